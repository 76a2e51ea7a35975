"""The memory plan: each process's high-water predicted by part, before the model is built.

A process's memory is what it holds all along (the interpreter and libraries, the data pipeline, the weights
and the optimizer state) plus what one phase adds while it lasts: a training step (gradients, activations,
the loss), a validation (an evaluation forward pass, the key/value cache of generation, under FSDP a whole
replica of the model) or, on the main process, a save. The phases come one after another, so the high-water
is what is held all along plus the largest phase:

    high-water = resident + max(step, validation, save)

On the CPU everything lives in host memory; on a GPU the model side lives on the device and the host holds
the interpreter, the CUDA runtime, the data pipeline and the save-time copy. The figures are arithmetic on
the model's shape (saved activations counted tensor by tensor from the model's own forward pass, see
`activation_bytes_per_position`) plus constants calibrated against measured high-waters (docs/memory.md
lists the cases); everything here is plain numbers, so it runs before anything is built.

Known arithmetic it follows: AdamW in float32 holds 16 bytes per parameter under DDP (weights 4, gradients 4,
moments 8), about 16/N under FSDP full shard plus the gathered weights of a block or two; activations are
counted per block, and with per-block checkpointing only each block's input plus one block's worth is kept;
whole logits are tokens x vocabulary x 4 bytes per copy, a chunk's worth when the loss is chunked.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from lowmem.units import MB, gib_text

FLOAT32 = 4
# Phases: a part is held all along, or only while its phase lasts (loading a source model's weights comes first).
RESIDENT, LOAD, STEP, VALIDATION, SAVE = "resident", "load", "step", "validation", "save"
PHASES = (LOAD, STEP, VALIDATION, SAVE)
SINGLE, DDP, FSDP, DEEPSPEED = "single", "ddp", "fsdp", "deepspeed"
STRATEGIES = (SINGLE, DDP, FSDP, DEEPSPEED)

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
# A plan fits when it leaves this share of the budget free: page cache, the allocator's rounding, a
# micro-batch larger than the sampled ones.
PLAN_MARGIN = 0.10


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of the GPT: its sizes and parameter counts (from a model built on the meta device)."""

    n_layer: int
    n_embd: int
    n_head: int
    mlp_hidden: int
    padded_vocab: int
    max_seq_len: int
    architecture: str  # "llama" or "gpt2"
    params: int  # the tied embedding / head counted once
    block_params: int  # one transformer block
    adapter_params: int = 0  # low-rank adapters (LoRA): then only they have gradients and optimizer state
    adapter_dropout_bytes: int = 0  # per position, over every block: the adapters' dropped-out inputs and masks

    @property
    def root_params(self) -> int:
        """Parameters outside the blocks: the embedding (tied to the head), norms, a position table."""
        return self.params - self.n_layer * self.block_params


