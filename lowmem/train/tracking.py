"""Training curves (`--report_to=tensorboard` or `wandb`) through Accelerate's trackers, from the main process.

The figures are the ones the training log already has: at every log line the loss, learning rate, gradient
norm, tokens/s and RSS (`LineFigures`), at every validation the loss, perplexity and BLEU-4 (`EvalResult`),
each against the optimizer step. TensorBoard's event files go to `tensorboard_dir(output_dir)`,
logs/tensorboard/<basename of output_dir>/: a resumed run writes into the same folder and continues the curve.
W&B's run id is chosen at a run's first start and kept in <output_dir>/tracking.json: a resumed run continues
the same W&B run (resume="allow"), a new run in the folder (`--overwrite=True`) gets a new one.

    accelerator = create_accelerator(..., **tracker_arguments(config.report_to))  # before anything is built
    tracking = Tracking(accelerator, config)
    tracking.start(step, resumed)       # then log_line(step, figures) / log_validation(step, result)
    tracking.end()                      # in a finally: the event files are flushed and closed
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import secrets
import string
import threading
from pathlib import Path
from typing import Any, Callable

from accelerate import Accelerator

from lowmem.atomic_files import write_json_atomic
from lowmem.config import TrainConfig
from lowmem.errors import ConfigError
from lowmem.eval.validation import EvalResult
from lowmem.run_files import LAUNCH_LOG_DIR, tracking_record_file
from lowmem.train.log import LineFigures

logger = logging.getLogger(__name__)

# The tags, grouped as TensorBoard shows them: one per figure of a log line (with the field of `LineFigures` it
# plots), one per figure of a validation.
LINE_FIELDS = {"train/loss": "loss", "train/learning_rate": "learning_rate", "train/grad_norm": "grad_norm",
               "train/tokens_per_s": "tokens_per_s", "memory/rss_mb": "rss_mb", "memory/rss_max_mb": "rss_max_mb",
               "memory/rss_sum_mb": "rss_sum_mb"}
LINE_TAGS = tuple(LINE_FIELDS)
# Figures of a log line that only some devices have (the MFU needs a known peak, the GPU peak a GPU).
DEVICE_LINE_FIELDS = {"train/mfu": "mfu", "memory/gpu_peak_mb": "gpu_peak_mb"}
EVAL_TAGS = ("eval/val_loss", "eval/perplexity", "eval/bleu4")
TAGS = LINE_TAGS + EVAL_TAGS

# What each tracker needs installed, and how to install it.
INSTALL = {"tensorboard": ("tensorboard", 'pip install "tensorboard>=2.14" (or pip install ".[tensorboard]" in '
                                          "lowmem's folder)"),
           "wandb": ("wandb", "pip install wandb")}


RUN_FOLDER_FILE = "run_folder.txt"  # in logs/tensorboard/<name>/: the run folder that owns the name


def run_name(output_dir: str | Path, log_dir: str | Path = LAUNCH_LOG_DIR, claim: bool = False) -> str:
    """The run's name for the trackers: the basename of its output folder (`model_save/demo` → `demo`), or,
    when another run folder of that basename already owns the name (`exp1/model`, `exp2/model`), the basename
    and a hash of the whole path (`model-1f3a9c2e`), so that two runs never write into one TensorBoard run.

    The owner of a name is recorded in logs/tensorboard/<name>/run_folder.txt; with `claim`, an unowned name is
    taken (created exclusively: two runs starting together cannot both take it).
    """
    folder = str(Path(output_dir).resolve())  # one name for a folder reached through a link or `..`
    base = Path(folder).name or "run"
    hashed = f"{base}-{hashlib.sha1(folder.encode()).hexdigest()[:8]}"
    owner_file = Path(log_dir) / "tensorboard" / base / RUN_FOLDER_FILE
    owner = _owner(owner_file)
    if owner == folder:
        return base
    if owner is None and claim:
        try:
            owner_file.parent.mkdir(parents=True, exist_ok=True)
            with open(owner_file, "x", encoding="utf-8") as file:
                file.write(folder + "\n")
            return base
        except FileExistsError:
            return base if _owner(owner_file) == folder else hashed
        except OSError:
            return base  # a full disk: the tracker itself will say so
    return base if owner is None else hashed



def _owner(owner_file: Path) -> str | None:
    """The run folder recorded as owning a TensorBoard run's name, or None when none is (yet)."""
    try:
        return owner_file.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def tensorboard_dir(output_dir: str | Path, log_dir: str | Path = LAUNCH_LOG_DIR) -> Path:
    """Where a run's TensorBoard event files go: logs/tensorboard/<run name>/ (see `run_name`).

    Relative to the working directory, beside the training log and the memory logs. The same output_dir gives
    the same folder, so a resumed run adds to the curves of the run it continues; `tensorboard --logdir
    logs/tensorboard` shows every run side by side. (Accelerate's tracker writes to this folder as
    logging_dir/project_name; the hyperparameters go into a timestamped subfolder of it.)
    """
    return Path(log_dir) / "tensorboard" / run_name(output_dir, log_dir)


