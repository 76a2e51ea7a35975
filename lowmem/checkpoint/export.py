"""Exported models: writing a self-contained model folder, and finding and loading one."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Callable, Collection

import torch

from lowmem.adapters.files import ADAPTERS_FILE, base_name, is_adapter_checkpoint, saved_spec
from lowmem.adapters.lora import LoRASpec, adapter_spec
from lowmem.adapters.peft_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_peft_adapter
from lowmem.atomic_files import folder_built_aside
from lowmem.config import TrainConfig
from lowmem.config.sources import saved_config_record
from lowmem.errors import ConfigError
from lowmem.model import GPT, GPTConfig
from lowmem.checkpoint.model_files import ModelWeights, has_model_weights, write_model
from lowmem.model.weights import (MODEL_CONFIG_FILE, WEIGHTS_FILE, empty_model, load_model_config, save_model_config,
                                  unwrap_gpt)
from lowmem.tokenization.text_tokenizer import TextTokenizer, has_tokenizer, load_tokenizer, tokenizer_files
from lowmem.program import command_line

logger = logging.getLogger(__name__)

TRAIN_CONFIG_FILE = "train_config.json"  # the training settings the exported model was trained with


def _write_model_folder(out_dir: Path, model_config: GPTConfig, config: TrainConfig, tokenizer_dir: str,
                        write_weights: Callable[[Path], Any], given: Collection[str] | None = None,
                        adapters: tuple[LoRASpec, GPT | dict[str, torch.Tensor]] | None = None) -> Path:
    """Weights, configs and tokenizer in one folder, written aside and renamed into place. The training config
    records its preset and, when known, the fields the user `given` (`lowmem.config.sources.saved_config_values`).
    A model with `adapters` (their spec, and the model that holds them or their tensors) leaves them in peft's files
    too, written before `write_weights` (which may merge them into the model)."""
    values = dataclasses.asdict(config)
    if given is not None:
        values = {**values, **saved_config_record(config, given)}
    with folder_built_aside(out_dir) as folder:
        if adapters is not None:
            spec, held = adapters
            write_peft_adapter(folder, held, spec, model_config, base_name(Path(config.output_dir)))
        write_weights(folder / WEIGHTS_FILE)
        save_model_config(model_config, folder)
        (folder / TRAIN_CONFIG_FILE).write_text(json.dumps(values, indent=2, ensure_ascii=False))
        for path in tokenizer_files(tokenizer_dir, essential=True):  # the model's tokenizer beside it, whichever kind
            shutil.copy(path, folder / path.name)
    return out_dir


def export_model(model: GPT, config: TrainConfig, out_dir: Path, tokenizer_dir: str,
                 given: Collection[str] | None = None) -> Path:
    """Export the model as it is: weights (safetensors), the configs that rebuild it, and its tokenizer.

    `model` is a whole GPT (see `lowmem.distributed.strategy.model_for_eval`), plain or wrapped by torch.compile: a
    model sharded by FSDP2 is exported from its checkpoint instead (`export_checkpoint`).
    """
    plain = unwrap_gpt(model)
    spec = adapter_spec(plain)
    # A tensor at a time (the adapters merged in, and kept in peft's files beside): on a GPU only the tensor being
    # written is copied to the host.
    return _write_model_folder(out_dir, plain.config, config, tokenizer_dir, lambda path: write_model(plain, path),
                               given, adapters=None if spec is None else (spec, plain))


def export_checkpoint(checkpoint: Path, config: TrainConfig, out_dir: Path, tokenizer_dir: str,
                      given: Collection[str] | None = None) -> Path:
    """Export a checkpoint's model (for `generate` and `evaluate`) without loading it: its one weights file copied,
    or its shards (FSDP2), or the run's base with its adapters merged in, written into one file a tensor at a time
    (`ModelWeights`): the host never holds the model."""
    if not is_adapter_checkpoint(checkpoint) and (checkpoint / WEIGHTS_FILE).is_file():
        return _write_model_folder(out_dir, load_model_config(checkpoint), config, tokenizer_dir,
                                   lambda path: shutil.copy(checkpoint / WEIGHTS_FILE, path), given)
    with ModelWeights(checkpoint) as weights:
        adapters = (weights.spec, weights.adapters) if weights.spec is not None else None
        return _write_model_folder(out_dir, weights.config, config, tokenizer_dir, weights.write, given,
                                   adapters=adapters)


def trained_config(folder: Path) -> dict[str, Any] | None:
    """The config the model in `folder` (best/, final/ or a checkpoint) was trained with: its train_config.json,
    else its checkpoint's trainer state's; None when neither reads."""
    from lowmem.checkpoint.contents import TRAINER_STATE_FILE  # it loads the strategies: only for this command

    for path in (folder / TRAIN_CONFIG_FILE, folder / TRAINER_STATE_FILE):
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            saved = data.get("config", data) if path.name == TRAINER_STATE_FILE else data
            return saved if isinstance(saved, dict) else {}
    return None


def _is_model_folder(folder: Path) -> bool:
    """The folder holds a model: its weights, its shards, or the adapters of a checkpoint (whose run's base
    `checked_base` checks when it is loaded, with its own message)."""
    return has_model_weights(folder) and (folder / MODEL_CONFIG_FILE).is_file()


def best_saved_checkpoint(run_dir: Path) -> tuple[Path, str] | None:
    """The checkpoint to use when a run has no best/ or final/ (it stopped before its end), with the reason: the
    best-scored complete checkpoint that checkpoints.json ranks, else the newest complete one; None when none.
    A checkpoint is complete by its own marker and its files' sizes, whatever the manifest lists."""
    from lowmem.checkpoint.listing import CheckpointFolders
    from lowmem.checkpoint.manifest import read_manifest
    from lowmem.checkpoint.marker import verify_checkpoint

    def intact(found: Any) -> bool:
        return _is_model_folder(found.path) and not verify_checkpoint(
            found.path, check_hashes=False, marker=found.marker, has_marker_file=found.has_marker_file)

    folders = CheckpointFolders(run_dir)
    complete = {found.path.name: found for found in folders.complete()}
    manifest = read_manifest(run_dir)
    scores = {entry.get("name"): entry.get("score") for entry in manifest.get("checkpoints", [])
              if isinstance(entry, dict)}
    for name in manifest.get("best", []):
        if name in complete and intact(complete[name]):
            score = scores.get(name)
            shown = f"{score:.4f}" if isinstance(score, (int, float)) else "unscored"
            return complete[name].path, f"the best-scored complete checkpoint so far ({manifest.get('metric')} {shown})"
    newest = folders.latest_complete(verify_hashes=False)  # the checkpoint a resume would continue from
    return None if newest is None else (newest, "the newest complete checkpoint (none has a score)")