@dataclass(frozen=True)
class PlanInputs:
    """Everything the plan depends on: the model, the batches, the memory savers and how the run is laid out.

    `micro_batch_positions` is the largest micro-batch's tensor size in positions (sequences x width, padding
    included), from a sample of the training rows run through the real collate; `eval_positions` is a
    validation batch's.
    """

    model: ModelShape
    micro_batch_positions: int
    sequence_width: int
    masked_attention: bool  # packed rows: attention within each row needs a mask
    micro_batch_rows: int
    gradient_accumulation_steps: int
    loss_chunk_tokens: int
    activation_checkpointing: bool
    malloc_mmap_threshold_mb: float
    strategy: str = SINGLE
    deepspeed_offload: bool = False
    processes: int = 1  # on this machine
    world_size: int = 1  # over all machines: what FSDP and ZeRO shard over
    device: str = "cpu"
    bf16: bool = False
    workers: int = 0  # DataLoader workers per process
    base_bytes: int = 0  # the interpreter and libraries, measured at start
    data_bytes: int = 0  # the data pipeline of one reader
    eval_positions: int = 0
    generation_rows: int = 0  # rows per batch of BLEU generation (0: no generation)
    generation_positions: int = 0  # the key/value cache's length
    launcher: bool = False  # under `accelerate launch`
    gpu_bytes: int = 0  # one device's memory (0: unknown or no GPU)
    tokens_estimated: bool = False  # no tokenizer yet: positions counted from characters (an upper bound)
    compiled: bool = False  # torch.compile of the training model
    compile_workers: int = 0  # processes of inductor's compile pool per process (0: it compiles in the process)
    generation_prompts: int = 0  # a process's share of the prompts BLEU-4 answers (generation batches hold fewer)
    load_chunk_bytes: int = 0  # a run started from a model: the most bytes of its files mapped at once
    static_shapes: bool = False  # fixed batch shapes: a compiled run compiles them all before its first step
    reference_bytes: int = 0  # preference training: the frozen copy of the starting model its reference is

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def shards(self) -> int:
        """Over how many processes the model states are split (1 unless FSDP or DeepSpeed)."""
        return self.world_size if self.strategy in (FSDP, DEEPSPEED) else 1


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


@dataclass(frozen=True)
class PlanPart:
    """One line of the plan: bytes per process, how they were counted, and when they are held."""

    name: str
    bytes: int
    basis: str
    phase: str = RESIDENT
    main_only: bool = False  # held by the main process only (the save-time copy)


@dataclass(frozen=True)
class MemoryPlan:
    """The predicted memory of each process of a run, by part; see the module's docstring."""

    inputs: PlanInputs
    host: tuple[PlanPart, ...]  # per process, in host memory
    device: tuple[PlanPart, ...] = ()  # per GPU (empty on the CPU)
    machine: tuple[PlanPart, ...] = ()  # once per machine: the launcher, DataLoader workers

    def high_water(self, main: bool = True, parts: Iterable[PlanPart] | None = None,
                   phases: tuple[str, ...] = PHASES) -> int:
        """Predicted high-water of one process (the main one holds the save-time copy too), over `phases`
        (training steps alone, for a benchmark that neither validates nor saves)."""
        parts = [part for part in (self.host if parts is None else parts) if main or not part.main_only]
        resident = sum(part.bytes for part in parts if part.phase == RESIDENT)
        return resident + max([sum(part.bytes for part in parts if part.phase == phase) for phase in phases])

    def phase_bytes(self, phase: str, main: bool = True) -> int:
        return sum(part.bytes for part in self.host if part.phase == phase and (main or not part.main_only))

    def largest_phase(self, main: bool = True) -> str:
        return max(PHASES, key=lambda phase: self.phase_bytes(phase, main))

    @property
    def machine_total(self) -> int:
        """This machine's predicted total: every local process at its high-water, plus the launcher and the
        workers held all along; or, when larger, every process in a phase plus the machine's parts held only then
        (torch.compile's worker pool, alive while the compile passes run their steps)."""
        processes = self.inputs.processes
        held = sum(part.bytes for part in self.machine if part.phase == RESIDENT)
        total = self.high_water(main=True) + (processes - 1) * self.high_water(main=False) + held
        for phase in {part.phase for part in self.machine} - {RESIDENT}:
            in_phase = (self.high_water(True, phases=(phase,))
                        + (processes - 1) * self.high_water(False, phases=(phase,)))
            total = max(total, in_phase + held + sum(part.bytes for part in self.machine if part.phase == phase))
        return total

    @property
    def device_peak(self) -> int:
        """Predicted peak of one GPU (0 on the CPU)."""
        return self.high_water(parts=self.device) if self.device else 0

    def fits(self, budget_bytes: int, margin: float = PLAN_MARGIN) -> bool:
        """True when the machine total, and each GPU where its size is known, leave `margin` free."""
        host_ok = self.machine_total <= budget_bytes * (1 - margin)
        gpu = self.inputs.gpu_bytes
        return host_ok and (not self.device or not gpu or self.device_peak <= gpu * (1 - margin))


