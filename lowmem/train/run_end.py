"""The end of a finished run, on the main process: the validation losses' line, final/ and best/ exported from the
trained model and the checkpoints, and a sampled answer logged beside its reference (`Trainer.finish` calls them)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable, Collection

from lowmem.adapters.files import BASE_DIR
from lowmem.checkpoint.export import export_checkpoint, export_model
from lowmem.config import TrainConfig
from lowmem.config.columns import data_columns, is_preference
from lowmem.data import ParquetStream
from lowmem.tokenization.text_tokenizer import TextTokenizer
from lowmem.disk_errors import writing
from lowmem.distributed.collectives import run_on_main
from lowmem.distributed.fsdp_units import all_ranks_finished, is_sharded
from lowmem.distributed.sharded_checkpoint import MODEL_SHARDS
from lowmem.eval.commands import answer
from lowmem.model.weights import WEIGHTS_FILE
from lowmem.program import command_line

logger = logging.getLogger(__name__)


def validation_losses_line(summary: dict[str, Any], step: int) -> str:
    """The run's last validation loss, beside the one before its first step where that was measured (not with
    `--eval_on_start=False`)."""
    start, end, seconds = summary["val_loss_start"], summary["val_loss_end"], summary["seconds"]
    if math.isnan(end):
        return f"No validation ran before step {step}, {seconds:.0f} s."
    if math.isnan(start):
        return f"Validation loss {end:.4f} at step {step} (none before step 1: --eval_on_start=False), {seconds:.0f} s."
    return f"Validation loss {start:.4f} at step 0 → {end:.4f} at step {step} ({start - end:.2f} nats lower), " \
           f"{seconds:.0f} s."


def export_final(final_model: Any, model: Any, config: TrainConfig, manifest: dict[str, Any],
                 given: Collection[str] | None, accelerator: Any) -> None:
    """`export_models` at the end of a finished run, every rank calling it (`model`: the training model,
    `final_model` its eval form) while the main process writes: a model sharded over the processes stays in its
    shards, and final/ is written from the last checkpoint, a tensor at a time. A full disk stops every rank."""
    run_on_main(accelerator, lambda: export_models(None if is_sharded(model) else final_model, config, manifest, given))


def answer_sample(final_model: Any, model: Any, tokenizer: TextTokenizer, config: TrainConfig,
                  accelerator: Any) -> dict[str, str]:
    """`sample_answer` at the end of a finished run, every rank calling it; the sample (an empty dict on the ranks that
    did not answer). A model sharded over the processes answers on every one together (each step of generation is a
    collective); otherwise the main process answers while the others wait."""
    if is_sharded(model):
        return sample_answer(final_model, tokenizer, config, all_ranks_finished(accelerator))
    return run_on_main(accelerator, lambda: sample_answer(final_model, tokenizer, config)) or {}


def export_models(final_model: Any | None, config: TrainConfig, manifest: dict[str, Any],
                  given: Collection[str] | None = None) -> None:
    """final/: the model as trained (`final_model`, whole; None: a model sharded over the processes, whose last
    checkpoint holds the trained weights and is exported tensor by tensor); best/: the best checkpoint's model by
    `best_metric`, as the checkpoints' `manifest` ranks them. Each folder's train_config.json records which fields
    were `given` (None: not known)."""
    output_dir = Path(config.output_dir)
    # The checkpoints hold the trained weights: a failed export loses nothing, and can be made again.
    latest = output_dir / str(manifest.get("latest"))
    needed = _weights_bytes(latest) or _weights_bytes(output_dir / BASE_DIR)  # adapters: the merged model, base-sized
    kept = f"The checkpoints in {output_dir} are complete; the partial folder was removed."

    def then(checkpoint: Path) -> str:
        return f"then export it with `{command_line(f'export --out=FOLDER --checkpoint={checkpoint}')}`"

    with writing("the final model", output_dir / "final", needed=needed, then=then(latest), kept=kept):
        if final_model is None:
            out_dir = export_checkpoint(latest, config, output_dir / "final", tokenizer_dir=config.tokenizer_dir,
                                        given=given)
        else:
            out_dir = export_model(final_model, config, output_dir / "final", tokenizer_dir=config.tokenizer_dir,
                                   given=given)
    logger.info("Model saved to %s", out_dir)
    best = manifest.get("best") or []
    if best:
        with writing("the best model", output_dir / "best", needed=needed, then=then(output_dir / best[0]),
                     kept=kept):
            best_dir = export_checkpoint(output_dir / best[0], config, output_dir / "best",
                                         tokenizer_dir=config.tokenizer_dir, given=given)
        logger.info("Best checkpoint by %s (%s) exported to %s", config.best_metric, best[0], best_dir)


def _weights_bytes(folder: Path) -> int | None:
    """The bytes of a model folder's weights: its one file, or its shards; None when it has neither."""
    shards = folder / MODEL_SHARDS
    files = [folder / WEIGHTS_FILE] if (folder / WEIGHTS_FILE).is_file() else sorted(shards.glob("*.safetensors"))
    return sum(path.stat().st_size for path in files) if files else None


def sample_answer(final_model: Any, tokenizer: TextTokenizer, config: TrainConfig,
                  stop_together: Callable[[bool], bool] | None = None) -> dict[str, str]:
    """The model's answer to the first validation prompt, logged beside the reference (the chosen answer of a
    preference row); with one text column,
    its continuation of the first third of the first validation text, beside the rest."""
    first = next(iter(ParquetStream(config.validation_file, columns=data_columns(config), shuffle=False,
                                    bad_text=config.bad_text)))
    if config.text_column:
        text = first[config.text_column]
        prompt, reference = text[: len(text) // 3], text[len(text) // 3:]
    else:  # preference rows: beside the chosen answer
        reference_column = config.chosen_column if is_preference(config) else config.response_column
        prompt, reference = first[config.prompt_column], first[reference_column]
    # Sampled rather than greedy: a small model's greedy answers fall into loops of one phrase.
    sampled = answer(final_model, tokenizer, prompt, config.sample_max_new_tokens, temperature=0.8, top_k=40,
                     seed=config.seed, bf16=config.bf16, bf16_on_cpu=config.bf16_on_cpu,
                     continue_text=bool(config.text_column), stop_together=stop_together)
    logger.info("Sample\n  prompt:    %s\n  model:     %s\n  reference: %s", prompt, sampled, reference)
    return {"prompt": prompt, "answer": sampled}
