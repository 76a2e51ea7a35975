"""What a run folder (`output_dir`) holds besides its checkpoints, so that a run is one folder:

    logs/train.log                      the run's training log (a resumed run appends to it)
    logs/memory_<run>_rank<r>.jsonl     the memory logs, one per rank per segment (`lowmem memlog RUN_FOLDER`)
    tokenizer.json                      the record of the tokenizer the run trains with (its hash, its data)
    started_from.json, tokenizer/       a run started from a model: its source, and the model's tokenizer copied
    tracking.json                       the run's W&B run id, which a resume continues (`--report_to=wandb`)

The launch folder's logs/ keeps the day's training log and links to the memory logs, where earlier versions
wrote them.
"""

from __future__ import annotations

from pathlib import Path

LAUNCH_LOG_DIR = "logs"  # relative to the folder training was started from
RUN_LOG_DIR = "logs"  # inside the run folder
TRAINING_LOG_NAME = "train.log"
TOKENIZER_RECORD_NAME = "tokenizer.json"
TRACKING_RECORD_NAME = "tracking.json"


def run_log_dir(output_dir: str | Path) -> Path:
    """The run folder's own log folder: the training log and the memory logs."""
    return Path(output_dir) / RUN_LOG_DIR


def run_training_log(output_dir: str | Path) -> Path:
    """The run's training log, every segment of a resumed run appended."""
    return run_log_dir(output_dir) / TRAINING_LOG_NAME


def tokenizer_record_file(output_dir: str | Path) -> Path:
    """The record of the run's tokenizer (see `lowmem.tokenization.identity`)."""
    return Path(output_dir) / TOKENIZER_RECORD_NAME


def tracking_record_file(output_dir: str | Path) -> Path:
    """The record of the run's tracker runs (the W&B run id a resume continues; see `lowmem.train.tracking`)."""
    return Path(output_dir) / TRACKING_RECORD_NAME
