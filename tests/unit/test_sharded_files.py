"""Tensors in shards and models written a slice at a time: what FSDP2's checkpoints and the exports are made of.
Shards written by three processes read back by two or by one, their index checked; a safetensors file written in
slices of rows; a model's weights read the same from one file, from shards, and merged with its adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lowmem.errors import CheckpointError, ConfigError
from lowmem.model.safetensors_writer import PlannedTensor, SafetensorsWriter
from lowmem.model.shards import LocalPart, ShardedTensors, shard_file, write_index, write_shard

TENSORS = {"embedding": torch.randn(10, 4), "norm": torch.randn(7), "step": torch.tensor(3.0),
           "half": torch.randn(5, 3).to(torch.bfloat16)}


def rows_of(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s rows of `rows`, as FSDP2 (torch.chunk) splits them."""
    chunk = -(-rows // world)
    return min(rows, rank * chunk), min(rows, (rank + 1) * chunk)


def write_three_ranks(folder: Path) -> None:
    every_rank = []
    for rank in range(3):
        parts = []
        for name, tensor in TENSORS.items():
            if tensor.dim():
                start, stop = rows_of(tensor.shape[0], rank, 3)
                parts.append(LocalPart(name, tensor[start:stop], start, tuple(tensor.shape)))
            else:  # a scalar: every rank holds it whole
                parts.append(LocalPart(name, tensor, 0, ()))
        every_rank.append(write_shard(folder, rank, parts))
    write_index(folder, every_rank, {"note": "kept"})


def test_shards_of_three_processes_read_back_by_two_and_by_one(tmp_path):
    write_three_ranks(tmp_path)
    with ShardedTensors(tmp_path) as shards:
        assert shards.index["note"] == "kept"
        for name, tensor in TENSORS.items():
            assert torch.equal(shards.whole(name), tensor), name
            if not tensor.dim():
                continue
            for rank in range(2):  # another number of processes: each its rows, from whichever files hold them
                start, stop = rows_of(tensor.shape[0], rank, 2)
                local = torch.empty(stop - start, *tensor.shape[1:], dtype=tensor.dtype)
                shards.fill(name, local, start)
                assert torch.equal(local, tensor[start:stop]), (name, rank)
    index = json.loads((tmp_path / "index.json").read_text())
    assert [piece["file"] for piece in index["tensors"]["embedding"]["pieces"]] == [shard_file(r) for r in range(3)]
    assert len(index["tensors"]["step"]["pieces"]) == 1, "a tensor every rank holds whole is stored once"


def test_a_shard_missing_rows_or_damaged_is_refused_with_its_name(tmp_path):
    write_three_ranks(tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    index["tensors"]["embedding"]["pieces"].pop(1)
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shards of embedding .* do not fit their index"):
        ShardedTensors(tmp_path)
    write_three_ranks(tmp_path)
    (tmp_path / shard_file(2)).write_bytes(b"\x80\x04K\x01.")  # a pickle, not safetensors
    with pytest.raises(ConfigError, match=f"{shard_file(2)}' is not a readable safetensors file"):
        ShardedTensors(tmp_path)
    (tmp_path / shard_file(2)).unlink()
    with pytest.raises(CheckpointError, match=f"{shard_file(2)} is missing"):
        ShardedTensors(tmp_path)


def test_a_file_written_in_slices_of_rows_is_the_whole_tensors(tmp_path):
    planned = [PlannedTensor.of(name, tensor) for name, tensor in TENSORS.items()]
    with SafetensorsWriter(tmp_path / "sliced.safetensors", planned, {"format": "pt"}) as writer:
        for name, tensor in TENSORS.items():
            for part in (tensor.split(3) if tensor.dim() else [tensor]):
                writer.write(name, part)
    loaded = load_file(str(tmp_path / "sliced.safetensors"))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in TENSORS.items())
    with pytest.raises(ValueError, match="expected embedding"):
        with SafetensorsWriter(tmp_path / "wrong.safetensors", planned) as writer:
            writer.write("norm", TENSORS["norm"])
    with pytest.raises(ValueError, match="planned tensors were not written"):
        with SafetensorsWriter(tmp_path / "short.safetensors", planned) as writer:
            writer.write("embedding", TENSORS["embedding"])


def test_a_models_weights_read_the_same_from_one_file_shards_and_with_adapters_merged(tmp_path, monkeypatch):
    from lowmem.adapters.files import ADAPTERS_FILE, base_weights_file, finish_base, save_adapters
    from lowmem.adapters.lora import LoRASpec, add_adapters, merged_state_dict
    from lowmem.checkpoint import model_files
    from lowmem.checkpoint.model_files import ModelWeights, write_model
    from lowmem.model import GPT, GPTConfig
    from lowmem.model.weights import save_model_config

    monkeypatch.setattr(model_files, "SLICE_BYTES", 1000)  # many slices of every tensor
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=96, max_seq_len=16, n_layer=2, n_head=2, n_embd=32, architecture="llama"))
    one = tmp_path / "one"
    one.mkdir()
    write_model(model, one / "model.safetensors")
    save_model_config(model.config, one)
    sharded = tmp_path / "sharded"
    every_rank = []
    for rank in range(3):
        parts = []
        for name, tensor in load_file(str(one / "model.safetensors")).items():
            start, stop = rows_of(tensor.shape[0], rank, 3)
            parts.append(LocalPart(name, tensor[start:stop], start, tuple(tensor.shape)))
        every_rank.append(write_shard(sharded / "model_shards", rank, parts))
    write_index(sharded / "model_shards", every_rank)
    save_model_config(model.config, sharded)
    whole = load_file(str(one / "model.safetensors"))
    for folder in (one, sharded):
        with ModelWeights(folder) as weights:
            assert sorted(weights.names) == sorted(whole)
            assert all(torch.equal(weights.tensor(name), whole[name]) for name in whole)
            weights.write(tmp_path / f"{folder.name}.safetensors")
        assert all(torch.equal(value, whole[name]) for name, value in
                   load_file(str(tmp_path / f"{folder.name}.safetensors")).items())

    # A checkpoint of adapters: the run's base with them merged in, slice by slice, as the model's own merge.
    run = tmp_path / "run"
    (run / "base").mkdir(parents=True)
    write_model(model, base_weights_file(run))
    finish_base(run, model.config, "a test model", one)
    spec = LoRASpec(rank=4, alpha=8.0)
    add_adapters(model, spec)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_B." in name:
                parameter.normal_()  # B starts at zeros: give the adapters an update
    checkpoint = run / "checkpoint-2"
    checkpoint.mkdir()
    save_adapters(model.state_dict(), checkpoint / ADAPTERS_FILE, spec)
    save_model_config(model.config, checkpoint)
    expected = merged_state_dict(model)
    with ModelWeights(checkpoint) as weights:
        assert weights.spec == spec and weights.adapters
        for name in weights.names:
            assert torch.allclose(weights.tensor(name), expected[name].float(), atol=1e-6), name
