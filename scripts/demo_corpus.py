"""Build the demo data set: Song ci and Yuan qu from the chinese-poetry corpus as prompt/response pairs.

The source folder has the layout of the chinese-poetry package: ``songci/ci.song.*.json`` (records with
``rhythmic``, ``author``, ``paragraphs``) and ``yuanqu/yuanqu.json`` (records with ``title``, ``author``,
``paragraphs``). Each usable poem becomes exactly one row, using one of three task templates:

- ``ci_write``: tune name (and author) -> the whole ci;
- ``qu_write``: title (and author) -> the whole qu;
- ``continue``: the first half of a ci or qu -> its second half.

Poems are deduplicated (including textual variants of the same poem) and split by poem, so no poem's
text is in two splits.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lowmem.errors import DataError

SPLITS = ("train", "valid", "test")
# Fractions of poems held out; train gets the rest (about 94%).
HELD_OUT_FRACTION = {"valid": 0.03, "test": 0.03}

# A response of at most 300 characters keeps prompt + response within ~256-320 tokens for a small model.
MAX_TEXT_CHARS = 300
# 16 characters is the shortest complete ci form (十六字令); anything shorter is a fragment.
MIN_HAN_CHARS = 16
# A continuation task needs enough on both sides to be a task, not a single word.
MIN_HALF_HAN_CHARS = 5
# Lines this long are distinctive enough that sharing many of them means "the same poem, another version".
DEDUP_LINE_CHARS = 5
DEDUP_SHARED_FRACTION = 0.5

# Stored in every file's metadata, so the notice travels with the data even without its LICENSE file.
LICENSE_NOTE = 'Built from "chinese-poetry": MIT licence, Copyright (c) 2016 JackeyGao'

_HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"
_HAN_RE = re.compile(f"[{_HAN}]")
# Chinese punctuation used by the corpus. Anything else (kana, Latin, "�", "…", "<") marks mojibake,
# elided text or leftovers of web pages, and the record is skipped.
_TEXT_RE = re.compile(f"[{_HAN}，。、；：？！“”‘’\"《》〔〕·]+")
_NAME_RE = re.compile(f"[{_HAN}]+(・[{_HAN}]+)*")
# A closing quote after a full stop belongs to the sentence it closes.
_SENTENCE_END_RE = re.compile(r"[。！？；]+[\"”’]*")
_LINE_SPLIT_RE = re.compile(r"[，。、；：？！“”‘’\"《》〔〕·]+")
# yuanqu.json ends every paragraph with "。", even after "？" or "！".
_DOUBLED_STOP_RE = re.compile(r"([！？，：；、])。")

# Qu titles that only say "same tune as the previous piece" or number the parts of a suite ("二"):
# useless as a prompt on their own.
_PLACEHOLDER_TITLES = {"前腔", "前腔换头", "同前", "同前换头", "幺", "幺篇", "么", "么篇", "又", "又一体"}
_PLACEHOLDER_TITLES |= set("一二三四五六七八九十")
# Brackets hold stage directions and dialogue of plays ("(旦云)…") or editorial notes ("（下缺）");
# southern-drama scripts also write "合前" for "sing the chorus as before", without the chorus.
_NOTE_RE = re.compile(r"[()（）\[\]［］]|合前")
_UNKNOWN_TUNE = "失调名"
_ANONYMOUS = "无名氏"


@dataclass(frozen=True)
class Poem:
    """One cleaned poem: ``name`` is the ci tune or qu title, ``author`` is empty when unknown."""

    kind: str  # "ci" or "qu"
    name: str
    author: str
    text: str


def build_demo_corpus(source_dir: Path, out_dir: Path, seed: int = 0, row_group_rows: int = 2000) -> dict:
    """Build ``train.parquet``, ``valid.parquet`` and ``test.parquet`` in ``out_dir`` from the corpus.

    Args:
        source_dir: folder with ``songci/ci.song.*.json`` and/or ``yuanqu/yuanqu.json``.
        out_dir: folder to write the three parquet files into (created if missing). A ``LICENSE`` file
            in ``source_dir`` is copied beside them, because the built data must carry the notice.
        seed: seeds the split, the template choice and the row order; the same seed gives the same files.
        row_group_rows: rows per parquet row group; small groups keep the streaming reader's memory low.

    Returns:
        A summary: rows per split, poems per kind, rows per template, skipped records per reason,
        file paths and sizes in bytes.

    Raises:
        DataError: when the source folder has no corpus files or no usable poem.
        ValueError: when ``row_group_rows`` is not positive.
    """
    if row_group_rows < 1:
        raise ValueError(f"row_group_rows must be at least 1, got {row_group_rows}")
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    files = _source_files(source_dir)
    if not files:
        raise DataError(
            f"no corpus files under {source_dir}: expected songci/ci.song.*.json or yuanqu/yuanqu.json"
        )

    skipped: Counter = Counter()
    poems = _read_poems(files, skipped)
    if not poems:
        raise DataError(f"no usable poem in the corpus files under {source_dir}")

    split_poems = _split_by_poem(poems, random.Random(f"split:{seed}"))
    template_rng = random.Random(f"template:{seed}")
    shuffle_rng = random.Random(f"shuffle:{seed}")
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {
        "seed": seed,
        "row_group_rows": row_group_rows,
        "rows": {},
        "poems": dict(Counter(p.kind for p in poems)),
        "templates": Counter(),
        "skipped": {kind: {r: n for (k, r), n in sorted(skipped.items()) if k == kind} for kind in ("ci", "qu")},
        "files": {},
        "bytes": {},
    }
    for split in SPLITS:
        rows = [_make_row(poem, template_rng) for poem in split_poems[split]]
        # Poems were shuffled to draw the split; shuffling the rows again keeps the row order
        # independent of how the split was drawn.
        shuffle_rng.shuffle(rows)
        summary["templates"].update(template for template, _, _ in rows)
        path = out_dir / f"{split}.parquet"
        _write_parquet(path, [(p, r) for _, p, r in rows], row_group_rows)
        summary["rows"][split] = len(rows)
        summary["files"][split] = str(path)
        summary["bytes"][split] = path.stat().st_size
    summary["templates"] = dict(summary["templates"])
    summary["license_copied"] = _copy_license(source_dir, out_dir)
    return summary


def _source_files(source_dir: Path) -> list[tuple[str, Path]]:
    """The corpus files to read, as (kind, path), in a fixed order so deduplication is deterministic."""
    # 宋词三百首.json is not read: its 280 poems are the ones tagged "宋词三百首" in the numbered files.
    ci_files = sorted((source_dir / "songci").glob("ci.song.*.json"), key=_ci_file_order)
    qu_file = source_dir / "yuanqu" / "yuanqu.json"
    files = [("ci", path) for path in ci_files]
    if qu_file.is_file():
        files.append(("qu", qu_file))
    return files


def _ci_file_order(path: Path) -> tuple[int, int, str]:
    """Numbered files first, in numeric order; then others (ci.song.2019y.json holds later variants)."""
    suffix = path.name[len("ci.song.") : -len(".json")]
    return (0, int(suffix), "") if suffix.isdigit() else (1, 0, suffix)


def _read_poems(files: list[tuple[str, Path]], skipped: Counter) -> list[Poem]:
    """Parse, clean and deduplicate the poems of all files; count skipped records in ``skipped[(kind, reason)]``."""
    dedup = _Deduplicator()
    poems: list[Poem] = []
    for kind, path in files:
        try:
            records = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"cannot read corpus file {path}: {exc}") from exc
        if not isinstance(records, list):
            raise DataError(f"corpus file {path} should hold a JSON list of records")
        for record in records:
            poem, reason = _clean_record(kind, record)
            if poem is not None and dedup.seen(poem.text):
                poem, reason = None, "duplicate"
            if poem is None:
                skipped[(kind, reason)] += 1
                continue
            dedup.add(poem.text)
            poems.append(poem)
    return poems


def _clean_record(kind: str, record: object) -> tuple[Poem | None, str]:
    """Turn a JSON record into a Poem, or return (None, reason) when it is unusable."""
    if not isinstance(record, dict) or not isinstance(record.get("paragraphs"), list):
        return None, "malformed"
    paragraphs = [p.strip() for p in record["paragraphs"] if isinstance(p, str)]
    text = "".join(paragraphs)
    name = str(record.get("rhythmic" if kind == "ci" else "title") or "").strip()
    if kind == "qu":
        name, text = _repair_qu_title(name, text)
        text = _DOUBLED_STOP_RE.sub(r"\1", text)
    reason = _text_problem(text)
    if reason:
        return None, reason
    clean_name = _clean_ci_tune(name) if kind == "ci" else _clean_qu_title(name)
    if not clean_name and _split_in_half(text) is None:
        # Neither template fits: no name to ask for and no second half to continue to.
        return None, "no_task"
    return Poem(kind, clean_name, _clean_author(str(record.get("author") or "")), text), ""


def _repair_qu_title(title: str, text: str) -> tuple[str, str]:
    """Move the opening of the text back out of the title.

    About 2,000 records of yuanqu.json have titles like "寄生草・为甚忧，为甚愁？…" (cut at ~32
    characters) whose paragraphs start mid-sentence: the title holds the tune name plus the start of
    the text.
    """
    tune, sep, rest = title.partition("・")
    if sep and re.search(r"[，。、；：？！]", rest):
        return tune, rest + text
    return title, text


def _text_problem(text: str) -> str:
    """The reason a poem text is unusable, or "" when it is fine."""
    if not text:
        return "empty"
    if "□" in text:
        # "□" stands for a lost character; a poem with holes is a poor training target.
        return "missing_chars"
    if _NOTE_RE.search(text):
        return "notes_in_text"
    if not _TEXT_RE.fullmatch(text):
        return "bad_chars"
    if len(_HAN_RE.findall(text)) < MIN_HAN_CHARS:
        return "too_short"
    if len(text) > MAX_TEXT_CHARS:
        return "too_long"
    return ""


def _clean_ci_tune(rhythmic: str) -> str:
    """The tune name if it can go in a prompt; "" for unknown or damaged tune names."""
    if rhythmic == _UNKNOWN_TUNE or not _NAME_RE.fullmatch(rhythmic):
        return ""
    return rhythmic


def _clean_qu_title(title: str) -> str:
    """A title fit for a prompt ("双调・蟾宫曲"), or "" when it carries no information."""
    # "(第四本)" numbers the part of a play; "仙吕/点绛唇" is written "仙吕・点绛唇" elsewhere.
    title = re.sub(r"[(（][^)）]*[)）]", "", title).replace("/", "・")
    if not _NAME_RE.fullmatch(title) or title.split("・")[-1] in _PLACEHOLDER_TITLES:
        return ""
    return title


def _clean_author(author: str) -> str:
    """The poet's name for a prompt, or "" when anonymous or damaged."""
    # "高明《蔡伯喈琵琶记》" names the play too; "吴氏3" numbers namesakes apart.
    author = re.sub(r"《[^》]*》", "", author).strip().rstrip("0123456789")
    if author == _ANONYMOUS or not re.fullmatch(f"[{_HAN}]+", author):
        return ""
    return author


