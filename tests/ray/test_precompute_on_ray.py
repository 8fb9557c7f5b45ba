"""`klpipe precompute --ray ADDRESS` on a real Ray cluster (cluster.py), run as a user runs it: a fresh
`python -m klpipe` driver. Each result is held against one process on the same rows, bit for bit.

Faults go into the cluster's workers through Ray's own job config (faults.py): a worker killed with SIGKILL
mid-shard, which Ray runs again and which resumes from the shard's checkpoint; and a shard that fails every
time, which the driver names, and which a rerun without the fault completes alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import ROLLOUTS, ROOT, TINY_GEMMA, run_cli, with_checkout
from tests.ray.faults import job_config
from tests.test_examples import controller_state

# 48 rows in chunks of 8: six chunks, two per shard of three.
CHUNK_ROWS = "8"
SHARDS = 3
COMMON = ["--model", str(TINY_GEMMA), str(ROLLOUTS), "--chunk-rows", CHUNK_ROWS, "--progress", "log",
          "--log-interval", "5"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The same rows through one process with one torch thread, as each shard's task runs (Ray sets
    OMP_NUM_THREADS to a task's CPUs): what every Ray run must reproduce. Another thread count may sum a
    matmul in another order, a last-bit change (1.9e-6 in one of the 48 rows with two threads)."""
    out = tmp_path_factory.mktemp("single") / "cached.parquet"
    result = run_cli("precompute", *COMMON, "--output", str(out), env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    return out


def ray_precompute(cluster, out, *extra, fault=None, timeout=900):
    env = cluster.env()
    if fault is not None:
        env["RAY_JOB_CONFIG_JSON_ENV_VAR"] = job_config(fault)
    return run_cli("precompute", *COMMON, "--output", str(out), "--ray", cluster.address,
                   "--num-shards", str(SHARDS), *extra, env=env, timeout=timeout)


def parts(out) -> list:
    return sorted(out.glob("part-*-of-*.parquet"))


def assert_same_cache(out, single):
    """The parts, in shard order, are the single run's cache: every column, ref_logprobs bit for bit."""
    assert [p.name for p in parts(out)] == [f"part-{i:05d}-of-{SHARDS:05d}.parquet" for i in range(SHARDS)]
    assert sorted(p.name for p in out.glob("*.done")) == [f"part-{i:05d}-of-{SHARDS:05d}.done" for i in range(SHARDS)]
    sharded = pa.concat_tables([pq.read_table(p) for p in parts(out)])
    whole = pq.read_table(single)
    assert sharded.num_rows == whole.num_rows == 48
    assert sharded.column("ref_logprobs").equals(whole.column("ref_logprobs"))
    assert sharded.drop_columns(["ref_logprobs"]).equals(whole.drop_columns(["ref_logprobs"]))


def test_three_shards_are_one_process_bit_for_bit_and_score_the_same(cluster, single, tmp_path):
    out = tmp_path / "cached"
    result = ray_precompute(cluster, out)
    assert result.returncode == 0, result.stderr
    assert_same_cache(out, single)
    assert "ray: 3 of 3 shards to run on 1 node(s), each with 0 GPU and 1 CPU" in result.stderr
    # One progress line for the whole run: shards done and where the running ones are.
    assert "shards done" in result.stderr and "running: shard" in result.stderr, result.stderr
    summary = result.stderr.strip().splitlines()[-1]
    assert summary.startswith(f"wrote {out}: 48 rows, "), summary
    assert "response tokens in" in summary and "padding efficiency" in summary and "peak memory rss" in summary

    again = ray_precompute(cluster, out)
    assert again.returncode == 0, again.stderr
    assert f"all 3 shards of {out} are already complete" in again.stderr

    assert_same_scores(out, single, tmp_path)


def assert_same_scores(out, single, tmp_path):
    """`klpipe score` of the parts writes the single run's scored rows and controller state."""
    scored = {}
    for name, cache in (("ray", out), ("single", single)):
        scored[name] = tmp_path / f"{name}.scored.parquet"
        state = tmp_path / f"{name}.state.json"
        done = run_cli("score", str(cache), "--output", str(scored[name]), "--state", str(state))
        assert done.returncode == 0, done.stderr
    assert pq.read_table(scored["ray"]).equals(pq.read_table(scored["single"]))
    assert controller_state(tmp_path / "ray.state.json") == controller_state(tmp_path / "single.state.json")


@contextmanager
def paused_driver(cluster, out, shard: int, faults):
    """A `precompute --ray` driver whose `shard` pauses once its first chunk is checkpointed; yields it and the pid
    of the worker running that shard. A driver still running at the end is killed."""
    env = with_checkout({**cluster.env(), "RAY_JOB_CONFIG_JSON_ENV_VAR": job_config(
        {"shard": shard, "action": "pause", "dir": str(faults)})})
    command = [sys.executable, "-m", "klpipe", "precompute", *COMMON, "--output", str(out), "--ray", cluster.address,
               "--num-shards", str(SHARDS)]
    driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 600
        while not (faults / "pid").exists():
            assert driver.poll() is None, driver.communicate()[1]
            assert time.monotonic() < deadline, f"shard {shard} never checkpointed its first chunk"
            time.sleep(0.5)
        yield driver, int((faults / "pid").read_text())
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def test_a_worker_killed_mid_shard_is_run_again_by_ray_and_resumes_and_a_lost_part_is_rerun(cluster, single,
                                                                                            tmp_path):
    """A worker SIGKILLed mid-shard, then a part lost and the command rerun: the parts are still the single run's,
    bit for bit, and score the same."""
    out, faults = tmp_path / "cached", tmp_path / "faults"
    faults.mkdir()
    with paused_driver(cluster, out, 1, faults) as (driver, worker):
        os.kill(worker, signal.SIGKILL)  # the worker running shard 1, its first chunk on disk
        _, stderr = driver.communicate(timeout=600)
    assert driver.returncode == 0, stderr
    assert "shard 1: resuming: 1 of 2 chunks already done" in stderr, stderr
    assert "Ray ran again after a worker died: shard 1 1x" in stderr, stderr
    assert_same_cache(out, single)

    (out / "part-00000-of-00003.parquet").unlink()  # lost; its marker stays, describing a part that is not there
    kept = {p.name: p.read_bytes() for p in parts(out)}
    rerun = ray_precompute(cluster, out)
    assert rerun.returncode == 0, rerun.stderr
    assert "ray: 1 of 3 shards to run on 1 node(s), each with 0 GPU and 1 CPU; 2 already complete" in rerun.stderr
    assert "shard 0 of 3 done" in rerun.stderr and "shard 1 of 3 done" not in rerun.stderr, rerun.stderr
    assert {p.name: p.read_bytes() for p in parts(out) if p.name in kept} == kept
    assert_same_cache(out, single)
    assert_same_scores(out, single, tmp_path)


def test_relative_paths_are_the_drivers_in_every_task(cluster, single, tmp_path):
    """`-m sample_data/... sample_data/rollouts.parquet -o cached` from the driver's directory: a Ray worker runs
    elsewhere (the node's own directory), where those paths name other files or none; each task runs in the
    driver's directory, so the parts are the single run's."""
    (tmp_path / "sample_data").mkdir()
    for source in (TINY_GEMMA, ROLLOUTS):
        (tmp_path / "sample_data" / source.name).symlink_to(source)
    relative = ["--model", f"sample_data/{TINY_GEMMA.name}", f"sample_data/{ROLLOUTS.name}", *COMMON[3:]]
    result = run_cli("precompute", *relative, "--output", "cached", "--ray", cluster.address,
                     "--num-shards", str(SHARDS), env=cluster.env(), cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr
    assert_same_cache(tmp_path / "cached", single)


def test_a_shard_that_always_fails_is_named_and_a_rerun_completes_it_alone(cluster, single, tmp_path):
    out = tmp_path / "cached"
    failed = ray_precompute(cluster, out, "--ray-max-retries", "1",
                            fault={"shard": 2, "action": "raise", "dir": str(tmp_path)})
    assert failed.returncode == 1, failed.stderr
    last = failed.stderr.strip().splitlines()[-1]
    assert last == ("Error: 1 of 3 shards failed (shard 2: unexpected RuntimeError: injected fault in shard 2); the "
                    "other 2 are complete: rerun the same command to run only the failed ones"), failed.stderr
    assert [p.name for p in parts(out)] == ["part-00000-of-00003.parquet", "part-00001-of-00003.parquet"]
    kept = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in parts(out)}

    rerun = ray_precompute(cluster, out)
    assert rerun.returncode == 0, rerun.stderr
    assert "ray: 1 of 3 shards to run on 1 node(s), each with 0 GPU and 1 CPU; 2 already complete" in rerun.stderr
    assert "shard 2 of 3 done" in rerun.stderr and "shard 0 of 3 done" not in rerun.stderr
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in parts(out) if p.name in kept} == kept
    assert_same_cache(out, single)


def test_sigterm_to_the_driver_cancels_the_shards_and_a_rerun_finishes_the_same(cluster, single, tmp_path):
    out, faults = tmp_path / "cached", tmp_path / "faults"
    faults.mkdir()
    with paused_driver(cluster, out, 0, faults) as (driver, _):
        driver.send_signal(signal.SIGTERM)  # shard 0 is mid-shard, paused after its first chunk
        _, stderr = driver.communicate(timeout=300)
    assert driver.returncode == 75, stderr
    assert stderr.strip().splitlines()[-1].startswith("Error: stopped by SIGTERM: cancelled "), stderr
    assert not (out / "part-00000-of-00003.parquet").exists()  # the cancelled shard wrote no part
    for part in parts(out):  # whatever finished before the signal is complete
        assert (out / part.name.replace(".parquet", ".done")).exists(), part

    rerun = ray_precompute(cluster, out)  # no fault: the rerun finishes every shard left, shard 0 resumed
    assert rerun.returncode == 0, rerun.stderr
    assert "shard 0: resuming: 1 of 2 chunks already done" in rerun.stderr, rerun.stderr
    assert_same_cache(out, single)
