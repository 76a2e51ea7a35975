"""The memory plan's parts, each counted from the model's shape and the run's inputs: what the interpreter, the data
pipeline, the model states, a step, a validation, a save, the export and the load each hold (`lowmem.memory.plan`
adds them up by phase).
"""

from __future__ import annotations

from dataclasses import replace

from lowmem.memory.plan_inputs import (DDP, DEEPSPEED, EXPORT, FLOAT32, FSDP, LOAD, RESIDENT, SAVE, STEP, VALIDATION,
                                       ModelShape, PlanInputs, PlanPart)
from lowmem.units import MB

# ----- calibration ---------------------------------------------------------------------------------------
# Without a fixed mmap threshold glibc serves a step's tensors from its heap and keeps what is freed: the
# high-water settles above the step's live peak, by a share of what the step allocates in all (the whole
# activations, even when checkpointing recomputes them a block at a time and never holds them together).
# Measured on the large config, 3 processes, 6 steps: DDP 6,474-6,609 MB, FSDP 5,684-5,999 MB, FSDP with
# checkpointing 3,655-3,781 MB; with --malloc_mmap_threshold_mb=1 none of it is kept.
HEAP_RETENTION = 0.65
# What a fixed threshold leaves: small tensors still come from the heap, and the backward pass holds a
# block's gradients beside the saved activations.
STEP_OVERHEAD = 0.05
# A DataLoader worker: a forked interpreter whose own pages (USS) grow to its Python objects, the tokenizer
# and one shuffle buffer (measured 188 MB of USS on the demo).
WORKER_BYTES = 200 * MB
# The `accelerate launch` process itself (measured 0.26 GB beside 3 workers).
LAUNCHER_BYTES = 260 * MB
# Reasoned, not measured (one GPU has run this project, and these were not measured apart there): the host memory
# of a process that has loaded the CUDA runtime, cuBLAS and cuDNN, and the device memory of its context.
CUDA_HOST_BYTES = 1200 * MB
CUDA_CONTEXT_DEVICE_BYTES = 500 * MB
# torch.compile: what a compiled model adds to its process (the traced graphs, the generated kernels loaded),
# measured 77-104 MB on the CPU for a tiny model and the large config; and each process of inductor's pool of
# compile workers, alive while the first steps compile: measured about 8 GB for a pool of 16 on an H200 host (RSS,
# its shared pages counted in each), 416 MB for a pool of 2 on the CPU.
COMPILE_HOST_BYTES = 150 * MB
COMPILE_WORKER_BYTES = {"cuda": 500 * MB, "cpu": 210 * MB}
# The CUDA caching allocator rounds and splits blocks: reserved runs above allocated.
CUDA_ALLOCATOR_OVERHEAD = 0.10
# Under bf16 autocast the matmul outputs are bf16 while norms and the residual stream stay float32: about
# this share of the float32 activation bytes (reasoned, not measured).
BF16_ACTIVATION_SHARE = 0.6
# Without a fixed mmap threshold the C heap also keeps some of what an FSDP validation's gathered pieces freed, counted
# as this share of what a validation allocates: on 3 processes of a model of Qwen2.5-0.5B's widths and vocabulary the
# validations peaked 0-50 MB above the rest of their figure with 4 layers and 100-150 MB above it with 24.
VALIDATION_HEAP_RETENTION = 0.05
# What an FSDP process keeps once it trains, beyond the model states (the collectives' and the autograd engine's
# buffers, the freed blocks the C heap keeps), in blocks' worth of weights as they are gathered: measured 150-200 MB
# during the steps of 3 FSDP processes of a model of Qwen2.5-0.5B's shapes on the CPU, whose blocks are 60 MB (the RSS
# after the first steps against before them), trained in full or with adapters. Most of it is the heap's, handed back
# as the next phase begins: at the saves that followed, 40-110 MB of it was left, the blocks' worth kept by every
# phase after the first step.
FSDP_TRAINING_BLOCKS = 3
FSDP_KEPT_BLOCKS = 1
# On a GPU the blocks are gathered in its memory: the host keeps the small buffers the CPU runs measured beside them.
FSDP_GPU_HOST_BYTES = 160 * MB
# What writing a model a slice of rows at a time holds beyond the slice itself (lowmem.checkpoint.model_files): the
# slice read, its cast or merged copy, the adapters' update of its rows.
EXPORT_SLICE_BYTES = 3 * 64 * MB


