"""The start-up of `train` and `plan`, in one place: the run folder's saved state is read once, and every setting
that depends on it is settled from it before anything is built or written.

    start_up            `train`: the given values checked (config, data files, run folder, a new run's tokenizer),
                        the saved run read, then `settle_run`
    read_saved_run      what a resume continues from, read once: the checkpoint named by --resume_from_checkpoint,
                        else the run's newest complete one (`CheckpointFolders.latest_complete`, the definition the
                        resume itself uses), its trainer state, and the run folder's listing (`SavedRun`)
    settle_run          `train` and `plan`: the model a run starts from found and checked (`lowmem.source.settle`),
                        and the fields left to decide decided from it and the saved run (`lowmem.config.settle`, the
                        rules `evaluate`, `generate` and `export` settle by too); the config comes back read-only

The memory savers are settled next, once the Accelerator exists (`lowmem.train.memory_fit.settle_memory`, handed
the saved run's choice), with what the plan decides on the way (speed and data settings, the tokenizer, the data's
index). The Trainer receives all of it and the saved run: it settles nothing again, and its resume takes the
trainer state and the run folder's listing read here (`SavedRun`) when it continues from that checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection

from lowmem.checkpoint.contents import read_trainer_state
from lowmem.checkpoint.listing import CheckpointFolders
from lowmem.checkpoint.run_lock import check_output_dir
from lowmem.config import TrainConfig, validate_config
from lowmem.config.settle import in_effect, settled_config
from lowmem.config.read_only import read_only
from lowmem.data.path_checks import check_data_files
from lowmem.source.finite import check_finite
from lowmem.source.settle import StartingPoint, refuse_keep_training_without_run, settle_source
from lowmem.config.overrides import explicit_fields
from lowmem.train.memory_fit import SAVED_KEY
from lowmem.train.setup import check_tokenizer_data

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class SavedRun:
    """What a resume continues from, as read at start-up: the checkpoint folder and its trainer state (both None
    for a new run, or for a run folder that holds no checkpoint yet), and the run folder's listing, which the
    run's CheckpointManager goes on with (None for a new run: its folder is listed once it is the run's)."""

    checkpoint: Path | None = None
    state: dict[str, Any] | None = None
    folders: CheckpointFolders | None = field(default=None, compare=False)

    @property
    def config(self) -> dict[str, Any] | None:
        """The config the checkpoint was saved with, the fields added since it was written at their values then."""
        return None if self.state is None else in_effect(dict(self.state["config"]))

    def memory_choice(self, allow_config_change: bool) -> dict[str, Any] | None:
        """The memory savers the run chose, which a resume applies again (none to keep when
        `allow_config_change` lets the savers be chosen anew for this host's budget)."""
        return None if self.state is None or allow_config_change else self.state.get(SAVED_KEY)

    def state_of(self, folder: Path) -> dict[str, Any]:
        """The trainer state of the checkpoint `folder` a resume loads: the one read at start-up when it is that
        checkpoint (the usual case), else read now (the newest was found damaged, and an older one is resumed
        from)."""
        if self.state is not None and self.checkpoint is not None and \
                Path(self.checkpoint).resolve() == Path(folder).resolve():
            return self.state
        return read_trainer_state(Path(folder))


def read_saved_run(output_dir: str | Path, named: str | Path | None = None) -> SavedRun:
    """What a resume of the run in `output_dir` continues from: the checkpoint `named` (--resume_from_checkpoint),
    else the newest complete one whose files have their recorded sizes (the resume hashes them before it loads);
    without one, a SavedRun with no checkpoint. The run folder is listed once here, for the whole start-up."""
    folders = CheckpointFolders(Path(output_dir))
    if named:
        return SavedRun(Path(named), read_trainer_state(Path(named)), folders)
    while (found := folders.latest_complete(verify_hashes=False)) is not None:
        try:
            state = read_trainer_state(found)
            dict(state["config"])
            return SavedRun(found, state, folders)
        except (OSError, ValueError, KeyError, TypeError) as error:
            folders.set_damaged(found, [f"its trainer state is unreadable ({error})"])
    return SavedRun(folders=folders)


def start_up(config: TrainConfig, given: Collection[str] | None, is_keep_training: bool,
             resume_from: str | Path | None = None) -> tuple[TrainConfig, SavedRun, StartingPoint | None]:
    """The config a run uses, the saved run it continues from and the model it starts from (None: random weights),
    before anything is built or written.

    The values as given are checked first (a mistake is named before anything is read), then the data files and
    the run folder. A resume (`is_keep_training`) reads the saved run once (`read_saved_run`) and settles from it
    (`settled_config`). A new run started from a model (--init_from) takes the model's shape and tokenizer, every
    tensor checked (`lowmem.source.settle`); any other new run's tokenizer must have been trained on its data
    (`check_tokenizer_data`).
    """
    validate_config(config)
    check_data_files(config)
    check_output_dir(config.output_dir)
    explicit = given if given is not None else explicit_fields(config)
    saved = read_saved_run(config.output_dir, resume_from) if is_keep_training else SavedRun()
    if is_keep_training and config.init_from and saved.state is None:
        refuse_keep_training_without_run(config)
    config, start = settle_run(config, given, saved)
    if start is not None and start.source is not None and not start.resumed:
        check_finite(start.source)  # every weight read once, before the run folder is touched
    if not is_keep_training and start is None:  # a resume checks the tokenizer against its checkpoint's instead
        check_tokenizer_data(config, explicit)
    return config, saved, start


def settle_run(config: TrainConfig, given: Collection[str] | None,
               saved: SavedRun) -> tuple[TrainConfig, StartingPoint | None]:
    """The config a run of `config` uses, and the model it starts from (None: random weights): what the source
    model decides (`lowmem.source.settle`; a resume keeps the source it was saved with), then every field left to
    decide (`settled_config`), from the saved run a resume continues from (`saved`; empty for a new run). What
    `train` runs and what `plan` plans are settled here alike; the config comes back read-only
    (`lowmem.config.read_only`): nothing after this decides a setting again."""
    explicit = given if given is not None else explicit_fields(config)
    config, start = settle_source(config, explicit, saved.config, saved.checkpoint)
    return read_only(settled_config(config, saved.config, given)), start


