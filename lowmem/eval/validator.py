"""Validation during training: when it is due, and the loss and BLEU-4 of the model on the validation file."""

from __future__ import annotations

import logging
from typing import Callable

import torch
from accelerate import Accelerator

from lowmem.config import TrainConfig
from lowmem.config.columns import data_columns, response_only
from lowmem.config.train_sources import validation_sources
from lowmem.tokenization.text_tokenizer import TextTokenizer
from lowmem.distributed.strategy import model_for_eval
from lowmem.eval.validation import EvalResult, evaluate

logger = logging.getLogger(__name__)


class Validator:
    """Validates the training model every `eval_steps` steps (0: only when the trainer asks, at epoch ends and
    checkpoints) and remembers the last result. Every rank calls `run` together."""

    def __init__(self, config: TrainConfig, tokenizer: TextTokenizer, accelerator: Accelerator,
                 score_pairs: Callable[[torch.nn.Module, str], EvalResult] | None = None) -> None:
        self.config, self.tokenizer, self.accelerator = config, tokenizer, accelerator
        # Preference training: scores the held-out pairs of a file (`lowmem.preference.evaluation.PairScorer`).
        self.score_pairs = score_pairs
        self.last: EvalResult | None = None

    def due(self, step: int) -> bool:
        return bool(self.config.eval_steps) and step % self.config.eval_steps == 0

    def run(self, model: torch.nn.Module, step: int, with_bleu: bool = True) -> EvalResult:
        """Loss over the validation file (or its first `eval_batches` batches), and BLEU-4 unless told not to (or
        the rows are one text column, with no prompts to answer)."""
        config = self.config
        # The CUDA cache is left as it is: evaluation's tensors (other batch shapes, the key/value cache) come from
        # the blocks training cached, and where none fits the allocator frees cached blocks and tries again by
        # itself; emptying it first would synchronize, and make the next training step allocate every block anew.
        with model_for_eval(model, self.accelerator) as eval_model:
            score_pairs = self.score_pairs

            def loss_of(path: str) -> float:  # each of --validation_sources: its loss alone
                if score_pairs is not None:
                    return score_pairs(eval_model, path).loss
                return evaluate(eval_model, self.tokenizer, path, self.accelerator, **self._loss_settings()).loss

            if score_pairs is not None:  # preference training: the DPO terms of the held-out pairs
                result = score_pairs(eval_model, config.validation_file)
            else:
                result = evaluate(eval_model, self.tokenizer, config.validation_file, self.accelerator,
                                  bleu_samples=config.eval_bleu_samples if with_bleu else 0,
                                  max_new_tokens=config.eval_max_new_tokens,
                                  no_repeat_ngram_size=config.eval_no_repeat_ngram_size, **self._loss_settings())
            result.by_source = {name: loss_of(path) for name, path in validation_sources(config).items()}
        logger.info("Validation at step %d: %s", step, result.describe())
        self.last = result
        return result

    def _loss_settings(self) -> dict:
        """evaluate()'s settings for a validation loss without BLEU."""
        config = self.config
        return dict(batch_size=config.batch_size_per_gpu, max_seq_len=config.max_seq_len, columns=data_columns(config),
                    max_batches=config.eval_batches, response_only=response_only(config), bf16=config.bf16,
                    bf16_on_cpu=config.bf16_on_cpu, bad_text=config.bad_text)

    def last_score(self, metric: str) -> float | None:
        """The last validation's value of `metric` (None before any validation)."""
        return None if self.last is None else self.last.score(metric)
