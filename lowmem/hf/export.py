"""`export`: a trained model folder rewritten as a folder that transformers loads offline.

    OUT/config.json             GPT2LMHeadModel or LlamaForCausalLM; for a model started from a transformers
                                model, that model's class and config (see `lowmem.hf.weights`)
    OUT/model.safetensors       the weights under transformers' names, float32
    OUT/generation_config.json  bos/eos/pad ids and our decoding defaults (`generation_defaults`)
    OUT/tokenizer.json, OUT/tokenizer_config.json, OUT/tokenizer.model   lowmem's tokenizer restated, or the
                                model's own tokenizer files with its chat template (see `lowmem.hf.tokenizer_files`)

The folder is built as `<OUT>.partial` and renamed into place, so OUT is absent or whole. The run folder is only
read (no lock): export works while a training runs, on the best/ or final/ it finds then.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from lowmem.adapters.files import BASE_DIR, base_name
from lowmem.adapters.peft_files import PEFT_BASE_DIR, name_base
from lowmem.atomic_files import folder_built_aside
from lowmem.checkpoint.export import (check_has_adapters, export_adapter, find_model_folder, tokenizer_folder,
                                      trained_config)
from lowmem.checkpoint.model_files import SLICE_BYTES, ModelWeights
from lowmem.config import EvalConfig, TrainConfig
from lowmem.config.settle import settled_for_model
from lowmem.tokenization.text_tokenizer import TextTokenizer, load_tokenizer
from lowmem.tokenization.sentencepiece_tokenizer import BOS_ID, EOS_ID, PAD_ID, TOKENIZER_FILE, Tokenizer
from lowmem.errors import ConfigError
from lowmem.hf.architectures import transformers_class
from lowmem.hf.tokenizer_files import check_tokenizer, copy_model_tokenizer, save_tokenizer
from lowmem.hf.weights import TRANSFORMERS_CLASSES, hf_config, hf_tensors
from lowmem.model import GPTConfig
from lowmem.model.safetensors_writer import PlannedTensor, SafetensorsWriter
from lowmem.model.weights import WEIGHTS_FILE, load_model_config

logger = logging.getLogger(__name__)

MIN_TRANSFORMERS = (4, 46)
INSTALL_HINT = 'pip install "transformers>=4.46" (or pip install ".[hf]" in lowmem\'s folder)'


def export_hf(config: TrainConfig, out: str | Path, checkpoint: str | None = None,
              adapter_dir: str | Path | None = None) -> Path:
    """Write the run's best/ model (else final/), or `checkpoint`, to the new folder `out` in transformers' format.

    Args:
        config: the command's config: output_dir (the run folder), tokenizer_dir (the tokenizer when the model
            folder has none), eval_max_new_tokens (the generation default).
        out: the folder to create; it must not exist, or be empty.
        checkpoint: a checkpoint-<step>, best/ or final/ folder to export instead.
        adapter_dir: a run that trained adapters: also write them, in peft's files, to this new folder.

    Returns:
        `out`, as a Path.
    """
    out = Path(out)
    _check_out(out)
    if adapter_dir is not None:
        _check_out(Path(adapter_dir))
    folder = find_model_folder(config.output_dir, checkpoint)
    if adapter_dir is not None:
        check_has_adapters(folder)  # before anything is written
    config = settled_for_model(config, trained_config(folder), folder)  # as evaluate and generate settle it
    transformers = _import_transformers()
    model_config = load_model_config(folder)
    tokenizer_dir = tokenizer_folder(folder, config.tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    lowmem_tokenizer = isinstance(tokenizer, Tokenizer)
    if tokenizer.vocab_size > model_config.vocab_size or \
            (lowmem_tokenizer and tokenizer.vocab_size != model_config.vocab_size):
        raise ConfigError(f"The tokenizer in '{tokenizer_dir}' has {tokenizer.vocab_size} pieces but the model in "
                          f"'{folder}' was trained with {model_config.vocab_size}: pass --tokenizer_dir=FOLDER with "
                          "the tokenizer the model was trained with.")
    ids = special_ids(tokenizer)
    with folder_built_aside(out) as staged:
        _save_folder(transformers, staged, folder, model_config, generation_defaults(config, ids), tokenizer,
                     tokenizer_dir)
    written = transformers_class(model_config.transformers_config) if model_config.transformers_config else \
        TRANSFORMERS_CLASSES[model_config.architecture]
    logger.info("Exported %s (%s) to %s as %s.", folder, model_config.architecture, out, written)
    if adapter_dir is not None:
        adapters = export_adapter(folder, Path(adapter_dir))
        logger.info("Its adapters, in peft's files, written to %s.", adapters)
        if not is_transformers_folder(Path(base_name(folder.parent))):
            # The run started from a lowmem model: its base, as the adapters apply to it, for transformers too.
            base = adapters / PEFT_BASE_DIR
            with folder_built_aside(base) as staged:
                _save_folder(transformers, staged, folder.parent / BASE_DIR, load_model_config(
                    folder.parent / BASE_DIR), generation_defaults(config, ids), tokenizer, tokenizer_dir)
            name_base(adapters, base.resolve())
            logger.info("The base they apply to, which the run started from a lowmem model, written for "
                        "transformers to %s and named in its adapter_config.json.", base)
    return out


def _save_folder(transformers: ModuleType, staged: Path, folder: Path, model_config: GPTConfig,
                 generation: dict[str, Any], tokenizer: TextTokenizer, tokenizer_dir: Path) -> None:
    """The model of `folder` and its tokenizer, written into `staged` in transformers' format, the tokenizer checked
    against ours."""
    ids = special_ids(tokenizer)
    _save_model(transformers, staged, folder, model_config, generation, ids)
    lowmem_tokenizer = isinstance(tokenizer, Tokenizer)
    if lowmem_tokenizer:
        save_tokenizer(staged, tokenizer_dir / TOKENIZER_FILE, model_config.max_seq_len)
    else:
        copy_model_tokenizer(staged, tokenizer_dir, tokenizer)
    check_tokenizer(staged, tokenizer, tokenizer_dir / TOKENIZER_FILE if lowmem_tokenizer else None)


def is_transformers_folder(folder: Path) -> bool:
    """Whether `AutoModelForCausalLM.from_pretrained(folder)` reads it: a transformers model's folder (or one `lowmem
    export` wrote), with its config.json; a lowmem run or model folder has none."""
    return (folder / "config.json").is_file()


def special_ids(tokenizer: TextTokenizer) -> dict[str, Any]:
    """The bos, eos and pad ids transformers' config and generation_config carry: lowmem's fixed ones, or a model's
    own tokenizer's (its eos a list when several ids end an answer: a chat model's end of turn and end of text)."""
    if isinstance(tokenizer, Tokenizer):
        return {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    stops = list(tokenizer.stop_ids)
    return {"bos_token_id": getattr(tokenizer, "bos_id", None),
            "eos_token_id": stops[0] if len(stops) == 1 else stops, "pad_token_id": tokenizer.pad_id}


def _check_out(out: Path) -> None:
    """Refuse an OUT that is a file, or a folder with anything in it: export never mixes its files with others."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"'{out}' is a file: export writes a folder there. Pass a path that does not exist yet.")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"'{out}' already exists and is not empty: export writes a new folder and never mixes its "
                          f"files with others. Pass a path that does not exist yet (or an empty folder), or remove "
                          f"'{out}' first.")


def _import_transformers() -> ModuleType:
    """transformers, imported here only: it is an optional dependency."""
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(f"`export` needs the transformers library, which is not installed: {INSTALL_HINT}") from exc
    version = tuple(int(part) for part in re.findall(r"\d+", transformers.__version__)[:2])
    if version < MIN_TRANSFORMERS:
        raise ConfigError(f"`export` needs transformers {'.'.join(map(str, MIN_TRANSFORMERS))} or later, found "
                          f"{transformers.__version__}: {INSTALL_HINT} --upgrade")
    return transformers


def generation_defaults(config: EvalConfig, ids: dict[str, Any] | None = None) -> dict[str, Any]:
    """generation_config.json: the special ids (`ids`, lowmem's own by default), and the decoding our `generate` and
    `evaluate` use by default.

    do_sample=False is greedy, as `generate` (temperature 0) and evaluate's BLEU answers; max_new_tokens is
    `eval_max_new_tokens` (128 by default, also `generate`'s default). Not written: no_repeat_ngram_size
    (transformers' also bans the prompt's n-grams, ours only the answer's) and the sampling settings of the
    sample printed after training (temperature 0.8, top_k 40: pass them with do_sample=True).
    """
    ids = ids or {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    return {**{key: value for key, value in ids.items() if value is not None}, "do_sample": False,
            "max_new_tokens": config.eval_max_new_tokens}


def _save_model(transformers: ModuleType, staged: Path, folder: Path, model_config: GPTConfig,
                generation: dict[str, Any], ids: dict[str, Any]) -> None:
    """config.json, generation_config.json (by transformers' own config classes) and model.safetensors, written a
    tensor at a time from the model folder's files (`ModelWeights`): the host holds one tensor, never the model."""
    keys = {**hf_config(model_config, ids), "torch_dtype": "float32"}
    hf_config_object = transformers.AutoConfig.for_model(**keys)
    hf_config_object.save_pretrained(staged)
    transformers.GenerationConfig(**generation).save_pretrained(staged)
    with ModelWeights(folder) as weights:
        shapes = {planned.name: planned.shape for planned in weights.planned()}
        tensors = hf_tensors(shapes, model_config)
        _check_names(transformers, hf_config_object, hf_tensors(shapes, model_config, with_tied_head=True))
        planned = [PlannedTensor(tensor.name, torch.float32, tensor.shape) for tensor in tensors]
        with SafetensorsWriter(staged / WEIGHTS_FILE, planned, metadata={"format": "pt"}) as writer:
            for tensor in tensors:  # a slice of rows at a time: the host never holds a whole tensor of the model
                for part in tensor.slices(weights.rows, weights.tensor, SLICE_BYTES):
                    writer.write(tensor.name, part)
                    del part
    # Keys the installed version did not write (rope_theta, which transformers 5 moves into rope_parameters)
    # are added for readers of other versions; what it wrote is kept as it is.
    config_file = staged / "config.json"
    written = json.loads(config_file.read_text(encoding="utf-8"))
    config_file.write_text(json.dumps({**keys, **written}, indent=2) + "\n", encoding="utf-8")


def _check_names(transformers: ModuleType, config: Any, tensors: list) -> None:
    """Every tensor of the transformers class (built on the meta device: no memory) is written, of its shape, and
    nothing else: the folder loads with no weight missing or left over."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    theirs = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    ours = {tensor.name: tuple(tensor.shape) for tensor in tensors}
    if theirs != ours:
        missing, extra = sorted(set(theirs) - set(ours)), sorted(set(ours) - set(theirs))
        shapes = sorted(name for name in set(theirs) & set(ours) if theirs[name] != ours[name])
        raise ConfigError(f"The exported weights do not fit {type(model).__name__}: missing {missing[:3]}, unexpected "
                          f"{extra[:3]}, of another shape {shapes[:3]}.")
