"""The GPT model: modules, KV-cache generation and the weights' file format."""

from lowmem.model.gpt import GPT, IGNORE_INDEX, PRESETS, GPTConfig, KVCache

__all__ = ["GPT", "GPTConfig", "IGNORE_INDEX", "KVCache", "PRESETS"]
