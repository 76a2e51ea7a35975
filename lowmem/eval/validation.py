"""Evaluation: loss, perplexity and BLEU-4 over a file, each sample counted once whatever the number of ranks."""

from __future__ import annotations

import itertools
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Sequence

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from lowmem.data import ParquetStream, StreamLoader
from lowmem.data.collate import TokenizingCollate
from lowmem.data.sources import DEFAULT_COLUMNS
from lowmem.distributed.collectives import all_reduce_sum
from lowmem.distributed.fsdp_units import all_ranks_finished, is_sharded, lockstep
from lowmem.model import GPT, IGNORE_INDEX
from lowmem.tokenization.text_tokenizer import TextTokenizer
from lowmem.distributed.performance import inference_autocast

logger = logging.getLogger(__name__)

_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
METRIC_MODES = {"bleu4": "max", "val_loss": "min", "rewards_accuracy": "max"}


@dataclass
class BleuResult:
    """A corpus BLEU-4 score (0-100) with sacrebleu's signature, which says how it was computed."""

    score: float
    signature: str
    samples: int
    precisions: tuple[float, ...] = ()  # 1- to 4-gram precisions (0-100): which n-grams the answers get right
    brevity_penalty: float = 1.0  # below 1 when the answers are shorter than the references in all


def bleu_tokenizer_for(references: Sequence[str]) -> str:
    """sacrebleu's Chinese tokenizer ("zh", by character) when the references hold Chinese, else its default."""
    return "zh" if any(_CJK.search(text) for text in references) else "13a"


def bleu4(hypotheses: Sequence[str], references: Sequence[str], tokenize: str | None = None) -> BleuResult:
    """Corpus BLEU-4 from sacrebleu (exponential smoothing; brevity penalty 1 for longer hypotheses)."""
    from sacrebleu.metrics import BLEU

    metric = BLEU(tokenize=tokenize or bleu_tokenizer_for(references))
    score = metric.corpus_score(list(hypotheses), [list(references)])
    _forget_tokenized_lines(metric.tokenizer)
    return BleuResult(score=float(score.score), signature=str(metric.get_signature()), samples=len(hypotheses),
                      precisions=tuple(float(p) for p in score.precisions), brevity_penalty=float(score.bp))


def _forget_tokenized_lines(tokenizer: object) -> None:
    """Empty the cache of sacrebleu's tokenizer. Its tokenizers memoise every line they tokenize, keyed by the
    tokenizer object, in a cache shared by the class that holds up to 65,536 lines: each validation makes a new
    tokenizer and its new generations, so nothing is ever found again and the cache grows by every line scored
    (about 0.7 MB per validation of 256 samples) until it is full, tens of MB later on every rank."""
    # A tokenizer may hand its output to another one (zh and 13a pass it through a regexp tokenizer), which
    # keeps a cache of its own.
    for part in (tokenizer, *vars(tokenizer).values()):
        # The class's __call__ itself (an lru_cache wrapper), not a test of callability: callable() would not do.
        cached = getattr(type(part), "__call__", None)  # noqa: B004
        clear = getattr(cached, "cache_clear", None)
        if callable(clear):
            clear()


@dataclass
class EvalResult:
    """What one evaluation measured, over all ranks."""

    loss: float
    loss_rows: int
    loss_tokens: int
    bleu: BleuResult | None = None
    triples: list[dict[str, str]] = field(default_factory=list)  # prompt, reference, generation (all ranks)
    decoding: str = ""  # how the scored answers were generated
    by_source: dict[str, float] = field(default_factory=dict)  # the loss on each of --validation_sources, by name
    # Preference training: rewards/chosen, rewards/rejected, rewards/accuracy, rewards/margin on the held-out pairs
    # (`lowmem.preference.evaluation`); the loss is then the DPO loss and loss_rows the pairs.
    preference: dict[str, float] = field(default_factory=dict)

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 50.0))

    def score(self, metric: str) -> float | None:
        """The value of a retention metric ("bleu4", "val_loss" or "rewards_accuracy")."""
        if metric == "rewards_accuracy":
            return self.preference.get("rewards/accuracy")
        if metric == "bleu4":
            return None if self.bleu is None else self.bleu.score
        return self.loss

    def describe(self) -> str:
        if self.preference:
            figures = self.preference
            text = (f"DPO loss {self.loss:.4f}, rewards/accuracy {figures['rewards/accuracy']:.3f}, rewards/margin "
                    f"{figures['rewards/margin']:.4f} (chosen {figures['rewards/chosen']:.4f}, rejected "
                    f"{figures['rewards/rejected']:.4f}; {self.loss_rows:,} pairs")
            skipped = int(figures.get("skipped_pairs", 0))
            return text + (f", {skipped:,} with the same two answers left out)" if skipped else ")")
        text = f"loss {self.loss:.4f}, perplexity {self.perplexity:.2f} ({self.loss_rows:,} samples)"
        if self.bleu is not None:
            text += (f", BLEU-4 {self.bleu.score:.2f} ({self.bleu.samples:,} samples, {self.decoding}; "
                     f"{self.bleu.signature})")
        if self.by_source:
            text += "; by source: " + ", ".join(f"{name} {loss:.4f}" for name, loss in self.by_source.items())
        return text


