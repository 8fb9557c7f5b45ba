"""File plumbing shared by both stages: finding inputs, reading parquet, fingerprints, atomic outputs."""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from klpipe.errors import InputError, OutputError

PARQUET_SUFFIXES = (".parquet",)


def _read_umask() -> int:
    # os.umask can only be read by setting it; done once at import, before any thread exists.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()
JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


def is_datasets_dir(path: Path) -> bool:
    """A directory written by `datasets.Dataset.save_to_disk`."""
    return path.is_dir() and (path / "dataset_info.json").is_file() and (path / "state.json").is_file()


def expand_inputs(paths: list[str | Path], suffixes: tuple[str, ...]) -> list[Path]:
    """Files named on the command line, with directories expanded to their files in sorted order.

    A `save_to_disk` directory stays whole: `datasets` reads it as one input.
    """
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise InputError(f"{path}: no such file or directory")
        if path.is_dir() and not is_datasets_dir(path):
            children = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(suffixes))
            if not children:
                raise InputError(f"{path}: directory holds no {'/'.join(suffixes)} files")
            found.extend(children)
        else:
            found.append(path)
    return found


def output_beside(first_input: str | Path, suffix: str, input_suffixes: tuple[str, ...]) -> Path:
    """`<stem><suffix>` beside the first input, the stem being its name less an input suffix (a directory's
    whole name): `day.v1.parquet` → `day.v1<suffix>`, so inputs that differ before the suffix never share an output."""
    first_input = Path(first_input)
    name = first_input.name
    if not first_input.is_dir():
        known = [s for s in input_suffixes if name.endswith(s)]
        name = name.removesuffix(max(known, key=len)) if known else name
    return first_input.parent / f"{name}{suffix}"


def refuse_overwriting_inputs(output: Path, inputs: list[Path]) -> None:
    """An output that is also an input would destroy the input: both stages refuse it, --overwrite or not."""
    resolved = Path(output).resolve()
    for path in inputs:
        if Path(path).resolve() == resolved:
            raise OutputError(f"{output}: is also an input; pass another --output")


def schema_difference(expected: pa.Schema, got: pa.Schema) -> str:
    """How `got` differs from `expected`, for messages about inputs that must share a schema."""
    expected_fields = {f.name: f.type for f in expected}
    got_fields = {f.name: f.type for f in got}
    parts = [f"no {name}" for name in expected_fields if name not in got_fields]
    parts += [f"extra {name}" for name in got_fields if name not in expected_fields]
    parts += [
        f"{name} is {got_fields[name]} not {kind}"
        for name, kind in expected_fields.items()
        if name in got_fields and got_fields[name] != kind
    ]
    return ", ".join(parts) or "column order"


# pyarrow's reader defaults hold far more than the batch they hand out: `pre_buffer=True` caches
# the column chunks of every row group it is asked for and keeps them as the batches go by (reading
# a whole file that way held memory in proportion to the file), and `buffer_size=0` reads each
# column chunk whole (a row group of wide rows can be gigabytes). Off, and buffered reads of 1 MiB:
# a reader holds about a page per column plus the batch it hands out, whatever the file's size.
PARQUET_READ_BUFFER = 1 << 20


def open_parquet(path: str | Path) -> pq.ParquetFile:
    """A parquet reader whose memory does not grow with the file: every klpipe reader opens files this way."""
    return pq.ParquetFile(path, pre_buffer=False, buffer_size=PARQUET_READ_BUFFER)


# Files up to this size are hashed whole; larger ones by their size, head and tail.
FULL_HASH_LIMIT = 64 << 20
SAMPLE_BYTES = 4 << 20


def fingerprint(path: Path) -> dict:
    """Name, size and a sha256 of a file (or of every file of a directory), to detect changed inputs.

    Every shard of a sharded run fingerprints every input, so hashing terabytes whole would cost
    each shard a full read. Past 64 MiB the hash covers the first and last 4 MiB (for parquet,
    the footer with every row group's offsets and statistics) plus the size.
    """
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    size = 0
    for file in files:
        file_size = file.stat().st_size
        size += file_size
        digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}:{file_size}".encode())
        with open(file, "rb") as fh:
            if file_size <= FULL_HASH_LIMIT:
                while chunk := fh.read(1 << 22):
                    digest.update(chunk)
            else:
                digest.update(fh.read(SAMPLE_BYTES))
                fh.seek(file_size - SAMPLE_BYTES)
                digest.update(fh.read(SAMPLE_BYTES))
    return {"name": path.name, "size": size, "sha256": digest.hexdigest()}


@contextmanager
def atomic_output(path: str | Path, tmp_dir: str | Path | None = None) -> Iterator[Path]:
    """Yield a temporary path; rename it to `path` only if the block succeeds.

    The temporary file lives beside `path` (or in `tmp_dir`, which must be on the same
    filesystem) so the final rename is atomic, and a crash never leaves anything under the
    final name. A work directory as `tmp_dir` means a kill -9 leaves no stray file beside outputs.

    A kill -9 can still leave the temporary file `.<name>.<random>.tmp` itself. The writer holds a
    lock on it until the rename, so the next write of the same `path` tells a dead writer's file
    from a live one's, and removes the dead ones.
    """
    path = Path(path)
    directory = Path(tmp_dir) if tmp_dir is not None else path.parent
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(directory, path.name)
        fd, tmp = _locked_tmp(directory, path.name)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write here ({exc.strerror or exc})") from None
    try:
        # mkstemp makes 0600 files; outputs should get the usual umask-derived mode, like open() gives.
        os.fchmod(fd, 0o666 & ~_UMASK)
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"{path}: write failed ({exc.strerror or exc})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)  # releases the lock


def _tmp_pattern(name: str) -> str:
    # mkstemp's names: prefix, 8 random characters, suffix.
    return f".{glob.escape(name)}.{'?' * 8}.tmp"


def _locked_tmp(directory: Path, name: str) -> tuple[int, Path]:
    """A new temporary file for `name`, locked: (its descriptor, its path)."""
    while True:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink:
            return fd, Path(tmp_name)
        os.close(fd)  # removed as stale by another run between mkstemp and the lock: make another


def _remove_stale_tmp(directory: Path, name: str) -> None:
    """Remove the temporary files of `name` that no live writer holds: a killed run's."""
    for stale in directory.glob(_tmp_pattern(name)):
        try:
            fd = os.open(stale, os.O_RDONLY)
        except OSError:
            continue  # gone already
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            stale.unlink(missing_ok=True)
        except OSError:
            pass  # locked: a live writer's
        finally:
            os.close(fd)


def write_json_atomic(path: str | Path, data: object, tmp_dir: str | Path | None = None) -> None:
    with atomic_output(path, tmp_dir=tmp_dir) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)
