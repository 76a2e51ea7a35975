"""Feeding the GPU at its own scale, checked on the CPU in-process: fixed batch shapes that keep the rows and the
losses, a step that never reads the device, the speed settings decided from the device, FlexAttention's mask,
the log line's MFU and GPU figures, and the fewest micro-batches that fit a GPU in the plan.

Compiled training (inductor's counters) is in tests/integration/test_compiled_training.py; a resume of a run
whose split the plan changed, in tests/integration/test_memory_fit.py.
"""

from __future__ import annotations

import dataclasses
import re
import types
from pathlib import Path

import pytest
import torch
from fault_injection import TrainingTrace, row_hashes
from trainer_fixtures import chat_data as chat_data, in_tmp as in_tmp, tokenizer_dir as tokenizer_dir  # fixtures
from trainer_fixtures import tiny_config

from lowmem.config import TrainConfig, apply_overrides
from lowmem.data.collate import FixedShapes, TokenizingCollate
from lowmem.data.stream import ParquetStream
from lowmem.tokenization.sentencepiece_tokenizer import Tokenizer
from lowmem.distributed.performance import speed_settings
from lowmem.errors import ConfigError
from lowmem.model import GPT, GPTConfig, IGNORE_INDEX
from lowmem.train.trainer import Trainer

DEMO_TRAIN = Path(__file__).resolve().parents[2] / "lowmem" / "demo_data" / "train.parquet"


# ----- fixed shapes -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory) -> Tokenizer:
    from lowmem.train.setup import train_tokenizer_for

    folder = tmp_path_factory.mktemp("demo-tok")
    train_tokenizer_for(apply_overrides(TrainConfig(), {"train_file": str(DEMO_TRAIN), "tokenizer_dir": str(folder)}))
    return Tokenizer.load(folder)


def test_an_epoch_of_the_demo_data_takes_three_shapes_with_the_same_rows(demo_tokenizer):
    """Every micro-batch of an epoch of the demo data, at the default 32 rows: at most three shapes with fixed
    shapes on (the sample makes a third worth it), and each micro-batch holds the same rows, in the same order,
    with the same counted targets as the batch shaped to fit."""
    from lowmem.train.setup import decide_fixed_shapes

    config = apply_overrides(TrainConfig(), {"train_file": str(DEMO_TRAIN)})
    shapes = decide_fixed_shapes(config, demo_tokenizer)
    assert shapes.width == 192 and shapes.rows == 32 and 8 <= shapes.sequences < shapes.more < 32
    fitted = TokenizingCollate(demo_tokenizer, 192, response_only=True, pack=True)
    fixed = TokenizingCollate(demo_tokenizer, 192, response_only=True, pack=True, fixed_shapes=shapes)
    stream = ParquetStream(str(DEMO_TRAIN), shuffle=True, seed=config.seed)
    seen_shapes, fitted_shapes, batches, rows = set(), set(), 0, []
    for start_of_batch in _batches(stream, 32):
        a, b = fitted(start_of_batch), fixed(start_of_batch)
        fitted_shapes.add(tuple(a["input_ids"].shape))
        seen_shapes.add(tuple(b["input_ids"].shape))
        hashes = row_hashes(b["input_ids"], demo_tokenizer.pad_id, b["segment_ids"])
        assert hashes == row_hashes(a["input_ids"], demo_tokenizer.pad_id, a["segment_ids"])
        assert int((b["targets"] != IGNORE_INDEX).sum()) == int((a["targets"] != IGNORE_INDEX).sum())
        assert int((b["input_ids"] != demo_tokenizer.pad_id).sum()) == int((a["input_ids"] != demo_tokenizer.pad_id)
                                                                            .sum())
        rows += hashes
        batches += 1
    assert batches > 700 and len(rows) == len(stream)  # the whole epoch, every row once
    assert seen_shapes <= {(size, 192) for size in shapes.sizes} and (shapes.sequences, 192) in seen_shapes
    assert (shapes.more, 192) in seen_shapes  # the third shape is met: the micro-batches that needed a few more
    assert len(fitted_shapes) > 5  # what fixed shapes replace: a new shape every few batches
    # The third shape is there for the positions it saves: fewer over the epoch than with the usual and the largest.
    two = FixedShapes(shapes.sequences, 32, 192)
    fitted_counts = [needed for needed in _needed_sequences(demo_tokenizer, stream)]
    assert sum(map(shapes.sequences_for, fitted_counts)) < sum(map(two.sequences_for, fitted_counts))


