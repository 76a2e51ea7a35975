"""HFTokenizer: a transformers model folder's tokenizer read through `tokenizers`, checked against transformers itself.

Two tokenizers are built here from scratch (offline) and saved with transformers' `save_pretrained`:

    qwen2-like  byte-level BPE, no bos, eos <|endoftext|> (also pad), <|im_start|> <|im_end|> added, a ChatML
                template that inserts a default system message, a generation_config.json ending at either end token
    llama-like  Metaspace BPE with byte fallback (SentencePiece-style), bos <s>, eos </s>, unk <unk>, no pad, a
                post-processor that adds bos, no chat template (so lowmem's plain layout applies)

Every id list is compared with what `AutoTokenizer` gives for the same folder.
"""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hf_models import CHATML_TEMPLATE  # ChatML as Qwen writes it: block tags on lines of their own

from lowmem.tokenization.hf_tokenizer import (
    HF_TOKENIZER_FILES,
    PLAIN_CHAT_TEMPLATE,
    HFTokenizer,
    read_hf_tokenizer_files,
)
from lowmem.errors import ConfigError

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA_SPECIALS = ("<unk>", "<s>", "</s>")

CHINESE = ["今天天气很好", "我们一起去公园散步吧", "机器学习是人工智能的一个重要分支", "请把这本书放在桌子上",
           "学习一门新的语言需要耐心", "长江是中国最长的河流", "数据越多模型越好", "你能帮我解释这段代码吗",
           "晚饭以后奶奶喜欢喝茶", "春天来了花都开了"]
ENGLISH = ["The quick brown fox", "jumps over the lazy dog", "Machine learning needs data", "Hello, world!",
           "def add(a, b): return a + b", "Version 2.0 was released", "What is the capital of France?"]
PUNCTUATION = ["，", "。", "！", "？", ": ", "; ", ", ", ". "]
RARE = ["𠀀", "𪚥", "龘", "䶮", "😀", "🎉", "👍🏽", "é", "ß"]  # never in the training text: bytes or byte fallback
SPACES = [" ", "  ", "\t", "\n", " \n", "\n\n", "\t\t", "   "]


def _phrase(rng: random.Random) -> str:
    return rng.choice(CHINESE) + rng.choice(PUNCTUATION) + rng.choice(ENGLISH) + str(rng.randint(0, 99999))


def training_corpus(n: int = 1500, seed: int = 0) -> list[str]:
    """Mixed Chinese and ASCII lines, with spaces, tabs, newlines and digits, and no rare characters."""
    rng = random.Random(seed)
    return [_phrase(rng) + rng.choice(SPACES) + _phrase(rng) for _ in range(n)]


def ordinary_texts(n: int, seed: int) -> list[str]:
    """Texts unlike the training lines: every kind of whitespace at either end, rare CJK characters and emoji."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        parts = [_phrase(rng) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.5:
            parts.insert(rng.randrange(len(parts) + 1), rng.choice(RARE))
        text = rng.choice(SPACES + [""] * 8).join(parts)
        texts.append(rng.choice(["", "", " ", "\n", "\t"]) + text + rng.choice(["", "", " ", "\n", "  \n"]))
    return texts


def texts_with_specials(n: int, seed: int, specials: tuple[str, ...]) -> list[str]:
    """Texts with special-token strings inside them, which encode as the special tokens."""
    rng = random.Random(seed)
    return [_phrase(rng) + rng.choice(specials) + rng.choice(["", " ", "\n"]) + _phrase(rng) for _ in range(n)]


def _with_bos_null(folder: Path) -> None:
    """Qwen2.5's tokenizer_config.json says "bos_token": null; transformers 5 leaves the key out."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["bos_token"] = None
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


