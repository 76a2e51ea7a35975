"""Adapters in peft's file format, for `PeftModel.from_pretrained(base, folder)` on the base's transformers model:

    FOLDER/adapter_config.json        peft's LoraConfig: peft_type LORA, task_type CAUSAL_LM, r, lora_alpha,
                                      lora_dropout, target_modules, fan_in_fan_out (True for GPT-2's Conv1D)
    FOLDER/adapter_model.safetensors  base_model.model.<transformers module>.lora_A.weight (rank, in) and
                                      .lora_B.weight (out, rank), float32, one pair per adapted projection

Our fused `qkv` holds the q, k and v projections' pairs side by side; each is written under its own module.
Nothing here imports peft: the files are plain JSON and safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lowmem.adapters.lora import LoRASpec, adapter_state_dict, part_key
from lowmem.adapters.targets import adapter_sites, chosen_parts, peft_module_names
from lowmem.model import GPTConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Where `export --adapter_dir` writes the base for transformers when the run's base is a lowmem model.
PEFT_BASE_DIR = "base"
PEFT_PREFIX = "base_model.model."


def peft_adapter_config(spec: LoRASpec, config: GPTConfig, base_name: str) -> dict[str, Any]:
    """The keys of peft's adapter_config.json for adapters of `spec` on a model of `config`."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": peft_module_names(chosen_parts(spec.targets, config)),
            "fan_in_fan_out": config.architecture == "gpt2", "bias": "none", "use_rslora": False,
            "modules_to_save": None, "init_lora_weights": True, "inference_mode": True}


def peft_adapter_tensors(adapters: torch.nn.Module | dict[str, torch.Tensor],
                         config: GPTConfig) -> dict[str, torch.Tensor]:
    """The adapters of a model (a GPT with `add_adapters` applied), or of their tensors under our names
    (`blocks.0.attn.qkv.lora_A.q_proj`: an adapters file's), under peft's names, float32 and contiguous."""
    state = adapter_state_dict(adapters) if isinstance(adapters, torch.nn.Module) else adapters
    tensors = {}
    for site in adapter_sites(config):
        for part, _rows in site.parts:
            key = part_key(part)
            a, b = state.get(f"{site.module}.lora_A.{key}"), state.get(f"{site.module}.lora_B.{key}")
            if a is None or b is None:
                continue
            where = PEFT_PREFIX + site.transformers_name(part)
            tensors[f"{where}.lora_A.weight"] = a.detach().float().contiguous().cpu()
            tensors[f"{where}.lora_B.weight"] = b.detach().float().contiguous().cpu()
    return tensors


def write_peft_adapter(folder: Path, adapters: torch.nn.Module | dict[str, torch.Tensor], spec: LoRASpec,
                       config: GPTConfig, base_name: str) -> None:
    """Write `adapter_config.json` and `adapter_model.safetensors` into `folder` (which exists), from a model with
    adapters or their tensors (see `peft_adapter_tensors`)."""
    from safetensors.torch import save_file

    save_file(peft_adapter_tensors(adapters, config), str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(
        json.dumps(peft_adapter_config(spec, config, base_name), indent=2) + "\n", encoding="utf-8")


def name_base(folder: Path, base: Path) -> None:
    """Point the adapter_config.json in `folder` at `base` (`base_model_name_or_path`), the folder transformers loads
    the model they apply to from."""
    path = folder / ADAPTER_CONFIG
    config = json.loads(path.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = str(base)
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
