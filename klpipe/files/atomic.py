"""Outputs that appear whole or not at all: a temporary file beside the output, renamed into place."""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from klpipe.errors import OutputError


def _read_umask() -> int:
    # os.umask can only be read by setting it; done once at import, before any thread exists.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


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
        move_into_place(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"{path}: write failed ({exc.strerror or exc})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)  # releases the lock


def move_into_place(src: Path, path: Path) -> None:
    """Rename a finished file on `path`'s filesystem to `path`, durably: its bytes, then the name."""
    _fsync_file(src)
    os.replace(src, path)
    _fsync_dir(path.parent)


@contextmanager
def scratch_directory(directory: str | Path, name: str) -> Iterator[Path]:
    """Yield a new empty directory `.<name>.<random>.tmp` in `directory`, removed with its contents at the end.

    For writers that name their own files: they write there, and the caller moves the finished file
    into place with `move_into_place`. Locked like atomic_output's temporary files, so the next
    scratch directory of the same `name` removes a killed run's and never a live one's.
    """
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(directory, name)
        fd, scratch = _locked_tmp(directory, name, is_dir=True)
    except OSError as exc:
        raise OutputError(f"{directory}: cannot write here ({exc.strerror or exc})") from None
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        os.close(fd)  # releases the lock


def _tmp_pattern(name: str) -> str:
    # mkstemp's names: prefix, 8 random characters, suffix.
    return f".{glob.escape(name)}.{'?' * 8}.tmp"


def _locked_tmp(directory: Path, name: str, is_dir: bool = False) -> tuple[int, Path]:
    """A new temporary file (or directory) for `name`, locked: (its descriptor, its path)."""
    while True:
        if is_dir:
            tmp_name = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
            fd = os.open(tmp_name, os.O_RDONLY)  # flock works on a directory's read-only descriptor
        else:
            fd, tmp_name = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink:
            return fd, Path(tmp_name)
        os.close(fd)  # removed as stale by another run between creation and the lock: make another


def _remove_stale_tmp(directory: Path, name: str) -> None:
    """Remove the temporary files and scratch directories of `name` that no live writer holds: a killed run's."""
    for stale in directory.glob(_tmp_pattern(name)):
        try:
            fd = os.open(stale, os.O_RDONLY)
        except OSError:
            continue  # gone already
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
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
