"""The run folder of data that is not the demo's: `model_save/<data name>` instead of the preset's own folder
(the demo's run, or the large preset's `model_save/pretrain_large`), unless that folder already holds a run on the
same data; and of a run started from a model: `model_save/<data name><variant>_from_<model name>`, the variant telling
apart what trains on the same data from the same model (`_lora16`, `_dpo`, `_dpo_precomputed`, `_dpo_lora16`). Every
command applies the rule (`lowmem.cli.common.resolve_config`), so `generate`, `evaluate`, `export` and `memlog` given
`train`'s flags find the run it wrote; a run named before the variant was part of the name is found where it is."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Collection, TypeVar

from lowmem.config.demo import DEMO_OUTPUT_DIR, data_name, uses_demo_data
from lowmem.config.overrides import class_defaults
from lowmem.config.train_config import TrainConfig
from lowmem.config.train_sources import training_paths
from lowmem.tokenization.identity import data_file_key

logger = logging.getLogger(__name__)

ConfigT = TypeVar("ConfigT", bound=TrainConfig)


def _same_file(saved: Any, train_file: str) -> bool:
    """Whether a saved --train_file names `train_file` (the same remote name, or the same local file)."""
    return isinstance(saved, str) and data_file_key(saved) == data_file_key(train_file)


def _earlier_run_on(run_dir: str, train_file: str) -> bool:
    """Whether the preset's run folder holds checkpoints of a run on `train_file` (made before data of one's own
    got a folder of its own): that run goes on there."""
    from lowmem.train.startup import read_saved_run  # loads torch: only for the commands that read data

    saved = read_saved_run(run_dir).config if Path(run_dir).is_dir() else None
    return saved is not None and _same_file(saved.get("train_file"), train_file)


def run_variant(config: TrainConfig) -> str:
    """What tells apart runs on the same data from the same model, for their folder's name: `_dpo` for preference
    training (`_dpo_precomputed` with precomputed reference values), `_lora<rank>` for adapters; "" for a full
    fine-tune by the next token."""
    parts = []
    if config.objective == "dpo":
        parts.append("dpo_precomputed" if config.dpo_reference == "precomputed" else "dpo")
    if config.lora_rank:
        parts.append(f"lora{config.lora_rank}")
    return "".join(f"_{part}" for part in parts)


def _folder_of(name: str, preset_output_dir: str) -> str:
    """`model_save/<name>`, with the preset's folder name after it for a preset other than TrainConfig's."""
    return f"model_save/{name}" if preset_output_dir == DEMO_OUTPUT_DIR else \
        f"model_save/{name}_{Path(preset_output_dir).name}"


def _same_variant(saved: dict[str, Any], config: TrainConfig) -> bool:
    """Whether a saved run's config is of the variant `config` asks for (see `run_variant`)."""
    as_saved = dataclasses.replace(config, objective=saved.get("objective", "lm"),
                                   dpo_reference=saved.get("dpo_reference", "auto"),
                                   lora_rank=int(saved.get("lora_rank") or 0))
    return run_variant(as_saved) == run_variant(config)


def _named_before_variants(config: TrainConfig, folder: str, earlier: str) -> bool:
    """Whether `earlier`, the folder a run of this variant was given before the variant was part of the name, holds
    checkpoints of such a run, and `folder` does not exist: that run goes on (or is read) where it is."""
    if folder == earlier or Path(folder).exists() or not Path(earlier).is_dir():
        return False
    from lowmem.train.startup import read_saved_run  # loads torch: only for the commands that read data

    saved = read_saved_run(earlier).config
    return saved is not None and _same_variant(saved, config)


def own_run_folder(config: TrainConfig, preset_output_dir: str) -> str:
    """The run folder of data of one's own: `model_save/<data name>` with TrainConfig, and the preset's folder name
    after it with another preset (`model_save/<data name>_pretrain_large`), so that the two never share one. A run
    started from a model adds its variant and where it came from: `model_save/<data name><variant>_from_<model
    name>` (the demo's data named "demo"; `run_variant`), or the folder without the variant where a run of this
    variant was saved before the variant was part of the name."""
    name = "demo" if uses_demo_data(config) else data_name(training_paths(config)[0])
    if not config.init_from:
        return _folder_of(name, preset_output_dir)
    from lowmem.source.locate import source_name  # loads torch: only for a run started from a model

    source = source_name(config.init_from)
    folder = _folder_of(f"{name}{run_variant(config)}_from_{source}", preset_output_dir)
    earlier = _folder_of(f"{name}_from_{source}", preset_output_dir)
    if _named_before_variants(config, folder, earlier):
        logger.info("%s holds an earlier run of this variant: it goes on there.", earlier)
        return earlier
    return folder


def with_run_folders(config: ConfigT, given: Collection[str]) -> ConfigT:
    """`config` with folders of its own for data that is not the demo's: output_dir and tokenizer_dir left at the
    preset's (`model_save/demo` and `model_save/tokenizer`; the large preset's `model_save/pretrain_large` and
    `model_save/tokenizer_large`) become `own_run_folder` and `<output_dir>/tokenizer`, said in one line, so that
    a run on other data never resumes, overwrites or shares the tokenizer of the demo's run. Unchanged when the
    preset's folder already holds a run on the same file."""
    defaults = class_defaults(config)
    preset_output_dir = defaults["output_dir"]
    if "output_dir" in given or config.output_dir != preset_output_dir or \
            (uses_demo_data(config) and not config.init_from):
        return config
    if not config.train_sources and not config.init_from and _earlier_run_on(preset_output_dir, config.train_file):
        logger.info("%s holds an earlier run on %s: it goes on there.", preset_output_dir, config.train_file)
        return config
    train_data = config.train_sources or config.train_file
    changes: dict[str, Any] = {"output_dir": own_run_folder(config, preset_output_dir)}
    if "tokenizer_dir" not in given and config.tokenizer_dir == defaults["tokenizer_dir"]:
        changes["tokenizer_dir"] = f"{changes['output_dir']}/tokenizer"
    origin = f" started from {config.init_from}" if config.init_from else ""
    logger.info("Run folder for %s%s: %s (--output_dir=PATH chooses another).", train_data, origin,
                ", ".join(f"{name} {value}" for name, value in changes.items()))
    return dataclasses.replace(config, **changes)
