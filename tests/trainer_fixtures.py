"""Fixtures of the tests that run the Trainer in-process: a tiny run's config, its data and tokenizer (made once per
test module) and a working folder of its own.

A test module takes the fixtures by importing them as themselves, so that pytest finds them there:

    from trainer_fixtures import chat_data as chat_data, in_tmp as in_tmp, tokenizer_dir as tokenizer_dir
"""

from __future__ import annotations

from pathlib import Path

import pytest
from training_helpers import write_chat_rows

from lowmem.config import TrainConfig, apply_overrides

ROWS, BATCH, ACCUMULATION = 200, 8, 2


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    """ROWS training rows and 20 validation rows."""
    folder = tmp_path_factory.mktemp("chat")
    return (write_chat_rows(folder / "train.parquet", ROWS, seed=1),
            write_chat_rows(folder / "valid.parquet", 20, seed=2))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, chat_data):
    """One tokenizer for every test of a module: training it is the slow part of a tiny run."""
    from lowmem.train.setup import train_tokenizer_for

    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer_for(tiny_config(folder, chat_data, folder))
    return folder


def tiny_config(folder: Path, chat_data, tokenizer_dir: Path, **overrides) -> TrainConfig:
    """A model that trains in seconds on `chat_data`, writing its run under `folder`; `overrides` win."""
    train, valid = chat_data
    values = dict(train_file=str(train), validation_file=str(valid), test_file=str(valid),
                  tokenizer_dir=str(tokenizer_dir), output_dir=str(folder / "run"), vocab_size=400, n_layer=2,
                  n_head=2, n_embd=32, max_seq_len=64, batch_size_per_gpu=BATCH,
                  gradient_accumulation_steps=ACCUMULATION, dataloader_buffer_size=50, logging_steps=5,
                  warmup_steps=2, sample_max_new_tokens=8, eval_bleu_samples=0, eval_max_new_tokens=8, epochs=1,
                  dropout=0.1, save_steps=100, keep_latest_n_ckp=1, best_metric="val_loss")
    values.update(overrides)
    return apply_overrides(TrainConfig(), values)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """The test's tmp_path, as the working folder."""
    monkeypatch.chdir(tmp_path)  # the memory and training logs go to ./logs
    return tmp_path
