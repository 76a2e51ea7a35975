"""What each way of spreading training over devices needs, in one place.

The trainer calls a few functions from here and never asks which strategy runs:

    prepare_model_and_optimizer   create the optimizer the strategy accepts and `accelerator.prepare` both
    save_model_and_optimizer      write this rank's part of the weights and optimizer into a checkpoint folder
    load_model_and_optimizer      read them back
    model_for_eval                a whole, usable GPT for evaluation, generation and export

The strategy comes from how `accelerate launch` was configured (see configs/accelerate/):

    plain / DDP   one process, or data parallel with a full replica per process. Checkpoint: the main
                  process writes `model.safetensors` and `optimizer.pt` (identical on every rank under DDP).
    DeepSpeed     ZeRO stage 1 or 2 (the optimizer state, and in stage 2 the gradients, are split over the
                  ranks; with offload, the optimizer state lives in host memory and is stepped there).
                  Checkpoint: every rank writes its optimizer shard through the engine's own
                  `save_checkpoint` into `deepspeed/`; the main process also writes the (replicated) weights to
                  `model.safetensors` for evaluation and export. Resume reads `deepspeed/` only.
    FSDP          parameters, gradients and optimizer state sharded (FSDP1 or FSDP2; FSDP2 also on the CPU,
                  see `lowmem.distributed.accelerator.fsdp_on_cpu`). Checkpoint: the weights are gathered in
                  full to `model.safetensors` (the file evaluation, export and resume read; on resume the main
                  process alone reads it and broadcasts it a parameter at a time); the optimizer state stays
                  sharded: every rank writes its own shard into `optimizer/` with torch.distributed.checkpoint.
                  Gathering it instead would put twice the model's size (AdamW's two moments) into one host's
                  memory, the very thing this project avoids, and the sharded form is re-sharded on load if the
                  number of processes changes.

Every function accepts a model wrapped by `torch.compile` (its state-dict keys start with `_orig_mod.`) or
by DDP (`module.`): weights are always written with the plain model's names and load into either. A model with
adapters (`lowmem.adapters`, one process, DDP or FSDP) writes `adapters.safetensors` instead of `model.safetensors`:
its frozen base is the run's own `base/`, filled in before a resume loads the adapters.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from lowmem.adapters.files import ADAPTERS_FILE, is_adapter_checkpoint, load_adapters, save_adapters
from lowmem.adapters.lora import ADAPTER_MARK, add_adapters, adapter_spec
from lowmem.config import OptimConfig
from lowmem.distributed.accelerator import ddp_settings, offloads_optimizer
from lowmem.distributed.gradient_hooks import use_bf16_gradients
from lowmem.distributed.collectives import broadcast_from_main
from lowmem.distributed.fsdp_units import shard_embedding_and_head
from lowmem.distributed.sharded_checkpoint import (has_sharded_optimizer, has_sharded_weights, load_sharded_optimizer,
                                                   load_sharded_weights, save_sharded_optimizer, save_sharded_weights)
from lowmem.distributed.safe_load import deepspeed_loads_as_data, load_distributed_checkpoint, load_torch_file
from lowmem.errors import CheckpointError, ConfigError
from lowmem.model import GPT
from lowmem.model.weights import (WEIGHTS_FILE, load_model_state_dict, load_weights, loaded_dtensor_type,
                                  model_state_dict, save_model_config, save_weights, strip_prefixes, tied_names,
                                  uncompiled, unwrap, unwrap_gpt)

logger = logging.getLogger(__name__)

PLAIN, DEEPSPEED, FSDP = "plain", "deepspeed", "fsdp"
OPTIMIZER_FILE = "optimizer.pt"  # plain / DDP
DEEPSPEED_DIR = "deepspeed"  # DeepSpeed engine checkpoint (one shard per rank)
DEEPSPEED_TAG = "state"  # the engine's sub-folder name; fixed, so no `latest` file is needed
FSDP_OPTIMIZER_DIR = "optimizer"  # torch.distributed.checkpoint folder (one shard per rank)
# DeepSpeed in bf16 casts the model itself to bf16 and keeps the float32 master weights in the optimizer's
# shards: the weights files written from the model hold bf16 tensors.
DEEPSPEED_BF16_EXPORTS = (
    "DeepSpeed in bf16: model.safetensors in checkpoints, best/ and final/ holds the bf16 weights the GPUs "
    "compute with; the float32 master weights are only in each checkpoint's deepspeed/ folder. To rebuild them "
    "(offline, on the CPU): python <checkpoint>/deepspeed/zero_to_fp32.py <checkpoint>/deepspeed <output folder> "
    f"--tag {DEEPSPEED_TAG} --safe_serialization"
)


# ----- which strategy -------------------------------------------------------------------------------------
def strategy(accelerator: Accelerator) -> str:
    """"plain" (one process or DDP), "deepspeed" or "fsdp", as `accelerate launch` configured it."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return DEEPSPEED
    if accelerator.distributed_type == DistributedType.FSDP:
        return FSDP
    return PLAIN


