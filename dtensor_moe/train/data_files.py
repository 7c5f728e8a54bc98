"""The user's data files (data.source = "files"): found by glob, checked, and read as documents or token shards.

Formats by extension: .txt / .md (the whole file is one document), .jsonl (one JSON object per line, its
data.text_field a document), .parquet (the data.text_field column, a document per row; needs pyarrow) and .npy
(a 1-D integer array of token ids already tokenized, taken as it is). Every problem is a ValueError naming the file
(and line) and what is valid, raised before any rank starts.
"""

import glob
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl", ".parquet": "parquet", ".npy": "tokens"}
PYARROW_HINT = "pip install pyarrow (or pip install 'dtensor_moe[data]')"


@dataclass(frozen=True)
class DataFile:
    path: str
    format: str  # a FORMATS value
    size: int  # bytes


def _check_readable(path: str, name: str) -> int:
    try:
        size = os.stat(path).st_size
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ValueError(f"data.{name}: {path!r} cannot be read ({e.strerror}); valid: readable files") from None
    if size == 0:
        raise ValueError(f"data.{name}: {path!r} is empty; remove it or narrow the pattern")
    return size


def find_files(patterns: tuple[str, ...], name: str = "paths") -> list[DataFile]:
    """Each pattern's matches, sorted (a file two patterns match once); data.`name` is named in errors."""
    out, seen = [], set()
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        files = [m for m in matches if not os.path.isdir(m)]
        if not files:
            what = "only directories" if matches else "no file"
            raise ValueError(f"data.{name} pattern {pattern!r} matches {what} (relative to {os.getcwd()}); give "
                             "files or a glob pattern such as 'data/*.jsonl' or 'data/**/*.parquet'")
        for path in files:
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            ext = os.path.splitext(path)[1].lower()
            if ext not in FORMATS:
                raise ValueError(f"data.{name}: {path!r} has an unknown extension {ext or '(none)'!r}; valid: "
                                 f"{', '.join(FORMATS)} (text, JSON lines, Parquet, token ids as a 1-D .npy array)")
            out.append(DataFile(path, FORMATS[ext], _check_readable(path, name)))
    if any(f.format == "parquet" for f in out) and importlib.util.find_spec("pyarrow") is None:
        first = next(f.path for f in out if f.format == "parquet")
        raise ValueError(f"data.{name}: reading Parquet ({first!r}) needs pyarrow: {PYARROW_HINT}")
    return out


def documents(f: DataFile, field: str) -> Iterator[tuple[str, int]]:
    """(text, bytes of the file it took) of each document of a text, JSON lines or Parquet file."""
    if f.format == "text":
        with open(f.path, "rb") as fh:
            raw = fh.read()
        try:
            yield raw.decode("utf-8"), len(raw)
        except UnicodeDecodeError as e:
            raise ValueError(f"data.paths: {f.path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    elif f.format == "jsonl":
        yield from _jsonl(f, field)
    elif f.format == "parquet":
        yield from _parquet(f, field)
    else:
        raise AssertionError(f.format)


def _jsonl(f: DataFile, field: str) -> Iterator[tuple[str, int]]:
    n = 0
    with open(f.path, "rb") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{f.path}:{i}"
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"data.paths: {where} is not a JSON object ({e}); valid: one JSON object per "
                                 "line") from None
            if not isinstance(row, dict):
                raise ValueError(f"data.paths: {where} is {type(row).__name__}, not a JSON object")
            if field not in row:
                raise ValueError(f"data.text_field {field!r} is missing at {where} (its fields: {sorted(row)[:10]}); "
                                 "set data.text_field to the field that holds the text")
            if not isinstance(row[field], str):
                raise ValueError(f"data.text_field {field!r} at {where} is {type(row[field]).__name__}, not a string")
            n += 1
            yield row[field], len(line)
    if n == 0:
        raise ValueError(f"data.paths: {f.path!r} holds no documents (only blank lines)")


def _parquet(f: DataFile, field: str) -> Iterator[tuple[str, int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f.path)
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"data.paths: {f.path!r} is not a readable Parquet file ({e})") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise ValueError(f"data.text_field {field!r} is not a column of {f.path!r} (its columns: "
                         f"{schema.names[:10]}); set data.text_field to the column that holds the text")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"data.text_field {field!r} of {f.path!r} is a {kind} column, not strings")
    if pf.metadata.num_rows == 0:
        raise ValueError(f"data.paths: {f.path!r} holds no rows")
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text, 0


def token_shard(f: DataFile, vocab: int):
    """The 1-D integer array of a .npy shard (memory-mapped), each id checked to be < `vocab`."""
    import numpy as np

    try:
        ids = np.load(f.path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"data.paths: {f.path!r} is not a readable .npy array ({e})") from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.size == 0:
        raise ValueError(f"data.paths: {f.path!r} holds a {ids.dtype} array of shape {ids.shape}; valid: a non-empty "
                         "1-D integer array of token ids")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"data.paths: {f.path!r} holds token ids {lo}..{hi}; the model's embedding has "
                         f"model.vocab_size = {vocab} rows (valid ids 0..{vocab - 1})")
    return ids
