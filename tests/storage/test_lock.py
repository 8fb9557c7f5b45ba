"""klpipe/storage/lock.py: one holder at a time, a wait that ends, and no stale lock after a kill -9."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from klpipe.storage import lock as lock_module
from klpipe.storage.lock import RunLock
from tests.helpers import with_checkout

ME = f"pid {os.getpid()} on host {socket.gethostname()}"


def test_a_held_lock_is_refused_to_another_until_the_wait_ends(tmp_path):
    first, second = RunLock(tmp_path / "x.lock"), RunLock(tmp_path / "x.lock")
    assert first.acquire()
    assert first.holder() == ME and (tmp_path / "x.lock").read_text() == ME + "\n"
    assert not second.acquire()  # no wait: at once
    heard = []
    began = time.monotonic()
    assert not second.acquire(0.3, heard.append)
    assert time.monotonic() - began >= 0.3
    assert heard == [ME]  # told once who holds it
    first.release()
    assert second.acquire()


def test_a_waiting_run_takes_the_lock_once_it_is_released(tmp_path):
    first, second = RunLock(tmp_path / "x.lock"), RunLock(tmp_path / "x.lock")
    assert first.acquire()
    threading.Timer(0.3, first.release, kwargs={"remove": True}).start()
    began = time.monotonic()
    assert second.acquire(30)
    assert 0.3 <= time.monotonic() - began < 30
    assert (tmp_path / "x.lock").exists() and not RunLock(tmp_path / "x.lock").acquire()  # second holds the new file
    second.release(remove=True)
    assert not (tmp_path / "x.lock").exists()


def test_a_killed_holder_leaves_its_file_but_no_lock(tmp_path):
    path = tmp_path / "x.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", ("import sys, time\nfrom klpipe.storage.lock import RunLock\n"
                                "assert RunLock(sys.argv[1]).acquire()\nprint('held', flush=True)\ntime.sleep(60)"),
         str(path)], stdout=subprocess.PIPE, text=True, env=with_checkout(dict(os.environ)))
    try:
        assert holder.stdout.readline() == "held\n"
        assert not RunLock(path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert path.read_text() == f"pid {holder.pid} on host {socket.gethostname()}\n"  # the file stays
    taken = RunLock(path)
    assert taken.acquire()  # at once: the kernel dropped the lock with its holder
    assert taken.holder() == ME


def test_a_lock_on_a_file_its_holder_removed_meanwhile_is_not_held(tmp_path, monkeypatch):
    """A run opens the lock file, its holder removes it and lets go, then the run locks what it opened: a file
    no longer at the path, which a third run would create and lock anew. The run must lock the file at the path."""
    path = tmp_path / "x.lock"
    first, second = RunLock(path), RunLock(path)
    assert first.acquire()
    flock = lock_module.fcntl.flock
    calls = []

    def flock_after_the_holder_let_go(fd, operation):
        calls.append(os.fstat(fd).st_ino)
        if len(calls) == 1:  # between the second run's open and its lock
            first.release(remove=True)
        return flock(fd, operation)

    monkeypatch.setattr(lock_module.fcntl, "flock", flock_after_the_holder_let_go)
    assert second.acquire()
    monkeypatch.undo()
    assert len(calls) == 2 and calls[1] == os.stat(path).st_ino  # locked again: the file at the path now
    assert not RunLock(path).acquire()  # a third run finds it held
