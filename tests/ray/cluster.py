"""A Ray cluster for the tests: one node (`ray start --head --block`) on 127.0.0.1, three CPUs for three shards.

Every port Ray opens is picked free beforehand (other servers run on this machine), and Ray's own switch for
a loopback cluster (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which macOS and Windows get by default) keeps every
address 127.0.0.1: Ray otherwise swaps 127.0.0.1 for the machine's outward address, and binds there. Logs,
sockets and session files live in a temporary directory of its own.

One node, not a head and a worker node: Ray refuses a second node on a loopback-only cluster ("Multi-node
Ray clusters are not supported on Windows and OSX"), and any other would listen on the machine's outward address.

Each node runs in its own session (start_new_session), and everything Ray spawns for it (GCS, raylet, agents,
worker processes, which lead process groups of their own) stays in that session. `stop()` asks each
`ray start --block` to shut its node down (SIGTERM), then kills whatever is left in the sessions it started,
by pid: never `ray stop`, which stops every Ray on the machine by name.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.helpers import ROOT, free_ports

RAY = str(Path(sys.executable).with_name("ray"))
OBJECT_STORE_BYTES = 200 * 2**20  # per node: klpipe passes only configs and summaries through it
# Per node: each Ray worker process listens on one, for its life. Idle workers of a finished job, the three
# prestarted ones and each job's board actor hold theirs for a while, so a handful runs out within a few jobs:
# a worker without a port dies unregistered, and the raylet waits the whole register timeout (600 s below)
# before it starts another.
WORKER_PORTS = 64

# For the cluster's processes and for every driver the tests run against it.
ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # loopback only (above)
    "RAY_USAGE_STATS_ENABLED": "0",
    # The machine is shared and busy: a worker importing torch may take minutes to register, and another
    # engineer's tests may fill memory, which must not make Ray's memory monitor kill our workers.
    "RAY_worker_register_timeout_seconds": "600",
    "RAY_memory_monitor_refresh_ms": "0",
    "PYTHONPATH": str(ROOT),  # workers import tests.ray.faults (the fault hook) and this checkout's klpipe
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class RayClusterError(RuntimeError):
    """The test cluster did not start or stop cleanly; the message carries its output."""


class Cluster:
    def __init__(self, cpus: int = 3) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="klpipe-ray-"))  # short: Ray's socket paths must fit 107 bytes
        self.cpus = cpus
        self.nodes: list[tuple[str, subprocess.Popen]] = []
        self.gcs_port = 0
        # Ray's token authentication, with a token of this cluster's own: nothing else on the machine can run
        # code on it, and nothing is read from or written to ~/.ray.
        self.token = secrets.token_hex(32)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def env(self, base: dict | None = None) -> dict:
        return {**(os.environ if base is None else base), **ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    def start(self, timeout: float = 300) -> None:
        self.gcs_port, client, dashboard = free_ports(3)
        self._start_node("head", "--head", f"--port={self.gcs_port}", f"--ray-client-server-port={client}",
                         "--include-dashboard=false", f"--dashboard-port={dashboard}", f"--num-cpus={self.cpus}",
                         f"--temp-dir={self.root}", "--disable-usage-stats")
        self._wait_nodes(1, timeout)

    def _start_node(self, name: str, *args: str) -> None:
        manager, objects, metrics, agent, agent_grpc, runtime_env, *workers = free_ports(6 + WORKER_PORTS)
        command = [RAY, "start", "--block", "--node-ip-address=127.0.0.1", "--num-gpus=0",
                   f"--object-store-memory={OBJECT_STORE_BYTES}", f"--node-manager-port={manager}",
                   f"--object-manager-port={objects}", f"--metrics-export-port={metrics}",
                   f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
                   f"--runtime-env-agent-port={runtime_env}", f"--worker-port-list={','.join(map(str, workers))}",
                   *args]
        with open(self.root / f"{name}.out", "wb") as out:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=self.env(), cwd=self.root, start_new_session=True)
        self.nodes.append((name, proc))

    def alive_nodes(self) -> int:
        # Ray prints cluster events (a node marked dead) to every driver's stdout as it joins: the count goes on a
        # line of its own, marked, and the driver asks for no worker logs.
        probe = ("import ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
                 "print('alive nodes:', sum(n['Alive'] for n in ray.nodes()))")
        result = subprocess.run([sys.executable, "-c", probe % self.address], capture_output=True, text=True,
                                env=self.env(), timeout=120)
        counts = [line.split(':', 1)[1] for line in result.stdout.splitlines() if line.startswith('alive nodes:')]
        return int(counts[-1]) if result.returncode == 0 and counts else 0

    def _wait_nodes(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self.nodes:
                if proc.poll() is not None:
                    raise RayClusterError(f"ray start ({name}) exited {proc.returncode}\n{self.logs()}")
            if self.alive_nodes() >= count:
                return
            if time.monotonic() > deadline:
                raise RayClusterError(f"timed out after {timeout:.0f} s waiting for {count} node(s)\n{self.logs()}")
            time.sleep(1)

    def logs(self, lines: int = 30) -> str:
        parts = []
        for path in sorted(self.root.glob("*.out")):
            parts.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(parts)

    def processes(self) -> list[int]:
        """Every live process in the sessions of the nodes started here (Ray's daemons and workers)."""
        sessions = {proc.pid for _, proc in self.nodes}
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                # Field 6 of /proc/PID/stat is the session id; the name in field 2 may hold spaces.
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) in sessions and fields[0] != "Z":
                found.append(int(entry.name))
        return found

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to each `ray start --block`, which stops its node; then SIGKILL to whatever
        of their sessions is left. Safe after a failed or partial start."""
        for _, proc in reversed(self.nodes):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        left = self.processes()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for _, proc in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.nodes.clear()
        shutil.rmtree(self.root, ignore_errors=True)
