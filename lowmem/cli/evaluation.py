"""The commands that use a trained model: `evaluate` (scores on the test file), `generate` (answers) and `export`
(the transformers format)."""

from __future__ import annotations

import json
from typing import Any

from lowmem.cli.common import build_config


def evaluate(use_large_config: bool = False, checkpoint: str | None = None, test_file: str | None = None,
             bleu_samples: int = -1, **overrides: Any) -> None:
    """Score a trained model on the test file: loss, perplexity and BLEU-4 (sacrebleu), with a baseline.

    Loads the run's best/ model (else final/; a run stopped before its end: its best-scored complete
    checkpoint), or --checkpoint. Writes <output_dir>/eval/test_summary.json and test_generations.jsonl (prompt,
    reference, generation per line). Works under `accelerate launch` too: each process scores its share, every
    sample once.

    Args:
        use_large_config: take output_dir and the other settings from TrainConfigPretrainLarge.
        checkpoint: a checkpoint-<step>, best/ or final/ folder to evaluate instead.
        test_file: the rows to score (default: the config's test_file).
        bleu_samples: how many test prompts to answer for BLEU-4 (-1: all of them).
        overrides: config fields, e.g. --output_dir=..., --batch_size_per_gpu=..., --eval_max_new_tokens=...
    """
    from lowmem.eval.commands import evaluate_command
    from lowmem.preference.held_out import preference_figures

    summary = evaluate_command(build_config(use_large_config, overrides), checkpoint, test_file, bleu_samples,
                               preference_figures)
    if summary.get("summary_file"):
        print(json.dumps(summary, indent=2, ensure_ascii=False))


def generate(prompt: str | None = None, use_large_config: bool = False, checkpoint: str | None = None,
             max_new_tokens: int = 128, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, **overrides: Any) -> None:
    """Answer a prompt with a trained model; without --prompt, answer each line typed (empty line or Ctrl+D ends).

    Loads the run's best/ model (else final/; a run stopped before its end: its best-scored complete
    checkpoint), or --checkpoint.

    Args:
        prompt: the prompt; leave it out for an interactive loop.
        use_large_config: take output_dir from TrainConfigPretrainLarge.
        checkpoint: a checkpoint-<step>, best/ or final/ folder to use instead.
        max_new_tokens: the longest answer, in tokens.
        temperature: 0 for greedy answers; above 0 samples (0.8 is a good start).
        top_k: sample among the k most likely tokens only.
        top_p: sample among the most likely tokens whose probabilities add up to top_p.
        seed: seed for sampling, for repeatable answers.
        overrides: config fields, e.g. --output_dir=model_save/demo.
    """
    from lowmem.eval.commands import generate_command

    config = build_config(use_large_config, overrides, demo_data=False)  # generate reads no data files
    generate_command(config, prompt, checkpoint, max_new_tokens, temperature, top_k, top_p, seed)


def export(out: str, use_large_config: bool = False, checkpoint: str | None = None, adapter_dir: str | None = None,
           **overrides: Any) -> None:
    """Write a trained model as a folder that transformers loads offline: AutoModelForCausalLM.from_pretrained(OUT)
    and AutoTokenizer.from_pretrained(OUT), with a chat template that lays a prompt out as in training.

    Exports the run's best/ model (else final/, else the best-scored complete checkpoint), or --checkpoint: a
    gpt2 model as GPT2LMHeadModel, a llama model as LlamaForCausalLM. OUT must not exist (or be empty); it is
    written aside and renamed into place. Needs transformers 4.46 or later: pip install "transformers>=4.46".

    Args:
        out: the folder to create.
        use_large_config: take output_dir from TrainConfigPretrainLarge.
        checkpoint: a checkpoint-<step>, best/ or final/ folder to export instead.
        adapter_dir: a run that trained adapters (--lora_rank): also write them to this new folder in peft's files
            (adapter_config.json, adapter_model.safetensors), which PeftModel.from_pretrained(base, FOLDER) loads.
        overrides: config fields, e.g. --output_dir=model_save/demo, --tokenizer_dir=..., --eval_max_new_tokens=...
            (the max_new_tokens written to generation_config.json).
    """
    from lowmem.hf import export_hf

    config = build_config(use_large_config, overrides, demo_data=False)  # export reads no data files
    folder = export_hf(config, str(out), checkpoint,  # fire reads a name like 123 as a number
                       None if adapter_dir is None else str(adapter_dir))
    print(f"Wrote {folder}: load it with AutoModelForCausalLM.from_pretrained({str(folder)!r}) and "
          f"AutoTokenizer.from_pretrained({str(folder)!r}).")
