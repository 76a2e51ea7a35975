"""Training configurations. Every field can be overridden on the command line: `--<field>=<value>`.

`TrainConfig` is the default: a small model that trains the demo data set on a 2-core laptop CPU in a few
minutes. `TrainConfigPretrainLarge` is for 3 GPUs on a host with 12 GB of RAM (`--use_large_config=True`).
Values are checked up front by `lowmem.config.validate_config`, which says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class TrainConfig:
    """The default configuration: the demo data set, a tiny GPT, CPU-friendly."""

    # --- data ---
    train_file: str = "data/train.parquet"  # parquet file, directory or glob with the training rows
    validation_file: str = "data/valid.parquet"  # held-out rows for the validation loss and samples
    test_file: str = "data/test.parquet"  # rows for the final evaluation (never trained on)
    prompt_column: str = "prompt"  # text column with the prompt
    response_column: str = "response"  # text column with the response
    dataloader_buffer_size: int = 2000  # rows in each process's shuffle buffer
    dataloader_num_workers: int = -1  # DataLoader workers per process; -1 decides from the memory budget
    ultra_low_mem: Optional[bool] = None  # reopen files per row group; None decides from the memory budget
    ultra_low_mem_threshold_gb: float = 15.0  # below this host memory, ultra-low-mem mode and no workers
    memory_budget_gb: float = 0.0  # host memory the run may use; 0 = min(physical RAM, cgroup limit)
    cleanup_steps: int = 50  # optimizer steps between memory cleanups (gc, Arrow pool, malloc_trim, CUDA cache)
    memory_log_steps: int = 200  # optimizer steps between memory records in logs/memory_<run>_rank<r>.jsonl
    memory_watchdog_fraction: float = 0.9  # warn when a process's RSS passes this share of its memory budget

    # --- tokenizer ---
    tokenizer_dir: str = "model_save/tokenizer"  # where the SentencePiece model is saved and loaded
    vocab_size: int = 8000  # tokenizer vocabulary (the model pads it to a multiple of 64)
    tokenizer_max_sentences: int = 1_000_000  # cap on lines sampled to train the tokenizer (~4 GB of RAM at 1M)

    # --- model ---
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block (must divide n_embd)
    n_embd: int = 128  # width of the residual stream
    dropout: float = 0.0  # dropout in embeddings, attention and residual branches
    max_seq_len: int = 192  # longest sequence in tokens; longer rows are cut at the end

    # --- optimisation ---
    seed: int = 42  # seed for the model initialisation, data order and sampling
    epochs: int = 2  # passes over the training data
    max_steps: int = 0  # stop after this many optimizer steps in total (0 = no limit)
    batch_size_per_gpu: int = 32  # rows per micro-batch on each process
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    learn_rate: float = 2e-3  # peak learning rate, reached after the warmup
    min_lr_ratio: float = 0.1  # the cosine decay ends at learn_rate * min_lr_ratio
    warmup_steps: int = 50  # optimizer steps of linear warmup from 0
    weight_decay: float = 0.1  # AdamW weight decay on matrices and embeddings (not on biases or norms)
    adam_beta1: float = 0.9  # AdamW first-moment coefficient
    adam_beta2: float = 0.95  # AdamW second-moment coefficient
    grad_clip: float = 1.0  # clip the gradient norm to this (0 = no clipping)
    bf16: bool = True  # bf16 autocast on GPUs that support it (the CPU always runs float32)
    compile: bool = False  # torch.compile the model (faster steps on GPU after a slow first few; checkpoints load either way)
    compile_backend: str = "inductor"  # torch.compile backend ("eager" only traces the model: for debugging)
    loss_on_response_only: bool = False  # train on the response tokens only (default: prompt and response)
    pack_rows: bool = True  # pack several rows into each sequence (attention stays within a row) instead of padding

    # --- logging, evaluation, output ---
    output_dir: str = "model_save/demo"  # run folder: checkpoints and the exported model
    logging_steps: int = 10  # optimizer steps between log lines
    save_steps: int = 500  # optimizer steps between checkpoints
    keep_latest_n_ckp: int = 3  # best checkpoints kept besides the latest
    eval_batches: int = 0  # validation batches for the loss (0 = the whole validation file)
    eval_steps: int = 0  # optimizer steps between validations (0 = at epoch ends and checkpoints only)
    eval_bleu_samples: int = -1  # first validation prompts whose greedy answers BLEU-4 scores (0 none, -1 all)
    eval_max_new_tokens: int = 128  # longest answer generated for BLEU-4
    eval_no_repeat_ngram_size: int = 0  # >0: BLEU answers never repeat an n-gram of their own (0 = plain greedy)
    best_metric: str = "bleu4"  # what ranks checkpoints: bleu4 (higher is better) or val_loss (lower is better)
    sample_max_new_tokens: int = 96  # tokens generated for the sample printed at the end


@dataclass
class TrainConfigPretrainLarge(TrainConfig):
    """3 GPUs of 20 GB on a host with 12 GB of RAM: a GPT-2-small-sized model, bf16, effective batch 192."""

    output_dir: str = "model_save/pretrain_large"  # run folder: checkpoints and the exported model
    tokenizer_dir: str = "model_save/tokenizer_large"  # where the SentencePiece model is saved and loaded
    vocab_size: int = 32000  # tokenizer vocabulary (the model pads it to a multiple of 64)
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block
    n_embd: int = 768  # width of the residual stream
    max_seq_len: int = 192  # longest sequence in tokens
    batch_size_per_gpu: int = 32  # rows per micro-batch on each GPU
    gradient_accumulation_steps: int = 2  # 32 x 2 x 3 GPUs = 192 rows per optimizer step
    dataloader_buffer_size: int = 5000  # rows in each process's shuffle buffer
    epochs: int = 3  # passes over the training data
    learn_rate: float = 1e-4  # peak learning rate
    warmup_steps: int = 1024  # optimizer steps of linear warmup
    save_steps: int = 5000  # optimizer steps between checkpoints
    logging_steps: int = 100  # optimizer steps between log lines
    keep_latest_n_ckp: int = 5  # best checkpoints kept besides the latest
    eval_batches: int = 200  # validation batches for the loss (0 = the whole validation file)
    eval_bleu_samples: int = 256  # first validation prompts whose greedy answers are scored by BLEU-4
    bf16: bool = True  # bf16 autocast (GPUs from Ampere on)


# Changing one of these between a save and a resume changes what the rest of the run computes.
RESUME_EXACT_FIELDS = (
    "train_file", "seed", "batch_size_per_gpu", "gradient_accumulation_steps", "dataloader_buffer_size",
    "max_seq_len", "epochs", "max_steps", "learn_rate", "min_lr_ratio", "warmup_steps", "weight_decay",
    "adam_beta1", "adam_beta2", "grad_clip", "loss_on_response_only", "dropout",
)
# Changing one of these makes the saved weights unusable.
MODEL_SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "max_seq_len")
