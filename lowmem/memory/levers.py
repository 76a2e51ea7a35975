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

`LEVERS` is the one table of the levers (the config fields each sets, the plan fields it changes, how far it goes,
how the log names it), in order of cost; everything here is derived from it, and the plan's inputs take a lever's
setting from the config through it (`plan_inputs_of_levers`). To add a memory saver: a row there and its option in
lowmem/config/sections.py; what it saves is counted in lowmem/memory/plan.py (its `PlanInputs` field), and the saver
itself is the model's or the data's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection

from lowmem.memory.plan import (DDP, FSDP, PLAN_MARGIN, SINGLE, MemoryPlan, PlanInputs, plan_memory,
                                with_inputs)
from lowmem.program import command_line
from lowmem.units import MB, gib_text

DEFAULT_CHUNK_TOKENS = 2048
FIXED_MMAP_THRESHOLD_MB = 1.0
WHOLE_LOGITS = (0,)  # the chunked loss's setting for a loss over whole logits (on a GPU, where they fit)

Values = tuple[Any, ...]  # a lever's setting: one value per config field, in the order of `config_fields`
PositionsForRows = Callable[[int], int]


@dataclass(frozen=True)
class Lever:
    """One memory saver, a row of `LEVERS`."""

    name: str
    config_fields: tuple[str, ...]  # the TrainConfig fields it sets; a user who set any of them keeps it as given
    plan_fields: tuple[str, ...]  # the PlanInputs fields it changes
    phrase: str  # its part of the log line, formatted with the config values it set
    # The values one more turn sets, from the plan's inputs so far; None when it is as far on as it goes (or does
    # not apply, as the mmap threshold on a GPU).
    next_values: Callable[[PlanInputs], Values | None]
    # Its values at their strongest, for what `no_fit_message` tries (fewer processes, FSDP), explicit settings or
    # not; None: as the run has it.
    strongest: Callable[[PlanInputs], Values] | None
    no_fit_rank: int  # where `no_fit_message` names its fields among those the user set (the largest saving first)
    repeats: bool = False  # turned again while the plan does not fit; the log names the final setting only
    # The plan's values for a setting, in the order of `plan_fields`; None: the config values, in that order.
    to_plan: Callable[[PlanInputs, Values, PositionsForRows], Values] | None = None

    def fixed_by(self, explicit: Collection[str]) -> bool:
        """True when the user set one of its fields: the lever is never turned."""
        return any(name in explicit for name in self.config_fields)

    def setting(self, values: Values) -> dict[str, object]:
        """Config field → value."""
        return dict(zip(self.config_fields, values, strict=True))

    def plan_changes(self, inputs: PlanInputs, values: Values,
                     positions_for_rows: PositionsForRows) -> dict[str, object]:
        """Plan field → value, for `with_inputs`."""
        plan_values = values if self.to_plan is None else self.to_plan(inputs, values, positions_for_rows)
        return dict(zip(self.plan_fields, plan_values, strict=True))

    def describe(self, values: Values) -> str:
        return self.phrase.format(**self.setting(values))


