"""Turning preference rows into batches: the chosen and the rejected answer of each prompt, as unpacked sequences.

Each row gives two sequences, `[bos] prompt [sep] answer [eos]`, with the answer's tokens the only ones counted
(the SFT layout of the same row): the P chosen answers first, then the P rejected ones in the same order, which is
the layout `lowmem.model.preference.dpo_loss` reads. Rows are not packed: each answer's log-probability is the sum
over its own sequence.

A pair whose two answers are the same tokens (within `max_seq_len`) gives no preference to learn: it is left out of
the batch and counted (`skipped_pairs`). A batch left with no pair holds one pair of padding of weight 0, so that
every process still runs the same forward and backward passes.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from lowmem.data.collate import PAD_TO_MULTIPLE_OF
from lowmem.errors import DataError
from lowmem.model.loss import IGNORE_INDEX


class PreferenceCollate:
    """Rows `{prompt, chosen, rejected}` (and the precomputed reference's two log-probabilities, when `columns`
    names them) → a batch of 2P sequences:

        input_ids, targets      (2P, T) LongTensors: the chosen answers' rows, then the rejected ones'
        pair_weights            (P,) float32: 1 for a pair, 0 for the padding pair of an empty batch
        skipped_pairs           () int64: the rows left out because both answers are the same
        cut_rows                () int64: the rows whose prompt and an answer were cut at max_seq_len
        reference_logps         (2P,) float32, with the reference columns: their values

    Widths are rounded up to a multiple of 32 (at most `max_seq_len`). Picklable, so it runs in DataLoader workers.

    Args:
        tokenizer: a `lowmem.tokenization.sentencepiece_tokenizer.Tokenizer` (or a transformers one's wrapper).
        max_seq_len: the longest input the model takes; longer sequences are cut at the end.
        columns: (prompt, chosen, rejected), or those and the two reference columns (`REFERENCE_COLUMNS`).
        skip_identical: leave out pairs whose answers are the same tokens (False keeps every row in its place:
            `lowmem dpo_reference` computes a value for each).
    """

    def __init__(self, tokenizer: Any, max_seq_len: int, columns: Sequence[str], skip_identical: bool = True) -> None:
        if len(columns) not in (3, 5):
            raise ValueError(f"columns must be (prompt, chosen, rejected) with or without the two reference columns, "
                             f"got {columns!r}")
        self.tokenizer, self.max_seq_len, self.columns = tokenizer, int(max_seq_len), tuple(columns)
        self.skip_identical = skip_identical

    def __call__(self, rows: list[dict[str, str]]) -> dict[str, torch.Tensor]:
        prompt, chosen, rejected = self.columns[:3]
        prompts = [row[prompt] for row in rows]
        encoded = self.tokenizer.encode_pair_batch(prompts + prompts, [row[chosen] for row in rows]
                                                   + [row[rejected] for row in rows])
        limit = self.max_seq_len + 1
        sequences = [(ids[:limit], start) for ids, start in encoded]
        pairs = len(rows)
        kept = [row for row in range(pairs)
                if not self.skip_identical or _answer(*sequences[row]) != _answer(*sequences[pairs + row])]
        order = kept + [pairs + row for row in kept]
        batch = self._sequences([sequences[index] for index in order], max(len(kept), 1))
        batch["pair_weights"] = torch.zeros(max(len(kept), 1), dtype=torch.float32)
        batch["pair_weights"][: len(kept)] = 1.0
        batch["skipped_pairs"] = torch.tensor(pairs - len(kept), dtype=torch.int64)
        batch["cut_rows"] = torch.tensor(sum(len(encoded[row][0]) > limit or len(encoded[pairs + row][0]) > limit
                                             for row in range(pairs)), dtype=torch.int64)
        if len(self.columns) == 5:  # the reference's log-probabilities, in the batch's order of sequences
            chosen_reference, rejected_reference = self.columns[3:]
            values = ([_log_prob(rows[row], chosen_reference) for row in kept]
                      + [_log_prob(rows[row], rejected_reference) for row in kept])
            batch["reference_logps"] = torch.tensor(values or [0.0, 0.0], dtype=torch.float32)
        return batch

    def _sequences(self, sequences: list[tuple[list[int], int]], pairs: int) -> dict[str, torch.Tensor]:
        """input_ids and targets (2·pairs, T) of the chosen sequences then the rejected ones; rows past
        `sequences` (the padding pair of an empty batch) are padding only."""
        lengths = [len(ids) - 1 for ids, _ in sequences]
        longest = max(lengths, default=1)
        width = min(self.max_seq_len, -(-max(longest, 1) // PAD_TO_MULTIPLE_OF) * PAD_TO_MULTIPLE_OF)
        count = 2 * pairs
        input_ids = np.full((count, width), self.tokenizer.pad_id, dtype=np.int64)  # (2P, T)
        targets = np.full((count, width), IGNORE_INDEX, dtype=np.int64)  # (2P, T)
        half = len(sequences) // 2
        for index, ((ids, start), length) in enumerate(zip(sequences, lengths)):
            # Chosen rows take the first half of the batch, rejected rows the second, each in the pairs' order.
            row = index if index < half else pairs + index - half
            row_ids = np.asarray(ids, dtype=np.int64)
            input_ids[row, :length] = row_ids[:-1]
            targets[row, :length] = row_ids[1:]
            # Position j predicts token j + 1: the prompt and separator are predicted before the answer.
            targets[row, : max(0, min(start - 1, length))] = IGNORE_INDEX
        return {"input_ids": torch.from_numpy(input_ids), "targets": torch.from_numpy(targets)}


def _answer(ids: list[int], start: int) -> tuple[int, ...]:
    """The answer's tokens of a sequence cut to its length: what its log-probability is summed over."""
    return tuple(ids[start:])


def _log_prob(row: dict[str, str], column: str) -> float:
    """A precomputed reference value, which `lowmem dpo_reference` writes as text."""
    try:
        value = float(row[column])
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise DataError(f"The column '{column}' holds {row[column][:40]!r}, not a finite log-probability: it is "
                        "written by `lowmem dpo_reference`. Run it again on the data, and train on what it writes.")
    return value