class _Deduplicator:
    """Recognises poems already seen, including other versions of them.

    The corpus holds the same poem more than once, sometimes as a textual variant: lines swapped,
    a character changed, half of it in traditional characters (ci.song.2019y.json). A poem counts as
    seen when its text matches exactly, or when at least half of its distinctive lines were seen.
    """

    def __init__(self) -> None:
        self._texts: set[str] = set()
        self._lines: set[str] = set()

    def seen(self, text: str) -> bool:
        if _han_only(text) in self._texts:
            return True
        lines = _distinctive_lines(text)
        if not lines:
            return False
        shared = sum(line in self._lines for line in lines)
        return shared >= DEDUP_SHARED_FRACTION * len(lines)

    def add(self, text: str) -> None:
        self._texts.add(_han_only(text))
        self._lines.update(_distinctive_lines(text))


def _han_only(text: str) -> str:
    return "".join(_HAN_RE.findall(text))


def _distinctive_lines(text: str) -> set[str]:
    return {line for line in _LINE_SPLIT_RE.split(text) if len(line) >= DEDUP_LINE_CHARS}


def _split_by_poem(poems: list[Poem], rng: random.Random) -> dict[str, list[Poem]]:
    """Assign whole poems to splits; valid and test get about 3% each, and at least one poem when possible."""
    order = list(range(len(poems)))
    rng.shuffle(order)
    sizes = {}
    for split, fraction in HELD_OUT_FRACTION.items():
        # Tiny corpora still get a non-empty valid and test split, as long as train keeps a poem.
        sizes[split] = max(1, round(fraction * len(poems))) if len(poems) >= len(SPLITS) else 0
    start, result = 0, {}
    for split in ("valid", "test"):
        result[split] = [poems[i] for i in order[start : start + sizes[split]]]
        start += sizes[split]
    result["train"] = [poems[i] for i in order[start:]]
    return result


