"""The memory plan's inputs the plan and lever tests share: a model of 110M parameters (LARGE) trained with DDP on
3 processes, and the packed positions of a micro-batch of so many rows."""

from __future__ import annotations

from lowmem.memory.plan import DDP, ModelShape, PlanInputs, with_inputs
from lowmem.units import MB

LARGE = ModelShape(n_layer=12, n_embd=768, n_head=12, mlp_hidden=2048, padded_vocab=32000, max_seq_len=192,
                   architecture="llama", params=109_530_624, block_params=7_080_960)


def large_inputs(**changes) -> PlanInputs:
    """LARGE with DDP on 3 processes, 2 micro-batches of 32 packed rows a step; `changes` replace fields."""
    base = PlanInputs(model=LARGE, micro_batch_positions=2688, sequence_width=192, masked_attention=True,
                      micro_batch_rows=32, gradient_accumulation_steps=2, loss_chunk_tokens=2048,
                      activation_checkpointing=False, malloc_mmap_threshold_mb=1.0, strategy=DDP, processes=3,
                      world_size=3, base_bytes=400 * MB, data_bytes=20 * MB, eval_positions=32 * 192,
                      generation_rows=32, generation_positions=192, launcher=True)
    return with_inputs(base, **changes)


def positions(rows: int) -> int:
    return rows * 84  # packed rows of about 84 tokens
