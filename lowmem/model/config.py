"""The configuration of a GPT model: `GPTConfig` (sizes, architecture, checks) and the model presets as data.

`GPTConfig.architecture` chooses the parts of the model (`lowmem.model.gpt` builds them):

    architecture  positions                   norm       MLP
    gpt2          learned table, added        LayerNorm  GELU, 4 x n_embd wide
    llama         rotary, on queries and keys RMSNorm    SwiGLU, about 8/3 x n_embd wide (about as many weights)

A model started from a transformers checkpoint of the Llama family (Llama, Qwen2, Mistral) is a llama whose sizes
come from the source's config.json (`lowmem.source.hf_config`): fewer key/value heads than query heads
(grouped-query attention), biases on the query/key/value projection only (Qwen2), an output layer of its own
(untied), the source's MLP width, head size, rotary base and scaling, and a vocabulary kept at the source's rows.
Every one of these fields defaults to what a model lowmem trains from scratch has, so model_config.json files
written before they existed read back as they were.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional

from lowmem.errors import ConfigError

# The architectures `GPTConfig.architecture` accepts (see the module docstring).
ARCHITECTURES: tuple[str, ...] = ("gpt2", "llama")

# Matmuls whose inner dimension is a multiple of 64 map cleanly onto GPU tensor cores; padding the vocabulary
# (the largest matmul in a small model) up to it is cheap in parameters and noticeably faster.
VOCAB_PAD_MULTIPLE = 64
# The SwiGLU hidden width is rounded up to this, for the same reason.
MLP_WIDTH_MULTIPLE = 64
# The rotary scalings a model may carry (`GPTConfig.rope_scaling["rope_type"]`, see `lowmem.model.rotary`).
ROPE_SCALINGS = ("linear", "llama3")

# The model presets, usable with `GPTConfig.from_preset` (configs and the command line): each name maps to the
# GPTConfig fields it sets besides `vocab_size`. `GPTConfig.demo` and `GPTConfig.gpt2_small` build them by name.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "demo": dict(max_seq_len=256, n_layer=4, n_head=4, n_embd=256),
    "gpt2_small": dict(max_seq_len=1024, n_layer=12, n_head=12, n_embd=768),
}


@dataclass
class GPTConfig:
    """Sizes of a GPT model.

    Args:
        vocab_size: number of token ids the tokenizer produces. The embedding table is padded up to
            `padded_vocab_size`; the extra rows are never produced by `GPT.generate`.
        max_seq_len: longest sequence (context) the model accepts; sets the size of the position embedding.
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide `n_embd`.
        n_embd: width of the residual stream.
        dropout: dropout probability on embeddings, attention weights and residual branches (0.0 for
            pretraining on a lot of data, 0.1 or so when fine-tuning on little).
        bias: whether Linear and LayerNorm layers have biases (False is slightly faster and as good).
        architecture: "gpt2" or "llama" (see the module docstring). Model files written before the field
            existed hold a "gpt2" model, hence that default here; new training runs choose theirs in the config.
        rope_theta: base of the rotary frequencies (llama only).
        norm_eps: the epsilon of LayerNorm / RMSNorm.
        n_kv_head: key/value heads (llama only); 0 means one per query head. Fewer is grouped-query attention:
            each key/value head serves n_head // n_kv_head consecutive query heads.
        head_size: channels per attention head; 0 means n_embd // n_head.
        mlp_width: the MLP's hidden width; 0 means the architecture's rule (`mlp_hidden`).
        qkv_bias: biases on the query/key/value projection even without `bias` (Qwen2's layout).
        tie_embeddings: the output layer shares its weight with the token embedding; False gives it its own.
        vocab_multiple: the embedding's rows are `vocab_size` rounded up to a multiple of this (64 for models
            trained here; 1 keeps a transformers model's rows as they are).
        rope_scaling: None, or the rotary scaling of the source model (llama only): {"rope_type": "linear",
            "factor": f} or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings"} (see `lowmem.model.rotary.inverse_frequencies`).
        transformers_config: the config.json of the transformers model this one was started from (None for a
            model lowmem trained from scratch), kept as data so that `lowmem export` writes the same model class
            with every key of the source (`lowmem.hf.weights.hf_config`).
    """

    vocab_size: int
    max_seq_len: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = False
    architecture: str = "gpt2"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    n_kv_head: int = 0
    head_size: int = 0
    mlp_width: int = 0
    qkv_bias: bool = False
    tie_embeddings: bool = True
    vocab_multiple: int = VOCAB_PAD_MULTIPLE
    rope_scaling: Optional[dict[str, Any]] = None
    transformers_config: Optional[dict[str, Any]] = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            # bool is an int subclass; `n_layer=True` is a typo, not a size.
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ConfigError(f"GPTConfig.{name} must be an integer, got {value!r}; pass a whole number.")
            if value < 1:
                raise ConfigError(f"GPTConfig.{name} must be at least 1, got {value}; set a positive {name}.")
        self._check_grouped_sizes()
        if not self.head_size and self.n_embd % self.n_head != 0:
            lower = (self.n_embd // self.n_head) * self.n_head
            upper = lower + self.n_head
            hint = f"n_embd={upper}" if lower == 0 else f"n_embd={lower} or n_embd={upper}"
            raise ConfigError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): each head gets "
                f"n_embd // n_head channels. Use for example {hint}, or an n_head that divides {self.n_embd}."
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, numbers.Real):
            raise ConfigError(f"GPTConfig.dropout must be a number, got {self.dropout!r}; use e.g. 0.0 or 0.1.")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(
                f"GPTConfig.dropout must be in [0, 1), got {self.dropout}; use 0.0 to disable dropout."
            )
        for name in ("bias", "qkv_bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"GPTConfig.{name} must be True or False, got {getattr(self, name)!r}.")
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"GPTConfig.architecture must be one of {', '.join(ARCHITECTURES)}, "
                              f"got {self.architecture!r}.")
        if self.architecture == "llama" and self.head_dim % 2:
            raise ConfigError(f"The llama architecture rotates channel pairs: n_embd // n_head ({self.head_dim}) "
                              "must be even. Choose another n_head or n_embd.")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or value <= 0:
                raise ConfigError(f"GPTConfig.{name} must be a number above 0, got {value!r}.")
        self._check_rope_scaling()

    def _check_grouped_sizes(self) -> None:
        """n_kv_head, head_size, mlp_width and vocab_multiple: whole numbers (0 = the rule), and n_kv_head dividing
        n_head."""
        for name in ("n_kv_head", "head_size", "mlp_width", "vocab_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ConfigError(f"GPTConfig.{name} must be a whole number >= 0, got {value!r}.")
        if self.vocab_multiple < 1:
            raise ConfigError(f"GPTConfig.vocab_multiple must be at least 1, got {self.vocab_multiple}.")
        if self.n_kv_head and (self.n_kv_head > self.n_head or self.n_head % self.n_kv_head):
            raise ConfigError(f"GPTConfig.n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head}): each "
                              "key/value head serves the same number of query heads.")
        if self.architecture == "gpt2" and (self.kv_heads != self.n_head or self.rope_scaling):
            raise ConfigError("Grouped-query attention and rotary scaling are for the llama architecture only.")

    def _check_rope_scaling(self) -> None:
        if self.rope_scaling is None:
            return
        kind = self.rope_scaling.get("rope_type") if isinstance(self.rope_scaling, dict) else None
        if kind not in ROPE_SCALINGS:
            raise ConfigError(f"GPTConfig.rope_scaling must be None or have a rope_type among "
                              f"{', '.join(ROPE_SCALINGS)}, got {self.rope_scaling!r}.")

    @property
    def padded_vocab_size(self) -> int:
        """`vocab_size` rounded up to a multiple of `vocab_multiple` (64): the number of rows in the embedding and
        logits."""
        return math.ceil(self.vocab_size / self.vocab_multiple) * self.vocab_multiple

    @property
    def mlp_hidden(self) -> int:
        """Width of the MLP's hidden layer: `mlp_width` when set; else 4 x n_embd for GELU, and for SwiGLU, whose
        three matrices would otherwise hold 1.5 times the parameters, 8/3 x n_embd rounded up to a multiple of 64
        (as many parameters at widths of 256 and more; at 128, 12% more)."""
        if self.mlp_width:
            return self.mlp_width
        if self.architecture == "gpt2":
            return 4 * self.n_embd
        return math.ceil(8 * self.n_embd / 3 / MLP_WIDTH_MULTIPLE) * MLP_WIDTH_MULTIPLE

    @property
    def head_dim(self) -> int:
        """Channels per attention head (`head_size`, else `n_embd // n_head`)."""
        return self.head_size or self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: `n_kv_head`, else one per query head."""
        return self.n_kv_head or self.n_head

    @property
    def sliding_window(self) -> int | None:
        """The transformers source's sliding attention window, when it has one in use (Mistral's first versions);
        None otherwise."""
        source = self.transformers_config or {}
        window = source.get("sliding_window")
        if not window or source.get("use_sliding_window") is False:
            return None
        return int(window)

    @property
    def context_len(self) -> int:
        """The longest context the model answers in: a llama started from a transformers model reaches as far as
        that model did (its `max_position_embeddings`, within its sliding window: rotary positions are computed,
        not looked up), whatever length it was trained at; any other model `max_seq_len` (a learned position table
        has that many rows; a model of one's own has never seen a position beyond it)."""
        source = self.transformers_config or {}
        if self.architecture != "llama" or not source.get("max_position_embeddings"):
            return self.max_seq_len
        longest = int(source["max_position_embeddings"])
        window = self.sliding_window
        return max(self.max_seq_len, min(longest, window) if window else longest)

    @classmethod
    def demo(cls, vocab_size: int, **overrides: Any) -> GPTConfig:
        """A tiny model that trains on a 2-core laptop CPU in minutes.

        About 3.2 M parameters besides the embeddings (4 layers, 4 heads, width 256, context 256).

        Args:
            vocab_size: the tokenizer's vocabulary size.
            **overrides: any other GPTConfig field, e.g. `max_seq_len=128`.
        """
        return cls.from_preset("demo", vocab_size, **overrides)

    @classmethod
    def gpt2_small(cls, vocab_size: int, **overrides: Any) -> GPTConfig:
        """A GPT-2-small-sized model (12 layers, 12 heads, width 768, context 1024): ~85 M parameters
        besides the embeddings. Randomly initialised; nothing is downloaded.

        Args:
            vocab_size: the tokenizer's vocabulary size.
            **overrides: any other GPTConfig field, e.g. `dropout=0.1`.
        """
        return cls.from_preset("gpt2_small", vocab_size, **overrides)

    @classmethod
    def from_preset(cls, name: str, vocab_size: int, **overrides: Any) -> GPTConfig:
        """Build a config from a preset name (for configs and the command line).

        Args:
            name: one of `MODEL_PRESETS` ("demo", "gpt2_small").
            vocab_size: the tokenizer's vocabulary size.
            **overrides: any other GPTConfig field.

        Raises:
            ConfigError: if the name is not a known preset.
        """
        if name not in MODEL_PRESETS:
            raise ConfigError(f"Unknown model preset {name!r}; choose one of: {', '.join(sorted(MODEL_PRESETS))}.")
        return cls(vocab_size=vocab_size, **{**MODEL_PRESETS[name], **overrides})
