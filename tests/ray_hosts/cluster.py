"""A Ray cluster of three hosts (network.py): a head that runs no shard, and two worker nodes of one CPU each.

Each node is `ray start --block` on its own host, with that host's address as `--node-ip-address`, so Ray sees
three machines. A host has a network stack of its own, so every node uses the same fixed ports (below): the
GCS, raylet, object manager and worker ports each host's peers dial across the bridge. Ray's token
authentication is on, with a token of this cluster's own.

What each node's processes get, as a machine's would: the S3 credentials and endpoint (the bridge's S3 server),
and KLPIPE_CACHE_DIR and TMPDIR on the host's private disk, where klpipe keeps the chunk checkpoints of an
output on a store. Ray's logs and session files go to a directory per node on the machine's disk, for the
test to read when something fails.

The driver, `python -m klpipe precompute --ray HEAD:6379`, runs on the head's host (as a RayJob's entrypoint
runs on the head pod) in a mount namespace of its own, with a private disk of its own: the workers' disks are
not mounted where it runs.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import time

from tests.helpers import with_checkout
from tests.ray.cluster import RAY, Cluster
from tests.ray_hosts.network import Host, Network

GCS_PORT = 6379
PORTS = {  # the same on every host: each has its own network namespace
    "node-manager-port": 6380, "object-manager-port": 6381, "metrics-export-port": 6382,
    "dashboard-agent-listen-port": 6383, "dashboard-agent-grpc-port": 6384, "runtime-env-agent-port": 6385,
}
HEAD_PORTS = {"port": GCS_PORT, "ray-client-server-port": 10001, "dashboard-port": 8265}
WORKER_PORTS = ",".join(str(p) for p in range(10002, 10066))  # see tests/ray/cluster.py on how many
OBJECT_STORE_BYTES = 100 * 2**20
WORKERS = ("w1", "w2")


class HostsCluster(Cluster):
    """tests/ray/cluster.py's Cluster, with each node on a host of its own."""

    def __init__(self, server_env: dict | None = None) -> None:
        super().__init__()
        self.network = Network(self.root)
        self.server_env = server_env or {}  # the S3 variables every node and the driver get
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def address(self) -> str:
        return f"{self.network.hosts['head'].address}:{GCS_PORT}"

    def host(self, name: str) -> Host:
        return self.network.hosts[name]

    def env(self, base: dict | None = None) -> dict:
        env = super().env(base)
        env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # tests/ray's loopback switch: these nodes are not
        return env

    def node_env(self, host: Host) -> dict:
        """A node's environment, as a machine's own: none of the test process's variables, only these."""
        return with_checkout(self.env({**self.server_env, "KLPIPE_CACHE_DIR": str(host.disk),
                                       "TMPDIR": str(host.disk), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}))

    def make_hosts(self) -> None:
        """The bridge and the three hosts, before any node (the S3 server listens on the bridge first)."""
        self.network.up()
        for name in ("head", *WORKERS):
            self.network.add(name)

    def start(self, timeout: float = 600) -> None:
        if not self.network.hosts:
            self.make_hosts()
        self.start_node("head")
        self._wait_nodes(1, timeout)
        for name in WORKERS:
            self.start_node(name)
        self._wait_nodes(1 + len(WORKERS), timeout)

    def start_node(self, name: str) -> None:
        """`ray start` on host `name`: the head (no CPUs: the driver's node, no shard runs there) or a worker."""
        host = self.host(name)
        ports = {**PORTS, **(HEAD_PORTS if name == "head" else {})}
        role = (["--head", "--include-dashboard=false", "--num-cpus=0"] if name == "head"
                else [f"--address={self.address}", "--num-cpus=1"])
        (self.root / name / "ray").mkdir(parents=True, exist_ok=True)
        command = [RAY, "start", "--block", f"--node-ip-address={host.address}", "--num-gpus=0",
                   f"--object-store-memory={OBJECT_STORE_BYTES}", *(f"--{k}={v}" for k, v in ports.items()),
                   f"--worker-port-list={WORKER_PORTS}", f"--temp-dir={self.root / name / 'ray'}",
                   "--disable-usage-stats", *role]
        with open(self.root / f"{name}.out", "ab") as out:
            proc = subprocess.Popen(host.command(*command), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=self.node_env(host), cwd=self.root)
        self.procs[name] = proc

    def revive(self, name: str, timeout: float = 600) -> None:
        """A lost worker node back, as a new machine in its place (an empty disk), once the cluster has marked the
        lost one dead (a shard's retry may come sooner: its owner sees the worker's connection drop)."""
        deadline = time.monotonic() + timeout
        while self.alive_nodes() > len(WORKERS):
            assert time.monotonic() < deadline, f"the cluster never marked the node on {name} dead\n{self.logs()}"
            time.sleep(2)
        self.start_node(name)
        self._wait_nodes(1 + len(WORKERS), timeout)

    def lose(self, name: str) -> list[int]:
        """Host `name` lost: SIGKILL to every process on it, Ray's and the shards' alike."""
        killed = self.host(name).kill()
        self.procs[name].wait(timeout=30)
        return killed

    @property
    def driver_host(self) -> Host:
        """Where the driver runs: the head's network namespace, a mount namespace and a private disk of its own."""
        head = self.host("head")
        disk = self.root / "driver" / "disk"
        disk.mkdir(parents=True, exist_ok=True)
        return Host("driver", head.netns, head.address, disk)

    def driver(self, *argv: str) -> list[str]:
        """The command that runs `klpipe ARGV` as the driver."""
        return self.driver_host.command(sys.executable, "-m", "klpipe", *argv)

    def driver_env(self, **extra: str) -> dict:
        disk = str(self.driver_host.disk)
        return with_checkout(self.env({**self.server_env, "KLPIPE_CACHE_DIR": disk, "TMPDIR": disk,
                                       "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra}))

    def alive_nodes(self) -> int:
        # Ray prints cluster events (a node marked dead) to every driver's stdout as it joins: the count goes on a
        # line of its own, marked, and the driver asks for no worker logs.
        probe = ("import ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
                 "print('alive nodes:', sum(n['Alive'] for n in ray.nodes()))")
        head = self.host("head")
        result = subprocess.run(head.command(sys.executable, "-c", probe % self.address), capture_output=True,
                                text=True, env=self.node_env(head), timeout=120)
        counts = [line.split(':', 1)[1] for line in result.stdout.splitlines() if line.startswith('alive nodes:')]
        return int(counts[-1]) if result.returncode == 0 and counts else 0

    def _wait_nodes(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None and proc.returncode != -signal.SIGKILL:
                    raise RuntimeError(f"ray start ({name}) exited {proc.returncode}\n{self.logs()}")
            if self.alive_nodes() >= count:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {count} node(s)\n{self.logs()}")
            time.sleep(2)

    def processes(self) -> list[int]:
        return self.network.processes()

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to each `ray start --block` (workers first), then SIGKILL to whatever is left on the hosts,
        found by namespace; then the namespaces and the bridge. Safe after a failed or partial start."""
        for name in reversed(list(self.procs)):
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        self.network.remove()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)
