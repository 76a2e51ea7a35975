"""What the `export` tests (in-process and through the command) share: transformers, imported offline (a test
module that imports this one is skipped where transformers is not installed), a tokenizer of Chinese and English
text, and tiny models of both architectures in run folders as training leaves them.

A test module takes the fixtures by importing them as themselves (`one_thread` is autouse there):

    from export_helpers import gpt2_run as gpt2_run, one_thread as one_thread, tokenizer_dir as tokenizer_dir
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # before transformers is imported
transformers = pytest.importorskip("transformers")

from lowmem.checkpoint.export import export_model  # noqa: E402
from lowmem.config import TrainConfig  # noqa: E402
from lowmem.tokenization.sentencepiece_tokenizer import Tokenizer, train_tokenizer  # noqa: E402
from lowmem.model import GPT, GPTConfig  # noqa: E402

CHINESE = "春风明月江南归去相思落花流水千里故人长亭夜雨西楼山青云白酒醉梦天地日星河海草木鸟鱼书画琴棋诗词"
ENGLISH = ["the", "spring", "wind", "moon", "river", "south", "return", "flower", "water", "night", "rain", "poem",
           "write", "please", "a", "of", "and", "in", "old", "friend"]


def write_mixed_rows(path: Path, rows: int, seed: int) -> Path:
    """Chinese, English and mixed prompt/response rows, so that the vocabulary holds both scripts and spaces."""
    rng = random.Random(seed)

    def text() -> str:
        chinese = "".join(rng.choices(CHINESE, k=rng.randint(3, 12)))
        english = " ".join(rng.choices(ENGLISH, k=rng.randint(2, 8)))
        return rng.choice([chinese, english, f"{chinese} {english} {rng.randint(0, 999)}"])

    pq.write_table(pa.table({"prompt": [text() for _ in range(rows)], "response": [text() for _ in range(rows)]}),
                   path, row_group_size=100)
    return path


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run faster on one thread, and a second one spinning against a busy core made generation
    100 times slower (1.1 s against 0.01 s for 32 tokens) while another process used the other core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer([write_mixed_rows(folder / "rows.parquet", 400, seed=0)], folder, vocab_size=700)
    return folder


def tiny_model(vocab_size: int, architecture: str, bias: bool = False) -> GPT:
    """A random model whose norms are not all ones and zeros, and whose blocks weigh enough against the (tied)
    embedding that greedy generation wanders through many tokens instead of repeating its input."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab_size, max_seq_len=64, n_layer=2, n_head=2, n_embd=32,
                          architecture=architecture, bias=bias)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".ln_" in name or name.startswith("ln_f") or name.endswith(".bias"):
                parameter.add_(0.3 * torch.randn_like(parameter))
            elif name.startswith("blocks."):
                parameter.mul_(8.0)  # from std 0.02 to 0.16
    return model


def run_folder(tmp: Path, model: GPT, tokenizer_dir: Path) -> TrainConfig:
    """A run folder holding `model` as training leaves it in final/; the config that finds it."""
    config = TrainConfig(output_dir=str(tmp / "run"), tokenizer_dir=str(tokenizer_dir))
    export_model(model, config, tmp / "run" / "final", str(tokenizer_dir))
    return config


@pytest.fixture
def gpt2_run(tokenizer_dir: Path, tmp_path: Path) -> TrainConfig:
    return run_folder(tmp_path, tiny_model(Tokenizer.load(tokenizer_dir).vocab_size, "gpt2"), tokenizer_dir)
