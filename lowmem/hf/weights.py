"""Our model in transformers' terms: the config of the matching transformers class, and the weights renamed.

    architecture  transformers class  what changes on the way
    gpt2          GPT2LMHeadModel     Linear (out, in) -> Conv1D (in, out): every matrix transposed; biases
                                      written as zeros when the model has none (GPT2 always has them)
    llama         LlamaForCausalLM    the fused qkv rows split into q_proj, k_proj, v_proj; nothing
                                      transposed; rotary needs no permutation (ours is HF's "rotate half")

A model started from a transformers model (`GPTConfig.transformers_config`) goes back to its own class with every
key of the source's config.json (a Qwen2 stays a Qwen2, with its biases; its key/value heads, untied head, rotary
scaling and context are kept); `lowmem.hf.weight_map` is the way in.

The output layer is tied to the token embedding unless the model has its own, and both are cropped to the
`vocab_size` rows: the rows that pad a model trained here to a multiple of 64 are never produced by our `generate`
and mean nothing.

Nothing here imports transformers: these are plain dicts and tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from lowmem.tokenization.sentencepiece_tokenizer import BOS_ID, EOS_ID, PAD_ID
from lowmem.model import GPTConfig

TRANSFORMERS_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}


def hf_config(config: GPTConfig, special_ids: dict[str, Any] | None = None) -> dict[str, Any]:
    """The transformers config (the keys of its config.json) of the model `config` describes; `special_ids` are the
    tokenizer's bos/eos/pad ids (lowmem's own when not given)."""
    ids = special_ids or {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    if config.transformers_config:
        return _source_config(config, ids)
    shared = {"architectures": [TRANSFORMERS_CLASSES[config.architecture]], "vocab_size": config.vocab_size,
              "tie_word_embeddings": True, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
              "use_cache": True}
    if config.architecture == "gpt2":
        return {"model_type": "gpt2", **shared, "n_positions": config.max_seq_len,
                "n_ctx": config.max_seq_len,  # not read by transformers; llama.cpp's converter reads it
                "n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head,
                "n_inner": 4 * config.n_embd,
                "activation_function": "gelu",  # exact (erf) GELU, as nn.GELU(); "gelu_new" would be the tanh one
                "layer_norm_epsilon": config.norm_eps, "resid_pdrop": config.dropout, "embd_pdrop": config.dropout,
                "attn_pdrop": config.dropout, "scale_attn_weights": True,  # 1/sqrt(head_dim), as SDPA's default
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    return {"model_type": "llama", **shared, "hidden_size": config.n_embd, "intermediate_size": config.mlp_hidden,
            "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
            "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim, "hidden_act": "silu",
            "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
            # transformers 5 reads rope_parameters; 4.x reads rope_theta (5 moves it into rope_parameters).
            "rope_theta": config.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
            "attention_bias": config.bias, "mlp_bias": config.bias, "attention_dropout": config.dropout}


# Keys of a source's config.json that describe the saved file rather than the model: transformers writes its own.
_FILE_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype")


def _source_config(config: GPTConfig, ids: dict[str, Any]) -> dict[str, Any]:
    """The source's config.json as it was, with what a lowmem run may change: the weights are float32, and the
    special ids are the tokenizer's."""
    source = {key: value for key, value in (config.transformers_config or {}).items() if key not in _FILE_KEYS}
    given_ids = {key: value for key, value in ids.items() if value is not None}
    return {**source, **given_ids, "vocab_size": config.vocab_size, "tie_word_embeddings": config.tie_embeddings,
            "torch_dtype": "float32"}


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the transformers checkpoint: its name and shape there, and how it is made from ours: a slice of
    the rows of our tensor `source` (all of them by default), transposed (GPT-2's Conv1D) or not; zeros where
    `source` is None (a bias transformers' class has and ours has not)."""

    name: str
    shape: tuple[int, ...]
    source: str | None
    rows: tuple[int, int] | None = None
    transpose: bool = False

    def value(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The tensor, float32, from `read(name)` of our tensors."""
        if self.source is None:
            return torch.zeros(self.shape)
        values = read(self.source).float()
        if self.rows is not None:
            values = values[self.rows[0]:self.rows[1]]
        if self.transpose:
            values = values.t()
        return values.contiguous()

    def slices(self, read_rows: Callable[[str, int, int], torch.Tensor], read: Callable[[str], torch.Tensor],
               chunk_bytes: int) -> Iterator[torch.Tensor]:
        """The tensor in slices of its rows, float32, about `chunk_bytes` each: from `read_rows(name, start, stop)` of
        our tensors, so that neither ours nor theirs is ever whole in memory; a transposed one (GPT-2's Conv1D, small
        models only) whole, from `read(name)`."""
        if self.source is None or self.transpose or not self.shape:
            yield self.value(read)
            return
        first = self.rows[0] if self.rows is not None else 0
        row_bytes = 4 * max(1, int(torch.Size(self.shape[1:]).numel()))
        step = max(1, chunk_bytes // row_bytes)
        for start in range(0, self.shape[0], step):
            stop = min(self.shape[0], start + step)
            yield read_rows(self.source, first + start, first + stop).float().contiguous()


def hf_tensors(shapes: dict[str, tuple[int, ...]], config: GPTConfig, with_tied_head: bool = False) -> list[HFTensor]:
    """The tensors of the transformers checkpoint of our weights (`shapes`: the names of `model.safetensors`, tied ones
    stored once), in order. A tied head is left out, as transformers' own files leave it (`with_tied_head` lists it
    too, for a `load_state_dict(strict=True)`)."""
    embedding = "tok_emb.weight" if "tok_emb.weight" in shapes else "lm_head.weight"  # one name of the tied pair
    V, C = config.vocab_size, config.n_embd
    crop = (0, V)  # the rows that pad a model trained here to a multiple of 64 are dropped
    embed_name = "transformer.wte.weight" if config.architecture == "gpt2" else "model.embed_tokens.weight"
    tensors = [HFTensor(embed_name, (V, C), embedding, crop)]
    tensors += _gpt2_tensors(shapes, config) if config.architecture == "gpt2" else _llama_tensors(shapes, config)
    if not config.tie_embeddings:
        tensors.append(HFTensor("lm_head.weight", (V, C), "lm_head.weight", crop))
    elif with_tied_head:
        tensors.append(HFTensor("lm_head.weight", (V, C), embedding, crop))
    return tensors


def hf_state_dict(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our weights (the names of `model.safetensors`, tied ones stored once) under transformers' names, float32.

    The output layer is included under its own name, the same values as the embedding where tied, so that the result
    loads into the transformers model with `strict=True`.
    """
    shapes = {name: tuple(tensor.shape) for name, tensor in state.items()}
    return {tensor.name: tensor.value(state.__getitem__) for tensor in hf_tensors(shapes, config, with_tied_head=True)}


def _gpt2_tensors(shapes: dict[str, tuple[int, ...]], config: GPTConfig) -> list[HFTensor]:
    C = config.n_embd
    tensors = [HFTensor("transformer.wpe.weight", shapes["pos_emb.weight"], "pos_emb.weight")]

    def conv1d(hf_name: str, ours_name: str, out_features: int) -> None:
        """A Linear's (out, in) weight as Conv1D's (in, out), and its bias (zeros where we have none)."""
        in_features = shapes[f"{ours_name}.weight"][1]
        tensors.append(HFTensor(f"{hf_name}.weight", (in_features, out_features), f"{ours_name}.weight",
                                transpose=True))
        bias = f"{ours_name}.bias"
        tensors.append(HFTensor(f"{hf_name}.bias", (out_features,), bias if bias in shapes else None))

    def layer_norm(hf_name: str, ours_name: str) -> None:
        tensors.append(HFTensor(f"{hf_name}.weight", (C,), f"{ours_name}.weight"))
        bias = f"{ours_name}.bias"
        tensors.append(HFTensor(f"{hf_name}.bias", (C,), bias if bias in shapes else None))

    for i in range(config.n_layer):
        h, b = f"transformer.h.{i}", f"blocks.{i}"
        layer_norm(f"{h}.ln_1", f"{b}.ln_1")
        conv1d(f"{h}.attn.c_attn", f"{b}.attn.qkv", 3 * C)  # columns [q | k | v], as our rows
        conv1d(f"{h}.attn.c_proj", f"{b}.attn.out_proj", C)
        layer_norm(f"{h}.ln_2", f"{b}.ln_2")
        conv1d(f"{h}.mlp.c_fc", f"{b}.mlp.fc", 4 * C)
        conv1d(f"{h}.mlp.c_proj", f"{b}.mlp.out_proj", C)
    layer_norm("transformer.ln_f", "ln_f")
    return tensors


def _llama_tensors(shapes: dict[str, tuple[int, ...]], config: GPTConfig) -> list[HFTensor]:
    tensors: list[HFTensor] = []

    def copy(hf_name: str, ours_name: str) -> None:
        """Weight and, where we have one, bias, under the new name (RMSNorm has no bias, Linear has with bias=True)."""
        for kind in ("weight", "bias"):
            if f"{ours_name}.{kind}" in shapes:
                tensors.append(HFTensor(f"{hf_name}.{kind}", shapes[f"{ours_name}.{kind}"], f"{ours_name}.{kind}"))

    q_rows, kv_rows = config.n_head * config.head_dim, config.kv_heads * config.head_dim
    for i in range(config.n_layer):
        h, b = f"model.layers.{i}", f"blocks.{i}"
        copy(f"{h}.input_layernorm", f"{b}.ln_1")
        for kind in ("weight", "bias"):
            fused = f"{b}.attn.qkv.{kind}"
            if fused in shapes:
                # Rows [q; k; v]: n_head x head size, then n_kv_head x head size twice.
                start = 0
                for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
                    tensors.append(HFTensor(f"{h}.self_attn.{name}.{kind}", (rows, *shapes[fused][1:]), fused,
                                            (start, start + rows)))
                    start += rows
        copy(f"{h}.self_attn.o_proj", f"{b}.attn.out_proj")
        copy(f"{h}.post_attention_layernorm", f"{b}.ln_2")
        copy(f"{h}.mlp.gate_proj", f"{b}.mlp.gate")
        copy(f"{h}.mlp.up_proj", f"{b}.mlp.up")
        copy(f"{h}.mlp.down_proj", f"{b}.mlp.out_proj")
    copy("model.norm", "ln_f")
    return tensors