def _as_added_token_dicts(folder: Path, names: tuple[str, ...]) -> None:
    """Rewrite special tokens in tokenizer_config.json in the AddedToken form older Llama folders use."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    for name in names:
        config[name] = {"__type": "AddedToken", "content": config[name], "lstrip": False, "normalized": False,
                        "rstrip": False, "single_word": False, "special": True}
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


@pytest.fixture(scope="module")
def transformers_module() -> Any:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TRANSFORMERS_OFFLINE", "1")
        yield pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen_folder(transformers_module: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(training_corpus(), trainer)
    # After training, as in Qwen2: the special tokens take the last ids.
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in QWEN_SPECIALS])
    folder = tmp_path_factory.mktemp("qwen2-like")
    transformers_module.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=CHATML_TEMPLATE,
    ).save_pretrained(folder)
    _with_bos_null(folder)
    end_of_text, im_end = backend.token_to_id("<|endoftext|>"), backend.token_to_id("<|im_end|>")
    # As Qwen2.5-Instruct's: both end tokens, and a bos_token_id the tokenizer itself does not use.
    generation = {"bos_token_id": end_of_text, "pad_token_id": end_of_text, "eos_token_id": [im_end, end_of_text]}
    (folder / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def llama_folder(transformers_module: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = metaspace
    # Trained line by line, as SentencePiece is: no piece holds a newline, which byte fallback encodes.
    lines = [line for text in training_corpus() for line in text.split("\n")]
    trained.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                                           special_tokens=list(LLAMA_SPECIALS)))
    model = json.loads(trained.to_str())["model"]
    # SentencePiece's layout: the special pieces, the 256 byte pieces of byte fallback, then the learned pieces.
    learned = [piece for piece, _ in sorted(model["vocab"].items(), key=lambda item: item[1])
               if piece not in LLAMA_SPECIALS]
    pieces = [*LLAMA_SPECIALS, *(f"<0x{byte:02X}>" for byte in range(256)), *learned]
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ", 1)) for merge in model["merges"]]
    backend = Tokenizer(models.BPE({piece: i for i, piece in enumerate(pieces)}, merges, unk_token="<unk>",
                                   byte_fallback=True, fuse_unk=True))
    backend.pre_tokenizer = metaspace
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in LLAMA_SPECIALS])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    folder = tmp_path_factory.mktemp("llama-like")
    transformers_module.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
    ).save_pretrained(folder)
    _as_added_token_dicts(folder, ("bos_token", "eos_token", "unk_token"))
    return folder


@pytest.fixture(scope="module")
def llama_plain_folder(llama_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llama-like tokenizer with PLAIN_CHAT_TEMPLATE written into its tokenizer_config.json, as an export
    would write it, for transformers to render."""
    folder = tmp_path_factory.mktemp("llama-like-plain")
    for name, data in read_hf_tokenizer_files(llama_folder).items():
        (folder / name).write_bytes(data)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = PLAIN_CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def qwen(qwen_folder: Path) -> HFTokenizer:
    return HFTokenizer.load(qwen_folder)


@pytest.fixture(scope="module")
def llama(llama_folder: Path) -> HFTokenizer:
    return HFTokenizer.load(llama_folder)


@pytest.fixture(scope="module")
def hf_qwen(transformers_module: Any, qwen_folder: Path) -> Any:
    return transformers_module.AutoTokenizer.from_pretrained(qwen_folder)


@pytest.fixture(scope="module")
def hf_llama(transformers_module: Any, llama_plain_folder: Path) -> Any:
    return transformers_module.AutoTokenizer.from_pretrained(llama_plain_folder)


@pytest.fixture(params=["qwen2-like", "llama-like"])
def pair(request: pytest.FixtureRequest) -> tuple[HFTokenizer, Any, tuple[str, ...]]:
    """(ours, transformers', the special tokens) for each of the two tokenizers."""
    if request.param == "qwen2-like":
        return request.getfixturevalue("qwen"), request.getfixturevalue("hf_qwen"), QWEN_SPECIALS
    return request.getfixturevalue("llama"), request.getfixturevalue("hf_llama"), LLAMA_SPECIALS


def _generation_prompt(hf: Any, prompt: str, template: str | None = None) -> list[int]:
    return list(hf.apply_chat_template([{"role": "user", "content": prompt}], chat_template=template,
                                       add_generation_prompt=True, tokenize=True, return_dict=False))


PROMPTS = ordinary_texts(80, seed=1) + ["", " ", "\n", "请回答。", "  spaces around  ", "tab\tinside\n\nand lines",
                                        "中文 and English 123 😀 𠀀"]
RESPONSES = [text.strip() or "答" for text in ordinary_texts(len(PROMPTS), seed=2)]


# --------------------------------------------------------------------------------------------
# encode and decode
# --------------------------------------------------------------------------------------------


