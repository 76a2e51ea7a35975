"""The held-out DPO loss, rewards/accuracy and rewards/margin of a trained model on a test file of pairs, as
validation computes them, against the run's reference: what `evaluate` reports for a DPO model.

The reference is the model the run started from: the run's own copy of it in `<run>/base` (adapters keep their
base there, and a frozen-copy reference its copy), else the source its `started_from.json` names while it exists,
else the test file's precomputed `reference_chosen` and `reference_rejected` columns (`lowmem dpo_reference`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from lowmem.adapters.files import BASE_DIR, checked_base
from lowmem.config import TrainConfig
from lowmem.config.columns import REFERENCE_COLUMNS
from lowmem.data.sources import build_row_group_index
from lowmem.errors import DataError
from lowmem.model import GPT
from lowmem.model.weights import empty_model
from lowmem.preference.evaluation import evaluate_preferences
from lowmem.preference.reference import COPY, PRECOMPUTED, Reference
from lowmem.source.load import fill_model, weight_plan
from lowmem.source.locate import find_source
from lowmem.source.settle import SOURCE_RECORD_NAME

logger = logging.getLogger(__name__)


def preference_figures(config: TrainConfig, model: GPT, tokenizer: Any, accelerator: Accelerator,
                       run_dir: Path) -> dict[str, Any]:
    """The held-out DPO figures of `model` on `config.test_file` (the keys of the summary), or a note of why none
    could be computed (no reference found)."""
    reference = _reference(config, model, accelerator, run_dir)
    if reference is None:
        logger.warning("No reference to measure the rewards against: %s and the source named in %s are gone, and %s "
                       "has no precomputed reference columns. The loss of the chosen answers only.",
                       run_dir / BASE_DIR, run_dir / SOURCE_RECORD_NAME, config.test_file)
        return {"preference": None}
    scoring = dataclasses.replace(config, max_seq_len=model.config.max_seq_len, eval_batches=0,
                                  dpo_reference=reference.mode)
    result = evaluate_preferences(model, reference, tokenizer, config.test_file, accelerator, scoring)
    figures = dict(result.preference or {})
    return {"preference": {"dpo_loss": result.loss, "pairs": result.loss_rows, "reference": reference.describe(),
                           **figures}}


def _reference(config: TrainConfig, model: GPT, accelerator: Accelerator, run_dir: Path) -> Reference | None:
    """The run's starting model as a frozen copy (its copy in the run folder, else its source), else the test
    file's precomputed values; None when there is neither."""
    folder = _starting_model(run_dir)
    if folder is None:
        try:
            build_row_group_index(config.test_file, (config.prompt_column, config.chosen_column,
                                                     config.rejected_column, *REFERENCE_COLUMNS))
        except DataError:
            return None
        return Reference(PRECOMPUTED, model, accelerator)
    source = find_source(str(folder))
    copy = empty_model(model.config, next(model.parameters()).device)
    fill_model(copy, source, weight_plan(source, model.config))
    copy.use_memory_savers(model.loss_chunk_tokens, False)
    copy.eval().requires_grad_(False)
    return Reference(COPY, model, accelerator, copy)


def _starting_model(run_dir: Path) -> Path | None:
    """The folder of the model the run started from: `<run>/base` (hash checked), else its recorded source while
    it exists; None without either."""
    if (run_dir / BASE_DIR).is_dir():
        return checked_base(run_dir, for_reference=True)
    record = run_dir / SOURCE_RECORD_NAME
    if record.is_file():
        folder = Path(json.loads(record.read_text(encoding="utf-8")).get("folder", ""))
        if folder.is_dir():
            return folder
    return None
