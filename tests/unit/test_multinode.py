"""Several machines need one output folder that all of them see: a folder that some ranks cannot see is
refused (two machines on one, for real: tests/integration/test_multinode_launch.py)."""

from __future__ import annotations

import pytest
from training_helpers import workspace as workspace  # a fixture, imported as itself so that pytest finds it here

pytestmark = pytest.mark.slow


def test_output_folder_not_shared_between_nodes_is_refused(workspace, monkeypatch):
    """Checkpoints on several machines need one folder all of them see: a folder only one sees is an error."""
    from lowmem.distributed import collectives as distributed
    from lowmem.errors import ConfigError

    class Accelerator:  # rank 1 of 4, on a machine of 2 processes, that never sees the main process's probe
        num_processes, is_main_process, process_index = 4, False, 1

        def wait_for_everyone(self) -> None:
            pass

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(distributed, "broadcast_from_main", lambda accelerator, compute: "token")
    monkeypatch.setattr(distributed, "all_reduce_sum", lambda accelerator, values: [2.0])  # 2 ranks saw nothing
    with pytest.raises(ConfigError, match="2 of 4 processes cannot see --output_dir=.*mounts at the same path"):
        distributed.check_shared_folder(Accelerator(), workspace[0] / "not-shared")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # one machine: nothing to check
    distributed.check_shared_folder(Accelerator(), workspace[0] / "not-shared")
