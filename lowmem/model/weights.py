"""The model as files: its weights (safetensors, under plain parameter names whatever wraps the model)
and its sizes (model_config.json).

torch.compile prefixes state-dict keys with `_orig_mod.`, DDP and DeepSpeed with `module.`: weights are
always written under the plain model's names and load into a plain, compiled or wrapped model alike.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from lowmem.model.config import GPTConfig

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from lowmem.model.gpt import GPT

WEIGHTS_FILE = "model.safetensors"
MODEL_CONFIG_FILE = "model_config.json"  # the GPT's sizes, beside its weights: together they rebuild the model
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile, DDP / DataParallel / DeepSpeedEngine

def loaded_dtensor_type() -> type[DTensor] | None:
    """DTensor's class once its module is loaded, else None (then no tensor can be one: FSDP2 loads it).

    Importing torch.distributed.tensor costs about a second of every command's start-up (it brings sympy): only
    a run that shards pays it.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This process's part of a tensor and the global index of its first row: the whole tensor (row 0), or for a
    DTensor sharded by rows (FSDP2) the local shard (rank r holds rows r x ceil(n / world) onward, as torch.chunk
    splits), or for a replicated one the whole of its local copy."""
    dtensor = loaded_dtensor_type()
    if dtensor is None or not isinstance(tensor, dtensor):
        return tensor.data, 0
    local = tensor.to_local()
    # The mesh dimension that shards rows (FSDP's one; HSDP replicates over another dimension first).
    sharding = [dim for dim, placement in enumerate(tensor.placements) if placement.is_shard(0)]
    if not sharding:
        return local, 0
    mesh = tensor.device_mesh
    chunk = -(-tensor.shape[0] // mesh.size(sharding[0]))
    return local, mesh.get_local_rank(sharding[0]) * chunk


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside torch.compile, DDP, DataParallel, DeepSpeed and FSDP1's outer wrappers.

    Only attributes are followed: unlike `accelerator.unwrap_model(keep_fp32_wrapper=False)`, nothing is
    changed on the model, so the training model keeps its mixed-precision forward.
    """
    while True:
        if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):  # torch.compile
            model = model._orig_mod
        elif type(model).__name__ in ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine",
                                      "FullyShardedDataParallel"):
            model = cast(torch.nn.Module, model.module)  # typed by Module.__getattr__ as a Tensor or a Module
        else:
            return model


def unwrap_gpt(model: torch.nn.Module) -> GPT:
    """The GPT inside `model`'s wrappers (`unwrap`, typed for the model lowmem trains)."""
    return cast("GPT", unwrap(model))


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """`model` without torch.compile's wrapper only: what torch.distributed.checkpoint's FSDP functions take."""
    while hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
        model = model._orig_mod
    return model


def strip_prefixes(name: str) -> str:
    """A state-dict key without the prefixes that compile and DDP wrappers add (`_orig_mod.`, `module.`)."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    return name


def model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights under the plain model's names, whether `model` is compiled, DDP-wrapped or plain."""
    return {strip_prefixes(name): tensor for name, tensor in unwrap(model).state_dict().items()}


def tied_names(module: torch.nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one Parameter (GPT ties the token embedding and the output layer)."""
    groups: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def empty_model(config: GPTConfig, device: torch.device | None = None,
                matrices_dtype: torch.dtype | None = None) -> GPT:
    """A GPT of `config` with uninitialised weights on `device` (the CPU by default): built on the meta device, then
    given storage that nothing has written yet (on the CPU it takes no RSS until weights are written into it). With
    `matrices_dtype`, its matrices (every Linear's weight and the embedding) take that dtype, the norms and biases
    float32: a frozen base in the dtype a bf16 run computes it in."""
    from lowmem.model.gpt import GPT

    with torch.device("meta"):
        model = GPT(config)
    if matrices_dtype is not None:
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and module.weight is not None:
                module.weight.data = module.weight.data.to(matrices_dtype)
    model.to_empty(device=device or torch.device("cpu"))
    model.tie_weights()  # to_empty gave the embedding and the head a Parameter each
    return model


def load_model_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load weights into `model` (plain, compiled or DDP-wrapped) from a state dict with or without wrapper
    prefixes. Of tied parameters one name is enough; anything else missing or unexpected is an error."""
    target = unwrap(model)
    clean = {strip_prefixes(name): tensor for name, tensor in state.items()}
    missing, unexpected = target.load_state_dict(clean, strict=False)
    covered = {name for group in tied_names(target) if any(n in clean for n in group) for name in group}
    missing = [name for name in missing if name not in covered]
    if missing or unexpected:
        raise RuntimeError(f"The weights do not fit the model: missing {missing}, unexpected {unexpected}.")


def _without_shared_duplicates(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep one name per shared tensor (safetensors refuses shared storage), the alphabetically first, as
    `safetensors.torch.save_model` does: files written either way have the same keys."""
    kept: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for name in sorted(state):
        tensor = state[name]
        if tensor.device.type != "meta":
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
            if key in seen:
                continue
            seen.add(key)
        kept[name] = tensor.detach().contiguous()
    return kept


def save_weights(model_or_state: torch.nn.Module | dict[str, torch.Tensor], path: str | Path) -> None:
    """Write weights to a safetensors file under the plain model's names (a compiled model's included)."""
    from safetensors.torch import save_file

    state = model_or_state if isinstance(model_or_state, dict) else model_state_dict(model_or_state)
    state = {strip_prefixes(name): tensor for name, tensor in state.items()}
    save_file(_without_shared_duplicates(state), str(path), metadata={"format": "pt"})


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load a safetensors file (from `save_weights` or `safetensors.torch.save_model`) into a plain or
    compiled model."""
    from safetensors.torch import load_file

    load_model_state_dict(model, load_file(str(path)))


def save_model_config(config: GPTConfig, folder: str | Path) -> None:
    """Write the GPT's sizes to `<folder>/model_config.json`, which `load_model_config` reads back."""
    (Path(folder) / MODEL_CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(config), indent=2))


def load_model_config(folder: str | Path) -> GPTConfig:
    """The GPT's sizes saved in `<folder>/model_config.json` (a checkpoint or an exported model)."""
    return GPTConfig(**json.loads((Path(folder) / MODEL_CONFIG_FILE).read_text()))