def test_encode_equals_transformers(pair: tuple[HFTokenizer, Any, tuple[str, ...]]) -> None:
    ours, hf, specials = pair
    texts = ordinary_texts(250, seed=3) + texts_with_specials(50, seed=4, specials=specials)
    expected = hf(texts, add_special_tokens=False)["input_ids"]
    assert [ours.encode(text) for text in texts] == expected
    assert ours.encode_batch(texts) == expected
    single_thread = pickle.loads(pickle.dumps(ours))
    single_thread.num_threads = 1
    assert single_thread.encode_batch(texts) == expected
    # The special-token strings became their tokens, not pieces of text.
    special_ids = {hf.convert_tokens_to_ids(token) for token in specials}
    assert all(special_ids & set(ids) for ids in expected[-50:])
    # Rare characters and emoji are in the texts, and encode without unknown tokens.
    assert any(any(c in text for c in RARE) for text in texts)
    assert all(ours.unk_id not in ids for ids in expected[:250])


def test_decode_round_trips(pair: tuple[HFTokenizer, Any, tuple[str, ...]]) -> None:
    ours, hf, _ = pair
    texts = ordinary_texts(250, seed=5)
    for text in texts:
        ids = ours.encode(text)
        decoded = ours.decode(ids)
        assert decoded == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(np.array(ids)) == decoded and ours.decode(torch.tensor(ids)) == decoded
        # The llama-like one loses a leading space, as its transformers counterpart does: Metaspace puts no "▁"
        # before a text that starts with one, and the decoder strips the first.
        assert decoded == (text[1:] if text.startswith(" ") and not ours.template_from_source else text)
    # Special tokens are left out of the text.
    assert ours.decode([ours.eos_id, *ours.encode("你好"), ours.eos_id]) == "你好"


def test_decode_skips_ids_past_the_vocabulary(pair: tuple[HFTokenizer, Any, tuple[str, ...]]) -> None:
    ours, hf, _ = pair
    assert ours.vocab_size == len(hf)
    ids = ours.encode("模型 model")
    padded = [*ids, ours.vocab_size, ours.vocab_size + 63, -100]
    assert ours.decode(padded) == "模型 model"
    assert ours.decode(torch.tensor(padded)) == "模型 model"


# --------------------------------------------------------------------------------------------
# The chat layout
# --------------------------------------------------------------------------------------------


def test_generation_prompt_equals_apply_chat_template(pair: tuple[HFTokenizer, Any, tuple[str, ...]]) -> None:
    ours, hf, specials = pair
    prompts = PROMPTS + texts_with_specials(10, seed=6, specials=specials)
    for prompt in prompts:
        ids, start = ours.encode_pair(prompt, None)
        assert ids == _generation_prompt(hf, prompt), prompt
        assert start == len(ids)


def test_plain_layout_is_its_template(llama: HFTokenizer, llama_plain_folder: Path, hf_llama: Any) -> None:
    """The llama-like folder has no template: lowmem's plain layout applies, and PLAIN_CHAT_TEMPLATE written into
    tokenizer_config.json gives transformers users the same ids."""
    assert not llama.template_from_source
    assert llama.chat_template == PLAIN_CHAT_TEMPLATE
    assert "plain chat layout" in llama.describe()
    ids, start = llama.encode_pair("写一首诗", None)
    # After <s>, the text gets no "▁" in front: it does not start the encoded string.
    assert ids == llama.encode("<s>写一首诗\n") and ids[0] == llama.bos_id and start == len(ids)
    from_template = HFTokenizer.load(llama_plain_folder)
    assert from_template.template_from_source
    for prompt, response in zip(PROMPTS, RESPONSES):
        assert from_template.encode_pair(prompt, response) == llama.encode_pair(prompt, response)
    full = hf_llama.apply_chat_template([{"role": "user", "content": "问题"}, {"role": "assistant", "content": "答案"}],
                                        tokenize=True, return_dict=False)
    assert llama.encode_pair("问题", "答案")[0] == list(full)


def test_pair_layout(pair: tuple[HFTokenizer, Any, tuple[str, ...]]) -> None:
    ours, hf, _ = pair
    turn_end = [hf.convert_tokens_to_ids("<|im_end|>"), *ours.encode("\n")] if ours.template_from_source \
        else [ours.eos_id]
    for prompt, response in zip(PROMPTS, RESPONSES):
        ids, start = ours.encode_pair(prompt, response)
        assert ids[:start] == _generation_prompt(hf, prompt)
        assert ids[len(ids) - len(turn_end):] == turn_end
        assert ours.decode(ids[start:len(ids) - len(turn_end)]) == response
        # The whole exchange is what transformers encodes for the conversation (no token spans the boundary
        # between prompt and response for these responses).
        conversation = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        assert ids == list(hf.apply_chat_template(conversation, tokenize=True, return_dict=False))