# ----- the parts ----------------------------------------------------------------------------------------------
def _mb(value: float) -> str:
    return f"{value / MB:,.0f} MB"


def _millions(count: int) -> str:
    return f"{count / 1e6:,.1f} M"


def _states(inputs: PlanInputs, where: str) -> list[PlanPart]:
    """Weights, gradients and AdamW's moments, as the strategy holds them, in `where` (host or device)."""
    if inputs.model.adapter_params:
        return _adapter_states(inputs)
    params, shards = inputs.model.params, inputs.shards
    share = f"/ {shards} shards" if shards > 1 else ""
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
                                  f"16 B x {_millions(params)} {share} (master weights, moments, gradients)"))
        return parts
    if inputs.strategy == FSDP:
        parts.append(PlanPart("model weights", FLOAT32 * params // shards, f"4 B x {_millions(params)} {share}"))
        parts.append(PlanPart("AdamW moments", 2 * FLOAT32 * params // shards, f"8 B x {_millions(params)} {share}"))
        parts.append(PlanPart("gradients", FLOAT32 * params // shards, f"4 B x {_millions(params)} {share}", STEP))
        model = inputs.model
        gathered = FLOAT32 * (2 * model.root_params + 3 * model.block_params)
        parts.append(PlanPart("gathered weights and gradients", gathered,
                              "the root's weights and gradient whole, 3 blocks' worth of weights and gradients", STEP))
        return parts
    parts.append(PlanPart("model weights", FLOAT32 * params, f"4 B x {_millions(params)}"))
    parts.append(PlanPart("AdamW moments", 2 * FLOAT32 * params, f"8 B x {_millions(params)}"))
    if inputs.strategy == DDP:
        # Gradients are views into DDP's all-reduce buckets, which live as long as the model.
        parts.append(PlanPart("gradients (DDP buckets)", FLOAT32 * params, f"4 B x {_millions(params)}"))
    else:
        parts.append(PlanPart("gradients", FLOAT32 * params, f"4 B x {_millions(params)}", STEP))
    if inputs.strategy == DEEPSPEED:
        parts.append(PlanPart("ZeRO partitions", 8 * params // shards, f"8 B x {_millions(params)} {share}"))
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
    """A run that trains adapters: the frozen base and the adapters as weights, gradients and AdamW's moments for
    the adapters only (sharded under FSDP as the weights are)."""
    model, shards = inputs.model, inputs.shards
    share = f" / {shards} shards" if shards > 1 else ""
    adapters = model.adapter_params
    parts = [PlanPart("model weights", FLOAT32 * (model.params + adapters) // shards,
                      f"4 B x {_millions(model.params + adapters)}{share}, the base frozen"),
             PlanPart("AdamW moments", 2 * FLOAT32 * adapters // shards,
                      f"8 B x {_millions(adapters)}{share}, the adapters only")]
    when = RESIDENT if inputs.strategy == DDP else STEP
    parts.append(PlanPart("gradients", FLOAT32 * adapters // shards, f"4 B x {_millions(adapters)}{share}, the "
                          "adapters", when))
    if inputs.strategy == FSDP:
        parts.append(PlanPart("gathered weights", FLOAT32 * (model.root_params + 3 * model.block_params),
                              "the root's weights whole, 3 blocks' worth of weights", STEP))
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
        kept += positions * model.adapter_dropout_bytes
        basis += f", and the adapters' dropped-out inputs ({model.adapter_dropout_bytes / 1e3:,.1f} kB a position)"
    parts = [PlanPart("activations", int(kept), basis, STEP)]
    V, C = model.padded_vocab, model.n_embd
    around = positions * (3 * C * FLOAT32 + (model.max_seq_len if inputs.masked_attention else 0))
    # The head's gradient, twice (its buffer in the chunked loss and the parameter's): none for a frozen head.
    head_grads, head_text = (0, "") if model.adapter_params else (2 * V * C * FLOAT32, ", the head's gradient")
    if inputs.loss_chunk_tokens and inputs.on_gpu and inputs.bf16:
        # Under bf16 autocast a chunk's logits come out of the matmul in bf16 and are read again in float32 with
        # their softmax's gradient (about 8 B a logit), and the head's weight is cast to a bf16 copy for it.
        chunk = min(inputs.loss_chunk_tokens, positions)
        loss = head_grads + V * C * 2 + chunk * V * 8 + around
        basis = f"chunks of {chunk:,} tokens x {V:,} x 8 B{head_text} and its bf16 copy"
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
    """An evaluation forward pass or a batch of generation, whichever is larger; FSDP's whole replica."""
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
    if inputs.strategy != FSDP:
        return [PlanPart("evaluation", int(evaluation), basis, VALIDATION)]
    # FSDP evaluates a whole replica, built from weights gathered in full and freed once it is loaded.
    weights = FLOAT32 * model.params
    if weights > evaluation:
        evaluation, basis = weights, f"the gathered weights while the replica loads: 4 B x {_millions(model.params)}"
    return [PlanPart("whole replica for evaluation", weights, f"4 B x {_millions(model.params)}", VALIDATION),
            PlanPart("evaluation", int(evaluation), basis, VALIDATION)]


def _save_copy(inputs: PlanInputs) -> list[PlanPart]:
    """What the main process gathers or copies to host memory to write a checkpoint."""
    params = inputs.model.params
    if inputs.strategy == FSDP or inputs.on_gpu:
        return [PlanPart("save-time copy of the weights", FLOAT32 * params, f"4 B x {_millions(params)}", SAVE,
                         main_only=True)]
    return []  # on the CPU, safetensors and torch.save write the tensors in place


def _heap(parts: list[PlanPart], inputs: PlanInputs) -> list[PlanPart]:
    """glibc's keep of freed step memory (no fixed mmap threshold), or the overhead a fixed one leaves."""
    step = sum(part.bytes for part in parts if part.phase == STEP and part.name in ("activations", "loss and logits"))
    if inputs.malloc_mmap_threshold_mb > 0:
        return [PlanPart("allocator overhead", int(STEP_OVERHEAD * step), f"{STEP_OVERHEAD:.0%} of the step", STEP)]
    # What the step allocates in all: checkpointing recomputes every block's activations in the backward pass.
    allocated = sum(part.bytes for part in _step(replace(inputs, activation_checkpointing=False), 1.0))
    return [PlanPart("freed memory the C heap keeps", int(HEAP_RETENTION * allocated),
                     f"{HEAP_RETENTION:.0%} of what a step allocates (no fixed mmap threshold)", STEP)]


def plan_memory(inputs: PlanInputs) -> MemoryPlan:
    """The memory plan of a run; see the module's docstring for how the parts add up."""
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
        device = [PlanPart("CUDA context", CUDA_CONTEXT_DEVICE_BYTES, "reasoned, not measured"),
                  *_states(inputs, "device"), *_reference(inputs), *_step(inputs, share),
                  *_validation(inputs, "device")]
        allocator = int(CUDA_ALLOCATOR_OVERHEAD * sum(part.bytes for part in device if part.phase != RESIDENT))
        device.append(PlanPart("caching allocator", allocator, f"{CUDA_ALLOCATOR_OVERHEAD:.0%} of what comes and goes",
                               STEP))
        if inputs.strategy == DEEPSPEED and inputs.deepspeed_offload:
            host += _states(inputs, "host")
    else:
        host += _states(inputs, "host") + _reference(inputs) + _step(inputs, 1.0)
        host += _heap(host, inputs) + _validation(inputs, "host")
    host += _save_copy(inputs) + _load(inputs)
    return MemoryPlan(inputs, tuple(host), tuple(device), tuple(machine))


def _load(inputs: PlanInputs) -> list[PlanPart]:
    """What loading a source model's weights adds to the weights themselves (counted above, a shard each under FSDP):
    a slice of the file's pages and its cast, never the whole model (`lowmem.source.load`)."""
    if not inputs.load_chunk_bytes:
        return []
    share = f"its shards' rows only (1/{inputs.shards})" if inputs.shards > 1 else "every row"
    return [PlanPart("loading the source's weights", inputs.load_chunk_bytes,
                     f"{_mb(inputs.load_chunk_bytes)} of the files mapped at a time and cast into the weights, "
                     f"{share}; the pages handed back after each slice", LOAD)]


def with_inputs(plan_inputs: PlanInputs, **changes: object) -> PlanInputs:
    """`plan_inputs` with some fields changed (a lever turned on, another number of processes)."""
    return replace(plan_inputs, **changes)  # type: ignore[arg-type]


# ----- the table ----------------------------------------------------------------------------------------------
def format_plan(plan: MemoryPlan, budget_bytes: int | None = None, budget_source: str = "") -> str:
    """The plan as a table: one line per part (MB per process), the high-waters, the machine total and the verdict."""
    inputs = plan.inputs
    width = max(len(part.name) for part in (*plan.host, *plan.device, *plan.machine)) + 2
    model = inputs.model
    trained = (f" frozen and {_millions(model.adapter_params)} in adapters that train (AdamW moments and gradients "
               f"of {_mb(3 * FLOAT32 * model.adapter_params // inputs.shards)} per process where training every "
               f"weight would take {_mb(3 * FLOAT32 * model.params // inputs.shards)})") if model.adapter_params else ""
    lines = [f"Memory plan: {inputs.model.architecture}, {_millions(inputs.model.params)} parameters{trained}, "
             f"{inputs.strategy.upper() if inputs.strategy != SINGLE else 'one process'}, "
             f"{inputs.processes} process(es) on this machine, {inputs.device}"
             f"{', bf16' if inputs.bf16 and inputs.on_gpu else ', float32'}; micro-batch {inputs.micro_batch_rows} "
             f"rows x {inputs.gradient_accumulation_steps}, largest {inputs.micro_batch_positions:,} positions"
             + (" (counted from characters: no tokenizer yet)" if inputs.tokens_estimated else "")]

    def block(title: str, parts: tuple[PlanPart, ...]) -> None:
        lines.append(f"  {title:<{width}}{'MB':>9}  when        how")
        for part in parts:
            when = part.phase + (" (main)" if part.main_only else "")
            lines.append(f"  {part.name:<{width}}{part.bytes / MB:>9,.0f}  {when:<10}  {part.basis}")

    block("host, per process", plan.host)
    main, other = plan.high_water(True), plan.high_water(False)
    lines.append(f"  high-water per process: {_mb(main)} (main process)"
                 + (f", {_mb(other)} (others)" if inputs.processes > 1 and other != main else "")
                 + f"; the largest phase is the {plan.largest_phase()}")
    if plan.machine:
        block("host, once per machine", plan.machine)
    if plan.device:
        block("each GPU", plan.device)
        gpu = f" of {_mb(inputs.gpu_bytes)}" if inputs.gpu_bytes else " (the GPU's size is unknown here)"
        lines.append(f"  GPU peak: {_mb(plan.device_peak)}{gpu}")
    total = plan.machine_total
    if budget_bytes:
        verdict = "fits" if plan.fits(budget_bytes) else "does not fit"
        lines.append(f"  this machine: {_mb(total)} of a {gib_text(budget_bytes)} budget"
                     f"{' (' + budget_source + ')' if budget_source else ''}: {verdict} "
                     f"(a plan fits with {PLAN_MARGIN:.0%} of the budget left free)")
    else:
        lines.append(f"  this machine: {_mb(total)}")
    return "\n".join(lines)
