"""Low-rank adapters (LoRA): a frozen Linear plus a trained low-rank update, `y = W x + b + s * B (A dropout(x))`.

`add_adapters` turns the chosen Linears of a GPT into `LoRALinear`s in place. The base weight and bias keep their
names and Parameters (nothing is copied: a model filled from a file stays as it was), so a checkpoint of the base,
the memory plan and the export see the same model; only `lora_A.<part>` and `lora_B.<part>` are new. As in peft:
A starts from Kaiming-uniform noise and B from zeros (so the model at step 0 is the base), the update is scaled by
`alpha / rank`, and dropout acts on the adapter's input only. Everything else in the model is frozen: no gradient,
no optimizer state.

A Linear that holds several transformers projections (our fused `qkv`) takes one pair per part, so the adapter is
the one peft trains on q_proj, k_proj and v_proj (`lowmem.adapters.targets`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from lowmem.adapters.targets import AdapterSite, adapter_sites, chosen_parts
from lowmem.config import ModelConfig
from lowmem.errors import ConfigError
from lowmem.model import GPT

ADAPTER_MARK = ".lora_"  # in the name of every adapter parameter, and of nothing else
_SPEC_ATTRIBUTE = "adapter_spec"  # the GPT attribute `add_adapters` sets


@dataclass(frozen=True)
class LoRASpec:
    """What adapters a run trains: rank (> 0), alpha (the update is scaled by alpha / rank), dropout on the
    adapter's input, and the targets (`lowmem.adapters.targets.chosen_parts`)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: str = "all"

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise ConfigError(f"--lora_rank must be a positive number of dimensions, got {self.rank}.")
        if self.alpha <= 0:
            raise ConfigError(f"--lora_alpha must be positive (the update is scaled by alpha / rank), "
                              f"got {self.alpha}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"--lora_dropout is a probability below 1, got {self.dropout}.")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, config: ModelConfig) -> LoRASpec | None:
        """The adapters a run's config asks for (`--lora_rank` and its companions); None when it trains every
        weight."""
        if not config.lora_rank:
            return None
        return cls(config.lora_rank, config.lora_alpha, config.lora_dropout, config.lora_targets)

    def describe(self) -> str:
        return (f"rank {self.rank}, alpha {self.alpha:g} (scale {self.scaling:g}), dropout {self.dropout:g}, "
                f"on {self.targets}")


class LoRALinear(nn.Linear):
    """A Linear whose `weight` and `bias` are frozen and whose output rows, block by block (`parts`: a name and a
    number of rows each), may get a low-rank update. Parts without an adapter add nothing."""

    def __init__(self, base: nn.Linear, parts: tuple[tuple[str, int], ...], adapted: frozenset[str],
                 spec: LoRASpec) -> None:
        # Built on the meta device, then given the base's own Parameters: no second copy of the weight.
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight = base.weight
        self.bias = base.bias
        self.parts = parts
        self.scaling = spec.scaling
        self.adapters_on = True
        self.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        device = base.weight.device
        for name, rows in parts:
            if name not in adapted:
                continue
            key = part_key(name)
            a = torch.empty(spec.rank, base.in_features, device=device, dtype=torch.float32)
            if device.type != "meta":
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as peft (and nn.Linear) start A
            self.lora_A[key] = nn.Parameter(a)
            self.lora_B[key] = nn.Parameter(torch.zeros(rows, spec.rank, device=device, dtype=torch.float32))
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.adapters_on or not len(self.lora_A):
            return y
        updates = []
        for name, rows in self.parts:
            key = part_key(name)
            if key in self.lora_A:  # a dropout mask of its own per part, as peft's one module per projection
                updates.append(F.linear(F.linear(self.lora_dropout(x), self.lora_A[key]), self.lora_B[key]))
            else:
                updates.append(y.new_zeros(*y.shape[:-1], rows))
        update = updates[0] if len(updates) == 1 else torch.cat(updates, dim=-1)
        return y + update.to(y.dtype) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """The update the adapters make to `weight`, (out, in) in float32: scaling x B A, part by part."""
        pairs = {key: (self.lora_A[key], self.lora_B[key]) for key in self.lora_A}
        return delta_weight(self.parts, pairs, self.in_features, self.scaling, self.weight.device)

    def extra_repr(self) -> str:
        adapted = [name for name, _ in self.parts if part_key(name) in self.lora_A]
        return f"{super().extra_repr()}, adapters on {', '.join(adapted)}, scaling={self.scaling:g}"


def delta_weight(parts: tuple[tuple[str, int], ...], pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 in_features: int, scaling: float, device: torch.device | None = None,
                 rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The update adapters make to a Linear's weight, (out, in) in float32, or to its `rows` [start, stop) only:
    scaling x B A for each part (a name and a number of rows) that has a pair (A, B) in `pairs` (by `part_key`), zeros
    for the others."""
    start, stop = rows if rows is not None else (0, sum(count for _, count in parts))
    blocks, offset = [], 0
    for name, count in parts:
        low, high = max(start, offset), min(stop, offset + count)
        if low < high:
            pair = pairs.get(part_key(name))
            if pair is not None:
                a, b = pair
                blocks.append(b[low - offset:high - offset].float() @ a.float())
            else:
                blocks.append(torch.zeros(high - low, in_features, device=device))
        offset += count
    if not blocks:
        return torch.zeros(0, in_features, device=device)
    return torch.cat(blocks, dim=0) * scaling


def part_key(part: str) -> str:
    """A part's name as the key of its adapter's tensors (`lora_A.<key>`): no dots in keys."""
    return part.replace(".", "_")


def add_adapters(model: GPT, spec: LoRASpec) -> list[AdapterSite]:
    """Put adapters on `model`'s Linears that `spec.targets` names and freeze every other parameter. Returns the
    sites that took adapters."""
    parts = chosen_parts(spec.targets, model.config)
    taken = []
    for site in adapter_sites(model.config):
        if not any(name in parts for name, _ in site.parts):
            continue
        parent_name, _, child = site.module.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        setattr(parent, child, LoRALinear(linear, site.parts, parts, spec))
        taken.append(site)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(ADAPTER_MARK in name)
    setattr(model, _SPEC_ATTRIBUTE, spec)  # what its checkpoints record (`adapter_spec`)
    return taken


def adapter_spec(model: nn.Module) -> LoRASpec | None:
    """The adapters `add_adapters` put on `model` (a plain GPT), or None."""
    return getattr(model, _SPEC_ATTRIBUTE, None)


def adapter_layers(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """Each LoRALinear of `model` with its module name."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors under our names (`blocks.0.attn.qkv.lora_A.q_proj`), detached."""
    return {name: value.detach() for name, value in model.state_dict().items() if ADAPTER_MARK in name}


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors without the adapters: the base model, under the names a plain GPT has."""
    return {name: value for name, value in model.state_dict().items() if ADAPTER_MARK not in name}


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain GPT's weights with every adapter folded into its base weight (W + scaling B A), as float32 copies
    for the adapted matrices and the model's own tensors for the rest; the model is left as it was. A tied
    embedding is untouched: no adapter sits on it."""
    merged = base_state_dict(model)
    for name, layer in adapter_layers(model):
        key = f"{name}.weight"
        merged[key] = layer.weight.float() + layer.delta_weight()
    return merged


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Within the block, the model computes as its base (the adapters add nothing); on again after."""
    layers = [layer for _, layer in adapter_layers(model)]
    for layer in layers:
        layer.adapters_on = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapters_on = True
