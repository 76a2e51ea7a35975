"""Which tokenizer a run trains with: its model file's hash and the data it was trained on.

A checkpoint's token ids mean something only with the tokenizer that made them: the identity is logged when a
run starts, written to `<output_dir>/tokenizer.json` and into every checkpoint, and a resume with a tokenizer
of another hash is refused (`check_same_tokenizer`). A new run compares the tokenizer's training record with its
own training files (`trained_on_same_files`): pieces learned from other text are not taken without a word.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

from lowmem.data.storage import is_uri
from lowmem.errors import ConfigError

TRAINING_RECORD_FILE = "tokenizer_training.json"  # beside tokenizer.model: what it was trained on
ORIGIN_RECORD_FILE = "tokenizer_origin.json"  # beside a tokenizer copied from a model a run starts from: which one
MAX_FILES_LISTED = 20  # a data set of thousands of files is recorded by its first files and its count


def write_training_record(out_dir: Path, files: Sequence[str], columns: Sequence[str], vocab_size: int,
                          sentences: int) -> dict[str, Any]:
    """Record, beside a newly trained tokenizer, the data it was trained on; returns the record."""
    record = {"files": [str(file) for file in files[:MAX_FILES_LISTED]], "file_count": len(files),
              "columns": list(columns), "vocab_size_asked": vocab_size, "sentences": sentences}
    (out_dir / TRAINING_RECORD_FILE).write_text(json.dumps(record, indent=2, ensure_ascii=False), encoding="utf-8")
    return record


def read_training_record(tokenizer_dir: str | Path) -> dict[str, Any] | None:
    """What the tokenizer in `tokenizer_dir` was trained on (`write_training_record`), or None where that was not
    recorded (a tokenizer trained before it was, or one made elsewhere)."""
    try:
        record = json.loads((Path(tokenizer_dir) / TRAINING_RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def data_file_key(path: str) -> str:
    """A training file as records are compared: remote files as named, local ones by their real path, except the
    demo files that ship inside the package, by name (the package's folder changes with the environment)."""
    if is_uri(path):
        return path
    real = Path(os.path.realpath(path))
    return f"lowmem demo data/{real.name}" if real.parent.name == "demo_data" else str(real)


def trained_on_same_files(record: dict[str, Any], files: Sequence[str]) -> bool:
    """Whether a tokenizer's training record names `files`: the same number of files, and each file it lists (the
    first `MAX_FILES_LISTED`) among them."""
    listed = record.get("files") or []
    if record.get("file_count", len(listed)) != len(files):
        return False
    keys = {data_file_key(str(file)) for file in files}
    return all(data_file_key(str(file)) in keys for file in listed)


def describe_files(files: Sequence[str], count: int | None = None) -> str:
    """The first two of `files` and how many more ("a.parquet, b.parquet and 3 more file(s)")."""
    more = (len(files) if count is None else count) - len(files[:2])
    return ", ".join(str(file) for file in files[:2]) + (f" and {more} more file(s)" if more > 0 else "")


# The files that decide a transformers tokenizer's ids and layout (tokenizer.json's pieces, the special tokens and
# the chat template), hashed in this order when the folder has no SentencePiece model.
HF_IDENTITY_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tokenizer_identity(tokenizer_dir: str | Path, model_file: str = "tokenizer.model") -> dict[str, Any]:
    """The tokenizer in `tokenizer_dir`: its folder, the sha256 of its model file (of a transformers tokenizer's
    files, `HF_IDENTITY_FILES`, when it has no SentencePiece model), and the data it was trained on (None for a
    tokenizer trained before that was recorded, or one that came with a model)."""
    folder = Path(tokenizer_dir)
    digest = hashlib.sha256()
    if (folder / model_file).is_file():
        digest.update((folder / model_file).read_bytes())
    else:
        for name in HF_IDENTITY_FILES:
            if (folder / name).is_file():
                digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    identity = {"tokenizer_dir": str(folder), "sha256": digest.hexdigest(), "trained_on": read_training_record(folder)}
    origin = _read_json(folder / ORIGIN_RECORD_FILE)
    if origin and origin.get("came_with"):
        identity["came_with"] = str(origin["came_with"])
    return identity


def write_origin_record(tokenizer_dir: str | Path, model: str) -> None:
    """Record, beside a tokenizer copied from a model (`--init_from`), which model it came with."""
    (Path(tokenizer_dir) / ORIGIN_RECORD_FILE).write_text(json.dumps({"came_with": model}, ensure_ascii=False),
                                                          encoding="utf-8")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def describe_identity(identity: dict[str, Any]) -> str:
    """One line: folder, short hash and training data of a tokenizer."""
    trained_on = identity.get("trained_on")
    if identity.get("came_with"):
        return f"{identity['tokenizer_dir']} (sha256 {identity['sha256'][:12]}, came with {identity['came_with']})"
    if trained_on:
        files = trained_on.get("files") or []
        data = describe_files(files, trained_on.get("file_count", len(files)))
    else:
        data = "data not recorded"
    return f"{identity['tokenizer_dir']} (sha256 {identity['sha256'][:12]}, trained on {data})"


def check_same_tokenizer(saved: dict[str, Any] | None, current: dict[str, Any], checkpoint: Path) -> None:
    """Refuse to resume `checkpoint` with another tokenizer than the one it was trained with (checkpoints saved
    before the identity was recorded pass)."""
    if not saved or saved.get("sha256") == current["sha256"]:
        return
    raise ConfigError(
        f"{checkpoint} was trained with the tokenizer {describe_identity(saved)}, but this run loads "
        f"{describe_identity(current)}: the model's token ids would mean other text. Resume with "
        f"--tokenizer_dir={saved.get('tokenizer_dir')} (the tokenizer it was trained with), or start a new run "
        "in another --output_dir for the new tokenizer.")
