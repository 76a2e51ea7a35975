"""Memory savers chosen to fit the budget: the cheapest levers first, until the plan fits.

On a GPU, `choose_savers` first computes the loss over whole logits (a few % faster a step than in chunks) when
they fit and --loss_chunk_tokens was not given, and gives a step's rows to the fewest micro-batches that fit the
device and the host (one of 64 rows rather than 32 x 2): each micro-batch is a forward and backward pass of small
kernels, and the activations live on the device, so fewer, larger ones keep the GPU busy at no cost to host
memory. Then, while the plan does not fit, it turns on the next lever the user did not set, in order of cost:

    1. malloc_mmap_threshold_mb=1   CPU only: freed step memory goes back to the system instead of staying in
                                    glibc's heap (page faults each step; measured free on the large config)
    2. loss_chunk_tokens=2048       the loss a chunk at a time, no whole logits (no extra compute)
    3. activation_checkpointing     keep each block's input only and recompute the block (a third more compute)
    4. a smaller micro-batch        halve batch_size_per_gpu and double gradient_accumulation_steps, as often as
                                    needed: the rows of each optimizer step, and so the run's results, stay the same
                                    (smaller matmuls are less efficient on a GPU)

A field the user set explicitly is never changed. When nothing fits, `no_fit_message` says by how much and
what would: fewer processes, FSDP, a smaller micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection

from lowmem.memory.plan import (DDP, FSDP, PLAN_MARGIN, SINGLE, MemoryPlan, PlanInputs, plan_memory,
                                with_inputs)
from lowmem.program import command_line
from lowmem.units import MB, gib_text

DEFAULT_CHUNK_TOKENS = 2048
FIXED_MMAP_THRESHOLD_MB = 1.0
# The config fields a lever may change.
LEVER_FIELDS = ("malloc_mmap_threshold_mb", "loss_chunk_tokens", "activation_checkpointing", "batch_size_per_gpu",
                "gradient_accumulation_steps")


@dataclass
class SaverChoice:
    """What `choose_savers` decided: the config changes, why, and the plans before and after."""

    before: MemoryPlan
    plan: MemoryPlan
    budget_bytes: int
    changes: dict[str, object] = field(default_factory=dict)  # config field → value
    steps: list[str] = field(default_factory=list)  # one phrase per lever turned on
    merged: str = ""  # on a GPU, the step's rows given to fewer micro-batches: what, and why
    whole_logits: bool = False  # on a GPU, the loss over whole logits (chunks left for when memory needs them)

    @property
    def fits(self) -> bool:
        return self.plan.fits(self.budget_bytes)

    def line(self) -> str:
        """One log line: what was turned on and why, or that nothing was needed."""
        after = self.plan.machine_total
        budget = f"{gib_text(self.budget_bytes)} budget"
        merged = f"{self.merged} " if self.merged else ""
        if self.whole_logits:
            merged += ("Loss over whole logits on the GPU (--loss_chunk_tokens=0: they fit, and a chunked loss is "
                       "a little slower). ")
        if not self.steps:
            return (f"{merged}Memory savers: none needed (predicted {after / MB:,.0f} MB for this machine, within the "
                    f"{budget} less {PLAN_MARGIN:.0%}).")
        return (f"{merged}Memory savers turned on to fit {self._reason()}: {'; '.join(self.steps)} (predicted "
                f"{self._prediction()}). Settings given explicitly are kept; --memory_savers=off keeps every setting "
                "as given.")

    def _gpu_was_short(self) -> bool:
        gpu = self.before.inputs.gpu_bytes
        return bool(self.before.device and gpu and self.before.device_peak > gpu * (1 - PLAN_MARGIN))

    def _host_was_short(self) -> bool:
        return self.before.machine_total > self.budget_bytes * (1 - PLAN_MARGIN)

    def _reason(self) -> str:
        """What the savers were turned on for: the host's budget, the GPU's memory, or both."""
        budget = f"the {gib_text(self.budget_bytes)} budget"
        gpu = f"the GPU's {self.before.inputs.gpu_bytes / MB:,.0f} MB"
        if self._gpu_was_short():
            return f"{budget} and {gpu}" if self._host_was_short() else gpu
        return budget

    def _prediction(self) -> str:
        host = f"{self.before.machine_total / MB:,.0f} MB for this machine → {self.plan.machine_total / MB:,.0f} MB"
        if not self._gpu_was_short():
            return host
        gpu = f"a GPU peak of {self.before.device_peak / MB:,.0f} MB → {self.plan.device_peak / MB:,.0f} MB"
        return f"{host}, {gpu}" if self._host_was_short() else gpu


def _divisor_below(rows: int) -> int:
    """The largest divisor of `rows` that is at most half of it (1 for a prime)."""
    for candidate in range(rows // 2, 0, -1):
        if rows % candidate == 0:
            return candidate
    return 1


def choose_savers(inputs: PlanInputs, budget_bytes: int, explicit: Collection[str],
                  positions_for_rows: Callable[[int], int]) -> SaverChoice:
    """Turn on the cheapest levers the user left unset until the plan of `inputs` fits `budget_bytes`.

    Args:
        inputs: the run as configured.
        budget_bytes: this machine's budget.
        explicit: config fields the user set (never changed).
        positions_for_rows: the largest micro-batch's positions for a micro-batch of so many rows (a smaller
            micro-batch packs its rows differently).
    """
    choice = SaverChoice(before=plan_memory(inputs), plan=plan_memory(inputs), budget_bytes=budget_bytes)

    def apply(phrase: str, config_changes: dict[str, object], **plan_changes: object) -> None:
        nonlocal inputs
        inputs = with_inputs(inputs, **plan_changes)
        choice.plan = plan_memory(inputs)
        choice.changes.update(config_changes)
        choice.steps.append(phrase)

    batch_fixed = {"batch_size_per_gpu", "gradient_accumulation_steps"} & set(explicit)
    if inputs.on_gpu:
        inputs = _gpu_shape(choice, inputs, bool(batch_fixed), "loss_chunk_tokens" in explicit, positions_for_rows)
    if choice.fits:
        return choice
    if not inputs.on_gpu and inputs.malloc_mmap_threshold_mb <= 0 and "malloc_mmap_threshold_mb" not in explicit:
        apply("freed memory returned to the system (--malloc_mmap_threshold_mb=1)",
              {"malloc_mmap_threshold_mb": FIXED_MMAP_THRESHOLD_MB}, malloc_mmap_threshold_mb=FIXED_MMAP_THRESHOLD_MB)
    if not choice.fits and not inputs.loss_chunk_tokens and "loss_chunk_tokens" not in explicit:
        apply(f"the loss in chunks (--loss_chunk_tokens={DEFAULT_CHUNK_TOKENS})",
              {"loss_chunk_tokens": DEFAULT_CHUNK_TOKENS}, loss_chunk_tokens=DEFAULT_CHUNK_TOKENS)
    if not choice.fits and not inputs.activation_checkpointing and "activation_checkpointing" not in explicit:
        apply("activation checkpointing (--activation_checkpointing=True, about a third more compute)",
              {"activation_checkpointing": True}, activation_checkpointing=True)
    while not choice.fits and not batch_fixed and inputs.micro_batch_rows > 1:
        rows = _divisor_below(inputs.micro_batch_rows)
        accumulation = inputs.gradient_accumulation_steps * inputs.micro_batch_rows // rows
        phrase = (f"micro-batches of {rows} rows x {accumulation} (--batch_size_per_gpu={rows} "
                  f"--gradient_accumulation_steps={accumulation}: the same rows per optimizer step)")
        if choice.steps and choice.steps[-1].startswith("micro-batches of"):
            choice.steps.pop()  # one phrase for the final micro-batch, however many halvings it took
        # Validation batches and generation batches have batch_size_per_gpu rows too.
        apply(phrase, {"batch_size_per_gpu": rows, "gradient_accumulation_steps": accumulation},
              **_micro_batch_inputs(inputs, rows, accumulation, positions_for_rows))
    return choice


def _micro_batch_inputs(inputs: PlanInputs, rows: int, accumulation: int,
                        positions_for_rows: Callable[[int], int]) -> dict[str, object]:
    """The plan's inputs that follow micro-batches of `rows` rows x `accumulation` (validation and generation
    batches have batch_size_per_gpu rows too)."""
    return {"micro_batch_rows": rows, "gradient_accumulation_steps": accumulation,
            "micro_batch_positions": positions_for_rows(rows), "eval_positions": rows * inputs.sequence_width,
            "generation_rows": min(rows, inputs.generation_prompts or inputs.generation_rows)}


def _gpu_shape(choice: SaverChoice, inputs: PlanInputs, batch_fixed: bool, chunks_given: bool,
               positions_for_rows: Callable[[int], int]) -> PlanInputs:
    """On a GPU, the first of these that fits, recorded in `choice`: fewer micro-batches with whole logits, fewer
    with the loss in chunks, whole logits with the micro-batches as given; else `inputs` as they were. Merging
    micro-batches gains more than whole logits do, so whole logits are given up first."""
    whole_possible = bool(inputs.loss_chunk_tokens) and not chunks_given
    losses = [True, False] if whole_possible else [False]
    if not batch_fixed and inputs.gradient_accumulation_steps > 1:
        for whole in losses:
            trial = SaverChoice(before=choice.before, plan=choice.plan, budget_bytes=choice.budget_bytes)
            shaped = _fewest_micro_batches(trial, with_inputs(inputs, loss_chunk_tokens=0) if whole else inputs,
                                           positions_for_rows)
            if trial.merged:
                return _adopt(choice, trial, shaped, whole)
    if whole_possible:
        whole_inputs = with_inputs(inputs, loss_chunk_tokens=0)
        trial = SaverChoice(before=choice.before, plan=plan_memory(whole_inputs), budget_bytes=choice.budget_bytes)
        if trial.fits:
            return _adopt(choice, trial, whole_inputs, True)
    return inputs


def _adopt(choice: SaverChoice, trial: SaverChoice, inputs: PlanInputs, whole: bool) -> PlanInputs:
    """Take `trial`'s plan and changes into `choice` (with whole logits: --loss_chunk_tokens=0 too)."""
    choice.plan, choice.merged, choice.whole_logits = trial.plan, trial.merged, whole
    choice.changes.update(trial.changes, **({"loss_chunk_tokens": 0} if whole else {}))
    return inputs


