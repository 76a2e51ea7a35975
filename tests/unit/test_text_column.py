"""Pretraining on one text column (--text_column), and which tokens the loss counts by default: the response of
prompt/response pairs, every token of one text column."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from data_helpers import EVERY_TOKEN_LINE
from data_helpers import text_data as text_data, text_tokenizer as text_tokenizer  # fixtures
from saved_runs import rewrite_trainer_state, write_saved_run
from training_helpers import write_chat_rows

from lowmem.config import TrainConfig, apply_overrides, validate_config
from lowmem.data.path_checks import check_data_files
from lowmem.config.columns import data_columns, describe_loss_targets, response_only
from lowmem.data.collate import TokenizingCollate
from lowmem.data.sources import build_row_group_index
from lowmem.tokenization.sentencepiece_tokenizer import Tokenizer
from lowmem.errors import ConfigError, DataError
from lowmem.model import IGNORE_INDEX
from lowmem.train.resume import resume_differences
from lowmem.config.settle import settle_best_metric, settle_loss_targets
from lowmem.train.startup import read_saved_run


def _config(**values) -> TrainConfig:
    return apply_overrides(TrainConfig(), values)


# ----- the rule, in one place ------------------------------------------------------------------------------------
def test_columns_and_loss_targets_follow_the_data():
    pairs, text = _config(), _config(text_column="text")
    assert data_columns(pairs) == ("prompt", "response") and data_columns(text) == ("text",)
    assert response_only(pairs) is True and response_only(text) is False
    assert response_only(_config(loss_on_response_only="False")) is False
    assert response_only(_config(loss_on_response_only="auto")) is True
    assert describe_loss_targets(pairs).startswith("loss on the response tokens only (prompt/response pairs; "
                                                   "--loss_on_response_only=False trains on every token)")
    assert describe_loss_targets(_config(loss_on_response_only=False)).startswith("loss on every token, prompt and")
    assert describe_loss_targets(text) == EVERY_TOKEN_LINE


def test_text_column_refuses_settings_it_would_ignore():
    validate_config(_config(text_column="text", loss_on_response_only=False))
    with pytest.raises(ConfigError, match="have no prompt: every token of the text is trained on"):
        validate_config(_config(text_column="text", loss_on_response_only=True))
    with pytest.raises(ConfigError, match="--prompt_column=question would not be read"):
        validate_config(_config(text_column="text", prompt_column="question"))
    with pytest.raises(ConfigError, match="--prompt_column=q and --response_column=a would not be read"):
        validate_config(_config(text_column="text", prompt_column="q", response_column="a"))


def test_an_empty_column_name_points_to_text_column(text_data):
    with pytest.raises(DataError, match="has no column ''.*or --text_column for one column of text"):
        build_row_group_index(str(text_data[0]), ("", "response"))


def test_a_missing_path_names_the_text_column(tmp_path):
    with pytest.raises(ConfigError, match="string column 'text'\\) there"):
        check_data_files(_config(text_column="text", train_file=str(tmp_path / "absent.parquet")))


def test_without_prompts_the_best_checkpoint_is_chosen_by_validation_loss():
    assert settle_best_metric(_config(text_column="text")).best_metric == "val_loss"
    assert settle_best_metric(_config()).best_metric == "bleu4"


# ----- the tokens in the loss ------------------------------------------------------------------------------------
def test_the_tokenizer_trains_on_the_text_column(text_tokenizer):
    record = json.loads((text_tokenizer / "tokenizer_training.json").read_text(encoding="utf-8"))
    assert record["columns"] == ["text"]
    tokenizer = Tokenizer.load(text_tokenizer)
    assert tokenizer.decode(tokenizer.encode("春风明月")) == "春风明月"


def test_one_text_column_trains_on_every_token_packed(text_data, text_tokenizer):
    tokenizer = Tokenizer.load(text_tokenizer)
    texts = pq.read_table(text_data[1], columns=["text"]).column("text").to_pylist()[:12]
    rows = [{"text": text} for text in texts]
    tokens = sum(len(tokenizer.encode(text)) + 2 for text in texts)  # [bos] text [eos]
    # response_only is ignored: one text column has no prompt to leave out.
    for flag in (False, True):
        batch = TokenizingCollate(tokenizer, max_seq_len=128, columns=("text",), response_only=flag, pack=True)(rows)
        assert batch["segment_ids"].amax(dim=1).sum() == len(rows)
        assert int((batch["targets"] != IGNORE_INDEX).sum()) == tokens - len(rows)  # one target fewer per row
        assert int((batch["segment_ids"] != 0).sum()) == tokens - len(rows)
        first = (batch["segment_ids"][0] == 1).nonzero().flatten()
        assert batch["input_ids"][0, int(first[0])] == tokenizer.bos_id


def _kept_after_the_separator(batch: dict[str, torch.Tensor], sep_id: int) -> bool:
    """Whether, in every packed row, exactly the targets from the row's [sep] on are in the loss."""
    for sequence in range(batch["input_ids"].size(0)):
        segments = batch["segment_ids"][sequence]
        for segment in range(1, int(segments.max()) + 1):
            positions = (segments == segment).nonzero().flatten()
            inputs, targets = batch["input_ids"][sequence, positions], batch["targets"][sequence, positions]
            sep = int((inputs == sep_id).nonzero().flatten()[0])
            expected = torch.arange(len(positions)) >= sep
            if not torch.equal(targets != IGNORE_INDEX, expected):
                return False
    return True


