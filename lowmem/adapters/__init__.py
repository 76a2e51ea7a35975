"""Low-rank adapters (LoRA) on a GPT: the layer, where it goes, and peft's file format."""

from lowmem.adapters.lora import LoRALinear, LoRASpec, add_adapters, adapters_off, merged_state_dict

__all__ = ["LoRALinear", "LoRASpec", "add_adapters", "adapters_off", "merged_state_dict"]
