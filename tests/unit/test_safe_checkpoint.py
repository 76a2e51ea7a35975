"""A checkpoint is data, never a program: a file rewritten to run a command when it loads (its completeness marker's
size and CRC-32 rewritten too, as anyone can) is refused with a message and the command does not run; checkpoints
of the earlier format, whose random states are Python tuples and a numpy array, still resume exactly. In-process
(FSDP2's sharded optimizer through the launcher: tests/integration/test_fsdp_cpu_processes.py)."""

from __future__ import annotations

import base64
import io
import json
import pickle
import random

import numpy as np
import pytest
import torch
from checkpoint_tampering import Planted, replace_as_saved, rewrite_as_saved
from fault_injection import StopAfterStep, TrainingTrace
from trainer_fixtures import chat_data as chat_data, in_tmp as in_tmp, tokenizer_dir as tokenizer_dir  # fixtures
from trainer_fixtures import tiny_config

from lowmem.distributed import safe_load
from lowmem.errors import UnsafeCheckpointError
from lowmem.train.trainer import Trainer


@pytest.fixture
def stopped_run(in_tmp, chat_data, tokenizer_dir):
    """A run stopped and saved at step 4 (checkpoint-4), with its config."""
    config = tiny_config(in_tmp, chat_data, tokenizer_dir, max_steps=8)
    Trainer(config, callbacks=[StopAfterStep(4)]).fit()
    return config, in_tmp / "run" / "checkpoint-4"


def as_earlier_version(checkpoint, earliest: bool = False) -> None:
    """The checkpoint's random states as an earlier version wrote them, its marker to match: `rng.pt`, a torch file of
    tensors and numbers, or with `earliest` of Python tuples and a numpy array, in place of `rng.json`."""
    from checkpoint_tampering import replace_as_saved

    json_file = checkpoint / "rank0" / "rng.json"
    states = json.loads(json_file.read_text())
    python, numpy = states["python"], states["numpy"]
    torch_state = torch.frombuffer(bytearray(base64.b64decode(states["torch"])), dtype=torch.uint8)
    if earliest:
        saved = {"python": (python["version"], tuple(python["words"]), python["gauss_next"]),
                 "numpy": (numpy["kind"], np.asarray(numpy["keys"], dtype=np.uint32), numpy["position"],
                           numpy["has_gauss"], numpy["cached_gaussian"]),
                 "torch": torch_state}
    else:
        saved = {"python": {**python, "words": torch.tensor(python["words"], dtype=torch.int64)},
                 "numpy": {**numpy, "keys": torch.tensor(numpy["keys"], dtype=torch.int64)}, "torch": torch_state}
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    replace_as_saved(checkpoint / "rank0" / "rng.pt", buffer.getvalue())
    json_file.unlink()
    marker = json.loads((checkpoint / "COMPLETE.json").read_text())
    del marker["files"]["rank0/rng.json"]
    (checkpoint / "COMPLETE.json").write_text(json.dumps(marker))


@pytest.mark.parametrize("part", ["rank0/rng.pt", "optimizer.pt"])
def test_a_planted_pickle_is_refused_and_runs_nothing(stopped_run, tmp_path, part):
    config, checkpoint = stopped_run
    ran = tmp_path / "the-command-ran"
    if part == "rank0/rng.pt":  # a checkpoint of an earlier version, whose random states are a torch file
        as_earlier_version(checkpoint)
    saved = torch.load(checkpoint / part, weights_only=True)
    rewrite_as_saved(checkpoint / part, {**saved, "extra": Planted(ran)})
    trainer = Trainer(config)
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system") as refused:
        trainer.resume()
    assert not ran.exists(), "loading the checkpoint ran the planted command"
    assert part.split("/")[-1] in str(refused.value) and "--resume_from_checkpoint" in str(refused.value)
    assert trainer.state.step == 0  # nothing of the checkpoint was loaded
    with pytest.raises(UnsafeCheckpointError):  # named explicitly, the same
        Trainer(config).resume(resume_from=checkpoint)
    assert not ran.exists()


@pytest.mark.parametrize("earliest", [False, True], ids=["tensors", "tuples"])
def test_a_checkpoint_of_an_earlier_version_resumes_exactly(in_tmp, chat_data, tokenizer_dir, earliest):
    """Its random states in a torch file (of tensors, or earlier still of tuples with a numpy array inside, which load
    through the one converter torch's data-only loader is given): training goes on with the uninterrupted run's losses
    (dropout draws from them)."""
    whole = TrainingTrace(in_tmp / "whole")
    Trainer(tiny_config(in_tmp / "whole", chat_data, tokenizer_dir, max_steps=8), callbacks=[whole]).fit()
    config = tiny_config(in_tmp / "cut", chat_data, tokenizer_dir, max_steps=8)
    Trainer(config, callbacks=[StopAfterStep(4)]).fit()
    checkpoint = in_tmp / "cut" / "run" / "checkpoint-4"
    as_earlier_version(checkpoint, earliest)
    if earliest:
        assert "numpy.ndarray" in safe_load.unsafe_globals(checkpoint / "rank0" / "rng.pt")  # as that writer left it
    after = TrainingTrace(in_tmp / "after")
    resumed = Trainer(config, callbacks=[after])
    assert resumed.resume() is not None
    resumed.fit()
    assert sorted(after.losses) == [5, 6, 7, 8]
    assert all(after.losses[step] == whole.losses[step] for step in after.losses)


def test_the_random_states_are_stored_as_json():
    from lowmem.train.state import RngState

    states = json.loads(json.dumps(RngState().state_dict()))  # JSON, nothing else
    expected = (random.random(), np.random.rand(), torch.rand(1))
    RngState().load_state_dict(states)
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(1), expected[2])


