"""Training configurations. Every field can be overridden on the command line: `--<field>=<value>`.

`TrainConfig` is the default: a small model that trains the demo data set on a 2-core laptop CPU in a few
minutes. It is every section of `lowmem.config.sections` at once, so `config.batch_size_per_gpu` and
`dataclasses.asdict(config)` see one flat set of fields. Presets are data: `PRESETS[name]` holds the fields
that differ from TrainConfig, and `TrainConfigPretrainLarge` is the class built from `PRESETS["large"]`
(3 GPUs on a host with 12 GB of RAM, `--use_large_config=True`). Values are checked up front by
`lowmem.config.validate_config`, which says what to change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lowmem.config.option import EXACT, MODEL_SHAPE, fields_with_role
from lowmem.config.sections import (DataConfig, EvalConfig, MemoryConfig, ModelConfig, OptimConfig, OutputConfig,
                                    PreferenceConfig, TokenizerConfig)


# The bases are listed last section first: dataclass fields are collected from the most basic class up,
# which keeps the order of the fields (and of `asdict`, `--help` and the checkpoints) data → eval.
@dataclass
class TrainConfig(EvalConfig, OutputConfig, OptimConfig, PreferenceConfig, ModelConfig, TokenizerConfig, MemoryConfig,
                  DataConfig):
    """The default configuration: the demo data set, a tiny GPT, CPU-friendly."""


PRESETS: dict[str, dict[str, Any]] = {
    # 3 GPUs of 20 GB on a host with 12 GB of RAM: a GPT-2-small-sized model, bf16, effective batch 192.
    "large": {
        "output_dir": "model_save/pretrain_large",
        "tokenizer_dir": "model_save/tokenizer_large",
        "vocab_size": 32000,
        "n_layer": 12,
        "n_head": 12,
        "n_embd": 768,
        "max_seq_len": 192,
        "batch_size_per_gpu": 32,
        "gradient_accumulation_steps": 2,  # 32 x 2 x 3 GPUs = 192 rows per optimizer step
        "dataloader_buffer_size": 5000,
        "epochs": 3,
        "learn_rate": 1e-4,
        "warmup_steps": 1024,
        "save_steps": 5000,
        "logging_steps": 100,
        "keep_latest_n_ckp": 5,
        "eval_batches": 200,
        "eval_bleu_samples": 256,
        "bf16": True,  # GPUs from Ampere on
    },
}


def preset_class(name: str, preset: str, doc: str) -> type[TrainConfig]:
    """A subclass of TrainConfig named `name` whose defaults are `PRESETS[preset]` (help, bounds and roles kept)."""
    base = {field.name: field for field in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(PRESETS[preset]) - set(base))
    if unknown:
        raise ValueError(f"Preset {preset!r} sets fields TrainConfig does not have: {unknown}")
    fields = [(key, base[key].type, dataclasses.field(default=value, metadata=base[key].metadata))
              for key, value in PRESETS[preset].items()]
    cls = dataclasses.make_dataclass(name, fields, bases=(TrainConfig,), namespace={"__doc__": doc})
    cls.__module__ = __name__  # string annotations resolve, and instances pickle, from this module
    return cls


TrainConfigPretrainLarge = preset_class(
    "TrainConfigPretrainLarge", "large",
    "3 GPUs of 20 GB on a host with 12 GB of RAM: a GPT-2-small-sized model, bf16, effective batch 192.")

# Changing one of these between a save and a resume changes what the rest of the run computes.
RESUME_EXACT_FIELDS = fields_with_role(TrainConfig, EXACT)
# Changing one of these makes the saved weights unusable.
MODEL_SHAPE_FIELDS = fields_with_role(TrainConfig, MODEL_SHAPE)