def _stream(files: str, columns: Sequence[str], accelerator: Accelerator, max_rows: int | None = None,
            bad_text: str = "refuse") -> ParquetStream:
    # File order and no row left out: every rank scores its own contiguous share, once.
    return ParquetStream(files, columns=columns, shuffle=False, drop_remainder=False, max_rows=max_rows,
                         rank=accelerator.process_index, world_size=accelerator.num_processes, bad_text=bad_text)


@torch.no_grad()
def evaluate_loss(model: GPT, loader: StreamLoader, accelerator: Accelerator,
                  max_batches: int = 0) -> tuple[float, int, int]:
    """(mean token loss, rows, target tokens) over the loader's rows on all ranks.

    A model sharded over the ranks (FSDP2) runs as it trains, a unit at a time: every forward pass is a collective,
    so a rank whose rows are done keeps stepping on a one-token input until every rank's are (`lockstep`).
    """
    was_training = model.training
    model.eval()
    loss_sum, rows, tokens = 0.0, 0, 0
    batches = itertools.islice(loader, max_batches) if max_batches else loader
    for batch in lockstep(batches, accelerator, together=is_sharded(model)):
        if batch is None:  # this rank's rows are done: a pass that counts nothing, for the others' collectives
            model(torch.zeros((1, 1), dtype=torch.long, device=accelerator.device))
            continue
        targets = batch["targets"].to(accelerator.device)
        _, mean_loss = model(batch["input_ids"].to(accelerator.device), targets)
        count = int((targets != IGNORE_INDEX).sum())
        loss_sum += float(mean_loss) * count
        rows += int(targets.shape[0])
        tokens += count
    model.train(was_training)
    total_loss, total_rows, total_tokens = all_reduce_sum(accelerator, [loss_sum, rows, tokens])
    return total_loss / max(total_tokens, 1.0), int(total_rows), int(total_tokens)


def prompt_room(context_len: int, max_new_tokens: int) -> int:
    """The tokens of a prompt a model of `context_len` keeps to answer in up to `max_new_tokens`: a longer prompt is
    cut from the left (its end, the question and the template's turn, stays)."""
    return max(1, context_len - max_new_tokens)