def is_fsdp2(accelerator: Accelerator) -> bool:
    """True under FSDP2 (`fully_shard`), the FSDP that validation, saving and export run sharded, never gathered."""
    return strategy(accelerator) == FSDP and accelerator.state.fsdp_plugin.fsdp_version == 2


def describe(accelerator: Accelerator, config: OptimConfig | None = None) -> str:
    """One line for the log: the strategy and its main settings (DDP's all-reduce from `config`)."""
    kind = strategy(accelerator)
    if kind == DEEPSPEED:
        plugin = accelerator.state.deepspeed_plugin
        return (f"DeepSpeed ZeRO-{plugin.zero_stage}, optimizer offload: {plugin.offload_optimizer_device}, "
                f"{accelerator.num_processes} processes")
    if kind == FSDP:
        plugin = accelerator.state.fsdp_plugin
        return f"FSDP{plugin.fsdp_version}, {accelerator.num_processes} processes"
    if accelerator.num_processes == 1:
        return "single process"
    return "DDP" if config is None else f"DDP, {ddp_settings(config).describe(accelerator)}"


def plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """`value` as an ordinary tensor: a DTensor (what FSDP2's `clip_grad_norm_` returns) in full, anything
    else unchanged.

    torch 2.13 returns the norm already replicated, and `float()` of it is the whole gradient's norm; a DTensor
    still pending its reduction would give this rank's part through `to_local()`. `full_tensor()` is right in
    every case (a collective when a reduction is pending: every rank calls it together, as the step does).
    """
    dtensor = loaded_dtensor_type()
    return value.full_tensor() if dtensor is not None and isinstance(value, dtensor) else value


# ----- preparing --------------------------------------------------------------------------------------------
def _check_supported(accelerator: Accelerator) -> None:
    if strategy(accelerator) == DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3:
        raise ConfigError(
            "DeepSpeed ZeRO stage 3 splits the weights themselves over the GPUs, and this trainer's evaluation, "
            "generation and export need whole weights on each GPU. Use configs/accelerate/deepspeed_zero2_offload"
            ".yaml (ZeRO-2 with the optimizer in host memory) or configs/accelerate/fsdp.yaml (everything sharded)."
        )


