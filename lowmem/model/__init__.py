"""The GPT model: its config and presets, modules, KV-cache generation and the weights' file format."""

from lowmem.model.config import MODEL_PRESETS, GPTConfig
from lowmem.model.kv_cache import KVCache
from lowmem.model.gpt import GPT
from lowmem.model.loss import IGNORE_INDEX

__all__ = ["GPT", "GPTConfig", "IGNORE_INDEX", "KVCache", "MODEL_PRESETS"]
