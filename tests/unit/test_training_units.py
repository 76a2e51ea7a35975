"""Units of the training loop: exact gradient accumulation, the LR schedule, overrides, collate."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from accelerate import Accelerator

from lowmem.config import TrainConfig, TrainConfigPretrainLarge
from lowmem.data.collate import IGNORE_INDEX, TokenizingCollate, pack_rows
from lowmem.errors import ConfigError
from lowmem.model import GPT, GPTConfig
from lowmem.train.schedule import LearningRateSchedule, get_lr, schedule_state_of_train_state
from lowmem.config import apply_overrides, describe_fields, validate_config
from lowmem.train.trainer import train_step


def _batch(rows: int, seed: int) -> dict[str, torch.Tensor]:
    """Rows of different lengths, padded: micro-batches then hold different numbers of target tokens."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, 100, (rows, 24), generator=generator)
    targets = torch.randint(5, 100, (rows, 24), generator=generator)
    for row in range(rows):
        targets[row, 4 + (row * 7) % 20:] = IGNORE_INDEX
    return {"input_ids": input_ids, "targets": targets}


def test_gradient_accumulation_is_exact():
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model_a = GPT(GPTConfig(vocab_size=100, max_seq_len=32, n_layer=2, n_head=2, n_embd=32))
    model_b = copy.deepcopy(model_a)
    # Plain SGD: the update is the gradient itself, so any difference in the gradient shows.
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.5)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.5)
    model_a, opt_a, model_b, opt_b = accelerator.prepare(model_a, opt_a, model_b, opt_b)

    full = _batch(16, seed=1)
    halves = [{key: value[:8] for key, value in full.items()}, {key: value[8:] for key, value in full.items()}]
    tokens = float((full["targets"] != IGNORE_INDEX).sum())
    counts = [int((half["targets"] != IGNORE_INDEX).sum()) for half in halves]
    assert counts[0] != counts[1], "the test needs micro-batches with different token counts"

    train_step(model_a, opt_a, accelerator, halves, tokens, grad_clip=0.0)  # 2 micro-batches of 8
    accelerator.gradient_accumulation_steps = 1
    train_step(model_b, opt_b, accelerator, [full], tokens, grad_clip=0.0)  # 1 batch of 16

    initial = GPT(GPTConfig(vocab_size=100, max_seq_len=32, n_layer=2, n_head=2, n_embd=32))
    moved = False
    for (name, a), (_, b) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), name
        moved = moved or not torch.equal(a, dict(initial.named_parameters())[name])
    assert moved


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    peak, warmup, total = 1e-3, 10, 110
    lrs = [get_lr(step, peak, warmup, total, min_lr_ratio=0.1) for step in range(130)]
    assert lrs[0] == pytest.approx(peak / warmup)
    assert lrs[warmup - 1] == pytest.approx(peak)
    assert all(a < b for a, b in zip(lrs[:warmup - 1], lrs[1:warmup]))  # rising
    assert all(a >= b for a, b in zip(lrs[warmup:total], lrs[warmup + 1:total + 1]))  # falling
    assert lrs[warmup + (total - warmup) // 2] == pytest.approx(peak * 0.55)  # half way down the cosine
    assert lrs[total] == pytest.approx(peak * 0.1) and lrs[-1] == pytest.approx(peak * 0.1)
    assert get_lr(0, peak, 0, total) == pytest.approx(peak)


def test_the_schedule_is_a_stateful_part_that_stretches_without_a_jump():
    schedule = LearningRateSchedule(1e-3, 10, 0.1, total_steps=100)
    assert [schedule.lr(step) for step in range(120)] == [get_lr(step, 1e-3, 10, 100, 0.1) for step in range(120)]
    before = schedule.lr(39)
    schedule.stretch(40, 130)  # a resume at step 40 finds 90 steps left instead of 60
    assert schedule.total_steps == 130 and schedule.lr(40) == pytest.approx(get_lr(40, 1e-3, 10, 100, 0.1))
    assert schedule.lr(40) < before and schedule.lr(130) == pytest.approx(1e-4)
    restored = LearningRateSchedule(1e-3, 10, 0.1, total_steps=5)
    restored.load_state_dict(schedule.state_dict())
    assert [restored.lr(step) for step in range(40, 131)] == [schedule.lr(step) for step in range(40, 131)]
    assert restored.state_dict() == schedule.state_dict() == {"total_steps": 130, "anchor_step": 40,
                                                              "anchor_virtual": 40.0, "virtual_total": 100,
                                                              "warmup_steps": 10}
    unrecorded = LearningRateSchedule(1e-3, 10, 0.1, total_steps=77)
    unrecorded.load_state_dict(schedule_state_of_train_state({"step": 3}))  # a checkpoint that recorded no total
    assert unrecorded.total_steps == 77 and not unrecorded.stretched


def test_the_schedule_is_built_from_the_config_and_restored_from_its_own_state():
    optim = TrainConfig(learn_rate=1e-3, warmup_steps=50, min_lr_ratio=0.2)
    schedule = LearningRateSchedule.from_config(optim, 120, warmup_kept_by=None)
    assert (schedule.peak_lr, schedule.configured_warmup, schedule.min_lr_ratio) == (1e-3, 50, 0.2)
    assert schedule.warmup_steps == 12  # 50 is over a quarter of 120 steps: fitted to a tenth
    kept = LearningRateSchedule.from_config(optim, 120, warmup_kept_by="--warmup_steps")
    assert kept.warmup_steps == 50 and kept.warmup_kept_by == "--warmup_steps"

    def restored_from(original: LearningRateSchedule) -> LearningRateSchedule:
        # As a resume builds it: from the config, for this run's length (another one here), then its own state.
        restored = LearningRateSchedule.from_config(optim, 1000, warmup_kept_by=None)
        restored.load_state_dict(copy.deepcopy(original.state_dict()))
        return restored

    steps = range(200)
    assert [restored_from(schedule).lr(step) for step in steps] == [schedule.lr(step) for step in steps]
    schedule.stretch(60, 170)  # a resume on another number of processes at step 60
    again = restored_from(schedule)
    assert again.stretched and again.state_dict() == schedule.state_dict()
    assert [again.lr(step) for step in steps] == [schedule.lr(step) for step in steps]
    again.stretch(100, 150)  # stretched again, restored or not: the same rates, and once more restored
    schedule.stretch(100, 150)
    assert [again.lr(step) for step in steps] == [schedule.lr(step) for step in steps]
    assert [restored_from(schedule).lr(step) for step in steps] == [schedule.lr(step) for step in steps]
    # A checkpoint that recorded no warmup warmed up over --warmup_steps as configured.
    older = LearningRateSchedule.from_config(optim, 120, warmup_kept_by=None)
    older.load_state_dict({"total_steps": 120})
    assert older.warmup_steps == 50
    assert older.lr(49) == get_lr(49, 1e-3, 50, 120, 0.2)
    # The first steps' rates under the old and a new run length, as a resume's check compares them.
    assert older.same_rates(40, 120, 240) and not older.same_rates(60, 120, 240)


def test_overrides_are_typed():
    config = apply_overrides(TrainConfig(), {"epochs": 5, "learn_rate": 2e-4, "batch_size_per_gpu": 24,
                                             "gradient_accumulation_steps": 4, "max_seq_len": 128,
                                             "warmup_steps": 2048.0, "save_steps": 2000, "bf16": "false",
                                             "train_file": 2024, "ultra_low_mem": "auto"})
    assert (config.epochs, config.learn_rate, config.batch_size_per_gpu) == (5, 2e-4, 24)
    assert isinstance(config.warmup_steps, int) and config.warmup_steps == 2048
    assert config.bf16 is False and config.train_file == "2024" and config.ultra_low_mem is None
    assert apply_overrides(TrainConfig(), {"ultra_low_mem": True}).ultra_low_mem is True
    assert apply_overrides(TrainConfig(), {"learn_rate": 1}).learn_rate == 1.0
    # fire splits `--lora_targets=q_proj,v_proj` at the comma: the text comes back as typed
    assert apply_overrides(TrainConfig(), {"lora_targets": ("q_proj", "v_proj")}).lora_targets == "q_proj,v_proj"


@pytest.mark.parametrize("overrides, message", [
    ({"epochs": "five"}, "epochs takes a whole number"),
    ({"epochs": 2.5}, "epochs takes a whole number"),
    ({"learn_rate": "fast"}, "learn_rate takes a number"),
    ({"bf16": "maybe"}, "bf16 takes True or False"),
    ({"learn_rat": 0.1}, "Did you mean --learn_rate"),
    ({"nonsense": 1}, "Valid options: --train_file"),
])
def test_bad_overrides_say_what_is_expected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(TrainConfig(), overrides)


@pytest.mark.parametrize("overrides, message", [
    ({"batch_size_per_gpu": 0}, "batch_size_per_gpu must be at least 1"),
    ({"n_embd": 100, "n_head": 3}, "divisible by --n_head"),
    ({"learn_rate": -1.0}, "learn_rate must be above 0"),
    ({"adam_beta2": 1.0}, "adam_beta2"),
])
def test_values_are_validated_up_front(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(apply_overrides(TrainConfig(), overrides))


def test_large_config_values():
    large = TrainConfigPretrainLarge()
    validate_config(large)
    assert (large.batch_size_per_gpu, large.gradient_accumulation_steps, large.max_seq_len) == (32, 2, 192)
    assert (large.dataloader_buffer_size, large.epochs, large.save_steps, large.logging_steps) == (5000, 3, 5000, 100)
    assert (large.keep_latest_n_ckp, large.learn_rate, large.warmup_steps, large.bf16) == (5, 1e-4, 1024, True)
    assert (large.n_layer, large.n_head, large.n_embd) == (12, 12, 768)
    assert large.output_dir == "model_save/pretrain_large"
    assert large.max_steps == 0


def test_every_field_is_documented():
    for line in describe_fields(TrainConfig()).splitlines():
        assert ": " in line and len(line.split(": ", 1)[1]) > 10, line


class _CharTokenizer:
    """Characters as ids: enough to check the collate's layout."""

    pad_id, bos_id, eos_id, sep_id = 0, 1, 2, 4

    def encode_pair_batch(self, prompts, responses):
        pairs = []
        for prompt, response in zip(prompts, responses):
            prompt_ids = [10 + ord(c) - ord("a") for c in prompt]
            response_ids = [10 + ord(c) - ord("a") for c in response]
            ids = [self.bos_id, *prompt_ids, self.sep_id, *response_ids, self.eos_id]
            pairs.append((ids, len(prompt_ids) + 2))
        return pairs


def test_collate_shifts_pads_and_masks():
    rows = [{"prompt": "ab", "response": "cde"}, {"prompt": "a", "response": "b"}]
    batch = TokenizingCollate(_CharTokenizer(), max_seq_len=64)(rows)
    inputs, targets = batch["input_ids"], batch["targets"]
    assert inputs.shape == targets.shape == (2, 32)  # longest row (7 tokens) rounded up to 32
    assert inputs[0, :7].tolist() == [1, 10, 11, 4, 12, 13, 14]
    assert targets[0, :7].tolist() == [10, 11, 4, 12, 13, 14, 2]
    assert (targets[0, 7:] == IGNORE_INDEX).all() and (inputs[1, 4:] == 0).all()

    masked = TokenizingCollate(_CharTokenizer(), max_seq_len=64, response_only=True)(rows)["targets"]
    assert masked[0, :7].tolist() == [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 12, 13, 14, 2]

    cut = TokenizingCollate(_CharTokenizer(), max_seq_len=4)(rows)
    assert cut["input_ids"].shape[1] == 4 and cut["input_ids"][0].tolist() == [1, 10, 11, 4]
    assert cut["targets"][0].tolist() == [10, 11, 4, 12]


def test_pack_rows_fills_bins_first_fit_longest_first():
    bins = pack_rows([5, 3, 8, 2, 6], capacity=10)
    assert bins == [[2, 3], [1, 4], [0]]  # 8+2, 6+3, 5: first fit, longest first; sorted within a bin
    assert sorted(row for rows in bins for row in rows) == list(range(5))
    assert pack_rows([10, 10], capacity=10) == [[0], [1]]


def test_packed_collate_holds_the_same_rows_in_segments():
    rows = [{"prompt": "ab", "response": "cde"}, {"prompt": "a", "response": "b"},
            {"prompt": "abcdef", "response": "g"}]
    plain = TokenizingCollate(_CharTokenizer(), max_seq_len=16)(rows)
    packed = TokenizingCollate(_CharTokenizer(), max_seq_len=16, response_only=True, pack=True)(rows)
    # Lengths 7, 4 and 9 in bins of 16: rows 0 and 2 share the first sequence, row 1 has the second.
    assert packed["input_ids"].shape == packed["segment_ids"].shape == (2, 16)
    assert packed["segment_ids"].tolist() == [[1] * 7 + [2] * 9, [1] * 4 + [0] * 12]
    assert packed["input_ids"][0].tolist() == plain["input_ids"][0, :7].tolist() + plain["input_ids"][2, :9].tolist()
    assert packed["input_ids"][1, :4].tolist() == plain["input_ids"][1, :4].tolist()
    # Response-only masking applies within each packed row, not from the start of the sequence.
    assert packed["targets"][0, 7:16].tolist() == [IGNORE_INDEX] * 7 + [16, 2]
    assert int((packed["targets"] != IGNORE_INDEX).sum()) == 4 + 2 + 2  # responses + end tokens


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_packed_rows_compute_exactly_as_rows_alone(architecture):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=100, max_seq_len=32, n_layer=2, n_head=2, n_embd=32,
                          architecture=architecture)).eval()
    lengths = [9, 5, 12, 3]
    rows = [torch.randint(5, 100, (n,)) for n in lengths]
    packed = torch.zeros(1, 32, dtype=torch.long)
    segments = torch.zeros(1, 32, dtype=torch.long)
    start = 0
    for segment, row in enumerate(rows, start=1):
        packed[0, start:start + len(row)] = row
        segments[0, start:start + len(row)] = segment
        start += len(row)
    with torch.no_grad():
        logits, _ = model(packed, segment_ids=segments)
        start = 0
        for row in rows:
            alone, _ = model(row.unsqueeze(0))
            assert torch.allclose(logits[0, start:start + len(row)], alone[0], atol=1e-5), "a row saw its neighbours"
            start += len(row)
        unmasked, _ = model(packed)  # the same sequence without segments: rows would see each other
        assert not torch.allclose(unmasked[0, 9:14], logits[0, 9:14], atol=1e-3)