def _create_optimizer(model: GPT, config: OptimConfig, accelerator: Accelerator) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (GPT.configure_optimizer), in the form the strategy accepts.

    With DeepSpeed's optimizer offload, accelerate replaces the optimizer it is handed by DeepSpeed's CPU Adam
    (`map_pytorch_optim_to_deepspeed`), built from its parameter groups (so each group's betas and weight
    decay carry over), and in AdamW mode (decoupled weight decay) only when the optimizer it replaces is a
    `torch.optim.AdamW`: anything else, DeepSpeedCPUAdam included, becomes Adam with L2 regularisation. So it
    gets a plain torch AdamW, never stepped, not fused (the parameters are still on the CPU here). A DeepSpeed
    config file that names an optimizer gets accelerate's DummyOptim carrying our parameter groups. Everywhere
    else the optimizer is the fused AdamW, which skips a non-finite step on the device.
    """
    offload = offloads_optimizer(accelerator)
    adamw = model.configure_optimizer(config.weight_decay, config.learn_rate, (config.adam_beta1, config.adam_beta2),
                                      device_type="cpu" if offload else accelerator.device.type, fused=not offload)
    if strategy(accelerator) == DEEPSPEED and "optimizer" in accelerator.state.deepspeed_plugin.deepspeed_config:
        from accelerate.utils import DummyOptim

        groups = [{"params": group["params"], "weight_decay": group["weight_decay"]} for group in adamw.param_groups]
        return DummyOptim(groups, lr=config.learn_rate)
    return adamw


def _fill_deepspeed_config(config: OptimConfig, accelerator: Accelerator) -> None:
    """Values DeepSpeed's config needs that accelerate takes from a DataLoader we do not hand it."""
    plugin = accelerator.state.deepspeed_plugin
    ds = plugin.deepspeed_config
    if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds["train_micro_batch_size_per_gpu"] = config.batch_size_per_gpu
    # DeepSpeed clips inside its own step (accelerator.clip_grad_norm_ does nothing there): give it ours.
    if ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = config.grad_clip if config.grad_clip > 0 else 0.0
    offload = ds.get("zero_optimization", {}).get("offload_optimizer")
    if isinstance(offload, dict) and offload.get("device", "none") != "none":
        # Pinned host buffers cost page-locked host RAM, rounded up to powers of two (see
        # configs/accelerate/deepspeed_zero2_offload.yaml); recent DeepSpeed pins by default and accelerate's
        # config file has no key for it. A DeepSpeed config file that sets it keeps its value.
        offload.setdefault("pin_memory", False)


def prepare_model_and_optimizer(model: GPT, config: OptimConfig,
                                accelerator: Accelerator) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Create the optimizer for `model` and prepare both for the launched strategy (DDP, DeepSpeed, FSDP).

    Model and optimizer go into one `accelerator.prepare` call: FSDP replaces the parameters while wrapping
    and accelerate re-points the optimizer at the new ones only when it sees both together.

    Args:
        model: the plain GPT, on the CPU.
        config: the training config (weight_decay, learn_rate, adam_beta1/2, batch_size_per_gpu, grad_clip).
        accelerator: the run's Accelerator.
    """
    _check_supported(accelerator)
    if is_fsdp2(accelerator):  # before the optimizer is made: it takes the units' sharded parameters
        shard_embedding_and_head(model, accelerator)
    optimizer = _create_optimizer(model, config, accelerator)
    if strategy(accelerator) == DEEPSPEED:
        _fill_deepspeed_config(config, accelerator)
        if accelerator.is_main_process and accelerator.mixed_precision == "bf16":
            logger.info(DEEPSPEED_BF16_EXPORTS)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    ddp = strategy(accelerator) == PLAIN and accelerator.num_processes > 1
    if ddp and ddp_settings(config).compresses(accelerator):
        use_bf16_gradients(prepared)
    return prepared, optimizer


# ----- checkpoints ------------------------------------------------------------------------------------------
def _inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's AcceleratedOptimizer."""
    return getattr(optimizer, "optimizer", optimizer)


def _plain_ties(model: torch.nn.Module) -> list[list[str]]:
    """The plain GPT's groups of tied parameter names, whatever FSDP made of the parameters."""
    with torch.device("meta"):
        return tied_names(GPT(unwrap_gpt(model).config))


