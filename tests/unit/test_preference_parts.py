"""The parts of preference training (--objective=dpo), each on its own: the collate that lays out the pairs, the two
warnings of its log, the step's counts of pairs, the DPO terms and the model's forward in DPO mode, the config's
checks and settled values, the validation result, the memory plan's frozen copy and the refusal to start from random
weights."""

from __future__ import annotations

import dataclasses
import logging
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from memory_plan_helpers import LARGE, large_inputs

from lowmem.config import TrainConfig, validate_config
from lowmem.config.columns import REFERENCE_COLUMNS, data_columns
from lowmem.config.settle import settle_best_metric, settled_config
from lowmem.data.collate import PAD_TO_MULTIPLE_OF
from lowmem.tokenization.sentencepiece_tokenizer import BOS_ID, EOS_ID, PAD_ID, SEP_ID, Tokenizer, train_tokenizer
from lowmem.errors import ConfigError
from lowmem.eval.validation import METRIC_MODES, EvalResult
from lowmem.memory.plan import RESIDENT, plan_memory
from lowmem.model import GPT, IGNORE_INDEX, GPTConfig
from lowmem.model.preference import LN2, SUM_FIELDS, dpo_terms
from lowmem.preference.collate import PreferenceCollate
from lowmem.preference.log import STALL_STEPS, STALL_TOLERANCE, SkippedPairs, StallAtLn2
from lowmem.source.settle import settle_source
from lowmem.train.step import count_rows, count_tokens
from lowmem.units import GIB

COLUMNS = ("prompt", "chosen", "rejected")
I = IGNORE_INDEX  # noqa: E741 (short, for the arrays written out below)


class CharTokenizer:
    """Each lowercase letter is one id ('a' → 10, 'b' → 11, ...), laid out as lowmem's
    SentencePiece tokenizer lays out a pair: [bos] prompt [sep] answer [eos], with `start` the index of the answer's
    first id."""

    pad_id = PAD_ID

    @staticmethod
    def encode(text: str) -> list[int]:
        return [ord(character) - ord("a") + 10 for character in text]

    def encode_pair_batch(self, prompts: list[str], responses: list[str]) -> list[tuple[list[int], int]]:
        assert len(prompts) == len(responses)
        encoded = []
        for prompt, response in zip(prompts, responses):
            ids = [BOS_ID, *self.encode(prompt), SEP_ID]
            encoded.append((ids + [*self.encode(response), EOS_ID], len(ids)))
        return encoded


def row(prompt: str, chosen: str, rejected: str, **extra: str) -> dict[str, str]:
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, **extra}


def padded(values: list[int], fill: int, width: int = PAD_TO_MULTIPLE_OF) -> list[int]:
    return values + [fill] * (width - len(values))


def collate(rows: list[dict[str, str]], max_seq_len: int = 64, columns=COLUMNS) -> dict[str, torch.Tensor]:
    return PreferenceCollate(CharTokenizer(), max_seq_len, columns)(rows)


# ----- the collate -----------------------------------------------------------------------------------------------
def test_chosen_rows_come_first_and_only_the_answers_are_targets():
    # ids: a..j = 10..19; bos 1, sep 4, eos 2.
    batch = collate([row("ab", "cd", "e"), row("f", "gh", "ij")])
    assert batch["input_ids"].tolist() == [
        padded([BOS_ID, 10, 11, SEP_ID, 12, 13], PAD_ID),  # pair 0, chosen
        padded([BOS_ID, 15, SEP_ID, 16, 17], PAD_ID),  # pair 1, chosen
        padded([BOS_ID, 10, 11, SEP_ID, 14], PAD_ID),  # pair 0, rejected
        padded([BOS_ID, 15, SEP_ID, 18, 19], PAD_ID),  # pair 1, rejected
    ]
    # Position j predicts id j + 1: the prompt's ids and the separator are not predicted, the answer and eos are.
    assert batch["targets"].tolist() == [
        padded([I, I, I, 12, 13, EOS_ID], I),
        padded([I, I, 16, 17, EOS_ID], I),
        padded([I, I, I, 14, EOS_ID], I),
        padded([I, I, 18, 19, EOS_ID], I),
    ]
    assert batch["input_ids"].dtype == batch["targets"].dtype == torch.int64
    assert batch["pair_weights"].dtype == torch.float32 and batch["pair_weights"].tolist() == [1.0, 1.0]
    assert int(batch["skipped_pairs"]) == 0
    assert "reference_logps" not in batch


