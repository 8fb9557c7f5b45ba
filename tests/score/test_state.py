"""Runs on one --state file overlap as they would run one after the other (klpipe/score/state.py).

Real processes: each `klpipe score` is a child of the fault harness (tests/fault_runner.py), whose pause
holds the first run at its first record batch (its state read, its lock taken) for as long as a test needs
the overlap, and whose kill stops a run while it holds the lock. Every result is compared with the same two
days scored one after the other: the state file, both scored files and both metrics files, byte for byte.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.fault_runner import Child, Fault, Runner
from tests.helpers import two_days

DAY_ROWS = 480
ROWS_PER_STEP = 48  # one controller batch per 48 rows: 10 a day
RERUN_LATER = 75


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    runner = Runner(tmp_path_factory.mktemp("logs"))
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def days(tmp_path_factory) -> list[Path]:
    return two_days(tmp_path_factory.mktemp("caches"), DAY_ROWS, ROWS_PER_STEP)


def day_args(cache: Path, directory: Path, *extra) -> list:
    name = cache.stem
    return ["score", cache, "-o", directory / f"{name}.scored.parquet", "--metrics-jsonl",
            directory / f"{name}.metrics.jsonl", "--state", directory / "kl_state.json", *extra]


@dataclass(frozen=True)
class Serial:
    directory: Path  # day 1 then day 2 scored one after the other
    after_day1: bytes  # the state file between the two


@pytest.fixture(scope="module")
def serial(runner, days, tmp_path_factory) -> Serial:
    directory = tmp_path_factory.mktemp("serial")
    after_day1 = b""
    for cache in days:
        result = runner.run(day_args(cache, directory))
        assert result.returncode == 0, result.stderr
        after_day1 = after_day1 or (directory / "kl_state.json").read_bytes()
    state = json.loads((directory / "kl_state.json").read_text())
    assert state["last_run"]["controller_batches"] == 2 * DAY_ROWS // ROWS_PER_STEP  # both days' batches
    assert json.loads(after_day1)["kl_coeff"] != state["kl_coeff"]  # day 2 moved the controller on
    return Serial(directory, after_day1)


def assert_serial(directory: Path, serial: Serial) -> None:
    """The state and both days' outputs are those of the two runs one after the other, exactly."""
    expected = serial.directory
    assert (directory / "kl_state.json").read_bytes() == (expected / "kl_state.json").read_bytes()
    for day in ("day1", "day2"):
        got = pq.read_table(directory / f"{day}.scored.parquet")
        assert got.equals(pq.read_table(expected / f"{day}.scored.parquet"), check_metadata=True), day
        assert (directory / f"{day}.metrics.jsonl").read_bytes() == (expected / f"{day}.metrics.jsonl").read_bytes()
    assert not (directory / "kl_state.json.lock").exists()  # removed by the last run that held it


def paused_at_first_batch(runner: Runner, cache: Path, directory: Path) -> Child:
    """A run holding the state: its lock taken and the state read, paused before its first record batch."""
    return runner.start(day_args(cache, directory), Fault("score_batch", at=1, action="pause")).wait_paused()


def holder(child: Child) -> str:
    return f"pid {child.pid} on host {socket.gethostname()}"


def test_two_overlapping_runs_on_one_state_give_the_serial_result(runner, days, serial, tmp_path):
    """Day 2 starts while day 1 still scores: it waits for day 1's state, then continues from it."""
    first = paused_at_first_batch(runner, days[0], tmp_path)
    second = runner.start(day_args(days[1], tmp_path))
    state = tmp_path / "kl_state.json"
    deadline = time.monotonic() + 60
    while "waiting for" not in second.stderr():
        assert second.poll() is None, "day 2 did not wait for day 1, which holds the state"
        assert time.monotonic() < deadline, second.stderr()
        time.sleep(0.01)
    assert second.stderr().splitlines() == [(f"waiting for {state}: another klpipe run ({holder(first)}) holds it; "
                                             "up to 300 s (--wait-for-state)")]
    time.sleep(1)
    assert second.poll() is None and not state.exists()  # still waiting; day 1 has written nothing yet
    first.go()
    assert first.wait().returncode == 0
    result = second.wait()
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("waiting for") == 1  # said once
    assert_serial(tmp_path, serial)


def test_past_the_wait_the_second_run_exits_75_and_writes_nothing(runner, days, serial, tmp_path):
    first = paused_at_first_batch(runner, days[0], tmp_path)
    state = tmp_path / "kl_state.json"
    before = sorted(p.name for p in tmp_path.iterdir())
    began = time.monotonic()
    refused = runner.run(day_args(days[1], tmp_path, "--wait-for-state", "1.5"), timeout=60)
    assert refused.returncode == RERUN_LATER, refused.stderr
    assert time.monotonic() - began >= 1.5
    assert refused.stderr.splitlines() == [
        f"waiting for {state}: another klpipe run ({holder(first)}) holds it; up to 1.5 s (--wait-for-state)",
        (f"Error: {state}: another klpipe run ({holder(first)}) still holds this state after 1.5 s "
         "(--wait-for-state); nothing was written: rerun later"),
    ]
    # Nothing of day 2: no scored file, no metrics, no state; day 1's lock and its staged output as they were.
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not any(p.name.startswith(("day2", ".day2")) for p in tmp_path.iterdir()) and not state.exists()
    first.go()
    assert first.wait().returncode == 0
    # Rerun later: day 2 continues from day 1's state.
    rerun = runner.run(day_args(days[1], tmp_path, "--wait-for-state", "0"))
    assert rerun.returncode == 0, rerun.stderr
    assert_serial(tmp_path, serial)


@pytest.mark.parametrize("fault", [Fault("score_batch", at=1, action="kill"),
                                   Fault("write_text", match="kl_state.json", fraction=0.5, action="kill")],
                         ids=["scoring", "mid-write-of-the-state"])
def test_a_run_killed_holding_the_lock_leaves_a_state_the_next_run_reads(runner, days, serial, tmp_path, fault):
    day1 = runner.run(day_args(days[0], tmp_path))
    assert day1.returncode == 0, day1.stderr
    killed = runner.start(day_args(days[1], tmp_path), fault)
    result = killed.wait()
    assert result.returncode == -signal.SIGKILL and result.fired(), result.stderr
    assert (tmp_path / "kl_state.json").read_bytes() == serial.after_day1  # day 1's state, whole
    assert (tmp_path / "kl_state.json.lock").read_text() == holder(killed) + "\n"  # the dead run's lock file
    # The kernel dropped the lock with the run: the rerun takes it at once, never waiting on the file left.
    began = time.monotonic()
    rerun = runner.run(day_args(days[1], tmp_path, "--wait-for-state", "0"))
    assert rerun.returncode == 0, rerun.stderr
    assert "waiting" not in rerun.stderr and time.monotonic() - began < 30
    assert_serial(tmp_path, serial)
