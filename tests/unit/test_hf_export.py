"""`export` to the transformers format: the transformers model computes our logits and generates our tokens, the
tokenizer gives our ids and its chat template our training layout, for both architectures; errors a user can
cause are one message. CPU, float32, offline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
# Imports transformers offline (or skips this module without it); the fixtures, imported as themselves.
from export_helpers import gpt2_run as gpt2_run, one_thread as one_thread, tokenizer_dir as tokenizer_dir
from export_helpers import run_folder, tiny_model, transformers

from lowmem.cli import main
from lowmem.config import TrainConfig
from lowmem.tokenization.sentencepiece_tokenizer import Tokenizer
from lowmem.errors import ConfigError
from lowmem.hf import export_hf, tokenizer_files

PROMPTS = ["春风", "请写一首词：江南 spring rain, 3 lines.", "Write a poem of the moon and the river 千里 in 2 lines."]
# Strings of every kind the tokenizers must agree on.
TEXTS = [
    "春风明月江南", "Write a poem of the moon.", "mixed 中文 and English 123 4567", "  two  spaces  ",
    " leading space", "trailing space ", "tabs\tand\nnew\nlines\r\n", "digits 0123456789 and 2024-05-01",
    "emoji 😀 and rare 龘𠀋 characters", "a<sep>b", "<sep> at the start", "full-width ，。！？ punctuation", "▁marker",
    "", "x",
]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def exported(request, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Our model, the transformers model and tokenizer loaded from its export, and our tokenizer."""
    tokenizer = Tokenizer.load(tokenizer_dir)
    model = tiny_model(tokenizer.vocab_size, request.param)
    tmp = tmp_path_factory.mktemp(f"export-{request.param}")
    config = run_folder(tmp, model, tokenizer_dir)
    assert main(["export", str(tmp / "hf"), f"--output_dir={config.output_dir}"]) == 0
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf", output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp / "hf")
    return model, hf_model.eval(), hf_tokenizer, tokenizer, tmp / "hf"


def _chat_ids(hf_tokenizer, prompt: str, response: str | None = None) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    if response is not None:
        messages.append({"role": "assistant", "content": response})
    # return_dict=False: the ids as a list (transformers 5 returns a dict by default, 4.x a list).
    return list(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=response is None, return_dict=False))


