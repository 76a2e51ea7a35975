"""DPO on adapters, lowmem against TRL's DPOTrainer with peft, on the same model, pairs and settings.

Both start from the transformers folder `--model`, train LoRA adapters of the same rank, alpha and targets (every
attention and MLP projection, no dropout) by the sigmoid DPO loss with the same beta, pairs per step, learning rate,
warmup, cosine decay to a tenth of the rate, AdamW betas, weight decay and gradient clipping, for `--steps` steps;
then both score the same held-out pairs: rewards/accuracy and rewards/margin against the starting model. One line per
seed and the means, as a Markdown table. TRL (`pip install trl peft datasets`) is needed by this script only; lowmem
never imports it.

    python scripts/dpo_side_by_side.py --model=qwen2-tiny --train=pairs.parquet --valid=pairs_valid.parquet
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lowmem_run(args: argparse.Namespace, seed: int, folder: Path) -> dict[str, float]:
    """Train and evaluate with lowmem's commands; the held-out figures of `evaluate`."""
    run = folder / f"lowmem-{seed}"
    common = [f"--init_from={args.model}", "--objective=dpo", f"--lora_rank={args.rank}",
              f"--lora_alpha={args.alpha}", "--lora_dropout=0", f"--dpo_beta={args.beta}",
              f"--train_file={args.train}", f"--validation_file={args.valid}", f"--output_dir={run}"]
    train = [*common, f"--batch_size_per_gpu={args.batch}", f"--learning_rate={args.lr}",
             f"--warmup_steps={args.warmup}", f"--max_steps={args.steps}", "--weight_decay=0", "--adam_beta1=0.9",
             f"--adam_beta2={args.adam_beta2}", "--grad_clip=1.0", f"--seed={seed}",
             f"--eval_steps={args.steps}", f"--save_steps={args.steps}", "--eval_bleu_samples=0",
             "--sample_max_new_tokens=4", "--progress=False"]
    rows = pq.read_metadata(args.train).num_rows  # epochs enough for the steps: --max_steps stops, never extends
    train.append(f"--epochs={math.ceil(args.steps * args.batch / rows)}")
    if args.max_len:
        train.append(f"--max_seq_len={args.max_len}")
    command = [sys.executable, "-m", "lowmem"]
    subprocess.run([*command, "train", *train], check=True, capture_output=True, text=True)
    subprocess.run([*command, "evaluate", f"--output_dir={run}", f"--test_file={args.valid}", "--bleu_samples=0",
                    f"--batch_size_per_gpu={args.batch}", "--checkpoint=" + str(run / "final")],
                   check=True, capture_output=True, text=True)
    pairs = json.loads((run / "eval" / "test_summary.json").read_text())["preference"]
    return {"accuracy": pairs["rewards/accuracy"], "margin": pairs["rewards/margin"]}


def trl_run(args: argparse.Namespace, seed: int, folder: Path) -> dict[str, float]:
    """Train and evaluate with TRL's DPOTrainer and a peft LoRA config; its eval rewards/accuracies and margins."""
    import transformers
    from datasets import Dataset
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    def pairs(path: str) -> Dataset:  # conversational: TRL lays the pairs out with the model's chat template
        table = pq.read_table(path, columns=["prompt", "chosen", "rejected"]).to_pydict()
        return Dataset.from_dict({
            "prompt": [[{"role": "user", "content": text}] for text in table["prompt"]],
            "chosen": [[{"role": "assistant", "content": text}] for text in table["chosen"]],
            "rejected": [[{"role": "assistant", "content": text}] for text in table["rejected"]],
        })

    transformers.set_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    config = DPOConfig(output_dir=str(folder / f"trl-{seed}"), per_device_train_batch_size=args.batch,
                       per_device_eval_batch_size=args.batch, learning_rate=args.lr, warmup_steps=args.warmup,
                       max_steps=args.steps, lr_scheduler_type="cosine_with_min_lr",
                       lr_scheduler_kwargs={"min_lr_rate": 0.1}, weight_decay=0.0, adam_beta1=0.9,
                       adam_beta2=args.adam_beta2, max_grad_norm=1.0, beta=args.beta, max_length=args.max_len or 1024,
                       seed=seed, data_seed=seed, save_strategy="no", report_to=[], logging_steps=args.steps,
                       use_cpu=True, disable_tqdm=True)
    lora = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, target_modules=TARGETS,
                      task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=model, args=config, train_dataset=pairs(args.train), eval_dataset=pairs(args.valid),
                         processing_class=tokenizer, peft_config=lora)
    trainer.train()
    scores = trainer.evaluate()
    return {"accuracy": scores["eval_rewards/accuracies"], "margin": scores["eval_rewards/margins"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a transformers model folder (Qwen2, Llama or Mistral)")
    parser.add_argument("--train", required=True, help="parquet pairs: prompt, chosen, rejected")
    parser.add_argument("--valid", required=True, help="held-out parquet pairs")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8, help="pairs per step")
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16)
    parser.add_argument("--adam_beta2", type=float, default=0.95)
    parser.add_argument("--max_len", type=int, default=0,
                        help="tokens per prompt and answer (0: lowmem's length from the rows, TRL's 1,024: both whole)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = {"lowmem": [], "TRL": []}
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            results["lowmem"].append(lowmem_run(args, seed, Path(scratch)))
            results["TRL"].append(trl_run(args, seed, Path(scratch)))
            print(f"seed {seed}: lowmem {results['lowmem'][-1]}, TRL {results['TRL'][-1]}", file=sys.stderr)
    print("| seed | lowmem accuracy | TRL accuracy | lowmem margin | TRL margin |\n|---:|---:|---:|---:|---:|")
    for number, seed in enumerate(args.seeds):
        ours, theirs = results["lowmem"][number], results["TRL"][number]
        print(f"| {seed} | {ours['accuracy']:.3f} | {theirs['accuracy']:.3f} | {ours['margin']:.3f} | "
              f"{theirs['margin']:.3f} |")

    def mean(name: str, key: str) -> str:
        values = [result[key] for result in results[name]]
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.mean(values):.3f} ± {spread:.3f}"

    print(f"| mean ± sd | {mean('lowmem', 'accuracy')} | {mean('TRL', 'accuracy')} | {mean('lowmem', 'margin')} | "
          f"{mean('TRL', 'margin')} |")


if __name__ == "__main__":
    main()
