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


def save_sharded_optimizer(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           accelerator: Accelerator) -> None:
    """Every rank writes its rows of AdamW's state into `<folder>/optimizer_shards`, the groups' settings in the
    index; every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    module = uncompiled(model)
    names = file_names(model)
    # torch types the result as any of its value kinds; for an optimizer it is {"state": ..., "param_groups": ...}.
    state: Any = get_optimizer_state_dict(module, _inner(optimizer))
    parts = []
    for fqn, values in state["state"].items():
        for key, value in values.items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"The optimizer's state of {fqn} holds a {type(value).__name__} ({key}), which "
                                      "lowmem's sharded checkpoints do not store.")
            local, first_row = local_rows(value)
            parts.append(LocalPart(f"{names.get(fqn, fqn)}/{key}", local.detach(), first_row, tuple(value.shape)))
    groups = [{key: ([names.get(fqn, fqn) for fqn in value] if key == "params" else _plain_value(value))
               for key, value in group.items()} for group in state["param_groups"]]
    _write_parts(folder / OPTIMIZER_SHARDS, parts, accelerator, extra={"param_groups": groups})


def load_sharded_optimizer(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state from `<folder>/optimizer_shards`, each rank its own shards' rows; every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    module, inner = uncompiled(model), _inner(optimizer)
    names = file_names(model)
    # The state as the optimizer holds it now (a fresh one is stepped once with a learning rate of 0 to make it):
    # each tensor is sharded as this run shards it, and is filled with its rows from the files.
    template: Any = get_optimizer_state_dict(module, inner)
    with ShardedTensors(folder / OPTIMIZER_SHARDS) as shards, torch.no_grad():
        for fqn, values in template["state"].items():
            for key, value in values.items():
                stored = f"{names.get(fqn, fqn)}/{key}"
                if stored not in shards.tensors:
                    raise CheckpointError(f"{folder / OPTIMIZER_SHARDS} has no {stored}: the optimizer's state does "
                                          "not fit the model (resume with the settings it was saved with).")
                local, first_row = local_rows(value)
                shards.fill(stored, local, first_row)
        saved_groups = shards.index.get("param_groups", [])
    if len(saved_groups) != len(template["param_groups"]):
        raise CheckpointError(f"{folder / OPTIMIZER_SHARDS} holds {len(saved_groups)} parameter groups where the "
                              f"optimizer has {len(template['param_groups'])}: resume with the settings it was saved "
                              "with.")
    for group, saved in zip(template["param_groups"], saved_groups):
        for key, value in saved.items():
            if key == "params" or key not in group:
                continue
            current = group[key]
            if isinstance(current, torch.Tensor):  # a tensor learning rate stays one, where it was
                group[key] = torch.as_tensor(value, dtype=current.dtype, device=current.device)
            else:
                group[key] = tuple(value) if isinstance(current, tuple) else value
    set_optimizer_state_dict(module, inner, optim_state_dict=template)

