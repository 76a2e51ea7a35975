"""The training log: readable lines on the console, in the run folder's logs/train.log and in the launch
folder's logs/chat_trainer_low_mem_YYYYMMDD.log, one per logging step."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import logging.handlers
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from accelerate import Accelerator
from tqdm import tqdm

from lowmem.distributed.collectives import all_reduce_max, all_reduce_sum
from lowmem.data.lengths import CutRows
from lowmem.distributed.performance import mfu, peak_bf16_tflops
from lowmem.log_format import log_formatter, open_log_file
from lowmem.preference.log import SkippedPairs, StallAtLn2
from lowmem.train.step import StepResult
from lowmem.units import MB

logger = logging.getLogger(__name__)


class _AllRanksFilter(logging.Filter):
    """On ranks other than the main one, let through warnings and records logged with extra={"all_ranks": True}."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or getattr(record, "all_ranks", False)


class _TqdmHandler(logging.StreamHandler):
    """Writes log lines above the progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - a log line must never stop training
            self.handleError(record)


def training_log_path(log_dir: str | Path = "logs", today: dt.date | None = None) -> Path:
    """The day's human-readable training log file."""
    today = today or dt.date.today()
    return Path(log_dir) / f"chat_trainer_low_mem_{today:%Y%m%d}.log"


def setup_training_log(rank: int, is_main: bool, log_dir: str | Path = "logs") -> Path:
    """Console on every rank (others only warnings), and from the main rank the day's log file in `log_dir` and
    the lines kept for the run's own log (`attach_run_log`); returns the day's path."""
    path = training_log_path(log_dir)
    formatter = log_formatter(rank)  # the format of the lines before training too (`lowmem.log_format`)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_lowmem", False) or isinstance(handler, logging.StreamHandler):
            root.removeHandler(handler)
    console = _TqdmHandler()
    console.setLevel(logging.INFO)
    if not is_main:
        console.addFilter(_AllRanksFilter())
    handlers: list[logging.Handler] = [console]
    if is_main:
        day_log = open_log_file(path, formatter)
        handlers += [day_log, _PendingRunLog()] if day_log is not None else [_PendingRunLog()]
    for handler in handlers:
        handler.setFormatter(formatter)
        handler._lowmem = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    return path


class _PendingRunLog(logging.handlers.MemoryHandler):
    """The lines logged before the run folder may be written to (it can still be refused: in use, or holding
    another run), kept until `attach_run_log` writes them there."""

    def __init__(self) -> None:
        super().__init__(capacity=100_000, flushLevel=logging.CRITICAL + 1)

    def shouldFlush(self, record: logging.LogRecord) -> bool:  # noqa: N802 - logging's name
        return False  # only attach_run_log empties it


def attach_run_log(run_log: str | Path) -> Path | None:
    """From now on, the main rank's lines also go to `run_log` (the run folder's, every segment of a resumed run
    appended), the lines kept since `setup_training_log` first; None on the other ranks."""
    root = logging.getLogger()
    pending = next((handler for handler in root.handlers if isinstance(handler, _PendingRunLog)), None)
    if pending is None:
        return None
    run_log = Path(run_log)
    assert pending.formatter is not None  # set with the handler, in setup_training_log
    file = open_log_file(run_log, pending.formatter)
    root.removeHandler(pending)
    if file is None:
        pending.buffer.clear()
        return None
    file._lowmem = True  # type: ignore[attr-defined]
    for record in pending.buffer:
        file.handle(record)
    pending.buffer.clear()
    root.addHandler(file)
    return run_log


@dataclass
class LineFigures:
    """The figures of one log line, as plain floats: what the trackers plot (see `lowmem.train.tracking`)."""

    loss: float  # mean token loss over the steps since the last line, over every rank
    learning_rate: float
    grad_norm: float  # mean over the steps since the last line, before clipping
    tokens_per_s: float  # real input tokens over every rank
    rss_mb: float  # this process's RSS
    rss_max_mb: float  # the largest RSS of a rank: the process nearest to an out-of-memory kill
    rss_sum_mb: float  # the ranks' RSS added up: on one host, what the training's processes hold together
    mfu: float | None = None  # model FLOPs utilisation over every rank (None: the device's peak is not known)
    gpu_peak_mb: float | None = None  # the most GPU memory a rank's tensors took so far in the run (None: no GPU)
    # Preference training: rewards/chosen, rewards/rejected, rewards/accuracy and rewards/margin over the window's
    # pairs on every rank (the loss above is then the mean DPO loss per pair).
    preference: dict[str, float] | None = None


