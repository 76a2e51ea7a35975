"""The largest model of a run's proportions that a host trains, by the memory plan.

The run's model is scaled as a family grows: its width (the heads, at the same head size, and the MLP with them) and
its depth by the same factor, the vocabulary and the context kept. For each size the memory savers are chosen as
`train` would choose them (`choose_savers`), and the largest size whose plan fits is found by bisection: once for a
full fine-tune, once for adapters (LoRA) on a frozen base. Everything is arithmetic on the plan's inputs: no model is
built.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Collection

from lowmem.memory.levers import PositionsForRows, choose_savers
from lowmem.memory.plan import ModelShape, PlanInputs, with_inputs

# The factors searched between: from a twentieth of the model to a hundred times its width and depth.
SMALLEST, LARGEST = 0.05, 100.0
STEPS = 40  # bisection steps: the factor to about 1e-10 relative, far below a layer's or a head's size


@dataclass(frozen=True)
class LargestModels:
    """The largest model of the run's proportions that fits, trained in full and with adapters (None: not even the
    smallest size searched fits)."""

    full: ModelShape | None
    adapters: ModelShape | None
    rank: int  # the adapters' rank the LoRA figure is for


def scaled(shape: ModelShape, factor: float) -> ModelShape:
    """`shape` with its width and depth times `factor` (see the module's docstring): a block's parameters grow with
    the width squared, the embedding and an untied head with the width, the adapters with width times depth."""
    head_size = shape.n_embd // max(shape.n_head, 1)
    heads = max(1, round(shape.n_head * factor))
    width = heads * head_size
    layers = max(1, round(shape.n_layer * factor))
    grow = width / shape.n_embd
    block = round(shape.block_params * grow * grow)
    root = round(shape.root_params * grow)
    adapters = round(shape.adapter_params * grow * layers / shape.n_layer)
    dropout = round(shape.adapter_dropout_bytes * grow * layers / shape.n_layer)
    return replace(shape, n_layer=layers, n_embd=width, n_head=heads, mlp_hidden=max(1, round(shape.mlp_hidden * grow)),
                   params=layers * block + root, block_params=block, adapter_params=adapters,
                   adapter_dropout_bytes=dropout)


def _largest(inputs: PlanInputs, shape: ModelShape, budget: int, explicit: Collection[str],
             positions_for_rows: PositionsForRows) -> ModelShape | None:
    def fits(factor: float) -> bool:
        return choose_savers(with_inputs(inputs, model=scaled(shape, factor)), budget, explicit,
                             positions_for_rows).fits

    low, high = SMALLEST, LARGEST
    if not fits(low):
        return None
    if fits(high):
        return scaled(shape, high)
    for _ in range(STEPS):
        middle = (low * high) ** 0.5  # sizes grow as powers: bisect the factor's logarithm
        low, high = (middle, high) if fits(middle) else (low, middle)
    return scaled(shape, low)


def largest_models(inputs: PlanInputs, adapters_shape: ModelShape, rank: int, budget: int,
                   explicit: Collection[str], positions_for_rows: PositionsForRows) -> LargestModels:
    """The largest full fine-tune and the largest run of adapters (`adapters_shape`: the run's model with adapters of
    `rank`) of the run's proportions that fit `budget` (and the GPU `inputs` names), the savers chosen for each."""
    full = replace(inputs.model, adapter_params=0, adapter_dropout_bytes=0)
    return LargestModels(_largest(inputs, full, budget, explicit, positions_for_rows),
                         _largest(inputs, adapters_shape, budget, explicit, positions_for_rows), rank)


def _size(shape: ModelShape | None) -> str:
    if shape is None:
        return "none (not even a twentieth of this model's width and depth)"
    return f"{shape.params / 1e9:,.2f} B parameters ({shape.n_layer} layers of {shape.n_embd:,})"


def largest_line(found: LargestModels, architecture: str) -> str:
    """One line for the plan: the largest model of the run's proportions this host trains, in full and adapters."""
    return (f"The largest {architecture} of these proportions this host trains (width and depth scaled together, the "
            f"memory savers chosen for each size): full fine-tune {_size(found.full)}; adapters of rank {found.rank} "
            f"on {_size(found.adapters)}.")
