"""Tokenizer: streamed training from parquet, lossless round trips, fixed special ids, pickling, errors."""

from __future__ import annotations

import json

import logging
import pickle
import random
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from lowmem.tokenization import sentencepiece_tokenizer as tk
from lowmem.errors import ConfigError, DataError
from lowmem.tokenization.sentencepiece_tokenizer import Tokenizer, train_tokenizer

CHINESE = [
    "今天天气很好，我们一起去公园散步吧。",
    "机器学习是人工智能的一个重要分支。",
    "请把这本书放在桌子上，谢谢你！",
    "他昨天在市场买了三个苹果和两个橙子。",
    "学习一门新的语言需要耐心和时间。",
    "这个问题的答案其实很简单。",
    "我们明天早上八点在学校门口见面。",
    "春天来了，花园里的花都开了。",
    "你能帮我解释一下这段代码吗？",
    "长江是中国最长的河流。",
    "小明每天坚持跑步，身体越来越好。",
    "数据越多，模型的效果通常越好。",
    "晚饭以后，奶奶喜欢在院子里喝茶。",
    "这家餐厅的饺子非常好吃。",
]
ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "Machine learning models need a lot of data.",
    "Please write a short poem about the sea.",
    "What is the capital of France? It is Paris.",
    "def add(a, b):\n    return a + b",
    "Version 2.0 was released on 2024-05-01.",
    "Hello, world!  Two spaces, then a tab:\tdone.",
]


def _make_rows(n: int, seed: int = 0) -> tuple[list[str | None], list[str | None]]:
    """Mixed Chinese/English prompts and responses, with some null and empty values."""
    rng = random.Random(seed)
    prompts: list[str | None] = []
    responses: list[str | None] = []
    for i in range(n):
        prompts.append(rng.choice(CHINESE + ENGLISH) + rng.choice(["", " 请回答。", " Answer briefly."]))
        parts = rng.sample(CHINESE, 2) + [rng.choice(ENGLISH), f"编号{rng.randint(0, 9999)}。"]
        rng.shuffle(parts)
        responses.append("".join(parts))
        if i % 37 == 0:
            prompts[-1] = None
        if i % 41 == 0:
            responses[-1] = ""
    return prompts, responses


def _write_parquet(path: Path, prompts: list, responses: list) -> Path:
    table = pa.table({"prompt": pa.array(prompts, pa.string()), "response": pa.array(responses, pa.string())})
    pq.write_table(table, path, row_group_size=100)
    return path


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prompts, responses = _make_rows(400)
    return _write_parquet(tmp_path_factory.mktemp("data") / "train.parquet", prompts, responses)


@pytest.fixture(scope="module")
def model_path(data_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer([data_file], tmp_path_factory.mktemp("tok"), vocab_size=500)


@pytest.fixture(scope="module")
def tok(model_path: Path) -> Tokenizer:
    return Tokenizer.load(model_path)


# ---------------------------------------------------------------------------- training output


def test_training_writes_model_and_vocab(model_path: Path, tok: Tokenizer) -> None:
    assert model_path.name == "tokenizer.model"
    vocab_lines = (model_path.parent / "tokenizer.vocab").read_text(encoding="utf-8").splitlines()
    assert len(vocab_lines) == tok.vocab_size == 500
    assert vocab_lines[4].split("\t")[0] == "<sep>"
    # Nothing temporary left next to the model.
    assert sorted(p.name for p in model_path.parent.iterdir()) == ["tokenizer.model", "tokenizer.vocab",
                                                                     "tokenizer_training.json"]
    assert json.loads((model_path.parent / "tokenizer_training.json").read_text())["file_count"] >= 1


def test_special_ids_are_fixed(tok: Tokenizer, model_path: Path) -> None:
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id, tok.sep_id) == (0, 1, 2, 3, 4)
    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    assert [sp.id_to_piece(i) for i in range(5)] == ["<pad>", "<s>", "</s>", "<unk>", "<sep>"]
    assert sp.id_to_piece(5) == "<0x00>" and sp.id_to_piece(260) == "<0xFF>"


