"""Turning rows into training batches: tokenize, cut to length, then pack or pad.

Packing puts several rows of a batch side by side in one sequence of `max_seq_len` tokens, with segment
ids that keep attention and positions inside each row (`GPT.forward(segment_ids=...)`), so each row is
computed exactly as if it were alone. On the demo data padding to the longest row wastes about half of
every batch (rows of 48-164 tokens in a width of 192); packing fills about 90% of it.

On a GPU the batches also take fixed shapes (`FixedShapes`): a compiled step meets two or three tensor shapes in
the whole run instead of a new one every few steps (each new shape is a recompile, or slower dynamic kernels,
and rules out CUDA graphs). The extra sequences and positions are padding that no real position attends to and
the loss never counts, so the rows and the losses stay what they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from lowmem.data.sources import DEFAULT_COLUMNS
from lowmem.model.loss import IGNORE_INDEX  # targets the loss skips: padding, and the prompt with response_only

# Batch widths are rounded up to a multiple of this: a handful of distinct tensor shapes instead of one per
# length. With a new shape every step the CPU allocator's heap fragments and RSS creeps up (measured: +35%
# over 150 steps, flat when rounded to 32); GPU kernels and torch.compile also prefer few, aligned shapes.
PAD_TO_MULTIPLE_OF = 32


@dataclass(frozen=True)
class FixedShapes:
    """The shapes every micro-batch takes: (`sequences`, `width`) for the usual micro-batch, (`more`, `width`) for
    one that needs a few more sequences (when the sample makes it worth a third shape), and (`rows`, `width`) for
    one whose rows need more still (at most one sequence per row, so it always fits). A micro-batch takes the
    smallest that holds it.

    `width` is `max_seq_len`; `sequences` and `more` come from a sample of the training rows (`lowmem.data.sizing`),
    so that nearly every micro-batch takes one of the two smaller shapes: a jump straight from the usual shape to
    one sequence per row would be two to three times its positions. Without packing every row is a sequence of its
    own and the shapes are one: (`rows`, `width`).
    """

    sequences: int
    rows: int
    width: int
    more: int = 0  # 0: no third shape

    @property
    def sizes(self) -> list[int]:
        """The sequences of each shape, smallest first."""
        return sorted({self.sequences, self.more or self.sequences, self.rows})

    def sequences_for(self, needed: int) -> int:
        """The sequences of the smallest shape that holds `needed` sequences."""
        if needed > self.rows:
            raise ValueError(f"a micro-batch needs {needed} sequences, more than the {self.rows} rows it may hold")
        return next(size for size in self.sizes if needed <= size)

    @staticmethod
    def larger_positions(rows: int, width: int) -> int:
        """The positions of the larger shape of micro-batches of `rows` rows: a sequence of `width` per row, whatever
        the usual shape turns out to be (the memory plan needs it before the rows are sampled)."""
        return rows * width

    def padding_batches(self, pad_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, targets) of a micro-batch of padding in each shape, smaller first: what compiles a model's
        graphs before training, learning nothing (no target counts, so the loss and every gradient are 0)."""
        batches = []
        for sequences in self.sizes:
            input_ids = torch.full((sequences, self.width), pad_id, dtype=torch.long)  # (B, T)
            batches.append((input_ids, torch.full_like(input_ids, IGNORE_INDEX)))
        return batches

    def describe(self) -> str:
        sizes = self.sizes
        if len(sizes) == 1:
            return f"{self.rows} x {self.width}"
        smaller = ", ".join(f"{size} x {self.width}" for size in sizes[:-1])
        return f"{smaller}, or {self.rows} x {self.width} for a micro-batch that needs more"


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group row indices into bins whose lengths sum to at most `capacity` (first fit, longest rows first).

    Deterministic: ties keep the rows' order, and each bin lists its rows in their batch order. Every row
    fits (rows are cut to `capacity` before packing).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for index in order:
        for b, free in enumerate(room):
            if lengths[index] <= free:
                bins[b].append(index)
                room[b] -= lengths[index]
                break
        else:
            bins.append([index])
            room.append(capacity - lengths[index])
    return [sorted(rows) for rows in bins]


def encode_rows(tokenizer: Any, values: Sequence[Sequence[str]]) -> list[tuple[list[int], int]]:
    """The training layout of each row and where its counted targets start, from its columns' values (one list
    per column): `[bos] text [eos]` for one column of text (every token counted), `[bos] prompt [sep] response
    [eos]` for prompt/response pairs (the response counted when the loss leaves the prompt out). Preference rows
    (prompt, chosen, rejected, and perhaps the reference's values) give the longer of their two answers' layouts:
    what sizes a batch of them (`lowmem.preference.collate` makes two unpacked sequences of each)."""
    if len(values) == 1:
        return tokenizer.encode_text_batch(values[0])
    if len(values) >= 3:
        prompts, chosen, rejected = values[:3]
        pairs = tokenizer.encode_pair_batch(list(prompts) * 2, [*chosen, *rejected])
        count = len(prompts)
        return [max(pairs[row], pairs[count + row], key=lambda layout: len(layout[0])) for row in range(count)]
    prompts, responses = values
    return tokenizer.encode_pair_batch(prompts, responses)


