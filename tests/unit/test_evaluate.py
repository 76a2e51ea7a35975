"""Evaluation in-process: BLEU-4 as sacrebleu computes it, and checkpoints kept by BLEU-4 or by loss (the
commands: tests/integration/test_evaluate_commands.py)."""

from __future__ import annotations

import pytest

from lowmem.checkpoint import CheckpointManager
from lowmem.eval.validation import METRIC_MODES, bleu4, bleu_tokenizer_for


@pytest.mark.parametrize("hypotheses, references, tokenize", [
    (["春风又绿江南岸", "明月何时照我还", ""], ["春风又绿江南岸", "明月几时照我还", "夜雨寄北"], "zh"),
    (["the cat sat on the mat", "a very much longer hypothesis than its short reference text", ""],
     ["the cat sat on a mat", "a short reference", "nothing produced here"], "13a"),
    (["一二三四五六七八九十，再加上很多很多字", "千里"], ["一二三四五六", "千里江陵一日还"], "zh"),
])
def test_bleu4_equals_sacrebleu(hypotheses, references, tokenize):
    import sacrebleu

    expected = sacrebleu.corpus_bleu(hypotheses, [references], tokenize=tokenize)
    result = bleu4(hypotheses, references)
    assert bleu_tokenizer_for(references) == tokenize
    assert result.score == pytest.approx(expected.score, abs=1e-9)
    assert f"tok:{tokenize}" in result.signature and result.samples == len(hypotheses)
    assert (result.precisions == pytest.approx(expected.precisions)
            and result.brevity_penalty == pytest.approx(expected.bp))


def test_bleu4_longer_hypothesis_has_no_bonus_and_empty_scores_zero():
    perfect = bleu4(["明月几时有"], ["明月几时有"]).score
    longer = bleu4(["明月几时有把酒问青天"], ["明月几时有"]).score
    assert perfect == pytest.approx(100.0)
    assert longer <= perfect  # brevity penalty never rewards length
    assert bleu4([""], ["明月几时有"]).score == 0.0


@pytest.mark.parametrize("tokenize", ["zh", "13a", "intl", "char"])
def test_bleu4_keeps_nothing_of_the_lines_it_scored(tokenize):
    """Every validation scores new generations with a new sacrebleu tokenizer, whose line cache is shared by
    its class: left alone it grew by every line scored (0.7 MB per validation of 256 samples), a steady rise in
    the memory log of a long run."""
    import gc
    import random
    import tracemalloc

    rng = random.Random(0)

    def line() -> str:
        return "".join(chr(0x4E00 + rng.randrange(3000)) + ("a" if index % 7 == 0 else "")
                       for index in range(60))

    references = [line() for _ in range(128)]
    bleu4([line() for _ in range(128)], references, tokenize=tokenize)
    tracemalloc.start()
    try:
        gc.collect()  # a scoring's own n-gram tables live in reference cycles until a collection
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(8):
            bleu4([line() for _ in range(128)], references, tokenize=tokenize)
        gc.collect()
        growth = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # With the cache kept, 8 scorings of 128 new lines of 60 characters keep 0.5 to 2.5 MB.
    assert growth < 100_000, f"{growth / 1e6:.2f} MB kept after 8 scorings"


@pytest.mark.parametrize("metric, scores, kept", [
    ("bleu4", {10: 12.0, 20: 30.0, 30: 25.0, 40: 5.0}, ["checkpoint-20", "checkpoint-30", "checkpoint-40"]),
    ("val_loss", {10: 3.0, 20: 2.0, 30: 2.5, 40: 4.0}, ["checkpoint-20", "checkpoint-30", "checkpoint-40"]),
    ("val_loss", {10: 1.0, 20: 2.0, 30: 3.0, 40: 4.0}, ["checkpoint-10", "checkpoint-20", "checkpoint-40"]),
])
def test_retention_by_bleu_keeps_highest_and_by_loss_lowest(tmp_path, metric, scores, kept):
    manager = CheckpointManager(tmp_path, keep_best_n=2, metric=metric, mode=METRIC_MODES[metric])
    for step, score in scores.items():
        manager.save(step, lambda folder: (folder / "w.bin").write_bytes(b"w"), score=score)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == kept
