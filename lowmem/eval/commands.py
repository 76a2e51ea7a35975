"""Using a trained model: `evaluate` on the test file, and `generate` answers to prompts."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable, TextIO

import torch

from lowmem.atomic_files import file_built_aside, write_json_atomic
from lowmem.distributed.accelerator import create_accelerator
from lowmem.eval.pairs import as_trained_for_pairs
from lowmem.eval.validation import EvalResult, bleu4, evaluate, prompt_room
from lowmem.model import GPT
from lowmem.checkpoint.export import find_model_folder, load_model_folder, trained_config
from lowmem.checkpoint.run_lock import lock_run_folder
from lowmem.config import DataConfig, TrainConfig
from lowmem.config.settle import settled_for_model
from lowmem.config.demo import is_demo_file
from lowmem.config.columns import describe_loss_targets, is_preference, response_only, scored_columns
from lowmem.data.path_checks import check_data_files
from lowmem.tokenization.text_tokenizer import TextTokenizer
from lowmem.distributed.performance import enable_tf32, inference_autocast

logger = logging.getLogger(__name__)

# (config, model, tokenizer, accelerator, run folder) → the summary's preference figures.
PairFigures = Callable[[TrainConfig, GPT, Any, Any, Path], dict[str, Any]]


def evaluate_command(config: TrainConfig, checkpoint: str | None = None, test_file: str | None = None,
                     bleu_samples: int = -1, pair_figures: PairFigures | None = None) -> dict[str, Any]:
    """Loss, perplexity and BLEU-4 of a trained model on the test file; writes a JSON summary and the triples.

    Runs on 1..N processes (each scores its own share of the rows, every row once). Besides the model's
    BLEU-4 it reports two baselines that know nothing of the task, so the score can be read: the prompt
    repeated as the answer, and the next sample's reference as the answer (text of the right form and
    length, on another subject). A model trained by DPO, scored on preference pairs, also gets its held-out rewards
    against the run's reference from `pair_figures` (`lowmem.preference.held_out.preference_figures`).
    """
    accelerator = create_accelerator(1, config.bf16, config.process_group_timeout_minutes,
                                     bf16_on_cpu=config.bf16_on_cpu)
    lock = lock_run_folder(accelerator, config.output_dir, "evaluation")  # it writes eval/ into the run folder
    try:
        return _evaluate_locked(config, accelerator, checkpoint, test_file, bleu_samples, pair_figures)
    finally:
        if lock is not None:
            lock.release()


def _scored_tokens(config: TrainConfig) -> str:
    """Which tokens the test loss counts, in words for the summary."""
    if is_preference(config):
        return "the chosen answers' tokens (preference rows scored as prompt/chosen pairs)"
    return describe_loss_targets(config)


def _evaluate_locked(config: TrainConfig, accelerator: Any, checkpoint: str | None, test_file: str | None,
                     bleu_samples: int, pair_figures: PairFigures | None) -> dict[str, Any]:
    folder = find_model_folder(config.output_dir, checkpoint)
    saved = trained_config(folder)
    config = settled_for_model(config, saved, folder)
    config = dataclasses.replace(config, test_file=test_file or test_file_for(config, folder, saved or {}))
    config = as_trained_for_pairs(config, saved or {}, folder)
    check_data_files(config, ("test_file",), columns=scored_columns(config))
    model, tokenizer = load_model_folder(folder, config.tokenizer_dir, accelerator.device)
    model.use_memory_savers(loss_chunk_tokens=config.loss_chunk_tokens)  # the test loss without whole logits
    # The model is loaded plain (not prepared by accelerate): TF32 and bf16 autocast are asked for here.
    enable_tf32(accelerator.device.type == "cuda")
    if config.text_column and bleu_samples != 0:
        logger.info("One text column (--text_column=%s) has no prompts to answer: the loss and perplexity only, "
                    "no BLEU-4.", config.text_column)
    result = evaluate(model, tokenizer, config.test_file, accelerator, batch_size=config.batch_size_per_gpu,
                      max_seq_len=model.config.max_seq_len, columns=scored_columns(config),
                      bleu_samples=bleu_samples, max_new_tokens=config.eval_max_new_tokens,
                      response_only=response_only(config),
                      no_repeat_ngram_size=config.eval_no_repeat_ngram_size, bf16=config.bf16,
                      bf16_on_cpu=config.bf16_on_cpu, bad_text=config.bad_text)
    summary = {"model": str(folder), "test_file": config.test_file, "samples": result.loss_rows,
               "loss": result.loss, "perplexity": result.perplexity, "loss_tokens": _scored_tokens(config),
               **_bleu_figures(result)}
    if is_preference(config) and pair_figures is not None:  # the held-out rewards, against the run's reference
        summary.update(pair_figures(config, model, tokenizer, accelerator, folder.parent))
    if accelerator.is_main_process:
        out_dir = Path(config.output_dir) / "eval"
        out_dir.mkdir(parents=True, exist_ok=True)
        summary["summary_file"] = str(out_dir / "test_summary.json")
        summary["generations_file"] = str(out_dir / "test_generations.jsonl")
        # Written aside and renamed: a run stopped midway never leaves a half-written file over an older one.
        write_json_atomic(summary["summary_file"], summary)
        with file_built_aside(summary["generations_file"]) as partial, open(partial, "w", encoding="utf-8") as out:
            for triple in result.triples:
                out.write(json.dumps(triple, ensure_ascii=False) + "\n")
    return summary


def test_file_for(config: DataConfig, folder: Path, saved: dict[str, Any]) -> str:
    """The test file to score the model in `folder` on when none was given: the command's (data/test.parquet, else
    the demo's), except that a model trained on data of one's own is scored on its run's test file when that is
    found from here, and never on the demo's test set without a warning naming --test_file."""
    trained_on = saved.get("train_file")
    if not is_demo_file(config.test_file) or not trained_on or is_demo_file(str(trained_on)):
        return config.test_file  # the user's own test file; a model of the demo data, or of unknown data
    own = saved.get("test_file")
    if own and Path(str(own)).is_file() and not is_demo_file(str(own)):
        logger.info("Scoring on %s, the test file of the run that trained %s (--test_file=PATH chooses another).",
                    own, folder)
        return str(own)
    logger.warning("%s was trained on %s, but no test file of that data is found from here (%s): it is scored on "
                   "lowmem's demo test set (Song ci and Yuan qu), which says little about that data. Pass "
                   "--test_file=YOUR_TEST.parquet.", folder, trained_on, own or "none recorded")
    return config.test_file