def find_model_folder(output_dir: str | Path, checkpoint: str | None = None) -> Path:
    """The folder to load: `checkpoint` if given, else `<output_dir>/best`, else `<output_dir>/final`, else (a run
    stopped before its end) the best-scored complete checkpoint (`best_saved_checkpoint`), which is logged."""
    candidates = [Path(checkpoint)] if checkpoint else [Path(output_dir) / "best", Path(output_dir) / "final"]
    for folder in candidates:
        if _is_model_folder(folder):
            return folder
    if checkpoint:
        raise ConfigError(f"No model in '{checkpoint}': pass a checkpoint-<step> folder, or a run's best/ or final/ "
                          f"folder (they hold {WEIGHTS_FILE} and {MODEL_CONFIG_FILE}).")
    saved = best_saved_checkpoint(Path(output_dir))
    if saved is not None:
        folder, why = saved
        logger.info("No best/ or final/ in %s (the run stopped before its end): using %s, %s; --checkpoint=PATH "
                    "chooses another.", output_dir, folder.name, why)
        return folder
    variants = _other_variants(Path(output_dir))
    hint = (f" Runs on the same data from the same model: {', '.join(variants)} (give the flags that trained it, such "
            "as --lora_rank or --objective, or its --output_dir).") if variants else ""
    raise ConfigError(f"No trained model in '{output_dir}' (looked for best/, final/ and complete checkpoints). "
                      f"Train one first with `{command_line('train')}`, or pass --checkpoint=PATH or "
                      f"--output_dir=RUN_FOLDER.{hint}")


def _other_variants(output_dir: Path) -> list[str]:
    """The folders beside `output_dir`, a default `<data>_from_<model>` run folder, of other variants of that run
    (`<data>_<variant>_from_<model>`: `lowmem.cli.run_folder.run_variant`), or of none where it names a variant."""
    if "_from_" not in output_dir.name or not output_dir.parent.is_dir():
        return []
    data, source = output_dir.name.split("_from_", 1)
    suffix = f"_from_{source}"

    def related(stem: str) -> bool:  # one name is the other's with a variant after it
        return stem.startswith(f"{data}_") or data.startswith(f"{stem}_")

    return sorted(str(path) for path in output_dir.parent.iterdir()
                  if path.is_dir() and path != output_dir and path.name.endswith(suffix)
                  and related(path.name.removesuffix(suffix)))


def check_has_adapters(folder: Path) -> None:
    """Refuse a model folder that holds no adapters (`--adapter_dir` of a run trained without `--lora_rank`)."""
    if not ((folder / ADAPTER_CONFIG).is_file() or is_adapter_checkpoint(folder)):
        raise ConfigError(f"The model in {folder} was trained without adapters (--lora_rank), so there are none to "
                          "export: leave --adapter_dir out to export the model itself.")


def export_adapter(folder: Path, out: Path) -> Path:
    """Write the adapters of a model folder (best/, final/ or a checkpoint of a run that trained adapters) to the new
    folder `out` in peft's files, for `PeftModel.from_pretrained(base, out)`."""
    from safetensors.torch import load_file

    check_has_adapters(folder)
    files = [folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS] if (folder / ADAPTER_CONFIG).is_file() else []
    with folder_built_aside(out) as staged:
        for path in files:
            shutil.copy(path, staged / path.name)
        if not files:  # a checkpoint: its adapters file, in peft's names
            adapters = folder / ADAPTERS_FILE
            write_peft_adapter(staged, load_file(str(adapters)), saved_spec(adapters), load_model_config(folder),
                               base_name(folder.parent))
    return out


def tokenizer_folder(folder: Path, tokenizer_dir: str | Path) -> Path:
    """Where a model folder's tokenizer is: the one exported with the model when it has one, else `tokenizer_dir`."""
    return folder if has_tokenizer(folder) else Path(tokenizer_dir)


def load_model_folder(folder: Path, tokenizer_dir: str | Path, device: torch.device) -> tuple[GPT, TextTokenizer]:
    """The model of an exported folder or a checkpoint (its one file, its shards, or its adapters merged into the run's
    base), in eval mode, and its tokenizer. The model is filled tensor by tensor: no second copy of it is made.

    The tokenizer exported with the model is used when the folder has one, else the one in `tokenizer_dir`.
    """
    with ModelWeights(folder) as weights:
        model = empty_model(weights.config)
        weights.load_into(model)
    model.to(device).eval()
    tokenizer = load_tokenizer(tokenizer_folder(folder, tokenizer_dir))
    return model, tokenizer
