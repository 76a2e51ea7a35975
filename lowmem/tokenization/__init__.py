"""Tokenizers and chat templates: lowmem's SentencePiece model (trained on the run's rows), a transformers model's
tokenizer.json, the one interface a run trains with (`text_tokenizer`), the record of which tokenizer a run uses,
and the chat template a row is laid out with."""