def test_pairs_default_to_the_response_and_every_token_when_asked(tmp_path, text_tokenizer):
    tokenizer = Tokenizer.load(text_tokenizer)
    pairs_file = write_chat_rows(tmp_path / "pairs.parquet", 12, seed=3)
    rows = pq.read_table(pairs_file).to_pylist()

    def batch_for(config: TrainConfig) -> dict[str, torch.Tensor]:
        return TokenizingCollate(tokenizer, 128, data_columns(config), response_only(config), pack=True)(rows)

    default = batch_for(_config())
    assert _kept_after_the_separator(default, tokenizer.sep_id)
    responses = sum(len(tokenizer.encode(row["response"])) + 1 for row in rows)  # the response and [eos]
    assert int((default["targets"] != IGNORE_INDEX).sum()) == responses
    every = batch_for(_config(loss_on_response_only=False))
    assert int((every["targets"] != IGNORE_INDEX).sum()) == int((every["segment_ids"] != 0).sum())


# ----- resume: the saved value wins over today's default ---------------------------------------------------------
def _saved_run(run: Path, **saved_values) -> dict:
    """A run folder whose one (complete) checkpoint's trainer state holds a config with `saved_values`."""
    config = dataclasses.asdict(_config(output_dir=str(run)))
    config.update(saved_values)
    state = {"config": config, "train": {"step": 4}}
    write_saved_run(run, 4, state)
    return state


def test_a_run_saved_with_every_token_resumes_with_every_token(tmp_path, caplog):
    run = tmp_path / "run"
    state = _saved_run(run, loss_on_response_only=False)
    del state["config"]["text_column"]  # saved before the field existed
    rewrite_trainer_state(run / "checkpoint-4", state)
    config = _config(output_dir=str(run))
    with caplog.at_level("INFO"):
        resumed = settle_loss_targets(config, read_saved_run(run).config)
    assert resumed.loss_on_response_only is False
    assert "saved with --loss_on_response_only=False: kept" in caplog.text
    assert resume_differences(state, resumed, steps_per_epoch=10) == ([], [])
    assert settle_loss_targets(config, None).loss_on_response_only is True  # a new run
    # Given explicitly, the flag is kept as given, and the resume check names the change.
    changed = settle_loss_targets(_config(output_dir=str(run), loss_on_response_only=True), read_saved_run(run).config)
    assert resume_differences(state, changed, steps_per_epoch=10)[0] == ["loss_on_response_only: False → True"]


def test_a_run_saved_with_the_response_only_resumes_so(tmp_path):
    run = tmp_path / "run"
    state = _saved_run(run, loss_on_response_only=True)
    resumed = settle_loss_targets(_config(output_dir=str(run)), read_saved_run(run).config)
    assert resumed.loss_on_response_only is True and resume_differences(state, resumed, 10) == ([], [])
    # Other columns than the run's: decided from the data, and the resume check refuses the change of columns.
    text = settle_loss_targets(_config(output_dir=str(run), text_column="text"), read_saved_run(run).config)
    assert text.loss_on_response_only is False
    assert "text_column: '' → 'text'" in resume_differences(state, text, 10)[0]
