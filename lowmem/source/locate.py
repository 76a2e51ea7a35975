"""What `--init_from=PATH` names: the folder the weights are read from, the model's shape, its tokenizer.

    PATH                                         weights read from                            shape from
    a lowmem run folder                          best/, else final/, else the newest complete  model_config.json
                                                 checkpoint (the choice is said)
    checkpoint-<step>, best/, final/             that folder                                   model_config.json
    a transformers folder (or `lowmem export`)   model.safetensors, or the shards its           config.json
                                                 model.safetensors.index.json names

Only safetensors files are ever read, as data. A folder that holds its weights only as pickles
(pytorch_model.bin, *.pt) is refused with the command that converts it: a pickle can run code when loaded, and
nothing here loads one, even with `weights_only` (nothing is opened at all).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowmem.adapters.files import is_adapter_checkpoint
from lowmem.checkpoint.export import best_saved_checkpoint, trained_config
from lowmem.checkpoint.layout import FINAL
from lowmem.tokenization.sentencepiece_tokenizer import TOKENIZER_FILE
from lowmem.errors import ConfigError
from lowmem.hf.architectures import gpt_config_from_transformers, supported_text, transformers_class
from lowmem.model import GPTConfig
from lowmem.model.safetensors_files import INDEX_FILE, TensorEntry, index_entries
from lowmem.model.weights import MODEL_CONFIG_FILE, WEIGHTS_FILE, load_model_config
from lowmem.program import command_line
from lowmem.run_files import TOKENIZER_RECORD_NAME

LOWMEM, TRANSFORMERS = "lowmem", "transformers"
TRANSFORMERS_CONFIG = "config.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
RUN_TOKENIZER_DIR = "tokenizer"  # `<run>/tokenizer/`: where a run started from a model keeps the model's tokenizer


@dataclass(frozen=True)
class ModelSource:
    """A trained model to start from, found (`find_source`) but not loaded.

    Attributes:
        given: PATH as the user typed it.
        folder: the folder the weights are read from.
        chosen: how that folder was chosen, for the line that says what was loaded.
        kind: "lowmem" (a run, checkpoint or exported model folder of lowmem's) or "transformers".
        model_config: the model's shape.
        tensors: the weights' tensors, name → where each lies (from the safetensors headers).
        tokenizer_folder: the folder of its tokenizer, or None when none was found.
        trained_config: for a lowmem source, the settings it was trained with (empty when unknown).
    """

    given: str
    folder: Path
    chosen: str
    kind: str
    model_config: GPTConfig
    tensors: dict[str, TensorEntry] = field(repr=False)
    tokenizer_folder: Path | None
    trained_config: dict[str, Any] = field(default_factory=dict, repr=False)
    # The sha256 of the weights' bytes, once a scan has read them (`lowmem.source.finite.scan_weights`).
    content_sha256: str | None = field(default=None, repr=False, compare=False)

    @property
    def stored_dtypes(self) -> list[str]:
        """The dtypes the weights are stored in, e.g. ["bfloat16"]."""
        return sorted({str(entry.dtype).replace("torch.", "") for entry in self.tensors.values()})

    @property
    def description(self) -> str:
        """The source in words: class, path and choice, e.g. "Qwen2ForCausalLM in /models/qwen (the folder given)"."""
        what = transformers_class(self.model_config.transformers_config or {}) if self.kind == TRANSFORMERS \
            else f"lowmem {self.model_config.architecture} model"
        return f"{what} in {self.folder} ({self.chosen})"


def source_name(path: str) -> str:
    """A short name for the model `path` names, from the path alone (for the default run folder): the run's, for a
    run or its best/ and final/; the run's and the step, for a checkpoint; else the folder's."""
    folder = Path(str(path)).expanduser().resolve()
    if folder.suffix == ".safetensors":
        folder = folder.parent
    if folder.name in ("best", "final"):
        return folder.parent.name
    step = FINAL.fullmatch(folder.name)
    return f"{folder.parent.name}-{step.group(1)}" if step else folder.name


def find_source(path: str) -> ModelSource:
    """The model `--init_from=path` names (see the module docstring); ConfigError, with what to pass instead, when
    there is none, or none lowmem can read."""
    given = Path(str(path)).expanduser()
    if not given.exists():
        raise ConfigError(f"--init_from={path}: no such file or folder. Pass a lowmem run folder (model_save/<run>), "
                          "one of its checkpoint-<step>, best/ or final/ folders, or a transformers model folder "
                          "(config.json and model.safetensors).")
    folder = given.parent if given.is_file() and given.suffix == ".safetensors" else given
    if not folder.is_dir():
        raise ConfigError(f"--init_from={path} is a file: pass the folder that holds the model.")
    if (folder / MODEL_CONFIG_FILE).is_file() and (folder / WEIGHTS_FILE).is_file():
        return _lowmem_source(str(path), folder, "the folder given")
    if is_adapter_checkpoint(folder):
        _refuse_adapter_checkpoint(folder)
    if (folder / TRANSFORMERS_CONFIG).is_file():
        return _transformers_source(str(path), folder)
    chosen = _model_folder_of_run(folder)
    if chosen is not None:
        return _lowmem_source(str(path), *chosen)
    _refuse_pickles(folder, path)
    raise ConfigError(f"--init_from={path}: '{folder}' holds no model lowmem can start from. Pass a lowmem run folder "
                      "(with best/, final/ or checkpoint-<step> folders), one of those folders (model_config.json and "
                      "model.safetensors), or a transformers model folder (config.json and model.safetensors).")


def _model_folder_of_run(run: Path) -> tuple[Path, str] | None:
    """The folder of a run to start from: best/, else final/, else its best-scored complete checkpoint (else the
    newest: `best_saved_checkpoint`); None when the folder is not a run (or has no model yet)."""
    for name, why in (("best", "the run's best/"), ("final", "the run's final/, as it has no best/")):
        if (run / name / WEIGHTS_FILE).is_file() and (run / name / MODEL_CONFIG_FILE).is_file():
            return run / name, why
    saved = best_saved_checkpoint(run)
    if saved is not None:
        folder, why = saved
        if is_adapter_checkpoint(folder):
            _refuse_adapter_checkpoint(folder)
        return folder, f"{folder.name}, {why}, as the run has no best/ or final/"
    return None


def _refuse_adapter_checkpoint(folder: Path) -> None:
    """A checkpoint of adapters is no model to start from by itself: say how to get its merged model."""
    raise ConfigError(
        f"{folder} is a checkpoint of a run that trains adapters (--lora_rank): it holds the adapters alone, not a "
        f"model to start from. Write its merged model first with `{command_line(f'export OUT --checkpoint={folder}')}`"
        " (a transformers folder, which --init_from=OUT takes), or start from the run's best/ or final/ once it has "
        "them.")


def _lowmem_source(given: str, folder: Path, chosen: str) -> ModelSource:
    try:
        model_config = load_model_config(folder)
    except (OSError, ValueError, TypeError) as error:
        raise ConfigError(f"--init_from={given}: '{folder / MODEL_CONFIG_FILE}' cannot be read ({error}).") from error
    trained = trained_config(folder) or {}
    return ModelSource(given, folder, chosen, LOWMEM, model_config, index_entries(folder, [folder / WEIGHTS_FILE]),
                       _lowmem_tokenizer(folder, trained), trained)


def _lowmem_tokenizer(folder: Path, trained: dict[str, Any]) -> Path | None:
    """The tokenizer of a lowmem model: the one exported beside it, else its run's (as the run's record or its
    config names it, else the run's own tokenizer/ folder)."""
    if _has_tokenizer(folder):
        return folder
    run = folder.parent
    candidates = [run / RUN_TOKENIZER_DIR]
    try:
        record = json.loads((run / TOKENIZER_RECORD_NAME).read_text(encoding="utf-8"))
        candidates.insert(0, Path(str(record["tokenizer_dir"])))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if trained.get("tokenizer_dir"):
        candidates.append(Path(str(trained["tokenizer_dir"])))
    return next((candidate for candidate in candidates if _has_tokenizer(candidate)), None)


def _has_tokenizer(folder: Path) -> bool:
    return (folder / TOKENIZER_FILE).is_file() or (folder / "tokenizer.json").is_file()


def _transformers_source(given: str, folder: Path) -> ModelSource:
    try:
        config = json.loads((folder / TRANSFORMERS_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"--init_from={given}: '{folder / TRANSFORMERS_CONFIG}' is not readable JSON ({error}).") \
            from error
    if not isinstance(config, dict):
        raise ConfigError(f"--init_from={given}: '{folder / TRANSFORMERS_CONFIG}' is not a model config.")
    model_config = gpt_config_from_transformers(config, str(folder))
    files = _weight_files(folder, given)
    return ModelSource(given, folder, "the folder given", TRANSFORMERS, model_config, index_entries(folder, files),
                       folder if (folder / "tokenizer.json").is_file() or (folder / TOKENIZER_FILE).is_file()
                       else None)


def _weight_files(folder: Path, given: str) -> list[Path]:
    """The safetensors files of a transformers folder: those its index names, else model.safetensors, else every
    *.safetensors file in it."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ConfigError(f"--init_from={given}: '{index}' is not a readable index of weight files ({error}).") \
                from error
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise ConfigError(f"--init_from={given}: '{index}' names {', '.join(missing)}, which '{folder}' does not "
                              "hold: the model was not fully downloaded or copied.")
        return [folder / name for name in names]
    files = [folder / WEIGHTS_FILE] if (folder / WEIGHTS_FILE).is_file() else sorted(folder.glob("*.safetensors"))
    if not files:
        _refuse_pickles(folder, given)
        raise ConfigError(f"--init_from={given}: '{folder}' has a config.json but no weights (model.safetensors, or "
                          f"the shards of {INDEX_FILE}). Download or copy the weights too.")
    return files


def _refuse_pickles(folder: Path, given: str) -> None:
    """Refuse a folder whose weights are pickles only (never opened), naming the command that converts them."""
    pickles = sorted(path.name for path in folder.iterdir() if path.suffix in PICKLE_SUFFIXES and path.is_file())
    if not pickles:
        return
    raise ConfigError(
        f"--init_from={given}: '{folder}' holds its weights as pickles ({', '.join(pickles[:3])}), which can run "
        "code when loaded: lowmem reads safetensors only, and has not opened them. Convert them once, where "
        "transformers is installed (it reads the pickle with weights_only=True, as data): python -c \"from "
        f"transformers import AutoModelForCausalLM as M; M.from_pretrained('{folder}').save_pretrained("
        f"'{folder}-safetensors')\"; then copy the tokenizer files beside it and pass --init_from="
        f"{folder}-safetensors. lowmem starts from {supported_text()}.")
