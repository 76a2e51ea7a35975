"""Filling a model with a source's weights, in low memory: strict, one slice of rows at a time, shards only.

The model is built on the meta device (no memory, no initialisation) and given uninitialised storage
(`empty_model`), which takes no RSS until written. `fill_model` then writes each parameter from the source's
safetensors files (`lowmem.model.safetensors_files`): at most `LOAD_CHUNK_BYTES` of the file at a time, cast to the
parameter's dtype on the way, the file's pages handed back after each slice. Under FSDP2 the model is sharded before
it is filled and each rank writes only the rows of its own shards: no rank ever holds the whole model, and the file
is read once by the page cache for every rank.

Nothing is loaded before everything is checked (`weight_plan`, from the files' headers alone): every parameter has
its tensors, of the right shape, and every tensor of the files is used. A mismatch is one message naming the tensor;
a partial load (`strict=False`) never happens.
"""

from __future__ import annotations

import time
from pathlib import Path
from dataclasses import dataclass

import torch

from lowmem.adapters.lora import ADAPTER_MARK
from lowmem.errors import ConfigError
from lowmem.hf.weight_map import NOT_WEIGHTS, WeightSource, transformers_weight_map
from lowmem.model import GPT, GPTConfig
from lowmem.model.safetensors_files import SafetensorsFiles, row_slices
from lowmem.model.safetensors_writer import PlannedTensor, SafetensorsWriter
from lowmem.model.weights import empty_model as empty_model  # re-exported: where a source's weights go
from lowmem.model.weights import local_rows, tied_names, uncompiled, unwrap
from lowmem.source.locate import LOWMEM, ModelSource


# The most bytes of a file read and cast at once: what loading adds to a process beyond the model itself.
LOAD_CHUNK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class LoadedWeights:
    """What `fill_model` did: the parameters and bytes this process wrote, and how long it took."""

    parameters: int
    bytes_written: int
    seconds: float


def load_slice_bytes(source: ModelSource) -> int:
    """The most bytes of the source's files a process maps at once while loading: a slice of LOAD_CHUNK_BYTES, or the
    largest tensor when all are smaller (each slice is cast straight into the weights, without a copy of its own)."""
    largest = max((entry.end - entry.start for entry in source.tensors.values()), default=0)
    return min(LOAD_CHUNK_BYTES, largest)