def _make_row(poem: Poem, rng: random.Random) -> tuple[str, str, str]:
    """Pick one of the templates the poem supports and return (template, prompt, response)."""
    halves = _split_in_half(poem.text)
    templates = ([f"{poem.kind}_write"] if poem.name else []) + (["continue"] if halves else [])
    template = rng.choice(templates)
    if template == "continue":
        first, second = halves
        return template, _continue_prompt(poem, first), second
    return template, _write_prompt(poem), poem.text


def _write_prompt(poem: Poem) -> str:
    genre = "宋词" if poem.kind == "ci" else "元曲"
    style = f"一首{poem.author}风格的{genre}" if poem.author else f"一首{genre}"
    # A qu title without "・" is a bare tune name ("红绣鞋"); with it, a mode or play plus the tune.
    if poem.kind == "ci" or "・" not in poem.name:
        return f"请以《{poem.name}》为{'词牌' if poem.kind == 'ci' else '曲牌'}，写{style}。"
    return f"请以《{poem.name}》为题，写{style}。"


def _continue_prompt(poem: Poem, first_half: str) -> str:
    genre = "宋词" if poem.kind == "ci" else "元曲"
    named = f"{genre}《{poem.name}》" if poem.name else genre
    return f"续写下面这首{named}的后半首：{first_half}"


