"""The checkpoint of a model sharded by FSDP2: each rank writes its own shards, and reads back the rows it needs.

    checkpoint-<step>/model_shards/       the weights: each rank's rows of every parameter (`lowmem.model.shards`)
    checkpoint-<step>/optimizer_shards/   AdamW's state the same way, its parameter groups' settings in the index

No rank gathers the model or its optimizer state: saving costs each rank one tensor's host copy at a time, and
nothing is read with pickle. Tensors are stored under the plain model's names (one name for the tied embedding and
head, the alphabetically first, as every weights file of lowmem), so a resume on another number of processes reads
each of its shards' rows from whichever files hold them, and one process reads them whole (`evaluate`, `export`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lowmem.distributed.fsdp_units import reshard_everything
from lowmem.errors import CheckpointError
from lowmem.model import GPT
from lowmem.model.shards import INDEX_FILE, LocalPart, ShardedTensors, write_index, write_shard
from lowmem.model.weights import local_rows, strip_prefixes, tied_names, uncompiled, unwrap, unwrap_gpt

if TYPE_CHECKING:
    from accelerate import Accelerator

MODEL_SHARDS = "model_shards"
OPTIMIZER_SHARDS = "optimizer_shards"


def file_names(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter name of `model` (compiled, wrapped or sharded) → the name files keep it under: the plain
    model's, the alphabetically first of a tied pair (a sharded model computes its tied head through the embedding,
    whose name alone remains)."""
    with torch.device("meta"):
        groups = tied_names(GPT(unwrap_gpt(model).config))
    kept = {name: sorted(group)[0] for group in groups for name in group}
    names = {}
    for name, _ in uncompiled(unwrap(model)).named_parameters():
        plain = strip_prefixes(name)
        names[name] = kept.get(plain, plain)
    return names


def has_sharded_weights(folder: Path) -> bool:
    return (folder / MODEL_SHARDS / INDEX_FILE).is_file()


def has_sharded_optimizer(folder: Path) -> bool:
    return (folder / OPTIMIZER_SHARDS / INDEX_FILE).is_file()


def _write_parts(folder: Path, parts: list[LocalPart], accelerator: Accelerator,
                 extra: dict[str, Any] | None = None) -> None:
    """This rank's parts into its file of `folder`; the main process writes the index of every rank's."""
    from accelerate.utils import gather_object

    entries = write_shard(folder, accelerator.process_index, parts, metadata={"format": "pt"})
    every_rank = gather_object([entries]) if accelerator.num_processes > 1 else [entries]
    if accelerator.is_main_process:
        write_index(folder, every_rank, extra)


def save_sharded_weights(folder: Path, model: torch.nn.Module, accelerator: Accelerator,
                         skip: str | None = None) -> None:
    """Every rank writes its rows of every parameter (those whose name holds `skip` left out) into
    `<folder>/model_shards`; every rank calls it."""
    reshard_everything(model)
    names = file_names(model)
    parts = []
    for name, parameter in uncompiled(unwrap(model)).named_parameters():
        if skip is not None and skip in name:
            continue
        local, first_row = local_rows(parameter)
        parts.append(LocalPart(names[name], local.detach(), first_row, tuple(parameter.shape)))
    _write_parts(folder / MODEL_SHARDS, parts, accelerator)


def load_sharded_weights(folder: Path, model: torch.nn.Module, skip: str | None = None) -> None:
    """Fill every parameter of `model` (those whose name holds `skip` left out) with its rows from
    `<folder>/model_shards`, each rank its own shards' rows; every rank calls it (nothing is exchanged)."""
    reshard_everything(model)
    names = file_names(model)
    with ShardedTensors(folder / MODEL_SHARDS) as shards, torch.no_grad():
        for name, parameter in uncompiled(unwrap(model)).named_parameters():
            if skip is not None and skip in name:
                continue
            if names[name] not in shards.tensors:
                raise CheckpointError(f"{folder / MODEL_SHARDS} has no {names[name]}: its weights do not fit the model "
                                      "(resume with the settings it was saved with).")
            local, first_row = local_rows(parameter)
            shards.fill(names[name], local, first_row)


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)


def _plain_value(value: Any) -> Any:
    """A parameter group's setting as JSON takes it (a tensor learning rate as its number, betas as a list)."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    return value


def _named_parameters(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) → the name files keep it under, for the parameters of `model` (see `file_names`)."""
    names = file_names(model)
    return {id(parameter): names[name] for name, parameter in uncompiled(unwrap(model)).named_parameters()}


