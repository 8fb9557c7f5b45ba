"""One run at a time on what it reads and then replaces: an flock(2) on a lock file.

precompute takes one in its work directory, so that a second run on the same output is refused;
score takes one beside its --state file, held from reading the state to writing it, so that a
second run waits and continues from the first run's state. The kernel drops the lock when its
holder exits however it exits (kill -9 too), so a lock is never stale: a lock file a killed run left
is an ordinary file, which the next run locks.

The holder writes `pid N on host H` into the file, for the message of a run that finds it taken.
A lock file may be removed by its holder at release (a state's directory is left as it was); a run
that locked it meanwhile holds a file no longer at its path, sees so, and locks the new one.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

POLL_SECONDS = 0.1  # how often a waiting run tries the lock again


class RunLock:
    """An exclusive lock on the file at `path` (made when missing), taken at most once."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self, wait: float = 0.0, on_wait: Callable[[str], None] | None = None) -> bool:
        """Take the lock, trying for up to `wait` seconds: True once held, False if another run still holds it.

        `on_wait(holder)` is called once, when the first try finds the lock held and `wait` allows more.
        Raises OSError where the file cannot be made or opened.
        """
        deadline = time.monotonic() + wait
        if self._try():
            return True
        if wait > 0 and on_wait is not None:
            on_wait(self.holder())
        while time.monotonic() < deadline:
            time.sleep(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))
            if self._try():
                return True
        return False

    def holder(self) -> str:
        """`pid N on host H` of the run that holds the lock, as it wrote it; "" where it has not (yet)."""
        try:
            return self.path.read_text(errors="replace").strip()
        except OSError:
            return ""

    def release(self, remove: bool = False) -> None:
        """Let go; with `remove`, delete the lock file first, while still holding it."""
        if self._fd is None:
            return
        if remove:
            self.path.unlink(missing_ok=True)
        os.close(self._fd)  # releases the lock
        self._fd = None

    def _try(self) -> bool:
        while True:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            except BaseException:
                os.close(fd)
                raise
            if _names(self.path, fd):
                self._fd = fd
                _write_holder(fd)
                return True
            os.close(fd)  # its holder removed it between our open and our lock: lock the file there now


def _names(path: Path, fd: int) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _write_holder(fd: int) -> None:
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    except OSError:
        pass  # a full disk: the lock holds all the same, and a waiting run names no holder