def _bleu_figures(result: EvalResult) -> dict[str, Any]:
    """BLEU-4 of the generations and of two baselines that know nothing of the task (the prompt repeated as
    the answer; the next sample's reference as the answer); None throughout when no prompt was answered
    (--bleu_samples=0: the loss alone)."""
    if result.bleu is None or not result.triples:
        return {"bleu4": None, "bleu_samples": 0, "baseline_repeat_prompt_bleu4": None,
                "baseline_other_reference_bleu4": None}
    references = [t["reference"] for t in result.triples]
    baseline = bleu4([t["prompt"] for t in result.triples], references)
    other_reference = bleu4(references[1:] + references[:1], references)
    return {"bleu4": result.bleu.score, "bleu_samples": result.bleu.samples, "bleu_signature": result.bleu.signature,
            "decoding": result.decoding,
            "bleu_precisions": result.bleu.precisions, "bleu_brevity_penalty": result.bleu.brevity_penalty,
            "baseline_repeat_prompt_bleu4": baseline.score, "baseline_repeat_prompt_precisions": baseline.precisions,
            "baseline_other_reference_bleu4": other_reference.score,
            "baseline_other_reference_precisions": other_reference.precisions}


def answer(model: GPT, tokenizer: TextTokenizer, prompt: str, max_new_tokens: int = 128, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, seed: int | None = None, bf16: bool = False,
           bf16_on_cpu: bool = False, continue_text: bool = False,
           stop_together: Callable[[bool], bool] | None = None) -> str:
    """The model's answer to one prompt: greedy with temperature 0, sampled otherwise. A model sharded over processes
    answers on every process at once, until all have finished (`stop_together`, see `GPT.generate`).

    With `continue_text`, `prompt` is the beginning of a text the model continues (a model trained on one text
    column has never seen the prompt/response separator). With `bf16`, generation runs under bf16 autocast on a
    GPU with native bf16, and on the CPU with `bf16_on_cpu` too (see `inference_autocast`).
    """
    device = next(model.parameters()).device
    ids, _ = tokenizer.encode_text(prompt, finished=False) if continue_text else tokenizer.encode_pair(prompt, None)
    room = prompt_room(model.config.context_len, max_new_tokens)
    if len(ids) > room:
        logger.warning("The prompt's %d tokens and up to %d new ones exceed the model's context of %d: its first %d "
                       "tokens are left out.", len(ids), max_new_tokens, model.config.context_len, len(ids) - room)
    idx = torch.tensor([ids[-room:]], dtype=torch.long, device=device)  # (1, T)
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    with inference_autocast(device, bf16, bf16_on_cpu):
        out = model.generate(idx, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                             eos_id=tokenizer.stop_ids, greedy=temperature == 0, generator=generator,
                             stop_together=stop_together)
    return tokenizer.decode(out[0, idx.size(1):].tolist())


def generate_command(config: TrainConfig, prompt: str | None = None, checkpoint: str | None = None,
                     max_new_tokens: int = 128, temperature: float = 0.0, top_k: int | None = None,
                     top_p: float | None = None, seed: int | None = None, stdin: TextIO | None = None,
                     stdout: TextIO | None = None) -> None:
    """Print the answer to `prompt`; without one, answer each line typed until an empty line or end of input.
    With `config.text_column` set (a model pretrained on one text column), the prompt is a beginning to continue.
    `stdin` and `stdout` default to the process's streams as they are when it is called (a redirection holds)."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    folder = find_model_folder(config.output_dir, checkpoint)
    config = settled_for_model(config, trained_config(folder), folder)
    model, tokenizer = load_model_folder(folder, config.tokenizer_dir, device)
    enable_tf32(device.type == "cuda")
    # answer()'s keyword arguments, each of its own type.
    options: dict[str, Any] = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, seed=seed, bf16=config.bf16, bf16_on_cpu=config.bf16_on_cpu,
                                   continue_text=bool(config.text_column))
    if prompt is not None:
        print(answer(model, tokenizer, str(prompt), **options), file=stdout)
        return
    print(f"Model from {folder}. Type a prompt and press Enter; an empty line or Ctrl+D ends.", file=stdout)
    while True:
        stdout.write("prompt> ")
        stdout.flush()
        line = stdin.readline()
        if not line.strip():
            break
        print(answer(model, tokenizer, line.strip(), **options), file=stdout)