class TokenizingCollate:
    """Rows `{prompt, response}`, or `{text}`, → `{"input_ids", "targets"}` LongTensors of shape (B, T).

    Each row becomes `[bos] prompt [sep] response [eos]` (one text column: `[bos] text [eos]`), cut at the end
    to `max_seq_len + 1` tokens (the rows cut are counted: `cut_rows`, a scalar), then shifted: inputs are tokens
    0..n-1 and targets tokens 1..n. Widths are rounded up to a multiple of 32 (at most `max_seq_len`), or fixed
    with `fixed_shapes`.

    With `pack=False` each row is one sequence, padded to the longest row of the batch (not to
    `max_seq_len`: with short rows most of a fixed-length batch would be padding). With `pack=True` the
    rows are packed (`pack_rows`) into fewer sequences, and the batch also holds `segment_ids` (B', T):
    1, 2, ... for the rows of a sequence, 0 for padding. The model keeps attention and positions within a
    segment, so packing changes the speed, not the result; the batch still holds the same rows.

    Picklable (the tokenizer is), so it runs inside DataLoader workers.

    Args:
        tokenizer: a `lowmem.tokenization.sentencepiece_tokenizer.Tokenizer`.
        max_seq_len: the longest input the model takes.
        columns: the (prompt, response) column names, or the one text column's (`lowmem.config.columns`).
        response_only: leave prompt tokens out of the loss (one text column has none: every token counts).
        pack: pack rows into shared sequences (with `segment_ids`) instead of padding each row.
        fixed_shapes: give every batch one of these shapes (sequences added as padding); None shapes each
            batch to fit its rows.
    """

    def __init__(self, tokenizer: Any, max_seq_len: int, columns: Sequence[str] = DEFAULT_COLUMNS,
                 response_only: bool = False, pack: bool = False, fixed_shapes: FixedShapes | None = None):
        self.tokenizer = tokenizer
        self.max_seq_len = int(max_seq_len)
        self.columns = tuple(columns)
        if len(self.columns) not in (1, 2):
            raise ValueError(f"columns must be (prompt, response) or (text,), got {columns!r}")
        self.response_only = response_only
        self.pack = pack
        self.fixed_shapes = fixed_shapes

    def __call__(self, rows: list[dict[str, str]]) -> dict[str, torch.Tensor]:
        encoded = encode_rows(self.tokenizer, [[row[column] for row in rows] for column in self.columns])
        limit = self.max_seq_len + 1
        lengths = [min(len(ids), limit) - 1 for ids, _ in encoded]
        bins = pack_rows(lengths, self.max_seq_len) if self.pack else [[row] for row in range(len(rows))]
        if self.fixed_shapes is not None:
            sequences, width = self.fixed_shapes.sequences_for(len(bins)), self.fixed_shapes.width
        else:
            filled = max(sum(lengths[row] for row in rows_in_bin) for rows_in_bin in bins)
            sequences = len(bins)
            width = min(self.max_seq_len, -(-filled // PAD_TO_MULTIPLE_OF) * PAD_TO_MULTIPLE_OF)
        # Sequences past the bins, and positions past a bin's rows, are padding: segment 0, no target.
        input_ids = np.full((sequences, width), self.tokenizer.pad_id, dtype=np.int64)  # (B', T)
        targets = np.full((sequences, width), IGNORE_INDEX, dtype=np.int64)  # (B', T)
        segment_ids = np.zeros((sequences, width), dtype=np.int64)  # (B', T)
        for sequence, rows_in_bin in enumerate(bins):
            start = 0
            for segment, row in enumerate(rows_in_bin, start=1):
                ids, targets_start = encoded[row]
                length = lengths[row]
                row_ids = np.asarray(ids[: length + 1], dtype=np.int64)
                end = start + length
                input_ids[sequence, start:end] = row_ids[:-1]
                targets[sequence, start:end] = row_ids[1:]
                segment_ids[sequence, start:end] = segment
                if self.response_only:
                    # Position j predicts token j + 1: the prompt and separator are predicted before the response.
                    targets[sequence, start: start + max(0, min(targets_start - 1, length))] = IGNORE_INDEX
                start = end
        batch = {"input_ids": torch.from_numpy(input_ids), "targets": torch.from_numpy(targets),
                 "cut_rows": torch.tensor(sum(len(ids) > limit for ids, _ in encoded), dtype=torch.int64)}
        if self.pack:
            batch["segment_ids"] = torch.from_numpy(segment_ids)
        return batch
