"""Data files on object storage (s3://, gs://, hdfs://, ...) through pyarrow's own filesystems.

A URI is resolved once, when the stream is built, into `DataFile`s: the name shown in messages (the URI of
one file), the path inside the filesystem, the filesystem itself and the file's size. Readers reopen a
file with the filesystem and the footer already parsed, so a remote footer is fetched once per file.

Globs (`*`, `**`, `[...]`) are expanded by listing the longest prefix without a pattern (one `FileSelector`
call) and matching each listed key component by component, as a local glob would. Errors a user can fix
(a missing bucket, missing credentials, an unreachable endpoint, a pattern with no match) become one
`DataError` that says what to do.
"""

from __future__ import annotations

import fnmatch
import os
import pickle
import re
from dataclasses import dataclass
from typing import Optional
from urllib.parse import quote, urlsplit, urlunsplit

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from lowmem.errors import DataError

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_URI_GLOB_CHARS = set("*[")  # `?` starts a URI's query (?region=..., ?endpoint_override=...)
# Standard AWS variables for an S3-compatible store (MinIO, moto, ...); the first one set wins.
ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def is_uri(path: object) -> bool:
    """True for `scheme://...` strings (s3://, gs://, hdfs://, file://), False for local paths."""
    return isinstance(path, str) and bool(_URI.match(path))


@dataclass(frozen=True)
class DataFile:
    """One parquet file to read: local (`filesystem` None, opened by path) or on a pyarrow filesystem."""

    name: str  # as shown in messages: the local path, or the file's URI (s3://bucket/key.parquet)
    path: str  # the path inside `filesystem`; the local path itself when `filesystem` is None
    filesystem: Optional[pafs.FileSystem] = None
    size: Optional[int] = None  # bytes, when a listing already told us

    @property
    def is_remote(self) -> bool:
        return self.filesystem is not None


def _with_endpoint_from_environment(uri: str) -> str:
    """Add `endpoint_override` from AWS_ENDPOINT_URL(_S3) to an s3:// URI that does not set its own.

    Recent pyarrow reads these variables itself; older releases ignore them, and an explicit query value
    gives the same endpoint everywhere.
    """
    parts = urlsplit(uri)
    endpoint = _configured_endpoint()
    if parts.scheme != "s3" or not endpoint or "endpoint_override=" in parts.query:
        return uri
    option = f"endpoint_override={quote(endpoint, safe='')}"
    query = f"{parts.query}&{option}" if parts.query else option
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))


def filesystem_from_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow's filesystem for `uri` and the path inside it, with user-fixable errors as DataError."""
    try:
        return pafs.FileSystem.from_uri(_with_endpoint_from_environment(uri))
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise storage_error("open", uri, exc) from exc


def _display_name(scheme: str, netloc: str, fs_path: str) -> str:
    """The URI of a path inside a filesystem: s3://bucket/key, or hdfs://host:port/path."""
    if fs_path.startswith("/"):
        return f"{scheme}://{netloc}{fs_path}"
    return f"{scheme}://{fs_path}"  # object stores: the path starts with the bucket


def _glob_match(pattern_parts: list[str], path_parts: list[str]) -> bool:
    """Component-wise glob match: `*` stays within one component, `**` spans any number of them."""
    if not pattern_parts:
        return not path_parts
    head, rest = pattern_parts[0], pattern_parts[1:]
    if head == "**":
        return any(_glob_match(rest, path_parts[i:]) for i in range(len(path_parts) + 1))
    return bool(path_parts) and fnmatch.fnmatchcase(path_parts[0], head) and _glob_match(rest, path_parts[1:])


def _split_glob(uri: str) -> tuple[str, Optional[list[str]]]:
    """(the URI up to the first path component with a pattern, the pattern components), or (uri, None)."""
    try:
        parts = urlsplit(uri)
    except ValueError as exc:
        raise DataError(f"'{uri}' is not a valid URI ({exc}). Write it as scheme://bucket/path.") from exc
    components = parts.path.split("/")
    first = next((i for i, part in enumerate(components) if _URI_GLOB_CHARS & set(part)), None)
    if first is None:
        return uri, None
    if any(_URI_GLOB_CHARS & set(parts.netloc)):
        raise DataError(f"'{uri}': a pattern in the bucket or host name is not supported; name the bucket.")
    base = urlunsplit((parts.scheme, parts.netloc, "/".join(components[:first]), parts.query, ""))
    return base, components[first:]


