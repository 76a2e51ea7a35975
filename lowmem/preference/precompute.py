"""`lowmem dpo_reference`: the reference model's log-probabilities of every preference row, computed once in one
streaming pass and written beside the rows, so that a full fine-tune trains without a second model in memory.

For a data set `data/pairs.parquet` (a file, a folder or a glob) the pass writes the folder `data/pairs.reference/`:
one parquet file per row group read, `part-<number>.parquet`, holding that row group's rows with every column they
had, plus `reference_chosen` and `reference_rejected` (`lowmem.config.columns.REFERENCE_COLUMNS`): the starting
model's log-probability of each answer, summed over the tokens the DPO loss counts, as text that reads back to the
same float32. Rows with an empty value get empty reference values (training skips such rows either way).

Each part is written whole or not at all (aside, then renamed), so a pass that stops resumes at the parts missing;
under `accelerate launch` each process computes its share of the row groups (`Share`: group g by process g mod the
number of processes), each with the whole model, into the same folder, so a pass resumes on any number of processes;
`_reference.json` records the model, tokenizer and sequence length the values belong to, and a pass (or a
training run) with others is refused instead of mixing them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Collection

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from lowmem.atomic_files import write_json_atomic
from lowmem.config import TrainConfig
from lowmem.config.columns import REFERENCE_COLUMNS
from lowmem.data.reader import open_parquet
from lowmem.data.sources import build_row_group_index
from lowmem.tokenization.text_tokenizer import load_tokenizer
from lowmem.distributed.fsdp_units import compute_as_fsdp2_bf16
from lowmem.distributed.precision import AUTOCAST, FLOAT32, FSDP2_BF16
from lowmem.errors import ConfigError, DataError
from lowmem.model import GPTConfig
from lowmem.preference.collate import PreferenceCollate
from lowmem.progress import progress_bar
from lowmem.source.finite import check_finite
from lowmem.source.load import empty_model, fill_model, weight_plan
from lowmem.source.locate import ModelSource, find_source
from lowmem.source.settle import StartingPoint, source_record, training_length

logger = logging.getLogger(__name__)

FINGERPRINTS = ("tensors_sha256", "content_sha256")  # of the model's tensors' headers, of their bytes
RECORD_NAME = "_reference.json"  # "_": pyarrow and pandas, reading the folder, pass it by
SUFFIX = ".reference"


def reference_folder(files: str) -> Path:
    """Where the pass over `files` writes: beside them, `<file or folder without .parquet>.reference`."""
    if any(mark in files for mark in "*?[") or "://" in files:
        raise ConfigError(f"{files} is a pattern or a remote location, and the reference's values are written beside "
                          "the data, on this machine: pass a local file or folder that holds the rows (copy remote "
                          "data here first).")
    path = Path(files.rstrip("/"))
    return path.with_name(path.name.removesuffix(".parquet") + SUFFIX)


@dataclasses.dataclass(frozen=True)
class Share:
    """This process's part of a pass on several processes: the row groups whose number modulo `count` is `rank`;
    `wait` is a barrier of every process, `total` sums a count over them. The default: one process, every group."""

    rank: int = 0
    count: int = 1
    wait: Callable[[], None] = lambda: None
    total: Callable[[int], int] = lambda count: count


def precompute_reference(config: TrainConfig, files: str, output: Path, device: torch.device,
                         given: Collection[str] = (), share: Share = Share(), precision: str = FLOAT32,
                         source: ModelSource | None = None) -> Path:
    """Write the reference log-probabilities of every row of `files` into `output` (see the module's docstring) with
    the model of `config.init_from`, the sequence length training will settle (`given`: the flags set) and
    `config.batch_size_per_gpu` rows per batch; parts already written by an earlier pass with the same model are
    kept. With `share`, this process writes only its row groups, and returns when every process has written its own.
    `precision`: the numerics the training run computes in (`lowmem.distributed.precision`), which the values are
    computed in and recorded with. `source`: the model of `config.init_from`, when the caller found it already (a
    pass over several files checks and fingerprints its weights once). Returns `output`."""
    if not config.init_from:
        raise ConfigError("lowmem dpo_reference computes the reference model's log-probabilities: name that model with "
                          "--init_from=PATH, the one `train --objective=dpo` will start from.")
    columns = (config.prompt_column, config.chosen_column, config.rejected_column)
    index = build_row_group_index(files, columns)  # every file and column checked before anything is computed
    source = source if source is not None else find_source(config.init_from)
    if source.tokenizer_folder is None and not Path(config.tokenizer_dir).is_dir():
        raise ConfigError(f"The model of --init_from={config.init_from} comes without a tokenizer: pass "
                          "--tokenizer_dir=FOLDER with the one it was trained with.")
    tokenizer_folder = source.tokenizer_folder or Path(config.tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_folder, num_threads=1)
    # The length training will settle: of the --train_file's pairs (the same rows as the folder written beside it).
    as_trained = dataclasses.replace(config, objective="dpo", dpo_reference="auto")
    config = dataclasses.replace(config, max_seq_len=training_length(as_trained, source, given, tokenizer))
    model_config = _model_config(source.model_config, config.max_seq_len)
    if source.content_sha256 is None:  # every weight read once: a source with NaN refused, its bytes fingerprinted
        check_finite(source)
    recorded_source = source_record(StartingPoint(model_config, source), config)
    record = {"init_from": config.init_from, **{key: recorded_source[key] for key in FINGERPRINTS},
              "tokenizer": str(tokenizer_folder.resolve()), "max_seq_len": config.max_seq_len,
              "columns": list(columns), "rows": index.num_rows, "row_groups": index.num_row_groups,
              "precision": precision}
    _check_earlier_pass(output, record)  # by every process (it only reads): each stops with the same message
    share.wait()  # every process has read the folder before the main process writes into it
    if share.rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        write_json_atomic(output / RECORD_NAME, {**record, "complete": False})
    share.wait()
    model = empty_model(model_config, device)
    fill_model(model, source, weight_plan(source, model_config))
    model.use_memory_savers(config.loss_chunk_tokens, False)
    model.eval()
    if precision == FSDP2_BF16:
        compute_as_fsdp2_bf16(model)
    collate = PreferenceCollate(tokenizer, config.max_seq_len, columns, skip_identical=False)
    started, written = time.perf_counter(), 0
    groups = range(share.rank, index.num_row_groups, share.count)
    bar = progress_bar(total=len(groups), desc="dpo_reference", unit="row group",
                       enabled=config.progress and share.rank == 0)
    for group in groups:
        part = output / f"part-{group:05d}.parquet"
        if not part.is_file():
            table = _read_group(index, group)
            values = _reference_values(model, collate, table, columns, config, device, precision == AUTOCAST)
            table = table.append_column(REFERENCE_COLUMNS[0], pa.array(values[0], pa.string()))
            table = table.append_column(REFERENCE_COLUMNS[1], pa.array(values[1], pa.string()))
            aside = part.with_name(part.name + ".partial")
            pq.write_table(table, aside)
            os.replace(aside, part)
            written += table.num_rows
        bar.update(1)
    bar.close()
    written = share.total(written)  # also the barrier after which every part is there
    if share.rank == 0:
        write_json_atomic(output / RECORD_NAME, {**record, "complete": True})
        processes = f" by {share.count} processes" if share.count > 1 else ""
        logger.info("Wrote the reference log-probabilities of %s rows (%s computed now%s) to %s in %.0f s.",
                    f"{index.num_rows:,}", f"{written:,}", processes, output, time.perf_counter() - started)
    share.wait()
    return output


def _model_config(model_config: GPTConfig, max_seq_len: int) -> GPTConfig:
    """The source's model, cut at the run's sequence length and without dropout (the reference computes as in eval)."""
    return dataclasses.replace(model_config, max_seq_len=max_seq_len, dropout=0.0)


def _check_earlier_pass(output: Path, record: dict[str, Any]) -> None:
    """An earlier pass into `output` must have been made with the same model, tokenizer, length and rows: its parts
    are kept and the pass resumes; otherwise the folder is refused (nothing in it is deleted)."""
    if not output.exists():
        return
    recorded_file = output / RECORD_NAME
    if not recorded_file.is_file():
        if any(output.iterdir()):
            raise ConfigError(f"{output} exists and holds files that no reference pass wrote: move them away, "
                              "or the data, so that the values can be written beside it.")
        return
    recorded = json.loads(recorded_file.read_text())
    # A record from before precisions and the bytes' fingerprint were recorded names neither: its parts are kept.
    later = ("precision", "content_sha256")
    changed = [key for key in record if recorded.get(key, record[key] if key in later else None) != record[key]
               and key != "init_from"]
    if changed:
        raise ConfigError(f"{output} holds reference values computed with another {', '.join(changed)}: they "
                          "would not be this model's. Remove that folder to compute them anew.")


def _read_group(index: Any, group: int) -> pa.Table:
    file_id = int(index.file_id[group])
    file = index.files[file_id]
    handle = open_parquet(file.path, index.metadata[file_id], file.filesystem)
    try:
        return handle.read_row_group(int(index.group_in_file[group]))
    finally:
        handle.close()


@torch.no_grad()
def _reference_values(model: torch.nn.Module, collate: PreferenceCollate, table: pa.Table, columns: tuple[str, ...],
                      config: TrainConfig, device: torch.device, autocast: bool) -> tuple[list[str], list[str]]:
    """The reference log-probability of each row's chosen and rejected answer, as text ("" where a value is empty)."""
    try:
        texts = [table.column(name).to_pylist() for name in columns]
    except (UnicodeDecodeError, pa.ArrowInvalid) as error:
        raise DataError(f"A row's text is not valid UTF-8 ({error}): lowmem dpo_reference writes a value for "
                        "every row, so fix or drop such rows first (`lowmem train --bad_text=refuse` names the "
                        "row).") from None
    rows = [dict(zip(columns, values)) for values in zip(*texts)]
    chosen: list[str] = [""] * len(rows)
    rejected: list[str] = [""] * len(rows)
    usable = [number for number, row in enumerate(rows) if all(row[name] for name in columns)]
    for start in range(0, len(usable), config.batch_size_per_gpu):
        numbers = usable[start:start + config.batch_size_per_gpu]
        batch = collate([rows[number] for number in numbers])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logps, _ = model(batch["input_ids"].to(device), batch["targets"].to(device), answer_logps=True)
        values = logps.float().cpu().tolist()
        for offset, number in enumerate(numbers):
            chosen[number], rejected[number] = repr(values[offset]), repr(values[len(numbers) + offset])
    return chosen, rejected


def check_precomputed(files: str, max_seq_len: int, model_fingerprint: dict[str, str] | None,
                      precision: str | None = None) -> str | None:
    """Training with --dpo_reference=precomputed: the values in `files` were computed, completely, for this
    sequence length and the model the run starts from (`model_fingerprint`: `source_record`'s `FINGERPRINTS`, the
    bytes' compared where both sides have it; None where it is not known), as the record beside them says. Values
    computed in other numerics than the run's (`precision`) are used: the warning to log is returned (the first step's
    loss is then not ln 2), else None."""
    record_file = Path(files.rstrip("/")) / RECORD_NAME
    if not record_file.is_file():
        raise ConfigError(f"--dpo_reference=precomputed reads the values `lowmem dpo_reference` writes, and {files} "
                          f"has no {RECORD_NAME} beside its rows: run `lowmem dpo_reference --init_from=MODEL "
                          "--train_file=... --validation_file=...` and train on the folders it writes.")
    recorded = json.loads(record_file.read_text())
    if not recorded.get("complete", False):
        raise ConfigError(f"The reference pass into {files} did not finish: run `lowmem dpo_reference` again with "
                          "the same flags (it resumes), then train.")
    if recorded.get("max_seq_len") != max_seq_len:
        raise ConfigError(f"The reference values in {files} were computed with --max_seq_len="
                          f"{recorded.get('max_seq_len')}, and this run cuts sequences at {max_seq_len}: the log-"
                          "probabilities would be over other tokens. Train with that --max_seq_len, or compute them "
                          "again with this one.")
    compared = next((key for key in reversed(FINGERPRINTS)
                     if model_fingerprint and key in model_fingerprint and key in recorded), None)
    if compared is not None and model_fingerprint is not None and recorded[compared] != model_fingerprint[compared]:
        raise ConfigError(f"The reference values in {files} were computed with the model of --init_from="
                          f"{recorded.get('init_from')}, whose tensors are not those of the model this run starts "
                          "from: compute them again with `lowmem dpo_reference` and this run's --init_from.")
    computed_in = recorded.get("precision")
    if precision is None or computed_in is None or computed_in == precision:
        return None
    return (f"The reference values in {files} were computed in {computed_in}, and this run computes in {precision}: "
            "the policy starts away from its reference, and step 0's DPO loss is not ln 2. Run `lowmem dpo_reference` "
            "under the launcher this run uses to compute them as it does.")
