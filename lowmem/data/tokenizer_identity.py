"""Which tokenizer a run trains with: its model file's hash and the data it was trained on.

A checkpoint's token ids mean something only with the tokenizer that made them: the identity is logged when a
run starts, written to `<output_dir>/tokenizer.json` and into every checkpoint, and a resume with a tokenizer
of another hash is refused (`check_same_tokenizer`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

from lowmem.errors import ConfigError

TRAINING_RECORD_FILE = "tokenizer_training.json"  # beside tokenizer.model: what it was trained on
MAX_FILES_LISTED = 20  # a data set of thousands of files is recorded by its first files and its count


def write_training_record(out_dir: Path, files: Sequence[str], columns: Sequence[str], vocab_size: int,
                          sentences: int) -> dict[str, Any]:
    """Record, beside a newly trained tokenizer, the data it was trained on; returns the record."""
    record = {"files": [str(file) for file in files[:MAX_FILES_LISTED]], "file_count": len(files),
              "columns": list(columns), "vocab_size_asked": vocab_size, "sentences": sentences}
    (out_dir / TRAINING_RECORD_FILE).write_text(json.dumps(record, indent=2, ensure_ascii=False), encoding="utf-8")
    return record


def tokenizer_identity(tokenizer_dir: str | Path, model_file: str = "tokenizer.model") -> dict[str, Any]:
    """The tokenizer in `tokenizer_dir`: its folder, the sha256 of its model file, and the data it was trained on
    (None for a tokenizer trained before that was recorded)."""
    folder = Path(tokenizer_dir)
    digest = hashlib.sha256((folder / model_file).read_bytes()).hexdigest()
    try:
        trained_on = json.loads((folder / TRAINING_RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        trained_on = None
    return {"tokenizer_dir": str(folder), "sha256": digest, "trained_on": trained_on}


def describe_identity(identity: dict[str, Any]) -> str:
    """One line: folder, short hash and training data of a tokenizer."""
    trained_on = identity.get("trained_on")
    if trained_on:
        files = trained_on.get("files") or []
        more = trained_on.get("file_count", len(files)) - len(files[:2])
        data = ", ".join(files[:2]) + (f" and {more} more file(s)" if more > 0 else "")
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