def test_a_pair_with_the_same_two_answers_is_left_out_and_counted():
    batch = collate([row("ab", "cd", "e"), row("f", "gg", "gg"), row("h", "i", "j")])
    assert batch["input_ids"].tolist() == [
        padded([BOS_ID, 10, 11, SEP_ID, 12, 13], PAD_ID),  # pair 0, chosen
        padded([BOS_ID, 17, SEP_ID, 18], PAD_ID),  # pair 2, chosen
        padded([BOS_ID, 10, 11, SEP_ID, 14], PAD_ID),  # pair 0, rejected
        padded([BOS_ID, 17, SEP_ID, 19], PAD_ID),  # pair 2, rejected
    ]
    assert batch["targets"][:, :4].tolist() == [[I, I, I, 12], [I, I, 18, EOS_ID], [I, I, I, 14], [I, I, 19, EOS_ID]]
    assert batch["pair_weights"].tolist() == [1.0, 1.0]
    assert int(batch["skipped_pairs"]) == 1


def test_answers_that_differ_only_past_max_seq_len_are_the_same_answer():
    # max_seq_len 6 keeps 7 ids: [bos] a b [sep] c d e; the answers differ in their fifth letter.
    batch = collate([row("ab", "cdefg", "cdefh"), row("ab", "cdx", "cdy")], max_seq_len=6)
    assert batch["input_ids"].tolist() == [[BOS_ID, 10, 11, SEP_ID, 12, 13], [BOS_ID, 10, 11, SEP_ID, 12, 13]]
    assert batch["targets"].tolist() == [[I, I, I, 12, 13, 33], [I, I, I, 12, 13, 34]]
    assert batch["pair_weights"].tolist() == [1.0] and int(batch["skipped_pairs"]) == 1


@pytest.mark.parametrize("columns", [COLUMNS, COLUMNS + REFERENCE_COLUMNS])
def test_a_batch_of_identical_pairs_is_one_padding_pair_of_weight_0(columns):
    rows = [row("ab", "cd", "cd", reference_chosen="-1.5", reference_rejected="-2.5"),
            row("e", "", "", reference_chosen="-3", reference_rejected="-3")]
    batch = collate(rows, columns=columns)
    assert batch["input_ids"].shape == batch["targets"].shape == (2, PAD_TO_MULTIPLE_OF)
    assert (batch["input_ids"] == PAD_ID).all() and (batch["targets"] == IGNORE_INDEX).all()
    assert batch["pair_weights"].tolist() == [0.0]
    assert int(batch["skipped_pairs"]) == 2
    if len(columns) == 5:
        assert batch["reference_logps"].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("answer, max_seq_len, width", [
    (1, 64, 32),  # [bos] a [sep] c: 4 inputs
    (29, 64, 32),  # 32 inputs
    (30, 64, 64),  # 33 inputs
    (30, 40, 40),  # 33 inputs, under the cap
    (90, 40, 40),  # cut at max_seq_len
    (90, 200, 96),
])
def test_widths_are_multiples_of_32_up_to_max_seq_len(answer, max_seq_len, width):
    batch = collate([row("a", "c" * answer, "d" * answer), row("a", "c", "e")], max_seq_len=max_seq_len)
    assert batch["input_ids"].shape == batch["targets"].shape == (4, width)
    longest = min(answer + 3, max_seq_len)
    assert (batch["input_ids"][0] != PAD_ID).sum() == longest and (batch["input_ids"][1] != PAD_ID).sum() == 4
    # A cut sequence ends on an answer id, not on eos.
    assert batch["targets"][0, longest - 1] == (EOS_ID if answer + 3 <= max_seq_len else 12)


