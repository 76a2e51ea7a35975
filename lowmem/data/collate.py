"""Turning rows into training batches: tokenize, cut to length, pad to the longest row of the batch."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

IGNORE_INDEX = -100  # targets the loss skips: padding (and the prompt, when training on responses only)
# Batch widths are rounded up to a multiple of this: a handful of distinct tensor shapes instead of one per
# length. With a new shape every step the CPU allocator's heap fragments and RSS creeps up (measured: +35%
# over 150 steps, flat when rounded to 32); GPU kernels and torch.compile also prefer few, aligned shapes.
PAD_TO_MULTIPLE_OF = 32


class TokenizingCollate:
    """Rows `{prompt, response}` → `{"input_ids", "targets"}` LongTensors of shape (B, T).

    Each row becomes `[bos] prompt [sep] response [eos]`, cut at the end to `max_seq_len + 1` tokens, then
    shifted: inputs are tokens 0..n-1 and targets tokens 1..n. Batches are padded to their longest row,
    not to `max_seq_len` (rounded up to a multiple of 32, at most `max_seq_len`): with short rows most of
    a fixed-length batch would be padding, and the model would spend its time on it. Packing rows into full sequences would waste nothing, but it lets
    attention cross from one row into the next and makes one row's tokens depend on its neighbours,
    which the prompt/response task does not want.

    Picklable (the tokenizer is), so it runs inside DataLoader workers.

    Args:
        tokenizer: a `lowmem.tokenizer.Tokenizer`.
        max_seq_len: the longest input the model takes.
        columns: the (prompt, response) column names.
        response_only: leave prompt tokens out of the loss.
    """

    def __init__(self, tokenizer: Any, max_seq_len: int, columns: Sequence[str] = ("prompt", "response"),
                 response_only: bool = False):
        self.tokenizer = tokenizer
        self.max_seq_len = int(max_seq_len)
        self.prompt_column, self.response_column = columns
        self.response_only = response_only

    def __call__(self, rows: list[dict[str, str]]) -> dict[str, torch.Tensor]:
        pairs = self.tokenizer.encode_pair_batch(
            [row[self.prompt_column] for row in rows], [row[self.response_column] for row in rows]
        )
        limit = self.max_seq_len + 1
        lengths = [min(len(ids), limit) - 1 for ids, _ in pairs]
        width = min(self.max_seq_len, -(-max(lengths) // PAD_TO_MULTIPLE_OF) * PAD_TO_MULTIPLE_OF)
        input_ids = np.full((len(rows), width), self.tokenizer.pad_id, dtype=np.int64)  # (B, T)
        targets = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)  # (B, T)
        for row, ((ids, response_start), length) in enumerate(zip(pairs, lengths)):
            ids = np.asarray(ids[: length + 1], dtype=np.int64)
            input_ids[row, :length] = ids[:-1]
            targets[row, :length] = ids[1:]
            if self.response_only:
                # Position j predicts token j + 1: the prompt and separator are predicted before the response.
                targets[row, : max(0, min(response_start - 1, length))] = IGNORE_INDEX
        return {"input_ids": torch.from_numpy(input_ids), "targets": torch.from_numpy(targets)}