class StepLog:
    """Sums over the optimizer steps since the last log line, on this rank, and the line itself when due.

    Due every `every` steps and at the last step; the line's loss and tokens/s are over every rank. Time spent
    in `paused()` (validation, checkpoint saves) is left out of tokens/s, so the figure is the training's rate
    whether or not a validation fell between two lines. The sums stay on the device until the line is written:
    adding a step waits for nothing.

    Args:
        accelerator: the run's Accelerator.
        total_steps: the run's optimizer steps in all (the last one always gets a line).
        every: steps between lines.
        flops_per_token: the model's training FLOPs per token with attention over `max_seq_len`
            (`GPT.estimate_flops_per_token`), for the MFU; 0 leaves the MFU out.
        peak_tflops: the device's dense bf16 peak (`--peak_tflops`); 0 looks a GPU up by its name
            (`lowmem.distributed.performance.peak_bf16_tflops`), and the CPU has none.
        attention_flops_per_pair: attention's FLOPs per (query, key) pair (`GPT.attention_flops_per_pair`): with
            it, the MFU counts attention over each row's real length (the steps' `attention_pairs`), and the line
            also gives the figure over `max_seq_len` where the two differ.
        max_seq_len: the sequence length `flops_per_token` counts attention over.
    """

    def __init__(self, accelerator: Accelerator, total_steps: int, every: int, flops_per_token: float = 0.0,
                 peak_tflops: float = 0.0, attention_flops_per_pair: float = 0.0, max_seq_len: int = 0) -> None:
        self.accelerator, self.total_steps, self.every = accelerator, total_steps, every
        self.device = torch.device(getattr(accelerator, "device", "cpu"))
        self.on_gpu = self.device.type == "cuda"
        if not peak_tflops and self.on_gpu:
            peak_tflops = peak_bf16_tflops(torch.cuda.get_device_name(self.device))
        self.flops_per_token, self.peak_tflops = flops_per_token, peak_tflops
        self.attention_flops_per_pair, self.max_seq_len = attention_flops_per_pair, max_seq_len
        self.gpu_peak = 0  # bytes: the highest allocation seen in the run (at log lines and memory records)
        self.stall, self.skipped = StallAtLn2(), SkippedPairs()  # preference training's two warnings
        self.cut = CutRows(max_seq_len)
        self.reset()

    def reset(self) -> None:
        """Start a new window: the sums back to zero, the clock from now."""
        self.loss_sum: torch.Tensor | float = 0.0  # summed on the device: read only when a line is written
        self.target_tokens = 0
        self.input_tokens = 0
        self.grad_norm_sum: torch.Tensor | float = 0.0  # summed on the device too
        self.attention_pairs = 0
        self.preference_sums: torch.Tensor | None = None  # on the device, like the loss
        self.skipped_pairs = 0
        self.cut_rows = 0
        self.steps = 0
        self.started = time.perf_counter()
        self.paused_seconds = 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the time spent inside out of the current line's tokens/s."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.paused_seconds += time.perf_counter() - started

    def add(self, result: StepResult) -> None:
        self.loss_sum += result.loss_sum
        self.target_tokens += result.target_tokens
        self.input_tokens += result.input_tokens
        self.grad_norm_sum += result.grad_norm
        self.attention_pairs += result.attention_pairs
        if result.preference_sums is not None:
            sums = result.preference_sums
            self.preference_sums = sums if self.preference_sums is None else self.preference_sums + sums
        self.skipped_pairs += result.skipped_pairs
        self.cut_rows += result.cut_rows
        self.steps += 1

    def note_gpu_peak(self, peak_bytes: int | None) -> None:
        """A GPU peak measured elsewhere: the memory log's record, which starts a new peak after it."""
        if peak_bytes:
            self.gpu_peak = max(self.gpu_peak, int(peak_bytes))

    def _utilisation(self, tokens_per_s: float, tokens: float, pairs: float) -> tuple[float | None, float | None]:
        """(MFU with attention over max_seq_len, MFU with attention over each row's real length); the second is the
        first where the pairs are not known. None where the peak or the FLOPs are not known."""
        if not self.flops_per_token:
            return None, None
        devices = self.accelerator.num_processes
        over_width = mfu(tokens_per_s, self.flops_per_token, self.peak_tflops, devices)
        if not (self.attention_flops_per_pair and self.max_seq_len and tokens and pairs):
            return over_width, over_width
        matmul = self.flops_per_token - self.attention_flops_per_pair * self.max_seq_len
        per_token = matmul + self.attention_flops_per_pair * pairs / tokens  # the window's real mean
        return over_width, mfu(tokens_per_s, per_token, self.peak_tflops, devices)

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.total_steps

    def write(self, step: int, epoch: int, lr: float) -> LineFigures:
        """One readable line: loss over the window and all ranks, learning rate, tokens/s, grad norm, RSS.

        Returns the line's figures (every rank gets the same, except its own RSS)."""
        rss = psutil.Process().memory_info().rss
        if self.on_gpu:  # the allocator's own counter (no wait for the device): the peak since the memory log's last
            self.note_gpu_peak(torch.cuda.max_memory_allocated(self.device))
        # One wait for the device: the window's loss and gradient norms, read together.
        loss_sum, grad_norm_sum = torch.stack([torch.as_tensor(value, dtype=torch.float64).to(self.device)
                                               for value in (self.loss_sum, self.grad_norm_sum)]).tolist()
        loss_sum, target_tokens, input_tokens, rss_sum, pairs, cut = all_reduce_sum(
            self.accelerator, [loss_sum, self.target_tokens, self.input_tokens, rss, self.attention_pairs,
                               self.cut_rows])
        [rss_max, gpu_peak_max] = all_reduce_max(self.accelerator, [rss, self.gpu_peak])
        preference = self._preference_figures()
        elapsed = time.perf_counter() - self.started - self.paused_seconds
        tokens_per_s = float(input_tokens / max(elapsed, 1e-9))
        over_width, over_rows = self._utilisation(tokens_per_s, input_tokens, pairs)
        figures = LineFigures(loss=float(loss_sum / max(target_tokens, 1)), learning_rate=float(lr),
                              grad_norm=float(grad_norm_sum / max(self.steps, 1)),
                              tokens_per_s=tokens_per_s, rss_mb=float(rss / MB),
                              rss_max_mb=float(rss_max / MB), rss_sum_mb=float(rss_sum / MB),
                              mfu=over_rows, gpu_peak_mb=float(gpu_peak_max / MB) if self.on_gpu else None,
                              preference=preference)
        device = ""
        if figures.mfu is not None:
            device += f" | mfu {figures.mfu:.1%}"
            if over_width is not None and f"{over_width:.1%}" != f"{figures.mfu:.1%}":
                device += f" ({over_width:.1%} with attention over max_seq_len)"
        if figures.gpu_peak_mb is not None:
            device += f" | gpu peak {figures.gpu_peak_mb:,.0f} MB"
        rewards = "" if preference is None else (
            f" | rewards/chosen {preference['rewards/chosen']:.4f} rejected {preference['rewards/rejected']:.4f} "
            f"accuracy {preference['rewards/accuracy']:.3f} margin {preference['rewards/margin']:.4f}")
        logger.info(
            "step %d/%d | epoch %d | loss %.4f%s | lr %.2e | grad_norm %.3f | tokens/s %s%s | rss %.0f MB "
            "(max over ranks %.0f MB)", step, self.total_steps, epoch, figures.loss, rewards, figures.learning_rate,
            figures.grad_norm, f"{figures.tokens_per_s:,.0f}", device, figures.rss_mb, figures.rss_max_mb,
        )
        self.cut.add(int(cut))
        if preference is not None:
            self.stall.add(step, figures.loss, self.steps)
            self.skipped.add(int(preference["skipped_pairs"]))
        self.reset()
        return figures

    def _preference_figures(self) -> dict[str, float] | None:
        """The window's DPO terms over every rank (one all-reduce), as TRL's users read them; None outside
        preference training."""
        if self.preference_sums is None:
            return None
        local = self.preference_sums.to(torch.float64).tolist()
        _, chosen, rejected, correct, pairs, skipped = all_reduce_sum(self.accelerator, [*local, self.skipped_pairs])
        count = max(pairs, 1.0)
        return {"rewards/chosen": chosen / count, "rewards/rejected": rejected / count,
                "rewards/accuracy": correct / count, "rewards/margin": (chosen - rejected) / count,
                "skipped_pairs": skipped}