def test_the_precomputed_reference_is_read_chosen_then_rejected_without_the_left_out_pairs():
    rows = [row("ab", "cd", "e", reference_chosen="-1.25", reference_rejected="-7.5"),
            row("f", "gg", "gg", reference_chosen="-100", reference_rejected="-200"),
            row("h", "i", "j", reference_chosen="-3e-1", reference_rejected="-12")]
    batch = collate(rows, columns=COLUMNS + REFERENCE_COLUMNS)
    assert batch["reference_logps"].dtype == torch.float32
    assert batch["reference_logps"].tolist() == pytest.approx([-1.25, -0.3, -7.5, -12.0])
    assert batch["pair_weights"].tolist() == [1.0, 1.0] and int(batch["skipped_pairs"]) == 1


def test_columns_other_than_three_or_five_are_refused():
    with pytest.raises(ValueError, match="columns must be"):
        PreferenceCollate(CharTokenizer(), 64, ("prompt", "chosen"))


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> Tokenizer:
    """A real lowmem tokenizer, trained on a few preference rows."""
    folder = tmp_path_factory.mktemp("preference_tokenizer")
    texts = ["the cat sat on the mat", "a dog ran in the park", "what is the capital of france",
             "paris is the capital", "london is not the capital of france", "how many legs has a spider",
             "eight legs", "six legs, like an ant", "name a colour of the sky", "blue on a clear day"] * 3
    pq.write_table(pa.table({"text": texts}), folder / "rows.parquet")
    train_tokenizer(folder / "rows.parquet", folder / "tokenizer", vocab_size=320, columns=("text",),
                    hard_vocab_limit=False)
    return Tokenizer.load(folder / "tokenizer")


def test_a_real_tokenizer_counts_each_answer_and_its_eos(sentencepiece):
    rows = [row("what is the capital of france", "paris is the capital", "london is not the capital of france"),
            row("how many legs has a spider", "eight legs", "eight legs"),
            row("how many legs has a spider", "eight legs", "six legs, like an ant")]
    batch = PreferenceCollate(sentencepiece, 64, COLUMNS)(rows)
    assert batch["pair_weights"].tolist() == [1.0, 1.0] and int(batch["skipped_pairs"]) == 1
    kept = [(rows[0]["prompt"], rows[0]["chosen"]), (rows[2]["prompt"], rows[2]["chosen"]),
            (rows[0]["prompt"], rows[0]["rejected"]), (rows[2]["prompt"], rows[2]["rejected"])]
    for index, (prompt, answer) in enumerate(kept):
        ids, start = sentencepiece.encode_pair(prompt, answer)
        prompt_ids = sentencepiece.encode(prompt)
        assert ids[:start] == [sentencepiece.bos_id, *prompt_ids, sentencepiece.sep_id]
        inputs, targets = batch["input_ids"][index].tolist(), batch["targets"][index].tolist()
        assert inputs == padded(ids[:-1], sentencepiece.pad_id)
        counted = [target for target in targets if target != IGNORE_INDEX]
        assert counted == sentencepiece.encode(answer) + [sentencepiece.eos_id]
        assert targets[: start - 1] == [IGNORE_INDEX] * (start - 1)  # the prompt's ids and the separator


# ----- the step's counts -----------------------------------------------------------------------------------------
def test_a_step_counts_pairs_not_tokens_and_rows_with_the_left_out_pairs():
    two_and_one_left_out = collate([row("ab", "cd", "e"), row("f", "gg", "gg"), row("h", "i", "j")])
    all_left_out = collate([row("ab", "cd", "cd"), row("e", "f", "f")])
    micro_batches = [two_and_one_left_out, all_left_out]
    targets, inputs = count_tokens(micro_batches, PAD_ID)
    assert targets == 2  # the pairs of the DPO loss; the padding pair weighs 0
    assert inputs == (6 + 4) + (5 + 4)  # every id but the eos of the four kept sequences
    assert count_rows(micro_batches, PAD_ID) == (2 + 1) + (0 + 2)


# ----- the log's warnings ----------------------------------------------------------------------------------------
def stall_warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if "ln 2" in record.getMessage()]