def save_sharded_optimizer(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           accelerator: Accelerator) -> None:
    """Every rank writes its rows of AdamW's state (`<name>/exp_avg`, `<name>/exp_avg_sq`, `<name>/step`) into
    `<folder>/optimizer_shards`, the parameter groups' settings in the index; every rank calls it. A parameter not
    stepped yet has no state, and none is written."""
    inner, names = _inner(optimizer), _named_parameters(model)
    parts = []
    groups = []
    for group in inner.param_groups:
        groups.append({key: ([names[id(parameter)] for parameter in value] if key == "params" else _plain_value(value))
                       for key, value in group.items()})
        for parameter in group["params"]:
            for key, value in inner.state.get(parameter, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise CheckpointError(f"The optimizer's state of {names[id(parameter)]} holds a "
                                          f"{type(value).__name__} ({key}), which lowmem's sharded checkpoints do not "
                                          "store.")
                local, first_row = local_rows(value)
                parts.append(LocalPart(f"{names[id(parameter)]}/{key}", local.detach(), first_row, tuple(value.shape)))
    _write_parts(folder / OPTIMIZER_SHARDS, parts, accelerator, extra={"param_groups": groups})


def load_sharded_optimizer(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state from `<folder>/optimizer_shards`, each rank its own shards' rows, made as AdamW makes it (each
    tensor sharded as its parameter is; the step where AdamW keeps it) and filled from the files: no gradient is made
    and no step taken to shape it. Every rank calls it."""
    inner, names = _inner(optimizer), _named_parameters(model)
    with ShardedTensors(folder / OPTIMIZER_SHARDS) as shards, torch.no_grad():
        saved_groups = shards.index.get("param_groups", [])
        if len(saved_groups) != len(inner.param_groups):
            raise CheckpointError(f"{folder / OPTIMIZER_SHARDS} holds {len(saved_groups)} parameter groups where the "
                                  f"optimizer has {len(inner.param_groups)}: resume with the settings it was saved "
                                  "with.")
        stored = {name.rpartition("/")[0] for name in shards.names}
        for group, saved in zip(inner.param_groups, saved_groups):
            if sorted(names[id(parameter)] for parameter in group["params"]) != sorted(saved.get("params", [])):
                raise CheckpointError(f"{folder / OPTIMIZER_SHARDS} holds the state of other parameters than the "
                                      "model's: resume with the settings it was saved with.")
            for key, value in saved.items():
                if key != "params" and key in group:
                    group[key] = _restored_setting(group[key], value)
            for parameter in group["params"]:
                name = names[id(parameter)]
                if name not in stored:  # not stepped when it was saved: AdamW makes its state at the next step
                    inner.state.pop(parameter, None)
                    continue
                inner.state[parameter] = _adamw_state(shards, name, parameter, group)


def _restored_setting(current: Any, saved: Any) -> Any:
    """A parameter group's setting as saved, in the form it has now (a tensor learning rate stays one)."""
    if isinstance(current, torch.Tensor):
        return torch.as_tensor(saved, dtype=current.dtype, device=current.device)
    return tuple(saved) if isinstance(current, tuple) else saved


def _adamw_state(shards: ShardedTensors, name: str, parameter: torch.Tensor, group: dict[str, Any]) -> dict:
    """One parameter's AdamW state from the files: the moments shaped and sharded as the parameter is, the step a
    float32 scalar where AdamW keeps it (on the parameter's device when fused or capturable, else on the host)."""
    state: dict[str, torch.Tensor] = {}
    prefix = f"{name}/"
    for stored in (key for key in shards.names if key.startswith(prefix)):
        key = stored[len(prefix):]
        if shards.shape(stored):  # a moment: as the parameter
            value = torch.zeros_like(parameter, dtype=shards.dtype(stored))
            local, first_row = local_rows(value)
            shards.fill(stored, local, first_row)
        else:  # the step
            on_device = group.get("fused") or group.get("capturable")
            device = local_rows(parameter)[0].device if on_device else torch.device("cpu")
            value = torch.zeros((), dtype=shards.dtype(stored), device=device)
            shards.fill(stored, value, 0)
        state[key] = value
    return state
