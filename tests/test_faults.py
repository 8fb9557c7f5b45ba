"""Fault injection: kill, stop, starve and race `klpipe precompute`, and kill `klpipe score`.

The contract under test: no file under a final name is ever partial, finished checkpoint chunks
survive any fault, and rerunning the same command gives exactly the output of an uninterrupted
run (the same ids in the same order, logprobs within 1e-6; in fact bit for bit, metadata included).

Each fault kind runs `trial` 0..9. A trial's seed (printed, and in every assertion message) picks
where the fault lands among the calls an uninterrupted run makes (its census), so every trial hits
a real point of a real run rather than a guessed moment. How faults are injected:
tests/fault_runner.py (the real klpipe code, wrapped at its seams in a forked child).

Selection: every test here is marked `faults`. A plain `pytest` (`make test`) collects trial 0 of
each kind, the quick subset; `pytest -m faults` (`make test-faults`) collects all ten. Nothing is
skipped to get there: the trials are simply not generated (see pytest_generate_tests below).
KLPIPE_FAULTS=all|quick overrides the choice; KLPIPE_FAULT_SEED=N moves every trial to new points.
Reproduce one trial: pytest -m faults -s 'tests/test_faults.py::test_sigkill[7-forward]'.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.fault_runner import Fault, Result, Runner
from tests.helpers import ROLLOUTS, TINY_LLAMA

pytestmark = pytest.mark.faults

FULL_TRIALS = 10
COPIES = 10  # the 48 sample rollouts ten times over: 480 rows
CHUNK_ROWS = 8  # → 60 checkpoint chunks, so any fault lands mid-run with work before and after it
PREEMPTED = 75
BAD_INPUT = 2


def pytest_generate_tests(metafunc):
    if "trial" in metafunc.fixturenames:
        metafunc.parametrize("trial", range(_trial_count(metafunc.config)))


def _trial_count(config) -> int:
    override = os.environ.get("KLPIPE_FAULTS", "")
    if override in ("all", "quick"):
        return FULL_TRIALS if override == "all" else 1
    markexpr = config.getoption("markexpr", "") or ""
    try:
        from _pytest.mark.expression import Expression

        expression = Expression.compile(markexpr) if markexpr else None
        # All ten trials only for an expression that selects fault tests and not unmarked ones (`-m faults`):
        # make test's `not arch and not slow` selects both, and takes the quick subset.
        full = (expression is not None and expression.evaluate(lambda name, **_: name == "faults")
                and not expression.evaluate(lambda name, **_: False))
    except Exception:  # noqa: BLE001 - a pytest without that (private) module: read the expression plainly
        full = "faults" in markexpr and "not faults" not in markexpr
    return FULL_TRIALS if full else 1


@pytest.mark.parametrize("markexpr, trials", [("", 1), ("not arch and not slow", 1), ("faults", FULL_TRIALS),
                                              ("faults and not slow", FULL_TRIALS), ("not faults", 1)])
def test_only_an_expression_that_asks_for_faults_runs_all_trials(markexpr, trials, monkeypatch):
    # make test's own expression once selected all ten trials of every kind, and the suite ran 4 minutes longer.
    monkeypatch.delenv("KLPIPE_FAULTS", raising=False)
    config = type("Config", (), {"getoption": lambda self, name, default=None: markexpr})()
    assert _trial_count(config) == trials


def trial_seed(kind: str, trial: int) -> int:
    base = os.environ.get("KLPIPE_FAULT_SEED", "0")
    seed = zlib.crc32(f"{kind}:{trial}:{base}".encode())
    print(f"seed={seed} ({kind}, trial {trial}, KLPIPE_FAULT_SEED={base})")
    return seed


# -- the uninterrupted runs everything is compared with ---------------------------------------------


@dataclass
class World:
    runner: Runner
    root: Path
    rollouts: Path
    expected: pa.Table  # an uninterrupted run's output
    census: dict  # calls per phase in that run
    n_chunks: int
    # The most forward passes one batch (from one stop check to the next) made in that run: [before its first
    # commit (the first chunk's batches make the probes' passes too), after it].
    batch_passes: list[int]

    def args(self, out: Path, *extra) -> list:
        return precompute_args(self.rollouts, out, *extra)


def precompute_args(rollouts: Path, out: Path, *extra) -> list:
    return ["precompute", "-m", TINY_LLAMA, rollouts, "-o", out, "--chunk-rows", CHUNK_ROWS,
            "--device", "cpu", "--progress", "none", *extra]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("faults")
    table = pa.concat_tables([pq.read_table(ROLLOUTS)] * COPIES)
    table = table.set_column(0, "id", pa.array([f"r{i}" for i in range(table.num_rows)]))
    rollouts = root / "rollouts.parquet"
    pq.write_table(table, rollouts, row_group_size=50)  # several row groups: reads span them
    runner = Runner(root / "logs")
    try:
        out = root / "uninterrupted" / "cached.parquet"
        result = runner.run(precompute_args(rollouts, out), census=True)
        assert result.returncode == 0, result.stderr
        n_chunks = -(-table.num_rows // CHUNK_ROWS)
        batch_passes, passes, committed = [0, 0], 0, False
        for line in result.trace:
            committed = committed or line.startswith("commit ")
            passes = 0 if line == "go" else passes + (line == "pass")
            batch_passes[committed] = max(batch_passes[committed], passes)
        world = World(runner, root, rollouts, pq.read_table(out), dict(result.calls()), n_chunks, batch_passes)
        assert world.expected.column("id").to_pylist() == table.column("id").to_pylist()
        # Faults are placed among these calls; a phase that is never reached would make trials vacuous.
        assert world.census["commit"] == n_chunks and world.census["forward"] >= n_chunks, world.census
        yield world
    finally:
        runner.close()


def assert_same_output(path: Path, expected: pa.Table, msg: str) -> None:
    got = pq.read_table(path)
    assert got.column("id").to_pylist() == expected.column("id").to_pylist(), f"{msg}: ids differ"
    got_lp = got.column("ref_logprobs").combine_chunks()
    want_lp = expected.column("ref_logprobs").combine_chunks()
    assert np.array_equal(np.asarray(got_lp.offsets), np.asarray(want_lp.offsets)), f"{msg}: token counts differ"
    diff = np.abs(np.asarray(got_lp.flatten()) - np.asarray(want_lp.flatten()))
    assert diff.size == 0 or diff.max() <= 1e-6, f"{msg}: logprobs differ by up to {diff.max()}"
    # Stronger than asked: bit for bit, provenance metadata included.
    assert got.equals(expected, check_metadata=True), f"{msg}: not identical to the uninterrupted run"


def assert_interrupted_cleanly(out: Path, result: Result, expected: pa.Table, msg: str,
                               allowed_beside: frozenset = frozenset()) -> int:
    """Nothing under the final name, only the work dir beside it, and its chunks exactly the committed ones.

    Returns how many chunks the rerun should resume from.
    """
    assert not out.exists(), f"{msg}: {out.name} exists after the fault"
    work = out.with_name(out.name + ".partial")
    beside = {p.name for p in out.parent.iterdir()}
    assert beside <= {work.name} | allowed_beside, f"{msg}: stray files beside the output: {sorted(beside)}"
    chunks = {int(p.name[len("chunk-"):-len(".parquet")]): p for p in work.glob("chunk-*.parquet")}
    assert set(chunks) == result.committed(), (
        f"{msg}: chunk files {sorted(chunks)} are not the committed chunks {sorted(result.committed())}")
    for index, path in chunks.items():
        # A committed chunk is whole and holds exactly its rows of the uninterrupted output.
        assert pq.read_table(path).equals(expected.slice(index * CHUNK_ROWS, CHUNK_ROWS)), (
            f"{msg}: chunk {index} differs from the uninterrupted run's rows")
    return len(chunks)


def rerun_and_compare(world: World, args: list, out: Path, expected: pa.Table, resumed: int, msg: str,
                      env: dict | None = None, total_chunks: int | None = None) -> Result:
    result = world.runner.run(args, env=env)
    assert result.returncode == 0, f"{msg}: the rerun failed: {result.stderr}"
    total = total_chunks or world.n_chunks
    if resumed:  # every chunk, too: a kill during the merge leaves only the merge to do
        assert f"resuming: {resumed} of {total} chunks already done" in result.stderr, f"{msg}: {result.stderr}"
    assert_same_output(out, expected, msg)
    return result


def assert_only(directory: Path, names: set, msg: str) -> None:
    present = {p.name for p in directory.iterdir()}
    assert present == names, f"{msg}: {sorted(present)} instead of {sorted(names)}"


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), f"not one `Error:` line: {stderr!r}"
    return lines[0]


def assert_full_disk(result: Result, msg: str) -> None:
    """The run stopped on a full disk as bad input: exit 2 and one `Error:` line that says so."""
    assert result.returncode == BAD_INPUT, f"{msg}: exit {result.returncode}: {result.stderr}"
    assert "No space left on device" in one_error_line(result.stderr), msg


def wait_until(condition, timeout: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# -- SIGKILL ----------------------------------------------------------------------------------------

SIGKILL_KINDS = ("read", "forward", "write", "commit", "merge")


def pick_kill(kind: str, rng: random.Random, census: dict, out: Path) -> Fault:
    if kind == "read":  # decoding record batches, or tokenizing a chunk (both passes)
        phase = rng.choice(["read", "tokenize"])
        return Fault(phase, rng.randint(1, census[phase]))
    if kind == "forward":  # inside the model, between its first and second layer
        return Fault("forward", rng.randint(1, census["forward"]))
    if kind == "write":  # a chunk file cut short mid-write, never renamed
        return Fault("write", rng.randint(1, census["write"]), fraction=rng.random())
    if kind == "commit":  # right after a chunk is in place, before the next one starts
        return Fault("commit", rng.randint(1, census["commit"]))
    if rng.random() < 0.2:  # merge: the merged file complete in the work dir, not yet renamed
        return Fault("rename", match=out.name, when="before")
    return Fault("merge", rng.randint(1, census["merge"]))  # a partial merged file


@pytest.mark.parametrize("kind", SIGKILL_KINDS)
def test_sigkill(world, tmp_path, kind, trial):
    seed = trial_seed(f"sigkill-{kind}", trial)
    out = tmp_path / "out" / "cached.parquet"
    out.parent.mkdir()
    fault = pick_kill(kind, random.Random(seed), world.census, out)
    msg = f"seed={seed} {fault}"

    result = world.runner.run(world.args(out), fault)
    assert result.returncode == -signal.SIGKILL and result.fired(), f"{msg}: not killed: {result.stderr}"
    resumed = assert_interrupted_cleanly(out, result, world.expected, msg)
    rerun_and_compare(world, world.args(out), out, world.expected, resumed, msg)
    assert_only(out.parent, {out.name}, msg)  # the work dir is gone


def test_sigkill_after_final_rename_leaves_no_work_dir(world, tmp_path):
    out = tmp_path / "cached.parquet"
    result = world.runner.run(world.args(out), Fault("rename", match=out.name, when="after"))
    assert result.returncode == -signal.SIGKILL
    assert_same_output(out, world.expected, "after the rename")  # complete: renamed whole
    rerun = world.runner.run(world.args(out))
    assert rerun.returncode == 0, rerun.stderr
    assert_only(tmp_path, {out.name}, "after the rerun")


# -- SIGTERM / SIGUSR1 (graceful) -------------------------------------------------------------------


def test_sigterm(world, tmp_path, trial):
    """Stop at the next batch boundary, keep every finished chunk, exit 75; a rerun resumes."""
    seed = trial_seed("sigterm", trial)
    rng = random.Random(seed)
    phase = rng.choice(["read", "tokenize", "forward", "write", "commit"])
    name = rng.choice(["SIGTERM", "SIGUSR1"])  # Slurm's preemption and time-limit warnings
    fault = Fault(phase, rng.randint(1, world.census[phase]), action="signal", signal=name)
    msg = f"seed={seed} {fault}"
    out = tmp_path / "out" / "cached.parquet"
    out.parent.mkdir()

    result = world.runner.run(world.args(out), fault)
    assert result.returncode == PREEMPTED, f"{msg}: exit {result.returncode}: {result.stderr}"
    assert (f"Error: stopped by {name}; finished chunks are saved, rerun the same command to resume"
            in result.stderr.splitlines()), f"{msg}: {result.stderr}"
    # Stopped after the current batch: no batch began after the signal (klpipe checks for a stop before each
    # one: no check may let work go on), and only the chunk in flight may still be committed (its last batch
    # was running, or its file was being written). Reading and tokenizing run ahead in a thread of their own:
    # their signal reaches the main thread when it next runs Python, maybe just after a check went on.
    at = result.trace.index(next(t for t in result.trace if t.startswith("fault ")))
    before, after = result.trace[:at], result.trace[at:]
    went_on, passes = after.count("go"), after.count("pass")
    late = [t for t in after if t.startswith("commit ")]
    assert went_on <= (1 if phase in ("read", "tokenize") else 0), f"{msg}: {went_on} batches began after the signal"
    # The rest of the batch in flight, and the one begun just after the signal: a chunk run past its batches'
    # stop checks would make more passes than that.
    most = world.batch_passes[any(t.startswith("commit ") for t in before)]
    assert passes <= (went_on + 1) * most, f"{msg}: {passes} passes after the signal (batches make {most} at most)"
    assert len(late) <= (0 if phase == "commit" else 1), f"{msg}: committed {late} after the signal"
    resumed = assert_interrupted_cleanly(out, result, world.expected, msg)
    rerun_and_compare(world, world.args(out), out, world.expected, resumed, msg)
    assert_only(out.parent, {out.name}, msg)


def test_second_signal_exits_at_once(world, tmp_path, trial):
    """The run is held inside a forward pass; the first signal waits for it, the second does not."""
    seed = trial_seed("second-signal", trial)
    rng = random.Random(seed)
    name = rng.choice(["SIGTERM", "SIGUSR1"])
    fault = Fault("forward", rng.randint(1, world.census["forward"]), action="pause")
    msg = f"seed={seed} {fault} {name}"
    out = tmp_path / "out" / "cached.parquet"
    out.parent.mkdir()

    child = world.runner.start(world.args(out), fault)
    wait_until(child.paused, what="the forward pass to be held")
    os.kill(child.pid, signal.Signals[name])
    wait_until(lambda: f"received {name}: stopping after the current batch" in child.stderr(), what="the first signal")
    assert child.poll() is None, f"{msg}: exited on the first signal"
    sent = time.monotonic()
    os.kill(child.pid, signal.Signals[name])
    result = child.wait(timeout=30)  # held forever otherwise: the test never lets the forward pass go
    assert time.monotonic() - sent < 10, msg
    assert result.returncode == PREEMPTED, f"{msg}: exit {result.returncode}: {result.stderr}"
    assert f"Error: received {name} again; exiting now" in result.stderr.splitlines(), f"{msg}: {result.stderr}"
    resumed = assert_interrupted_cleanly(out, result, world.expected, msg)
    rerun_and_compare(world, world.args(out), out, world.expected, resumed, msg)


# -- a full disk ------------------------------------------------------------------------------------


def test_full_disk_failing_writer(world, tmp_path, trial):
    """ENOSPC from the writer, part of the file already written: one clear line, exit 2, nothing partial."""
    seed = trial_seed("enospc-writer", trial)
    rng = random.Random(seed)
    where = rng.choice(["write", "merge", "run.json"])
    if where == "write":
        fault = Fault("write", rng.randint(1, world.census["write"]), action="enospc", fraction=rng.random())
    elif where == "merge":
        fault = Fault("merge", rng.randint(1, world.census["merge"]), action="enospc")
    else:
        fault = Fault("write_text", match="run.json", action="enospc", fraction=rng.random())
    msg = f"seed={seed} {fault}"
    out = tmp_path / "out" / "cached.parquet"
    out.parent.mkdir()

    result = world.runner.run(world.args(out), fault)
    assert result.fired(), msg
    assert_full_disk(result, msg)
    resumed = assert_interrupted_cleanly(out, result, world.expected, msg)
    rerun_and_compare(world, world.args(out), out, world.expected, resumed, msg)
    assert_only(out.parent, {out.name}, msg)


# -- write behind: chunk k written in the writer's thread while the model runs chunk k+1 -------------


def read_trace(child) -> list[str]:
    return child.trace_path.read_text().splitlines() if child.trace_path.exists() else []


def test_sigkill_while_a_computed_chunk_waits_for_the_writer(world, tmp_path):
    """The writer held inside chunk k's write (its file written, not yet renamed) while the model computes
    chunk k+1, which then waits to be handed over; kill -9 there: neither is committed, the rerun is identical."""
    at = world.n_chunks // 2  # the at-th write is chunk at-1's
    fault = Fault("write", at, action="pause")
    msg = str(fault)
    out = tmp_path / "out" / "cached.parquet"
    out.parent.mkdir()

    child = world.runner.start(world.args(out), fault)
    # `wait` is logged once per chunk, as the model hands it over: the (at+1)-th is chunk at's, computed
    # while chunk at-1's write is held, since a write held on the model's thread would hold the model too.
    wait_until(lambda: read_trace(child).count("wait") > at, what="the next chunk to be computed during the write")
    assert child.paused(), msg
    os.kill(child.pid, signal.SIGKILL)
    result = child.wait(timeout=30)
    assert result.returncode == -signal.SIGKILL, f"{msg}: {result.stderr}"
    assert result.committed() == set(range(at - 1)), msg
    resumed = assert_interrupted_cleanly(out, result, world.expected, msg)
    rerun_and_compare(world, world.args(out), out, world.expected, resumed, msg)
    assert_only(out.parent, {out.name}, msg)


def test_full_disk_in_the_writer_stops_the_model(world, tmp_path):
    """ENOSPC in chunk k's write, in the writer's thread, while the model runs chunk k+1: one `Error:` line, exit 2,
    no chunk after k+1 begun, nothing partial; a rerun resumes to the same bytes."""
    at = world.n_chunks // 2
    fault = Fault("write", at, action="enospc", fraction=0.5)
    msg = str(fault)
    out = tmp_path / "out" / "cached.parquet"
    out.parent.mkdir()

    result = world.runner.run(world.args(out), fault)
    assert result.fired(), msg
    assert_full_disk(result, msg)
    after = result.trace[result.trace.index(next(t for t in result.trace if t.startswith("fault "))):]
    # Chunk at (the one after the failed write) may have been computed; none after it began. Its batch in
    # flight ends, and at most one more begins in the moment the writer records its failure.
    assert result.trace.count("wait") <= at + 1, f"{msg}: the model went on past the failed write"
    assert after.count("pass") <= 2 * world.batch_passes[1], f"{msg}: the model did not stop at a batch boundary"
    assert result.committed() == set(range(at - 1)), msg
    resumed = assert_interrupted_cleanly(out, result, world.expected, msg)
    rerun_and_compare(world, world.args(out), out, world.expected, resumed, msg)
    assert_only(out.parent, {out.name}, msg)


@pytest.fixture(scope="module")
def peak_bytes(world) -> int:
    """Disk a run needs at its peak: every chunk plus the merged file, just before the rename."""
    out = world.root / "peak" / "cached.parquet"
    result = world.runner.run(world.args(out), Fault("rename", match=out.name, when="before"))
    assert result.returncode == -signal.SIGKILL, result.stderr
    work = out.with_name(out.name + ".partial")
    return sum(p.stat().st_blocks * 512 for p in work.iterdir())


@pytest.fixture
def tmpfs(tmp_path):
    """A real, small filesystem that fills up: `mount -t tmpfs` (root only)."""
    mountpoint = tmp_path / "disk"
    mountpoint.mkdir()
    size_kib = 4096
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mountpoint)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); "
                    "test_full_disk_failing_writer covers ENOSPC without one")
    try:
        yield mountpoint, size_kib * 1024
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def test_full_disk_tmpfs(world, peak_bytes, tmpfs, trial):
    """The output on a tmpfs with less free space than the run needs; free it, rerun."""
    seed = trial_seed("enospc-tmpfs", trial)
    rng = random.Random(seed)
    disk, size = tmpfs
    free = int(peak_bytes * rng.uniform(0.02, 0.9)) // 4096 * 4096
    filler = disk / "filler"
    with open(filler, "wb") as fh:  # leaves `free` bytes (tmpfs counts whole pages)
        fh.write(b"\0" * (size - free))
    msg = f"seed={seed} free={free} of the {peak_bytes} a run needs"
    out = disk / "cached.parquet"

    result = world.runner.run(world.args(out))
    assert_full_disk(result, msg)
    resumed = assert_interrupted_cleanly(out, result, world.expected, msg, allowed_beside=frozenset({"filler"}))
    filler.unlink()  # the operator frees space and reruns the same command
    rerun_and_compare(world, world.args(out), out, world.expected, resumed, msg)
    assert_only(disk, {out.name}, msg)


# -- two runs at once -------------------------------------------------------------------------------


def test_two_runs_on_one_output(world, tmp_path, trial):
    """Started together: exactly one refuses (the lock), the other finishes with the right output.

    Both are held at their first forward pass, which only the lock holder reaches, so the runs
    overlap for certain however the machine schedules them; who wins the lock is left to the race.
    """
    seed = trial_seed("concurrent", trial)
    rng = random.Random(seed)
    out = tmp_path / "out" / "cached.parquet"
    out.parent.mkdir()
    hold = Fault("forward", 1, action="pause")
    msg = f"seed={seed}"

    children = [world.runner.start(world.args(out), hold)]
    time.sleep(rng.uniform(0, 0.05))
    children.append(world.runner.start(world.args(out), hold))
    deadline = time.monotonic() + 60
    finished = []
    while not finished:
        assert time.monotonic() < deadline, f"{msg}: neither run refused"
        finished = [(c, r) for c in children if (r := c.poll()) is not None]
        time.sleep(0.01)
    assert len(finished) == 1, f"{msg}: both ended early: {[r.stderr for _, r in finished]}"
    loser, refused = finished[0]
    assert refused.returncode == BAD_INPUT, f"{msg}: {refused.stderr}"
    assert "another klpipe run is writing" in one_error_line(refused.stderr), msg
    winner = children[1 - children.index(loser)]
    wait_until(winner.paused, what="the lock holder's first forward pass")
    winner.go()
    result = winner.wait()
    assert result.returncode == 0, f"{msg}: {result.stderr}"
    assert_same_output(out, world.expected, msg)
    assert_only(out.parent, {out.name}, msg)


# -- sharded runs -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shard(world):
    """Shard 1 of 2, uninterrupted: the expected part and the call census."""
    out = world.root / "shard-uninterrupted"
    result = world.runner.run(world.args(out, "--shard-index", "1", "--num-shards", "2"), census=True)
    assert result.returncode == 0, result.stderr
    part = out / "part-00001-of-00002.parquet"
    return pq.read_table(part), dict(result.calls())


def test_sigkill_sharded(world, shard, tmp_path, trial):
    """A shard killed anywhere up to its marker: the part is never partial, and no marker says done."""
    seed = trial_seed("sigkill-sharded", trial)
    rng = random.Random(seed)
    expected, census = shard
    part_name, marker_name = "part-00001-of-00002.parquet", "part-00001-of-00002.done"
    kind = rng.choice(["forward", "commit", "write", "merge", "rename-before", "rename-after"])
    if kind.startswith("rename"):
        fault = Fault("rename", match=part_name, when=kind.split("-")[1])
    else:
        fault = Fault(kind, rng.randint(1, census[kind]), fraction=rng.random())
    # The shard comes from the flags, or from the Slurm array or torchrun variables.
    source = rng.choice(["flags", "slurm", "torchrun"])
    extra, env = {
        "flags": (["--shard-index", "1", "--num-shards", "2"], None),
        "slurm": ([], {"SLURM_ARRAY_TASK_ID": "11", "SLURM_ARRAY_TASK_MIN": "10", "SLURM_ARRAY_TASK_COUNT": "2"}),
        "torchrun": ([], {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}),
    }[source]
    msg = f"seed={seed} {fault} shard from {source}"
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    part = out_dir / part_name
    args = world.args(out_dir, *extra)

    result = world.runner.run(args, fault, env=env)
    assert result.returncode == -signal.SIGKILL and result.fired(), f"{msg}: not killed: {result.stderr}"
    assert not (out_dir / marker_name).exists(), f"{msg}: a marker for an unfinished part"
    if kind == "rename-after":  # renamed whole, not yet marked done
        assert_same_output(part, expected, msg)
        assert_only(out_dir, {part_name, part_name + ".partial"}, msg)
        resumed = len(list((out_dir / (part_name + ".partial")).glob("chunk-*.parquet")))
    else:
        resumed = assert_interrupted_cleanly(part, result, expected, msg)
    total = -(-expected.num_rows // CHUNK_ROWS)
    rerun_and_compare(world, args, part, expected, resumed, msg, env=env, total_chunks=total)
    assert_only(out_dir, {part_name, marker_name}, msg)
    marker = json.loads((out_dir / marker_name).read_text())
    assert marker["rows"] == expected.num_rows, msg


def test_sigkill_during_marker_write_leaves_no_stray_file(world, tmp_path):
    out_dir = tmp_path / "out"
    args = world.args(out_dir, "--shard-index", "1", "--num-shards", "2")
    result = world.runner.run(args, Fault("write_text", match="*.done", fraction=0.5))
    assert result.returncode == -signal.SIGKILL
    rerun = world.runner.run(args)
    assert rerun.returncode == 0, rerun.stderr
    assert_only(out_dir, {"part-00001-of-00002.parquet", "part-00001-of-00002.done"}, "after the rerun")


# -- klpipe score: the state file --------------------------------------------------------------------


@dataclass
class ScoreWorld:
    cache: Path
    previous_state: bytes  # what a first scoring run leaves
    next_state: bytes  # what a second, uninterrupted run leaves, starting from previous_state
    scored: pa.Table  # that second run's output
    census: dict


def score_args(cache: Path, directory: Path) -> list:
    return ["score", cache, "-o", directory / "scored.parquet", "--report", directory / "report.json",
            "--state", directory / "kl_state.json", "--plot", directory / "report.png"]


@pytest.fixture(scope="module")
def scoring(world) -> ScoreWorld:
    cache = world.root / "uninterrupted" / "cached.parquet"
    first = world.root / "score-first"
    first.mkdir()
    result = world.runner.run(score_args(cache, first))
    assert result.returncode == 0, result.stderr
    previous = (first / "kl_state.json").read_bytes()
    second = world.root / "score-second"
    second.mkdir()
    (second / "kl_state.json").write_bytes(previous)
    result = world.runner.run(score_args(cache, second), census=True)
    assert result.returncode == 0, result.stderr
    next_state = (second / "kl_state.json").read_bytes()
    assert next_state != previous  # else "previous or new" could not tell a torn write from either
    return ScoreWorld(cache, previous, next_state, pq.read_table(second / "scored.parquet"), dict(result.calls()))


def test_killed_score_never_half_writes_state(world, scoring, tmp_path, trial):
    """The state file is the previous one or the complete new one, whatever point score dies at."""
    seed = trial_seed("sigkill-score", trial)
    rng = random.Random(seed)
    point = rng.choice(["score_batch", "merge", "plot", "rename", "write_text", "write_text"])
    if point == "rename":  # just before or after a finished file is renamed into place
        target = rng.choice(["scored.parquet", "report.json", "report.png", "kl_state.json"])
        fault = Fault("rename", match=target, when=rng.choice(["before", "after"]))
    elif point == "write_text":  # mid-write of the state's (or the report's) tmp file
        fault = Fault("write_text", match=rng.choice(["kl_state.json", "kl_state.json", "report.json"]),
                      fraction=rng.random())
    else:
        fault = Fault(point, rng.randint(1, scoring.census[point]))
    msg = f"seed={seed} {fault}"
    (tmp_path / "kl_state.json").write_bytes(scoring.previous_state)

    result = world.runner.run(score_args(scoring.cache, tmp_path), fault)
    assert result.returncode == -signal.SIGKILL and result.fired(), f"{msg}: not killed: {result.stderr}"
    state = (tmp_path / "kl_state.json").read_bytes()
    assert state in (scoring.previous_state, scoring.next_state), f"{msg}: state file is neither: {state[:200]!r}"
    json.loads(state)
    # The other outputs are never partial either: absent, or complete.
    if (tmp_path / "scored.parquet").exists():
        assert pq.read_table(tmp_path / "scored.parquet").equals(scoring.scored, check_metadata=True), msg
    if (tmp_path / "report.json").exists():
        assert json.loads((tmp_path / "report.json").read_text())["summary"]["rows"] == world.expected.num_rows
    if state == scoring.next_state:  # the state is written last: everything else is in place
        assert (tmp_path / "scored.parquet").exists() and (tmp_path / "report.json").exists(), msg
    # A temporary file the kill left beside the outputs is found and removed by the next run.
    rerun = world.runner.run(score_args(scoring.cache, tmp_path))
    assert rerun.returncode == 0, f"{msg}: the rerun failed: {rerun.stderr}"
    assert_only(tmp_path, {"scored.parquet", "report.json", "report.png", "kl_state.json"}, msg)
    if state == scoring.previous_state:  # killed before the state moved on: the rerun is the same run
        assert pq.read_table(tmp_path / "scored.parquet").equals(scoring.scored, check_metadata=True), msg
        assert (tmp_path / "kl_state.json").read_bytes() == scoring.next_state, msg


def test_full_disk_tmpfs_score(world, scoring, tmpfs, trial):
    """klpipe score's outputs on a tmpfs that fills mid-run: one line, nothing that looks complete, the
    state untouched; once space is freed the rerun equals an uninterrupted run."""
    seed = trial_seed("enospc-tmpfs-score", trial)
    rng = random.Random(seed)
    disk, size = tmpfs
    probe = disk / "probe"
    probe.mkdir()
    (probe / "kl_state.json").write_bytes(scoring.previous_state)
    done = world.runner.run(score_args(scoring.cache, probe))
    assert done.returncode == 0, done.stderr
    needed = sum(p.stat().st_blocks * 512 for p in probe.iterdir())
    for p in probe.iterdir():
        p.unlink()
    probe.rmdir()
    free = int(needed * rng.uniform(0.02, 0.9)) // 4096 * 4096
    out = disk / "out"
    out.mkdir()
    (out / "kl_state.json").write_bytes(scoring.previous_state)
    used = sum(p.stat().st_blocks * 512 for p in out.iterdir())
    filler = disk / "filler"
    with open(filler, "wb") as fh:  # leaves `free` bytes (tmpfs counts whole pages)
        fh.write(b"\0" * (size - used - free))
    msg = f"seed={seed} free={free} of the {needed} the outputs need"

    result = world.runner.run(score_args(scoring.cache, out))
    assert result.returncode == BAD_INPUT, f"{msg}: exit {result.returncode}: {result.stderr}"
    line = one_error_line(result.stderr)
    assert "No space left on device" in line and f"Error: {out}/" in line, f"{msg}: {line}"
    assert_only(out, {"kl_state.json"}, msg)  # nothing partial, no temporary file left behind
    assert (out / "kl_state.json").read_bytes() == scoring.previous_state, msg
    filler.unlink()  # the operator frees space and reruns the same command
    rerun = world.runner.run(score_args(scoring.cache, out))
    assert rerun.returncode == 0, f"{msg}: {rerun.stderr}"
    assert pq.read_table(out / "scored.parquet").equals(scoring.scored, check_metadata=True), msg
    assert (out / "kl_state.json").read_bytes() == scoring.next_state, msg