def _list_files(filesystem: pafs.FileSystem, base: str, recursive: bool, uri: str) -> list[pafs.FileInfo]:
    try:
        infos = filesystem.get_file_info(pafs.FileSelector(base, recursive=recursive, allow_not_found=True))
    except (pa.ArrowException, OSError) as exc:
        raise storage_error("list", uri, exc) from exc
    return sorted((info for info in infos if info.type == pafs.FileType.File), key=lambda info: info.path)


def _file_info(filesystem: pafs.FileSystem, path: str, uri: str) -> pafs.FileInfo:
    try:
        return filesystem.get_file_info(path)
    except (pa.ArrowException, OSError) as exc:
        raise storage_error("look up", uri, exc) from exc


def resolve_uri(uri: str) -> list[DataFile]:
    """The parquet files a URI names: one file, every `*.parquet` below a prefix, or a glob's matches (sorted)."""
    base_uri, pattern = _split_glob(uri)
    parts = urlsplit(uri)
    filesystem, base = filesystem_from_uri(base_uri)

    def as_files(infos: list[pafs.FileInfo]) -> list[DataFile]:
        return [DataFile(_display_name(parts.scheme, parts.netloc, info.path), info.path, filesystem, info.size)
                for info in infos]

    if pattern is not None:
        base = base.rstrip("/")
        recursive = len(pattern) > 1 or "**" in pattern[0]
        wanted = base.split("/") + pattern
        matches = [info for info in _list_files(filesystem, base, recursive, uri)
                   if _glob_match(wanted, info.path.split("/"))]
        if not matches:
            listing = f"`aws s3 ls {_display_name(parts.scheme, parts.netloc, base)}/` lists what is there; "
            raise _missing_bucket(filesystem, base, uri) or DataError(
                f"No files match the pattern '{uri}'. Check the bucket, the prefix and the pattern "
                f"({listing if parts.scheme == 's3' else ''}`*` stays within one level, `**` spans levels), "
                "or pass the prefix ending in '/' to read every *.parquet below it."
            )
        return as_files(matches)

    info = _file_info(filesystem, base, uri)
    if info.type == pafs.FileType.File:
        return as_files([info])
    if info.type == pafs.FileType.Directory:
        matches = [f for f in _list_files(filesystem, base, True, uri) if f.path.endswith(".parquet")]
        if not matches:
            raise DataError(
                f"No parquet files found under '{uri}' (looked for *.parquet, recursively). Upload your "
                ".parquet files there or point to the files themselves."
            )
        return as_files(matches)
    raise _not_found(filesystem, base, uri)


def _missing_bucket(filesystem: pafs.FileSystem, path: str, uri: str) -> Optional[DataError]:
    """The message for a bucket that does not exist, when `path` is in one; None otherwise."""
    bucket = path.lstrip("/").split("/", 1)[0]
    if urlsplit(uri).scheme not in ("s3", "gs", "gcs") or not bucket:
        return None
    if _file_info(filesystem, bucket, uri).type != pafs.FileType.NotFound:
        return None
    return DataError(
        f"Data file not found: '{uri}': the bucket '{bucket}' does not exist or these credentials cannot see "
        f"it. Check the bucket name{_endpoint_hint()}."
    )


def _not_found(filesystem: pafs.FileSystem, path: str, uri: str) -> DataError:
    """The message for a URI that names nothing: say whether the bucket itself is missing."""
    return _missing_bucket(filesystem, path, uri) or DataError(
        f"Data file not found: '{uri}'. Check the key (names are case-sensitive), or pass its prefix ending "
        "in '/' or a glob such as 's3://bucket/prefix/*.parquet'."
    )


def _configured_endpoint() -> str | None:
    """The S3 endpoint the environment names (AWS_ENDPOINT_URL_S3 first), or None."""
    return next((os.environ[name] for name in ENDPOINT_VARIABLES if os.environ.get(name)), None)


def _endpoint_hint() -> str:
    endpoint = _configured_endpoint()
    if endpoint:
        return f", and that AWS_ENDPOINT_URL ({endpoint}) points to the right store"
    return ", the region (AWS_REGION), and for an S3-compatible store set AWS_ENDPOINT_URL=http://host:port"


