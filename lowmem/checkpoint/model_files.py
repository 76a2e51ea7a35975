"""The weights of a model folder or checkpoint, one whole tensor at a time, whatever their layout.

    model.safetensors                 one file (best/, final/, a checkpoint of one process, DDP or DeepSpeed)
    model_shards/                     each rank's rows (a checkpoint of FSDP2: `lowmem.model.shards`)
    adapters.safetensors + <run>/base the run's base with the checkpoint's adapters merged in, matrix by matrix

`ModelWeights` reads each tensor from its files through a memory map when asked for it, so a model is exported,
converted or loaded tensor by tensor: the host holds the tensor being written (and, loading, the model being filled),
never a second copy of the model. The names are the plain GPT's, one per tied pair (the alphabetically first), as in
every weights file of lowmem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from lowmem.adapters.files import ADAPTERS_FILE, checked_base, is_adapter_checkpoint, saved_spec
from lowmem.adapters.lora import ADAPTER_MARK, LoRASpec, delta_weight
from lowmem.adapters.targets import adapter_sites
from lowmem.distributed.sharded_checkpoint import MODEL_SHARDS, has_sharded_weights
from lowmem.errors import CheckpointError
from lowmem.memory.cleanup import return_free_heap
from lowmem.model import GPT, GPTConfig
from lowmem.model.safetensors_files import SafetensorsFiles, TensorEntry, read_header, row_slices
from lowmem.model.safetensors_writer import PlannedTensor, SafetensorsWriter
from lowmem.model.shards import ShardedTensors
from lowmem.model.weights import WEIGHTS_FILE, load_model_config, tied_names

# The most bytes of the files read (and, merging adapters, computed) at once: what exporting holds beyond a tensor's
# slice being written.
SLICE_BYTES = 64 * 2**20


def has_model_weights(folder: Path) -> bool:
    """The folder holds a model's weights in one of the layouts `ModelWeights` reads."""
    return (folder / WEIGHTS_FILE).is_file() or has_sharded_weights(folder) or is_adapter_checkpoint(folder)


