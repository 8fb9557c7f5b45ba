"""`klpipe precompute --ray` on a Ray cluster of three hosts (cluster.py, network.py): shards on two worker nodes,
a worker node lost mid-run, a driver that cannot see the workers' disks, the output on S3 and on a shared
directory. Each result is held against one process on the same rows with one torch thread, bit for bit.

The driver runs as a user runs it, `python -m klpipe`, on the head's host in a mount namespace of its own. Which
node ran each shard comes from the driver's own record: its line `shard I of N done on ADDRESS (node)`.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import time
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import ROLLOUTS, ROOT, TINY_GEMMA, run_cli
from tests.ray.faults import job_config
from tests.ray_hosts.cluster import WORKERS
from tests.test_examples import controller_state

# 48 rows in chunks of 4: twelve chunks, two per shard of six, so a shard stopped after its first chunk has one
# to resume from.
CHUNK_ROWS = "4"
SHARDS = 6
COMMON = ["--model", str(TINY_GEMMA), str(ROLLOUTS), "--chunk-rows", CHUNK_ROWS, "--progress", "log",
          "--log-interval", "5"]
DONE = re.compile(r"^shard (\d+) of (\d+) done on (\S+) \(", re.MULTILINE)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The same rows through one process with one torch thread, as each one-CPU task runs them (Ray sets
    OMP_NUM_THREADS to a task's CPUs; tests/ray explains why the thread count matters)."""
    out = tmp_path_factory.mktemp("single") / "cached.parquet"
    result = run_cli("precompute", *COMMON, "--output", str(out), env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    return out


def precompute_argv(cluster, output: str, *extra: str) -> list[str]:
    return cluster.driver("precompute", *COMMON, "--output", output, "--ray", cluster.address,
                          "--num-shards", str(SHARDS), *extra)


def drive(cluster, argv: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, env=cluster.driver_env(), timeout=timeout, cwd=ROOT)


def placement(stderr: str) -> dict[int, str]:
    """Shard -> the address of the node whose run of it completed, from the driver's lines."""
    return {int(index): address for index, _, address in DONE.findall(stderr)}


def assert_same_cache(parts: list[pa.Table], single) -> None:
    sharded = pa.concat_tables(parts)
    whole = pq.read_table(single)
    assert sharded.num_rows == whole.num_rows == 48
    assert sharded.column("ref_logprobs").equals(whole.column("ref_logprobs"))
    assert sharded.drop_columns(["ref_logprobs"]).equals(whole.drop_columns(["ref_logprobs"]))


def part_names(suffix: str) -> list[str]:
    return [f"part-{i:05d}-of-{SHARDS:05d}.{suffix}" for i in range(SHARDS)]


def s3_parts(server, bucket: str, prefix: str) -> list[pa.Table]:
    keys = server.keys_under(bucket, prefix)
    assert keys == sorted([f"{prefix}{n}" for n in part_names("parquet") + part_names("done")]), keys
    return [pq.read_table(io.BytesIO(server.read(bucket, f"{prefix}{n}"))) for n in part_names("parquet")]


def listing(pid: int, path) -> list[str]:
    """Every file under `path` as process `pid` sees it (in its mount namespace), relative to `path`."""
    found = subprocess.run(["nsenter", "-t", str(pid), "-m", "find", str(path), "-type", "f"], capture_output=True,
                           text=True, check=True).stdout.split()
    return sorted(os.path.relpath(f, path) for f in found)


def host_of(cluster, pid: int) -> str:
    """The worker host a process runs on, by its network namespace."""
    netns = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout.strip()
    (name,) = [name for name in WORKERS if cluster.host(name).netns == netns]
    return name


def test_six_shards_on_s3_across_both_workers_bit_for_bit_then_scored_from_the_driver(hosts, single, tmp_path):
    cluster, server = hosts
    bucket = server.bucket("six")
    output = f"s3://{bucket}/cached/"
    started = time.perf_counter()
    result = drive(cluster, precompute_argv(cluster, output))
    seconds = time.perf_counter() - started
    assert result.returncode == 0, result.stderr + cluster.logs()
    assert f"ray: {SHARDS} of {SHARDS} shards to run on 3 node(s), each with 0 GPU and 1 CPU" in result.stderr
    ran = placement(result.stderr)
    workers = {cluster.host(name).address for name in WORKERS}
    assert sorted(ran) == list(range(SHARDS)), result.stderr
    assert set(ran.values()) == workers, ran  # both worker nodes ran shards; the head (no CPU) none
    # The driver's progress line, from what the tasks on the other hosts report to its board.
    running = set(re.findall(r"running: .*?shard \d+ on (\S+) \(", result.stderr))
    assert running and running <= workers, result.stderr
    print(f"6 shards on S3 in {seconds:.1f} s: " + ", ".join(
        f"{address} ran {sorted(i for i, a in ran.items() if a == address)}" for address in sorted(workers)))
    assert_same_cache(s3_parts(server, bucket, "cached/"), single)
    # The workers kept their checkpoints on their own disks, gone now; nothing reached the machine's disk there.
    for name in WORKERS:
        assert list(cluster.host(name).disk.iterdir()) == []

    # klpipe score from the driver, on the S3 result, against the same on the single process's cache.
    scored = cluster.driver("score", output, "--output", f"s3://{bucket}/scored.parquet",
                            "--state", f"s3://{bucket}/state.json")
    done = drive(cluster, scored, timeout=300)
    assert done.returncode == 0, done.stderr
    local = run_cli("score", str(single), "--output", str(tmp_path / "scored.parquet"),
                    "--state", str(tmp_path / "state.json"))
    assert local.returncode == 0, local.stderr
    assert pq.read_table(io.BytesIO(server.read(bucket, "scored.parquet"))).equals(
        pq.read_table(tmp_path / "scored.parquet"))
    (tmp_path / "ray.state.json").write_bytes(server.read(bucket, "state.json"))
    assert controller_state(tmp_path / "ray.state.json") == controller_state(tmp_path / "state.json")


@contextmanager
def paused_run(cluster, argv: list[str], faults, shard: int):
    """A driver running `argv` whose `shard` pauses once its first chunk is checkpointed (tests/ray/faults.py), on its
    first attempt only; yields the driver and the pid of the worker process running that shard. A driver still
    running at the end is killed."""
    env = cluster.driver_env(RAY_JOB_CONFIG_JSON_ENV_VAR=job_config({"shard": shard, "action": "pause",
                                                                     "dir": str(faults)}))
    driver = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 600
        while not (faults / "pid").exists():
            assert driver.poll() is None, driver.communicate()[1] + cluster.logs()
            assert time.monotonic() < deadline, f"shard {shard} never checkpointed its first chunk"
            time.sleep(0.5)
        yield driver, int((faults / "pid").read_text())
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


@pytest.fixture
def lost(hosts):
    """A worker node the test loses (set `lost.name`), started again afterwards as a fresh machine."""
    cluster, _ = hosts

    class Lost:
        name: str | None = None

    yield Lost
    if Lost.name is not None:
        cluster.revive(Lost.name)


def test_a_worker_node_lost_with_the_output_on_s3_the_driver_never_seeing_the_workers_disks(
        hosts, single, tmp_path, lost):
    """The output on S3: each shard's checkpoints on its node's own disk, which the driver cannot see. The node
    that runs shard 3 is lost after the shard's first chunk; Ray runs it on the other node, which starts it again
    (its checkpoint went with the lost disk), and the output is the same."""
    cluster, server = hosts
    bucket = server.bucket("lost")
    faults = tmp_path / "faults"
    faults.mkdir()
    with paused_run(cluster, precompute_argv(cluster, f"s3://{bucket}/cached/"), faults, 3) as (driver, worker):
        lost.name = host_of(cluster, worker)
        disk = cluster.host(lost.name).disk
        # Shard 3's first chunk, checkpointed under KLPIPE_CACHE_DIR/work on its node's disk: there for the
        # worker, not there for the driver (nor for this test), whose view of that path is an empty directory.
        on_node = listing(worker, disk)
        assert any("part-00003-of-00006" in f and f.endswith(".parquet") for f in on_node), on_node
        assert listing(driver.pid, disk) == [] and listing(os.getpid(), disk) == []
        cluster.lose(lost.name)
        _, stderr = driver.communicate(timeout=900)
    assert driver.returncode == 0, stderr + cluster.logs()
    ran = placement(stderr)
    assert sorted(ran) == list(range(SHARDS)), stderr
    survivor = cluster.host(next(n for n in WORKERS if n != lost.name)).address
    assert ran[3] == survivor, ran
    assert "shard 3: resuming" not in stderr, stderr  # its checkpoint was on the lost disk
    assert re.search(r"Ray ran again after a worker died: .*shard 3 1x", stderr), stderr
    assert_same_cache(s3_parts(server, bucket, "cached/"), single)


def test_a_worker_node_lost_with_the_output_on_a_shared_directory_resumes_from_its_checkpoint(
        hosts, single, tmp_path, lost):
    """The output in a directory every host sees: shard 1's work directory sits beside it, so the node that runs
    it again resumes from the chunk the lost node finished. Then a part is lost and the command rerun."""
    cluster, _ = hosts
    shared = tmp_path / "shared" / "cached"
    faults = tmp_path / "faults"
    faults.mkdir()
    with paused_run(cluster, precompute_argv(cluster, str(shared)), faults, 1) as (driver, worker):
        lost.name = host_of(cluster, worker)
        killed = cluster.lose(lost.name)
        assert worker in killed
        _, stderr = driver.communicate(timeout=900)
    assert driver.returncode == 0, stderr + cluster.logs()
    ran = placement(stderr)
    survivor = cluster.host(next(n for n in WORKERS if n != lost.name)).address
    assert sorted(ran) == list(range(SHARDS)) and ran[1] == survivor, ran
    assert "shard 1: resuming: 1 of 2 chunks already done" in stderr, stderr
    assert re.search(r"Ray ran again after a worker died: .*shard 1 1x", stderr), stderr
    assert sorted(p.name for p in shared.iterdir()) == sorted(part_names("parquet") + part_names("done"))
    assert_same_cache([pq.read_table(shared / n) for n in part_names("parquet")], single)

    # A part lost afterwards (shard 4's, which the worker's death did not touch) and the command rerun: that
    # shard alone runs again, the others stay as they are, and the parts still score as the single run.
    lost_part = shared / part_names("parquet")[4]
    lost_part.unlink()
    kept = {n: (shared / n).read_bytes() for n in part_names("parquet") if n != lost_part.name}
    rerun = drive(cluster, precompute_argv(cluster, str(shared)))
    assert rerun.returncode == 0, rerun.stderr + cluster.logs()
    assert re.search(rf"ray: 1 of {SHARDS} shards to run on \d node\(s\), each with 0 GPU and 1 CPU; 5 already "
                     "complete", rerun.stderr), rerun.stderr
    assert sorted(placement(rerun.stderr)) == [4], rerun.stderr
    assert {n: (shared / n).read_bytes() for n in kept} == kept
    assert_same_cache([pq.read_table(shared / n) for n in part_names("parquet")], single)
    scored = {}
    for name, cache in (("ray", shared), ("single", single)):
        scored[name] = tmp_path / f"{name}.scored.parquet"
        done = run_cli("score", str(cache), "--output", str(scored[name]), "--state", str(tmp_path / f"{name}.json"))
        assert done.returncode == 0, done.stderr
    assert pq.read_table(scored["ray"]).equals(pq.read_table(scored["single"]))
    assert controller_state(tmp_path / "ray.json") == controller_state(tmp_path / "single.json")


def test_an_output_on_the_drivers_own_disk_is_refused_in_one_line_before_any_shard(hosts, tmp_path):
    cluster, _ = hosts
    output = cluster.driver_host.disk / "cached"  # a tmpfs only the driver's mount namespace has
    result = drive(cluster, precompute_argv(cluster, str(output)), timeout=300)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"Error: --output {re.escape(str(output))} is on this machine's disk, which 3 of the cluster's 3 nodes do "
        r"not see \(.+\): write to storage every node sees \(s3://\.\.\., or a shared filesystem\)", last), last
    assert "Traceback" not in result.stderr and "ray: " not in result.stderr and "shard" not in result.stderr