def test_same_seed_gives_same_model(data_file: Path, tmp_path: Path) -> None:
    # max_sentences below the ~850 sentences in the file, so the seeded sampling is exercised.
    a = train_tokenizer([data_file], tmp_path / "a", vocab_size=500, max_sentences=300, seed=7)
    b = train_tokenizer([data_file], tmp_path / "b", vocab_size=500, max_sentences=300, seed=7)
    c = train_tokenizer([data_file], tmp_path / "c", vocab_size=500, max_sentences=300, seed=8)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_sentence_cap_is_applied(data_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lowmem.tokenization.sentencepiece_tokenizer"):
        train_tokenizer([data_file], tmp_path, vocab_size=500, max_sentences=200)
    assert re.search(r"on 200 of \d+ sentences", caplog.text)


def test_reservoir_sample_is_uniform_and_seeded() -> None:
    assert tk._reservoir_sample(range(5), 10, seed=0) == [0, 1, 2, 3, 4]
    assert tk._reservoir_sample(range(100), 10, seed=1) == tk._reservoir_sample(range(100), 10, seed=1)
    assert tk._reservoir_sample(range(100), 10, seed=1) != tk._reservoir_sample(range(100), 10, seed=2)
    counts = [0] * 100
    for seed in range(1000):
        sample = tk._reservoir_sample(range(100), 10, seed)
        assert len(set(sample)) == 10
        for item in sample:
            counts[item] += 1
    # Each item is expected 100 times; 5 standard deviations (~47) either side.
    assert 50 < min(counts) and max(counts) < 150


def test_training_is_quiet_by_default(data_file: Path, tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    train_tokenizer([data_file], tmp_path, vocab_size=500)
    assert capfd.readouterr().err == ""


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "text",
    [
        "今天天气很好，我们一起去公园散步吧。",
        "The quick brown fox jumps over the lazy dog.",
        "机器学习 needs data：模型 v2.0 很好！",
        "  leading, double  inner and trailing spaces  ",
        "tabs\tand\nnew lines\r\n",
        "数字 0123456789 和标点 ,.;:!?()[]{}<>'\"@#$%^&*-_=+/\\|~`",
        "全角标点：，。！？《》“”（）",
        "没见过的字：龘靐齉 emoji 🙂 and 𠀀",
        "",
    ],
)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_unseen_characters_use_byte_pieces(tok: Tokenizer) -> None:
    ids = tok.encode("龘🙂")
    assert ids and all(5 <= i <= 260 for i in ids)  # byte pieces, never <unk>
    assert tok.unk_id not in tok.encode("没见过的字：龘靐齉 🙂")


def test_frequent_text_gets_merged(tok: Tokenizer) -> None:
    # The model learned something beyond characters: frequent training text takes fewer ids.
    text = "机器学习是人工智能的一个重要分支。"
    assert len(tok.encode(text)) < len(text)


def test_decode_skips_pad_bos_eos(tok: Tokenizer) -> None:
    text = "你好, world"
    assert tok.decode([tok.bos_id, *tok.encode(text), tok.eos_id, tok.pad_id, tok.pad_id]) == text


# ---------------------------------------------------------------------------- layout and batching


def test_encode_pair_layout(tok: Tokenizer) -> None:
    prompt, response = "请把这本书放在桌子上。", "好的, done!"
    ids, start = tok.encode_pair(prompt, response)
    p, r = tok.encode(prompt), tok.encode(response)
    assert ids == [tok.bos_id, *p, tok.sep_id, *r, tok.eos_id]
    assert start == len(p) + 2
    assert ids[start - 1] == tok.sep_id and ids[start:] == [*r, tok.eos_id]


def test_encode_pair_for_generation(tok: Tokenizer) -> None:
    ids, start = tok.encode_pair("你好", None)
    assert ids == [tok.bos_id, *tok.encode("你好"), tok.sep_id]
    assert start == len(ids)


def test_encode_batch_matches_encode(tok: Tokenizer) -> None:
    texts = CHINESE + ENGLISH + ["", "龘 🙂"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.encode_batch([]) == []


def test_encode_pair_batch_matches_encode_pair(tok: Tokenizer) -> None:
    prompts = ["你好", "Hi there", "问题"]
    responses = ["世界", None, ""]
    assert tok.encode_pair_batch(prompts, responses) == [tok.encode_pair(p, r) for p, r in zip(prompts, responses)]


def test_pickle_round_trip(tok: Tokenizer) -> None:
    clone = pickle.loads(pickle.dumps(tok))
    texts = CHINESE + ENGLISH + ["没见过的字：龘 🙂"]
    assert clone.encode_batch(texts) == tok.encode_batch(texts)
    assert clone.vocab_size == tok.vocab_size and clone.num_threads == tok.num_threads
    assert clone.decode(clone.encode(texts[0])) == texts[0]


# ---------------------------------------------------------------------------- loading


def test_load_from_folder_or_file(model_path: Path, tok: Tokenizer) -> None:
    assert Tokenizer.load(model_path.parent).encode("你好") == tok.encode("你好")
    assert Tokenizer.load(str(model_path)).encode("你好") == tok.encode("你好")


def test_load_missing_says_how_to_train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    # The hint names the command the way the user started it (see lowmem.program).
    monkeypatch.setattr("sys.argv", ["train_low_mem.py", "train"])
    with pytest.raises(ConfigError, match=r"model_save/tokenizer/tokenizer\.model.*python train_low_mem\.py tokenizer"):
        Tokenizer.load()
    monkeypatch.setattr("sys.argv", ["/venv/bin/lowmem", "train"])
    with pytest.raises(ConfigError, match=r"model_save/tokenizer/tokenizer\.model.*`lowmem tokenizer"):
        Tokenizer.load()
    assert tk.DEFAULT_TOKENIZER_DIR == Path("model_save/tokenizer")


def test_load_corrupt_model(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="retrain"):
        Tokenizer.load(tmp_path)


def test_load_rejects_model_with_other_special_ids(tmp_path: Path) -> None:
    # A SentencePiece model with its default ids (unk=0, bos=1, eos=2, no pad, no <sep>).
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CHINESE * 20),
        model_prefix=str(tmp_path / "tokenizer"),
        vocab_size=150,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    with pytest.raises(ConfigError, match="not trained by lowmem"):
        Tokenizer.load(tmp_path)


def test_decode_accepts_arrays(tok: Tokenizer) -> None:
    np = pytest.importorskip("numpy")
    ids = [tok.bos_id, *tok.encode("你好")]
    assert tok.decode(np.array(ids)) == "你好"


# ---------------------------------------------------------------------------- data handling and errors


def test_null_and_empty_values_are_skipped(tmp_path: Path) -> None:
    prompts, responses = _make_rows(200)
    prompts[:50] = [None] * 50
    responses[50:100] = [""] * 50
    path = _write_parquet(tmp_path / "holes.parquet", prompts, responses)
    model = train_tokenizer([path], tmp_path / "tok", vocab_size=500)
    assert Tokenizer.load(model).vocab_size == 500


def test_all_null_columns_raise_data_error(tmp_path: Path) -> None:
    path = _write_parquet(tmp_path / "empty.parquet", [None, ""] * 10, [""] * 20)
    with pytest.raises(DataError, match="null or empty"):
        train_tokenizer([path], tmp_path / "tok", vocab_size=500)
    assert not (tmp_path / "tok" / "tokenizer.model").exists()


def test_missing_file_raises_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        train_tokenizer([tmp_path / "nope.parquet"], tmp_path / "tok")


def test_missing_column_raises_data_error(tmp_path: Path) -> None:
    path = tmp_path / "other.parquet"
    pq.write_table(pa.table({"text": ["你好"]}), path)
    with pytest.raises(DataError, match="no column 'prompt'"):
        train_tokenizer([path], tmp_path / "tok")


def test_non_string_column_raises_data_error(tmp_path: Path) -> None:
    path = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"prompt": ["你好"], "response": [1]}), path)
    with pytest.raises(DataError, match="'response'.*expected strings"):
        train_tokenizer([path], tmp_path / "tok")


