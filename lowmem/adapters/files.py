"""A run that trains adapters, on disk: its frozen base once, the adapters at each checkpoint.

    <run>/base/model.safetensors    the base the adapters were trained on, under our names, float32: written
    <run>/base/model_config.json    once when the run starts (from the model of --init_from as loaded), so that
    <run>/base/base.json            a resume and every command need the run folder only; base.json holds the
                                    weights file's SHA-256 and where the base came from
    checkpoint-<step>/adapters.safetensors   the adapters under our names (`blocks.0.attn.qkv.lora_A.q_proj`),
                                    float32, with the LoRASpec in the file's metadata: no base weights

best/ and final/ hold the merged model instead (a plain model folder) and the adapters in peft's files
(`lowmem.adapters.peft_files`). A resume, `generate` and `evaluate` on a checkpoint read the base from
`<run>/base`, checked against its recorded hash: a base that changed since the run started is refused.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from lowmem.adapters.lora import ADAPTER_MARK, LoRASpec
from lowmem.errors import ConfigError
from lowmem.model import GPTConfig
from lowmem.model.weights import (MODEL_CONFIG_FILE, WEIGHTS_FILE, save_model_config,
                                  strip_prefixes, uncompiled, unwrap)

BASE_DIR = "base"
BASE_RECORD = "base.json"
ADAPTERS_FILE = "adapters.safetensors"
_SPEC_KEYS = ("rank", "alpha", "dropout", "targets")


def file_sha256(path: Path, block: int = 8 * 2**20) -> str:
    """The SHA-256 of a file's bytes, read a block at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def base_weights_file(run_dir: Path) -> Path:
    """Where `<run>/base/`'s weights go (the folder made); `finish_base` records them once written."""
    folder = run_dir / BASE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    return folder / WEIGHTS_FILE


def finish_base(run_dir: Path, config: GPTConfig, came_from: str, source_folder: Path) -> dict[str, Any]:
    """`<run>/base/`'s config and record (the weights file's hash, what and where the model was), once its weights are
    written (`base_weights_file`); returns the record."""
    folder = run_dir / BASE_DIR
    save_model_config(config, folder)
    record = {"sha256": file_sha256(folder / WEIGHTS_FILE), "came_from": came_from,
              "folder": str(source_folder.resolve())}
    (folder / BASE_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def checked_base(run_dir: Path, for_reference: bool = False) -> Path:
    """`<run>/base`, after checking that its weights are the ones the run started with (their recorded hash): the
    base of its adapters, or with `for_reference` the model a DPO run measures its policy against."""
    folder = run_dir / BASE_DIR
    record_path = folder / BASE_RECORD
    held = ("the model this DPO run started from, its reference" if for_reference else
            "the base model this run's adapters were trained on")
    if not (record_path.is_file() and (folder / WEIGHTS_FILE).is_file() and (folder / MODEL_CONFIG_FILE).is_file()):
        needs = ("the run has no reference to measure its policy against" if for_reference else
                 "the checkpoints' adapters have nothing to apply to")
        raise ConfigError(f"{folder} is missing or incomplete: it holds {held} (written when the run started), and "
                          f"without it {needs}. Restore it from a copy of the run folder, or start a new run.")
    record = json.loads(record_path.read_text(encoding="utf-8"))
    found = file_sha256(folder / WEIGHTS_FILE)
    if found != record.get("sha256"):
        meaning = ("the run's rewards would be measured against another model" if for_reference else
                   "the adapters were trained on the other one and would not mean the same")
        raise ConfigError(
            f"The model in {folder} changed since the run started (its {WEIGHTS_FILE} has SHA-256 {found[:12]}…, "
            f"the run recorded {str(record.get('sha256'))[:12]}…); it holds {held}, and {meaning}. Put the original "
            "back, or start a new run from the model in another --output_dir.")
    return folder


def is_adapter_checkpoint(folder: Path) -> bool:
    return (folder / ADAPTERS_FILE).is_file()


def save_adapters(state: dict[str, torch.Tensor], path: Path, spec: LoRASpec) -> None:
    """Write the adapter tensors of a model's state (its other tensors left out), with `spec` in the metadata."""
    from safetensors.torch import save_file

    adapters = {strip_prefixes(name): tensor.detach().float().contiguous().cpu() for name, tensor in state.items()
                if ADAPTER_MARK in name}
    metadata = {"format": "pt", **{f"lora_{key}": str(getattr(spec, key)) for key in _SPEC_KEYS}}
    save_file(adapters, str(path), metadata=metadata)


def saved_spec(path: Path) -> LoRASpec:
    """The LoRASpec an adapters file was written with."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata() or {}
    return LoRASpec(int(metadata["lora_rank"]), float(metadata["lora_alpha"]), float(metadata["lora_dropout"]),
                    metadata["lora_targets"])


def load_adapters(model: torch.nn.Module, path: Path) -> None:
    """Load an adapters file into `model` (plain, compiled or DDP-wrapped, with the same adapters): every adapter
    tensor of the model from the file, and nothing else of the file left over."""
    from safetensors.torch import load_file

    state = load_file(str(path))
    target = uncompiled(unwrap(model))
    missing, unexpected = target.load_state_dict(state, strict=False)
    missing = [name for name in missing if ADAPTER_MARK in name]
    if missing or unexpected:
        raise ConfigError(f"The adapters in {path} do not fit the model: missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]}. Resume with the --lora_rank and --lora_targets it was saved with.")


def base_name(run_dir: Path) -> str:
    """The base as peft's adapter_config.json names it: the folder the run started from (`write_base`)."""
    record = run_dir / BASE_DIR / BASE_RECORD
    try:
        return str(json.loads(record.read_text(encoding="utf-8")).get("folder", ""))
    except (OSError, ValueError):
        return ""
