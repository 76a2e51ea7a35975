"""The transformers format: `lowmem export OUT` writes a folder that `AutoModelForCausalLM.from_pretrained(OUT)` and
`AutoTokenizer.from_pretrained(OUT)` load offline. transformers is optional (`pip install "transformers>=4.46"`,
or `pip install ".[hf]"` in lowmem's folder) and is imported only while exporting."""

from lowmem.hf.export import export_hf

__all__ = ["export_hf"]