def test_batches_equal_single_rows(pair: tuple[HFTokenizer, Any, tuple[str, ...]]) -> None:
    ours, _, _ = pair
    prompts = PROMPTS[:30]
    responses: list[str | None] = [None if i % 4 == 0 else "" if i % 7 == 0 else r
                                   for i, r in enumerate(RESPONSES[:30])]
    assert ours.encode_pair_batch(prompts, responses) == [ours.encode_pair(p, r) for p, r in zip(prompts, responses)]
    assert ours.encode_text_batch(prompts) == [ours.encode_text(text) for text in prompts]
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        ours.encode_pair_batch(["a", "b"], ["c"])


def _with_template(folder: Path, template: str) -> HFTokenizer:
    files = read_hf_tokenizer_files(folder)
    files["chat_template.jinja"] = template.encode("utf-8")
    return HFTokenizer(files, source=str(folder))


@pytest.mark.parametrize("change, per_row", [
    ("| upper", True),    # changes the content: rendered per row
    ("| trim", False),    # trims it (as Llama 2 and 3 do): still composed from the pieces
])
def test_templates_that_change_the_content(qwen_folder: Path, hf_qwen: Any, change: str, per_row: bool) -> None:
    template = CHATML_TEMPLATE.replace("{{ message['content'] }}", "{{ message['content'] " + change + " }}")
    ours = _with_template(qwen_folder, template)
    assert ("rendered per row" in ours.describe()) == per_row
    rows = []
    for prompt, response in zip(PROMPTS[:40], RESPONSES[:40]):
        assert ours.encode_pair(prompt, None)[0] == _generation_prompt(hf_qwen, prompt, template)
        # Rendered per row by transformers: the response part is what follows the generation prompt.
        user = [{"role": "user", "content": prompt}]
        generation = hf_qwen.apply_chat_template(user, chat_template=template, add_generation_prompt=True,
                                                 tokenize=False)
        full = hf_qwen.apply_chat_template([*user, {"role": "assistant", "content": response}],
                                           chat_template=template, tokenize=False)
        assert full.startswith(generation)
        expected = ours.encode(generation) + ours.encode(full[len(generation):])
        assert ours.encode_pair(prompt, response) == (expected, len(ours.encode(generation)))
        rows.append((prompt, response))
    assert ours.encode_pair_batch(*zip(*rows)) == [ours.encode_pair(p, r) for p, r in rows]


def test_empty_content_is_rendered_for_real(qwen_folder: Path, hf_qwen: Any) -> None:
    """The probes never show what a template does with empty content: empty rows are rendered, not composed."""
    content = "{% if message['content'] %}{{ message['content'] }}{% else %}(empty){% endif %}"
    template = CHATML_TEMPLATE.replace("{{ message['content'] }}", content)
    ours = _with_template(qwen_folder, template)
    assert "rendered per row" not in ours.describe()
    assert ours.encode_pair("", None)[0] == _generation_prompt(hf_qwen, "", template)
    ids, start = ours.encode_pair("问", "")
    assert ours.decode(ids[start:]) == "(empty)\n"


def test_template_whose_conversation_does_not_start_with_its_generation_prompt(qwen_folder: Path,
                                                                                hf_qwen: Any) -> None:
    # The generation prompt opens a reasoning block that a finished answer does not show.
    template = CHATML_TEMPLATE.replace("<|im_start|>assistant\n{% endif %}",
                                       "<|im_start|>assistant\n<think>\n{% endif %}")
    assert template != CHATML_TEMPLATE
    ours = _with_template(qwen_folder, template)
    assert "rendered per row" in ours.describe()
    for prompt, response in zip(PROMPTS[:10], RESPONSES[:10]):
        ids, start = ours.encode_pair(prompt, response)
        assert ids[:start] == _generation_prompt(hf_qwen, prompt, template)
        assert ours.decode(ids[start:]) == response + "\n"


# --------------------------------------------------------------------------------------------
# Special ids, the text layout, the description
# --------------------------------------------------------------------------------------------


