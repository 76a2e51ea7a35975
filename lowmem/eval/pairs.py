"""`evaluate` of a model trained by DPO on a test file of preference pairs: the run's objective read from the model.

A DPO model scored on a file with the chosen and rejected columns is scored as DPO (with its beta and columns)
without --objective being given again; its held-out rewards come from `lowmem.preference.held_out`, which the
command is handed (`evaluate_command`'s `pair_figures`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from lowmem.config import TrainConfig
from lowmem.data.sources import build_row_group_index
from lowmem.errors import DataError

logger = logging.getLogger(__name__)

# What a DPO model's trained config gives a command that scores it, where the command leaves them at their defaults.
PREFERENCE_FIELDS = ("objective", "dpo_beta", "chosen_column", "rejected_column", "dpo_reference")


def as_trained_for_pairs(config: TrainConfig, trained: dict[str, Any], folder: Path) -> TrainConfig:
    """`config` scoring preference pairs as the model was trained (its beta and columns, where left at their
    defaults) when it was trained by DPO and the test file holds its pairs' columns; a file of prompts and responses
    is scored as the language model it also is."""
    if trained.get("objective") != "dpo":
        return config
    defaults = TrainConfig()
    taken = {name: trained[name] for name in PREFERENCE_FIELDS
             if name in trained and getattr(config, name) == getattr(defaults, name)}
    pairs = dataclasses.replace(config, **taken)
    if config.objective != "dpo":
        try:
            build_row_group_index(config.test_file, (pairs.prompt_column, pairs.chosen_column, pairs.rejected_column))
        except DataError:
            return config
        logger.info("As %s was trained: scored as DPO (beta %g) on the pairs of %s.", folder, pairs.dpo_beta,
                    config.test_file)
    return pairs
