"""The memory plan: each process's high-water predicted by part, before the model is built.

A process's memory is what it holds all along (the interpreter and libraries, the data pipeline, the weights
and the optimizer state) plus what one phase adds while it lasts: loading a source model, a training step
(gradients, activations, the loss; under FSDP the weights of a block or a unit gathered), a validation (an
evaluation forward pass, the key/value cache of generation; under FSDP run sharded, a unit at a time), a save or,
on the main process, the export of final/ and best/. The phases come one after another, so the high-water is what
is held all along plus the largest phase:

    high-water = resident + max(load, step, validation, save, export)

Each phase's own figure (resident + that phase) is what the memory log's phase records are compared with. A part
held all along may not exist yet in the first phase: AdamW's moments are made by the first step (or by a resume's
load), so the load phase leaves them out.

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

from dataclasses import dataclass
from typing import Iterable

# What the plan reads and its parts' constants, under the names the other modules import them by.
from lowmem.memory.plan_inputs import DDP as DDP, DEEPSPEED as DEEPSPEED, EXPORT as EXPORT, FLOAT32 as FLOAT32
from lowmem.memory.plan_inputs import FSDP as FSDP, LOAD as LOAD, PHASES as PHASES, RESIDENT as RESIDENT
from lowmem.memory.plan_inputs import SAVE as SAVE, SINGLE as SINGLE, STEP as STEP, STRATEGIES as STRATEGIES
from lowmem.memory.plan_inputs import VALIDATION as VALIDATION, ModelShape as ModelShape, PlanInputs as PlanInputs
from lowmem.memory.plan_inputs import PlanPart as PlanPart, with_inputs as with_inputs
from lowmem.memory.plan_parts import CUDA_CONTEXT_DEVICE_BYTES as CUDA_CONTEXT_DEVICE_BYTES
from lowmem.memory.plan_parts import activation_bytes_per_position as activation_bytes_per_position
from lowmem.memory.plan_parts import plan_parts
from lowmem.units import MB, gib_text

# A plan fits when it leaves this share of the budget free: page cache, the allocator's rounding, a
# micro-batch larger than the sampled ones.
PLAN_MARGIN = 0.10


@dataclass(frozen=True)
class MemoryPlan:
    """The predicted memory of each process of a run, by part; see the module's docstring."""

    inputs: PlanInputs
    host: tuple[PlanPart, ...]  # per process, in host memory
    device: tuple[PlanPart, ...] = ()  # per GPU (empty on the CPU)
    machine: tuple[PlanPart, ...] = ()  # once per machine: the launcher, DataLoader workers

    def high_water(self, main: bool = True, parts: Iterable[PlanPart] | None = None,
                   phases: tuple[str, ...] = PHASES) -> int:
        """Predicted high-water of one process (the main one holds the save-time copy and the export too), over
        `phases` (training steps alone, for a benchmark that neither validates nor saves)."""
        parts = [part for part in (self.host if parts is None else parts) if main or not part.main_only]
        return max(_in_phase(parts, phase) for phase in phases)

    def phase_high_water(self, phase: str, main: bool = True) -> int:
        """Predicted high-water of one process during `phase`: what is held then, and what the phase adds."""
        return self.high_water(main, phases=(phase,))

    def phase_bytes(self, phase: str, main: bool = True) -> int:
        return sum(part.bytes for part in self.host if part.phase == phase and (main or not part.main_only))

    def largest_phase(self, main: bool = True) -> str:
        return max(PHASES, key=lambda phase: self.phase_high_water(phase, main))

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


def _in_phase(parts: Iterable[PlanPart], phase: str) -> int:
    """What `parts` hold during `phase`: the resident ones that exist by then, and the phase's own."""
    return sum(part.bytes for part in parts
               if part.phase == phase or (part.phase == RESIDENT and phase not in part.absent_in))


def plan_memory(inputs: PlanInputs) -> MemoryPlan:
    """The memory plan of a run; see the module's docstring for how the parts add up."""
    host, device, machine = plan_parts(inputs)
    return MemoryPlan(inputs, tuple(host), tuple(device), tuple(machine))


def _mb(value: float) -> str:
    return f"{value / MB:,.0f} MB"


def _millions(count: int) -> str:
    return f"{count / 1e6:,.1f} M"


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
             f"{', bf16' if inputs.bf16 else ', float32'}; micro-batch {inputs.micro_batch_rows} "
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