def test_qwen2_like_special_ids(qwen: HFTokenizer, hf_qwen: Any) -> None:
    end_of_text, im_end = (hf_qwen.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>"))
    assert qwen.bos_id is None  # "bos_token": null wins over generation_config.json's bos_token_id
    assert qwen.eos_id == end_of_text == hf_qwen.eos_token_id
    assert qwen.pad_id == end_of_text == hf_qwen.pad_token_id
    assert qwen.unk_id is None
    assert set(qwen.stop_ids) == {im_end, end_of_text}
    assert qwen.vocab_size == len(hf_qwen) == max(hf_qwen.get_vocab().values()) + 1
    assert qwen.template_from_source and "<|im_start|>system" in qwen.chat_template
    # Without generation_config.json, the token that ends the assistant's turn in the template still stops.
    files = read_hf_tokenizer_files(qwen.source)
    del files["generation_config.json"]
    assert HFTokenizer(files).stop_ids == (end_of_text, im_end)
    assert qwen.encode_text("你好") == ([*qwen.encode("你好"), end_of_text], 0)
    assert qwen.encode_text("你好", finished=False) == (qwen.encode("你好"), 0)
    description = qwen.describe()
    assert description.startswith(f"tokenizer.json, {len(hf_qwen):,} ids, chat template from the source, ")
    assert "eos <|endoftext|>, pad <|endoftext|>, no bos" in description and "<|im_end|>" in description
    assert "rendered per row" not in description


def test_llama_like_special_ids(llama: HFTokenizer, hf_llama: Any) -> None:
    assert (llama.bos_id, llama.eos_id, llama.unk_id) == (1, 2, 0)
    assert (hf_llama.bos_token_id, hf_llama.eos_token_id, hf_llama.unk_token_id) == (1, 2, 0)
    assert hf_llama.pad_token is None and llama.pad_id == llama.unk_id  # no pad token: unk pads
    assert llama.stop_ids == (2,)
    assert llama.vocab_size == len(hf_llama)
    text_ids = llama.encode("今天 good")
    assert llama.encode_text("今天 good") == ([1, *text_ids, 2], 1)
    assert llama.encode_text("今天 good", finished=False) == ([1, *text_ids], 1)
    # The layout of a text is what transformers' post-processor makes of it, plus eos.
    assert hf_llama("今天 good")["input_ids"] == [1, *text_ids]
    assert "bos <s>" in llama.describe() and "eos </s>, pad <unk>" in llama.describe()


def test_settings_of_the_files_that_transformers_overrides(qwen_folder: Path, llama_folder: Path,
                                                          transformers_module: Any, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    # Padding and truncation saved in tokenizer.json: transformers applies them per call only, so do we.
    files = read_hf_tokenizer_files(qwen_folder)
    backend = Tokenizer.from_str(files["tokenizer.json"].decode())
    backend.enable_padding(pad_id=backend.token_to_id("<|endoftext|>"), pad_token="<|endoftext|>")
    backend.enable_truncation(max_length=4)
    texts = ordinary_texts(10, seed=9)
    plain = HFTokenizer(files).encode_batch(texts)
    assert HFTokenizer({**files, "tokenizer.json": backend.to_str().encode()}).encode_batch(texts) == plain
    assert max(map(len, plain)) > 4 and len(set(map(len, plain))) > 1
    # A special token that tokenizer_config.json names but tokenizer.json lacks: transformers adds it.
    for name, data in read_hf_tokenizer_files(llama_folder).items():
        (tmp_path / name).write_bytes(data)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["pad_token"] = "<pad>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    hf = transformers_module.AutoTokenizer.from_pretrained(tmp_path)
    ours = HFTokenizer.load(tmp_path)
    assert ours.pad_id == hf.pad_token_id == len(hf) - 1
    assert ours.vocab_size == len(hf)
    assert ours.encode("a<pad>b") == hf("a<pad>b", add_special_tokens=False)["input_ids"]


def test_pickles(qwen: HFTokenizer, llama: HFTokenizer) -> None:
    for ours in (qwen, llama):
        copy = pickle.loads(pickle.dumps(ours))
        texts = ordinary_texts(20, seed=7)
        assert copy.encode_batch(texts) == ours.encode_batch(texts)
        assert copy.encode_pair_batch(texts, texts) == ours.encode_pair_batch(texts, texts)
        assert (copy.vocab_size, copy.stop_ids, copy.num_threads) == (ours.vocab_size, ours.stop_ids, ours.num_threads)
        assert repr(copy) == repr(ours) and "vocab_size=" in repr(ours)


@pytest.mark.skipif(not hasattr(os, "fork") or "TOKENIZERS_PARALLELISM" in os.environ,
                    reason="needs fork, and TOKENIZERS_PARALLELISM left to lowmem")
def test_a_forked_child_does_not_use_the_thread_pool(qwen: HFTokenizer) -> None:
    """After a batch on the library's thread pool, a forked child (a DataLoader worker) inherits
    TOKENIZERS_PARALLELISM=false, which keeps it off the pool without the library's warning; the parent keeps
    its pool."""
    pooled = pickle.loads(pickle.dumps(qwen))
    pooled.num_threads = 2
    texts = ordinary_texts(50, seed=8)
    expected = pooled.encode_batch(texts)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it sees, then leave without running pytest's teardown
        try:
            same = pooled.encode_batch(texts) == expected
            os.write(write_end, f"{os.environ.get('TOKENIZERS_PARALLELISM')} {same}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    seen = os.read(read_end, 100).decode()
    os.close(read_end)
    os.waitpid(pid, 0)
    assert seen == "false True"
    assert "TOKENIZERS_PARALLELISM" not in os.environ


# --------------------------------------------------------------------------------------------
# Files and errors
# --------------------------------------------------------------------------------------------


def test_read_hf_tokenizer_files(qwen_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    for name, data in read_hf_tokenizer_files(qwen_folder).items():
        (folder / name).write_bytes(data)
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "config.json").write_text("{}")
    files = read_hf_tokenizer_files(folder)
    assert sorted(files) == sorted(["tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                    "generation_config.json"])
    assert set(files) <= set(HF_TOKENIZER_FILES)
    assert files["tokenizer.json"] == (qwen_folder / "tokenizer.json").read_bytes()
    # A tokenizer built from the files alone is the folder's.
    assert HFTokenizer(files).encode_pair("问", "答") == HFTokenizer.load(qwen_folder).encode_pair("问", "答")
    assert HFTokenizer.load(folder / "tokenizer.json").describe() == HFTokenizer.load(qwen_folder).describe()


def test_a_folder_without_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x05not a sentencepiece model")
    with pytest.raises(ConfigError, match="has no tokenizer.json") as raised:
        HFTokenizer.load(tmp_path)
    message = str(raised.value)
    assert "tokenizer.model" in message and "save_pretrained" in message and "\n" not in message
    (tmp_path / "tokenizer.model").unlink()
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("")
    with pytest.raises(ConfigError, match="vocab.json or merges.txt"):
        read_hf_tokenizer_files(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        HFTokenizer.load(tmp_path / "missing")


def test_unreadable_files(qwen_folder: Path, tmp_path: Path) -> None:
    files = read_hf_tokenizer_files(qwen_folder)
    (tmp_path / "tokenizer.json").write_bytes(files["tokenizer.json"][: len(files["tokenizer.json"]) // 2])
    with pytest.raises(ConfigError, match=f"'{tmp_path / 'tokenizer.json'}' could not be read"):
        HFTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(files["tokenizer.json"])
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer_config.json' is not valid JSON"):
        HFTokenizer.load(tmp_path)
    (tmp_path / "tokenizer_config.json").write_bytes(files["tokenizer_config.json"])
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ConfigError, match="chat_template.jinja' is not valid Jinja"):
        HFTokenizer.load(tmp_path)


def test_templates_that_raise(llama: HFTokenizer, qwen_folder: Path) -> None:
    # The plain layout refuses what it was not made for, with its own words.
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ConfigError, match="trained on single exchanges"):
        llama.render_chat(two_users)
    # A model template that refuses the one-exchange conversation every row is: refused at load.
    refusing = "{% if messages | length < 2 or messages[1]['role'] != 'user' %}" \
               "{{ raise_exception('Two user messages are needed') }}{% endif %}"
    with pytest.raises(ConfigError, match="Two user messages are needed"):
        _with_template(qwen_folder, refusing)
    # The sandbox stays shut: a template cannot reach Python's internals.
    with pytest.raises(ConfigError, match="access to attribute '__class__' of 'list' object is unsafe"):
        _with_template(qwen_folder, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ConfigError, match="may not set '_x' on a namespace"):
        _with_template(qwen_folder, "{% set ns = namespace() %}{% set ns._x = 1 %}{{ messages[0]['content'] }}")