_CREDENTIAL_SIGNS = ("ACCESS_DENIED", "INVALID_ACCESS_KEY", "SIGNATURE_DOES_NOT_MATCH", "EXPIRED_TOKEN",
                     "MISSING_AUTHENTICATION", "HTTP status 403", "credentials", "Forbidden", "Unauthorized")
_NETWORK_SIGNS = ("NETWORK_CONNECTION", "curlCode", "Could not connect", "resolve host", "Connection refused",
                  "timed out", "Timeout", "UNREACHABLE")


_DETAIL_CHARS = 300  # pyarrow's messages can list every path it tried; the start says what failed


def _detail(exc: BaseException) -> str:
    detail = " ".join(str(exc).split())
    return detail if len(detail) <= _DETAIL_CHARS else detail[:_DETAIL_CHARS] + " ..."


def storage_error(action: str, uri: str, exc: BaseException) -> DataError:
    """One-paragraph DataError for a failed storage call, saying what to do about the usual causes."""
    detail = _detail(exc)
    scheme = urlsplit(uri).scheme if is_uri(uri) else ""
    s3_hint = _endpoint_hint() if scheme == "s3" else ""
    if isinstance(exc, pa.ArrowInvalid) and "Unrecognized filesystem type" in detail:
        return DataError(
            f"'{uri}' uses a storage type pyarrow cannot read ('{scheme}://'). Use s3://, gs://, hdfs://, "
            "file:// or a local path."
        )
    if scheme in ("hdfs", "viewfs") and ("libjvm" in detail or "libhdfs" in detail):
        return DataError(
            f"Could not {action} '{uri}': pyarrow reads HDFS through Java's libhdfs, which it could not load "
            f"({detail}). Install Java and Hadoop, and set JAVA_HOME, HADOOP_HOME (or ARROW_LIBHDFS_DIR) and "
            "CLASSPATH=$(hadoop classpath --glob)."
        )
    if isinstance(exc, pa.ArrowNotImplementedError) or "not built with" in detail:
        return DataError(
            f"This pyarrow cannot read '{scheme}://' ({detail}). Install the pyarrow wheel from PyPI or "
            "conda-forge, which includes S3 and GCS."
        )
    if "NO_SUCH_BUCKET" in detail or "bucket does not exist" in detail:
        return DataError(
            f"Could not {action} '{uri}': the bucket does not exist ({detail}). Check the bucket name{s3_hint}."
        )
    if any(sign in detail for sign in _CREDENTIAL_SIGNS):
        return DataError(
            f"Could not {action} '{uri}': access was refused ({detail}). Set credentials that may read it: "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (plus AWS_SESSION_TOKEN for temporary ones) or "
            "AWS_PROFILE for s3://, GOOGLE_APPLICATION_CREDENTIALS for gs://."
        )
    if any(sign in detail for sign in _NETWORK_SIGNS):
        return DataError(
            f"Could not {action} '{uri}': the storage service could not be reached ({detail}). Check the "
            f"network{s3_hint}."
        )
    return DataError(f"Could not {action} '{uri}' ({detail}). Check the URI and that you may read it{s3_hint}.")


def read_remote_metadata(file: DataFile) -> pq.FileMetaData:
    """Read a remote file's footer (one ranged GET for a footer under 64 KiB)."""
    if file.size == 0:
        raise DataError(f"The data file '{file.name}' is empty (0 bytes). Remove it or upload it again.")
    try:
        return pq.read_metadata(file.path, filesystem=file.filesystem)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        if isinstance(exc, pa.ArrowInvalid) and "Parquet" in str(exc):
            raise DataError(
                f"'{file.name}' is not a readable parquet file ({exc}). It may be truncated (an interrupted "
                "upload) or not parquet at all: upload it again, or leave it out of the data files."
            ) from exc
        raise storage_error("read the footer of", file.name, exc) from exc


def fresh_filesystem(filesystem: pafs.FileSystem) -> pafs.FileSystem:
    """A new client with the same options (endpoint, region, credentials source).

    Each reading process gets its own: a client copied into a forked DataLoader worker would share the
    parent's pooled connections with the other workers.
    """
    return pickle.loads(pickle.dumps(filesystem))
