"""The transformers models a run can start from, and their config.json read as a GPTConfig: the user types no shape.

    transformers class   lowmem model
    LlamaForCausalLM     llama: grouped-query attention, an untied or tied head, Llama 3's rotary scaling
    Qwen2ForCausalLM     llama with biases on the query/key/value projection
    MistralForCausalLM   llama; its sliding window must cover the training sequence (--max_seq_len)
    GPT2LMHeadModel      gpt2, as `lowmem export` writes it (exact GELU); GPT-2 itself uses the tanh GELU

Both spellings of the rotary settings are read: transformers 4's `rope_theta` and `rope_scaling`, and 5's
`rope_parameters`. A config that asks for what these classes do not compute (another class, quantized weights, an
activation other than SiLU, a rotary scaling other than linear or llama3, biases on the output projection alone)
is refused with a message naming the key; nothing of the folder is ever run (a folder's own modelling code, which
`trust_remote_code` would import, is never read).
"""

from __future__ import annotations

from typing import Any

from lowmem.errors import ConfigError
from lowmem.model import GPTConfig
from lowmem.model.config import ROPE_SCALINGS

LLAMA_FAMILY = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
EXPORTED_GPT2 = "GPT2LMHeadModel"
SUPPORTED_CLASSES = (*LLAMA_FAMILY, EXPORTED_GPT2)
# What each rotary scaling reads (`lowmem.model.rotary.inverse_frequencies`).
SCALING_KEYS = {"linear": {"factor"},
                "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}}


def supported_text() -> str:
    """The classes a run can start from, in words, for messages."""
    return (f"{', '.join(LLAMA_FAMILY)} (transformers causal language models of the Llama family), and "
            f"{EXPORTED_GPT2} folders written by `lowmem export`")


def transformers_class(config: dict[str, Any]) -> str:
    """The model class a config.json names (its `architectures`), or its model_type when it names none."""
    names = config.get("architectures") or []
    return str(names[0]) if names else f"model_type {config.get('model_type')!r}"


def gpt_config_from_transformers(config: dict[str, Any], where: str) -> GPTConfig:
    """The GPTConfig of the model a transformers config.json describes (`where` names the folder in messages).

    The vocabulary keeps the source's rows (`vocab_multiple=1`); `max_seq_len` is the source's longest context
    (`max_position_embeddings`), which the run's start-up lowers to the training sequence. The whole config.json is
    kept (`transformers_config`), so that an export writes the same class with every key of the source. A field
    missing or of a value that cannot be read is a `ConfigError` that names it.
    """
    try:
        return _config_of_class(config, where)
    except ConfigError:
        raise
    except KeyError as missing:
        raise ConfigError(f"The config.json in '{where}' has no {missing.args[0]!r}, which lowmem needs to build "
                          f"the model: the file is incomplete. Copy it again from the model's source.") from None
    except (TypeError, ValueError, ZeroDivisionError) as error:
        raise ConfigError(f"The config.json in '{where}' holds a value lowmem cannot read ({error}): the file is "
                          "damaged or hand-edited. Copy it again from the model's source.") from None


def _config_of_class(config: dict[str, Any], where: str) -> GPTConfig:
    """`gpt_config_from_transformers`, without the translation of a missing or unreadable field."""
    name = transformers_class(config)
    if config.get("quantization_config"):
        raise ConfigError(f"The model in '{where}' is quantized ({config['quantization_config'].get('quant_method')}):"
                          " lowmem trains float weights. Start from the unquantized model.")
    if name == EXPORTED_GPT2:
        return _gpt2_config(config, where)
    if name not in LLAMA_FAMILY:
        raise ConfigError(f"The model in '{where}' is a {name}: lowmem starts from {supported_text()}. Encoder "
                          "models (BERT), encoder-decoders (T5) and classes of a model's own code are not supported.")
    _require(config.get("hidden_act", "silu") == "silu", where, "hidden_act", config.get("hidden_act"), "silu")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_size = int(config.get("head_dim") or hidden // heads)
    theta, scaling = _rotary(config, where)
    bias = bool(config.get("attention_bias", False))
    if bias != bool(config.get("mlp_bias", False)):
        raise ConfigError(f"The model in '{where}' has attention_bias={config.get('attention_bias')} and "
                          f"mlp_bias={config.get('mlp_bias')}: lowmem's llama has biases everywhere or on the "
                          "query/key/value projection only. This model is not supported.")
    return GPTConfig(
        vocab_size=int(config["vocab_size"]), max_seq_len=int(config.get("max_position_embeddings") or 2048),
        n_layer=int(config["num_hidden_layers"]), n_head=heads, n_embd=hidden, architecture="llama",
        rope_theta=theta, norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        n_kv_head=0 if kv_heads == heads else kv_heads, head_size=0 if head_size * heads == hidden else head_size,
        mlp_width=int(config["intermediate_size"]), bias=bias, qkv_bias=LLAMA_FAMILY[name] == "qwen2" or bias,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), vocab_multiple=1, rope_scaling=scaling,
        transformers_config=dict(config))


def _gpt2_config(config: dict[str, Any], where: str) -> GPTConfig:
    """A GPT2LMHeadModel as `lowmem export` writes it: exact GELU, biases (zeros where the model had none)."""
    _require(config.get("activation_function") == "gelu", where, "activation_function",
             config.get("activation_function"), "gelu (the exact GELU lowmem's gpt2 computes; GPT-2 itself uses the "
             "tanh approximation, gelu_new, which lowmem does not)")
    hidden = int(config["n_embd"])
    inner = config.get("n_inner") or 4 * hidden
    return GPTConfig(vocab_size=int(config["vocab_size"]), max_seq_len=int(config["n_positions"]),
                     n_layer=int(config["n_layer"]), n_head=int(config["n_head"]), n_embd=hidden,
                     architecture="gpt2", bias=True, norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
                     mlp_width=0 if inner == 4 * hidden else int(inner),
                     tie_embeddings=bool(config.get("tie_word_embeddings", True)), vocab_multiple=1,
                     transformers_config=dict(config))


def _rotary(config: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, the scaling or None), from transformers 5's `rope_parameters` or 4's `rope_theta`/`rope_scaling`."""
    parameters = config.get("rope_parameters") or {}
    if "full_attention" in parameters:  # per layer type: these families use one for every layer
        parameters = parameters["full_attention"]
    scaling = dict(parameters) if parameters else dict(config.get("rope_scaling") or {})
    theta = float(parameters.get("rope_theta") or config.get("rope_theta") or 10000.0)
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("rope_theta", None)
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALINGS:
        raise ConfigError(f"The model in '{where}' scales its rotary positions by {kind!r}: lowmem computes "
                          f"{', '.join(ROPE_SCALINGS)} scaling (or none). This model is not supported.")
    needed = SCALING_KEYS[kind] - set(scaling)
    if needed:
        raise ConfigError(f"The model in '{where}' asks for {kind} rotary scaling without {', '.join(sorted(needed))}:"
                          " its config.json is incomplete.")
    return theta, {"rope_type": kind, **{key: scaling[key] for key in SCALING_KEYS[kind]}}


def _require(ok: bool, where: str, key: str, found: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"The model in '{where}' has {key}={found!r}; lowmem computes {expected}. This model is not "
                          "supported.")


def sliding_window(config: GPTConfig) -> int | None:
    """The source's sliding attention window, when it has one in use (Mistral's first versions): a training sequence
    longer than it would attend further back than the model was trained to."""
    return config.sliding_window