def _padded(rows: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths padded with id 0, and the attention mask (1 on real tokens)."""
    width = max(len(row) for row in rows)
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span], mask[i, span] = torch.tensor(row), 1
    return ids, mask


def test_the_folder_holds_the_transformers_files(exported):
    model, hf_model, _, _, out = exported
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    expected = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[model.config.architecture]
    assert type(hf_model).__name__ == expected
    assert json.loads((out / "config.json").read_text())["architectures"] == [expected]
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 0)
    assert generation["do_sample"] is False and generation["max_new_tokens"] == TrainConfig().eval_max_new_tokens
    # The embedding is cropped to the tokenizer's vocabulary (ours is padded to a multiple of 64) and tied.
    assert hf_model.get_input_embeddings().weight.shape == (model.config.vocab_size, model.config.n_embd)
    assert hf_model.get_output_embeddings().weight.data_ptr() == hf_model.get_input_embeddings().weight.data_ptr()


def test_logits_match(exported):
    model, hf_model, _, tokenizer, _ = exported
    rows = [tokenizer.encode_pair(p, "回答 answer")[0] for p in PROMPTS]
    assert len({len(row) for row in rows}) == 3
    ids, mask = _padded(rows, left=False)
    with torch.no_grad():
        theirs = hf_model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
        for i, row in enumerate(rows):
            ours = model(torch.tensor([row]))[0][0, :, : model.config.vocab_size]  # (T, V): the real rows only
            torch.testing.assert_close(theirs[i, : len(row)], ours, atol=1e-4, rtol=0)


def _until_eos(ids: list[int]) -> list[int]:
    return ids[: ids.index(2) + 1] if 2 in ids else ids


def test_greedy_generation_matches(exported):
    model, hf_model, hf_tokenizer, tokenizer, _ = exported
    prompts = [tokenizer.encode_pair(p, None)[0] for p in PROMPTS]
    assert [_chat_ids(hf_tokenizer, p) for p in PROMPTS] == prompts
    ours_alone, theirs_alone = [], []
    for row in prompts:
        ours = model.generate(torch.tensor([row]), max_new_tokens=32, greedy=True, eos_id=2)[0, len(row):]
        theirs = hf_model.generate(torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long),
                                   do_sample=False, max_new_tokens=32)[0, len(row):]
        ours_alone.append(_until_eos(ours.tolist()))
        theirs_alone.append(_until_eos(theirs.tolist()))
    assert theirs_alone == ours_alone
    assert all(len(set(answer)) >= 4 for answer in ours_alone), ours_alone  # not one token repeated: it can fail

    # A batch of left-padded prompts of different lengths: each row as alone, both ways.
    ids, mask = _padded(prompts, left=True)
    lengths = torch.tensor([len(row) for row in prompts])
    ours = model.generate(ids, max_new_tokens=32, greedy=True, eos_id=2, prompt_lengths=lengths)[:, ids.size(1):]
    theirs = hf_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=32)[:, ids.size(1):]
    assert [_until_eos(row) for row in theirs.tolist()] == [_until_eos(row) for row in ours.tolist()] == ours_alone


def test_the_tokenizer_gives_our_ids(exported):
    _, _, hf_tokenizer, tokenizer, _ = exported
    for text in TEXTS + PROMPTS:
        ids = tokenizer.encode(text)
        assert hf_tokenizer.encode(text, add_special_tokens=False) == ids, text
        assert hf_tokenizer(text)["input_ids"] == ids, text  # nothing added around a text
        assert hf_tokenizer.decode(ids) == tokenizer.decode(ids), text
    assert tokenizer.encode("<sep>") == [4] == hf_tokenizer.encode("<sep>", add_special_tokens=False)
    # Byte-fallback pieces: a character outside the vocabulary, and an answer cut inside one, decode alike.
    emoji = tokenizer.encode("😀")
    assert len(emoji) == 4 and hf_tokenizer.decode(emoji[:2]) == tokenizer.decode(emoji[:2])


def test_documented_differences_of_the_tokenizer(exported):
    """The README lists these: transformers reads special tokens in text; its decode keeps <s>, </s>, <pad>."""
    _, _, hf_tokenizer, tokenizer, _ = exported
    for special, special_id in (("<s>", 1), ("</s>", 2), ("<pad>", 0), ("<unk>", 3)):
        text = f"a {special} b"
        assert special_id not in tokenizer.encode(text)  # ours: plain text
        assert special_id in hf_tokenizer.encode(text, add_special_tokens=False)  # theirs: the special token
    ids = tokenizer.encode_pair("春风", "明月")[0]  # [bos] ... [sep] ... [eos]
    assert tokenizer.decode(ids) == "春风<sep>明月"
    assert hf_tokenizer.decode(ids) == "<s>春风<sep>明月</s>"
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == "春风明月"  # <sep> is special there too


def test_the_chat_template_is_the_training_layout(exported):
    _, _, hf_tokenizer, tokenizer, _ = exported
    for prompt in PROMPTS + ["<sep>", " x "]:
        assert _chat_ids(hf_tokenizer, prompt) == tokenizer.encode_pair(prompt, None)[0]
        assert _chat_ids(hf_tokenizer, prompt, "明月 moon") == tokenizer.encode_pair(prompt, "明月 moon")[0]
    user = {"role": "user", "content": "春风"}
    for conversation in ([{"role": "system", "content": "be brief"}, user],
                         [user, {"role": "assistant", "content": "明月"}, user]):
        with pytest.raises(Exception, match="single exchanges"):
            hf_tokenizer.apply_chat_template(conversation)


# ------------------------------------------------------------------------------------------------ errors


def test_refuses_an_out_that_is_not_empty_or_a_file(gpt2_run: TrainConfig, tmp_path: Path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty.*does not exist yet"):
        export_hf(gpt2_run, tmp_path / "full")
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        export_hf(gpt2_run, tmp_path / "file")
    (tmp_path / "empty").mkdir()
    assert (export_hf(gpt2_run, tmp_path / "empty") / "model.safetensors").is_file()  # an empty folder is taken


def test_no_model_or_no_transformers_is_one_message(gpt2_run: TrainConfig, tmp_path: Path, monkeypatch, capsys):
    assert main(["export", str(tmp_path / "out"), f"--output_dir={tmp_path / 'nothing'}"]) == 2
    assert "No trained model in" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ConfigError, match=r'pip install "transformers>=4\.46"'):
        export_hf(gpt2_run, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_that_would_differ_is_not_exported(gpt2_run: TrainConfig, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(tokenizer_files, "CHAT_TEMPLATE", "{{ messages[0]['content'] }}<sep>")  # no bos
    with pytest.raises(ConfigError, match="encodes differently.*chat template"):
        export_hf(gpt2_run, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_a_model_with_biases_exports_them(architecture, tokenizer_dir: Path, tmp_path: Path):
    """Biases (q, k and v split from one qkv bias; LayerNorm biases for gpt2) reach the exported model."""
    tokenizer = Tokenizer.load(tokenizer_dir)
    model = tiny_model(tokenizer.vocab_size, architecture, bias=True)
    config = run_folder(tmp_path, model, tokenizer_dir)
    assert main(["export", str(tmp_path / "hf"), f"--output_dir={config.output_dir}"]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    row = tokenizer.encode_pair(PROMPTS[0], "回答")[0]
    with torch.no_grad():
        theirs = hf_model(input_ids=torch.tensor([row])).logits[0]
        ours = model(torch.tensor([row]))[0][0, :, : model.config.vocab_size]
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
