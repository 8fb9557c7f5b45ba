"""The controller's state across runs: held from its read before a run to its write at the end.

A run reads the state, scores, and writes the next state. Two runs on one state that both read it
before either wrote it would each continue the same state, and the later write would drop the other
run's update. So a run holds the state from the read to the write:

- a local state under a lock beside it, `<state>.lock` (storage/lock.py): a second run waits for it
  (--wait-for-state), then reads the state the first one saved; past the wait it writes nothing and
  exits 75. The lock file is removed at the end; a killed run's is taken by the next run.
- a state on a store, which has no lock, by what the run read: the state is read again before the
  run's outputs are committed, and again just before the state is written, and the run stops (75) on
  any change. pyarrow sends no conditional request (If-Match), so this is no conditional write: a
  run that saves the state between the last read and this write's end is not seen. Runs on one
  machine also share a lock under KLPIPE_CACHE_DIR/locks, so there they wait for each other.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from klpipe.errors import OutputError, StateBusy, StateError
from klpipe.score.config import ScoreConfig
from klpipe.score.controller import KLController
from klpipe.storage.atomic import write_json_atomic
from klpipe.storage.fingerprint import cache_dir
from klpipe.storage.lock import RunLock
from klpipe.storage.store import Location, StorePath


def lock_path(state: Location) -> Path:
    """`<state>.lock` beside a local state; for one on a store, KLPIPE_CACHE_DIR/locks/<name>.<hash of the URI>.lock."""
    if not isinstance(state, StorePath):
        return state.with_name(state.name + ".lock")
    return cache_dir() / "locks" / f"{state.name}.{hashlib.sha256(state.uri.encode()).hexdigest()[:12]}.lock"


class HeldState:
    """The --state file (or none) from the read to the write, as a context manager: what this run read
    of it (`read`), whether it is still that (`check`), and the next state (`save`)."""

    def __init__(self, path: Location | None, wait: float, log: Callable[[str], object] = print):
        self.path = path
        self.wait = wait
        self.log = log
        self.read: bytes | None = None  # the state as this run read it; None where there was none
        self.waited = 0.0  # seconds spent waiting for another run that held it
        self._lock = None if path is None else RunLock(lock_path(path))

    def __enter__(self) -> HeldState:
        if self.path is None or self._lock is None:
            return self
        began = time.monotonic()
        self._take_lock(self._lock)
        self.waited = time.monotonic() - began
        try:
            self.read = self._current(self.path)
        except BaseException:
            self._lock.release(remove=True)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._lock is not None:
            self._lock.release(remove=True)

    def check(self) -> None:
        """Just before the run's outputs are committed: refuse, having written nothing, a state another run saved."""
        if self.path is not None and self._current(self.path) != self.read:
            raise StateBusy(f"{self.path}: another klpipe run saved this state while this one ran; nothing was "
                            "written: rerun to continue from its state")

    def save(self, state: dict[str, Any]) -> None:
        """Write the next state, only over the one this run read: compared once more just before it is replaced."""
        path = self.path
        assert path is not None, "a run without --state saves none"

        def unchanged() -> None:  # under the lock only a writer outside klpipe could have changed it
            if self._current(path) != self.read:
                raise StateBusy(f"{self.path}: another klpipe run saved this state while this one wrote its "
                                "outputs; they are written and the state is not advanced: rerun to score again "
                                "from its state")

        write_json_atomic(path, state, before_commit=unchanged)

    def _take_lock(self, lock: RunLock) -> None:
        def waiting(holder: str) -> None:
            self.log(f"waiting for {self.path}: another klpipe run{f' ({holder})' if holder else ''} holds it; "
                     f"up to {self.wait:g} s (--wait-for-state)")

        try:
            taken = lock.acquire(self.wait, waiting)
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot take its lock {lock.path} ({exc.strerror or exc})") from None
        if not taken:
            holder = lock.holder()
            raise StateBusy(f"{self.path}: another klpipe run{f' ({holder})' if holder else ''} still holds this "
                            f"state after {self.wait:g} s (--wait-for-state); nothing was written: rerun later")

    @staticmethod
    def _current(path: Location) -> bytes | None:
        """The state's bytes now; None where there is none."""
        if isinstance(path, StorePath):
            return path.read_bytes() if path.exists() else None
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateError(f"{path}: not a readable controller state file ({exc})") from None


def load_controller(config: ScoreConfig, held: HeldState,
                    warnings: list[str]) -> tuple[KLController, dict[str, Any] | None]:
    """The controller, continued from the state `held` read where there was one (unless --reset-state); its last
    run's record."""
    controller = KLController(config.controller)
    if held.read is None or config.reset_state:
        return controller, None
    path = config.state
    try:
        state = json.loads(held.read)
    except ValueError as exc:
        raise StateError(f"{path}: not a readable controller state file ({exc})") from None
    try:
        controller.load_state(state)
    except StateError as exc:
        raise StateError(f"{path}: {exc}; pass --reset-state to start a fresh controller") from None
    differences = controller.config_differences(state.get("config") or {})
    if differences:
        warnings.append(f"{path}: settings changed since the state was saved ({'; '.join(differences)})")
    last_run = state.get("last_run")
    return controller, last_run if isinstance(last_run, dict) else None


def batches_before(previous_run: dict[str, Any] | None, state_path: Location | None) -> int:
    """Controller batches scored into the state file by earlier runs: where this run's batch counter starts."""
    count = (previous_run or {}).get("controller_batches", 0)  # absent from states written before it was kept
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise StateError(f"{state_path}: last_run.controller_batches must be a non-negative integer, got {count!r}")
    return count