def _needed_sequences(tokenizer, stream: ParquetStream) -> list[int]:
    """The sequences each micro-batch of 32 rows of an epoch needs, packed to fit."""
    fitted = TokenizingCollate(tokenizer, 192, response_only=True, pack=True)
    return [int(fitted(batch)["input_ids"].shape[0]) for batch in _batches(stream, 32)]


def _batches(stream: ParquetStream, size: int):
    batch = []
    for row in stream:
        batch.append(row)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def test_fixed_shapes_pad_a_short_batch_and_refuse_one_too_large(demo_tokenizer):
    shapes = FixedShapes(sequences=3, rows=8, width=64)
    collate = TokenizingCollate(demo_tokenizer, 64, pack=False, fixed_shapes=FixedShapes(8, 8, 64))
    rows = [{"prompt": "春风", "response": "明月"}] * 5  # a short last batch: 5 rows of 8
    batch = collate(rows)
    assert batch["input_ids"].shape == (8, 64) and (batch["input_ids"][5:] == demo_tokenizer.pad_id).all()
    assert (batch["targets"][5:] == IGNORE_INDEX).all()
    from lowmem.train.step import count_rows

    assert count_rows([batch], demo_tokenizer.pad_id) == 5  # the padding sequences are not rows
    assert shapes.sequences_for(2) == 3 and shapes.sequences_for(4) == 8
    with pytest.raises(ValueError, match="9 sequences"):
        shapes.sequences_for(9)
    three = FixedShapes(sequences=3, rows=8, width=64, more=5)
    assert [three.sequences_for(n) for n in (1, 3, 4, 5, 6, 8)] == [3, 3, 5, 5, 8, 8]
    assert [tuple(ids.shape) for ids, _ in three.padding_batches(0)] == [(3, 64), (5, 64), (8, 64)]
    assert three.describe() == "3 x 64, 5 x 64, or 8 x 64 for a micro-batch that needs more"


def test_static_shapes_train_the_same_rows_to_the_same_losses(in_tmp, chat_data, tokenizer_dir):
    """Fixed shapes are a pure speed change: on the CPU in float32 every step trains the same rows to the same
    loss (1e-5) as batches shaped to fit, packed or not."""
    for pack in (True, False):
        traces = {}
        for static in (False, True):
            trace = TrainingTrace(in_tmp / f"trace-{pack}-{static}")
            config = tiny_config(in_tmp / f"{pack}-{static}", chat_data, tokenizer_dir, max_steps=10, dropout=0.0,
                                 pack_rows=pack, static_shapes=static)
            trainer = Trainer(config, callbacks=[trace])
            assert (trainer.fixed_shapes is not None) == static
            trainer.fit()
            traces[static] = trace
        assert traces[True].rows == traces[False].rows and len(traces[True].rows) == 10 * 16
        assert sorted(traces[True].losses) == list(range(1, 11))
        for step, loss in traces[False].losses.items():
            assert traces[True].losses[step] == pytest.approx(loss, rel=1e-5), (pack, step)


