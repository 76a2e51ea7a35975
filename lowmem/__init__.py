"""lowmem: a low-memory streaming data and training pipeline for small GPT-style language models."""

__version__ = "0.1.0"