def test_the_stall_at_ln_2_is_said_once_after_its_steps_and_not_before(caplog):
    stall = StallAtLn2()
    with caplog.at_level(logging.WARNING, logger="lowmem.preference.log"):
        for step in range(10, STALL_STEPS, 10):  # windows of 10 steps: steps 1 to 190
            stall.add(step, LN2 + (STALL_TOLERANCE * 0.9 if step % 20 else -STALL_TOLERANCE * 0.9), 10)
        assert stall_warnings(caplog) == []
        stall.add(STALL_STEPS, LN2, 10)
        assert len(stall_warnings(caplog)) == 1
        assert f"for {STALL_STEPS} steps" in stall_warnings(caplog)[0]
        for step in range(STALL_STEPS + 10, 3 * STALL_STEPS, 10):
            stall.add(step, LN2, 10)
        assert len(stall_warnings(caplog)) == 1


def test_a_line_out_of_the_band_starts_the_count_again(caplog):
    stall = StallAtLn2()
    with caplog.at_level(logging.WARNING, logger="lowmem.preference.log"):
        for step in range(10, 110, 10):
            stall.add(step, LN2, 10)
        stall.add(110, LN2 - 2 * STALL_TOLERANCE, 10)  # out of the band
        for step in range(120, 110 + STALL_STEPS, 10):  # steps 111 to 300: 190 steps
            stall.add(step, LN2, 10)
        assert stall_warnings(caplog) == []
        stall.add(110 + STALL_STEPS, LN2, 10)
        assert len(stall_warnings(caplog)) == 1


def test_left_out_pairs_are_said_at_the_first_and_when_the_count_doubles(caplog):
    skipped = SkippedPairs()
    said = []
    with caplog.at_level(logging.WARNING, logger="lowmem.preference.log"):
        for count in [0, 0, 1, 0, 1, 1, 1, 3, 1, 1500, 0, 1]:
            caplog.clear()
            skipped.add(count)
            said.append([record.getMessage().split(" pairs")[0] for record in caplog.records])
    assert said == [[], [], ["1"], [], ["2"], [], ["4"], [], ["8"], ["1,508"], [], []]
    assert skipped.total == 1509


# ----- the DPO terms and the model's forward ---------------------------------------------------------------------
def test_a_pair_of_weight_0_changes_neither_the_loss_nor_the_sums():
    # beta 0.5; rewards: chosen [0.5, 0], rejected [-0.5, 0.5]; z = [1, -0.5]. A third pair, far apart, weighs 0.
    policy = torch.tensor([-1.0, -2.0, -100.0, -3.0, -1.0, 0.0])
    reference = torch.tensor([-2.0, -2.0, -1.0, -2.0, -2.0, -1.0])
    weighted = dpo_terms(policy, reference, beta=0.5, pair_weights=torch.tensor([1.0, 1.0, 0.0]))
    two = dpo_terms(policy[[0, 1, 3, 4]], reference[[0, 1, 3, 4]], beta=0.5, pair_weights=torch.ones(2))
    expected_loss = F.softplus(torch.tensor(-1.0)).item() + F.softplus(torch.tensor(0.5)).item()
    assert SUM_FIELDS == ("loss", "chosen", "rejected", "correct", "pairs")
    for terms in (weighted, two):
        assert dict(zip(SUM_FIELDS, terms.sums().tolist())) == pytest.approx(
            {"loss": expected_loss, "chosen": 0.5, "rejected": 0.0, "correct": 1.0, "pairs": 2.0}, abs=1e-6)
        assert terms.accuracy.item() == pytest.approx(0.5) and terms.margin.item() == pytest.approx(0.25)
    assert weighted.row_weights[[2, 5]].tolist() == [0.0, 0.0]
    assert torch.allclose(weighted.row_weights[[0, 1, 3, 4]], two.row_weights)


VOCAB, WIDTH, BETA = 64, 12, 0.1


def tiny_gpt(loss_chunk_tokens: int = 0) -> GPT:
    torch.manual_seed(0)
    net = GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=WIDTH, n_layer=2, n_head=2, n_embd=32, architecture="llama"))
    return net.use_memory_savers(loss_chunk_tokens=loss_chunk_tokens)