@torch.no_grad()
def generate_answers(model: GPT, tokenizer: TextTokenizer, prompts: Sequence[str], max_new_tokens: int,
                     device: torch.device, batch_size: int = 16, no_repeat_ngram_size: int = 0,
                     accelerator: Accelerator | None = None) -> list[str]:
    """Greedy answers to `prompts`, generated in batches of left-padded prompts with the key/value cache.

    A model sharded over the ranks (FSDP2; `accelerator` given) generates as it trains, a unit at a time: every rank
    runs as many batches as the rank with the most (one of a one-token prompt where its own are done), and a batch
    ends when every rank's rows have finished.
    """
    answers: list[str] = []
    room = prompt_room(model.config.context_len, max_new_tokens)
    prompt_ids = [tokenizer.encode_pair(prompt, None)[0] for prompt in prompts]
    cut = sum(len(ids) > room for ids in prompt_ids)
    if cut:
        logger.warning("%d of %d prompts are longer than the model's context of %d tokens less %d for the answer: "
                       "each keeps its last %d tokens.", cut, len(prompts), model.config.context_len, max_new_tokens,
                       room)
    together = accelerator is not None and is_sharded(model)
    stop_together = all_ranks_finished(accelerator) if accelerator is not None and together else None
    starts = range(0, len(prompts), batch_size)
    for start in lockstep(starts, accelerator, together) if accelerator is not None else starts:
        if start is None:  # this rank's prompts are done: a one-token prompt, for the others' collectives
            encoded = [[tokenizer.pad_id]]
        else:
            encoded = [ids[-room:] for ids in prompt_ids[start:start + batch_size]]
        width = max(len(ids) for ids in encoded)
        idx = torch.full((len(encoded), width), tokenizer.pad_id, dtype=torch.long)  # (B, T), padded on the left
        for row, ids in enumerate(encoded):
            idx[row, width - len(ids):] = torch.tensor(ids)
        lengths = torch.tensor([len(ids) for ids in encoded], device=device)  # (B,) real tokens per row
        out = model.generate(idx.to(device), max_new_tokens=max_new_tokens, greedy=True, eos_id=tokenizer.stop_ids,
                             prompt_lengths=lengths, no_repeat_ngram_size=no_repeat_ngram_size,
                             stop_together=stop_together)
        if start is not None:
            answers.extend(tokenizer.decode(row[width:].tolist()) for row in out)
    return answers


def evaluate(model: GPT, tokenizer: TextTokenizer, files: str, accelerator: Accelerator, *, batch_size: int,
             max_seq_len: int, columns: Sequence[str] = DEFAULT_COLUMNS, bleu_samples: int = 0,
             max_new_tokens: int = 128, max_batches: int = 0, response_only: bool = False,
             no_repeat_ngram_size: int = 0, bf16: bool = False, bf16_on_cpu: bool = False,
             bad_text: str = "refuse") -> EvalResult:
    """Loss and perplexity over `files`, and BLEU-4 of greedy answers to their first `bleu_samples` prompts.

    `columns` are (prompt, response), or one text column: that has no prompts to answer, so no BLEU-4 either.

    Every rank scores its own contiguous share of the rows; sums are all-reduced and generations gathered,
    so each sample counts exactly once whatever the number of ranks. `bleu_samples` < 0 scores every row;
    0 skips BLEU. With `bf16`, the model runs under bf16 autocast on a GPU with native bf16 (the loss is
    still computed in float32); the CPU stays in float32 unless `bf16_on_cpu`. `bad_text` is the streams'
    (`lowmem.data.bad_text`): refuse rows whose text is not UTF-8, or skip them.
    """
    collate = TokenizingCollate(tokenizer, max_seq_len, columns, response_only)
    loader = StreamLoader(_stream(files, columns, accelerator, bad_text=bad_text), batch_size=batch_size,
                          collate_fn=collate)
    with inference_autocast(accelerator.device, bf16, bf16_on_cpu):
        loss, rows, tokens = evaluate_loss(model, loader, accelerator, max_batches)
    result = EvalResult(loss=loss, loss_rows=rows, loss_tokens=tokens)
    if bleu_samples == 0 or len(columns) == 1:
        return result
    prompt_column, response_column = columns
    rows_here = list(_stream(files, columns, accelerator, max_rows=None if bleu_samples < 0 else bleu_samples,
                             bad_text=bad_text))
    prompts = [row[prompt_column] for row in rows_here]
    was_training = model.training
    with inference_autocast(accelerator.device, bf16, bf16_on_cpu):
        answers = generate_answers(model, tokenizer, prompts, max_new_tokens, accelerator.device, batch_size,
                                   no_repeat_ngram_size, accelerator)
    model.train(was_training)
    local = [{"prompt": p, "reference": row[response_column], "generation": a}
             for p, row, a in zip(prompts, rows_here, answers)]
    triples = gather_object(local) if accelerator.num_processes > 1 else local
    result.bleu = bleu4([t["generation"] for t in triples], [t["reference"] for t in triples])
    result.decoding = f"greedy, no repeated {no_repeat_ngram_size}-grams" if no_repeat_ngram_size else "greedy"
    result.triples = triples
    return result
