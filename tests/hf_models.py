"""Small transformers model folders built in the tests, offline, from random weights: a Qwen2 (biases on q/k/v,
tied head, grouped-query attention) with a byte-level tokenizer and a ChatML template, a Llama (untied head,
grouped-query attention, Llama 3's rotary scaling) and a Mistral (a head size other than hidden / heads) with a
SentencePiece-style tokenizer and no chat template; and a model of Qwen2.5-0.5B's shapes written straight to
safetensors in bf16 (no transformers model in memory)."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import Any

import pytest

os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # before transformers is imported

# ChatML written with block tags on lines of their own, as Qwen's templates are: it renders right only with
# transformers' trim_blocks and lstrip_blocks.
CHATML_TEMPLATE = """{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""
# Qwen2's pre-tokenizer: contractions, letters with one leading non-letter, single digits, punctuation runs, newlines
# and spaces.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
_CHINESE = "春风明月江南归去相思落花流水千里故人长亭夜雨西楼山青云白酒醉梦天地日星河海草木鸟鱼书画琴棋诗词"
_ENGLISH = ["the", "spring", "wind", "moon", "river", "south", "flower", "water", "night", "rain", "poem", "write",
            "please", "a", "of", "and", "in", "old", "friend", "Hello,", "world!", "What", "is", "it?"]


def mixed_text(rng: random.Random) -> str:
    """A line of Chinese, English, digits and spaces."""
    chinese = "".join(rng.choices(_CHINESE, k=rng.randint(2, 10)))
    english = " ".join(rng.choices(_ENGLISH, k=rng.randint(1, 6)))
    return rng.choice([chinese, english, f"{chinese}，{english} {rng.randint(0, 999)}", f"{english}\t{chinese}。"])


def mixed_lines(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [mixed_text(rng) for _ in range(count)]


def qwen2_tokenizer(folder: Path, vocab_size: int = 600) -> int:
    """A Qwen2-like tokenizer saved in `folder` (byte-level BPE, no bos, <|endoftext|> as eos and pad, ChatML);
    returns its number of ids."""
    import transformers
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    # As Qwen2's tokenizer.json: its own split (digits one by one), then bytes (transformers 5's Qwen2Tokenizer
    # installs this pre-tokenizer whatever the file says).
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(mixed_lines(2000, seed=0), trainer)
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=CHATML_TEMPLATE)
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


def llama_tokenizer(folder: Path, vocab_size: int = 600) -> int:
    """A Llama-2-like tokenizer saved in `folder` (Metaspace BPE with byte fallback, bos <s> added before a text,
    eos </s>, unk <unk>, no pad, no chat template); returns its number of ids."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    backend.train_from_iterator(mixed_lines(2000, seed=1), trainer)
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials[:3]])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", backend.token_to_id("<s>"))])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                     unk_token="<unk>")
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


def _seeded_model(model_class: Any, config: Any, seed: int) -> Any:
    """`model_class(config)` initialised from `seed`, not from the process's global generator: otherwise the weights,
    and every value a test computes with them, depend on what ran before in that process (the test order, a worker's
    earlier tests), and a failure seen in CI does not reproduce alone."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class(config)


def _perturbed(model: Any, seed: int) -> Any:
    """A random model whose norms, biases and matrices are far from their initial values (ones, zeros, std 0.02):
    differences in how they are read then show in the logits."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if parameter.dim() == 1:
                parameter.add_(0.3 * noise)
            else:
                parameter.mul_(4.0).add_(0.02 * noise)
    return model.eval()


def qwen2_folder(folder: Path, seed: int = 0, extra_rows: int = 13, **sizes: Any) -> Path:
    """A Qwen2ForCausalLM folder: its tokenizer, config.json and model.safetensors (float32). The embedding has
    `extra_rows` rows more than the tokenizer has ids (as Qwen2.5's: 151,936 rows for 151,665 ids)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    ids = qwen2_tokenizer(folder)
    shape = {**dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512), **sizes}
    config = transformers.Qwen2Config(vocab_size=ids + extra_rows, eos_token_id=ids - 1, pad_token_id=ids - 3,
                                      **shape)
    _perturbed(_seeded_model(transformers.Qwen2ForCausalLM, config, seed), seed).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    """A tiny Qwen2 folder (`qwen2_folder`), made once per module that imports this fixture as itself."""
    return qwen2_folder(tmp_path_factory.mktemp("models") / "qwen2-tiny")


@pytest.fixture(scope="module")
def qwen_one_block(tmp_path_factory) -> Path:
    """`qwen` with one decoder block instead of two: for the tests that compile the model, where inductor's work
    grows with the blocks it traces (a mirrored DPO run took a fifth less) and one block is the same unit as two."""
    return qwen2_folder(tmp_path_factory.mktemp("models") / "qwen2-one-block", num_hidden_layers=1)


def mistral_folder(folder: Path, seed: int = 2, **sizes: Any) -> Path:
    """A MistralForCausalLM folder (untied head, 4 query heads over 2 key/value heads, a head size of its own) with
    the Llama-like tokenizer; `sizes` may set its sliding_window (none by default)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    ids = llama_tokenizer(folder)
    shape = {**dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, max_position_embeddings=512,
                    sliding_window=None), **sizes}
    config = transformers.MistralConfig(vocab_size=ids, bos_token_id=1, eos_token_id=2, **shape)
    _perturbed(_seeded_model(transformers.MistralForCausalLM, config, seed), seed).save_pretrained(folder)
    return folder


def llama_folder(folder: Path, seed: int = 1, **sizes: Any) -> Path:
    """A LlamaForCausalLM folder (untied head, 4 query heads over 2 key/value heads, Llama 3's rotary scaling)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    ids = llama_tokenizer(folder)
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=512, rope_theta=500000.0,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 128}, **sizes)
    config = transformers.LlamaConfig(vocab_size=ids, bos_token_id=1, eos_token_id=2, **shape)
    _perturbed(_seeded_model(transformers.LlamaForCausalLM, config, seed), seed).save_pretrained(folder)
    return folder


