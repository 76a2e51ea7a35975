"""FSDP2's units beyond the transformer blocks, and what a sharded model needs to be run outside training.

Accelerate makes one FSDP2 unit per transformer block (`fsdp_transformer_layer_cls_to_wrap: Block`) and puts what
is left in the root unit, whose weights are gathered at the start of every forward pass and kept whole until its
end: the token embedding and the output head, the largest tensors of a model with a large vocabulary (545 M of a 7.6 B
model's parameters are each of them). Here they are units of their own, made before Accelerate wraps the rest:

    tok_emb     gathered for the lookup, released after it (and, when the head is tied to it, gathered again for
                the head: `GPT.head_through_embedding`)
    lm_head     an untied head: gathered for the logits or the chunked loss, released after it
    ln_f        the final norm, a few kB: kept gathered from its forward to its backward; its input is not cast,
                so it normalises the float32 stream the blocks hand on, as it did inside the root

The final norm is made a unit here because Accelerate 1.15 and later carve it out of the root themselves, with the
policy's cast of its input to bf16, and earlier versions leave it in the root: made here, it computes alike under
every version, and a pass that computes as the sharded model does (`compute_as_fsdp2_bf16`) meets it exactly. The
root keeps gpt2's position table.

A sharded model is run outside training as it is, never gathered into a whole copy: every forward pass is a
collective, so every rank runs the same number of them (`lockstep`), and a generation stops when every rank's rows
have finished (`all_ranks_finished`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, TypeVar

import torch

from lowmem.model import GPT
from lowmem.model.weights import unwrap_gpt

if TYPE_CHECKING:
    from accelerate import Accelerator

T = TypeVar("T")


def fsdp2_unit_options(accelerator: Accelerator) -> dict[str, Any]:
    """The `fully_shard` options Accelerate gives the blocks (the mixed-precision policy, the offload policy and the
    device mesh), for the units made here."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    plugin = accelerator.state.fsdp_plugin
    policy = plugin.mixed_precision_policy
    offload = plugin.cpu_offload
    options: dict[str, Any] = {
        "mp_policy": policy if isinstance(policy, MixedPrecisionPolicy) else MixedPrecisionPolicy(),
        "offload_policy": offload if isinstance(offload, OffloadPolicy) else OffloadPolicy(),
    }
    mesh = getattr(accelerator, "torch_device_mesh", None)
    config = getattr(accelerator, "parallelism_config", None)
    if mesh is not None and config is not None:
        options["mesh"] = mesh[tuple(config.fsdp_dim_names)]
    return options


def shard_embedding_and_head(model: GPT, accelerator: Accelerator) -> None:
    """Make the embedding, the output head and the final norm FSDP2 units of their own (see the module's
    docstring); the blocks and the root are left to Accelerate. Every rank calls it, before the optimizer is made
    from the parameters."""
    shard_own_units(model, fsdp2_unit_options(accelerator))


def shard_own_units(model: GPT, options: dict[str, Any]) -> None:
    """`shard_embedding_and_head`'s units, made with the `fully_shard` options given (a mixed-precision policy, a
    mesh): for a sharded model made without Accelerate, as a check of the policy's numerics makes one."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model.head_through_embedding()  # a tied head: one unit owns the weight, gathered around each use
    # Released after each use: the weights come back for the backward pass only where a gradient needs them.
    fully_shard(model.tok_emb, reshard_after_forward=True, **options)
    if not model.head_in_embedding:
        fully_shard(model.lm_head, reshard_after_forward=True, **options)
    norm_policy = dataclasses.replace(options.get("mp_policy", MixedPrecisionPolicy()), cast_forward_inputs=False)
    fully_shard(model.ln_f, reshard_after_forward=False, **{**options, "mp_policy": norm_policy})


def is_sharded(model: torch.nn.Module) -> bool:
    """True when `model` (or the GPT in its wrappers) is sharded by FSDP2: a forward pass is then a collective."""
    from lowmem.model.weights import loaded_dtensor_type

    if loaded_dtensor_type() is None:  # FSDP2 imports DTensor's module: without it nothing can be sharded
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(unwrap_gpt(model), FSDPModule)


def reshard_everything(model: torch.nn.Module) -> None:
    """Put every unit of a sharded model back in its shards (the root keeps its weights whole after a forward
    pass): its parameters are then the sharded ones, which saving writes."""
    from torch.distributed.fsdp import FSDPModule

    for module in unwrap_gpt(model).modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def lockstep(items: Iterable[T], accelerator: Accelerator, together: bool) -> Iterator[T | None]:
    """`items`, then None on this rank until every rank's items are used up (with `together`; else `items` as they
    are): a rank that runs out first keeps stepping, with a pass on a dummy input, while the others finish.

    One small all-reduce per item: whether any rank still has one.
    """
    if not together or accelerator.num_processes == 1:
        yield from items
        return
    from lowmem.distributed.collectives import all_reduce_max

    iterator = iter(items)
    while True:
        item = next(iterator, None)
        [any_left] = all_reduce_max(accelerator, [0.0 if item is None else 1.0])
        if not any_left:
            return
        yield item


def all_ranks_finished(accelerator: Accelerator) -> Callable[[bool], bool]:
    """For `GPT.generate(stop_together=...)`: whether every rank's rows have finished (one small all-reduce)."""
    from lowmem.distributed.collectives import all_reduce_max

    def finished(here: bool) -> bool:
        [unfinished] = all_reduce_max(accelerator, [0.0 if here else 1.0])
        return not unfinished
    return finished


def compute_as_fsdp2_bf16(model: GPT) -> GPT:
    """Make a whole model on one process compute what it computes sharded by FSDP2 under `fsdp2_bf16_policy`, for a
    pass whose values a sharded run must meet (the precomputed DPO reference: its step 0 is ln 2 only where the
    reference computed as the policy does).

    What the policy changes is mirrored unit by unit (the embedding, an untied head, each block, the final norm, the
    root, as `shard_embedding_and_head` and Accelerate make them): every parameter in bf16, a unit's floating-point
    inputs cast to bf16 on the way in (not the final norm's) and its outputs to float32 on the way out, so each block
    computes in bf16 and hands float32 on. The tied head is computed through the embedding, as it is sharded.
    Returns `model`.
    """
    from torch.utils._pytree import tree_map

    def cast(dtype: torch.dtype) -> Callable[[Any], Any]:
        return lambda value: value.to(dtype) if torch.is_tensor(value) and value.is_floating_point() else value

    to_bf16, to_float32 = cast(torch.bfloat16), cast(torch.float32)
    model.head_through_embedding()
    for parameter in model.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    units = [model.tok_emb, *([] if model.head_in_embedding else [model.lm_head]), *model.blocks, model]
    for unit in units:
        unit.register_forward_pre_hook(lambda _, args, kwargs: (tree_map(to_bf16, args), tree_map(to_bf16, kwargs)),
                                       with_kwargs=True)
        unit.register_forward_hook(lambda _, args, output: tree_map(to_float32, output))
    model.ln_f.register_forward_hook(lambda _, args, output: tree_map(to_float32, output))
    return model