def _split_in_half(text: str) -> tuple[str, str] | None:
    """Cut the text at the sentence end closest to its middle; None when there is no good place to cut."""
    ends = [
        m.end()
        for m in _SENTENCE_END_RE.finditer(text)
        if len(_HAN_RE.findall(text[: m.end()])) >= MIN_HALF_HAN_CHARS
        and len(_HAN_RE.findall(text[m.end() :])) >= MIN_HALF_HAN_CHARS
    ]
    if not ends:
        return None
    cut = min(ends, key=lambda end: abs(2 * end - len(text)))
    return text[:cut], text[cut:]


def _write_parquet(path: Path, rows: list[tuple[str, str]], row_group_rows: int) -> None:
    """Write rows as a zstd parquet file with small row groups; atomically, so a crash leaves no half file."""
    schema = pa.schema(
        [("prompt", pa.string()), ("response", pa.string())],
        metadata={"license": LICENSE_NOTE},
    )
    table = pa.table(
        {"prompt": [p for p, _ in rows], "response": [r for _, r in rows]},
        schema=schema,
    )
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp, row_group_size=row_group_rows, compression="zstd")
    os.replace(tmp, path)


def _copy_license(source_dir: Path, out_dir: Path) -> bool:
    """Copy the corpus licence beside the built files; return whether there was one to copy."""
    license_file = source_dir / "LICENSE"
    if not license_file.is_file():
        return False
    shutil.copyfile(license_file, out_dir / "LICENSE")
    return True
