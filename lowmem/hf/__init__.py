"""The transformers format: `lowmem export OUT` writes a folder that `AutoModelForCausalLM.from_pretrained(OUT)` and
`AutoTokenizer.from_pretrained(OUT)` load offline. transformers is optional (`pip install "lowmem[hf]"`) and is
imported only while exporting."""

from lowmem.hf.export import export_hf

__all__ = ["export_hf"]