def pair_batch(pairs: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """2P rows (chosen first) of a 3-token prompt and a 6-token answer; targets count the answer only."""
    generator = torch.Generator().manual_seed(seed)
    sequences = torch.randint(1, VOCAB, (2 * pairs, 10), generator=generator)
    sequences[pairs:, :3] = sequences[:pairs, :3]  # each pair's two answers follow one prompt
    idx, targets = sequences[:, :-1], sequences[:, 1:].clone()
    targets[:, :2] = IGNORE_INDEX
    return idx, targets


def plain_answer_logps(net: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(2P,) −Σ CE over each row's answer tokens, through the whole logits, with gradients."""
    logits = net(idx)[0].float()  # (2P, T, V)
    losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                             reduction="none")
    return -losses.view(targets.shape).sum(dim=1)


def gradients(net: GPT) -> dict[str, torch.Tensor]:
    grads = {name: parameter.grad.clone() for name, parameter in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("loss_chunk_tokens", [0, 7])
def test_the_forward_against_its_own_answers_is_ln_2_with_the_direct_losss_gradient(loss_chunk_tokens):
    pairs = 3
    net, (idx, targets) = tiny_gpt(loss_chunk_tokens), pair_batch(pairs)
    reference, nothing = net(idx, targets, answer_logps=True)
    assert nothing is None and not reference.requires_grad and reference.shape == (2 * pairs,)
    assert torch.allclose(reference, plain_answer_logps(net, idx, targets).detach(), atol=1e-5)
    net.zero_grad(set_to_none=True)

    sums, surrogate = net(idx, targets, reference_logps=reference, dpo_beta=BETA, pair_weights=torch.ones(pairs))
    assert dict(zip(SUM_FIELDS, sums.tolist())) == pytest.approx(
        {"loss": pairs * LN2, "chosen": 0.0, "rejected": 0.0, "correct": 0.0, "pairs": float(pairs)}, abs=1e-5)
    surrogate.backward()
    two_pass = gradients(net)

    logps = plain_answer_logps(net, idx, targets)
    z = BETA * ((logps[:pairs] - reference[:pairs]) - (logps[pairs:] - reference[pairs:]))
    direct = F.softplus(-z).sum()
    assert direct.item() == pytest.approx(pairs * LN2, abs=1e-5)
    direct.backward()
    for name, expected in gradients(net).items():
        assert torch.allclose(two_pass[name], expected, atol=1e-5), name
    assert max(grad.abs().max().item() for grad in two_pass.values()) > 1e-3  # there is a gradient to compare


def test_a_padding_pair_of_weight_0_changes_neither_the_sums_nor_the_gradient():
    net, (idx, targets) = tiny_gpt(), pair_batch(3, seed=1)
    with torch.no_grad():  # a reference away from the policy: each pair has its own weight in the gradient
        reference = net(idx, targets, answer_logps=True)[0] + torch.tensor([0.5, -1.0, 3.0, -0.5, 2.0, -3.0])
    sums, surrogate = net(idx, targets, reference_logps=reference, dpo_beta=0.5,
                          pair_weights=torch.tensor([1.0, 1.0, 0.0]))
    surrogate.backward()
    with_padding = gradients(net)
    kept = [0, 1, 3, 4]
    kept_sums, kept_surrogate = net(idx[kept], targets[kept], reference_logps=reference[kept], dpo_beta=0.5,
                                    pair_weights=torch.ones(2))
    kept_surrogate.backward()
    assert torch.allclose(sums, kept_sums, atol=1e-6) and sums[-1].item() == 2.0
    assert not math.isclose(sums[0].item(), 2 * LN2, abs_tol=1e-3)
    for name, expected in gradients(net).items():
        assert torch.allclose(with_padding[name], expected, atol=1e-6), name


# ----- the config ------------------------------------------------------------------------------------------------
def dpo(**changes) -> TrainConfig:
    return dataclasses.replace(TrainConfig(objective="dpo"), **changes)


def test_a_plain_dpo_config_passes():
    validate_config(dpo())
    validate_config(dpo(best_metric="rewards_accuracy", dpo_reference="precomputed"))


def test_dpo_with_one_text_column_is_refused():
    with pytest.raises(ConfigError, match="--text_column=text"):
        validate_config(dpo(text_column="text"))


@pytest.mark.parametrize("changes", [dict(chosen_column="prompt"), dict(rejected_column="prompt"),
                                     dict(rejected_column="chosen"), dict(chosen_column="a", rejected_column="a")])
def test_dpo_reads_three_different_columns(changes):
    with pytest.raises(ConfigError, match="three different columns"):
        validate_config(dpo(**changes))


def test_dpo_does_not_check_the_response_column_it_does_not_read():
    validate_config(dpo(prompt_column="response"))


@pytest.mark.parametrize("changes, flag", [(dict(best_metric="rewards_accuracy"), "--best_metric=rewards_accuracy"),
                                           (dict(dpo_reference="precomputed"), "--dpo_reference=precomputed")])
def test_preference_settings_without_dpo_are_refused(changes, flag):
    with pytest.raises(ConfigError, match=flag) as refusal:
        validate_config(TrainConfig(**changes))
    assert "--objective=dpo" in str(refusal.value)


def test_dpo_ranks_checkpoints_by_rewards_accuracy_unless_told_otherwise():
    assert settled_config(dpo(), None).best_metric == "rewards_accuracy"
    assert settle_best_metric(dpo(eval_bleu_samples=0)).best_metric == "rewards_accuracy"
    assert settle_best_metric(dpo(best_metric="val_loss")).best_metric == "val_loss"
    assert settled_config(TrainConfig(), None).best_metric == "bleu4"


def test_dpo_reads_the_prompt_and_two_answers_and_the_precomputed_reference():
    assert data_columns(dpo()) == ("prompt", "chosen", "rejected")
    assert data_columns(dpo(prompt_column="q", chosen_column="good", rejected_column="bad")) == ("q", "good", "bad")
    assert data_columns(dpo(dpo_reference="precomputed")) == ("prompt", "chosen", "rejected", *REFERENCE_COLUMNS)
    assert REFERENCE_COLUMNS == ("reference_chosen", "reference_rejected")
    assert data_columns(dpo(dpo_reference="copy")) == ("prompt", "chosen", "rejected")
    assert data_columns(TrainConfig()) == ("prompt", "response")


def test_dpo_without_a_starting_model_is_refused():
    with pytest.raises(ConfigError, match="--init_from"):
        settle_source(dpo(), given=(), saved_config=None, checkpoint=None)
    with pytest.raises(ConfigError, match="--objective=dpo"):
        settle_source(dpo(lora_rank=8), given=("lora_rank",), saved_config=None, checkpoint=None)
    config = TrainConfig()
    assert settle_source(config, given=(), saved_config=None, checkpoint=None) == (config, None)


# ----- the validation result -------------------------------------------------------------------------------------
FIGURES = {"rewards/chosen": 0.2, "rewards/rejected": -0.1, "rewards/accuracy": 0.75, "rewards/margin": 0.3}


def test_held_out_accuracy_ranks_checkpoints_higher_is_better():
    result = EvalResult(loss=0.5, loss_rows=1200, loss_tokens=0, preference=dict(FIGURES))
    assert result.score("rewards_accuracy") == 0.75 and METRIC_MODES["rewards_accuracy"] == "max"
    assert result.score("val_loss") == 0.5
    assert EvalResult(loss=0.5, loss_rows=10, loss_tokens=100).score("rewards_accuracy") is None


def test_a_preference_result_describes_its_rewards_and_pairs():
    result = EvalResult(loss=0.5, loss_rows=1200, loss_tokens=0, preference=dict(FIGURES))
    assert result.describe() == ("DPO loss 0.5000, rewards/accuracy 0.750, rewards/margin 0.3000 (chosen 0.2000, "
                                 "rejected -0.1000; 1,200 pairs)")
    result.preference["skipped_pairs"] = 3000.0
    assert result.describe() == ("DPO loss 0.5000, rewards/accuracy 0.750, rewards/margin 0.3000 (chosen 0.2000, "
                                 "rejected -0.1000; 1,200 pairs, 3,000 with the same two answers left out)")


# ----- the memory plan -------------------------------------------------------------------------------------------
REFERENCE_PART = "DPO reference (frozen copy)"


def test_the_plan_counts_the_frozen_reference_where_the_model_trains():
    copy = 4 * LARGE.params
    without = plan_memory(large_inputs())
    plan = plan_memory(large_inputs(reference_bytes=copy))
    [part] = [item for item in plan.host if item.name == REFERENCE_PART]
    assert part.bytes == copy and part.phase == RESIDENT
    assert REFERENCE_PART not in [item.name for item in without.host]
    assert plan.high_water() - without.high_water() == copy
    gpu = plan_memory(large_inputs(reference_bytes=copy, device="cuda", bf16=True, gpu_bytes=80 * GIB))
    assert [item.bytes for item in gpu.device if item.name == REFERENCE_PART] == [copy]
    assert REFERENCE_PART not in [item.name for item in gpu.host]


# ----- what the review of the first version found --------------------------------------------------------------

def test_a_frozen_copy_with_bf16_block_matrices_computes_what_the_policy_computes_under_autocast():
    from lowmem.preference.reference import copy_bytes, halve_block_matrices

    policy, (idx, targets) = tiny_gpt(), pair_batch(3)
    copy = tiny_gpt()
    halve_block_matrices(copy)
    copy.load_state_dict(policy.state_dict())  # cast to each parameter's dtype on the way in, as fill_model does
    halved = [name for name, parameter in copy.named_parameters() if parameter.dtype == torch.bfloat16]
    assert halved and all(name.startswith("blocks.") and name.endswith("weight") for name in halved)
    assert copy.tok_emb.weight.dtype == torch.float32  # the embedding and the head tied to it stay float32
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ours, _ = copy(idx, targets, answer_logps=True)
        theirs, _ = policy(idx, targets, answer_logps=True)
    assert torch.equal(ours, theirs)  # autocast casts the policy's float32 matrices to the same bf16 values
    blocks = sum(parameter.numel() for parameter in policy.blocks.parameters())
    others = policy.num_params() - blocks
    assert copy_bytes(blocks, others, half=True) == 2 * blocks + 4 * others
    assert copy_bytes(blocks, others, half=False) == 4 * policy.num_params()


def test_reference_log_probs_passed_as_float32_bits_survive_a_bf16_cast_of_the_inputs():
    net, (idx, targets) = tiny_gpt(), pair_batch(2)
    reference = -300.0 - torch.rand(4, generator=torch.Generator().manual_seed(1))  # between -301 and -300
    assert not torch.equal(reference.to(torch.bfloat16).float(), reference)  # what a bf16 cast would do
    bits = reference.contiguous().view(torch.int32)
    with torch.no_grad():
        as_bits, _ = net(idx, targets, reference_logps=bits, dpo_beta=BETA, pair_weights=torch.ones(2))
        as_floats, _ = net(idx, targets, reference_logps=reference, dpo_beta=BETA, pair_weights=torch.ones(2))
    assert torch.equal(as_bits, as_floats)


@pytest.mark.parametrize("value", ["abc", "nan", "inf", " "])
def test_a_precomputed_value_that_is_not_a_finite_number_is_refused_naming_its_column(value):
    from lowmem.errors import DataError

    rows = [row("p", "yes", "no", reference_chosen=value, reference_rejected="-1.5")]
    with pytest.raises(DataError, match="reference_chosen"):
        collate(rows, columns=COLUMNS + REFERENCE_COLUMNS)


def test_preference_training_shapes_batches_to_fit_on_a_gpu_and_refuses_fixed_shapes():
    from lowmem.distributed.performance import speed_settings

    assert not speed_settings(dpo(), "cuda").static_shapes
    assert speed_settings(TrainConfig(), "cuda").static_shapes  # next-token runs keep their fixed shapes
    with pytest.raises(ConfigError, match="--static_shapes"):
        speed_settings(dpo(static_shapes=True), "cuda")
