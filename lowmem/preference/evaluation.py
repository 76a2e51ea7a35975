"""Validation of preference training: the DPO loss, rewards/accuracy and rewards/margin on held-out pairs.

Every rank scores its own contiguous share of the pairs once (as the loss of `lowmem.eval.validation` does); the
sums are all-reduced, so each pair counts once whatever the number of ranks.
"""

from __future__ import annotations

import itertools

import torch
from accelerate import Accelerator

from lowmem.config import TrainConfig
from lowmem.config.columns import data_columns
from lowmem.data import ParquetStream, StreamLoader
from lowmem.distributed.collectives import all_reduce_sum
from lowmem.distributed.fsdp_units import is_sharded, lockstep
from lowmem.distributed.performance import inference_autocast
from lowmem.eval.validation import EvalResult
from lowmem.model.preference import SUM_FIELDS, dpo_terms
from lowmem.preference.collate import PreferenceCollate
from lowmem.preference.loss import PreferenceLoss
from lowmem.preference.reference import Reference, evaluating


@torch.no_grad()
def evaluate_preferences(model: torch.nn.Module, reference: Reference, tokenizer: object, files: str,
                         accelerator: Accelerator, config: TrainConfig) -> EvalResult:
    """The DPO terms of `model` against `reference` over the pairs of `files` (or their first `eval_batches`
    batches per rank): an EvalResult whose loss is the mean DPO loss and whose `preference` holds rewards/chosen,
    rewards/rejected, rewards/accuracy and rewards/margin."""
    columns = data_columns(config)
    stream = ParquetStream(files, columns=columns, shuffle=False, drop_remainder=False,
                           rank=accelerator.process_index, world_size=accelerator.num_processes,
                           bad_text=config.bad_text)
    collate = PreferenceCollate(tokenizer, config.max_seq_len, columns)
    loader = StreamLoader(stream, batch_size=config.batch_size_per_gpu, collate_fn=collate)
    device = accelerator.device
    totals = torch.zeros(len(SUM_FIELDS), dtype=torch.float64)
    skipped = 0
    batches = itertools.islice(loader, config.eval_batches) if config.eval_batches else loader
    with evaluating(model), inference_autocast(device, config.bf16, config.bf16_on_cpu):
        # A model sharded over the ranks runs as it trains: a rank whose pairs are done keeps stepping, on the padding
        # pair of weight 0 an empty batch holds, until every rank's are (`lockstep`).
        for batch in lockstep(batches, accelerator, together=is_sharded(model)):
            batch = collate([]) if batch is None else batch
            input_ids, targets = batch["input_ids"].to(device), batch["targets"].to(device)
            reference_logps = reference.log_probs(batch, input_ids, targets, model=model)
            policy_logps, _ = model(input_ids, targets, answer_logps=True)
            terms = dpo_terms(policy_logps.float(), reference_logps, config.dpo_beta,
                              batch["pair_weights"].to(device))
            totals += terms.sums().double().cpu()
            skipped += int(batch["skipped_pairs"])
    loss, chosen, rejected, correct, pairs, skipped_all = all_reduce_sum(accelerator, [*totals.tolist(), skipped])
    count = max(pairs, 1.0)
    result = EvalResult(loss=loss / count, loss_rows=int(pairs), loss_tokens=0)
    result.preference = {"rewards/chosen": chosen / count, "rewards/rejected": rejected / count,
                         "rewards/accuracy": correct / count, "rewards/margin": (chosen - rejected) / count,
                         "skipped_pairs": skipped_all}
    return result


class PairScorer:
    """`evaluate_preferences` of a model over a file, with the run's reference, tokenizer and config: what the
    validator calls on each held-out file."""

    def __init__(self, reference: Reference, tokenizer: object, accelerator: Accelerator, config: TrainConfig) -> None:
        self.reference, self.tokenizer, self.accelerator, self.config = reference, tokenizer, accelerator, config

    def __call__(self, model: torch.nn.Module, files: str) -> EvalResult:
        return evaluate_preferences(model, self.reference, self.tokenizer, files, self.accelerator, self.config)


def pair_scorer(preference: PreferenceLoss | None, tokenizer: object, accelerator: Accelerator,
                config: TrainConfig) -> PairScorer | None:
    """The validator's scorer of held-out pairs for a preference run (against its loss's reference); None for any
    other run."""
    return None if preference is None else PairScorer(preference.reference, tokenizer, accelerator, config)
