"""`--compile=True` through the training command: checkpoints saved from a compiled model load without
compilation, and the other way round.

The compiled model's state dict prefixes every key with `_orig_mod.`; checkpoints must not carry it. The
tests compile with the "eager" backend: it wraps and traces the model exactly as inductor does (same
wrapper, same keys) but skips code generation, which takes minutes on a CPU.
"""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open
from training_helpers import run_command, tiny_overrides, write_chat_rows

STOP_AT, STEPS = 3, 6
COMPILED = ("--compile=True", "--compile_backend=eager")


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    return write_chat_rows(folder / "train.parquet", 200, seed=1), write_chat_rows(folder / "valid.parquet", 20, seed=2)


def train(folder, chat_data, *extra: str, env: dict | None = None):
    args = ["train", *tiny_overrides(folder, *chat_data), f"--max_steps={STEPS}", "--save_steps=100",
            "--logging_steps=1", "--eval_bleu_samples=0", *extra]
    done = run_command(args, cwd=folder, env={"LOWMEM_TRACE_DIR": str(folder / "trace"), **(env or {})})
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def losses(folder) -> dict[int, float]:
    trace = json.loads((folder / "trace" / "trace-rank0.json").read_text())
    return {int(step): loss for step, loss in trace["losses"].items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, chat_data):
    folder = tmp_path_factory.mktemp("reference")
    train(folder, chat_data)
    return losses(folder)


@pytest.mark.parametrize("first, then", [(COMPILED, ()), ((), COMPILED)],
                         ids=["compiled-then-plain", "plain-then-compiled"])
def test_checkpoint_loads_with_and_without_compile(tmp_path, chat_data, reference, first, then):
    stopped = train(tmp_path, chat_data, *first, env={"LOWMEM_STOP_AFTER_STEP": str(STOP_AT)})
    assert ("Compiling the model" in stopped.stderr) == bool(first)
    checkpoint = tmp_path / "run" / f"checkpoint-{STOP_AT}"
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as weights:
        keys = list(weights.keys())
    assert keys and not any(key.startswith("_orig_mod.") for key in keys), keys[:3]

    resumed = train(tmp_path, chat_data, *then, "--is_keep_training=True")
    assert f"checkpoint-{STOP_AT}" in resumed.stderr and ("Compiling the model" in resumed.stderr) == bool(then)
    after = losses(tmp_path)
    assert sorted(after) == list(range(STOP_AT + 1, STEPS + 1))
    for step, loss in after.items():  # the weights and optimizer state came back: the run continues exactly
        assert loss == pytest.approx(reference[step], rel=1e-5), step
