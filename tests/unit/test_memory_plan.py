"""The memory budget from the process's own cgroup, the plan's arithmetic, and the memory savers it chooses.

In-process and fast: fake cgroup trees (v1 and v2, limits on a parent, "max", memory.high, a container's
mount), the plan's parts against hand-computed figures and against what autograd really saves, and the
levers' choices. A real memory cgroup: tests/integration/test_memory_plan_child_cgroup.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from memory_plan_helpers import LARGE, large_inputs, positions

from lowmem.memory.budget import MemoryBudget, read_cgroup_limit_bytes
from lowmem.memory.cgroup import find_own_cgroup, machine_oom_kills, own_cgroup_limit
from lowmem.memory.levers import choose_savers, no_fit_message
from lowmem.memory.plan import FSDP, SINGLE, STEP, ModelShape, activation_bytes_per_position, plan_memory
from lowmem.model import GPT, GPTConfig
from lowmem.units import GIB, MB

# ----- the budget from a cgroup tree ----------------------------------------------------------------------------
V2_MOUNT = "30 1 0:26 / {point} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNT = "35 30 0:31 {root} {point} rw,nosuid - cgroup cgroup rw,memory\n"


def fake_v2(tmp_path: Path, own: str, files: dict[str, str]) -> Path:
    """A cgroup v2 tree under tmp_path/cg with `files` (path → content) and a /proc/self naming `own`."""
    mount = tmp_path / "cg"
    (mount / own.strip("/")).mkdir(parents=True, exist_ok=True)
    (mount / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for name, text in files.items():
        (mount / name).parent.mkdir(parents=True, exist_ok=True)
        (mount / name).write_text(text)
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(f"0::{own}\n")
    (proc / "mountinfo").write_text(V2_MOUNT.format(point=mount))
    return proc


def fake_v1(tmp_path: Path, own: str, files: dict[str, str], mount_root: str = "/") -> Path:
    mount = tmp_path / "memory"
    below_root = own[len(mount_root.rstrip("/")):] if mount_root != "/" else own
    (mount / below_root.strip("/")).mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (mount / name).parent.mkdir(parents=True, exist_ok=True)
        (mount / name).write_text(text)
    proc = tmp_path / "proc"
    proc.mkdir()
    # A hybrid system: the unified hierarchy is mounted too, without the memory controller.
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("")
    (proc / "cgroup").write_text(f"5:memory:{own}\n4:cpu,cpuacct:/\n0::/\n")
    (proc / "mountinfo").write_text(V2_MOUNT.format(point=unified) + V1_MOUNT.format(root=mount_root, point=mount))
    return proc


def test_v2_limit_set_on_a_parent_slice_applies_to_the_child(tmp_path):
    proc = fake_v2(tmp_path, "/user.slice/job.scope", {
        "user.slice/memory.max": str(8 * GIB), "user.slice/memory.high": "max",
        "user.slice/job.scope/memory.max": "max", "user.slice/job.scope/memory.high": "max",
    })
    limit = own_cgroup_limit(proc)
    assert limit is not None and limit.bytes == 8 * GIB and limit.version == 2
    assert limit.path == tmp_path / "cg" / "user.slice" / "memory.max"
    assert "cgroup v2 memory.max of" in limit.describe()


def test_v2_the_tightest_of_max_and_high_on_the_way_up(tmp_path):
    proc = fake_v2(tmp_path, "/a/b", {"a/memory.max": str(16 * GIB), "a/b/memory.max": str(12 * GIB),
                                      "a/b/memory.high": str(10 * GIB)})
    limit = own_cgroup_limit(proc)
    assert limit.bytes == 10 * GIB and limit.path.name == "memory.high"


def test_v2_with_no_limit_anywhere_is_none(tmp_path):
    proc = fake_v2(tmp_path, "/a/b", {"a/memory.max": "max", "a/b/memory.max": "max", "a/b/memory.high": "max"})
    assert own_cgroup_limit(proc) is None


def test_v1_limit_on_the_child_and_the_unlimited_root(tmp_path):
    proc = fake_v1(tmp_path, "/slurm/job_42", {
        "memory.limit_in_bytes": "9223372036854771712", "slurm/memory.limit_in_bytes": "9223372036854771712",
        "slurm/job_42/memory.limit_in_bytes": str(12 * GIB),
        "slurm/job_42/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
    })
    limit = own_cgroup_limit(proc)
    assert limit.bytes == 12 * GIB and limit.version == 1
    assert find_own_cgroup(proc).oom_kills() == 3


def test_v1_parent_tighter_than_the_child(tmp_path):
    proc = fake_v1(tmp_path, "/slurm/job_42", {"slurm/memory.limit_in_bytes": str(6 * GIB),
                                               "slurm/job_42/memory.limit_in_bytes": str(12 * GIB)})
    assert own_cgroup_limit(proc).bytes == 6 * GIB


def test_a_container_mount_shows_only_its_own_subtree(tmp_path):
    # Without a cgroup namespace /proc/self/cgroup names the host's path; the container mounts that sub-tree.
    proc = fake_v1(tmp_path, "/docker/abc", {"memory.limit_in_bytes": str(3 * GIB)}, mount_root="/docker/abc")
    assert own_cgroup_limit(proc).bytes == 3 * GIB


def test_no_cgroup_files_means_no_limit(tmp_path):
    assert own_cgroup_limit(tmp_path / "missing") is None
    assert machine_oom_kills(tmp_path / "vmstat") is None
    (tmp_path / "vmstat").write_text("pgfault 10\noom_kill 7\n")
    assert machine_oom_kills(tmp_path / "vmstat") == 7


def test_the_budget_option_overrides_detection():
    assert MemoryBudget.detect(3, budget_gb=12).total_bytes == 12 * GIB
    assert MemoryBudget.detect(3, budget_gb=12).per_process_bytes == 4 * GIB


def test_the_old_root_file_reader_still_reads_given_files(tmp_path):
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v1.write_text(str(2 * GIB))
    assert read_cgroup_limit_bytes(v2, v1) == 2 * GIB


# ----- the plan's arithmetic -------------------------------------------------------------------------------------
def shape_of(config: GPTConfig) -> ModelShape:
    model = GPT(config)
    return ModelShape(n_layer=config.n_layer, n_embd=config.n_embd, n_head=config.n_head, mlp_hidden=config.mlp_hidden,
                      padded_vocab=config.padded_vocab_size, max_seq_len=config.max_seq_len,
                      architecture=config.architecture, params=model.num_params(),
                      block_params=sum(p.numel() for p in model.blocks[0].parameters()))


def saved_activation_bytes(config: GPTConfig, batch: int, packed: bool, checkpointing: bool = False) -> int:
    """Bytes autograd keeps for the backward pass in one forward (parameters left out), de-duplicated by storage."""
    torch.manual_seed(0)
    model = GPT(config).use_memory_savers(64, checkpointing)
    T = config.max_seq_len
    idx = torch.randint(0, config.vocab_size, (batch, T))
    segments = (torch.arange(T) * 3 // T + 1).expand(batch, T).contiguous() if packed else None
    storages: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(idx, idx.clone(), segment_ids=segments)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(size for pointer, size in storages.items() if pointer not in params)


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
@pytest.mark.parametrize("packed", [True, False])
def test_activations_per_block_are_what_autograd_saves(architecture, packed):
    small = dict(vocab_size=300, max_seq_len=48, n_head=4, n_embd=64, architecture=architecture)
    one, two = GPTConfig(n_layer=1, **small), GPTConfig(n_layer=2, **small)
    per_block = saved_activation_bytes(two, 3, packed) - saved_activation_bytes(one, 3, packed)
    assert per_block == 3 * 48 * activation_bytes_per_position(shape_of(two), packed)


def test_checkpointing_keeps_only_each_blocks_input():
    small = dict(vocab_size=300, max_seq_len=48, n_head=4, n_embd=64, architecture="llama")
    one, two = GPTConfig(n_layer=1, **small), GPTConfig(n_layer=2, **small)
    per_block = saved_activation_bytes(two, 3, True, True) - saved_activation_bytes(one, 3, True, True)
    assert per_block == 3 * 48 * 64 * 4  # the (B, T, C) float32 input


def part(plan, name):
    return next(item for item in plan.host if item.name == name)


def test_model_states_per_strategy():
    P = LARGE.params
    ddp = plan_memory(large_inputs())
    assert part(ddp, "model weights").bytes == 4 * P
    assert part(ddp, "AdamW moments").bytes == 8 * P
    assert part(ddp, "gradients (DDP buckets)").bytes == 4 * P  # 16 B per parameter held all along
    single = plan_memory(large_inputs(strategy=SINGLE, processes=1, world_size=1, launcher=False))
    assert part(single, "gradients").phase == STEP  # freed after every step without DDP's buckets
    fsdp = plan_memory(large_inputs(strategy=FSDP))
    assert part(fsdp, "model weights").bytes == 4 * P // 3
    assert part(fsdp, "AdamW moments").bytes == 8 * P // 3
    # The step's larger moment: at the loss, three blocks and the head's unit twice (its all-gather's buffer) with
    # the head's gradient; at the backward pass's end, the sharded gradients and the embedding gathered twice again
    # with its dense gradient, the activations and the loss's chunk freed by then.
    V, C, B = LARGE.padded_vocab, LARGE.n_embd, LARGE.block_params
    at_loss, at_end = 4 * (3 * B + 2 * V * C) + 4 * V * C, 4 * P // 3 + 12 * V * C
    beside = part(fsdp, "activations").bytes + part(fsdp, "loss and logits").bytes
    assert part(fsdp, "gathered weights and gradients").bytes == max(at_loss, at_end - beside)
    # Validation runs the sharded model: no whole copy of the weights, two blocks and a unit gathered.
    assert part(fsdp, "gathered weights (evaluation)").bytes == 4 * (2 * V * C + 2 * B)  # the unit and its buffer
    assert not [item for item in fsdp.host if "replica" in item.name or item.phase == "save"], "no whole copy"
    # The moments are made by the first step (and what a process keeps once it trains, by the first steps): the load
    # phase holds none of them, a resume's holds the moments.
    trained = part(fsdp, "kept once training").bytes
    assert fsdp.phase_high_water("load") == fsdp.phase_high_water("step") - sum(
        item.bytes for item in fsdp.host if item.phase == "step") - 8 * P // 3 - trained
    resumed = plan_memory(large_inputs(strategy=FSDP, resuming=True))
    assert resumed.phase_high_water("load") == fsdp.phase_high_water("load") + 8 * P // 3


def test_activations_with_and_without_checkpointing():
    per_position = (12 * 768 + 4 * 2048 + 12 + 2 + 192) * 4  # llama, packed: 70,456 B (measured with hooks)
    assert activation_bytes_per_position(LARGE, masked=True) == per_position
    plain = plan_memory(large_inputs())
    assert part(plain, "activations").bytes == 2688 * 12 * per_position
    checkpointed = plan_memory(large_inputs(activation_checkpointing=True))
    assert part(checkpointed, "activations").bytes == 2688 * (12 * 768 * 4 + per_position)


def test_logits_chunked_and_whole():
    around = 2688 * (3 * 768 * 4 + 192)
    chunked = plan_memory(large_inputs())
    # One chunk's logits and the head's gradient, once: scaled in place in the backward pass.
    assert part(chunked, "loss and logits").bytes == 32000 * 768 * 4 + 2048 * 32000 * 4 + around
    whole = plan_memory(large_inputs(loss_chunk_tokens=0))
    assert part(whole, "loss and logits").bytes == 3 * 2688 * 32000 * 4 + around
    # Under bf16 on a GPU a chunk's logits take about 8 B each (bf16 out of the matmul, float32 with the softmax's
    # gradient), and the head's weight gets a bf16 copy.
    gpu = plan_memory(large_inputs(device="cuda", bf16=True, gpu_bytes=20 * GIB))
    [loss] = [item for item in gpu.device if item.name == "loss and logits"]
    assert loss.bytes == 32000 * 768 * 4 + 32000 * 768 * 2 + 2048 * 32000 * 8 + around


def test_high_water_is_what_is_held_plus_the_largest_phase():
    plan = plan_memory(large_inputs())
    resident = sum(item.bytes for item in plan.host if item.phase == "resident")
    step = sum(item.bytes for item in plan.host if item.phase == STEP)
    assert plan.largest_phase() == STEP
    assert plan.high_water() == resident + step
    assert plan.machine_total == 3 * plan.high_water() + 260 * MB  # three processes and the launcher
    # Without a fixed mmap threshold glibc keeps 65% of what a step allocates, checkpointing or not.
    heap = plan_memory(large_inputs(malloc_mmap_threshold_mb=0.0))
    activations_and_loss = part(heap, "activations").bytes + part(heap, "loss and logits").bytes
    assert part(heap, "freed memory the C heap keeps").bytes == int(0.65 * activations_and_loss)
    recomputed = plan_memory(large_inputs(malloc_mmap_threshold_mb=0.0, activation_checkpointing=True))
    assert part(recomputed, "freed memory the C heap keeps").bytes == part(heap, "freed memory the C heap keeps").bytes


def test_compile_workers_count_only_while_the_compile_passes_run():
    gpu = dict(device="cuda", bf16=True, gpu_bytes=80 * GIB, compiled=True, compile_workers=16)
    fixed = plan_memory(large_inputs(static_shapes=True, **gpu))
    [workers] = [item for item in fixed.machine if item.name == "torch.compile workers"]
    assert workers.phase == STEP and workers.bytes == 3 * 16 * 500 * MB
    # The host's largest phase is the save (the main process's copy of the weights): the pool, shut down after the
    # compile passes (steps), is not there then; the machine's peak is the larger of the two moments.
    assert fixed.largest_phase() == "save"
    held = 260 * MB + sum(item.bytes for item in fixed.machine if item.name == "DataLoader workers")
    at_save = fixed.high_water(True) + 2 * fixed.high_water(False) + held
    while_compiling = fixed.high_water(True, phases=(STEP,)) + 2 * fixed.high_water(False, phases=(STEP,))
    assert fixed.machine_total == max(at_save, while_compiling + held + workers.bytes)
    assert fixed.machine_total < at_save + workers.bytes
    # Shapes compiled as they come keep the pool all along.
    as_they_come = plan_memory(large_inputs(static_shapes=False, **gpu))
    assert as_they_come.machine_total == (as_they_come.high_water(True) + 2 * as_they_come.high_water(False)
                                          + sum(item.bytes for item in as_they_come.machine))


def test_a_gpu_plan_keeps_the_model_on_the_device():
    plan = plan_memory(large_inputs(device="cuda", bf16=True, gpu_bytes=20 * GIB))
    names = [item.name for item in plan.host]
    assert "activations" not in names and "CUDA runtime" in names and "save-time copy of the weights" in names
    assert plan.device_peak > 16 * LARGE.params
    assert plan.high_water(main=True) - plan.high_water(main=False) == 4 * LARGE.params


# ----- the levers ------------------------------------------------------------------------------------------------
def test_a_small_budget_turns_the_levers_on_and_keeps_the_global_batch():
    inputs = large_inputs(malloc_mmap_threshold_mb=0.0)
    choice = choose_savers(inputs, 9 * GIB, explicit=(), positions_for_rows=positions)
    assert choice.fits
    assert choice.changes["malloc_mmap_threshold_mb"] == 1.0 and choice.changes["activation_checkpointing"] is True
    rows, steps = choice.changes["batch_size_per_gpu"], choice.changes["gradient_accumulation_steps"]
    assert rows < 32 and rows * steps == 32 * 2
    assert "the same rows per optimizer step" in choice.line()


def test_a_plan_that_fits_changes_nothing():
    choice = choose_savers(large_inputs(), 64 * GIB, explicit=(), positions_for_rows=positions)
    assert choice.fits and choice.changes == {} and "none needed" in choice.line()


def test_explicit_settings_are_never_changed():
    inputs = large_inputs(malloc_mmap_threshold_mb=0.0)
    choice = choose_savers(inputs, 9 * GIB, explicit={"activation_checkpointing", "batch_size_per_gpu"},
                           positions_for_rows=positions)
    assert "activation_checkpointing" not in choice.changes and "batch_size_per_gpu" not in choice.changes
    assert "gradient_accumulation_steps" not in choice.changes  # halving needs both: neither is touched


def test_nothing_fits_says_by_how_much_and_what_would():
    choice = choose_savers(large_inputs(), 5 * GIB, explicit=(), positions_for_rows=positions)
    assert not choice.fits
    message = no_fit_message(choice, (), "accelerate launch --config_file configs/accelerate/fsdp.yaml ...",
                             positions)
    assert "MB short" in message and "5.0 GiB budget" in message
    assert "--num_processes 1" in message  # one process fits where three do not
    assert "\n" not in message  # one paragraph
