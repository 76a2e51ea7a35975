"""ParquetStream on s3:// URIs, against a real S3-compatible server (moto) started on localhost by the test.

The same generated files are read locally and from the bucket: the rows, their order and a resume must
be identical, and each remote footer is fetched once.
"""

from __future__ import annotations

import logging
import re
import uuid

import pytest

moto_server = pytest.importorskip("moto.server", reason="moto[server] (a test dependency) is not installed")
boto3 = pytest.importorskip("boto3")

from lowmem.data import ParquetStream, StreamLoader  # noqa: E402
from lowmem.data.sources import build_row_group_index, resolve_parquet_files  # noqa: E402
from lowmem.errors import DataError  # noqa: E402

BUFFER = 300
SEED = 5


@pytest.fixture(scope="module")
def endpoint():
    """A moto S3 server on a free localhost port, for the whole module."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def bucket(endpoint, monkeypatch, tmp_path) -> str:
    """A new bucket, with credentials and endpoint set the way a user would: AWS environment variables."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "lowmem-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "lowmem-test-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    # Keep this machine's own AWS configuration, if any, out of the test.
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    name = f"lowmem-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


@pytest.fixture
def uploaded(bucket, three_files) -> tuple[list, str]:
    """The conftest files (several row groups, short last groups) locally and under s3://bucket/train/."""
    s3 = boto3.client("s3")
    for path in three_files:
        s3.upload_file(str(path), bucket, f"train/{path.name}")
    s3.put_object(Bucket=bucket, Key="train/README.txt", Body=b"not parquet")
    return three_files, f"s3://{bucket}/train/"


def rank_rows(files, world_size: int, rank: int, epoch: int = 1, **kwargs) -> list[str]:
    stream = ParquetStream(files, buffer_size=BUFFER, seed=SEED, shuffle=True, rank=rank, world_size=world_size,
                           **kwargs)
    stream.set_epoch(epoch)
    return [row["prompt"] + "|" + row["response"] for row in stream]


@pytest.mark.parametrize("world_size,ultra_low_mem", [(1, False), (3, True)])
def test_same_rows_in_the_same_order_as_local_files(uploaded, world_size, ultra_low_mem):
    local, uri = uploaded
    seen = []
    for rank in range(world_size):
        expected = rank_rows(local, world_size, rank, ultra_low_mem=ultra_low_mem)
        assert rank_rows(f"{uri}*.parquet", world_size, rank, ultra_low_mem=ultra_low_mem) == expected
        seen += expected
    assert len(seen) == len(set(seen)) == 3278 - 3278 % world_size


def test_resume_on_s3_continues_a_local_position_exactly(uploaded):
    local, uri = uploaded
    # One lane, so that the bound below is one window's row groups (tests/unit/test_stream_resume.py bounds lanes).
    stream = ParquetStream(local, buffer_size=BUFFER, seed=SEED, ultra_low_mem=True, mix_row_groups=1)
    stream.set_epoch(2)
    rows = iter(stream)
    before = [next(rows)["prompt"] for _ in range(1234)]  # mid-window, mid-epoch
    state = stream.state_dict()
    rest = [row["prompt"] for row in rows]

    remote = ParquetStream(uri, buffer_size=BUFFER, seed=SEED, ultra_low_mem=True, mix_row_groups=1)
    remote.load_state_dict(state)  # the data fingerprint matches: same names, same row groups
    remote.set_epoch(2)
    resumed = [row["prompt"] for row in remote]
    assert resumed == rest
    assert len(before) + len(resumed) == 3278
    # Resuming reads the rest and the row groups of the window it was in, not the epoch from its start.
    assert remote.rows_decoded < 3278 - 1234 + 2 * 250


def test_dataloader_workers_read_s3_like_local_files(uploaded):
    local, uri = uploaded

    def batches(files):
        loader = StreamLoader(ParquetStream(files, buffer_size=BUFFER, seed=SEED), batch_size=64, num_workers=2,
                              collate_fn=lambda rows: [row["prompt"] for row in rows])
        return list(loader)

    assert batches(uri) == batches(local)