class ModelWeights:
    """The weights of the model in `folder` (see the module's docstring); use it as a context manager.

    Raises:
        CheckpointError or ConfigError: the folder holds no weights, or a damaged file (named).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.config: GPTConfig = load_model_config(folder)
        self._shards: ShardedTensors | None = None
        self._files: SafetensorsFiles | None = None
        self._adapters: dict[str, torch.Tensor] = {}
        self._spec: LoRASpec | None = None
        if is_adapter_checkpoint(folder):
            from safetensors.torch import load_file

            base = checked_base(folder.parent)
            self._files = SafetensorsFiles(read_header(base / WEIGHTS_FILE))
            self._adapters = load_file(str(folder / ADAPTERS_FILE))  # a few MB: the adapters only
            self._spec = saved_spec(folder / ADAPTERS_FILE)
        elif has_sharded_weights(folder):
            self._shards = ShardedTensors(folder / MODEL_SHARDS)
        elif (folder / WEIGHTS_FILE).is_file():
            self._files = SafetensorsFiles(read_header(folder / WEIGHTS_FILE))
        else:
            raise CheckpointError(f"{folder} holds no model weights ({WEIGHTS_FILE}, {MODEL_SHARDS}/ or "
                                  f"{ADAPTERS_FILE}).")
        self._sites = {f"{site.module}.weight": site for site in adapter_sites(self.config)}

    def __enter__(self) -> ModelWeights:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._shards is not None:
            self._shards.__exit__()
        if self._files is not None:
            self._files.close()

    @property
    def has_adapters(self) -> bool:
        """The weights are a base with adapters merged in (an adapters checkpoint)."""
        return self._spec is not None

    @property
    def adapters(self) -> dict[str, torch.Tensor]:
        """The adapters' tensors under our names (empty unless `has_adapters`)."""
        return self._adapters

    @property
    def spec(self) -> LoRASpec | None:
        return self._spec

    def _entry(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        if self._shards is not None:
            return self._shards.shape(name), self._shards.dtype(name)
        assert self._files is not None
        entry: TensorEntry = self._files.entries[name]
        return entry.shape, entry.dtype

    @property
    def names(self) -> list[str]:
        """The tensors' names, in the order the files list them."""
        if self._shards is not None:
            return self._shards.names
        assert self._files is not None
        return list(self._files.entries)

    def planned(self) -> list[PlannedTensor]:
        """Each tensor's name, dtype and shape as `tensor` gives it (a merged matrix in float32)."""
        planned = []
        for name in self.names:
            shape, dtype = self._entry(name)
            merged = self.has_adapters and self._is_adapted(name)
            planned.append(PlannedTensor(name, torch.float32 if merged else dtype, shape))
        return planned

    def _is_adapted(self, name: str) -> bool:
        site = self._sites.get(name)
        return site is not None and any(f"{site.module}.lora_A." in key for key in self._adapters)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name`, a copy in host memory read without the rest of the tensor (a base
        matrix's rows with their adapters' update merged in, in float32)."""
        shape, dtype = self._entry(name)
        values = torch.empty((stop - start, *shape[1:]), dtype=dtype)
        if self._shards is not None:
            self._shards.fill(name, values, start)
        else:
            assert self._files is not None
            for low, high, part in row_slices(self._files, (name,), start, stop - start, SLICE_BYTES):
                values[low:high].copy_(part)
                del part  # a view of the file's pages: handed back before the next slice
        if self.has_adapters and self._is_adapted(name):
            values = values.float() + self._delta(name, start, stop, shape[1])
        return values

    def slices(self, name: str, chunk_bytes: int = SLICE_BYTES) -> Iterator[torch.Tensor]:
        """Tensor `name`'s rows in order, about `chunk_bytes` of them at a time (see `rows`); a scalar whole."""
        shape, dtype = self._entry(name)
        if not shape:
            yield self._shards.whole(name) if self._shards is not None else self._scalar(name)
            return
        row_bytes = max(1, dtype.itemsize * (shape[0] and int(torch.Size(shape[1:]).numel())))
        step = max(1, chunk_bytes // row_bytes)
        for first in range(0, shape[0], step):
            yield self.rows(name, first, min(shape[0], first + step))

    def _scalar(self, name: str) -> torch.Tensor:
        assert self._files is not None
        return self._files.read_rows(name, 0, 0).clone()

    def _delta(self, name: str, start: int, stop: int, in_features: int) -> torch.Tensor:
        """Rows [start, stop) of the update the adapters make to matrix `name`."""
        assert self._spec is not None
        site = self._sites[name]
        pairs = {key.rpartition(".")[2]: (self._adapters[key], self._adapters[key.replace(".lora_A.", ".lora_B.")])
                 for key in self._adapters if key.startswith(f"{site.module}.lora_A.")}
        return delta_weight(site.parts, pairs, in_features, self._spec.scaling, rows=(start, stop))

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name` whole, in host memory (see `rows`)."""
        shape, _ = self._entry(name)
        return self.rows(name, 0, shape[0]) if shape else next(self.slices(name))

    def write(self, path: Path) -> None:
        """Write the weights as one safetensors file, a slice of rows at a time: the host holds one slice."""
        with SafetensorsWriter(path, self.planned(), metadata={"format": "pt"}) as writer:
            for name in self.names:
                for part in self.slices(name):
                    writer.write(name, part)
                    del part
                return_free_heap()  # see write_model

    def load_into(self, model: GPT) -> None:
        """Fill a plain GPT of this config (its adapters, if any, left as they are) tensor by tensor: every parameter
        from the files, one name of a tied pair enough."""
        groups = tied_names(model)
        stored = set(self.names)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if ADAPTER_MARK in name:
                    continue
                group = next((group for group in groups if name in group), [name])
                found = [candidate for candidate in sorted(group) if candidate in stored]
                if not found:
                    raise CheckpointError(f"The weights in {self.folder} have no {name}: they do not fit the model.")
                shape, _ = self._entry(found[0])
                if shape != tuple(parameter.shape):
                    raise CheckpointError(f"{found[0]} in {self.folder} has shape {list(shape)} where the model has "
                                          f"{list(parameter.shape)}.")
                first = 0
                for part in self.slices(found[0]):  # a slice at a time: no second copy of the tensor
                    parameter[first:first + part.shape[0]].copy_(part)
                    first += part.shape[0]
                    del part


def write_model(model: GPT, path: Path) -> None:
    """Write a whole GPT's weights (plain, or with adapters: merged into their base matrices, in float32) as one
    safetensors file under the plain model's names, a tensor at a time: each is copied to the host (and an adapted
    one merged) only while it is written, never the model at once."""
    from lowmem.adapters.lora import adapter_layers

    adapted = {f"{name}.weight": layer for name, layer in adapter_layers(model)}
    kept = {name: sorted(group)[0] for group in tied_names(model) for name in group}
    chosen: dict[str, tuple[str, torch.Tensor]] = {}  # the name written → (the model's name, the tensor)
    for name, tensor in model.state_dict().items():
        if ADAPTER_MARK not in name:
            chosen.setdefault(kept.get(name, name), (name, tensor))
    unique = [(stored, name, tensor) for stored, (name, tensor) in chosen.items()]
    planned = [PlannedTensor(stored, torch.float32 if name in adapted else tensor.dtype, tuple(tensor.shape))
               for stored, name, tensor in unique]
    with SafetensorsWriter(path, planned, metadata={"format": "pt"}) as writer, torch.no_grad():
        for stored, name, tensor in unique:
            layer = adapted.get(name)
            values = tensor if layer is None else tensor.float() + layer.delta_weight()
            writer.write(stored, values)
            del values
            # A tensor's temporaries (its host copy, a merged matrix and its update) come from the C heap, which keeps
            # them once freed: without handing them back after each, an export holds hundreds of MB more than one
            # tensor's worth, and the next folder's export adds its own on top.
            return_free_heap()
