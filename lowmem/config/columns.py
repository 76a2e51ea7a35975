"""What a config reads from each row, and which of its tokens the loss counts, decided here for every command.

A config reads either prompt/response pairs (`--prompt_column`, `--response_column`) or one column of text
(`--text_column`), never both; preference training (`--objective=dpo`) reads a prompt and two answers
(`--chosen_column`, `--rejected_column`), and with `--dpo_reference=precomputed` the reference's log-probabilities
`lowmem dpo_reference` wrote beside them. `--loss_on_response_only` left unset follows that choice: pairs train on the
response (the prompt is given, not predicted), one text column on every token (there is no prompt).
"""

from __future__ import annotations

from lowmem.config.sections import DataConfig
from lowmem.config.train_config import TrainConfig


# The columns `lowmem dpo_reference` adds to preference rows: the reference's log-probability of each answer.
REFERENCE_COLUMNS = ("reference_chosen", "reference_rejected")


def data_columns(config: DataConfig) -> tuple[str, ...]:
    """The columns every row is read from: `(text_column,)` when one is set, `(prompt_column, chosen_column,
    rejected_column)` for preference training (and the two reference columns when they were precomputed), else
    `(prompt_column, response_column)`."""
    if is_preference(config):
        columns = (config.prompt_column, config.chosen_column, config.rejected_column)
        return columns + REFERENCE_COLUMNS if getattr(config, "dpo_reference", "") == "precomputed" else columns
    if config.text_column:
        return (config.text_column,)
    return (config.prompt_column, config.response_column)


def scored_columns(config: DataConfig) -> tuple[str, ...]:
    """The columns `evaluate` scores a model on: `data_columns`, except that preference rows are scored on their
    chosen answers, (prompt_column, chosen_column): the loss, perplexity and BLEU-4 of what the model was tuned
    towards."""
    if is_preference(config):
        return (config.prompt_column, config.chosen_column)
    return data_columns(config)


def is_preference(config: object) -> bool:
    """Whether the run trains on preferences (`--objective=dpo`): rows of a prompt and two answers."""
    return getattr(config, "objective", "lm") == "dpo"


def response_only(config: TrainConfig) -> bool:
    """Whether the loss leaves the prompt out: `--loss_on_response_only` as given, else True for prompt/response
    pairs and False for one text column."""
    if config.loss_on_response_only is not None:
        return config.loss_on_response_only
    return not config.text_column


def describe_loss_targets(config: TrainConfig) -> str:
    """Which tokens the loss counts, and why, in words for the log line that starts training."""
    if is_preference(config):
        return (f"DPO loss on pairs of answers (--chosen_column={config.chosen_column}, "
                f"--rejected_column={config.rejected_column}), beta {config.dpo_beta:g}, each answer's "
                "log-probability over its own tokens")
    if config.text_column:
        return "loss on every token (one text column)"
    if not response_only(config):
        return "loss on every token, prompt and response (--loss_on_response_only=False)"
    return ("loss on the response tokens only (prompt/response pairs; --loss_on_response_only=False trains on "
            "every token)")
