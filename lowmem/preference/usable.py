"""A preference file whose pairs carry no preference is refused before the run starts.

A pair whose two answers are the same is left out of its batch (`lowmem.preference.collate`). A file where every
pair is such would train its whole length on none: each step's gradient zero, while the optimizer still stepped
and checkpoints of nothing were saved. The sample the memory plan reads (a few rows from row groups spread over
the data) is checked first; a step that finds no pair on any rank is skipped by the optimizer (`train_step`).
"""

from __future__ import annotations

from lowmem.config import TrainConfig
from lowmem.config.columns import data_columns, is_preference
from lowmem.config.train_sources import training_paths
from lowmem.data.sources import build_row_group_index
from lowmem.data.sizing import sample_rows
from lowmem.errors import DataError


def check_usable_pairs(config: TrainConfig) -> None:
    """Refuse preference training whose sampled training pairs all have the same chosen and rejected answer."""
    if not is_preference(config):
        return
    columns = data_columns(config)
    for path in training_paths(config):
        rows = sample_rows(build_row_group_index(path, columns))
        if rows and all(chosen == rejected for _, chosen, rejected, *_ in rows):
            raise DataError(
                f"Every one of the {len(rows):,} pairs sampled from {path} has the same {config.chosen_column} "
                f"and {config.rejected_column} answer: they carry no preference, and DPO would train on none. "
                f"Check that --chosen_column and --rejected_column name two different columns of the preferred and "
                "the other answer (`lowmem convert` writes them from the common layouts); nothing was written.")
