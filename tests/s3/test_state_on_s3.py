"""Two `klpipe score` runs on one --state on S3 (the moto server): the serial result or one refusal, never a
lost update (klpipe/score/state.py).

A state on a store has no lock: a run compares it with what it read just before its outputs are committed
and again just before the state is replaced. Two "machines" are two KLPIPE_CACHE_DIRs (the lock runs on one
machine share lives there). Real processes from the fault harness (tests/fault_runner.py), whose pause holds
the first run at a chosen point while the second runs. Results are compared, byte for byte, with the same
runs on local files one after the other.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.fault_runner import Child, Fault, Runner
from tests.helpers import two_days

RERUN_LATER = 75
DAY_ROWS, ROWS_PER_STEP = 480, 48


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    runner = Runner(tmp_path_factory.mktemp("logs"))
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def days(tmp_path_factory) -> dict[str, Path]:
    return {cache.stem: cache for cache in two_days(tmp_path_factory.mktemp("caches"), DAY_ROWS, ROWS_PER_STEP)}


def day_args(cache: Path, where: str) -> list:
    return ["score", cache, "-o", f"{where}/{cache.stem}.scored.parquet", "--metrics-jsonl",
            f"{where}/{cache.stem}.metrics.jsonl", "--state", f"{where}/kl_state.json"]


@pytest.fixture(scope="module")
def serial(runner, days, tmp_path_factory) -> dict[str, Path]:
    """Local runs one after the other, in each order, and day 2 alone: {"day1,day2": directory, ...}."""
    found = {}
    for order in ("day1,day2", "day2,day1", "day2"):
        directory = tmp_path_factory.mktemp(order.replace(",", "-"))
        for day in order.split(","):
            result = runner.run(day_args(days[day], str(directory)))
            assert result.returncode == 0, result.stderr
        found[order] = directory
    return found


class Machine:
    """klpipe runs on one machine: its own KLPIPE_CACHE_DIR, the writer's credentials for the S3 server."""

    def __init__(self, runner: Runner, server, cache_dir: Path):
        self.runner = runner
        self.env = {**server.env(), "KLPIPE_CACHE_DIR": str(cache_dir)}

    def start(self, args: list, fault: Fault | None = None) -> Child:
        return self.runner.start(args, fault, env=self.env)


def assert_on_s3_as(server, bucket: str, expected: Path, days: tuple[str, ...]) -> None:
    """The state and `days`' outputs on S3 are, byte for byte, those of the local runs in `expected`."""
    assert server.read(bucket, "out/kl_state.json") == (expected / "kl_state.json").read_bytes()
    for day in days:
        got = pq.read_table(io.BytesIO(server.read(bucket, f"out/{day}.scored.parquet")))
        assert got.equals(pq.read_table(expected / f"{day}.scored.parquet"), check_metadata=True), day
        assert server.read(bucket, f"out/{day}.metrics.jsonl") == (expected / f"{day}.metrics.jsonl").read_bytes()


@pytest.mark.parametrize("pause, refusal", [
    (Fault("score_batch", at=1, action="pause"),
     "another klpipe run saved this state while this one ran; nothing was written: rerun to continue from its state"),
    (Fault("write_text", match="kl_state.json", action="pause"),
     ("another klpipe run saved this state while this one wrote its outputs; they are written and the state is not "
      "advanced: rerun to score again from its state")),
], ids=["before-the-outputs", "before-the-state"])
def test_two_machines_end_with_one_refusal_and_no_lost_update(runner, s3_server, bucket, days, serial, tmp_path,
                                                               pause, refusal):
    """Day 1 on machine A is held (with the state read) while day 2 on machine B runs whole and saves the state;
    day 1 then finds the state changed, exits 75 and leaves day 2's state; its rerun continues from it."""
    where = f"s3://{bucket}/out"
    a, b = (Machine(runner, s3_server, tmp_path / name) for name in ("machine-a", "machine-b"))
    first = a.start(day_args(days["day1"], where), pause).wait_paused()
    second = b.start(day_args(days["day2"], where)).wait()
    assert second.returncode == 0, second.stderr
    first.go()
    refused = first.wait()
    assert refused.returncode == RERUN_LATER, refused.stderr
    assert refused.stderr.strip() == f"Error: {where}/kl_state.json: {refusal}"
    assert_on_s3_as(s3_server, bucket, serial["day2"], ("day2",))  # day 2's update stands
    if pause.phase == "score_batch":  # refused before its outputs: nothing of day 1 on the store
        assert not [key for key in s3_server.keys_under(bucket, "out/") if key.startswith("out/day1")]
    rerun = a.start(day_args(days["day1"], where)).wait()
    assert rerun.returncode == 0, rerun.stderr
    assert_on_s3_as(s3_server, bucket, serial["day2,day1"], ("day1", "day2"))


def test_one_machine_waits_for_the_run_that_holds_a_state_on_s3(runner, s3_server, bucket, days, serial, tmp_path):
    """On one machine the runs share a lock (in KLPIPE_CACHE_DIR): day 2 waits for day 1, then continues from it."""
    where = f"s3://{bucket}/out"
    machine = Machine(runner, s3_server, tmp_path / "machine")
    first = machine.start(day_args(days["day1"], where), Fault("score_batch", at=1, action="pause")).wait_paused()
    second = machine.start(day_args(days["day2"], where))
    deadline = time.monotonic() + 60
    while "waiting for" not in second.stderr():
        assert second.poll() is None, "day 2 did not wait"
        assert time.monotonic() < deadline, second.stderr()
        time.sleep(0.01)
    assert second.stderr().startswith(f"waiting for {where}/kl_state.json: another klpipe run (pid {first.pid} ")
    first.go()
    assert first.wait().returncode == 0
    result = second.wait()
    assert result.returncode == 0, result.stderr
    assert_on_s3_as(s3_server, bucket, serial["day1,day2"], ("day1", "day2"))
    assert not list((tmp_path / "machine" / "locks").iterdir())  # the lock file went with its last holder
