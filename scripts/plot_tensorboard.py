"""Draw a run's training curves from its TensorBoard event files into one PNG: a grid of small line plots.

A run trained with `--report_to=tensorboard` has its event files in logs/tensorboard/<basename of output_dir>/
(see `lowmem.train.tracking.tensorboard_dir`). This reads them with TensorBoard's EventAccumulator and draws
the training loss, validation loss, learning rate, tokens/s, RSS and BLEU-4 against the optimizer step, for
a README or a report, without starting TensorBoard. A tag the run did not log gets an empty panel.

Usage, from the repository root (needs tensorboard and matplotlib: pip install "lowmem[tensorboard,plot]"):

    python scripts/plot_tensorboard.py logs/tensorboard/demo --out docs/demo-curves.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lowmem.train.tracking import TAGS

# (tag, panel title), in the grid's order: the losses first.
PANELS = (
    ("train/loss", "training loss"),
    ("eval/val_loss", "validation loss"),
    ("train/learning_rate", "learning rate"),
    ("train/tokens_per_s", "tokens/s"),
    ("memory/rss_mb", "RSS of the main process (MB)"),
    ("eval/bleu4", "BLEU-4"),
)
COLUMNS = 3
assert {tag for tag, _ in PANELS} <= set(TAGS), "a panel names a tag the trainer does not log"


def read_scalars(logdir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Every scalar tag of the event files in `logdir` (not its subfolders): tag → (steps, values)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every point
    accumulator.Reload()
    scalars = {}
    for tag in accumulator.Tags()["scalars"]:
        events = accumulator.Scalars(tag)
        scalars[tag] = ([event.step for event in events], [event.value for event in events])
    return scalars


def plot(scalars: dict[str, tuple[list[int], list[float]]], out: Path, title: str) -> None:
    """The grid of `PANELS`, one line plot each, written to `out`."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    rows = -(-len(PANELS) // COLUMNS)
    figure = Figure(figsize=(4.2 * COLUMNS, 2.8 * rows), layout="constrained")
    axes = figure.subplots(rows, COLUMNS, squeeze=False).flatten()
    for ax, (tag, name) in zip(axes, PANELS):
        steps, values = scalars.get(tag, ([], []))
        ax.plot(steps, values, marker="." if len(steps) < 30 else None, linewidth=1.2)
        ax.set_title(f"{name}  ({tag})", fontsize=9)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if tag == "train/learning_rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))  # 2e-3, not 0.002 with 0.0002
        if not steps:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in axes[len(PANELS):]:
        ax.set_visible(False)
    figure.suptitle(title, fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """Read the event files of one run's folder and write the PNG."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logdir", type=Path, help="a run's folder of event files, e.g. logs/tensorboard/demo")
    parser.add_argument("--out", type=Path, default=Path("curves.png"), help="the PNG to write (curves.png)")
    args = parser.parse_args(argv)
    if not args.logdir.is_dir():
        parser.error(f"{args.logdir} is not a folder; a run's event files are in logs/tensorboard/<run>/")
    scalars = read_scalars(args.logdir)
    if not scalars:
        parser.error(f"no scalars in {args.logdir}: is it the folder of one run (logs/tensorboard/<run>/)?")
    plot(scalars, args.out, f"Training curves of {args.logdir.name}")
    print(f"{len(scalars)} curves of {args.logdir} → {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
