"""The reference model of DPO: where each batch's reference log-probabilities come from.

    adapters      under --lora_rank (the default there): the training model itself with its adapters off, which is
                  the starting model exactly; no second copy of anything
    copy          a full fine-tune (the default there): a frozen copy of the starting model on the device, counted
                  by the memory plan; not under FSDP, whose sharded model would need a sharded copy
    precomputed   the rows carry them (`lowmem dpo_reference` wrote them): no reference model at all

Each is computed without gradients and without dropout, one forward per micro-batch, over the same sequences and
counted tokens as the policy's.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from accelerate import Accelerator

from lowmem.adapters.files import checked_base
from lowmem.adapters.lora import adapters_off
from lowmem.config import TrainConfig
from lowmem.config.columns import data_columns, is_preference
from lowmem.config.train_sources import training_paths, validation_sources
from lowmem.data.sources import build_row_group_index
from lowmem.distributed.strategy import DEEPSPEED, FSDP, strategy
from lowmem.errors import ConfigError
from lowmem.model import GPT
from lowmem.model.weights import unwrap_gpt
from lowmem.distributed.device_copies import to_device
from lowmem.distributed.precision import launch_precision
from lowmem.preference.precompute import FINGERPRINTS, check_precomputed
from lowmem.preference.usable import check_usable_pairs
from lowmem.source.load import empty_model, fill_model, weight_plan
from lowmem.source.locate import find_source
from lowmem.source.settle import SOURCE_RECORD_NAME, StartingPoint, source_record

logger = logging.getLogger(__name__)

ADAPTERS, COPY, PRECOMPUTED = "adapters", "copy", "precomputed"


def reference_mode(config: TrainConfig) -> str | None:
    """Where a run's reference log-probabilities come from (see the module's table); None for a run that is not
    preference training."""
    if not is_preference(config):
        return None
    if config.dpo_reference == PRECOMPUTED:
        return PRECOMPUTED
    if config.dpo_reference == "auto" and config.lora_rank:
        return ADAPTERS
    return COPY


def check_reference_strategy(config: TrainConfig, accelerator: Accelerator) -> None:
    """A frozen copy under FSDP or DeepSpeed is refused before the run folder is touched: each rank would hold the
    whole model beside its shard."""
    if reference_mode(config) != COPY or strategy(accelerator) not in (FSDP, DEEPSPEED):
        return
    raise ConfigError(
        f"--objective=dpo keeps a frozen copy of the starting model as its reference, and under "
        f"{strategy(accelerator)} each process would hold it whole beside its shard of the model. Train adapters "
        "(--lora_rank=16: the reference is the model with its adapters off, no copy), or write the reference's "
        "log-probabilities first with `lowmem dpo_reference` and train with --dpo_reference=precomputed, or launch "
        "with DDP.")


def check_preference_start(config: TrainConfig, accelerator: Accelerator, start: StartingPoint | None) -> None:
    """Before the run folder is touched: the reference fits the strategy, the training pairs carry a preference
    (`check_usable_pairs`), every held-out file has the columns
    (a file without them would stop the run at its first validation, its steps lost), and precomputed values
    belong to this run's model and sequence length."""
    if not is_preference(config):
        return
    check_reference_strategy(config, accelerator)
    check_usable_pairs(config)
    held_out = [config.validation_file, *validation_sources(config).values()]
    for files in held_out:
        build_row_group_index(files, data_columns(config))
    if reference_mode(config) != PRECOMPUTED:
        return
    fingerprint = _model_fingerprint(config, start)
    for files in dict.fromkeys((*training_paths(config), *held_out)):
        warning = check_precomputed(str(files), config.max_seq_len, fingerprint, launch_precision(accelerator))
        if warning and accelerator.is_main_process:
            logger.warning(warning)


def _model_fingerprint(config: TrainConfig, start: StartingPoint | None) -> dict[str, str] | None:
    """The fingerprints of the model the run starts from (`source_record`'s `tensors_sha256` and `content_sha256`):
    of the source a new run reads, else as the run folder recorded them when it started."""
    if start is not None and start.source is not None and not start.resumed:
        recorded = source_record(start, config)
    else:
        record = Path(config.output_dir) / SOURCE_RECORD_NAME
        if not record.is_file():
            return None
        recorded = json.loads(record.read_text())
    return {key: recorded[key] for key in FINGERPRINTS if key in recorded}