def test_the_numpy_converter_is_only_for_the_random_states(tmp_path):
    path = tmp_path / "optimizer.pt"
    torch.save({"array": np.zeros(3)}, path)
    with pytest.raises(UnsafeCheckpointError, match="numpy"):
        safe_load.check_torch_file(path)
    safe_load.check_torch_file(path, {"numpy.ndarray", "numpy.dtype", "numpy._core.multiarray._reconstruct",
                                      "numpy.core.multiarray._reconstruct"})


def test_a_distributed_checkpoints_metadata_and_values_are_read_as_data(tmp_path):
    """torch.distributed.checkpoint, one process: its own metadata passes, a planted metadata file or value is
    refused and runs nothing."""
    import torch.distributed.checkpoint as dcp

    ran = tmp_path / "the-command-ran"
    good = tmp_path / "good"
    dcp.save({"weight": torch.ones(3), "lr": 0.5, "betas": (0.9, 0.95)}, checkpoint_id=str(good), no_dist=True)
    safe_load.check_distributed_checkpoint(good)
    state = {"weight": torch.zeros(3), "lr": 0.0, "betas": (0.0, 0.0)}
    safe_load.load_distributed_checkpoint(state, good, no_dist=True)
    assert torch.equal(state["weight"], torch.ones(3)) and state["lr"] == 0.5 and state["betas"] == (0.9, 0.95)

    planted_metadata = tmp_path / "planted-metadata"
    dcp.save({"weight": torch.ones(3)}, checkpoint_id=str(planted_metadata), no_dist=True)
    (planted_metadata / ".metadata").write_bytes(__import__("pickle").dumps(Planted(ran)))
    with pytest.raises(UnsafeCheckpointError, match="system"):
        safe_load.load_distributed_checkpoint({"weight": torch.zeros(3)}, planted_metadata, no_dist=True)

    planted_value = tmp_path / "planted-value"
    dcp.save({"weight": torch.ones(3), "lr": Planted(ran)}, checkpoint_id=str(planted_value), no_dist=True)
    with pytest.raises(UnsafeCheckpointError, match=r"planted-value \(its value lr\)"):
        safe_load.load_distributed_checkpoint({"weight": torch.zeros(3), "lr": 0.0}, planted_value, no_dist=True)
    assert not ran.exists()


def test_deepspeed_files_may_name_deepspeeds_own_classes_only(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    ran = tmp_path / "the-command-ran"
    folder = tmp_path / "deepspeed" / "state"
    folder.mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(2)}, "loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum(2),
                "param_shapes": [{"w": torch.Size([2])}]}, folder / "mp_rank_00_model_states.pt")
    safe_load.check_deepspeed_checkpoint(tmp_path / "deepspeed")
    torch.save({"optimizer_state_dict": Planted(ran)}, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(UnsafeCheckpointError, match="zero_pp_rank_0.*system"):
        safe_load.check_deepspeed_checkpoint(tmp_path / "deepspeed")
    assert not ran.exists()


def test_an_allowed_class_gets_no_new_attributes_from_a_pickle(tmp_path):
    """The metadata's unpickler builds its own classes' instances, and never sets attributes on a class itself
    (a pickle may name pathlib.PurePath, then try to give it a new attribute for the whole process)."""
    import pathlib

    path = tmp_path / ".metadata"
    path.write_bytes(b"cpathlib\nPurePath\n}(Vplanted\nI1\nub.")  # GLOBAL, {"planted": 1}, BUILD
    with pytest.raises(UnsafeCheckpointError, match="new attributes for PurePath"):
        safe_load.check_distributed_checkpoint(tmp_path)
    assert not hasattr(pathlib.PurePath, "planted")


def test_a_refused_checkpoint_named_to_resume_from_sets_nothing_aside(in_tmp, chat_data, tokenizer_dir, tmp_path):
    config = tiny_config(in_tmp, chat_data, tokenizer_dir, max_steps=8, save_steps=4, keep_latest_n_ckp=2)
    Trainer(config).fit()
    run = in_tmp / "run"
    before = sorted(path.name for path in run.iterdir())
    assert {"checkpoint-4", "checkpoint-8"} <= set(before)
    replace_as_saved(run / "checkpoint-4" / "rank0" / "rng.pt", pickle.dumps({"torch": Planted(tmp_path / "ran")}))
    with pytest.raises(UnsafeCheckpointError):
        Trainer(config).resume(resume_from=run / "checkpoint-4")
    assert sorted(path.name for path in run.iterdir()) == before  # checkpoint-8 was not moved aside
    assert not (tmp_path / "ran").exists()


def test_deepspeeds_checkpoint_engine_reads_as_data_within_the_block(tmp_path):
    """DeepSpeed reads every checkpoint file through its checkpoint engine's `load`, with weights_only=False: within
    `deepspeed_loads_as_data` it reads as data (its own classes allowed), and gets its own method back after."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    engine = type("Engine", (), {})()
    engine.checkpoint_engine = TorchCheckpointEngine()
    good, planted = tmp_path / "good.pt", tmp_path / "planted.pt"
    torch.save({"loss_scaler": LossScaler(2.0), "w": torch.ones(2)}, good)
    torch.save({"x": Planted(tmp_path / "ran")}, planted)
    with safe_load.deepspeed_loads_as_data(engine):
        loaded = engine.checkpoint_engine.load(str(good), map_location="cpu")
        assert loaded["loss_scaler"].cur_scale == 2.0 and torch.equal(loaded["w"], torch.ones(2))
        with pytest.raises(UnsafeCheckpointError):
            engine.checkpoint_engine.load(str(planted), map_location="cpu")
    assert not (tmp_path / "ran").exists()
    assert "load" not in vars(engine.checkpoint_engine)  # the class's own method serves again