WANDB_ID_KEY = "wandb_run_id"  # in <output_dir>/tracking.json
# W&B run ids may hold letters, digits, - and _; 8 lowercase letters and digits, as wandb's own ids.
_WANDB_ID_ALPHABET = string.ascii_lowercase + string.digits


def new_wandb_run_id() -> str:
    """A fresh W&B run id: 8 random lowercase letters and digits (36^8 ids: two runs never share one)."""
    return "".join(secrets.choice(_WANDB_ID_ALPHABET) for _ in range(8))


def recorded_wandb_run_id(output_dir: str | Path) -> str | None:
    """The W&B run id kept in the run folder, or None when there is none (no record, or one that cannot be read)."""
    try:
        record = json.loads(tracking_record_file(output_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    run_id = record.get(WANDB_ID_KEY) if isinstance(record, dict) else None
    return run_id if isinstance(run_id, str) and run_id else None


def wandb_run(output_dir: str | Path, resumed: bool) -> dict[str, str]:
    """wandb.init's arguments that make a run and its resumes one W&B run: `id` (and `resume="allow"` on a resume).

    A new run chooses an id and keeps it in <output_dir>/tracking.json (atomically, replacing an earlier run's: a
    new run in the folder is a new W&B run); a resume reads it back. A resume with no id kept (a run started before
    the id was kept, or with another tracker) starts a new W&B run and keeps its id for the next resume. Main
    process only: the trackers live there.
    """
    run_id = recorded_wandb_run_id(output_dir) if resumed else None
    if resumed and run_id is not None:
        logger.info("W&B: continuing run %s (its id kept in %s).", run_id, tracking_record_file(output_dir))
        return {"id": run_id, "resume": "allow"}
    run_id = new_wandb_run_id()
    record = tracking_record_file(output_dir)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(record, {WANDB_ID_KEY: run_id})
    except OSError as error:
        # Only a later resume needs the record: this run's curves go on, and the resume starts a new W&B run.
        logger.warning("W&B: the run id %s cannot be kept in %s (%s): a resume of this run will start a new W&B "
                       "run.", run_id, record, error)
    else:
        logger.info("W&B: new run %s%s (its id kept in %s for a resume).", run_id,
                    ", no id kept from the run this resumes" if resumed else "", record)
    return {"id": run_id}


def forget_tracker_runs(output_dir: str | Path) -> None:
    """A new run in a folder: remove the earlier run's record, so that a resume of this run with --report_to=wandb
    (after a start with another tracker, or none) starts a W&B run of its own instead of continuing the earlier's."""
    try:
        tracking_record_file(output_dir).unlink(missing_ok=True)
    except OSError:
        pass  # a folder that cannot be written: training itself will say so when it saves


def check_installed(report_to: str) -> None:
    """Fail before anything is built, with what to install, when the tracker's package is missing."""
    if report_to == "none":
        return
    package, command = INSTALL[report_to]
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"--report_to={report_to} needs the {package} package, which is not installed. Install "
                          f"it with `{command}`, or train without curves (--report_to=none); the training log "
                          f"still has every figure, one line per logging step.")


def tracker_arguments(report_to: str, log_dir: str | Path = LAUNCH_LOG_DIR) -> dict[str, Any]:
    """The Accelerator's arguments for `report_to` (none for "none"): `log_with` and the logging folder
    (logs/<tracker>/, under which each run has its folder). Checks that the tracker is installed."""
    check_installed(report_to)
    if report_to == "none":
        return {}
    return {"log_with": report_to, "project_dir": str(Path(log_dir) / report_to)}


def hyperparameters(config: TrainConfig) -> dict[str, bool | int | float | str]:
    """The config as a flat dict of the values TensorBoard's hparams take (None, an automatic setting, left out)."""
    values = dataclasses.asdict(config)
    return {name: value for name, value in values.items() if isinstance(value, (bool, int, float, str))}


class Tracking:
    """Scalars for Accelerate's trackers; does nothing with `--report_to=none`. Every rank may call it: the
    trackers write on the main process only.

    Args:
        accelerator: the run's Accelerator, created with `tracker_arguments(config.report_to)`.
        config: the run's config (report_to, output_dir, and the hyperparameters stored with the run).
    """

    def __init__(self, accelerator: Accelerator, config: TrainConfig) -> None:
        self.accelerator, self.config = accelerator, config
        self.enabled = config.report_to != "none"
        if self.enabled and not accelerator.log_with:
            raise ConfigError(f"--report_to={config.report_to} needs an Accelerator created with its trackers: "
                              "create_accelerator(..., **tracker_arguments(config.report_to)), or leave out the "
                              "accelerator and let the Trainer create it.")

    def start(self, step: int, resumed: bool) -> None:
        """Open the run's trackers and store the config with them; once, before the first step.

        TensorBoard: a fresh run hides what an earlier run in the same folder logged; a resumed run hides only
        what was logged after the checkpoint it continues from (steps a crash lost and the run trains again).
        W&B: a resumed run continues the W&B run of the run it resumes (`wandb_run`).
        """
        if not resumed and self.accelerator.is_main_process:
            forget_tracker_runs(self.config.output_dir)  # whatever this run reports to
        if not self.enabled:
            return
        claim = self.accelerator.is_main_process and self.config.report_to == "tensorboard"
        name = run_name(self.config.output_dir, claim=claim)
        # TensorBoard drops earlier points at steps >= purge_step (a start event in the new file).
        purge_step = step + 1 if resumed else 0
        wandb_kwargs: dict[str, Any] = {"dir": LAUNCH_LOG_DIR, "name": name}
        if self.accelerator.is_main_process and self.config.report_to == "wandb":
            Path(LAUNCH_LOG_DIR).mkdir(parents=True, exist_ok=True)  # wandb writes its run folder into logs/wandb/
            wandb_kwargs.update(wandb_run(self.config.output_dir, resumed))
        init_kwargs = {"tensorboard": {"purge_step": purge_step}, "wandb": wandb_kwargs}
        self._quiet_writer_threads()
        self._guarded(lambda: self.accelerator.init_trackers(name, config=hyperparameters(self.config),
                                                             init_kwargs=init_kwargs))

    @staticmethod
    def _quiet_writer_threads() -> None:
        """TensorBoard writes from a thread of its own, which prints a traceback when the disk is full before the
        next call re-raises the error here (where `_guarded` turns it into one warning): silence that print."""
        previous = threading.excepthook
        if getattr(previous, "_lowmem", False):
            return

        def hook(args: threading.ExceptHookArgs) -> None:
            if not (issubclass(args.exc_type, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
                previous(args)

        hook._lowmem = True  # type: ignore[attr-defined]
        threading.excepthook = hook

    def _guarded(self, write: Callable[[], object]) -> None:
        """Run a tracker's write; a full disk (or a lost permission) turns the curves off with one warning instead
        of stopping the run: the training log keeps every figure."""
        if not self.enabled:
            return
        try:
            write()
        except OSError as error:
            self.enabled = False
            logger.warning("The training curves (--report_to=%s) cannot be written (%s): training goes on without "
                           "them; the training log keeps every figure.", self.config.report_to, error)

    def log_line(self, step: int, figures: LineFigures) -> None:
        """The figures of a training log line, at its optimizer step."""
        if not self.enabled:
            return
        values = {tag: float(getattr(figures, field)) for tag, field in LINE_FIELDS.items()}
        values.update({tag: float(getattr(figures, field)) for tag, field in DEVICE_LINE_FIELDS.items()
                       if getattr(figures, field) is not None})
        if figures.preference is not None:  # TRL's names: train/rewards/chosen, ...
            values.update({f"train/{name}": float(value) for name, value in figures.preference.items()
                           if name.startswith("rewards/")})
        self._guarded(lambda: self.accelerator.log(values, step=step))

    def log_validation(self, step: int, result: EvalResult) -> None:
        """A validation's loss, perplexity and, when it was scored, BLEU-4."""
        if not self.enabled:
            return
        values = {"eval/val_loss": float(result.loss)}
        if not result.preference:  # the perplexity of a DPO loss means nothing
            values["eval/perplexity"] = float(result.perplexity)
        if result.bleu is not None:
            values["eval/bleu4"] = float(result.bleu.score)
        values.update({f"eval/val_loss/{name}": float(loss) for name, loss in result.by_source.items()})
        values.update({f"eval/{name}": float(value) for name, value in result.preference.items()
                       if name.startswith("rewards/")})
        self._guarded(lambda: self.accelerator.log(values, step=step))

    def end(self) -> None:
        """Flush and close the trackers (a stopped or failed run's curves included).

        This is the trackers' half of `accelerator.end_training()`, which also destroys the process group: the
        Trainer may have been handed an Accelerator its caller goes on using, and on a rank that failed, other
        ranks may still be inside a collective.
        """
        if not self.enabled:
            return
        for tracker in self.accelerator.trackers:
            self._guarded(tracker.finish)
        self.accelerator.trackers.clear()
