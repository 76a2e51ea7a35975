"""What a config reads from each row, and which of its tokens the loss counts, decided here for every command.

A config reads either prompt/response pairs (`--prompt_column`, `--response_column`) or one column of text
(`--text_column`), never both. `--loss_on_response_only` left unset follows that choice: pairs train on the
response (the prompt is given, not predicted), one text column on every token (there is no prompt).
"""

from __future__ import annotations

from lowmem.config.sections import DataConfig
from lowmem.config.train_config import TrainConfig


def data_columns(config: DataConfig) -> tuple[str, ...]:
    """The columns every row is read from: `(text_column,)` when one is set, else `(prompt_column, response_column)`."""
    if config.text_column:
        return (config.text_column,)
    return (config.prompt_column, config.response_column)


def response_only(config: TrainConfig) -> bool:
    """Whether the loss leaves the prompt out: `--loss_on_response_only` as given, else True for prompt/response
    pairs and False for one text column."""
    if config.loss_on_response_only is not None:
        return config.loss_on_response_only
    return not config.text_column


def describe_loss_targets(config: TrainConfig) -> str:
    """Which tokens the loss counts, and why, in words for the log line that starts training."""
    if config.text_column:
        return "loss on every token (one text column)"
    if not response_only(config):
        return "loss on every token, prompt and response (--loss_on_response_only=False)"
    return ("loss on the response tokens only (prompt/response pairs; --loss_on_response_only=False trains on "
            "every token)")