def test_a_run_with_static_shapes_stopped_and_resumed_trains_as_one_that_was_not(in_tmp, chat_data, tokenizer_dir):
    """The loader's positions know nothing of the shapes: a stop and a resume continue with the same rows and
    losses (the epoch end falls inside, at step 12 of 16)."""
    from fault_injection import StopAfterStep

    common = dict(max_steps=16, epochs=2, dropout=0.0, static_shapes=True)
    whole = TrainingTrace(in_tmp / "whole")
    Trainer(tiny_config(in_tmp / "whole", chat_data, tokenizer_dir, **common), callbacks=[whole]).fit()
    Trainer(tiny_config(in_tmp / "cut", chat_data, tokenizer_dir, **common), callbacks=[StopAfterStep(7)]).fit()
    after = TrainingTrace(in_tmp / "after")
    resumed = Trainer(tiny_config(in_tmp / "cut", chat_data, tokenizer_dir, **common), callbacks=[after])
    assert resumed.resume() is not None and resumed.state.step == 7
    resumed.fit()
    assert sorted(after.losses) == list(range(8, 17))
    assert after.rows == whole.rows[-len(after.rows):] and len(after.rows) == 9 * 16
    assert all(after.losses[step] == whole.losses[step] for step in after.losses)


# ----- a step that waits for nothing ---------------------------------------------------------------------------
class _NoHostRead:
    """Within the block, reading a tensor's value on the host (item, float, int, bool, tolist) raises."""

    NAMES = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")

    def __init__(self, monkeypatch) -> None:
        self.monkeypatch = monkeypatch

    def __enter__(self) -> None:
        def refuse(name: str):
            def read(tensor, *args, **kwargs):
                raise AssertionError(f"a host read ({name}) of a tensor of shape {tuple(tensor.shape)}")
            return read

        for name in self.NAMES:
            self.monkeypatch.setattr(torch.Tensor, name, refuse(name))

    def __exit__(self, *exc) -> None:
        self.monkeypatch.undo()


def _step_parts(nan: bool):
    from accelerate import Accelerator

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, max_seq_len=16, n_layer=1, n_head=2, n_embd=16))
    optimizer = model.configure_optimizer(0.1, 1e-2)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    if nan:
        model.ln_f.register_forward_hook(lambda module, inputs, output: output * float("nan"))
    ids = torch.randint(1, 50, (2, 16))
    batch = {"input_ids": ids, "targets": ids.clone(), "segment_ids": torch.ones_like(ids)}
    return model, optimizer, accelerator, batch


@pytest.mark.parametrize("nan", [False, True], ids=["finite", "non-finite"])
def test_a_step_reads_nothing_from_the_device_and_skips_a_non_finite_update(monkeypatch, nan):
    """The step's whole code path, the skip of a non-finite step included, runs with every host read of a tensor
    refused: the optimizer's fused kernel decides on the device, and the loss and norm stay tensors."""
    from lowmem.train.step import train_step

    model, optimizer, accelerator, batch = _step_parts(nan)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with _NoHostRead(monkeypatch):
        loss_sum, grad_norm = train_step(model, optimizer, accelerator, [batch], 30.0, grad_clip=1.0)
    assert torch.isfinite(grad_norm).item() is not nan
    changed = [name for name, value in model.state_dict().items() if not torch.equal(value, before[name])]
    state = optimizer.optimizer.state
    steps = {float(value["step"]) for value in state.values()}
    if nan:
        assert not changed and steps == {0.0}, "a skipped step changed the weights or counted an AdamW step"
        assert all(torch.equal(value["exp_avg"], torch.zeros_like(value["exp_avg"])) for value in state.values())
    else:
        assert changed and steps == {1.0}
    assert not hasattr(optimizer.optimizer, "found_inf")  # the flag does not outlive the step


