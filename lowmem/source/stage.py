"""The defaults of a run that starts from a trained model, chosen by the kind of stage it is.

TrainConfig's defaults are a pretraining run's: a learning rate of 2e-3 would wreck a model it starts from. A new
run with --init_from takes, for each of these fields the user did not set, the value its stage uses, in the range
the fine-tuning projects use (their defaults and recipes, listed in docs/training.md):

    stage                            learn_rate  weight_decay  epochs  usual rates
    a full fine-tune                 2e-5        0.0           1       5e-6 to 1e-4
    adapters (--lora_rank)           2e-4        0.01          1       5e-5 to 1e-3
    preference training (DPO)        1e-6        0.0           1       1e-7 to 1e-5
    DPO on adapters                  5e-6        0.0           1       1e-6 to 1e-4

and, for a model over BLEU_BOUND_PARAMETERS, BLEU-4 on the first BOUNDED_BLEU_SAMPLES validation prompts instead
of all of them (each prompt is a greedy answer of up to --eval_max_new_tokens steps, at every validation). The
warmup stays the default 50 steps, shortened to a tenth of a run shorter than 200 steps as any warmup left at its
default is (`lowmem.train.schedule.fitted_warmup`): a value chosen here would count as given there. A value given is
kept; a learning rate far outside the stage's usual range is warned about. A resume keeps the values its run was
saved with.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Collection

from lowmem.config import TrainConfig
from lowmem.config.columns import is_preference

logger = logging.getLogger(__name__)

# The fields a stage decides when they are not given.
STAGE_FIELDS = ("learn_rate", "weight_decay", "epochs", "eval_bleu_samples")
# What a resume of a run from a model keeps unless given: the stage's fields, and the adapters' dropout, whose
# default was 0.05 before it became 0 (peft's and torchtune's): a run keeps the dropout it trained with.
KEPT_ON_RESUME = (*STAGE_FIELDS, "lora_dropout")
# A model this large answers its BLEU prompts slowly enough that every prompt at every validation costs more than
# the training between validations on a small data set.
BLEU_BOUND_PARAMETERS = 100_000_000
BOUNDED_BLEU_SAMPLES = 32
# A given rate this many times beyond either end of the stage's usual range is warned about.
FAR_OUTSIDE = 3.0


@dataclass(frozen=True)
class Stage:
    """One kind of run from a trained model: its name, its values and the learning rates its peers use."""

    name: str
    values: dict[str, Any]
    usual_rates: tuple[float, float]
    why: str  # where the values come from, in a few words


FULL = Stage("a full fine-tune", {"learn_rate": 2e-5, "weight_decay": 0.0, "epochs": 1},
             (5e-6, 1e-4), "TRL's SFT default rate 2e-5; torchtune's full fine-tune recipes, one epoch")
ADAPTERS = Stage("adapters (LoRA)", {"learn_rate": 2e-4, "weight_decay": 0.01, "epochs": 1},
                 (5e-5, 1e-3), "the QLoRA paper's rate 2e-4; torchtune's LoRA recipes: 3e-4, decay 0.01")
PREFERENCE = Stage("preference training (DPO)", {"learn_rate": 1e-6, "weight_decay": 0.0, "epochs": 1},
                   (1e-7, 1e-5), "TRL's DPO default rate 1e-6; the alignment handbook's recipes: 5e-7, one epoch")
PREFERENCE_ADAPTERS = Stage("DPO on adapters", {"learn_rate": 5e-6, "weight_decay": 0.0, "epochs": 1},
                            (1e-6, 1e-4), "the alignment handbook's DPO on adapters: 5e-6")


def stage_of(config: TrainConfig) -> Stage:
    """The stage a run from a trained model is: preference training or not, adapters or every weight."""
    if is_preference(config):
        return PREFERENCE_ADAPTERS if config.lora_rank else PREFERENCE
    return ADAPTERS if config.lora_rank else FULL


@dataclass(frozen=True)
class StageChoice:
    """What a new run from a trained model took from its stage, and what it was told."""

    stage: Stage
    chosen: dict[str, Any]  # field → value, the fields not given only
    warning: str | None = None  # a given learning rate far outside the stage's range

    def line(self) -> str:
        """The start-up line: the values chosen for the stage, and why."""
        if not self.chosen:
            return f"Stage: {self.stage.name}; every value it decides was given."
        values = ", ".join(f"{name}={_shown(value)}" for name, value in self.chosen.items())
        return f"Stage: {self.stage.name}; chosen for it, as not given: {values}. Peers: {self.stage.why}."


def choose_stage_defaults(config: TrainConfig, given: Collection[str], parameters: int
                          ) -> tuple[TrainConfig, StageChoice]:
    """`config` of a new run from a trained model (of `parameters` parameters) with its stage's values for the
    fields not `given`, and what was chosen."""
    stage = stage_of(config)
    chosen = {name: value for name, value in stage.values.items() if name not in given}
    if "eval_bleu_samples" not in given and parameters > BLEU_BOUND_PARAMETERS and \
            (config.eval_bleu_samples < 0 or config.eval_bleu_samples > BOUNDED_BLEU_SAMPLES):
        chosen["eval_bleu_samples"] = BOUNDED_BLEU_SAMPLES
    warning = far_rate_warning(stage, config.learn_rate) if "learn_rate" in given else None
    return dataclasses.replace(config, **chosen), StageChoice(stage, chosen, warning)


def far_rate_warning(stage: Stage, rate: float) -> str | None:
    """One line when `rate` lies more than FAR_OUTSIDE times beyond the stage's usual range; None otherwise."""
    low, high = stage.usual_rates
    if low / FAR_OUTSIDE <= rate <= high * FAR_OUTSIDE:
        return None
    way, harm = (("above", "a rate this high can wreck the model it starts from in a few steps") if rate > high
                 else ("below", "the model will hardly move"))
    return (f"--learn_rate={_shown(rate)} is far {way} the usual range for {stage.name}, {_shown(low)} to "
            f"{_shown(high)}: {harm}. Kept, as given; leave it out to take {_shown(stage.values['learn_rate'])}.")


def log_stage(choice: StageChoice) -> None:
    """Say what the stage chose (one line) and warn of a rate far outside its range (one more)."""
    logger.info(choice.line())
    if choice.warning:
        logger.warning(choice.warning)


def kept_on_resume(config: TrainConfig, given: Collection[str], saved: dict[str, Any]) -> TrainConfig:
    """`config` of a resume with the stage's fields it was saved with, where they are not given (a run saved
    before its stage chose them keeps the values it trained with, as a new one does)."""
    kept = {name: saved[name] for name in KEPT_ON_RESUME if name not in given and name in saved}
    return dataclasses.replace(config, **kept)


def _shown(value: Any) -> str:
    """A value as a flag takes it: 2e-05 as 2e-5, 100 as 100."""
    if isinstance(value, float) and value and (abs(value) < 1e-2 or abs(value) >= 1e4):
        mantissa, exponent = f"{value:e}".split("e")
        return f"{float(mantissa):g}e{int(exponent)}"
    return f"{value:g}" if isinstance(value, float) and not math.isnan(value) else str(value)
