"""Validation on a model sharded by FSDP2 runs it as training does, a unit at a time, never gathered whole: on 1 and 3
gloo processes it gives the loss of the whole model in one process (float32, within 1e-5) and the same greedy BLEU
answers, the ranks stepping together while one has more prompts, or longer answers, than the others."""

from __future__ import annotations

import json
import os
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from gloo_ranks import free_port, start_ranks
from trainer_fixtures import chat_data as chat_data, tokenizer_dir as tokenizer_dir  # noqa: F401 (fixtures)

SIZES = dict(vocab_size=400, max_seq_len=64, n_layer=2, n_head=2, n_embd=32)
BATCH, NEW_TOKENS = 4, 12


def small_gpt():
    from lowmem.model import GPT, GPTConfig

    torch.manual_seed(0)  # the same weights in every process
    return GPT(GPTConfig(**SIZES)).use_memory_savers(loss_chunk_tokens=64)


def process_stub(rank: int, world: int) -> types.SimpleNamespace:
    """What evaluation reads of an Accelerator."""
    return types.SimpleNamespace(process_index=rank, num_processes=world, device=torch.device("cpu"),
                                 is_main_process=rank == 0)


def evaluated(model, accelerator, tokenizer_dir: str, valid: str) -> dict:
    from lowmem.tokenization.text_tokenizer import load_tokenizer
    from lowmem.eval.validation import evaluate

    result = evaluate(model, load_tokenizer(tokenizer_dir), valid, accelerator, batch_size=BATCH,
                      max_seq_len=SIZES["max_seq_len"], bleu_samples=-1, max_new_tokens=NEW_TOKENS,
                      response_only=True)
    return {"loss": result.loss, "rows": result.loss_rows,
            "answers": sorted((triple["prompt"], triple["generation"]) for triple in result.triples)}


def sharded_worker(rank: int, port: int, world: int, folder: Path, tokenizer_dir: str, valid: str) -> None:
    from accelerate import PartialState
    from torch.distributed.fsdp import fully_shard

    from lowmem.distributed.fsdp_units import is_sharded, shard_embedding_and_head

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "CUDA_VISIBLE_DEVICES": ""})
    torch.set_num_threads(1)
    PartialState(cpu=True, timeout=timedelta(minutes=2))  # gloo, as Accelerate makes it; a rank out of step fails
    model = small_gpt()
    plugin = types.SimpleNamespace(mixed_precision_policy=None, cpu_offload=None)
    shard_embedding_and_head(model, types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin)))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    result = {"sharded": is_sharded(model), **evaluated(model, process_stub(rank, world), tokenizer_dir, valid)}
    if rank == 0:
        (folder / f"sharded-{world}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("world", [1, 3])
def test_validation_of_the_sharded_model_is_the_whole_models(tmp_path, chat_data, tokenizer_dir, world):
    _, valid = chat_data
    whole = evaluated(small_gpt(), process_stub(0, 1), str(tokenizer_dir), str(valid))
    start_ranks(sharded_worker, (free_port(), world, tmp_path, str(tokenizer_dir), str(valid)), world)
    sharded = json.loads((tmp_path / f"sharded-{world}.json").read_text())
    assert sharded["sharded"], "the model was not sharded"
    assert sharded["rows"] == whole["rows"] == 20
    assert abs(sharded["loss"] - whole["loss"]) <= 1e-5, (sharded["loss"], whole["loss"])
    # 20 prompts in batches of 4: 7 on ranks 0 and 1, 6 on rank 2 (which steps once more on a one-token prompt).
    assert [tuple(pair) for pair in sharded["answers"]] == [tuple(pair) for pair in whole["answers"]]
