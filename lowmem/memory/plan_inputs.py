"""What the memory plan reads and what it is made of: the model's shape, the run's inputs, and a part of the plan.

Plain numbers, so that a plan is made before anything is built (`lowmem.memory.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

FLOAT32 = 4
# Phases: a part is held all along, or only while its phase lasts (loading a source model's weights comes first).
RESIDENT, LOAD, STEP, VALIDATION, SAVE, EXPORT = "resident", "load", "step", "validation", "save", "export"
PHASES = (LOAD, STEP, VALIDATION, SAVE, EXPORT)
SINGLE, DDP, FSDP, DEEPSPEED = "single", "ddp", "fsdp", "deepspeed"
STRATEGIES = (SINGLE, DDP, FSDP, DEEPSPEED)


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
    tied_head: bool = True  # the head shares the embedding's weight (else it has its own, as large)

    @property
    def root_params(self) -> int:
        """Parameters outside the blocks: the embedding (and an untied head), norms, a position table."""
        return self.params - self.n_layer * self.block_params

    @property
    def embedding_params(self) -> int:
        """The token embedding's parameters: padded vocabulary x width, each of the model's two ends."""
        return self.padded_vocab * self.n_embd

    @property
    def largest_tensor(self) -> int:
        """The parameters of the model's largest tensor: the embedding, or a block's widest matrix."""
        return max(self.embedding_params, self.mlp_hidden * self.n_embd)


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
    resuming: bool = False  # a resume loads the optimizer's state with the weights: the moments exist from the load
    mirrors_cuda: bool = False  # on the CPU, `--mirror_cuda`: the plan's GPU choices are made as on a GPU

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def gpu_choices(self) -> bool:
        """Whether the plan shapes the step as on a GPU (merged micro-batches, whole logits): on a GPU, and on the
        CPU under `--mirror_cuda`, where the host's budget stands for the GPU's memory."""
        return self.on_gpu or self.mirrors_cuda

    @property
    def frozen_bytes(self) -> int:
        """Bytes a parameter of a frozen base takes: 2 in a bf16 run (stored in the dtype it computes in), else 4."""
        return 2 if self.model.adapter_params and self.bf16 else FLOAT32

    @property
    def gathered_bytes(self) -> int:
        """Bytes a parameter takes gathered for compute under FSDP: FSDP2's bf16 policy gathers in bf16."""
        return 2 if self.bf16 else FLOAT32

    @property
    def shards(self) -> int:
        """Over how many processes the model states are split (1 unless FSDP or DeepSpeed)."""
        return self.world_size if self.strategy in (FSDP, DEEPSPEED) else 1


@dataclass(frozen=True)
class PlanPart:
    """One line of the plan: bytes per process, how they were counted, and when they are held."""

    name: str
    bytes: int
    basis: str
    phase: str = RESIDENT
    main_only: bool = False  # held by the main process only (the save-time copy, the export)
    absent_in: tuple[str, ...] = ()  # phases a resident part does not exist in yet (the moments, while loading)


def with_inputs(plan_inputs: PlanInputs, **changes: object) -> PlanInputs:
    """`plan_inputs` with some fields changed (a lever turned on, another number of processes)."""
    return replace(plan_inputs, **changes)  # type: ignore[arg-type]