@pytest.mark.parametrize("nan", [False, True], ids=["finite", "non-finite"])
def test_the_fused_kernel_clips_as_torch_does_with_no_pass_of_its_own(monkeypatch, nan):
    """On a GPU (one process or DDP) the fused AdamW clips through `grad_scale` as it reads each gradient: the
    weights after the step match torch's clipping followed by a step, the gradients are not rewritten before the
    step, nothing is read on the host, and a non-finite step is still skipped. The CPU keeps torch's clipping."""
    import lowmem.train.step as step

    model, optimizer, accelerator, batch = _step_parts(nan)
    assert not step.clips_in_the_optimizer(optimizer, accelerator)  # the CPU path is unchanged
    clipped_model, clipped_optimizer, _, _ = _step_parts(nan)
    step.train_step(clipped_model, clipped_optimizer, accelerator, [batch], 30.0, grad_clip=0.05)

    monkeypatch.setattr(step, "clips_in_the_optimizer", lambda optimizer, accelerator: True)
    rewritten = []
    monkeypatch.setattr(step, "clip_and_measure", lambda *args: rewritten.append(1))
    seen_scales = []
    inner_step = optimizer.optimizer.step

    def recorded_step(*args, **kwargs):
        seen_scales.append(optimizer.optimizer.grad_scale.clone())
        return inner_step(*args, **kwargs)

    monkeypatch.setattr(optimizer.optimizer, "step", recorded_step)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with _NoHostRead(monkeypatch):
        _, grad_norm = step.train_step(model, optimizer, accelerator, [batch], 30.0, grad_clip=0.05)
    monkeypatch.undo()
    assert rewritten == [] and len(seen_scales) == 1
    assert not hasattr(optimizer.optimizer, "grad_scale") and not hasattr(optimizer.optimizer, "found_inf")
    if nan:
        assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
        return
    assert float(seen_scales[0]) == pytest.approx(float(grad_norm) / 0.05, rel=1e-5) and float(seen_scales[0]) > 1
    expected = clipped_model.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-7)
    assert any(not torch.equal(value, before[name]) for name, value in model.state_dict().items())


class _NoPairs:
    """A preference loss whose micro-batches hold no pair (one padding pair of weight 0): a zero gradient."""

    def micro_batch(self, model, batch, input_ids, targets):
        _, loss = model(input_ids, targets)
        return (loss * 0).detach(), loss * 0


