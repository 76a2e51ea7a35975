"""The sections of the training configuration, one dataclass each; `TrainConfig` inherits them all.

A function that needs one part of the configuration takes that section (`def maybe_compile(model,
config: OptimConfig)`); a TrainConfig is every section at once. Each field is declared with `option()`:
its help text, its bounds and what changing it between a save and a resume breaks; a field added after
checkpoints were written without it, the value those runs had in effect (`before=`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lowmem.config.option import EXACT, MODEL_SHAPE, option


@dataclass
class DataConfig:
    """Where the rows come from and how they are streamed."""

    train_file: str = option("data/train.parquet", "parquet file, directory or glob with the training rows; the "
                             "data/ defaults fall back to the packaged demo data set when absent", resume=EXACT)
    validation_file: str = option("data/valid.parquet", "held-out rows for the validation loss and samples")
    test_file: str = option("data/test.parquet", "rows for the final evaluation (never trained on)")
    train_sources: str = option("", "several training sources mixed by weight, PATH:WEIGHT,PATH:WEIGHT (each a parquet "
                                "file, folder or glob; in a config file also a mapping of paths to weights); every "
                                "batch follows the weights, a small source is repeated; replaces --train_file",
                                resume=EXACT, hint="empty reads --train_file alone", before="")
    validation_sources: str = option("", "held-out files scored one by one at every validation, PATH,PATH (e.g. one "
                                     "per training source): a validation loss per source in the log and the curves, "
                                     "beside --validation_file's", hint="empty scores --validation_file alone")
    prompt_column: str = option("prompt", "text column with the prompt")
    response_column: str = option("response", "text column with the response")
    chosen_column: str = option("chosen", "with --objective=dpo: the text column with the preferred answer")
    rejected_column: str = option("rejected", "with --objective=dpo: the text column with the answer not preferred")
    # Exact on resume: pairs and one text column make different sequences, and count different tokens in the loss.
    text_column: str = option("", "one text column to pretrain on, every token in the loss, instead of "
                              "prompt/response pairs (empty: the pairs of --prompt_column and --response_column)",
                              resume=EXACT, before="")
    # Not a resume setting: positions count the rows left out too, so a run refused at bad text resumes with skip.
    bad_text: str = option("refuse", "rows whose text is not valid UTF-8: refuse stops with a message naming the "
                           "file, row group, row and column; skip leaves them out, counted with the rows with empty "
                           "values", choices=("refuse", "skip"),
                           hint="refuse stops at the first such row and names it, skip leaves such rows out and "
                           "counts them")
    dataloader_buffer_size: int = option(2000, "rows in each process's shuffle buffer", minimum=1, resume=EXACT)
    dataloader_mix_row_groups: int = option(16, "row groups each reader reads at once and mixes into every batch; "
                                            "memory holds this many row groups", minimum=1, resume=EXACT,
                                            hint="1 reads one row group at a time, as earlier versions did",
                                            before=1)
    # -1 said "decide" before None did; it still does (`none_spellings`).
    dataloader_num_workers: Optional[int] = option(None, "DataLoader workers per process; None decides from the "
                                                   "memory budget", minimum=0, none_spellings=(-1,),
                                                   hint="leave it unset (None) to decide from the memory budget")


@dataclass
class MemoryConfig:
    """How much host memory the run may use, how often it is cleaned up and logged, and what the model trades
    for memory."""

    ultra_low_mem: Optional[bool] = option(None, "reopen files per row group; None decides from the memory budget")
    # The help says what lowmem.memory.data_settings.decide_memory_settings does (a test checks the share).
    ultra_low_mem_threshold_gb: float = option(15.0, "host memory in GiB (2^30 bytes) below which the automatic "
                                               "settings save memory: ultra-low-mem mode, no pinned memory, and one "
                                               "DataLoader worker per GPU process whose share of the budget is at "
                                               "least 2 GiB (none below that, none on the CPU)", above=0)
    memory_budget_gb: float = option(0.0, "host memory the run may use, in GiB (2^30 bytes); 0 = min(physical RAM, "
                                     "the tightest limit of this process's own cgroup)",
                                     minimum=0, hint="0 detects it")
    memory_savers: str = option("auto", "auto: plan the memory before building the model and turn on the "
                                "memory savers the budget needs (fixed mmap threshold, chunked loss, activation "
                                "checkpointing, smaller micro-batches with the same global batch), or stop when "
                                "nothing fits; off: run every setting as given", choices=("auto", "off"),
                                hint="settings given explicitly are never changed")
    cleanup_steps: int = option(50, "optimizer steps between memory cleanups (gc, Arrow pool, malloc_trim, CUDA cache)",
                                minimum=0)
    memory_log_steps: int = option(200, "optimizer steps between memory records in "
                                   "<output_dir>/logs/memory_<run>_rank<r>.jsonl", minimum=0)
    memory_watchdog_fraction: float = option(0.9, "warn when a process's RSS passes this share of its memory budget",
                                             above=0, maximum=1)
    # The model side of memory (see lowmem/model/loss.py and Block.forward): neither changes what is computed.
    loss_chunk_tokens: int = option(2048, "tokens per chunk of the loss: the head and cross-entropy run a chunk at a "
                                    "time, so the (batch, sequence, vocabulary) logits never exist whole "
                                    "(0 = whole logits; on a GPU where they fit, --memory_savers=auto takes whole "
                                    "logits unless this is given)", minimum=0, hint="0 turns chunking off; 1024 to "
                                    "8192 suit most models")
    malloc_mmap_threshold_mb: float = option(0.0, "C allocations of this many MB or more get a mapping of their "
                                             "own, returned to the system when freed: RSS follows what is in use "
                                             "instead of settling near the peak, for page faults every step "
                                             "(0 = glibc's default)", minimum=0, maximum=32,
                                             hint="0 keeps glibc's default; 1 suits training on a CPU")
    activation_checkpointing: bool = option(False, "keep only each transformer block's input and recompute the "
                                            "block in the backward pass: activations no longer grow with depth, for "
                                            "about a third more compute", aliases=("gradient_checkpointing",),
                                            alias_notes={"gradient_checkpointing": "HF's name for it"})


@dataclass
class TokenizerConfig:
    """The SentencePiece tokenizer: where it lives and how it is trained."""

    tokenizer_dir: str = option("model_save/tokenizer", "where the SentencePiece model is saved and loaded")
    vocab_size: int = option(8000, "tokenizer vocabulary (the model pads it to a multiple of 64)", minimum=64)
    tokenizer_max_sentences: int = option(1_000_000, "cap on lines sampled to train the tokenizer "
                                          "(several GB of RAM at 1M, not in the memory plan: train the tokenizer "
                                          "beforehand on a small host)", minimum=1)


@dataclass
class ModelConfig:
    """The shape of the GPT, or the trained model a run starts from."""

    # Exact on resume: a resume continues from its checkpoint's weights; naming another source then is a mistake.
    init_from: str = option("", "start a new run from a trained model: a lowmem run folder (its best/, else final/, "
                            "else its newest checkpoint), a checkpoint-<step>, best/ or final/ folder, or a "
                            "transformers folder of a Llama, Qwen2 or Mistral model; the model takes the source's "
                            "shape and tokenizer, with a new optimizer, learning-rate schedule and data position, in "
                            "a run folder of its own", resume=EXACT, hint="empty starts from random weights",
                            before="")
    # The adapters' shape is the checkpoints' (their tensors): a resume with another cannot load them.
    lora_rank: int = option(0, "train low-rank adapters (LoRA) of this rank on the model of --init_from, whose own "
                            "weights stay frozen (no gradients, no optimizer state); checkpoints then hold the "
                            "adapters only, best/ and final/ the merged model", minimum=0,
                            resume=(EXACT, MODEL_SHAPE), hint="0 trains every weight; 8 to 64 are usual", before=0)
    lora_alpha: float = option(16.0, "the adapters' scale: their update is multiplied by lora_alpha / lora_rank",
                               above=0, resume=EXACT, before=16.0)
    lora_dropout: float = option(0.0, "dropout on the adapters' input (none by default, as peft's and torchtune's)",
                                 minimum=0, below=1, resume=EXACT, hint="0.05 to 0.1 where a small data set "
                                 "overfits", before=0.05)
    lora_targets: str = option("all", "the projections that get adapters, by transformers' names: all (attention and "
                               "MLP), attention, mlp, or a comma list such as q_proj,v_proj (llama, Qwen2) or "
                               "c_attn,c_fc (gpt2)", resume=(EXACT, MODEL_SHAPE), before="all")
    architecture: Optional[str] = option(None, "llama (rotary positions, RMSNorm, SwiGLU) or gpt2 (learned "
                                         "positions, LayerNorm, GELU); unset: llama for a new run, the checkpoint's "
                                         "when resuming", choices=("gpt2", "llama"), resume=MODEL_SHAPE,
                                         hint="leave it unset to keep a resumed run's architecture", before="gpt2")
    n_layer: int = option(4, "transformer blocks", minimum=1, resume=MODEL_SHAPE)
    n_head: int = option(4, "attention heads per block (must divide n_embd)", minimum=1, resume=MODEL_SHAPE)
    n_embd: int = option(128, "width of the residual stream", minimum=1, resume=MODEL_SHAPE)
    dropout: float = option(0.0, "dropout in embeddings, attention and residual branches", minimum=0, below=1,
                            resume=EXACT)
    max_seq_len: int = option(192, "longest sequence in tokens; longer rows are cut at the end", minimum=1,
                              resume=(EXACT, MODEL_SHAPE))


@dataclass
class PreferenceConfig:
    """What the run optimises: the next token (language modelling) or a preference between two answers (DPO)."""

    # Exact on resume: the two objectives read other rows, count other units and optimise other losses.
    objective: str = option("lm", "what training optimises: lm (the next token of each row) or dpo (direct preference "
                            "optimisation on rows of a prompt, a chosen and a rejected answer; needs --init_from)",
                            choices=("lm", "dpo"), resume=EXACT, before="lm")
    dpo_beta: float = option(0.1, "with --objective=dpo: how far the policy may move from the reference (the "
                             "rewards are beta x the log-probability ratios; TRL's default is 0.1)", above=0,
                             hint="0.01 to 0.5 are usual", resume=EXACT, before=0.1)
    dpo_reference: str = option("auto", "with --objective=dpo: where the reference model's log-probabilities come "
                                "from: auto (under --lora_rank the starting model with the adapters off, no second "
                                "copy; else a frozen copy of it), copy (a frozen copy, counted by the memory plan), "
                                "precomputed (the reference_chosen and reference_rejected columns `lowmem "
                                "dpo_reference` wrote beside the rows)", choices=("auto", "copy", "precomputed"),
                                resume=EXACT, before="auto")


@dataclass
class OptimConfig:
    """How the model is optimised: steps and batches, the learning-rate schedule, AdamW, precision, the loss."""

    seed: int = option(42, "seed for the model initialisation, data order and sampling", resume=EXACT)
    epochs: int = option(2, "passes over the training data", minimum=1, resume=EXACT)
    max_steps: int = option(0, "stop after this many optimizer steps in total (0 = no limit); it also sets the "
                            "schedule's length: the cosine decays to its floor by this step", minimum=0,
                            resume=EXACT)
    batch_size_per_gpu: int = option(32, "rows per micro-batch on each process", minimum=1, resume=EXACT)
    gradient_accumulation_steps: int = option(1, "micro-batches per optimizer step", minimum=1, resume=EXACT)
    learn_rate: float = option(2e-3, "peak learning rate, reached after the warmup", above=0,
                               hint="try 1e-4 to 3e-3", resume=EXACT, aliases=("learning_rate",),
                               alias_notes={"learning_rate": "transformers' name for it"})
    min_lr_ratio: float = option(0.1, "the cosine decay ends at learn_rate * min_lr_ratio", minimum=0, maximum=1,
                                 resume=EXACT)
    warmup_steps: int = option(50, "optimizer steps of linear warmup from 0", minimum=0, resume=EXACT)
    weight_decay: float = option(0.1, "AdamW weight decay on matrices and embeddings (not on biases or norms)",
                                 minimum=0, resume=EXACT)
    adam_beta1: float = option(0.9, "AdamW first-moment coefficient", minimum=0, below=1,
                               hint="the usual values are 0.9 and 0.95", resume=EXACT)
    adam_beta2: float = option(0.95, "AdamW second-moment coefficient", minimum=0, below=1,
                               hint="the usual values are 0.9 and 0.95", resume=EXACT)
    grad_clip: float = option(1.0, "clip the gradient norm to this (0 = no clipping)", minimum=0,
                              hint="0 turns clipping off", resume=EXACT)
    bf16: bool = option(True, "bf16 autocast on GPUs that support it (the CPU runs float32 unless bf16_on_cpu)")
    bf16_on_cpu: bool = option(False, "with bf16, bf16 autocast on the CPU too: the GPU's precision without a GPU "
                               "(faster or slower than float32 depending on the CPU: docs/gpu.md)")
    mirror_cuda: bool = option(False, "on the CPU, decide every automatic setting as on a CUDA GPU (bf16 autocast, "
                               "torch.compile, fixed batch shapes, FSDP2's bf16 policy, merged micro-batches and "
                               "whole logits where the host's budget holds them), to run the GPU's code where there "
                               "is no GPU; what only CUDA has is listed in docs/gpu.md")
    # Speed settings: none changes what a step computes (the losses stay equal to float rounding), so a resume
    # may change any of them. None means "decide from the device" (`lowmem.distributed.performance.speed_settings`).
    compile: Optional[bool] = option(None, "torch.compile the training model (faster steps after the first few "
                                     "compile; checkpoints load either way); None: on with CUDA, off on the CPU "
                                     "and under FSDP or DeepSpeed (their hooks split the graph: True asks anyway)",
                                     hint="leave it unset to compile on a GPU only")
    compile_backend: str = option("inductor", 'torch.compile backend ("eager" only traces the model: for debugging)')
    compile_mode: str = option("default", "torch.compile mode: default; reduce-overhead also replays each step's "
                               "kernels as CUDA graphs (fixed batch shapes, more GPU memory); max-autotune searches "
                               "faster kernels for longer", choices=("default", "reduce-overhead", "max-autotune"))
    static_shapes: Optional[bool] = option(None, "pad every micro-batch to one of two or three fixed shapes "
                                           "(sequences x max_seq_len), so compiled kernels never meet a new shape; "
                                           "the rows and "
                                           "the losses stay the same; None: on with CUDA, off on the CPU (where "
                                           "the padding costs more than it saves)",
                                           hint="leave it unset to fix shapes on a GPU only")
    ddp_bucket_cap_mb: int = option(25, "under DDP, the gradients are all-reduced in buckets of this many MB: larger "
                                    "buckets are fewer, larger transfers (torch's default is 25)", minimum=1)
    # Exact on resume: the gradients rounded to bf16 change what the rest of the run computes.
    ddp_bf16_gradients: bool = option(False, "under DDP in a bf16 run, all-reduce the gradients in bf16: half the "
                                      "bytes between the GPUs, the gradients rounded to bf16 on the way; the update "
                                      "still adds them to float32 weights", resume=EXACT, before=False)
    # "auto" said "decide" before None did; it still does (`none_spellings`).
    attention: Optional[str] = option(None, "attention kernel for packed rows: sdpa (PyTorch's "
                                      "scaled_dot_product_attention with a mask), flex (FlexAttention with a block "
                                      "mask built once per micro-batch, fast on long sequences); None decides: flex "
                                      "on CUDA from 1024 tokens per sequence, sdpa otherwise",
                                      choices=("sdpa", "flex"), none_spellings=("auto",),
                                      hint="leave it unset (None) to decide from the device and --max_seq_len")
    # A first run's rank 0 trains the tokenizer (streaming every row to sample up to tokenizer_max_sentences, 1M,
    # then SentencePiece, which can outlast NCCL's default 10 minutes on a slow CPU) while the other ranks wait in
    # a barrier. A dead rank still stops the run at once (the launcher ends the others); only a rank that hangs
    # alive is noticed this much later.
    process_group_timeout_minutes: float = option(60.0, "minutes a collective waits for the slowest process "
                                                  "before the run fails (NCCL's default is 10; a first run's "
                                                  "tokenizer training on rank 0 can need more)", above=0)
    loss_on_response_only: Optional[bool] = option(None, "train on the response tokens only; None follows the "
                                                   "data: the response for prompt/response pairs, every token for "
                                                   "--text_column", resume=EXACT)
    pack_rows: bool = option(True, "pack several rows into each sequence (attention stays within a row) "
                             "instead of padding")


@dataclass
class OutputConfig:
    """The run folder: log lines, training curves, checkpoints and which of them are kept."""

    output_dir: str = option("model_save/demo", "run folder: checkpoints and the exported model")
    logging_steps: int = option(10, "optimizer steps between log lines", minimum=1)
    peak_tflops: float = option(0.0, "the device's dense bf16 peak in TFLOP/s, for the MFU in the log (0: from the "
                                "GPU's name; no MFU on the CPU unless given)", minimum=0,
                                hint="0 looks the GPU up by its name")
    save_steps: int = option(500, "optimizer steps between checkpoints", minimum=1)
    # The name is historical: it counts the best checkpoints (by best_metric), and the latest is kept on top.
    keep_latest_n_ckp: int = option(3, "how many best checkpoints (by best_metric) are kept besides the latest, "
                                    "which is always kept", minimum=0, aliases=("keep_best_n",))
    keep_optimizer_n_ckp: int = option(2, "how many of the newest kept checkpoints keep the optimizer state a "
                                       "resume needs (the latest, and the one a damaged latest falls back to); "
                                       "the others keep the weights, which is all evaluation and export read",
                                       minimum=1)
    report_to: str = option("none", "training curves through Accelerate's trackers, from the main process: "
                            "tensorboard (event files in logs/tensorboard/<basename of output_dir>/), wandb, or none",
                            choices=("none", "tensorboard", "wandb"))
    progress: bool = option(True, "the training progress bar, on the main process when stderr is a terminal (never "
                            "in a pipe or a log file, where it would break the log lines)")


@dataclass
class EvalConfig:
    """Validation during training: the loss, BLEU-4 on greedy answers, what ranks checkpoints, the final sample."""

    eval_batches: int = option(0, "validation batches for the loss (0 = the whole validation file)", minimum=0)
    eval_steps: int = option(0, "optimizer steps between validations (0 = at epoch ends and checkpoints only)",
                             minimum=0)
    eval_on_start: bool = option(True, "the validation loss before the first step, which the run's last line "
                                 "compares with the end's (False starts training at once: a long validation file "
                                 "takes minutes; a resumed run never validates at its start)")
    eval_bleu_samples: int = option(-1, "first validation prompts whose greedy answers BLEU-4 scores "
                                    "(0 none, -1 all)", minimum=-1, hint="-1 scores all, 0 none")
    eval_max_new_tokens: int = option(128, "longest answer generated for BLEU-4", minimum=1)
    eval_no_repeat_ngram_size: int = option(0, ">0: BLEU answers never repeat an n-gram of their own "
                                            "(0 = plain greedy)", minimum=0)
    best_metric: str = option("bleu4", "what ranks checkpoints: bleu4 (higher is better), val_loss (lower is "
                              "better) or, with --objective=dpo, rewards_accuracy (the share of held-out pairs whose "
                              "chosen answer the policy prefers, higher is better)",
                              choices=("bleu4", "val_loss", "rewards_accuracy"))
    sample_max_new_tokens: int = option(96, "tokens generated for the sample printed at the end", minimum=1)