# Qwen2.5-0.5B's shapes (its config.json): 24 layers, 896 wide, 14 query heads over 2 key/value heads of 64,
# an MLP 4,864 wide, 151,936 embedding rows tied to the head: 494 M parameters, 988 MB in bf16.
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)


def qwen2_shapes(sizes: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen2 of `sizes` (a config.json's keys), under transformers' names, with its shape."""
    hidden, heads, kv, inner = (sizes["hidden_size"], sizes["num_attention_heads"], sizes["num_key_value_heads"],
                                sizes["intermediate_size"])
    head = hidden // heads
    shapes = {"model.embed_tokens.weight": (sizes["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if not sizes["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (sizes["vocab_size"], hidden)
    for i in range(sizes["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        shapes.update({f"{layer}.input_layernorm.weight": (hidden,),
                       f"{layer}.post_attention_layernorm.weight": (hidden,),
                       f"{layer}.self_attn.o_proj.weight": (hidden, heads * head),
                       f"{layer}.mlp.gate_proj.weight": (inner, hidden), f"{layer}.mlp.up_proj.weight": (inner, hidden),
                       f"{layer}.mlp.down_proj.weight": (hidden, inner)})
        for name, rows in (("q", heads * head), ("k", kv * head), ("v", kv * head)):
            shapes.update({f"{layer}.self_attn.{name}_proj.weight": (rows, hidden),
                           f"{layer}.self_attn.{name}_proj.bias": (rows,)})
    return shapes


def _write_qwen2_config(folder: Path, sizes: dict[str, Any]) -> None:
    """config.json as the hub's (transformers 4 keys), for bf16 weights of `sizes`."""
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
              "torch_dtype": "bfloat16", "use_sliding_window": False, "sliding_window": 32768, "bos_token_id": 151643,
              "eos_token_id": 151643, "rope_scaling": None, **sizes}
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def qwen25_half_billion_folder(folder: Path, seed: int = 0, layers: int = QWEN25_05B["num_hidden_layers"]) -> Path:
    """A folder of Qwen2.5-0.5B's shapes (or of its widths and vocabulary with `layers` of its 24 layers) with random
    bf16 weights, written tensor group by tensor group into one safetensors file as transformers names them, with a
    config.json as the hub's (transformers 4 keys) and the small Qwen2-like tokenizer (its ids fit the embedding's
    rows)."""
    import torch
    from safetensors.torch import save_file

    sizes = dict(QWEN25_05B, num_hidden_layers=layers)
    folder.mkdir(parents=True, exist_ok=True)
    qwen2_tokenizer(folder)
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: (torch.randn(shape, generator=generator) * (1.0 if len(shape) == 1 else 0.02)).to(torch.bfloat16)
               for name, shape in qwen2_shapes(sizes).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    _write_qwen2_config(folder, sizes)
    return folder


# The shapes of the models the reference host's plan is asked about (their config.json on the hub).
QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=False)


def sparse_qwen2_folder(folder: Path, sizes: dict[str, Any]) -> Path:
    """A Qwen2 folder of `sizes` whose weights file is a header and a hole: its tensors' bytes are never written (the
    file takes no disk), which is all a memory plan reads of it. Nothing can train from it."""
    import struct

    folder.mkdir(parents=True, exist_ok=True)
    qwen2_tokenizer(folder)
    shapes = qwen2_shapes(sizes)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)  # bf16
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(folder / "model.safetensors", "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        file.truncate(8 + len(encoded) + offset)  # a hole: no block of the tensors is written
    _write_qwen2_config(folder, sizes)
    return folder