def _run_folder_with_a_checkpoint(folder, saved_config: dict) -> None:
    """A run folder whose (complete) checkpoint-7 holds a trainer state with `saved_config` (nothing else is read)."""
    from saved_runs import write_saved_run

    write_saved_run(folder, 7, {"config": saved_config})


def test_the_architecture_of_a_new_run_and_of_a_resumed_one(tmp_path):
    from lowmem.train.resume import resume_differences
    from lowmem.config.settle import NEW_RUN_ARCHITECTURE, settle_architecture
    from lowmem.train.startup import read_saved_run

    def resumed(config: TrainConfig) -> TrainConfig:  # what a resume settles: from the run folder's saved run
        return settle_architecture(config, read_saved_run(config.output_dir).config)

    fresh = TrainConfig(output_dir=str(tmp_path / "new"))
    assert resumed(fresh).architecture == NEW_RUN_ARCHITECTURE
    # A run saved before the option existed holds a gpt2 model: its resume keeps it, whatever the default.
    old = tmp_path / "old"
    _run_folder_with_a_checkpoint(old, {"n_layer": 4})
    resumed_old = resumed(TrainConfig(output_dir=str(old)))
    assert resumed_old.architecture == "gpt2"
    before_the_option = {k: v for k, v in dataclasses.asdict(resumed_old).items() if k != "architecture"}
    assert resume_differences({"config": before_the_option, "train": {"step": 7}}, resumed_old, 100) == ([], [])
    # A llama run resumes as llama; an explicit other value is kept here and refused by the resume check.
    llama = tmp_path / "llama"
    _run_folder_with_a_checkpoint(llama, {"architecture": "llama"})
    assert resumed(TrainConfig(output_dir=str(llama))).architecture == "llama"
    explicit = resumed(TrainConfig(output_dir=str(llama), architecture="gpt2"))
    assert explicit.architecture == "gpt2"
    saved = {"config": dataclasses.asdict(TrainConfig(architecture="llama")), "train": {"step": 7}}
    assert resume_differences(saved, explicit, 100)[1] == ["architecture: 'llama' → 'gpt2'"]
    # Without --is_keep_training a folder's checkpoints do not decide.
    assert settle_architecture(TrainConfig(output_dir=str(old)), None).architecture == NEW_RUN_ARCHITECTURE


