"""Exported models: writing a self-contained model folder, and finding and loading one."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from lowmem.errors import ConfigError
from lowmem.model import GPT, GPTConfig
from lowmem.model.weights import load_weights, save_weights, unwrap
from lowmem.data.tokenizer import Tokenizer


def _write_model_folder(out_dir: Path, model_config: dict[str, Any], config: Any, tokenizer_dir: str,
                        write_weights: Callable[[Path], Any]) -> Path:
    """Weights, configs and tokenizer in one folder, written aside and renamed into place."""
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write_weights(partial / "model.safetensors")
    (partial / "model_config.json").write_text(json.dumps(model_config, indent=2))
    (partial / "train_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2, ensure_ascii=False))
    shutil.copy(Path(tokenizer_dir) / "tokenizer.model", partial / "tokenizer.model")
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.rename(out_dir)
    return out_dir


def export_model(model: GPT, config: Any, out_dir: Path, tokenizer_dir: str) -> Path:
    """Export the model as it is: weights (safetensors), the configs that rebuild it, and its tokenizer.

    `model` is a whole GPT (see `lowmem.distributed.strategy.model_for_eval`), plain or wrapped by torch.compile.
    """
    return _write_model_folder(out_dir, dataclasses.asdict(unwrap(model).config), config, tokenizer_dir,
                               lambda path: save_weights(model, path))


def export_checkpoint(checkpoint: Path, config: Any, out_dir: Path, tokenizer_dir: str) -> Path:
    """Export a checkpoint's model (for `generate` and `evaluate`) without loading it."""
    model_config = json.loads((checkpoint / "model_config.json").read_text())
    return _write_model_folder(out_dir, model_config, config, tokenizer_dir,
                               lambda path: shutil.copy(checkpoint / "model.safetensors", path))


def find_model_folder(output_dir: str | Path, checkpoint: str | None = None) -> Path:
    """The folder to load: `checkpoint` if given, else `<output_dir>/best`, else `<output_dir>/final`."""
    candidates = [Path(checkpoint)] if checkpoint else [Path(output_dir) / "best", Path(output_dir) / "final"]
    for folder in candidates:
        if (folder / "model.safetensors").is_file() and (folder / "model_config.json").is_file():
            return folder
    if checkpoint:
        raise ConfigError(f"No model in '{checkpoint}': pass a checkpoint-<step> folder, or a run's best/ or final/ "
                          "folder (they hold model.safetensors and model_config.json).")
    raise ConfigError(f"No trained model in '{output_dir}' (looked for best/ and final/). Train one first with "
                      "`python train_low_mem.py train`, or pass --checkpoint=PATH or --output_dir=RUN_FOLDER.")


def load_model_folder(folder: Path, tokenizer_dir: str | Path, device: torch.device) -> tuple[GPT, Tokenizer]:
    """The model of an exported folder or a checkpoint, in eval mode, and its tokenizer.

    The tokenizer exported with the model is used when the folder has one, else the one in `tokenizer_dir`.
    """
    model = GPT(GPTConfig(**json.loads((folder / "model_config.json").read_text())))
    load_weights(model, folder / "model.safetensors")
    model.to(device).eval()
    tokenizer = Tokenizer.load(folder if (folder / "tokenizer.model").is_file() else tokenizer_dir)
    return model, tokenizer
