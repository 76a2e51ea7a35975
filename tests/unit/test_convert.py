"""`lowmem convert`: every row it can read is kept, in order, with the fields mapped; whatever is left out is
counted by reason and named by line; outputs are atomic, never replace a file unasked, and read through
ParquetStream (its memory, in fresh processes: tests/integration/test_convert_memory.py)."""

from __future__ import annotations

import csv
import json
import re
import shlex
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from training_helpers import tiny_overrides, write_chat_rows

from lowmem.cli import main
from lowmem.conversion.convert import FieldNames, convert
from lowmem.data.stream import ParquetStream
from lowmem.errors import DataError

PAIRS = [{"prompt": f"问题{i}，请回答", "response": f"回答{i}\n第二行"} for i in range(25)]


def _rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def _jsonl(path: Path, records: list, extra_lines: dict[int, str] | None = None) -> Path:
    """Write records one per line; `extra_lines` puts raw lines at those (1-based) line numbers."""
    lines = [json.dumps(record, ensure_ascii=False) for record in records]
    for number, line in sorted((extra_lines or {}).items()):
        lines.insert(number - 1, line)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _quoted(path: Path | str) -> str:
    """A path as messages quote it, as a regular expression."""
    return re.escape(f"'{path}'")


def _convert_one(source: Path, **options) -> tuple[list[dict], object]:
    [result] = convert(str(source), str(source.with_name("out.parquet")), **options)
    return _rows(Path(result.target)), result


# ----- every row kept, in order, with the mapping applied -------------------------------------------------------
def test_json_lines_keep_every_row_in_order_and_write_numbers_as_text(tmp_path):
    records = [*PAIRS, {"prompt": 12, "response": 3.5}, {"prompt": "yes?", "response": True}]
    rows, result = _convert_one(_jsonl(tmp_path / "chat.jsonl", records), row_group_rows=10)
    assert rows == [*PAIRS, {"prompt": "12", "response": "3.5"}, {"prompt": "yes?", "response": "true"}]
    assert result.rows == 27 and result.row_groups == 3 and not result.skipped.total
    assert pq.ParquetFile(result.target).metadata.num_row_groups == 3
    assert pq.ParquetFile(result.target).metadata.row_group(0).num_rows == 10


def _compressed(path: Path, codec: str, data: bytes) -> None:
    with pa.output_stream(str(path), compression=codec) as out:
        out.write(data)


@pytest.mark.parametrize("name, codec", [("chat.jsonl.gz", "gzip"), ("chat.jsonl.zst", "zstd")])
def test_compressed_json_lines_are_read_as_the_plain_file(tmp_path, name, codec):
    plain = _jsonl(tmp_path / "plain.jsonl", PAIRS)
    _compressed(tmp_path / name, codec, plain.read_bytes())
    [result] = convert(str(tmp_path / name))
    assert result.target == str(tmp_path / "chat.parquet")  # the stem without .jsonl.gz
    assert _rows(tmp_path / "chat.parquet") == PAIRS