def test_glob_prefix_and_key_resolve_like_local_paths(uploaded, bucket):
    local, uri = uploaded
    names = [f"s3://{bucket}/train/{path.name}" for path in local]
    assert resolve_parquet_files(uri) == names  # a prefix: every *.parquet below it, README.txt left out
    assert resolve_parquet_files(uri.rstrip("/")) == names
    assert resolve_parquet_files(f"{uri}*.parquet") == names
    assert resolve_parquet_files(f"s3://{bucket}/**/[ab].parquet") == names[:2]
    with pytest.raises(DataError, match="No files match"):
        resolve_parquet_files(f"s3://{bucket}/*.parquet")  # `*` stays within one level, as in a local glob
    assert resolve_parquet_files([names[1], uri]) == [names[1], names[0], names[2]]  # each file once
    remote_index = build_row_group_index(uri, ("prompt", "response"))
    local_index = build_row_group_index(local, ("prompt", "response"))
    assert remote_index.fingerprint == local_index.fingerprint
    assert remote_index.rows.tolist() == local_index.rows.tolist()


def test_user_errors_are_one_paragraph_that_says_what_to_do(uploaded, bucket):
    cases = {
        "s3://lowmem-no-such-bucket/train/a.parquet": "bucket 'lowmem-no-such-bucket' does not exist",
        "s3://lowmem-no-such-bucket/train/*.parquet": "bucket 'lowmem-no-such-bucket' does not exist",
        f"s3://{bucket}/train/missing.parquet": "not found",
        f"s3://{bucket}/train/*.jsonl": "No files match",
        f"s3://{bucket}/empty-prefix/": "not found",
        "nosuchscheme://x/y.parquet": "storage type pyarrow cannot read",
    }
    for uri, expected in cases.items():
        with pytest.raises(DataError, match=re.escape(expected)) as error:
            ParquetStream(uri)
        message = str(error.value)
        assert uri.split("?")[0] in message and "\n" not in message


class _RequestLog(logging.Handler):
    """The moto server's access log (werkzeug logs one line per HTTP request)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def gets(self, key: str) -> int:
        return sum(1 for line in self.lines if f"GET /{key} " in line)


@pytest.fixture
def requests_log():
    logger = logging.getLogger("werkzeug")
    handler, level = _RequestLog(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_footer_is_fetched_once_per_file(uploaded, bucket, requests_log):
    local, uri = uploaded
    keys = [f"{bucket}/train/{path.name}" for path in local]
    stream = ParquetStream(uri, buffer_size=BUFFER, seed=SEED, ultra_low_mem=True)
    assert [requests_log.gets(key) for key in keys] == [1, 1, 1]  # one ranged GET: the footer

    requests_log.lines.clear()
    assert len(list(stream)) == 3278
    # Ultra-low-mem mode reopens the file for each of its row groups (each read once here, one consumer).
    # With the cached footer an open costs a size lookup and one GET per column chunk; fetching the footer
    # again would add a GET per open.
    groups = stream.index.file_id.tolist()
    for file_id, key in enumerate(keys):
        opens = groups.count(file_id)
        assert requests_log.gets(key) == opens * len(stream.columns)


def test_tokenizer_trains_from_s3_like_from_local_files(uploaded, tmp_path):
    from lowmem.tokenization.sentencepiece_tokenizer import train_tokenizer

    local, uri = uploaded
    options = dict(vocab_size=300, columns=("prompt", "response"), seed=3, hard_vocab_limit=False)
    from_disk = train_tokenizer([str(p) for p in local], tmp_path / "local", **options)
    from_bucket = train_tokenizer(resolve_parquet_files(uri), tmp_path / "s3", **options)
    assert from_bucket.read_bytes() == from_disk.read_bytes()  # same sentences, same sample, same model


def test_a_file_uploaded_again_with_other_rows_is_refused_by_its_uri(uploaded, bucket, tmp_path):
    from conftest import write_rows

    local, uri = uploaded
    stream = ParquetStream(uri, buffer_size=BUFFER, seed=SEED)
    rows = iter(stream)
    for _ in range(500):
        next(rows)
    state = stream.state_dict()
    # The footers are read through S3, like the rows: a byte-identical local copy has the same fingerprint.
    assert state["data_content"] == ParquetStream(local, buffer_size=BUFFER, seed=SEED).state_dict()["data_content"]

    # b.parquet again with the same rows per row group (777 rows in groups of 64), in another order.
    other = write_rows(tmp_path / "b.parquet", [f"b{i}" for i in reversed(range(777))], 64)
    boto3.client("s3").upload_file(str(other), bucket, "train/b.parquet")
    with pytest.raises(DataError, match=re.escape(f"The content of 's3://{bucket}/train/b.parquet' changed")):
        ParquetStream(uri, buffer_size=BUFFER, seed=SEED).load_state_dict(state)
