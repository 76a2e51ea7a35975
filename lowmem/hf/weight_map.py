"""Where each of our parameters comes from in a transformers checkpoint: the names to read, the reverse of
`lowmem.hf.weights` (which writes ours under transformers' names).

    ours                           LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM
    tok_emb.weight                 model.embed_tokens.weight
    blocks.i.ln_1                  model.layers.i.input_layernorm
    blocks.i.attn.qkv              model.layers.i.self_attn.{q,k,v}_proj, stacked as rows [q; k; v]
    blocks.i.attn.out_proj         model.layers.i.self_attn.o_proj
    blocks.i.ln_2                  model.layers.i.post_attention_layernorm
    blocks.i.mlp.{gate,up,out_proj} model.layers.i.mlp.{gate,up,down}_proj
    ln_f                           model.norm
    lm_head.weight                 lm_head.weight (a tied model reads the embedding; a copy in the file is skipped)

    GPT2LMHeadModel (lowmem's export): transformer.{wte,wpe,h.i,ln_f}, each Conv1D matrix transposed back.

Nothing is copied here: these are names, read by `lowmem.source.load`, one slice of rows at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowmem.model import GPTConfig

# Buffers some checkpoints store beside the weights, which the models recompute: never weights, never an error.
NOT_WEIGHTS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


@dataclass(frozen=True)
class WeightSource:
    """The file tensors one of our parameters is made of: `names` stacked along the first dimension (one name for
    most), transposed first when `transpose` (GPT-2's Conv1D stores (in, out) where our Linear has (out, in))."""

    names: tuple[str, ...]
    transpose: bool = False


def transformers_weight_map(config: GPTConfig) -> tuple[dict[str, WeightSource], tuple[str, ...]]:
    """Our parameter name → its WeightSource, for a model started from a transformers checkpoint of `config`; and the
    file's names that may be present without being read (a tied head's copy)."""
    if config.architecture == "gpt2":
        return _gpt2_map(config), ("lm_head.weight",) if config.tie_embeddings else ()
    sources = {"tok_emb.weight": WeightSource(("model.embed_tokens.weight",)),
               "ln_f.weight": WeightSource(("model.norm.weight",))}
    if not config.tie_embeddings:
        sources["lm_head.weight"] = WeightSource(("lm_head.weight",))
    for i in range(config.n_layer):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        pairs = {"ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight",
                 "attn.out_proj.weight": "self_attn.o_proj.weight", "mlp.gate.weight": "mlp.gate_proj.weight",
                 "mlp.up.weight": "mlp.up_proj.weight", "mlp.out_proj.weight": "mlp.down_proj.weight"}
        kinds = ["weight"] + (["bias"] if config.bias or config.qkv_bias else [])
        if config.bias:
            pairs.update({"attn.out_proj.bias": "self_attn.o_proj.bias", "mlp.gate.bias": "mlp.gate_proj.bias",
                          "mlp.up.bias": "mlp.up_proj.bias", "mlp.out_proj.bias": "mlp.down_proj.bias"})
        for our_name, their_name in pairs.items():
            sources[f"{ours}.{our_name}"] = WeightSource((f"{theirs}.{their_name}",))
        for kind in kinds:
            sources[f"{ours}.attn.qkv.{kind}"] = WeightSource(
                tuple(f"{theirs}.self_attn.{part}_proj.{kind}" for part in ("q", "k", "v")))
    return sources, ("lm_head.weight",) if config.tie_embeddings else ()


def _gpt2_map(config: GPTConfig) -> dict[str, WeightSource]:
    sources = {"tok_emb.weight": WeightSource(("transformer.wte.weight",)),
               "pos_emb.weight": WeightSource(("transformer.wpe.weight",))}
    if not config.tie_embeddings:
        sources["lm_head.weight"] = WeightSource(("lm_head.weight",))
    for kind in ("weight", "bias"):
        sources[f"ln_f.{kind}"] = WeightSource((f"transformer.ln_f.{kind}",))
    for i in range(config.n_layer):
        ours, theirs = f"blocks.{i}", f"transformer.h.{i}"
        for our_name, their_name, conv in (("ln_1", "ln_1", False), ("ln_2", "ln_2", False),
                                           ("attn.qkv", "attn.c_attn", True), ("attn.out_proj", "attn.c_proj", True),
                                           ("mlp.fc", "mlp.c_fc", True), ("mlp.out_proj", "mlp.c_proj", True)):
            sources[f"{ours}.{our_name}.weight"] = WeightSource((f"{theirs}.{their_name}.weight",), transpose=conv)
            sources[f"{ours}.{our_name}.bias"] = WeightSource((f"{theirs}.{their_name}.bias",))
    return sources