def test_error_while_streaming_reaches_caller(data_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(path: Path, columns: tuple[str, ...], *reading):  # reading: bad_text, stats
        yield "你好"
        raise DataError(f"cannot read parquet file {path}: simulated")

    monkeypatch.setattr(tk, "_stream_values", broken)
    with pytest.raises(DataError, match="simulated"):
        train_tokenizer([data_file], tmp_path / "tok", vocab_size=500)
    assert not (tmp_path / "tok" / "tokenizer.model").exists()


def test_vocab_too_large_fails_cleanly(data_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "tok"
    with pytest.raises(ConfigError, match="lower vocab_size"):
        train_tokenizer([data_file], out, vocab_size=100_000)
    # Atomic: no model, no vocab, no temporary file.
    assert list(out.iterdir()) == []


def test_vocab_too_large_with_soft_limit_gives_smaller_vocab(data_file: Path, tmp_path: Path) -> None:
    model = train_tokenizer([data_file], tmp_path, vocab_size=100_000, hard_vocab_limit=False)
    assert 261 < Tokenizer.load(model).vocab_size < 100_000


def test_vocab_too_small_raises_config_error(data_file: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="too small"):
        train_tokenizer([data_file], tmp_path, vocab_size=200)
    with pytest.raises(ConfigError, match="raise vocab_size"):
        train_tokenizer([data_file], tmp_path, vocab_size=270)


def test_failed_retrain_keeps_previous_model(data_file: Path, tmp_path: Path) -> None:
    model = train_tokenizer([data_file], tmp_path, vocab_size=500)
    before = model.read_bytes()
    with pytest.raises(ConfigError):
        train_tokenizer([data_file], tmp_path, vocab_size=100_000)
    assert model.read_bytes() == before


def test_long_lines_are_chunked_not_dropped() -> None:
    line = "长" * 5000  # 15,000 bytes: SentencePiece would skip it whole
    chunks = list(tk._split_sentences(f"第一行\n\n{line}\n"))
    assert chunks[0] == "第一行"
    assert "".join(chunks[1:]) == line
    assert all(len(c.encode("utf-8")) <= tk.MAX_SENTENCE_BYTES for c in chunks)


# ----- a tokenizer trained on other data ------------------------------------------------------------------------
def test_a_new_run_refuses_a_tokenizer_trained_on_other_files_before_writing_anything(tmp_path, monkeypatch, capsys):
    from training_helpers import write_chat_rows

    from lowmem.cli import main

    monkeypatch.chdir(tmp_path)
    poems, mine = write_chat_rows(tmp_path / "poems.parquet", 300, seed=1), write_chat_rows(
        tmp_path / "mine.parquet", 300, seed=2)
    # The default preset's tokenizer folder holds one trained on the poems; the run names a folder of its own.
    train_tokenizer([str(poems)], tmp_path / "model_save" / "tokenizer", vocab_size=600, columns=("prompt", "response"),
                    hard_vocab_limit=False)
    flags = [f"--train_file={mine}", f"--validation_file={mine}", f"--test_file={mine}", "--output_dir=run",
             "--n_layer=1", "--n_head=2", "--n_embd=16", "--max_steps=1", "--vocab_size=600"]
    capsys.readouterr()
    assert main(["train", *flags]) == 2
    message = capsys.readouterr().err
    assert "The tokenizer in model_save/tokenizer was trained on" in message
    assert str(poems) in message and str(mine) in message
    assert "--tokenizer_dir=run/tokenizer" in message and "--tokenizer_dir=model_save/tokenizer" in message
    assert not (tmp_path / "run").exists() and not (tmp_path / "logs").exists()
    # Given on the command line, the same tokenizer is kept knowingly: the check lets it through.
    from lowmem.config import TrainConfig
    from lowmem.train.setup import check_tokenizer_data

    config = TrainConfig(train_file=str(mine), output_dir="run")
    check_tokenizer_data(config, explicit={"tokenizer_dir"})
    check_tokenizer_data(TrainConfig(train_file=str(poems)), explicit=())  # its own data
    with pytest.raises(ConfigError, match="was trained on"):
        check_tokenizer_data(config, explicit=())


def test_the_training_record_compares_files_by_their_real_path_and_the_demo_files_by_name(tmp_path):
    from lowmem.tokenization.identity import trained_on_same_files

    (tmp_path / "a.parquet").write_bytes(b"")
    (tmp_path / "link.parquet").symlink_to(tmp_path / "a.parquet")
    record = {"files": [str(tmp_path / "a.parquet")], "file_count": 1}
    assert trained_on_same_files(record, [str(tmp_path / "link.parquet")])
    assert not trained_on_same_files(record, [str(tmp_path / "a.parquet"), str(tmp_path / "link2.parquet")])
    assert not trained_on_same_files(record, [str(tmp_path / "b.parquet")])
    # The demo files of another installation of the package are the same demo files.
    demo = {"files": ["/venv1/site-packages/lowmem/demo_data/train.parquet"], "file_count": 1}
    assert trained_on_same_files(demo, ["/venv2/site-packages/lowmem/demo_data/train.parquet"])
    assert trained_on_same_files({"files": ["s3://b/x.parquet"], "file_count": 1}, ["s3://b/x.parquet"])