def full_model_state(model: torch.nn.Module, accelerator: Accelerator, on_every_rank: bool = False,
                     ) -> dict[str, torch.Tensor] | None:
    """The whole model's weights under plain names: on the main process (None elsewhere), or with
    `on_every_rank` on every process (on its device). Every rank must call it: FSDP gathers the shards."""
    if strategy(accelerator) == FSDP:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # cpu_offload gathers into the main process's host memory only; without it every rank gets the
        # whole model on its GPU.
        options = StateDictOptions(full_state_dict=True, cpu_offload=not on_every_rank)
        # torch types the result for every option; with full_state_dict its values are whole tensors.
        state: dict[str, torch.Tensor] = get_model_state_dict(  # type: ignore[assignment]
            uncompiled(model), options=options)
        state = {strip_prefixes(name): tensor for name, tensor in state.items()}
        # Each name of a tied parameter comes back as a tensor of its own (or one only, where the head is computed
        # through the embedding): keep it under the name the other strategies' files keep (the alphabetically
        # first), rather than write the tied matrix twice.
        for group in _plain_ties(model):
            present = [name for name in sorted(group) if name in state]
            if present:
                kept = state[present[0]]
                for name in present:
                    del state[name]
                state[sorted(group)[0]] = kept
        return state if on_every_rank or accelerator.is_main_process else None
    if on_every_rank or accelerator.is_main_process:
        return model_state_dict(model)
    return None


def _adapter_state(model: torch.nn.Module, accelerator: Accelerator) -> dict[str, torch.Tensor] | None:
    """The adapters' tensors whole, under plain names, on the main process (None elsewhere); every rank calls it:
    under FSDP each sharded adapter is gathered in turn, the same order on every rank."""
    dtensor = loaded_dtensor_type()
    state = {}
    for name, parameter in uncompiled(unwrap(model)).named_parameters():
        if ADAPTER_MARK in name:
            whole = parameter.full_tensor() if dtensor is not None and isinstance(parameter, dtensor) else parameter
            state[strip_prefixes(name)] = whole.detach()
    if not state:  # FSDP1 flattens the parameters under names of its own: gather the whole state instead
        return full_model_state(model, accelerator)
    return state if accelerator.is_main_process else None