@pytest.mark.parametrize("damage", ["cut short .gz", "cut short .zst", "damaged .zst", "not gzip, named .gz"])
def test_a_compressed_input_that_cannot_be_read_to_its_end_stops_with_a_message_and_writes_nothing(
        tmp_path, capsys, damage):
    """A download cut short, a damaged zstd frame, a file that is not what its name says: exit code 2, one message
    naming the file, what is wrong and how far it was read, no traceback and no parquet file left behind."""
    plain = (json.dumps({"prompt": "p" * 100, "response": "r" * 100}) + "\n").encode() * 3000
    name = "chat.jsonl.gz" if ".gz" in damage else "chat.jsonl.zst"
    source = tmp_path / name
    if damage == "not gzip, named .gz":
        source.write_bytes(plain)
    else:
        _compressed(source, "gzip" if ".gz" in damage else "zstd", plain)
        data = bytearray(source.read_bytes())
        if damage == "damaged .zst":
            data[len(data) // 2: len(data) // 2 + 64] = bytes(byte ^ 0xFF for byte in data[len(data) // 2:][:64])
        else:
            data = data[: len(data) // 2]
        source.write_bytes(bytes(data))
    assert main(["convert", str(source)]) == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error and f"'{source}'" in error and "Nothing was written" in error
    expected = "ends in the middle of its" if "cut short" in damage else "is not valid"
    assert expected in error and ("lines were read" in error or "not one line of it could be read" in error)
    assert sorted(path.name for path in tmp_path.iterdir()) == [name]  # no parquet, no partial file


def test_a_json_array_is_streamed_record_by_record_and_a_non_object_named_by_line(tmp_path):
    source = tmp_path / "chat.json"
    records = [*PAIRS[:3], [1, 2], *PAIRS[3:]]
    source.write_text(json.dumps(records, ensure_ascii=False, indent=2), encoding="utf-8")
    rows, result = _convert_one(source)
    assert rows == PAIRS
    # Each record of indent=2 output takes 4 lines after the opening "[": the list starts on line 14.
    assert result.skipped.counts == {"not a JSON object": 1} and result.skipped.lines["not a JSON object"] == [14]


def test_a_json_array_larger_than_a_read_chunk_is_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr("lowmem.conversion.formats._ARRAY_CHUNK_CHARS", 7)  # records cut at every point
    source = tmp_path / "chat.json"
    source.write_text(json.dumps([*PAIRS, {"prompt": 1234567, "response": 89}], ensure_ascii=False),
                      encoding="utf-8")
    rows, _ = _convert_one(source)
    assert rows == [*PAIRS, {"prompt": "1234567", "response": "89"}]


def test_text_after_a_json_array_is_counted_and_a_second_array_refused(tmp_path):
    source = tmp_path / "chat.json"
    source.write_text(json.dumps(PAIRS[:2], ensure_ascii=False) + '\n\n{"prompt": "lost?", "response": "no"}\n',
                      encoding="utf-8")
    rows, result = _convert_one(source)
    assert rows == PAIRS[:2]
    assert result.skipped.lines == {"text after the array's closing ']'": [3]}
    source.write_text('[{"prompt": "a", "response": "b"}]\n[{"prompt": "c", "response": "d"}]\n')
    with pytest.raises(DataError, match=f"{_quoted(source)}: A second JSON array starts at line 2.*JSON Lines"):
        convert(str(source), overwrite=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["chat.json", "out.parquet"]  # the first run's


def test_a_broken_json_array_stops_with_its_line_and_writes_nothing(tmp_path):
    source = tmp_path / "chat.json"
    source.write_text('[\n{"prompt": "a", "response": "b"},\n{"prompt": "c" "response": "d"}\n]\n')
    with pytest.raises(DataError, match="not valid at line 3"):
        convert(str(source))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["chat.json"]


@pytest.mark.parametrize("name, delimiter", [("chat.csv", ","), ("chat.tsv", "\t")])
def test_csv_and_tsv_keep_quoted_commas_and_line_breaks(tmp_path, name, delimiter):
    source = tmp_path / name
    with open(source, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, delimiter=delimiter)
        writer.writerow(["prompt", "response"])
        writer.writerows([[row["prompt"] + ", \"引号\"", row["response"]] for row in PAIRS])
        writer.writerow(["only one field"])
    rows, result = _convert_one(source)
    assert rows == [{"prompt": row["prompt"] + ", \"引号\"", "response": row["response"]} for row in PAIRS]
    # Every response spans two lines: the 26th row starts on line 2 + 25 * 2.
    assert result.skipped.lines == {"a different number of fields than the header": [52]}


def test_text_gives_one_text_row_per_line_or_per_paragraph(tmp_path):
    source = tmp_path / "book.txt"
    source.write_text("第一段第一行\n第一段第二行\n\n第二段\n   \n\n第三段\n", encoding="utf-8")
    rows, result = _convert_one(source)
    assert rows == [{"text": "第一段第一行"}, {"text": "第一段第二行"}, {"text": "第二段"}, {"text": "第三段"}]
    assert result.skipped.lines == {"blank line": [3, 5, 6]}
    rows, result = _convert_one(source, text_unit="paragraph", overwrite=True)
    assert rows == [{"text": "第一段第一行\n第一段第二行"}, {"text": "第二段"}, {"text": "第三段"}]
    assert not result.skipped.total


@pytest.fixture
def small_record_cap(monkeypatch):
    """Records of at most 1,000 bytes, and a JSON array read 100 bytes at a time; the csv module's field limit,
    which convert sets to the cap, given back afterwards (it is the whole process's)."""
    monkeypatch.setattr("lowmem.conversion.formats.MAX_RECORD_BYTES", 1000)
    monkeypatch.setattr("lowmem.conversion.formats._ARRAY_CHUNK_CHARS", 100)
    limit = csv.field_size_limit()
    yield
    csv.field_size_limit(limit)


_LONG = "长" * 400  # 1,200 bytes
_TOO_LONG_RECORDS = {  # name: (text, options, the line the long record starts on, what the message advises)
    "chat.jsonl": ('{"prompt": "a", "response": "b"}\n\n{"prompt": "' + _LONG + '", "response": "b"}\n', {}, 3,
                   "split it"),
    "chat.json": ('[\n{"prompt": "a", "response": "b"},\n{"prompt": "a", "response": "' + _LONG + '"}\n]', {}, 3,
                  "split the record"),
    "chat.csv": ('prompt,response\na,b\nc,"never closed\n' + "more text, and more\n" * 60, {}, 3, "fix the quote"),
    "book.txt": ("第一行\n" + _LONG + "\n", {}, 2, "shorter"),
    "essay.txt": ("第一段\n\n" + "没有空行的一行字\n" * 50, {"text_unit": "paragraph"}, 3, "--text_unit=line"),
}


@pytest.mark.parametrize("name", _TOO_LONG_RECORDS)
def test_a_record_over_the_cap_stops_with_its_file_its_line_and_what_to_do(tmp_path, small_record_cap, name):
    text, options, line, advice = _TOO_LONG_RECORDS[name]
    source = tmp_path / name
    source.write_text(text, encoding="utf-8")
    with pytest.raises(DataError, match=rf"{_quoted(source)}: The record that starts at line {line} .*{advice}"):
        convert(str(source), **options)
    assert sorted(path.name for path in tmp_path.iterdir()) == [name]


def test_records_under_the_cap_are_read_whatever_the_file_s_length(tmp_path, small_record_cap):
    source = tmp_path / "essay.txt"
    source.write_text("没有空行的一行字\n" * 50, encoding="utf-8")  # one paragraph over the cap, 50 lines under it
    rows, _ = _convert_one(source)
    assert rows == [{"text": "没有空行的一行字"}] * 50
    with pytest.raises(DataError, match="line 1 "):
        _convert_one(source, text_unit="paragraph", overwrite=True)
    records = [{"prompt": "p" * 300, "response": "r" * 300}] * 3
    (tmp_path / "chat.json").write_text(json.dumps(records), encoding="utf-8")  # 1,900 bytes, read 100 at a time
    assert _convert_one(tmp_path / "chat.json", overwrite=True)[0] == records


# ----- field mapping ------------------------------------------------------------------------------------------
def test_alpaca_fields_join_instruction_and_input(tmp_path):
    records = [{"instruction": "翻译", "input": "hello", "output": "你好"},
               {"instruction": "写一首诗", "input": "", "output": "春风"}]
    rows, result = _convert_one(_jsonl(tmp_path / "alpaca.jsonl", records))
    assert rows == [{"prompt": "翻译\nhello", "response": "你好"}, {"prompt": "写一首诗", "response": "春风"}]
    assert "'instruction' + 'input' → prompt, 'output' → response" in result.summary()


@pytest.mark.parametrize("prompt, response", [("question", "answer"), ("query", "response"), ("input", "output")])
def test_common_field_names_are_recognised(tmp_path, prompt, response):
    records = [{prompt: row["prompt"], response: row["response"], "id": i} for i, row in enumerate(PAIRS)]
    rows, _ = _convert_one(_jsonl(tmp_path / "chat.jsonl", records))
    assert rows == PAIRS


def test_named_fields_reach_into_nested_objects_and_a_text_field_gives_one_column(tmp_path):
    records = [{"meta": {"q": row["prompt"]}, "a": row["response"]} for row in PAIRS]
    source = _jsonl(tmp_path / "chat.jsonl", records)
    rows, _ = _convert_one(source, names=FieldNames(prompt="meta.q", response="a"))
    assert rows == PAIRS
    rows, _ = _convert_one(source, names=FieldNames(text="a"), overwrite=True)
    assert rows == [{"text": row["response"]} for row in PAIRS]
    rows, _ = _convert_one(_jsonl(tmp_path / "book.jsonl", [{"text": "一"}, {"text": "二"}]), overwrite=True)
    assert rows == [{"text": "一"}, {"text": "二"}]


def test_a_text_field_for_plain_text_is_refused_before_anything_is_written(tmp_path):
    chat = _jsonl(tmp_path / "chat.jsonl", [{"body": "一"}])
    (tmp_path / "book.txt").write_text("一行\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"--text_field=body .*{_quoted(tmp_path / 'book.txt')} is plain text"):
        convert([str(chat), str(tmp_path / "book.txt")], names=FieldNames(text="body"))
    with pytest.raises(DataError, match="--text_field=body"):
        convert(str(chat), names=FieldNames(text="body"), input_format="txt")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["book.txt", "chat.jsonl"]


def test_a_conversation_gives_one_row_per_assistant_turn_prompted_with_what_came_before(tmp_path):
    share_gpt = {"conversations": [{"from": "system", "value": "你是助手"}, {"from": "human", "value": "你好"},
                                   {"from": "gpt", "value": "你好！"}, {"from": "human", "value": "天气？"},
                                   {"from": "gpt", "value": "晴"}]}
    open_ai = {"conversations": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}
    rows, result = _convert_one(_jsonl(tmp_path / "chat.jsonl", [share_gpt, open_ai]))
    assert rows == [
        {"prompt": "你是助手\n你好", "response": "你好！"},  # one user turn: its text, after the system turn
        {"prompt": "你是助手\nUser: 你好\nAssistant: 你好！\nUser: 天气？", "response": "晴"},
        {"prompt": "1+1?", "response": "2"},
    ]
    assert not result.skipped.total
    messages = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
                {"messages": [{"role": "user", "content": "only a question"}]},
                {"messages": open_ai["conversations"]}]
    rows, result = _convert_one(_jsonl(tmp_path / "messages.jsonl", messages), overwrite=True)
    assert rows == [{"prompt": "1+1?", "response": "2"}]
    assert result.skipped.lines == {"an empty assistant turn": [1], "no assistant turn in 'messages'": [2]}


def test_records_without_known_fields_stop_with_their_fields_named(tmp_path):
    source = _jsonl(tmp_path / "chat.jsonl", [{"foo": "a", "bar": "b"}])
    with pytest.raises(DataError, match=r"line 1: .*its fields are: foo, bar.*--prompt_field"):
        convert(str(source))
    assert not (tmp_path / "chat.parquet").exists()


# ----- what is left out is counted and named ------------------------------------------------------------------
def test_bad_lines_are_counted_by_reason_named_by_line_and_the_others_kept(tmp_path, capsys):
    source = _jsonl(tmp_path / "chat.jsonl", [*PAIRS[:20], {"prompt": "p"}, {"prompt": "p", "response": ""},
                                              {"prompt": None, "response": "r"}, *PAIRS[20:]],
                    extra_lines={3: "{not json", 8: '{"prompt": "cut', 9: "", 30: "[1, 2]"})
    assert main(["convert", str(source), f"--output={tmp_path / 'out.parquet'}"]) == 0
    assert _rows(tmp_path / "out.parquet") == PAIRS
    summary = capsys.readouterr().out
    assert "25 rows in 1 row group" in summary and "7 left out" in summary, summary
    for reason in ("not valid JSON: 2, lines 3, 8", "blank line: 1, line 9", "missing 'response': 1, line 24",
                   "empty 'response': 1, line 25", "null 'prompt': 1, line 26", "not a JSON object: 1, line 30"):
        assert reason in summary, (reason, summary)
    assert "MB/s" in summary


def test_a_file_with_nothing_to_convert_writes_nothing(tmp_path):
    source = tmp_path / "chat.jsonl"
    source.write_text("not json\n{also not\n")
    with pytest.raises(DataError, match=r"No rows could be read .*not valid JSON: 2, lines 1, 2"):
        convert(str(source))
    assert not (tmp_path / "chat.parquet").exists() and not (tmp_path / "chat.parquet.partial").exists()


# ----- outputs ----------------------------------------------------------------------------------------------------
def test_a_failure_part_way_leaves_no_output_and_the_input_intact(tmp_path, monkeypatch):
    source = _jsonl(tmp_path / "chat.jsonl", PAIRS)
    before = source.read_bytes()
    written = []

    def failing_write(self, table, row_group_size=None):
        written.append(table.num_rows)
        if len(written) == 2:
            raise OSError("disk on fire")
        return original(self, table, row_group_size=row_group_size)

    original = pq.ParquetWriter.write_table
    monkeypatch.setattr(pq.ParquetWriter, "write_table", failing_write)
    with pytest.raises(OSError, match="disk on fire"):
        convert(str(source), str(tmp_path / "out.parquet"), row_group_rows=10)
    assert written == [10, 10]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["chat.jsonl"]
    assert source.read_bytes() == before


def test_an_existing_output_is_refused_unless_overwrite(tmp_path, capsys):
    source = _jsonl(tmp_path / "chat.jsonl", PAIRS)
    target = tmp_path / "chat.parquet"
    target.write_bytes(b"keep me")
    assert main(["convert", str(source)]) == 2
    error = capsys.readouterr().err
    assert f"{target} already exists" in error and "--overwrite=True" in error and "Traceback" not in error
    assert target.read_bytes() == b"keep me"
    assert main(["convert", str(source), "--overwrite=True"]) == 0
    assert _rows(target) == PAIRS


def test_several_inputs_go_to_a_folder_one_file_each(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    _jsonl(raw / "a.jsonl", PAIRS[:10])
    _jsonl(raw / "b.jsonl", PAIRS[10:])
    (raw / "c.txt").write_text("一行\n")
    (raw / "notes.md").write_text("# not data\n")  # a folder gives only the files convert reads
    results = convert(str(raw), str(tmp_path / "out"))
    assert [Path(result.target).name for result in results] == ["a.parquet", "b.parquet", "c.parquet"]
    assert _rows(tmp_path / "out" / "a.parquet") + _rows(tmp_path / "out" / "b.parquet") == PAIRS
    results = convert(str(raw / "*.jsonl"), str(tmp_path / "globbed"))
    assert sorted(path.name for path in (tmp_path / "globbed").iterdir()) == ["a.parquet", "b.parquet"]


@pytest.mark.parametrize("names, output", [(("a.jsonl", "a.jsonl.gz"), None), (("a.json", "a.jsonl"), None),
                                           (("a.jsonl", "sub/a.csv"), "out")])
def test_inputs_that_would_share_an_output_are_refused_before_anything_is_written(tmp_path, names, output):
    raw = tmp_path / "raw"
    for name in names:  # refused before any is read
        (raw / name).parent.mkdir(parents=True, exist_ok=True)
        (raw / name).write_text('{"prompt": "a", "response": "b"}\n')
    first, second = (str(raw / name) for name in names)
    with pytest.raises(DataError, match=rf"{_quoted(first)} and {_quoted(second)} would both be written to .*"
                                        "one by one.*--output"):
        convert(str(raw), None if output is None else str(tmp_path / output))
    assert not list(tmp_path.rglob("*.parquet*"))


def test_the_same_file_named_twice_is_converted_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _jsonl(tmp_path / "chat.jsonl", PAIRS)
    [result] = convert(["chat.jsonl", "./chat.jsonl", "*.jsonl"])
    assert _rows(Path(result.target)) == PAIRS


def test_no_input_or_an_input_that_finds_nothing_is_an_error_that_says_what_was_looked_for(tmp_path, capsys):
    assert main(["convert"]) == 2
    error = capsys.readouterr().err
    assert "No input named" in error and ".jsonl" in error and "Traceback" not in error
    with pytest.raises(DataError, match="No input named"):
        convert([])
    (tmp_path / "notes.md").write_text("# not data\n")
    for entry in (tmp_path, tmp_path / "*.jsonl", tmp_path / "missing.jsonl"):
        with pytest.raises(DataError, match=rf"Nothing to convert at {_quoted(entry)}.*\.jsonl, .*\.txt files"):
            convert(str(entry))


def test_an_output_named_as_the_last_input_is_refused_with_the_command_that_works(tmp_path, capsys, monkeypatch):
    """`lowmem convert data.jsonl data.parquet`, as `cp` would have it: one paragraph naming --output."""
    monkeypatch.chdir(tmp_path)
    _jsonl(tmp_path / "data.jsonl", PAIRS)
    assert main(["convert", "data.jsonl", "data.parquet"]) == 2
    error = capsys.readouterr().err
    assert "did you mean `lowmem convert data.jsonl --output=data.parquet`?" in error, error
    assert "Nothing to convert at 'data.parquet': no such file" in error and "Traceback" not in error
    assert error.strip().count("\n") == 0  # one paragraph
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data.jsonl"]  # nothing written
    _jsonl(tmp_path / "more.jsonl", PAIRS)
    with pytest.raises(DataError, match=re.escape("`lowmem convert data.jsonl more.jsonl --output='my data.parquet'`")):
        convert(["data.jsonl", "more.jsonl", "my data.parquet"])
    # With --output given, a missing parquet input is only missing.
    with pytest.raises(DataError, match=r"Nothing to convert at 'missing\.parquet'.*Check the path"):
        convert(["data.jsonl", "missing.parquet"], "out")
    assert main(["convert", "data.jsonl", "--output=data.parquet"]) == 0
    assert _rows(tmp_path / "data.parquet") == PAIRS


def test_the_converted_file_reads_through_parquet_stream(tmp_path):
    records = [{"instruction": row["prompt"], "input": "", "output": row["response"]} for row in PAIRS]
    [result] = convert(str(_jsonl(tmp_path / "alpaca.jsonl", records)), row_group_rows=7)
    stream = ParquetStream(result.target, columns=("prompt", "response"), shuffle=False, drop_remainder=False)
    assert list(stream) == PAIRS


# ----- train points to convert ------------------------------------------------------------------------------------
def test_train_on_json_lines_stops_with_the_convert_command_that_works(tmp_path, capsys):
    train = _jsonl(tmp_path / "train.jsonl", [{"question": row["prompt"], "answer": row["response"]} for row in PAIRS])
    valid = write_chat_rows(tmp_path / "valid.parquet", 20, seed=2)
    assert main(["train", *tiny_overrides(tmp_path, train, valid)]) == 2
    message = capsys.readouterr().err
    command = f"lowmem convert {shlex.quote(str(train))} --output={shlex.quote(str(tmp_path / 'train.parquet'))}"
    assert f"'{train}' is not a parquet file" in message and f"    {command}\n" in message, message
    assert "--train_file" in message and "Traceback" not in message
    assert main(shlex.split(command)[1:]) == 0  # the command given, as given
    assert list(ParquetStream(tmp_path / "train.parquet", shuffle=False, drop_remainder=False)) == PAIRS