def test_a_model_file_written_before_the_architecture_field_loads_as_gpt2(tmp_path):
    import json

    from lowmem.model.weights import load_model_config, save_model_config

    save_model_config(GPTConfig(vocab_size=100, max_seq_len=16, n_layer=1, n_head=2, n_embd=16), tmp_path)
    fields = json.loads((tmp_path / "model_config.json").read_text())
    for name in ("architecture", "rope_theta", "norm_eps"):
        del fields[name]
    (tmp_path / "model_config.json").write_text(json.dumps(fields))
    config = load_model_config(tmp_path)
    assert config.architecture == "gpt2" and GPT(config).pos_emb is not None


def test_tokens_per_s_leaves_out_validation_and_saves(monkeypatch):
    import types

    from lowmem.train import log as log_module
    from lowmem.train.callbacks import StepResult

    now = [100.0]  # a clock the test moves by hand
    monkeypatch.setattr(log_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    step_log = log_module.StepLog(types.SimpleNamespace(num_processes=1), total_steps=4, every=2)

    def step(tokens: int, seconds: float) -> None:
        now[0] += seconds
        step_log.add(StepResult([], torch.tensor(2.0 * tokens), 1.0, True, 1e-3, tokens, tokens, tokens, tokens))

    step(1000, 1.0)
    with step_log.paused():  # a validation and a save: 8 s that are not training
        now[0] += 8.0
    step(1000, 1.0)
    assert step_log.write(2, 0, 1e-3).tokens_per_s == pytest.approx(1000.0)
    # The next window starts clean: no pause carried over.
    step(3000, 1.0)
    step(3000, 2.0)
    figures = step_log.write(4, 0, 1e-3)
    assert figures.tokens_per_s == pytest.approx(2000.0)
    assert figures.loss == pytest.approx(2.0)


# ----- a warmup that does not fit the run ------------------------------------------------------------------------
def test_the_large_presets_warmup_on_the_demo_data_is_shortened_and_said():
    from lowmem.train.schedule import LearningRateSchedule

    # 3 processes x 7,995 rows at 64 rows a step: 124 steps an epoch, 372 in 3 epochs, under warmup_steps=1024.
    schedule = LearningRateSchedule(1e-4, 1024, 0.1, 372, warmup_kept_by=None)
    lrs = [schedule.lr(step) for step in range(372)]
    assert schedule.warmup_steps == 37 and max(lrs) == pytest.approx(1e-4)
    assert lrs[-1] == pytest.approx(1e-5, rel=0.01)  # decayed to the floor by the end
    line = schedule.warmup_line()
    assert line.startswith("--warmup_steps=1024 is 275% of this run's 372 optimizer steps: the learning rate would "
                           "never reach its peak of 0.0001 nor decay. Warming up over 37 steps instead, 10% of the run")
    # Given on the command line, it is kept, and the line says what it costs.
    given = LearningRateSchedule(1e-4, 1024, 0.1, 372, warmup_kept_by="--warmup_steps")
    assert given.warmup_steps == 1024 and max(given.lr(step) for step in range(372)) < 0.4e-4
    assert "Kept as given; leave --warmup_steps out to warm up over 10% of the run (37 steps)" in given.warmup_line()
    # --max_steps below the warmup: the same line; the warmup is kept, so that a larger --max_steps continues
    # the run exactly while every step taken is in it.
    short = LearningRateSchedule(2e-3, 50, 0.1, 30, warmup_kept_by="--max_steps")
    assert short.warmup_steps == 50 and short.warmup_line().startswith(
        "--warmup_steps=50 is 167% of this run's 30 optimizer steps: the learning rate would never reach its peak of "
        "0.002 nor decay. Kept, as --max_steps cuts the run short")
    assert "--warmup_steps=3 fits this length" in short.warmup_line()
    # A warmup that fits is left alone, without a line.
    fits = LearningRateSchedule(2e-3, 50, 0.1, 1000, warmup_kept_by=None)
    assert fits.warmup_steps == 50 and fits.warmup_line() is None


def test_the_warmup_a_run_started_with_is_kept_by_its_checkpoints():
    from lowmem.train.schedule import LearningRateSchedule

    started = LearningRateSchedule(1e-4, 1024, 0.1, 372, warmup_kept_by=None)
    resumed = LearningRateSchedule(1e-4, 1024, 0.1, 248, warmup_kept_by=None)  # on 2 processes: another length
    resumed.load_state_dict(started.state_dict())
    assert resumed.warmup_steps == 37
    # A checkpoint saved before the warmup was part of the state warmed up over --warmup_steps as given.
    older = LearningRateSchedule(1e-4, 1024, 0.1, 372, warmup_kept_by=None)
    older.load_state_dict({"total_steps": 372, "anchor_step": 0, "anchor_virtual": 0.0, "virtual_total": 0})
    assert older.warmup_steps == 1024