class Reference:
    """Gives the reference log-probabilities (2P,) of a batch on the device, as `mode` says.

    Args:
        mode: ADAPTERS, COPY or PRECOMPUTED (`reference_mode`).
        model: the training model (wrapped as accelerate prepared it): ADAPTERS runs it with the adapters off.
        copy: COPY's frozen model, on the device.
        accelerator: for its autocast, which the prepared model's forward has too.
    """

    def __init__(self, mode: str, model: torch.nn.Module, accelerator: Accelerator, copy: GPT | None = None) -> None:
        self.mode, self.model, self.accelerator, self.copy = mode, model, accelerator, copy

    @torch.no_grad()
    def log_probs(self, batch: dict[str, torch.Tensor], input_ids: torch.Tensor, targets: torch.Tensor,
                  model: torch.nn.Module | None = None) -> torch.Tensor:
        """(2P,) float32: the reference's answer log-probabilities of the batch's sequences. `model`: the model
        whose adapters are turned off, when not the training model (validation's replica under FSDP)."""
        if self.mode == PRECOMPUTED:
            return to_device(batch["reference_logps"], input_ids.device)
        if self.mode == COPY:
            assert self.copy is not None  # built with the mode
            with self.accelerator.autocast():
                logps, _ = self.copy(input_ids, targets, answer_logps=True)
            return logps.float()
        model = model if model is not None else self.model
        with evaluating(model), adapters_off(model):
            logps, _ = model(input_ids, targets, answer_logps=True)
        return logps.float()

    def describe(self) -> str:
        return {ADAPTERS: "the starting model with the adapters off (no copy)",
                COPY: "a frozen copy of the starting model",
                PRECOMPUTED: "the rows' precomputed reference_chosen and reference_rejected"}[self.mode]


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """The model in eval mode within the block (no dropout: the reference is the starting model as it computes),
    back as it was after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def make_reference(config: TrainConfig, model: torch.nn.Module, accelerator: Accelerator,
                   start: StartingPoint | None) -> Reference | None:
    """The run's `Reference` (None when it is not preference training); a frozen copy is built and filled here."""
    mode = reference_mode(config)
    if mode is None:
        return None
    check_reference_strategy(config, accelerator)
    if mode == COPY and config.lora_rank:
        logger.warning("--dpo_reference=copy keeps a frozen copy of the model, though with --lora_rank the model with "
                       "its adapters off is the same reference at no cost: leave --dpo_reference out to save it.")
    copy = reference_copy(config, model, accelerator, start) if mode == COPY else None
    reference = Reference(mode, model, accelerator, copy)
    logger.info("DPO: beta %g; the reference log-probabilities come from %s.", config.dpo_beta, reference.describe())
    return reference


def copy_in_bf16(accelerator: Accelerator) -> bool:
    """Whether the frozen copy's block matrices are kept in bf16: where the accelerator runs bf16 autocast, which
    multiplies by them in bf16 anyway; not where mixed precision ended up off (`--bf16` on a GPU without bf16, a
    T4 or a V100), whose float32 activations could not meet bf16 weights."""
    return accelerator.mixed_precision == "bf16"


def reference_copy(config: TrainConfig, model: torch.nn.Module, accelerator: Accelerator,
                   start: StartingPoint | None) -> GPT:
    """A frozen copy of the starting model on the device, with the training model's loss settings: from the source
    a new run starts from, or, at a resume, from the run's own copy of it in `<run>/base` (its hash checked: the
    reference must be the model the run started from; the source itself may be gone)."""
    plain = unwrap_gpt(model)
    source = start.source if start is not None and not start.resumed else None
    if source is None:  # a resume: the copy of the starting model the run kept (`keep_starting_model`)
        source = find_source(str(checked_base(Path(config.output_dir), for_reference=True)))
    copy = empty_model(plain.config, accelerator.device)
    if copy_in_bf16(accelerator):
        halve_block_matrices(copy)  # before it is filled: each weight is cast on its way in
    fill_model(copy, source, weight_plan(source, plain.config))
    copy.use_memory_savers(plain.loss_chunk_tokens, False)
    copy.use_attention(getattr(plain, "packed_attention", "sdpa"))
    copy.eval().requires_grad_(False)
    return copy


def halve_block_matrices(model: GPT) -> None:
    """The matrices of the transformer blocks in bf16, everything else (the embedding and the head tied to it, the
    norms, the biases) as it is. Under bf16 autocast a matmul casts a float32 weight to bf16 anyway, so the copy
    computes what the policy computed at the start, bit for bit, in half the bytes of its largest part; the
    embedding's lookup and the norms stay in float32, as the policy's do."""
    for block in model.blocks:
        for module in block.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.data = module.weight.data.to(torch.bfloat16)


def copy_bytes(block_params: int, other_params: int, half: bool) -> int:
    """The frozen copy's bytes: the blocks' matrices in bf16 where `half` (`halve_block_matrices`; their norms
    counted with them), the rest in float32."""
    return (2 if half else 4) * block_params + 4 * other_params