def save_model_and_optimizer(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             accelerator: Accelerator) -> None:
    """Write this rank's part of the weights and the optimizer state into a checkpoint folder.

    Every rank calls it (inside CheckpointManager.save's write step, all into the same temporary folder).
    The main process writes `model.safetensors` and `model_config.json` under every strategy.
    """
    kind = strategy(accelerator)
    spec = adapter_spec(unwrap_gpt(model))
    sharded = is_fsdp2(accelerator)
    # The base of a run of adapters is the run's, written once (`lowmem.adapters.files`): only the adapters are
    # gathered and written. FSDP2's weights are written as they are held, each rank its shards.
    if spec is None and sharded:
        save_sharded_weights(folder, model, accelerator)
        state = None
    else:
        state = full_model_state(model, accelerator) if spec is None else _adapter_state(model, accelerator)
    if accelerator.is_main_process:
        if spec is not None:
            assert state is not None  # _adapter_state gives the main process the adapters
            save_adapters(state, folder / ADAPTERS_FILE, spec)
        elif not sharded:
            assert state is not None  # full_model_state gives the main process the weights
            save_weights(state, folder / WEIGHTS_FILE)
        save_model_config(unwrap_gpt(model).config, folder)
    del state
    if kind == FSDP and sharded:
        save_sharded_optimizer(folder, model, optimizer, accelerator)
    elif kind == DEEPSPEED:
        # Every rank writes its own optimizer shard; rank 0 also the engine's module states.
        # model is DeepSpeed's engine here: typed as a Module, its methods reach mypy as Module.__getattr__'s.
        model.save_checkpoint(  # type: ignore[operator]
            str(folder / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, save_latest=False)
    elif kind == FSDP:
        _save_sharded_optimizer(folder / FSDP_OPTIMIZER_DIR, model, optimizer)
    elif accelerator.is_main_process:
        save_torch_file(_inner_optimizer(optimizer).state_dict(), folder / OPTIMIZER_FILE)


def save_torch_file(obj: object, path: Path) -> None:
    """torch.save through an open file: a failed write (a full disk) then keeps its OSError in the exception's
    context, where `lowmem.disk_errors` finds it; torch.save(obj, path) reports only "unexpected pos"."""
    with open(path, "wb") as file:
        torch.save(obj, file)


def _save_sharded_optimizer(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Each rank writes its optimizer shard (torch.distributed.checkpoint); also works unsharded."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = uncompiled(model)
    save_distributed({"optimizer": get_optimizer_state_dict(model, _inner_optimizer(optimizer))}, folder)


def save_distributed(state: dict, folder: Path, **options: Any) -> None:
    """`torch.distributed.checkpoint.save` of `state` into `folder`. Its CheckpointException is a BaseException
    (it would slip past every `except Exception`), so it is raised again as a RuntimeError caused by it, which
    keeps each rank's error (a full disk's OSError among them) for `lowmem.disk_errors`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    folder.mkdir(parents=True, exist_ok=True)
    try:
        dcp.save(state, checkpoint_id=str(folder), **options)
    except CheckpointException as error:
        raise RuntimeError(f"torch.distributed.checkpoint could not save {folder}") from error


def _load_sharded_optimizer(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model, inner = uncompiled(model), _inner_optimizer(optimizer)
    # The current (sharded) optimizer state is the template that tells DCP what to read into.
    state = {"optimizer": get_optimizer_state_dict(model, inner)}
    load_distributed_checkpoint(state, folder)  # as data: its reader would unpickle the metadata as it is
    set_optimizer_state_dict(model, inner, optim_state_dict=state["optimizer"])


def _read_full_weights(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights file as a state dict with every name of a tied parameter (the file holds one of them)."""
    from safetensors.torch import load_file

    state = load_file(str(path))
    # Every name the model gives the tied parameter (both, or the embedding's alone where the head is computed
    # through it), from the one name the file holds.
    names = {strip_prefixes(name) for name, _ in uncompiled(unwrap(model)).named_parameters(remove_duplicate=False)}
    for group in _plain_ties(model):
        present = next((name for name in group if name in state), None)
        if present is None:
            continue
        value = state[present]
        for name in group:
            if name in names:
                state[name] = value
            else:
                state.pop(name, None)
    return state


def _load_weights(folder: Path, model: torch.nn.Module, accelerator: Accelerator) -> None:
    """The model's trained tensors from a checkpoint folder: its whole weights, or the adapters of a run that trains
    adapters (whose base the model was filled with when it was built); every rank calls it."""
    adapters = is_adapter_checkpoint(folder)
    if strategy(accelerator) == FSDP and has_sharded_weights(folder) and not adapters:
        load_sharded_weights(folder, model)
    elif strategy(accelerator) == FSDP:
        _load_full_weights_from_main(folder / (ADAPTERS_FILE if adapters else WEIGHTS_FILE), model, accelerator,
                                     whole=not adapters)
    elif adapters:
        load_adapters(model, folder / ADAPTERS_FILE)
    else:
        load_weights(model, folder / WEIGHTS_FILE)


def _load_full_weights_from_main(path: Path, model: torch.nn.Module, accelerator: Accelerator,
                                 whole: bool = True) -> None:
    """Load the whole-model weights file into an FSDP model: the main process reads it, and each parameter is
    broadcast in turn and sharded on arrival, so no other rank holds the whole model (only one parameter at a
    time); every rank calls it.

    The main process says first whether it could read the file: the other ranks would otherwise wait in the
    broadcast until the process group's timeout.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state: dict[str, torch.Tensor] = {}  # the other ranks' template: what arrives is sharded into the model
    read_problem = None
    if accelerator.is_main_process:
        try:
            state = _read_full_weights(path, model)
        except Exception as error:  # noqa: BLE001 - every rank raises it below
            read_problem = f"{type(error).__name__}: {error}"
    problem = broadcast_from_main(accelerator, lambda: read_problem)
    if problem is not None:
        raise CheckpointError(f"The main process could not read {path}: {problem}")
    # One process (and no process group to broadcast over) loads its own full dict, as a plain model would.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=accelerator.num_processes > 1,
                               strict=whole)  # an adapters file sets the adapters only
    # torch types the dict as invariant dict[str, ValueType], where tensors are among the values it takes.
    set_model_state_dict(uncompiled(model), state, options=options)  # type: ignore[arg-type]


def _saved_strategy(folder: Path) -> str:
    if (folder / DEEPSPEED_DIR).is_dir():
        return DEEPSPEED
    if (folder / FSDP_OPTIMIZER_DIR).is_dir() or has_sharded_optimizer(folder):
        return FSDP
    return PLAIN


def load_model_and_optimizer(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             accelerator: Accelerator, with_optimizer: bool = True) -> None:
    """Load the weights and optimizer state saved by `save_model_and_optimizer`; every rank calls it.

    Without `with_optimizer` only the weights file is read (a checkpoint kept for its score holds nothing else),
    under any strategy, and the optimizer keeps its fresh state.
    """
    kind = strategy(accelerator)
    if not with_optimizer and kind != DEEPSPEED:
        _load_weights(folder, model, accelerator)
        return
    saved = _saved_strategy(folder)
    if kind != saved:
        raise ConfigError(
            f"The checkpoint {folder} was saved under {saved} and this run uses {kind}: its optimizer state "
            "cannot be read across strategies. Resume with the accelerate config file it was trained with, or "
            f"start a new run in another --output_dir (its {WEIGHTS_FILE} can still be evaluated and exported)."
        )
    if kind == DEEPSPEED:
        # The engine restores the module's weights and the optimizer's fp32 master weights and moments, its files
        # read as data (its own loader would unpickle them as they are; the main process checked them before).
        with deepspeed_loads_as_data(model):
            # model is DeepSpeed's engine here: typed as a Module, its methods reach mypy as Module.__getattr__'s.
            load_path, _ = model.load_checkpoint(  # type: ignore[operator]
                str(folder / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, load_optimizer_states=True,
                load_lr_scheduler_states=False)
        if load_path is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint in {folder / DEEPSPEED_DIR}.")
        return
    _load_weights(folder, model, accelerator)
    if kind == FSDP and has_sharded_optimizer(folder):
        load_sharded_optimizer(folder, model, optimizer)
        return
    if kind == FSDP:  # a checkpoint of an earlier version: torch.distributed.checkpoint's files, read as data
        _load_sharded_optimizer(folder / FSDP_OPTIMIZER_DIR, model, optimizer)
        return
    # mmap: the file's pages are read on demand and can be dropped again, so several ranks loading at once
    # do not each hold a full copy of the optimizer state in anonymous memory.
    saved_state = load_torch_file(folder / OPTIMIZER_FILE, mmap=True)
    _inner_optimizer(optimizer).load_state_dict(saved_state)


# ----- evaluation and export --------------------------------------------------------------------------------
@contextlib.contextmanager
def model_for_eval(model: torch.nn.Module, accelerator: Accelerator) -> Iterator[GPT]:
    """The GPT that evaluation and generation run: the training model itself, without its wrappers (and without
    torch.compile, which would recompile for every new generation length).

    Plain, DDP and DeepSpeed ZeRO-1/2 keep whole weights on every rank. FSDP2 runs sharded as it trains, a unit at a
    time, so no rank ever holds the whole model: every forward pass is then a collective, and evaluation keeps the
    ranks in step (`lowmem.distributed.fsdp_units.lockstep`). FSDP1, whose flattened units cannot be run piecemeal
    outside its forward pass, gathers the weights into a temporary float32 replica on every rank, freed after it.
    Every rank must enter the context together under FSDP.
    """
    if strategy(accelerator) != FSDP or is_fsdp2(accelerator):
        yield unwrap_gpt(model)
        return
    state = full_model_state(model, accelerator, on_every_rank=True)
    assert state is not None  # on_every_rank: every rank has it
    with torch.device(accelerator.device):
        # The same memory savers: the validation loss without whole logits here too.
        plain = unwrap_gpt(model)
        replica = GPT(plain.config).use_memory_savers(**plain.memory_savers)
        spec = adapter_spec(plain)
        if spec is not None:  # the same adapters, for the validation and for final/'s merge and peft files
            add_adapters(replica, spec)
    load_model_state_dict(replica, state)
    del state
    replica.eval()
    try:
        yield replica
    finally:
        del replica
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
