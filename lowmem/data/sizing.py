"""How large the training batches will be, from a small sample of the rows, before training starts.

The memory plan needs the largest micro-batch a run will see, in positions (sequences x width, padding
included): that sets the activations. Packed rows make it a matter of the data, so a sample of rows from a
few row groups spread over the files is tokenized and grouped into micro-batches exactly as
`TokenizingCollate` would (same packing, same width rounding), and the largest is taken. Without a
tokenizer yet, a row's tokens are counted as its characters plus the layout's specials: SentencePiece pieces
hold one character or more, so that is an upper bound. Rows are prompt/response pairs or one column of text,
whichever columns the index holds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from lowmem.data.collate import PAD_TO_MULTIPLE_OF, FixedShapes, encode_rows, pack_rows
from lowmem.data.reader import open_parquet
from lowmem.data.sources import RowGroupIndex
from lowmem.memory.cleanup import release_arrow_memory

SAMPLE_ROW_GROUPS = 8  # spread evenly over the data
SAMPLE_ROWS_PER_GROUP = 1024
SAMPLE_BATCHES = 256
# Micro-batches drawn to choose the fixed shapes: enough to see the 1-in-1000 ones.
SHAPE_SAMPLE_BATCHES = 2048
# The share of the expected positions a third fixed shape must save to be taken (it costs one more compiled graph):
# on the demo data it saves 7% at 32 rows (16.3 → 15.1 sequences per micro-batch) and 6% at 64.
THIRD_SHAPE_GAIN = 0.02
# Specials around a row's texts: [bos] text [eos] for one column, [bos] prompt [sep] response [eos] for two.
_LAYOUT_SPECIALS = {1: 2, 2: 3}


@dataclass(frozen=True)
class BatchSizes:
    """Row lengths (tokens, or characters as an upper bound) of a sample of the training rows."""

    lengths: tuple[int, ...]
    max_seq_len: int
    pack: bool
    estimated: bool  # counted from characters (no tokenizer)
    seed: int = 0

    def largest_positions(self, rows: int, batches: int = SAMPLE_BATCHES) -> int:
        """The largest micro-batch of `rows` rows among `batches` drawn from the sample, in positions."""
        if not self.lengths:
            return rows * self.max_seq_len
        generator = random.Random(self.seed)
        largest = 0
        for _ in range(batches):
            lengths = [min(generator.choice(self.lengths), self.max_seq_len + 1) - 1 for _ in range(rows)]
            largest = max(largest, micro_batch_positions(lengths, self.max_seq_len, self.pack))
        return largest

    def fixed_shapes(self, rows: int, batches: int = SHAPE_SAMPLE_BATCHES) -> FixedShapes:
        """The shapes of micro-batches of `rows` rows (`FixedShapes`), chosen on `batches` drawn from the sample.

        The smaller shapes' sequences are those that make the expected positions per micro-batch smallest: each
        micro-batch takes the smallest shape that holds it, the last one a sequence per row. A few more sequences
        than most micro-batches need wastes a little on every one; a few fewer sends many to the next shape. A
        third shape, between the usual one and a sequence per row, is taken when it saves `THIRD_SHAPE_GAIN` of the
        expected positions (one more compiled graph). Without packing every row is a sequence: one shape.
        """
        if not self.pack or not self.lengths:
            return FixedShapes(rows, rows, self.max_seq_len)
        generator = random.Random(self.seed)
        needed = np.array([len(pack_rows([min(generator.choice(self.lengths), self.max_seq_len + 1) - 1
                                          for _ in range(rows)], self.max_seq_len)) for _ in range(batches)])
        candidates = range(int(needed.min()), rows + 1)

        def expected(smallest: int, more: int) -> float:
            """Expected sequences per micro-batch with shapes of `smallest`, `more` and `rows` sequences."""
            return float(np.mean(np.where(needed <= smallest, smallest, np.where(needed <= more, more, rows))))

        # On a tie, the larger shapes (fewer micro-batches in the next one).
        two = min(candidates, key=lambda smallest: (expected(smallest, smallest), -smallest))
        three = min(((smallest, more) for smallest in candidates for more in candidates if smallest < more < rows),
                    key=lambda pair: (expected(*pair), -pair[0], -pair[1]), default=None)
        if three is not None and expected(*three) <= (1 - THIRD_SHAPE_GAIN) * expected(two, two):
            return FixedShapes(three[0], rows, self.max_seq_len, more=three[1])
        return FixedShapes(two, rows, self.max_seq_len)

    @property
    def mean_row_tokens(self) -> float:
        return float(np.mean(self.lengths)) if self.lengths else float(self.max_seq_len)


def micro_batch_positions(lengths: Sequence[int], max_seq_len: int, pack: bool) -> int:
    """Sequences x width of the batch `TokenizingCollate` makes of rows with these input lengths."""
    bins = pack_rows(lengths, max_seq_len) if pack else [[row] for row in range(len(lengths))]
    filled = max(sum(lengths[row] for row in rows_in_bin) for rows_in_bin in bins)
    width = min(max_seq_len, -(-filled // PAD_TO_MULTIPLE_OF) * PAD_TO_MULTIPLE_OF)
    return len(bins) * width


def sample_rows(index: RowGroupIndex) -> list[tuple[str, ...]]:
    """The values of the index's columns ((prompt, response), or (text,)) of up to SAMPLE_ROWS_PER_GROUP rows from
    each of a few row groups spread over the data."""
    picks = np.unique(np.linspace(0, index.num_row_groups - 1, num=min(SAMPLE_ROW_GROUPS, index.num_row_groups))
                      .round().astype(int))
    rows: list[tuple[str, ...]] = []
    try:
        for group in picks:
            file_id = int(index.file_id[group])
            file = index.files[file_id]
            handle = open_parquet(file.path, index.metadata[file_id], file.filesystem)
            try:
                batch = next(handle.iter_batches(batch_size=SAMPLE_ROWS_PER_GROUP, columns=list(index.columns),
                                                 row_groups=[int(index.group_in_file[group])]), None)
            finally:
                handle.close()
            if batch is None:
                continue
            columns = [batch.column(name).to_pylist() for name in index.columns]
            rows.extend(tuple(value or "" for value in row) for row in zip(*columns))
    except (pa.ArrowException, OSError, UnicodeDecodeError):
        return rows  # the stream reports unreadable data with its own message; the plan makes do with less
    finally:
        release_arrow_memory()
    return rows


def sample_batch_sizes(index: RowGroupIndex, max_seq_len: int, pack: bool, tokenizer: Any | None = None,
                       seed: int = 0) -> BatchSizes:
    """Row lengths of a sample of the indexed rows, tokenized (or counted from characters without a tokenizer)."""
    rows = sample_rows(index)
    if tokenizer is not None and rows:
        encoded = encode_rows(tokenizer, [list(values) for values in zip(*rows)])
        lengths = tuple(len(ids) for ids, _ in encoded)
    else:
        lengths = tuple(_estimated_length(row) for row in rows)
    return BatchSizes(lengths, max_seq_len, pack, estimated=tokenizer is None, seed=seed)


def _estimated_length(row: tuple[str, ...]) -> int:
    """A row's tokens counted from its characters (an upper bound): a preference row's longer answer with its
    prompt."""
    if len(row) >= 3:
        return len(row[0]) + max(len(row[1]), len(row[2])) + _LAYOUT_SPECIALS[2]
    return sum(len(value) for value in row) + _LAYOUT_SPECIALS[len(row)]


def data_pipeline_bytes(index: RowGroupIndex, groups_at_once: int, buffer_rows: int) -> int:
    """What one reader holds: `groups_at_once` of the largest row groups decoded, and the shuffle buffer's rows
    as Python strings (about twice their UTF-8 bytes with the objects around them)."""
    largest = int(index.uncompressed_bytes.max()) if index.num_row_groups else 0
    per_row = float(index.uncompressed_bytes.sum()) / max(index.num_rows, 1)
    return int(min(groups_at_once, index.num_row_groups) * largest * 1.5 + 2 * buffer_rows * per_row) + 8 * 2**20