def _divisor_below(rows: int) -> int:
    """The largest divisor of `rows` that is at most half of it (1 for a prime)."""
    for candidate in range(rows // 2, 0, -1):
        if rows % candidate == 0:
            return candidate
    return 1


def _smaller_micro_batch(inputs: PlanInputs) -> Values | None:
    """The next smaller micro-batch (rows, accumulation) with the same rows per optimizer step; None at one row."""
    if inputs.micro_batch_rows <= 1:
        return None
    rows = _divisor_below(inputs.micro_batch_rows)
    return rows, inputs.gradient_accumulation_steps * inputs.micro_batch_rows // rows


def _micro_batch_plan(inputs: PlanInputs, values: Values, positions_for_rows: PositionsForRows) -> Values:
    """The plan's values for micro-batches of (rows, accumulation): the rows, the accumulation, the largest
    micro-batch's positions, a validation batch's positions and a generation batch's rows (validation and generation
    batches have batch_size_per_gpu rows too)."""
    rows, accumulation = values
    return (rows, accumulation, positions_for_rows(rows), rows * inputs.sequence_width,
            min(rows, inputs.generation_prompts or inputs.generation_rows))


# The levers, cheapest first: `choose_savers` turns them in this order.
LEVERS: tuple[Lever, ...] = (
    Lever("mmap threshold", ("malloc_mmap_threshold_mb",), ("malloc_mmap_threshold_mb",),
          "freed memory returned to the system (--malloc_mmap_threshold_mb={malloc_mmap_threshold_mb:g})",
          # CPU only: on a GPU the step's memory is the device's.
          next_values=lambda inputs: None if inputs.on_gpu or inputs.malloc_mmap_threshold_mb > 0
          else (FIXED_MMAP_THRESHOLD_MB,),
          strongest=lambda inputs: (inputs.malloc_mmap_threshold_mb or FIXED_MMAP_THRESHOLD_MB,), no_fit_rank=2),
    Lever("chunked loss", ("loss_chunk_tokens",), ("loss_chunk_tokens",),
          "the loss in chunks (--loss_chunk_tokens={loss_chunk_tokens})",
          next_values=lambda inputs: None if inputs.loss_chunk_tokens else (DEFAULT_CHUNK_TOKENS,),
          strongest=None, no_fit_rank=3),  # no_fit_message's trials keep the loss as the run has it
    Lever("activation checkpointing", ("activation_checkpointing",), ("activation_checkpointing",),
          "activation checkpointing (--activation_checkpointing={activation_checkpointing}, about a third more "
          "compute)",
          next_values=lambda inputs: None if inputs.activation_checkpointing else (True,),
          strongest=lambda inputs: (True,), no_fit_rank=1),
    Lever("smaller micro-batch", ("batch_size_per_gpu", "gradient_accumulation_steps"),
          ("micro_batch_rows", "gradient_accumulation_steps", "micro_batch_positions", "eval_positions",
           "generation_rows"),
          "micro-batches of {batch_size_per_gpu} rows x {gradient_accumulation_steps} (--batch_size_per_gpu="
          "{batch_size_per_gpu} --gradient_accumulation_steps={gradient_accumulation_steps}: the same rows per "
          "optimizer step)",
          next_values=_smaller_micro_batch,
          strongest=lambda inputs: (1, inputs.micro_batch_rows * inputs.gradient_accumulation_steps), no_fit_rank=0,
          repeats=True, to_plan=_micro_batch_plan),
)
# The config fields a lever may change.
LEVER_FIELDS = tuple(name for row in LEVERS for name in row.config_fields)


def plan_inputs_of_levers(config: Any) -> dict[str, Any]:
    """The plan's inputs that are a lever's config fields as they are (every lever but the micro-batch, whose
    plan values are computed from its rows): PlanInputs field → the value in `config`."""
    return {plan_field: getattr(config, name) for row in LEVERS if row.to_plan is None
            for name, plan_field in zip(row.config_fields, row.plan_fields, strict=True)}


def lever(name: str) -> Lever:
    """The row of `LEVERS` called `name`."""
    return next(row for row in LEVERS if row.name == name)


@dataclass
class SaverChoice:
    """What `choose_savers` decided: the config changes, why, and the plans before and after."""

    before: MemoryPlan
    plan: MemoryPlan
    budget_bytes: int
    changes: dict[str, object] = field(default_factory=dict)  # config field → value
    steps: list[str] = field(default_factory=list)  # one phrase per lever turned on
    merged: str = ""  # on a GPU (or its mirror), the step's rows given to fewer micro-batches: what, and why
    whole_logits: bool = False  # on a GPU (or its mirror), the loss over whole logits (chunks when memory needs them)

    @property
    def fits(self) -> bool:
        return self.plan.fits(self.budget_bytes)

    def line(self) -> str:
        """One log line: what was turned on and why, or that nothing was needed."""
        after = self.plan.machine_total
        budget = f"{gib_text(self.budget_bytes)} budget"
        merged = f"{self.merged} " if self.merged else ""
        if self.whole_logits:
            where = "on the GPU (" if self.plan.inputs.on_gpu else "as on a GPU (--mirror_cuda=True; "
            merged += (f"Loss over whole logits {where}--loss_chunk_tokens=0: they fit, and a chunked loss is "
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


def choose_savers(inputs: PlanInputs, budget_bytes: int, explicit: Collection[str],
                  positions_for_rows: PositionsForRows) -> SaverChoice:
    """Turn on the cheapest levers the user left unset until the plan of `inputs` fits `budget_bytes`.

    Args:
        inputs: the run as configured.
        budget_bytes: this machine's budget.
        explicit: config fields the user set (never changed).
        positions_for_rows: the largest micro-batch's positions for a micro-batch of so many rows (a smaller
            micro-batch packs its rows differently).
    """
    choice = SaverChoice(before=plan_memory(inputs), plan=plan_memory(inputs), budget_bytes=budget_bytes)
    if inputs.gpu_choices:
        inputs = _gpu_shape(choice, inputs, lever("smaller micro-batch").fixed_by(explicit),
                            lever("chunked loss").fixed_by(explicit), positions_for_rows)
    for row in LEVERS:
        if row.fixed_by(explicit):
            continue
        turns = 0
        while not choice.fits and (values := row.next_values(inputs)) is not None:
            inputs = with_inputs(inputs, **row.plan_changes(inputs, values, positions_for_rows))
            choice.plan = plan_memory(inputs)
            choice.changes.update(row.setting(values))
            if turns:
                choice.steps.pop()  # one phrase for the final setting, however many turns it took
            choice.steps.append(row.describe(values))
            turns += 1
            if not row.repeats:
                break
    return choice


def _gpu_shape(choice: SaverChoice, inputs: PlanInputs, batch_fixed: bool, chunks_given: bool,
               positions_for_rows: PositionsForRows) -> PlanInputs:
    """On a GPU (and under `--mirror_cuda`), the first of these that fits, recorded in `choice`: fewer micro-batches
    with whole logits, fewer with the loss in chunks, whole logits with the micro-batches as given; else `inputs` as
    they were. Merging micro-batches gains more than whole logits do, so whole logits are given up first."""
    whole_possible = bool(inputs.loss_chunk_tokens) and not chunks_given
    losses = [True, False] if whole_possible else [False]
    whole_inputs = with_inputs(inputs, **lever("chunked loss").plan_changes(inputs, WHOLE_LOGITS, positions_for_rows))
    if not batch_fixed and inputs.gradient_accumulation_steps > 1:
        for whole in losses:
            trial = SaverChoice(before=choice.before, plan=choice.plan, budget_bytes=choice.budget_bytes)
            shaped = _fewest_micro_batches(trial, whole_inputs if whole else inputs, positions_for_rows)
            if trial.merged:
                return _adopt(choice, trial, shaped, whole)
    if whole_possible:
        trial = SaverChoice(before=choice.before, plan=plan_memory(whole_inputs), budget_bytes=choice.budget_bytes)
        if trial.fits:
            return _adopt(choice, trial, whole_inputs, True)
    return inputs


def _adopt(choice: SaverChoice, trial: SaverChoice, inputs: PlanInputs, whole: bool) -> PlanInputs:
    """Take `trial`'s plan and changes into `choice` (with whole logits: --loss_chunk_tokens=0 too)."""
    choice.plan, choice.merged, choice.whole_logits = trial.plan, trial.merged, whole
    choice.changes.update(trial.changes, **(lever("chunked loss").setting(WHOLE_LOGITS) if whole else {}))
    return inputs


def _fewest_micro_batches(choice: SaverChoice, inputs: PlanInputs,
                          positions_for_rows: PositionsForRows) -> PlanInputs:
    """On a GPU (and under `--mirror_cuda`): the step's rows in the fewest micro-batches whose plan fits (a divisor of
    the rows, fewer micro-batches than configured), recorded in `choice`; the inputs it plans with (unchanged when none
    fits)."""
    micro_batch = lever("smaller micro-batch")
    rows, accumulation = inputs.micro_batch_rows, inputs.gradient_accumulation_steps
    total = rows * accumulation
    for count in range(1, accumulation):
        if total % count:
            continue
        trial = with_inputs(inputs, **micro_batch.plan_changes(inputs, (total // count, count), positions_for_rows))
        plan = plan_memory(trial)
        if not plan.fits(choice.budget_bytes):
            continue
        shape = "one micro-batch" if count == 1 else f"{count} micro-batches"
        if inputs.on_gpu:
            gpu = f"{plan.device_peak / MB:,.0f} of {inputs.gpu_bytes / MB:,.0f} MB" if inputs.gpu_bytes else \
                f"{plan.device_peak / MB:,.0f} MB"
            fit = f"predicted GPU peak {gpu}"
        else:  # the mirror: the host holds what a GPU would
            fit = f"as on a GPU (--mirror_cuda=True), within this host's budget: {plan.machine_total / MB:,.0f} MB"
        choice.merged = (f"GPU micro-batches: {shape} of {total // count} rows per step instead of {rows} x "
                         f"{accumulation} (--batch_size_per_gpu={total // count} --gradient_accumulation_steps={count}"
                         f": as many rows per optimizer step, in fewer and larger passes that keep the GPU busy; "
                         f"{fit}).")
        choice.plan = plan
        choice.changes.update(micro_batch.setting((total // count, count)))
        return trial
    return inputs


def no_fit_message(choice: SaverChoice, explicit: Collection[str], launch_hint: str,
                   positions_for_rows: PositionsForRows) -> str:
    """One paragraph for a run that fits nowhere: the plan, the shortfall, and what would fit."""
    plan, inputs = choice.plan, choice.plan.inputs
    usable = choice.budget_bytes * (1 - PLAN_MARGIN)
    needed, limit = plan.machine_total, f"{gib_text(choice.budget_bytes)} budget"
    where = "this machine"
    if plan.machine_total <= usable and plan.device:
        usable = inputs.gpu_bytes * (1 - PLAN_MARGIN)
        where, needed, limit = "each GPU", plan.device_peak, f"{inputs.gpu_bytes / MB:,.0f} MB GPU"
    shortfall = needed - usable
    text = (f"The memory plan does not fit: {where} needs about {needed / MB:,.0f} MB where {usable / MB:,.0f} MB can "
            f"be used ({limit} less {PLAN_MARGIN:.0%}), {shortfall / MB:,.0f} MB short")
    text += (f", even with {'; '.join(choice.steps)}." if choice.steps else ".")
    fixes = []
    strongest: dict[str, object] = {}  # every lever that has a strongest setting at it, explicit or not
    for row in LEVERS:
        if row.strongest is not None:
            strongest.update(row.plan_changes(inputs, row.strongest(inputs), positions_for_rows))
    smallest = with_inputs(inputs, **strongest)
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
    fixed = [name for row in sorted(LEVERS, key=lambda row: row.no_fit_rank) for name in row.config_fields
             if name in explicit]
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
