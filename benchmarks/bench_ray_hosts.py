"""Wall time of `klpipe precompute` as one process against `--ray` with 2, 4 and 6 shards on a Ray cluster of three
hosts (tests/ray_hosts: network namespaces, a head and two one-CPU worker nodes), and of a 6-shard run that loses a
worker node mid-run. Needs root (it makes the namespaces) and the `ray` extra:

    .venv/bin/python benchmarks/bench_ray_hosts.py            # the 48 sample rows, --chunk-rows 4

Every run writes to a directory every host sees. The one process runs on a worker's host with one torch thread, as
each one-CPU shard does. For each Ray run: the driver's wall time, which node ran which shard, and each shard's own
time in its task (model load + scoring, from the driver's `done` lines); the rest of the wall time is the cost of
running it on the cluster (the driver joining it, the probe of the output, scheduling, the worker processes
importing torch). Speed is measured here, never asserted in tests.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers import ROLLOUTS, TINY_GEMMA
from tests.ray.faults import job_config
from tests.ray_hosts.cluster import WORKERS, HostsCluster

COMMON = ["--model", str(TINY_GEMMA), str(ROLLOUTS), "--chunk-rows", "4", "--progress", "none"]
DONE = re.compile(r"^shard (\d+) of \d+ done on (\S+) \(.*in ([\d.]+) s \+ ([\d.]+) s", re.MULTILINE)


def report(name: str, seconds: float, stderr: str) -> None:
    per_node: dict[str, list] = defaultdict(list)
    for index, address, load, score in DONE.findall(stderr):
        per_node[address].append((int(index), float(load) + float(score)))
    busiest = max((sum(t for _, t in shards) for shards in per_node.values()), default=0.0)
    most = max((len(shards) for shards in per_node.values()), default=1)
    nodes = "; ".join(f"{address} ran {sorted(i for i, _ in shards)} ({sum(t for _, t in shards):.1f} s in tasks)"
                      for address, shards in sorted(per_node.items()))
    print(f"{name}: {seconds:.1f} s wall; {nodes}; beyond the busiest node's task time {seconds - busiest:.1f} s, "
          f"{(seconds - busiest) / most:.1f} s per shard on it", flush=True)


def main() -> None:
    cluster = HostsCluster()
    try:
        started = time.perf_counter()
        cluster.start()
        print(f"cluster of 3 hosts up in {time.perf_counter() - started:.1f} s", flush=True)
        shared = Path(tempfile.mkdtemp(prefix="klpipe-bench-"))
        env = cluster.driver_env(OMP_NUM_THREADS="1")
        worker = cluster.host(WORKERS[0])
        started = time.perf_counter()
        subprocess.run(worker.command(sys.executable, "-m", "klpipe", "precompute", *COMMON, "--output",
                                      str(shared / "single.parquet")), env=env, check=True, cwd=ROOT)
        print(f"one process on {worker.address}: {time.perf_counter() - started:.1f} s wall", flush=True)
        for shards in (2, 4, 6):
            started = time.perf_counter()
            result = subprocess.run(cluster.driver("precompute", *COMMON, "--output", str(shared / f"s{shards}"),
                                                   "--ray", cluster.address, "--num-shards", str(shards)),
                                    env=cluster.driver_env(), capture_output=True, text=True, check=True, cwd=ROOT)
            report(f"{shards} shards", time.perf_counter() - started, result.stderr)
        # The driver's fixed cost: start, join the cluster, probe the output, find every shard complete.
        started = time.perf_counter()
        subprocess.run(cluster.driver("precompute", *COMMON, "--output", str(shared / "s6"), "--ray", cluster.address,
                                      "--num-shards", "6"), env=cluster.driver_env(), capture_output=True, check=True,
                       cwd=ROOT)
        print(f"a rerun with all 6 shards complete (the driver alone): {time.perf_counter() - started:.1f} s wall",
              flush=True)
        # A worker node lost once shard 3's first chunk is checkpointed; Ray runs it on the other node.
        faults = shared / "faults"
        faults.mkdir()
        started = time.perf_counter()
        driver = subprocess.Popen(
            cluster.driver("precompute", *COMMON, "--output", str(shared / "lost"), "--ray", cluster.address,
                           "--num-shards", "6"), stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env=cluster.driver_env(RAY_JOB_CONFIG_JSON_ENV_VAR=job_config(
                {"shard": 3, "action": "pause", "dir": str(faults)})))
        while not (faults / "pid").exists():
            assert driver.poll() is None, driver.communicate()[1]
            time.sleep(0.2)
        pid = (faults / "pid").read_text()
        paused = time.perf_counter() - started
        netns = subprocess.run(["ip", "netns", "identify", pid], capture_output=True, text=True).stdout.strip()
        (lost,) = [name for name in WORKERS if cluster.host(name).netns == netns]
        cluster.lose(lost)
        _, stderr = driver.communicate()
        assert driver.returncode == 0, stderr
        print(f"lost node {cluster.host(lost).address} at {paused:.1f} s, once shard 3's first chunk was checkpointed",
              flush=True)
        report("6 shards, a node lost", time.perf_counter() - started, stderr)
        print("\n".join(line for line in stderr.splitlines() if "resuming" in line or "Ray ran again" in line))
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