@pytest.mark.parametrize("fused", [True, False], ids=["device-side skip", "host-side skip"])
def test_a_preference_step_with_no_pair_on_any_rank_moves_nothing(monkeypatch, fused):
    """Weight decay would shrink every matrix on a step of nothing, and AdamW would count it: the step is skipped."""
    from lowmem.train.step import train_step

    model, optimizer, accelerator, batch = _step_parts(nan=False)
    if not fused:
        for group in optimizer.optimizer.param_groups:
            group["fused"] = None
    before = {name: value.clone() for name, value in model.state_dict().items()}
    _, grad_norm = train_step(model, optimizer, accelerator, [batch], 1.0, grad_clip=1.0, preference=_NoPairs())
    assert float(grad_norm) == 0.0
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert {float(value["step"]) for value in optimizer.optimizer.state.values()} <= {0.0}
    train_step(model, optimizer, accelerator, [batch], 30.0, grad_clip=1.0)  # a step with tokens still steps
    assert any(not torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_an_optimizer_without_a_device_side_skip_reads_the_norm_and_still_skips(monkeypatch):
    from lowmem.train.step import train_step

    model, optimizer, accelerator, batch = _step_parts(nan=True)
    for group in optimizer.optimizer.param_groups:  # as any optimizer that takes no found_inf flag
        group["fused"] = None
    calls = []
    monkeypatch.setattr(optimizer.optimizer, "step", lambda *args, **kwargs: calls.append(1))
    train_step(model, optimizer, accelerator, [batch], 30.0, grad_clip=1.0)
    assert calls == []


def test_an_optimizer_state_saved_unfused_steps_and_skips_as_before():
    """A checkpoint written before the AdamW was fused on the CPU brings its groups' `fused=None` back with its
    state: the step then reads the norm on the host, and still skips a non-finite one."""
    from lowmem.train.step import train_step

    model, optimizer, accelerator, batch = _step_parts(nan=True)
    # As earlier versions made it on the CPU: the same groups, not fused.
    old = torch.optim.AdamW([{"params": group["params"]} for group in optimizer.optimizer.param_groups], lr=1e-2)
    optimizer.optimizer.load_state_dict(old.state_dict())
    assert not optimizer.optimizer.param_groups[0].get("fused")
    before = {name: value.clone() for name, value in model.state_dict().items()}
    train_step(model, optimizer, accelerator, [batch], 30.0, grad_clip=1.0)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_the_trainer_reads_the_norms_only_when_a_line_or_checkpoint_needs_them(in_tmp, chat_data, tokenizer_dir,
                                                                              monkeypatch, caplog):
    """Between log lines the Trainer keeps each step's gradient norm on the device; the skipped steps are counted
    (and each named) when a line is written, with nothing read in the steps between."""
    from fault_injection import NonFiniteAtStep

    trainer = Trainer(tiny_config(in_tmp, chat_data, tokenizer_dir, max_steps=6, logging_steps=5),
                      callbacks=[NonFiniteAtStep(2)])
    reads = []
    original = trainer.count_skipped_steps

    def counted() -> None:
        reads.append((trainer.state.step, len(trainer.unread_norms)))
        original()

    monkeypatch.setattr(trainer, "count_skipped_steps", counted)
    with caplog.at_level("WARNING"):
        summary = trainer.fit()
    assert (5, 5) in reads  # the first line read five steps' norms at once
    assert summary["skipped_steps"] == 1
    assert "Step 2: the gradient norm is nan, so the update was skipped on every rank" in caplog.text


# ----- speed settings --------------------------------------------------------------------------------------------
def test_speed_settings_follow_the_device_unless_given():
    config = TrainConfig()
    assert speed_settings(config, "cuda") == speed_settings(config, "cuda")
    on_gpu, on_cpu = speed_settings(config, "cuda"), speed_settings(config, "cpu")
    assert (on_gpu.compile, on_gpu.static_shapes, on_gpu.attention) == (True, True, "sdpa")  # 192 tokens: sdpa
    assert (on_cpu.compile, on_cpu.static_shapes, on_cpu.attention) == (False, False, "sdpa")
    sharded = speed_settings(config, "cuda", sharded=True)  # FSDP, DeepSpeed: compiled only when asked
    assert not sharded.compile and sharded.static_shapes and "--compile=True" in sharded.describe()
    assert speed_settings(dataclasses.replace(config, compile=True), "cuda", sharded=True).compile
    long = dataclasses.replace(config, max_seq_len=2048)
    assert speed_settings(long, "cuda").attention == "flex" and speed_settings(long, "cpu").attention == "sdpa"
    assert speed_settings(dataclasses.replace(long, dropout=0.1), "cuda").attention == "sdpa"
    assert speed_settings(dataclasses.replace(long, pack_rows=False), "cuda").attention == "sdpa"
    given = dataclasses.replace(config, compile=False, static_shapes=True)
    assert (speed_settings(given, "cuda").compile, speed_settings(given, "cpu").static_shapes) == (False, True)
    with pytest.raises(ConfigError, match="trains on a GPU only"):
        speed_settings(dataclasses.replace(config, attention="flex"), "cpu")
    with pytest.raises(ConfigError, match="no dropout"):
        speed_settings(dataclasses.replace(config, attention="flex", dropout=0.1), "cuda")
    with pytest.raises(ConfigError, match="CUDA graphs"):
        speed_settings(dataclasses.replace(config, compile_mode="reduce-overhead", static_shapes=False), "cuda")
    from lowmem.distributed.performance import check_cuda_graphs

    graphs = dataclasses.replace(config, compile_mode="reduce-overhead", gradient_accumulation_steps=2)
    with pytest.raises(ConfigError, match="cannot accumulate gradients"):
        check_cuda_graphs(graphs, speed_settings(graphs, "cuda"))
    check_cuda_graphs(dataclasses.replace(graphs, gradient_accumulation_steps=1), speed_settings(graphs, "cuda"))
    check_cuda_graphs(graphs, speed_settings(graphs, "cpu"))  # not compiled: nothing to refuse


def test_an_automatic_compile_stays_off_where_the_gpu_cannot_run_inductor(monkeypatch):
    import importlib.util

    from lowmem.distributed import performance

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 1))
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "triton" else found(name))
    settings = speed_settings(TrainConfig(), "cuda")
    assert not settings.compile and "compute capability 7.0 or later, this one has 6.1" in settings.describe()
    assert speed_settings(dataclasses.replace(TrainConfig(), compile=True), "cuda").compile  # asked for: tried
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "triton" else found(name))
    assert "Triton" in performance.gpu_compile_problem()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a plan for a GPU made on a CPU machine
    assert speed_settings(TrainConfig(), "cuda").compile


