"""The model-memory bench's parts in-process: its FSDP launch gives each process the environment
configs/accelerate/fsdp.yaml gives, its cases add one lever at a time, and its table is read (the
measurements, in fresh processes: tests/integration/test_model_memory_launches.py)."""

from __future__ import annotations

from lowmem.bench.memory_bench import DDP, FSDP, cases, launcher, parse_bench_output


def test_the_bench_fsdp_launch_is_the_fsdp_config_files(monkeypatch):
    """bench_memory launches FSDP with flags, not the file (which an installed package has not got): the
    environment the launcher gives each process must be the one configs/accelerate/fsdp.yaml gives."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env
    from training_helpers import launcher_args

    def launch_env(args) -> dict[str, str]:
        env = prepare_multi_gpu_env(args)
        return {name: value for name, value in env.items() if name.startswith("FSDP_") or "FSDP" in name}

    flags = launcher(FSDP, 3)[3:]  # after `python -m accelerate.commands.launch`
    from_flags, _, _ = _validate_launch_command(launch_command_parser().parse_args([*flags, "train_low_mem.py"]))
    from_file = launcher_args("fsdp.yaml")
    assert launch_env(from_flags) == launch_env(from_file)
    assert launch_env(from_flags)["ACCELERATE_USE_FSDP"] == "true"


def test_the_cases_add_one_lever_at_a_time():
    labels = [(case.strategy, case.loss_chunk_tokens, case.activation_checkpointing)
              for case in cases([DDP, FSDP], 512)]
    assert labels == [(DDP, 0, False), (DDP, 512, False), (DDP, 0, True), (DDP, 512, True),
                      (FSDP, 0, False), (FSDP, 512, False), (FSDP, 0, True), (FSDP, 512, True)]
    assert [(case.strategy, case.loss_chunk_tokens, case.activation_checkpointing)
            for case in cases([FSDP], 512, every_combination=False)] == [(FSDP, 512, True)]


def test_the_bench_table_is_parsed():
    output = ("| (a) batches in memory (ceiling) | 1,234 | 1.00 | 0.00% | 600 / 610 | - | - |\n\n"
              "RSS the data pipeline adds per process: 20 / 21 MB; process high-water RSS: 1,001 / 999 MB "
              "(sum 2,000 MB)")
    assert parse_bench_output(output) == ([1001.0, 999.0], 1234.0)
    assert parse_bench_output("Traceback ...") is None