def activation_bytes_per_position(model: ModelShape, masked: bool, bytes_per_value: float = FLOAT32) -> float:
    """The bytes one block keeps for the backward pass per position (float32), as autograd saves them.

    Counted from the model's forward pass (a test checks it against `saved_tensors_hooks` on both
    architectures): llama keeps 12 x C (its norms' inputs and outputs, q, k, v and the rotated q, k, the
    attention output before and after the projection) + 4 x H (SwiGLU's gate, its SiLU, up and their
    product) + one float per head (the attention's log-sum-exp) + 2 (the norms' scales); gpt2 keeps 8 x C
    + 2 x H + heads + 4. Packed rows add the attention mask as floats, one per key.
    """
    C, H = model.n_embd, model.mlp_hidden
    if model.architecture == "llama":
        per_position = 12 * C + 4 * H + model.n_head + 2
    else:
        per_position = 8 * C + 2 * H + model.n_head + 4
    if masked:
        per_position += model.max_seq_len
    return per_position * bytes_per_value


def _mb(value: float) -> str:
    return f"{value / MB:,.0f} MB"


def _millions(count: int) -> str:
    return f"{count / 1e6:,.1f} M"


def _moments(inputs: PlanInputs, count: int, share: str) -> PlanPart:
    """AdamW's two moments of `count` parameters (per shard): made by the first step, or by a resume's load."""
    return PlanPart("AdamW moments", 2 * FLOAT32 * count // inputs.shards, f"8 B x {_millions(count)}{share}",
                    absent_in=() if inputs.resuming else (LOAD,))


def _fsdp_step(inputs: PlanInputs, step: list[PlanPart]) -> list[PlanPart]:
    """What FSDP holds during a step beyond the activations and the loss's chunk (`step`): the larger of two moments,
    which never coexist. At the loss, three blocks' weights gathered (the one computing and those prefetched) and the
    head's unit twice while it is gathered (its all-gather's buffer and the weight copied out of it), with the head's
    gradient when it trains; at the end of the backward pass, every parameter's sharded gradient, and an embedding
    that trains gathered again, twice, for its dense gradient (the activations are freed by then)."""
    model, each, shards = inputs.model, inputs.gathered_bytes, inputs.shards
    unit, blocks = model.embedding_params, 3 * model.block_params
    trained_head = not model.adapter_params
    at_loss = each * (blocks + 2 * unit) + (FLOAT32 * unit if trained_head else 0)
    trained = model.adapter_params or model.params
    at_end = FLOAT32 * trained // shards + ((each * 2 + FLOAT32) * unit if trained_head else 0)
    beside = sum(part.bytes for part in step)  # the activations and the loss, held at the loss only
    basis = (f"the larger of the loss's moment ({at_loss / MB:,.0f} MB: 3 blocks' weights and the head's unit twice, "
             f"{each} B a parameter" + (", the head's gradient" if trained_head else "") + ") and the backward pass's "
             f"end ({at_end / MB:,.0f} MB: the sharded gradients" + (", the embedding gathered twice and its "
             "gradient" if trained_head else "") + ")")
    return [PlanPart("gathered weights and gradients", max(at_loss, at_end - beside), basis, STEP)]


def _fsdp_training_heap(inputs: PlanInputs) -> list[PlanPart]:
    """What an FSDP process keeps once it trains: the collectives' and the autograd engine's buffers, the freed small
    blocks the C heap keeps (made by the first step)."""
    if inputs.strategy != FSDP:
        return []
    if inputs.on_gpu:  # the gathered blocks and their buffers live on the GPU (its allocator's share counts them)
        return [PlanPart("kept once training", FSDP_GPU_HOST_BYTES, f"{FSDP_GPU_HOST_BYTES / MB:,.0f} MB of the "
                         "collectives' and autograd's host buffers, reasoned, not measured", absent_in=(LOAD,))]
    block = inputs.gathered_bytes * inputs.model.block_params
    stepping = FSDP_TRAINING_BLOCKS - FSDP_KEPT_BLOCKS
    return [PlanPart("kept once training", FSDP_KEPT_BLOCKS * block, f"{FSDP_KEPT_BLOCKS} block's worth of weights at "
                     f"{inputs.gathered_bytes} B, measured", absent_in=(LOAD,)),
            PlanPart("freed memory the C heap keeps (FSDP)", stepping * block, f"{stepping} blocks' worth more while "
                     "the steps run, handed back as the next phase begins, measured", STEP)]


