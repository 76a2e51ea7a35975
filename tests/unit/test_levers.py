"""The table of memory levers (`lowmem.memory.levers.LEVERS`) is the one place a lever is named: its config fields
exist, its plan fields exist, and what `choose_savers` and `no_fit_message` do follows the table's order.

The levers' choices against budgets: tests/unit/test_memory_plan.py.
"""

from __future__ import annotations

import dataclasses

from memory_plan_helpers import large_inputs, positions

from lowmem.config import TrainConfig
from lowmem.memory.levers import LEVER_FIELDS, LEVERS, choose_savers, no_fit_message
from lowmem.memory.plan import PlanInputs
from lowmem.train import memory_fit
from lowmem.units import GIB


def test_the_table_is_the_single_source_of_the_levers():
    config_fields = {item.name for item in dataclasses.fields(TrainConfig)}
    plan_fields = {item.name for item in dataclasses.fields(PlanInputs)}
    names = [row.name for row in LEVERS]
    assert len(set(names)) == len(names)
    assert len({row.no_fit_rank for row in LEVERS}) == len(LEVERS)
    for row in LEVERS:
        assert row.config_fields and set(row.config_fields) <= config_fields, row.name
        assert row.plan_fields and set(row.plan_fields) <= plan_fields, row.name
        if row.to_plan is None:  # each config value goes to the plan field in its place
            assert len(row.plan_fields) == len(row.config_fields), row.name
    assert LEVER_FIELDS == tuple(name for row in LEVERS for name in row.config_fields)
    assert len(set(LEVER_FIELDS)) == len(LEVER_FIELDS), "a config field belongs to one lever"
    assert memory_fit.LEVER_FIELDS is LEVER_FIELDS  # what a resume keeps of the saved choice


def test_each_lever_sets_its_own_fields_and_names_them_in_its_phrase():
    inputs = large_inputs(malloc_mmap_threshold_mb=0.0, loss_chunk_tokens=0)
    for row in LEVERS:
        values = row.next_values(inputs)
        assert values is not None and len(values) == len(row.config_fields), row.name
        assert set(row.plan_changes(inputs, values, positions)) == set(row.plan_fields), row.name
        phrase = row.describe(values)  # formats with the row's own config fields, no other
        assert all(f"--{name}=" in phrase for name in row.config_fields), row.name


def test_the_levers_turn_in_the_order_of_the_table():
    choice = choose_savers(large_inputs(malloc_mmap_threshold_mb=0.0, loss_chunk_tokens=0), 9 * GIB, explicit=(),
                           positions_for_rows=positions)
    assert choice.fits and tuple(choice.changes) == LEVER_FIELDS
    assert choice.steps == [
        "freed memory returned to the system (--malloc_mmap_threshold_mb=1)",
        "the loss in chunks (--loss_chunk_tokens=2048)",
        "activation checkpointing (--activation_checkpointing=True, about a third more compute)",
        "micro-batches of 8 rows x 8 (--batch_size_per_gpu=8 --gradient_accumulation_steps=8: the same rows per "
        "optimizer step)",
    ]


def test_no_fit_names_the_fields_the_user_set_in_the_tables_rank():
    choice = choose_savers(large_inputs(), 5 * GIB, explicit=LEVER_FIELDS, positions_for_rows=positions)
    message = no_fit_message(choice, LEVER_FIELDS, "accelerate launch ...", positions)
    assert ("leave --batch_size_per_gpu, --gradient_accumulation_steps, --activation_checkpointing, "
            "--malloc_mmap_threshold_mb, --loss_chunk_tokens unset so that the memory savers may change them"
            in message)