def _fewest_micro_batches(choice: SaverChoice, inputs: PlanInputs,
                          positions_for_rows: Callable[[int], int]) -> PlanInputs:
    """On a GPU: the step's rows in the fewest micro-batches whose plan fits (a divisor of the rows, fewer
    micro-batches than configured), recorded in `choice`; the inputs it plans with (unchanged when none fits)."""
    rows, accumulation = inputs.micro_batch_rows, inputs.gradient_accumulation_steps
    total = rows * accumulation
    for count in range(1, accumulation):
        if total % count:
            continue
        trial = with_inputs(inputs, **_micro_batch_inputs(inputs, total // count, count, positions_for_rows))
        plan = plan_memory(trial)
        if not plan.fits(choice.budget_bytes):
            continue
        shape = "one micro-batch" if count == 1 else f"{count} micro-batches"
        gpu = f"{plan.device_peak / MB:,.0f} of {inputs.gpu_bytes / MB:,.0f} MB" if inputs.gpu_bytes else \
            f"{plan.device_peak / MB:,.0f} MB"
        choice.merged = (f"GPU micro-batches: {shape} of {total // count} rows per step instead of {rows} x "
                         f"{accumulation} (--batch_size_per_gpu={total // count} --gradient_accumulation_steps={count}"
                         f": as many rows per optimizer step, in fewer and larger passes that keep the GPU busy; "
                         f"predicted GPU peak {gpu}).")
        choice.plan = plan
        choice.changes.update(batch_size_per_gpu=total // count, gradient_accumulation_steps=count)
        return trial
    return inputs


def no_fit_message(choice: SaverChoice, explicit: Collection[str], launch_hint: str,
                   positions_for_rows: Callable[[int], int]) -> str:
    """One paragraph for a run that fits nowhere: the plan, the shortfall, and what would fit."""
    plan, inputs = choice.plan, choice.plan.inputs
    usable = choice.budget_bytes * (1 - PLAN_MARGIN)
    where = "this machine"
    shortfall = plan.machine_total - usable
    if plan.machine_total <= usable and plan.device:
        where, shortfall = "each GPU", plan.device_peak - inputs.gpu_bytes * (1 - PLAN_MARGIN)
    text = (f"The memory plan does not fit: {where} needs about {(shortfall + usable) / MB:,.0f} MB where "
            f"{usable / MB:,.0f} MB can be used ({gib_text(choice.budget_bytes)} budget less "
            f"{PLAN_MARGIN:.0%}), {shortfall / MB:,.0f} MB short")
    text += (f", even with {'; '.join(choice.steps)}." if choice.steps else ".")
    fixes = []
    smallest = with_inputs(inputs, **_micro_batch_inputs(inputs, 1, inputs.micro_batch_rows
                                                         * inputs.gradient_accumulation_steps, positions_for_rows),
                           activation_checkpointing=True,
                           malloc_mmap_threshold_mb=inputs.malloc_mmap_threshold_mb or FIXED_MMAP_THRESHOLD_MB)
    for processes in range(inputs.processes - 1, 0, -1):
        fewer = with_inputs(smallest, processes=processes,
                            world_size=max(1, inputs.world_size - inputs.processes + processes),
                            strategy=inputs.strategy if processes > 1 or inputs.strategy != DDP else SINGLE)
        if plan_memory(fewer).fits(choice.budget_bytes):
            fixes.append(f"{processes} process(es) on this machine (--num_processes {processes})")
            break
    if inputs.strategy != FSDP and inputs.processes > 1:
        if plan_memory(with_inputs(smallest, strategy=FSDP)).fits(choice.budget_bytes):
            fixes.append(f"FSDP, which shards the model states over the processes: {launch_hint}")
    fixed = [name for name in ("batch_size_per_gpu", "gradient_accumulation_steps", "activation_checkpointing",
                               "malloc_mmap_threshold_mb", "loss_chunk_tokens") if name in explicit]
    if fixed:
        fixes.append("leave " + ", ".join(f"--{name}" for name in fixed) + " unset so that the memory savers may "
                     "change them")
    if inputs.micro_batch_rows > 1 and "batch_size_per_gpu" in explicit:
        fixes.append("a smaller --batch_size_per_gpu with a larger --gradient_accumulation_steps")
    if fixes:
        text += " Would fit: " + "; or ".join(fixes) + "."
    else:
        text += (" Nothing tried here fits: a smaller model (--n_layer, --n_embd), a shorter --max_seq_len or a "
                 "machine with more memory is needed.")
    return (text + " --memory_budget_gb=GiB sets the budget when the detected one is wrong; --memory_savers=off "
            f"trains as configured, at the risk of the OOM killer. `{command_line('plan ...')}` with the same "
            "flags prints the plan part by part.")
