"""Evaluation: validation loss, perplexity and BLEU-4, and the evaluate and generate commands."""
