"""What a run started from a trained model uses: the source's shape and tokenizer, settled into the run's config.

    field                          a new run with --init_from              its resume
    architecture, n_layer,         the source's; a flag that disagrees     the checkpoint's (as every resume)
      n_head, n_embd, vocab_size     is refused
    max_seq_len                    transformers: as given, else the length the checkpoint's
                                   that keeps 99% of a sample of the
                                   rows whole; within the source's
                                   context and sliding window; lowmem:
                                   the source's unless given (gpt2:
                                   always)
    learn_rate, weight_decay,      the stage's unless given                the checkpoint's, unless given
      epochs, eval_bleu_samples      (`lowmem.source.stage`)
    tokenizer_dir                  <output_dir>/tokenizer, where the       the checkpoint's
                                   source's tokenizer is copied (or as
                                   given: an existing tokenizer)
    the model's every size         the source's (`StartingPoint`)          the checkpoint's model_config.json

The run's optimizer, learning-rate schedule (its warmup from step 0) and data position are new. The source is
read again by nothing after the start: a resume needs only the run folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection

from lowmem.adapters.files import checked_base
from lowmem.adapters.targets import canonical_targets
from lowmem.atomic_files import write_json_atomic
from lowmem.config import ModelConfig, TrainConfig
from lowmem.config.columns import data_columns, is_preference
from lowmem.config.train_sources import training_paths
from lowmem.data.lengths import LENGTH_FROM_ROWS_CAP, WHOLE_SHARE, length_keeping
from lowmem.data.sizing import sample_batch_sizes
from lowmem.data.sources import build_row_group_index
from lowmem.tokenization.text_tokenizer import check_fits_model, has_tokenizer, load_tokenizer
from lowmem.errors import ConfigError
from lowmem.hf.architectures import sliding_window
from lowmem.hf.weight_map import WeightSource
from lowmem.model import GPTConfig
from lowmem.model.weights import load_model_config
from lowmem.source.finite import content_fingerprint
from lowmem.source.load import LoadedWeights, weight_plan
from lowmem.source.locate import LOWMEM, RUN_TOKENIZER_DIR, TRANSFORMERS, ModelSource, find_source
from lowmem.source.stage import StageChoice, choose_stage_defaults, kept_on_resume

logger = logging.getLogger(__name__)

# The run folder's record of where its weights came from (written once, when the run starts).
SOURCE_RECORD_NAME = "started_from.json"
# The fields a source decides, each with the GPTConfig attribute it comes from.
SHAPE_FROM_SOURCE = {"architecture": "architecture", "n_layer": "n_layer", "n_head": "n_head", "n_embd": "n_embd",
                     "vocab_size": "vocab_size"}


@dataclass(frozen=True)
class StartingPoint:
    """The model a run starts from, as its start-up settled it.

    Attributes:
        model_config: the run's model: the source's sizes with the run's sequence length and dropout.
        source: the weights to load (a new run); None for a resume, which loads its checkpoint's.
        tokenizer_folder: where the tokenizer is read before the run folder holds its copy (None: the run's own).
    """

    model_config: GPTConfig
    source: ModelSource | None = None
    tokenizer_folder: Path | None = None
    weights: dict[str, WeightSource] = field(default_factory=dict, repr=False)  # `weight_plan`, for a new run
    # True for the resume of a run that trains adapters: `source` is then the run's own base (`<run>/base`), filled
    # in before the checkpoint's adapters are loaded; nothing of a new start (its line, its record) is repeated.
    resumed: bool = False
    stage: StageChoice | None = None  # a new run: the values its stage chose (`lowmem.source.stage`)


def settle_source(config: TrainConfig, given: Collection[str], saved_config: dict[str, Any] | None,
                  checkpoint: Path | None) -> tuple[TrainConfig, StartingPoint | None]:
    """`config` with what its source decides, and the starting point; (config, None) for a run from random weights.

    A resume (`saved_config`, the config of `checkpoint`) keeps the source and sizes it was saved with: the source's
    folder is not read again. `--init_from` with `--is_keep_training` and no checkpoint is refused: the two ask
    for different things.
    """
    # Only a value other than the default is a sign the user meant adapters: a saved config lists every field.
    defaults = ModelConfig()
    ignored = [f"--{name}" for name in ("lora_alpha", "lora_dropout", "lora_targets")
               if name in given and getattr(config, name) != getattr(defaults, name)]
    if ignored and not config.lora_rank:
        raise ConfigError(f"{', '.join(ignored)} shape{'s' if len(ignored) == 1 else ''} the adapters that "
                          "--lora_rank=R trains, and no --lora_rank was given: add it (8 to 64 are usual) to train "
                          "adapters, or leave those flags out to train every weight.")
    saved_source = (saved_config or {}).get("init_from") or ""
    if saved_config is not None:
        if not saved_source:
            return config, None
        return _resumed(config, given, saved_config, checkpoint)
    if not config.init_from:
        if is_preference(config):
            raise ConfigError(
                "--objective=dpo tunes a trained model towards the chosen answers and away from the rejected ones, "
                "measured against that same model as it started (the reference): name it with --init_from=PATH (a "
                "lowmem run or model folder, e.g. your SFT run's, or a transformers Llama, Qwen2 or Mistral "
                "folder). Preference training from random weights has nothing to start from.")
        if config.lora_rank:
            raise ConfigError(
                f"--lora_rank={config.lora_rank} trains adapters on a model that exists: name it with "
                "--init_from=PATH (a lowmem run or model folder, or a transformers Llama, Qwen2 or Mistral folder). "
                "Adapters on random weights learn little; to train every weight, leave --lora_rank out.")
        return config, None
    source = find_source(config.init_from)
    config = _with_source_shape(config, source, given)
    tokenizer_folder = None if "tokenizer_dir" in given else source.tokenizer_folder
    tokenizer = _checked_tokenizer(config, source, tokenizer_folder)
    config = dataclasses.replace(config, max_seq_len=training_length(config, source, given, tokenizer))
    config, stage = choose_stage_defaults(config, given, source_parameters(source))
    model_config = dataclasses.replace(source.model_config, max_seq_len=config.max_seq_len, dropout=config.dropout)
    if config.lora_rank:  # named once for the checkpoints, and a wrong name refused before anything is read
        config = dataclasses.replace(config, lora_targets=canonical_targets(config.lora_targets, model_config))
    weights = weight_plan(source, model_config)  # every tensor checked before anything is built or written
    return config, StartingPoint(model_config, source, tokenizer_folder, weights, stage=stage)


def training_length(config: TrainConfig, source: ModelSource, given: Collection[str], tokenizer: Any) -> int:
    """The --max_seq_len a new run of `config` from `source` trains at: for a transformers model not given one, the
    length of its training rows (`length_of_rows`, laid out by `tokenizer`), else `sequence_length`'s. What `lowmem
    dpo_reference` computes its values at, too."""
    if source.kind == TRANSFORMERS and "max_seq_len" not in given:  # the rows decide, within the model's context
        sequence_length(config, source, given)  # a --max_seq_len over the context is refused either way
        return length_of_rows(config, tokenizer, context_limit(source)[0])
    return sequence_length(config, source, given)


def length_of_rows(config: TrainConfig, tokenizer: Any, limit: int) -> int:
    """The training length that keeps WHOLE_SHARE of a sample of the training rows whole, laid out by the model's
    tokenizer and template, at most `limit` (the model's context) and LENGTH_FROM_ROWS_CAP (said where it binds)."""
    index = build_row_group_index(training_paths(config), data_columns(config))
    sizes = sample_batch_sizes(index, limit, pack=False, tokenizer=tokenizer, seed=config.seed)
    keeping = min(length_keeping(sizes.lengths), limit)
    if keeping > LENGTH_FROM_ROWS_CAP:
        logger.warning("The training rows need --max_seq_len=%d to keep %.0f%% of them whole; trained at %d, the "
                       "length fine-tuning tools cut at by default (TRL's max_length): pass --max_seq_len=%d to "
                       "train them whole (lowmem plan shows its memory first).", keeping, WHOLE_SHARE * 100,
                       LENGTH_FROM_ROWS_CAP, keeping)
    return min(keeping, LENGTH_FROM_ROWS_CAP)


def source_parameters(source: ModelSource) -> int:
    """The parameters of the source's tensors, from their headers."""
    return sum(math.prod(entry.shape) for entry in source.tensors.values())


def _checked_tokenizer(config: TrainConfig, source: ModelSource, folder: Path | None) -> Any:
    """The tokenizer the run will use: it exists (none is trained for a model that has one) and its ids fit the
    model's embedding."""
    folder = folder or Path(config.tokenizer_dir)
    if not has_tokenizer(folder):
        where = f"'{folder}'" if folder != Path(config.tokenizer_dir) or source.tokenizer_folder is None else ""
        raise ConfigError(f"The model of --init_from={config.init_from} comes without a tokenizer {where}(no "
                          "tokenizer.json or tokenizer.model beside it or in its run): pass --tokenizer_dir=FOLDER "
                          "with the tokenizer it was trained with.")
    tokenizer = load_tokenizer(folder, num_threads=1)
    check_fits_model(tokenizer, folder, source.model_config.padded_vocab_size,
                     f"the model of --init_from={config.init_from}")
    return tokenizer


def refuse_keep_training_without_run(config: TrainConfig) -> None:
    """`--init_from` with `--is_keep_training=True` where the run folder holds no checkpoint: say which to use."""
    raise ConfigError(
        f"--init_from={config.init_from} starts a new run from that model, and --is_keep_training=True continues the "
        f"run in {config.output_dir}, which holds no checkpoint. To start, leave --is_keep_training out; to continue "
        "a run started from a model, pass the --output_dir it trained in (its checkpoints record the source).")


def _resumed(config: TrainConfig, given: Collection[str], saved: dict[str, Any],
             checkpoint: Path | None) -> tuple[TrainConfig, StartingPoint]:
    """A resume of a run started from a model: its source and sizes as saved (a different --init_from is refused
    by the resume's check, as any changed setting)."""
    changes = {name: saved[name] for name in (*SHAPE_FROM_SOURCE, "max_seq_len") if name not in given
               and name in saved}
    if "init_from" not in given:
        changes["init_from"] = saved["init_from"]
    config = kept_on_resume(dataclasses.replace(config, **changes), given, saved)
    assert checkpoint is not None  # a saved config comes from a checkpoint
    model_config = dataclasses.replace(load_model_config(checkpoint), max_seq_len=config.max_seq_len,
                                       dropout=config.dropout)
    if not saved.get("lora_rank"):
        return config, StartingPoint(model_config)
    if config.lora_rank:  # in the spelling the run saved (`canonical_targets`): the same set is no change
        config = dataclasses.replace(config, lora_targets=canonical_targets(config.lora_targets, model_config))
    # Adapters: the checkpoint holds them alone, and the base is the run's copy, unchanged since the start.
    base = find_source(str(checked_base(Path(config.output_dir))))
    return config, StartingPoint(model_config, base, None, weight_plan(base, model_config), resumed=True)


def _with_source_shape(config: TrainConfig, source: ModelSource, given: Collection[str]) -> TrainConfig:
    """`config` with the source's sizes and sequence length; shape flags that disagree refused in one message."""
    model = source.model_config
    values: dict[str, Any] = {field: getattr(model, attribute) for field, attribute in SHAPE_FROM_SOURCE.items()}
    values["max_seq_len"] = sequence_length(config, source, given)
    disagree = [f"--{name}={getattr(config, name)} (the model has {value})" for name, value in values.items()
                if name in given and getattr(config, name) != value]
    if disagree:
        raise ConfigError(f"--init_from={config.init_from} gives the model its shape, and {', '.join(disagree)} "
                          "disagree: leave these flags out (the run takes the model's), or train a model of your own "
                          "shape without --init_from.")
    if "tokenizer_dir" not in given:
        values["tokenizer_dir"] = str(Path(config.output_dir) / RUN_TOKENIZER_DIR)
    return dataclasses.replace(config, **values)


def sequence_length(config: ModelConfig, source: ModelSource, given: Collection[str]) -> int:
    """The run's --max_seq_len: a learned position table's (gpt2) always; a lowmem llama's unless given; for a
    transformers model, as given (or the default), within its context and sliding window."""
    model = source.model_config
    if model.architecture == "gpt2":
        return model.max_seq_len  # its position table has that many rows: a flag that differs is refused
    if source.kind == LOWMEM:
        return config.max_seq_len if "max_seq_len" in given else model.max_seq_len
    limit, why = context_limit(source)
    if config.max_seq_len > limit:
        raise ConfigError(f"--max_seq_len={config.max_seq_len} is longer than {why}, {limit:,} tokens, in the model "
                          f"of --init_from={config.init_from}: pass --max_seq_len={limit} or less.")
    return config.max_seq_len


def context_limit(source: ModelSource) -> tuple[int, str]:
    """The longest training sequence a transformers source takes, and why: its context (max_position_embeddings),
    or its sliding attention window where that is shorter."""
    model = source.model_config
    limit, why = model.max_seq_len, "its context (max_position_embeddings)"
    window = sliding_window(model)
    if window is not None and window < limit:
        limit, why = window, "its sliding attention window"
    return limit, why


def describe_start(start: StartingPoint, loaded: LoadedWeights, parameters: int, tokenizer: str) -> str:
    """The one line that says what a new run loaded: the source and the folder chosen, the model, its parameters
    and dtypes, the time, and the tokenizer."""
    source, model = start.source, start.model_config
    assert source is not None  # said when a new run starts from a source
    heads = f"{model.n_head} heads" + (f" ({model.kv_heads} key/value)" if model.kv_heads != model.n_head else "")
    return (f"Started from {source.description}: {model.architecture}, {model.n_layer} layers x {model.n_embd} wide, "
            f"{heads}, {parameters / 1e6:,.1f} M parameters{'' if model.tie_embeddings else ' (untied head)'}, "
            f"stored as {', '.join(source.stored_dtypes)}, loaded as float32 in {loaded.seconds:.1f} s "
            f"({loaded.bytes_written / 2**20:,.1f} MB written by this process); tokenizer: {tokenizer}. The optimizer, "
            "the learning-rate schedule (its warmup from step 0) and the data position are new.")


def write_source_record(start: StartingPoint, config: TrainConfig) -> None:
    """Write the run folder's record of its source (`source_record`), once, when a new run starts from one."""
    write_json_atomic(Path(config.output_dir) / SOURCE_RECORD_NAME, source_record(start, config))


def source_record(start: StartingPoint, config: ModelConfig) -> dict[str, Any]:
    """What the run folder records of its source (`SOURCE_RECORD_NAME`): the path given, the folder read and why,
    its kind and shape, the dtypes and two fingerprints of its tensors: of their names, dtypes, shapes and sizes
    from the headers (`tensors_sha256`), and of their bytes (`content_sha256`, from the scan that checked them for
    NaN: another checkpoint of the same shapes has another)."""
    source = start.source
    assert source is not None  # recorded when a new run starts from a source
    listing = sorted((name, str(entry.dtype), entry.shape, entry.end - entry.start)
                     for name, entry in source.tensors.items())
    fingerprint = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
    return {"init_from": config.init_from, "folder": str(source.folder.resolve()), "chosen": source.chosen,
            "kind": source.kind, "description": source.description, "stored_dtypes": source.stored_dtypes,
            "tensors_sha256": fingerprint, "content_sha256": content_fingerprint(source),
            "model_config": dataclasses.asdict(start.model_config),
            "tokenizer_from": None if source.tokenizer_folder is None else str(source.tokenizer_folder.resolve()),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