def test_the_new_flags_parse_and_reject_bad_values():
    config = apply_overrides(TrainConfig(), {"compile": "no", "static_shapes": "auto", "attention": "flex",
                                             "peak_tflops": 312})
    assert (config.compile, config.static_shapes, config.attention, config.peak_tflops) == (False, None, "flex", 312.0)
    from lowmem.config import validate_config

    with pytest.raises(ConfigError, match="--attention must be"):
        validate_config(apply_overrides(TrainConfig(), {"attention": "flash"}))
    with pytest.raises(ConfigError, match="--compile_mode must be"):
        validate_config(apply_overrides(TrainConfig(), {"compile_mode": "fast"}))


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_flex_attention_over_packed_rows_computes_what_sdpa_does(architecture):
    """FlexAttention's block mask keeps each packed row to itself, as SDPA's boolean mask does (forward only: the
    CPU has no FlexAttention backward, and training here uses SDPA)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=60, max_seq_len=256, n_layer=2, n_head=2, n_embd=32, architecture=architecture))
    ids = torch.randint(1, 60, (2, 256))
    segments = torch.tensor([[1] * 100 + [2] * 100 + [0] * 56, [1] * 30 + [2] * 200 + [3] * 26])
    with torch.no_grad():
        expected, _ = model(ids, segment_ids=segments)
        flex, _ = model.use_attention("flex")(ids, segment_ids=segments)
    real = segments != 0
    torch.testing.assert_close(flex[real], expected[real], rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match="sdpa or flex"):
        model.use_attention("flash")


# ----- compile warm-up, the log line --------------------------------------------------------------------------
def test_running_each_shape_once_changes_no_weight_and_no_random_state():
    from lowmem.train.step import compile_each_shape

    model, optimizer, accelerator, _ = _step_parts(nan=False)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    rng = torch.get_rng_state()
    calls = []
    model.register_forward_hook(lambda module, inputs, output: calls.append(tuple(inputs[0].shape)))
    compile_each_shape(model, optimizer, accelerator, FixedShapes(3, 8, 16), pad_id=0, packed=True)
    assert calls == [(3, 16), (8, 16)]
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(parameter.grad is None for parameter in model.parameters())


def test_the_log_line_shows_mfu_where_the_peak_is_known(caplog):
    from lowmem.train import log as log_module
    from lowmem.train.callbacks import StepResult

    accelerator = types.SimpleNamespace(num_processes=1, device=torch.device("cpu"))
    step_log = log_module.StepLog(accelerator, total_steps=2, every=1, flops_per_token=6e9, peak_tflops=100.0)
    step_log.add(StepResult([], torch.tensor(20.0), torch.tensor(1.5), torch.tensor(True), 1e-3, 10, 1000, 10, 1000))
    with caplog.at_level("INFO"):
        figures = step_log.write(1, 0, 1e-3)
    assert figures.mfu == pytest.approx(figures.tokens_per_s * 6e9 / 100e12)
    assert figures.gpu_peak_mb is None and figures.grad_norm == pytest.approx(1.5)
    assert "| mfu " in caplog.text and "gpu peak" not in caplog.text
    no_peak = log_module.StepLog(accelerator, total_steps=2, every=1, flops_per_token=6e9)
    no_peak.add(StepResult([], torch.tensor(20.0), 1.0, True, 1e-3, 10, 1000, 10, 1000))
    assert no_peak.write(1, 0, 1e-3).mfu is None  # the CPU has no peak unless --peak_tflops gives one


def test_the_mfu_counts_attention_over_each_packed_rows_own_length(caplog):
    from lowmem.model import GPT, GPTConfig
    from lowmem.train import log as log_module
    from lowmem.train.callbacks import StepResult
    from lowmem.train.step import attention_pairs

    # Two sequences of 8 positions: rows of 3 and 4 tokens packed in the first, one of 6 (and padding) in the second.
    segments = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 0, 0]])
    packed = {"input_ids": torch.ones(2, 8, dtype=torch.long), "segment_ids": segments}
    assert attention_pairs([packed], pad_id=0) == 3 * 3 + 4 * 4 + 6 * 6
    unpacked = {"input_ids": torch.tensor([[5, 6, 7, 0], [5, 0, 0, 0]])}
    assert attention_pairs([unpacked, unpacked], pad_id=0) == 2 * (3 * 3 + 1 * 1)

    model = GPT(GPTConfig(vocab_size=64, max_seq_len=8, n_layer=2, n_head=2, n_embd=16, architecture="llama"))
    per_pair, per_token = model.attention_flops_per_pair(), model.estimate_flops_per_token()
    assert per_pair == 12 * 2 * 16 and per_token == model.matmul_flops_per_token() + per_pair * 8
    accelerator = types.SimpleNamespace(num_processes=1, device=torch.device("cpu"))
    step_log = log_module.StepLog(accelerator, total_steps=2, every=1, flops_per_token=per_token, peak_tflops=1e-6,
                                  attention_flops_per_pair=per_pair, max_seq_len=8)
    step_log.add(StepResult([packed], torch.tensor(20.0), 1.0, True, 1e-3, 13, 13, 13, 13,
                            attention_pairs([packed], 0)))
    with caplog.at_level("INFO"):
        figures = step_log.write(1, 0, 1e-3)
    real = model.matmul_flops_per_token() + per_pair * (9 + 16 + 36) / 13  # the rows' own pairs per token
    assert figures.mfu == pytest.approx(figures.tokens_per_s * real / 1e6)
    over_width = figures.tokens_per_s * per_token / 1e6  # attention as if every token saw 8 keys
    assert figures.mfu < over_width
    assert f"({over_width:.1%} with attention over max_seq_len)" in caplog.text


# ----- the fewest micro-batches on a GPU ------------------------------------------------------------------------
@pytest.mark.parametrize("gpu_gb, expected", [(20, (64, 1)), (8, (32, 2))])
def test_the_plan_gives_a_gpu_the_fewest_micro_batches_that_fit(gpu_gb, expected, tmp_path):
    """The large preset on one 20 GB GPU: its 32 x 2 becomes one micro-batch of 64 rows; on an 8 GB GPU the
    larger micro-batch does not fit and 32 x 2 stays. The rows per step are 64 either way."""
    from lowmem.config import TrainConfigPretrainLarge
    from lowmem.train.memory_fit import RunLayout, decide

    config = dataclasses.replace(TrainConfigPretrainLarge(), train_file=str(DEMO_TRAIN),
                                 tokenizer_dir=str(tmp_path / "no-tokenizer"), memory_budget_gb=12.0)
    layout = RunLayout("single", 1, 1, "cuda", bf16=True, gpu_bytes=int(gpu_gb * 2**30))
    decision = decide(config, layout, explicit=(), base_bytes=400 * 2**20)
    assert decision.error is None
    rows = decision.changes.get("batch_size_per_gpu", 32)
    accumulation = decision.changes.get("gradient_accumulation_steps", 2)
    assert (rows, accumulation) == expected and rows * accumulation == 64
    assert decision.plan.device_peak <= gpu_gb * 2**30 * 0.9
    merged = "GPU micro-batches: one micro-batch of 64 rows per step instead of 32 x 2" in " ".join(decision.lines)
    assert merged == (expected == (64, 1))
    # The loss over whole logits where they fit (the 20 GB GPU); in chunks where they do not (8 GB).
    whole = decision.changes.get("loss_chunk_tokens") == 0
    assert whole == (gpu_gb == 20) and ("Loss over whole logits on the GPU" in " ".join(decision.lines)) == whole
    chunked = decide(config, layout, explicit=("loss_chunk_tokens",), base_bytes=400 * 2**20)
    assert "loss_chunk_tokens" not in chunked.changes  # given, it is kept
    # Given explicitly, the split is kept; on the CPU it never changes.
    kept = decide(config, layout, explicit=("batch_size_per_gpu",), base_bytes=400 * 2**20)
    assert "batch_size_per_gpu" not in kept.changes
    on_cpu = decide(config, dataclasses.replace(layout, device="cpu", bf16=False, gpu_bytes=0), explicit=(),
                    base_bytes=400 * 2**20)
    assert on_cpu.changes.get("gradient_accumulation_steps", 2) >= 2
    assert on_cpu.changes.get("loss_chunk_tokens") != 0  # the CPU keeps its chunks


def test_the_cuda_mirror_shapes_the_step_as_a_gpu_would_within_the_hosts_budget(tmp_path):
    """`--mirror_cuda=True` on the CPU: the large preset's 32 x 2 becomes one micro-batch of 64 rows and the loss is
    taken over whole logits, as on a 20 GB GPU, where the host's budget holds them (32 GiB; the GPU's loss path then
    runs on the CPU: under FSDP2's bf16 policy it once stopped a GPU's first step); on 12 GiB, too small for either,
    both stay; without the mirror the CPU keeps both as configured."""
    from lowmem.config import TrainConfigPretrainLarge
    from lowmem.train.memory_fit import RunLayout, decide

    config = dataclasses.replace(TrainConfigPretrainLarge(), train_file=str(DEMO_TRAIN),
                                 tokenizer_dir=str(tmp_path / "no-tokenizer"), memory_budget_gb=32.0, mirror_cuda=True)
    layout = RunLayout("single", 1, 1, "cpu", bf16=True)
    decision = decide(config, layout, explicit=(), base_bytes=400 * 2**20)
    assert decision.error is None
    assert (decision.changes.get("batch_size_per_gpu"), decision.changes.get("gradient_accumulation_steps")) == (64, 1)
    assert decision.changes.get("loss_chunk_tokens") == 0
    lines = " ".join(decision.lines)
    assert "GPU micro-batches: one micro-batch of 64 rows per step instead of 32 x 2" in lines
    assert "as on a GPU (--mirror_cuda=True), within this host's budget" in lines and "GPU peak" not in lines
    assert "Loss over whole logits as on a GPU (--mirror_cuda=True; --loss_chunk_tokens=0: they fit" in lines
    given = decide(config, layout, explicit=("loss_chunk_tokens", "batch_size_per_gpu"), base_bytes=400 * 2**20)
    assert "loss_chunk_tokens" not in given.changes and "batch_size_per_gpu" not in given.changes
    small = decide(dataclasses.replace(config, memory_budget_gb=12.0), layout, explicit=(), base_bytes=400 * 2**20)
    assert small.changes.get("loss_chunk_tokens") != 0 and "batch_size_per_gpu" not in small.changes, small.changes
    plain = decide(dataclasses.replace(config, mirror_cuda=False), layout, explicit=(), base_bytes=400 * 2**20)
    assert plain.changes.get("loss_chunk_tokens") != 0 and plain.changes.get("gradient_accumulation_steps", 2) == 2


def test_the_savers_line_names_the_gpu_when_the_gpu_was_short(tmp_path):
    """The large preset on a 4 GB GPU of a host with room: the savers are turned on for the GPU, and the line says so
    with the GPU's peak before and after, not the host's budget."""
    from lowmem.config import TrainConfigPretrainLarge
    from lowmem.train.memory_fit import RunLayout, decide

    config = dataclasses.replace(TrainConfigPretrainLarge(), train_file=str(DEMO_TRAIN),
                                 tokenizer_dir=str(tmp_path / "no-tokenizer"), memory_budget_gb=64.0)
    layout = RunLayout("single", 1, 1, "cuda", bf16=True, gpu_bytes=4 * 2**30)
    decision = decide(config, layout, explicit=(), base_bytes=400 * 2**20)
    assert decision.error is None
    [line] = [line for line in decision.lines if "Memory savers turned on" in line]
    assert "turned on to fit the GPU's 4,096 MB:" in line and "GiB budget" not in line
    assert re.search(r"predicted a GPU peak of [\d,]+ MB → [\d,]+ MB\)", line), line