def _states(inputs: PlanInputs, where: str) -> list[PlanPart]:
    """Weights, gradients and AdamW's moments, as the strategy holds them, in `where` (host or device)."""
    if inputs.model.adapter_params:
        return _adapter_states(inputs)
    params, shards = inputs.model.params, inputs.shards
    share = f" / {shards} shards" if shards > 1 else ""
    parts = []
    if inputs.strategy == DEEPSPEED and inputs.deepspeed_offload:
        # ZeRO-2 with offload: the device computes with its weights; the float32 master weights, the moments
        # and the gradients' partitions live in host memory.
        if where == "device":
            weight_bytes = 2 if inputs.bf16 else FLOAT32
            parts.append(PlanPart("model weights", weight_bytes * params, f"{weight_bytes} B x {_millions(params)}"))
            parts.append(PlanPart("gradients (computing)", weight_bytes * params,
                                  f"{weight_bytes} B x {_millions(params)}", STEP))
        else:
            parts.append(PlanPart("optimizer (host offload)", 16 * params // shards,
                                  f"16 B x {_millions(params)}{share} (master weights, moments, gradients)"))
        return parts
    if inputs.strategy == FSDP:  # the gradients: with the gathered weights (`_fsdp_step`)
        parts.append(PlanPart("model weights", FLOAT32 * params // shards, f"4 B x {_millions(params)}{share}"))
        parts.append(_moments(inputs, params, share))
        return parts
    parts.append(PlanPart("model weights", FLOAT32 * params, f"4 B x {_millions(params)}"))
    parts.append(_moments(inputs, params, ""))
    if inputs.strategy == DDP:
        # Gradients are views into DDP's all-reduce buckets, which live as long as the model.
        parts.append(PlanPart("gradients (DDP buckets)", FLOAT32 * params, f"4 B x {_millions(params)}"))
    else:
        parts.append(PlanPart("gradients", FLOAT32 * params, f"4 B x {_millions(params)}", STEP))
    if inputs.strategy == DEEPSPEED:
        parts.append(PlanPart("ZeRO partitions", 8 * params // shards, f"8 B x {_millions(params)}{share}"))
    return parts


def _reference(inputs: PlanInputs) -> list[PlanPart]:
    """Preference training against a frozen copy of the starting model: that copy, held all along where the model
    trains."""
    if not inputs.reference_bytes:
        return []
    per_param = inputs.reference_bytes / max(inputs.model.params, 1)
    return [PlanPart("DPO reference (frozen copy)", inputs.reference_bytes,
                     f"{per_param:.1f} B x {_millions(inputs.model.params)} (bf16 block matrices where the run is "
                     "bf16 on a GPU), no gradients or moments" if per_param < 4 else
                     f"4 B x {_millions(inputs.model.params)}, no gradients or moments")]


def _adapter_states(inputs: PlanInputs) -> list[PlanPart]:
    """A run that trains adapters: the frozen base (in bf16 in a bf16 run) and the adapters as weights, gradients and
    AdamW's moments for the adapters only (sharded under FSDP as the weights are)."""
    model, shards = inputs.model, inputs.shards
    share = f" / {shards} shards" if shards > 1 else ""
    adapters, frozen = model.adapter_params, inputs.frozen_bytes
    parts = [PlanPart("model weights", (frozen * model.params + FLOAT32 * adapters) // shards,
                      f"({frozen} B x {_millions(model.params)} frozen + 4 B x {_millions(adapters)} adapters){share}"),
             _moments(inputs, adapters, f"{share}, the adapters only")]
    if inputs.strategy == FSDP:  # the gradients: with the gathered weights (`_fsdp_step`)
        return parts
    when = RESIDENT if inputs.strategy == DDP else STEP
    parts.append(PlanPart("gradients", FLOAT32 * adapters // shards, f"4 B x {_millions(adapters)}{share}, the "
                          "adapters", when))
    return parts


def _step(inputs: PlanInputs, share: float) -> list[PlanPart]:
    """The training step's activations and loss; `share` scales float32 bytes (bf16 on a GPU)."""
    model, positions = inputs.model, inputs.micro_batch_positions
    per_block = activation_bytes_per_position(model, inputs.masked_attention) * share
    if inputs.activation_checkpointing:
        kept = positions * (model.n_layer * model.n_embd * FLOAT32 * share + per_block)
        basis = (f"{positions:,} positions x ({model.n_layer} block inputs of {model.n_embd} + one block's "
                 f"{per_block / 1e3:,.1f} kB) (activation checkpointing)")
    else:
        kept = positions * model.n_layer * per_block
        basis = f"{positions:,} positions x {model.n_layer} blocks x {per_block / 1e3:,.1f} kB"
    if model.adapter_dropout_bytes:  # each adapter's input, dropped out: a copy and its mask kept for backward
        # Under activation checkpointing the adapters are recomputed with their block: one block's copies at a time.
        dropped = model.adapter_dropout_bytes // (model.n_layer if inputs.activation_checkpointing else 1)
        kept += positions * dropped
        basis += f", and the adapters' dropped-out inputs ({dropped / 1e3:,.1f} kB a position)"
    parts = [PlanPart("activations", int(kept), basis, STEP)]
    V, C = model.padded_vocab, model.n_embd
    around = positions * (3 * C * FLOAT32 + (model.max_seq_len if inputs.masked_attention else 0))
    # The head's gradient (the chunked loss's buffer, which becomes the parameter's): none for a frozen head, and under
    # FSDP counted with the gathered weights (`_fsdp_step`).
    counted = not model.adapter_params and inputs.strategy != FSDP
    head_grads, head_text = (V * C * FLOAT32, ", the head's gradient") if counted else (0, "")
    if inputs.loss_chunk_tokens and inputs.on_gpu and inputs.bf16:
        # Under bf16 autocast a chunk's logits come out of the matmul in bf16 and are read again in float32 with
        # their softmax's gradient (about 8 B a logit), and the head's weight is cast to a bf16 copy for it (FSDP
        # gathers it in bf16 already: its unit is counted with the gathered weights).
        chunk = min(inputs.loss_chunk_tokens, positions)
        copy = 0 if inputs.strategy == FSDP else V * C * 2
        loss = head_grads + copy + chunk * V * 8 + around
        basis = f"chunks of {chunk:,} tokens x {V:,} x 8 B{head_text}" + (" and its bf16 copy" if copy else "")
    elif inputs.loss_chunk_tokens:
        chunk = min(inputs.loss_chunk_tokens, positions)
        loss = head_grads + chunk * V * FLOAT32 + around
        basis = f"chunks of {chunk:,} tokens x {V:,} x 4 B{head_text.replace(',', ', and')}"
    else:
        loss = 3 * positions * V * FLOAT32 + around
        basis = f"3 copies of {positions:,} x {V:,} x 4 B (whole logits)"
    parts.append(PlanPart("loss and logits", int(loss), basis, STEP))
    return parts


def _validation(inputs: PlanInputs, where: str) -> list[PlanPart]:
    """An evaluation forward pass or a batch of generation, whichever is larger; under FSDP the model runs sharded,
    with a block's and a unit's weights gathered at a time."""
    model = inputs.model
    V, C, H, L = model.padded_vocab, model.n_embd, model.mlp_hidden, model.n_layer
    chunk = min(inputs.loss_chunk_tokens or inputs.eval_positions, inputs.eval_positions)
    # One block's temporaries at a time (no gradients kept): the q, k, v and their rotated copies, the attention
    # output and the MLP's hidden tensors; then a chunk's logits and their log-softmax.
    hidden = 4 * H if model.architecture == "llama" else 2 * H
    forward = inputs.eval_positions * (6 * C + hidden) * FLOAT32 + 2 * chunk * V * FLOAT32
    cache = (L * 2 * inputs.generation_rows * inputs.generation_positions * C * FLOAT32
             + 4 * inputs.generation_rows * V * FLOAT32)
    evaluation = max(forward, cache)
    basis = "key/value cache of a generation batch" if cache > forward else "a no-grad forward pass"
    parts = [PlanPart("evaluation", int(evaluation), basis, VALIDATION)]
    if inputs.strategy == FSDP:
        # The embedding's (or the head's) unit twice while it is gathered: the all-gather's buffer, then the weight
        # copied out of it.
        each = inputs.gathered_bytes
        gathered = each * (2 * model.block_params + 2 * model.embedding_params)
        parts.append(PlanPart("gathered weights (evaluation)", gathered,
                              f"{each} B x (2 blocks' worth + the embedding's or the head's unit and its all-gather "
                              "buffer): run sharded, never gathered whole", VALIDATION))
        if inputs.malloc_mmap_threshold_mb <= 0 and where == "host":
            kept = int(VALIDATION_HEAP_RETENTION * (gathered + evaluation))
            parts.append(PlanPart("freed memory the C heap keeps (evaluation)", kept,
                                  f"{VALIDATION_HEAP_RETENTION:.0%} of what a validation allocates (no fixed mmap "
                                  "threshold)", VALIDATION))
    return parts


def _save_copy(inputs: PlanInputs) -> list[PlanPart]:
    """What a save copies to host memory: under FSDP each rank its shards, one tensor at a time (none on the CPU,
    where they are written in place); elsewhere, on a GPU, the main process the whole weights."""
    params, adapters = inputs.model.params, inputs.model.adapter_params
    if adapters:  # a run of adapters saves them alone (its base is written once, at its start)
        return [PlanPart("save: the adapters gathered", FLOAT32 * adapters, f"4 B x {_millions(adapters)}", SAVE,
                         main_only=True)]
    if inputs.strategy == FSDP:
        if not inputs.on_gpu:
            return []
        shard = FLOAT32 * inputs.model.largest_tensor // inputs.shards
        return [PlanPart("save: a shard's host copy", shard, f"4 B x {_millions(inputs.model.largest_tensor)} / "
                         f"{inputs.shards} shards, one tensor at a time", SAVE)]
    if inputs.on_gpu:
        return [PlanPart("save-time copy of the weights", FLOAT32 * params, f"4 B x {_millions(params)}", SAVE,
                         main_only=True)]
    return []  # on the CPU, safetensors and torch.save write the tensors in place


def _export(inputs: PlanInputs) -> list[PlanPart]:
    """final/ and best/, written by the main process at the end: under FSDP from the checkpoints' shards, a slice of
    rows at a time; elsewhere from the model in memory, a tensor at a time (its host copy on a GPU, an adapted
    matrix merged in float32), and the best checkpoint of adapters from its files, merged a slice of rows at a
    time."""
    model = inputs.model
    slices = PlanPart("export of final/ and best/", EXPORT_SLICE_BYTES, "a slice of rows at a time from the "
                      "checkpoint's files, read, cast or merged, written", EXPORT, main_only=True)
    if inputs.strategy == FSDP:
        return [slices]
    # Merging an adapted matrix holds it in float32 three times: the base's rows cast, the adapters' update, their sum.
    matrix = model.mlp_hidden * model.n_embd
    largest = FLOAT32 * (model.largest_tensor if inputs.on_gpu else (3 * matrix if model.adapter_params else 0))
    if model.adapter_params and largest <= EXPORT_SLICE_BYTES:
        return [slices]
    if not largest:
        return []
    what = "the largest tensor's host copy" if inputs.on_gpu else "the largest adapted matrix merged in float32"
    return [PlanPart("export of final/ and best/", largest, f"{what}, one tensor at a time", EXPORT, main_only=True)]


def _heap(parts: list[PlanPart], inputs: PlanInputs) -> list[PlanPart]:
    """glibc's keep of freed step memory (no fixed mmap threshold), or the overhead a fixed one leaves."""
    step = sum(part.bytes for part in parts if part.phase == STEP and part.name in ("activations", "loss and logits"))
    if inputs.malloc_mmap_threshold_mb > 0:
        return [PlanPart("allocator overhead", int(STEP_OVERHEAD * step), f"{STEP_OVERHEAD:.0%} of the step", STEP)]
    # What the step allocates in all: checkpointing recomputes every block's activations in the backward pass.
    allocated = sum(part.bytes for part in _step(replace(inputs, activation_checkpointing=False), 1.0))
    return [PlanPart("freed memory the C heap keeps", int(HEAP_RETENTION * allocated),
                     f"{HEAP_RETENTION:.0%} of what a step allocates (no fixed mmap threshold)", STEP)]


def _load(inputs: PlanInputs) -> list[PlanPart]:
    """What loading a source model's weights adds to the weights themselves (counted above, a shard each under FSDP):
    a slice of the file's pages and its cast, never the whole model (`lowmem.source.load`)."""
    if not inputs.load_chunk_bytes:
        return []
    share = f"its shards' rows only (1/{inputs.shards})" if inputs.shards > 1 else "every row"
    return [PlanPart("loading the source's weights", inputs.load_chunk_bytes,
                     f"{_mb(inputs.load_chunk_bytes)} of the files mapped at a time and cast into the weights, "
                     f"{share}; the pages handed back after each slice", LOAD)]


def plan_parts(inputs: PlanInputs) -> tuple[list[PlanPart], list[PlanPart], list[PlanPart]]:
    """The plan's parts (host per process, each GPU, once per machine) of a run; `lowmem.memory.plan` adds them up."""
    host = [PlanPart("interpreter and libraries", inputs.base_bytes, "measured at start"),
            PlanPart("data pipeline", inputs.data_bytes, "row groups held and the shuffle buffer")]
    machine = []
    if inputs.launcher:
        machine.append(PlanPart("launcher", LAUNCHER_BYTES, "accelerate launch, measured"))
    if inputs.workers:
        count = inputs.workers * inputs.processes
        machine.append(PlanPart("DataLoader workers", count * (WORKER_BYTES + inputs.data_bytes),
                                f"{count} x ({_mb(WORKER_BYTES)} + the data pipeline)"))
    if inputs.compiled:
        host.append(PlanPart("torch.compile", COMPILE_HOST_BYTES, "graphs and generated kernels, measured"))
        if inputs.compile_workers:
            count = inputs.compile_workers * inputs.processes
            worker = COMPILE_WORKER_BYTES[inputs.device]
            # With fixed shapes every shape is compiled before the first step, and the pool is shut down then.
            machine.append(PlanPart("torch.compile workers", count * worker,
                                    f"{count} x {_mb(worker)}, while the compile passes run (shut down after them)"
                                    if inputs.static_shapes else f"{count} x {_mb(worker)}, alive all along (shapes "
                                    "compiled as they come)", STEP if inputs.static_shapes else RESIDENT))
    device: list[PlanPart] = []
    if inputs.on_gpu:
        host.append(PlanPart("CUDA runtime", CUDA_HOST_BYTES, "reasoned, not measured"))
        share = BF16_ACTIVATION_SHARE if inputs.bf16 else 1.0
        step = _step(inputs, share)
        device = [PlanPart("CUDA context", CUDA_CONTEXT_DEVICE_BYTES, "reasoned, not measured"),
                  *_states(inputs, "device"), *_reference(inputs), *step,
                  *(_fsdp_step(inputs, step) if inputs.strategy == FSDP else []), *_validation(inputs, "device")]
        allocator = int(CUDA_ALLOCATOR_OVERHEAD * sum(part.bytes for part in device if part.phase != RESIDENT))
        device.append(PlanPart("caching allocator", allocator, f"{CUDA_ALLOCATOR_OVERHEAD:.0%} of what comes and goes",
                               STEP))
        if inputs.strategy == DEEPSPEED and inputs.deepspeed_offload:
            host += _states(inputs, "host")
    else:
        step = _step(inputs, 1.0)
        host += _states(inputs, "host") + _reference(inputs) + step
        host += (_fsdp_step(inputs, step) if inputs.strategy == FSDP else []) + _heap(host, inputs)
        host += _validation(inputs, "host")
    host += _fsdp_training_heap(inputs) + _save_copy(inputs) + _export(inputs) + _load(inputs)
    return host, device, machine


