"""`lowmem convert` on preference data: each common layout (text beside a prompt, TRL's lists of turns with and
without a prompt, HH-RLHF's Human/Assistant text) gives rows of `prompt`, `chosen` and `rejected`, the prompt
written as a conversation's prompt is; records that do not fit the first record's layout are counted by reason."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lowmem.cli import main
from lowmem.conversion.convert import FieldNames, convert
from lowmem.conversion.fields import suggest_flags
from lowmem.data.stream import ParquetStream
from lowmem.errors import DataError


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records), encoding="utf-8")
    return path


def _convert_one(source: Path, **options) -> tuple[list[dict], object]:
    [result] = convert(str(source), str(source.with_name("out.parquet")), **options)
    return pq.read_table(result.target).to_pylist(), result


def _row(prompt: str, chosen: str, rejected: str) -> dict:
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


# ----- text beside a prompt ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, chosen, rejected", [("prompt", "chosen", "rejected"),
                                                      ("question", "response_j", "response_k"),
                                                      ("question", "response_chosen", "response_rejected"),
                                                      ("prompt", "response_chosen", "response_rejected")])
def test_text_answers_beside_a_prompt_are_written_as_they_are(tmp_path, prompt, chosen, rejected):
    records = [{prompt: "1+1?", chosen: "2", rejected: "3", "score": 1},
               {prompt: "首都？", chosen: "北京\n第二行", rejected: "上海"}]
    rows, result = _convert_one(_jsonl(tmp_path / "pref.jsonl", records))
    assert rows == [_row("1+1?", "2", "3"), _row("首都？", "北京\n第二行", "上海")]
    assert f"'{prompt}' → prompt, '{chosen}' → chosen, '{rejected}' → rejected" in result.summary()
    assert pq.read_schema(result.target).names == ["prompt", "chosen", "rejected"]


def test_alpaca_preference_joins_instruction_and_input(tmp_path):
    records = [{"instruction": "翻译", "input": "hello", "chosen": "你好", "rejected": "再见"},
               {"instruction": "写一首诗", "input": "", "chosen": "春风", "rejected": "秋雨"}]
    rows, _ = _convert_one(_jsonl(tmp_path / "pref.jsonl", records))
    assert rows == [_row("翻译\nhello", "你好", "再见"), _row("写一首诗", "春风", "秋雨")]


def test_a_prompt_given_as_turns_beside_text_answers_is_written_as_a_conversation_s_prompt(tmp_path):
    record = {"prompt": [{"role": "system", "content": "简短"}, _user("hi"), _assistant("hello"), _user("2+2?")],
              "chosen": "4", "rejected": "5"}
    rows, _ = _convert_one(_jsonl(tmp_path / "pref.jsonl", [record]))
    assert rows == [_row("简短\nUser: hi\nAssistant: hello\nUser: 2+2?", "4", "5")]


# ----- lists of turns ---------------------------------------------------------------------------------------------
def test_trl_conversational_with_a_prompt_takes_the_prompt_s_turns(tmp_path):
    records = [{"prompt": [_user("1+1?")], "chosen": [_assistant("2")], "rejected": [_assistant("3")]},
               {"prompt": [_user("hi"), _assistant("hello"), _user("bye?")], "chosen": [_assistant("bye")],
                "rejected": [_assistant("no")]}]
    rows, result = _convert_one(_jsonl(tmp_path / "pref.jsonl", records))
    assert rows == [_row("1+1?", "2", "3"), _row("User: hi\nAssistant: hello\nUser: bye?", "bye", "no")]
    assert not result.skipped.total


def test_ultrafeedback_s_text_prompt_repeated_in_the_turns_is_written_once(tmp_path):
    """UltraFeedback-binarized: a text prompt, and answers that repeat it as their first turn; its `messages`
    (the chosen conversation) does not make it a conversation file."""
    records = [{"prompt": "1+1?", "prompt_id": "a1", "chosen": [_user("1+1?"), _assistant("2")],
                "rejected": [_user("1+1?"), _assistant("3")], "messages": [_user("1+1?"), _assistant("2")],
                "score_chosen": 9.0, "score_rejected": 2.0}]
    source = tmp_path / "pref.json"  # a JSON array, as some copies of it are
    source.write_text(json.dumps(records, ensure_ascii=False, indent=2), encoding="utf-8")
    rows, _ = _convert_one(source)
    assert rows == [_row("1+1?", "2", "3")]


def test_trl_implicit_prompt_is_the_turns_both_answers_share(tmp_path):
    shared = [{"role": "system", "content": "你是助手"}, _user("你好"), _assistant("你好！"), _user("天气？")]
    records = [{"chosen": [*shared, _assistant("晴")], "rejected": [*shared, _assistant("不知道")]},
               {"chosen": [_user("1+1?"), _assistant("2"), _assistant("(two)")], "rejected": [_user("1+1?"),
                                                                                          _assistant("3")]}]
    rows, result = _convert_one(_jsonl(tmp_path / "pref.jsonl", records))
    assert rows == [_row("你是助手\nUser: 你好\nAssistant: 你好！\nUser: 天气？", "晴", "不知道"),
                    _row("1+1?", "2\n(two)", "3")]
    assert "the turns they share → prompt" in result.summary()


def test_identical_answers_are_written_for_training_to_count(tmp_path):
    turns = [_user("1+1?"), _assistant("2")]
    hh = "\n\nHuman: 1+1?\n\nAssistant: 2"
    rows, _ = _convert_one(_jsonl(tmp_path / "turns.jsonl", [{"chosen": turns, "rejected": turns}]))
    assert rows == [_row("1+1?", "2", "2")]
    rows, _ = _convert_one(_jsonl(tmp_path / "hh.jsonl", [{"chosen": hh, "rejected": hh}]), overwrite=True)
    assert rows == [_row("1+1?", "2", "2")]


# ----- HH-RLHF ----------------------------------------------------------------------------------------------------
HH = [{"chosen": "\n\nHuman: What is 1+1?\n\nAssistant: 2", "rejected": "\n\nHuman: What is 1+1?\n\nAssistant: 3"},
      {"chosen": "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant: Fine, thanks.",
       "rejected": "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant: Fine? Go away."}]
HH_ROWS = [_row("What is 1+1?", "2", "3"),
           _row("User: hi\nAssistant: hello\nUser: how are you?", "Fine, thanks.", "Fine? Go away.")]


def test_hh_rlhf_splits_at_the_last_assistant_turn_both_share(tmp_path):
    """The answers share "Fine" after the last "\\n\\nAssistant:": the split is at that turn, not inside it."""
    rows, result = _convert_one(_jsonl(tmp_path / "hh.jsonl", HH))
    assert rows == HH_ROWS
    assert "Human/Assistant text" in result.summary()


def test_gzipped_hh_rlhf_converts_with_the_command_and_reads_through_parquet_stream(tmp_path, capsys):
    plain = _jsonl(tmp_path / "plain.jsonl", HH).read_bytes()
    with pa.output_stream(str(tmp_path / "train.jsonl.gz"), compression="gzip") as out:
        out.write(plain)
    assert main(["convert", str(tmp_path / "train.jsonl.gz")]) == 0
    assert "2 rows in 1 row group" in capsys.readouterr().out
    stream = ParquetStream(tmp_path / "train.parquet", columns=("prompt", "chosen", "rejected"), shuffle=False,
                           drop_remainder=False)
    assert list(stream) == HH_ROWS


# ----- what is left out ---------------------------------------------------------------------------------------
def test_records_missing_an_answer_or_unlike_the_first_are_counted_by_reason(tmp_path):
    first = {"chosen": [_user("1+1?"), _assistant("2")], "rejected": [_user("1+1?"), _assistant("3")]}
    records = [first,
               {"chosen": [_user("q"), _assistant("a")]},  # no rejected answer
               {"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant: b"},  # text
               {"chosen": [_user("q"), _assistant("a")], "rejected": [_user("q")]},  # no answer
               {"chosen": [_assistant("a")], "rejected": [_assistant("b")]},  # no prompt
               {"chosen": [_user("q"), _assistant("a"), _user("more"), _assistant("b")],
                "rejected": [_user("q"), _assistant("x"), _user("more"), _assistant("b")]},
               first]
    rows, result = _convert_one(_jsonl(tmp_path / "pref.jsonl", records))
    assert rows == [_row("1+1?", "2", "3")] * 2
    assert result.skipped.lines == {"missing 'rejected'": [2], "'chosen' is not a list of turns": [3],
                                    "no assistant turn at the end of 'rejected'": [4],
                                    "no prompt: 'chosen' and 'rejected' share no turn before their answers": [5],
                                    "'chosen' and 'rejected' differ before their last assistant turns": [6]}


def test_text_answers_left_out_are_named_in_the_summary(tmp_path, capsys):
    records = [{"prompt": "p", "chosen": "c", "rejected": "r"}, {"prompt": "p", "chosen": "c"},
               {"prompt": "p", "chosen": "c", "rejected": ""}, {"prompt": "p", "chosen": ["c"], "rejected": "r"},
               {"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant: b"},
               {"prompt": "p", "chosen": "c", "rejected": "r"}]
    source = _jsonl(tmp_path / "pref.jsonl", records)
    assert main(["convert", str(source)]) == 0
    summary = capsys.readouterr().out
    assert "2 rows in 1 row group" in summary and "4 left out" in summary, summary
    for reason in ("missing 'rejected': 1, line 2", "empty 'rejected': 1, line 3",
                   "'chosen' is a list, not text: 1, line 4", "missing 'prompt': 1, line 5"):
        assert reason in summary, (reason, summary)
    hh = [HH[0], {"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: other\n\nAssistant: a"},
          {"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant:  "}]
    rows, result = _convert_one(_jsonl(tmp_path / "hh.jsonl", hh))
    assert rows == HH_ROWS[:1]
    assert result.skipped.lines == {"no 'Assistant:' turn shared by 'chosen' and 'rejected'": [2],
                                    "an empty answer in 'rejected'": [3]}


def test_text_answers_with_no_prompt_to_find_stop_at_the_first_record(tmp_path):
    source = _jsonl(tmp_path / "pref.jsonl", [{"chosen": "good", "rejected": "bad"}])
    with pytest.raises(DataError, match=r"line 1: .*'chosen' and 'rejected' but no prompt.*--prompt_field"):
        convert(str(source))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["pref.jsonl"]


# ----- fields named on the command line ---------------------------------------------------------------------------
def test_chosen_and_rejected_fields_named_on_the_command_line(tmp_path):
    records = [{"meta": {"q": "1+1?"}, "good": "2", "bad": "3"}]
    source = _jsonl(tmp_path / "pref.jsonl", records)
    assert main(["convert", str(source), "--prompt_field=meta.q", "--chosen_field=good", "--rejected_field=bad"]) == 0
    assert pq.read_table(tmp_path / "pref.parquet").to_pylist() == [_row("1+1?", "2", "3")]
    hh = _jsonl(tmp_path / "hh.jsonl", [{"better": HH[0]["chosen"], "worse": HH[0]["rejected"]}])
    rows, _ = _convert_one(hh, names=FieldNames(chosen="better", rejected="worse"), overwrite=True)
    assert rows == HH_ROWS[:1]


@pytest.mark.parametrize("names, message", [
    (FieldNames(response="a", chosen="good"), "--response_field names the response .* --chosen_field"),
    (FieldNames(text="a", rejected="bad"), "--text_field writes one column of text"),
])
def test_fields_for_different_rows_are_refused_before_anything_is_written(tmp_path, names, message):
    source = _jsonl(tmp_path / "pref.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    with pytest.raises(DataError, match=message):
        convert(str(source), names=names)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["pref.jsonl"]


def test_train_s_convert_command_for_preference_data_names_the_fields_it_needs():
    columns = ("prompt", "chosen", "rejected")
    assert suggest_flags({"prompt": "p", "chosen": "c", "rejected": "r"}, columns) == ([], "")
    assert suggest_flags({"chosen": HH[0]["chosen"], "rejected": HH[0]["rejected"]}, columns) == ([], "")
    flags, note = suggest_flags({"q": "p", "good": "c", "bad": "r"}, ("q", "good", "bad"))
    assert flags == ["--prompt_field=q", "--chosen_field=good", "--rejected_field=bad"]
    assert "without --prompt_column, --chosen_column and --rejected_column" in note
    flags, note = suggest_flags({"x": "p", "y": "c"}, columns)
    assert flags == ["--prompt_field=FIELD", "--chosen_field=FIELD", "--rejected_field=FIELD"]
    assert "its first record has: x, y" in note
    flags, note = suggest_flags({"prompt": "p", "chosen": "c", "rejected": "r"}, ("prompt", "response"))
    assert flags == [] and re.search(r"'prompt', 'chosen' and 'rejected'.*--objective=dpo", note)


# ----- parquet, as the published preference sets ship -------------------------------------------------------------
def test_a_parquet_file_of_lists_of_turns_converts_as_its_json_would(tmp_path):
    """UltraFeedback's and TRL's sets are parquet files whose answers are lists of turns: read a batch of rows at a
    time, each row a record, and written beside the input under another name."""
    records = [{"prompt": f"{n}+{n}?", "chosen": [_user(f"{n}+{n}?"), _assistant(str(2 * n))],
                "rejected": [_user(f"{n}+{n}?"), _assistant(str(2 * n + 1))], "score_chosen": 9.0} for n in range(3000)]
    source = tmp_path / "train_prefs.parquet"
    pq.write_table(pa.Table.from_pylist(records), source, row_group_size=2000)
    assert main(["convert", str(source)]) == 0
    rows = pq.read_table(tmp_path / "train_prefs_converted.parquet").to_pylist()
    assert len(rows) == 3000 and rows[7] == _row("7+7?", "14", "15")
    from_json, _ = _convert_one(_jsonl(tmp_path / "same.jsonl", records[:5]))
    assert rows[:5] == from_json


def test_a_folder_converts_its_text_files_not_the_parquet_files_written_beside_them(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    assert main(["convert", str(tmp_path)]) == 0 and (tmp_path / "a.parquet").is_file()
    assert main(["convert", str(tmp_path), "--overwrite=True"]) == 0  # a.parquet is an output, not an input
    assert not (tmp_path / "a_converted.parquet").exists()


def test_training_on_lists_of_turns_names_the_convert_command_that_makes_them_text(tmp_path):
    from lowmem.data.sources import build_row_group_index

    records = [{"prompt": "1+1?", "chosen": [_user("1+1?"), _assistant("2")],
                "rejected": [_user("1+1?"), _assistant("3")]}]
    source = tmp_path / "prefs.parquet"
    pq.write_table(pa.Table.from_pylist(records), source)
    columns = ("prompt", "chosen", "rejected")
    with pytest.raises(DataError, match=r"is a list .*`lowmem convert .*prefs.parquet` writes them as such into "
                                        r".*prefs_converted.parquet"):
        build_row_group_index(str(source), columns)
    assert main(["convert", str(source)]) == 0
    assert build_row_group_index(str(tmp_path / "prefs_converted.parquet"), columns).num_rows == 1


def test_validation_rows_are_drawn_at_random_and_moved_to_a_file_of_their_own(tmp_path, capsys):
    records = [{"prompt": f"q{n}", "chosen": f"a{n}", "rejected": f"b{n}"} for n in range(500)]
    source = _jsonl(tmp_path / "pairs.jsonl", records)
    assert main(["convert", str(source), "--validation_rows=40", "--row_group_rows=64"]) == 0
    train = pq.read_table(tmp_path / "pairs.parquet").to_pylist()
    valid = pq.read_table(tmp_path / "pairs_valid.parquet").to_pylist()
    assert len(train) == 460 and len(valid) == 40
    assert sorted(row["prompt"] for row in train + valid) == sorted(f"q{n}" for n in range(500))  # each row once
    assert [row["prompt"] for row in valid] != [f"q{n}" for n in range(40)]  # drawn, not the first ones
    assert "--validation_file=" in capsys.readouterr().out
    # The same file gives the same split; an existing validation file is refused before anything is written.
    again = tmp_path / "again"
    again.mkdir()
    assert main(["convert", str(source), f"--output={again / 'pairs.parquet'}", "--validation_rows=40"]) == 0
    assert pq.read_table(again / "pairs_valid.parquet").to_pylist() == valid
    assert main(["convert", str(source), "--validation_rows=40", "--overwrite=False"]) == 2
