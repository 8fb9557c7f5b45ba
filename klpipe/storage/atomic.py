"""Outputs that appear whole or not at all: a temporary file beside the output, renamed into place.

An output on a store (storage/store.py) is written to a local temporary file the same way, in the
work directory or $TMPDIR, and uploaded at commit by upload.py, which never lets half an object
appear under its name.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from klpipe.errors import OutputError
from klpipe.storage.store import Location, StorePath, staging_dir


def _read_umask() -> int:
    # os.umask can only be read by setting it; done once at import, before any thread exists.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


class OutputGroup:
    """Files that appear together or not at all: each is written to a temporary file beside it, and
    `commit` renames every one into place only once all of them are complete.

    A run that fails writing its third output (a full disk, say) then leaves none of the three,
    where renaming each as it was done would leave the first two looking complete. Used as a context
    manager: temporary files of a group that never committed are removed when it exits.

    A kill -9 can still leave a temporary file `.<name>.<random>.tmp`. The writer holds a lock on it
    until the rename, so the next write of the same output tells a dead writer's file from a live
    one's, and removes the dead ones.
    """

    def __init__(self) -> None:
        self._staged: list[tuple[int, Path, Location]] = []  # (locked descriptor, temporary file, final path)

    def __enter__(self) -> OutputGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd, tmp, _ in self._staged:  # never committed: an error came first
            _discard(fd, tmp)
        self._staged = []

    @contextmanager
    def file(self, path: str | Path | Location, tmp_dir: str | Path | None = None) -> Iterator[Path]:
        """Yield a temporary path to write `path` to; staged for `commit` if the block succeeds.

        The temporary file lives beside `path` (or in `tmp_dir`, which must be on the same
        filesystem) so the rename is atomic. A work directory as `tmp_dir` means a kill -9 leaves no
        stray file beside outputs. For an output on a store it lives in `tmp_dir` or $TMPDIR, on
        local disk, until the commit uploads it.
        """
        final: Location = path if isinstance(path, StorePath) else Path(path)
        if tmp_dir is not None:
            directory = Path(tmp_dir)
        else:
            directory = staging_dir() if isinstance(final, StorePath) else final.parent
        try:
            if isinstance(final, Path):
                final.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_tmp(directory, final.name)
            fd, tmp = _locked_tmp(directory, final.name)
        except OSError as exc:
            raise OutputError(f"{final}: cannot write here ({exc.strerror or exc})") from None
        try:
            # mkstemp makes 0600 files; outputs should get the usual umask-derived mode, like open() gives.
            os.fchmod(fd, 0o666 & ~_UMASK)
            yield tmp
            _fsync_file(tmp)
        except OSError as exc:
            _discard(fd, tmp)
            raise OutputError(f"{final}: write failed ({exc.strerror or exc})") from None
        except BaseException:
            _discard(fd, tmp)
            raise
        self._staged.append((fd, tmp, final))

    def commit(self) -> None:
        """Rename every staged file into place, durably; upload those bound for a store, first.

        Uploads go first because they are slow and can fail (the network, permissions); the local
        renames after them are quick. Each object appears whole, but unlike a rename, not all at
        once: a failure after the first upload leaves the earlier ones in place.
        """
        staged, self._staged = self._staged, []
        try:
            remote = [(tmp, path) for _, tmp, path in staged if isinstance(path, StorePath)]
            if remote:
                from klpipe.storage.upload import publish

                publish(remote)  # raises an error naming the URI that failed
            for _, tmp, path in staged:
                if isinstance(path, StorePath):
                    continue
                try:
                    os.replace(tmp, path)
                    _fsync_dir(path.parent)
                except OSError as exc:
                    raise OutputError(f"{path}: write failed ({exc.strerror or exc})") from None
        finally:
            for fd, tmp, _ in staged:
                _discard(fd, tmp)  # releases the lock; the file is gone from `tmp` once renamed


@contextmanager
def atomic_output(path: str | Path | Location, tmp_dir: str | Path | None = None,
                  before_commit: Callable[[], None] | None = None) -> Iterator[Path]:
    """Yield a temporary path; rename it to `path` only if the block succeeds (an OutputGroup of one).

    `before_commit`, where given, runs once the file is complete, just before it replaces `path`: an error
    it raises leaves `path` as it was.
    """
    with OutputGroup() as group:
        with group.file(path, tmp_dir) as tmp:
            yield tmp
        if before_commit is not None:
            before_commit()
        group.commit()


def _discard(fd: int, tmp: Path) -> None:
    Path(tmp).unlink(missing_ok=True)
    os.close(fd)  # releases the lock


@contextmanager
def scratch_directory(directory: str | Path | Location, name: str) -> Iterator[Path]:
    """Yield a new empty directory `.<name>.<random>.tmp` in `directory`, removed with its contents at the end.

    For writers that name their own files: they write there, and the caller moves the finished file
    into its place (an OutputGroup file). Locked like atomic_output's temporary files, so the next
    scratch directory of the same `name` removes a killed run's and never a live one's. For a
    directory on a store, it is made in $TMPDIR, where that OutputGroup file is staged too.
    """
    local = staging_dir() if isinstance(directory, StorePath) else Path(directory)
    try:
        local.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(local, name)
        fd, scratch = _locked_tmp(local, name, is_dir=True)
    except OSError as exc:
        raise OutputError(f"{local}: cannot write here ({exc.strerror or exc})") from None
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


def write_json_atomic(path: str | Path | Location, data: object, tmp_dir: str | Path | None = None,
                      before_commit: Callable[[], None] | None = None) -> None:
    with atomic_output(path, tmp_dir=tmp_dir, before_commit=before_commit) as tmp:
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