def _our_parameters(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter names (one per tied group) and shapes, from a model built on the meta device."""
    with torch.device("meta"):
        model = GPT(config)
    return {name: tuple(parameter.shape) for name, parameter in model.named_parameters()}


def weight_plan(source: ModelSource, config: GPTConfig) -> dict[str, WeightSource]:
    """Where each of our parameters comes from in `source`, checked against the files' headers: every parameter
    found, of its shape, and every tensor of the files used. ConfigError naming the first tensor that is not."""
    ours = _our_parameters(config)
    may_skip: tuple[str, ...]
    if source.kind == LOWMEM:
        plan, may_skip = _lowmem_map(config, ours, source), ()
    else:
        plan, may_skip = transformers_weight_map(config)
    where = f"'{source.folder}'"
    for name, shape in ours.items():
        if name not in plan:
            raise ConfigError(f"The model in {where} has no tensor for {name}: lowmem cannot start from it.")
        _check_parts(name, shape, plan[name], source, where)
    used = {part for weight in plan.values() for part in weight.names}
    extra = sorted(name for name in source.tensors
                   if name not in used and name not in may_skip and not name.endswith(NOT_WEIGHTS))
    if extra:
        raise ConfigError(f"The model in {where} holds tensors its config does not describe: {', '.join(extra[:5])}"
                          f"{' and more' if len(extra) > 5 else ''}. Its config.json and weights do not belong "
                          "together, or it is not a model of the class it names; nothing was loaded.")
    return {name: plan[name] for name in ours}


def _lowmem_map(config: GPTConfig, ours: dict[str, tuple[int, ...]], source: ModelSource) -> dict[str, WeightSource]:
    """Our names in a lowmem weights file, which stores one name of the tied embedding and head."""
    with torch.device("meta"):
        groups = tied_names(GPT(config))
    plan = {}
    for name in ours:
        candidates = next((group for group in groups if name in group), [name])
        present = next((candidate for candidate in sorted(candidates) if candidate in source.tensors), None)
        if present is not None:
            plan[name] = WeightSource((present,))
    return plan


def _check_parts(name: str, shape: tuple[int, ...], weight: WeightSource, source: ModelSource, where: str) -> None:
    missing = [part for part in weight.names if part not in source.tensors]
    if missing:
        raise ConfigError(f"The model in {where} has no tensor {missing[0]} (for {name}): its weights are incomplete "
                          "or do not match its config.json; nothing was loaded.")
    shapes = [source.tensors[part].shape for part in weight.names]
    if weight.transpose:
        shapes = [tuple(reversed(found)) for found in shapes]
    rows = sum(found[0] for found in shapes) if all(shapes) else 0
    stacked = (rows, *shapes[0][1:]) if shapes[0] else ()
    if stacked != shape or any(found[1:] != shapes[0][1:] for found in shapes):
        found_text = " + ".join(str(list(found)) for found in shapes)
        raise ConfigError(f"The model in {where} has {' + '.join(weight.names)} of shape {found_text}, where {name} "
                          f"needs {list(shape)}: its weights do not match its config.json; nothing was loaded.")


def fill_model(model: torch.nn.Module, source: ModelSource, plan: dict[str, WeightSource]) -> LoadedWeights:
    """Write `source`'s weights into `model` (plain, compiled, DDP-wrapped or sharded by FSDP2): each rank the rows of
    its own shards, `LOAD_CHUNK_BYTES` of the files at a time."""
    started = time.perf_counter()
    parameters, written = 0, 0
    with SafetensorsFiles(source.tensors) as files, torch.no_grad():
        for name, parameter in uncompiled(unwrap(model)).named_parameters():
            if ADAPTER_MARK in name:  # adapters start as `add_adapters` made them: the source has none
                continue
            local, first_row = local_rows(parameter)
            weight = plan[name]
            for start, stop, part in row_slices(files, weight.names, first_row, local.shape[0], LOAD_CHUNK_BYTES,
                                                weight.transpose):
                local[start:stop].copy_(part)  # cast to the parameter's dtype on the way
                written += part.numel() * local.element_size()
                del part  # a view of the file's pages: the next slice's release hands them back
            parameters += local.numel()
    return LoadedWeights(parameters, written, time.perf_counter() - started)


def write_source_weights(path: Path, source: ModelSource, plan: dict[str, WeightSource], config: GPTConfig) -> None:
    """One safetensors file of the source's weights under our names (one name of a tied pair, the alphabetically
    first, as every weights file of ours), each in the dtype the source stores it in: what a model filled from it
    holds, written from the files by this process alone, `LOAD_CHUNK_BYTES` at a time (no model, no gathering)."""
    with torch.device("meta"):
        model = GPT(config)
    groups = tied_names(model)
    kept = {name: sorted(group)[0] for group in groups for name in group}
    chosen = [(kept.get(name, name), name, tuple(parameter.shape)) for name, parameter in model.named_parameters()]
    planned = [PlannedTensor(stored, source.tensors[plan[name].names[0]].dtype, shape)
               for stored, name, shape in chosen]
    with SafetensorsFiles(source.tensors) as files, SafetensorsWriter(path, planned, {"format": "pt"}) as writer:
        for (stored, name, shape), tensor in zip(chosen, planned):
            weight = plan[name]
            for _start, _stop, part in row_slices(files, weight.names, 0, shape[0], LOAD_CHUNK_BYTES,
                                                  weight.transpose):
                writer.write(stored, part.to(tensor.dtype).contiguous())
                del part
