"""A one-node Slurm cluster for the tests: munged, slurmctld and slurmd, all inside one directory.

Everything lives in a fresh temporary directory (config, state, spool, pid files, logs, the munge
key and socket) and every daemon listens on 127.0.0.1 only, on ports picked free at start-up, so
the cluster touches nothing of the machine's own Slurm or munge set-up. Client commands (sbatch,
squeue, scontrol, sacct) find it through SLURM_CONF, which `env()` sets; jobs inherit it.

The daemons run in the foreground (-D, --foreground): the pids held here are the daemons' own, and
`stop()` ends exactly those. Each runs in its own session, so a Ctrl-C at the terminal reaches
pytest, whose fixture teardown stops them in order, and not the daemons half-way through a job.
Needs root and Debian's slurm-wlm and munge packages (`make test-slurm` installs them).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.helpers import free_ports

NODE = "localhost"
PARTITION = "test"
# A requeued job waits this long before it may start again: the job step credentials of its last
# run must expire first (AuthInfo cred_expire; Slurm's default is 120 s).
CRED_EXPIRE_SECONDS = 5


class SlurmError(RuntimeError):
    """The test cluster did not start or stop cleanly; the message carries its logs."""


def tool(name: str) -> str:
    """A Slurm or munge command's path. The daemons live in /usr/sbin, which not every PATH has."""
    found = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if found is None:
        raise SlurmError(f"{name} not found: `make test-slurm` installs Slurm (Debian's slurm-wlm and munge)")
    return found


def node_hardware() -> str:
    """This machine's CPUs, sockets, cores, threads and memory as slurmd sees them (`slurmd -C`),
    so the node's configuration matches its hardware and slurmd does not drain it."""
    out = subprocess.run([tool("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    fields = re.findall(r"\b(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore|RealMemory)=(\d+)", out)
    if len(fields) != 6:
        raise SlurmError(f"unexpected `slurmd -C` output: {out!r}")
    return " ".join(f"{k}={v}" for k, v in fields)


class Cluster:
    def __init__(self) -> None:
        # munged insists that every directory above its socket is searchable by all (pytest's
        # own temporary directories are not), so this one is made beside them, mode 0755.
        self.root = Path(tempfile.mkdtemp(prefix="klpipe-slurm-"))
        self.root.chmod(0o755)
        self.conf = self.root / "slurm.conf"
        self.daemons: list[tuple[str, subprocess.Popen]] = []  # in start order

    def env(self, base: dict | None = None) -> dict:
        """`base` (default: this process's environment) without any SLURM_* of its own, pointed at this cluster."""
        base = os.environ if base is None else base
        return {**{k: v for k, v in base.items() if not k.startswith("SLURM_")}, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        result = subprocess.run(args, capture_output=True, text=True, env=self.env(), timeout=60)
        if check and result.returncode != 0:
            raise SlurmError(f"{' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
        return result

    # -- start -----------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> None:
        munged, slurmctld, slurmd = tool("munged"), tool("slurmctld"), tool("slurmd")
        tool("sbatch")
        if os.geteuid() != 0:
            raise SlurmError("the test cluster runs its daemons and jobs as root; run `make test-slurm` as root")
        munge = self.root / "munge"
        munge.mkdir(mode=0o755)
        key = munge / "munge.key"
        with os.fdopen(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(os.urandom(128))  # what `mungekey` makes: 1024 random bits, readable by root alone
        munge_socket = munge / "munge.socket"
        for name in ("state", "spool"):
            (self.root / name).mkdir(mode=0o700)
        self.conf.write_text(self._config(munge_socket, *free_ports(2)))

        self._spawn("munged", munged, "--foreground", f"--socket={munge_socket}", f"--key-file={key}",
                    f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'munged.seed'}")
        self._wait(lambda: munge_socket.exists(), timeout, "munged to create its socket")
        self._spawn("slurmctld", slurmctld, "-D", "-f", str(self.conf))
        self._spawn("slurmd", slurmd, "-D", "-f", str(self.conf), "-N", NODE)
        self._wait(self._node_idle, timeout, f"node {NODE} to be idle in sinfo")

    def _config(self, munge_socket: Path, ctld_port: int, slurmd_port: int) -> str:
        root = self.root
        return f"""\
ClusterName=klpipe-test
SlurmctldHost={NODE}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
# Every daemon, srun included, binds to the address its host name resolves to (127.0.0.1), not to all.
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire={CRED_EXPIRE_SECONDS}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root / 'slurmd.pid'}
SlurmctldLogFile={root / 'slurmctld.log'}
SlurmdLogFile={root / 'slurmd.log'}
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
# Look at pending jobs every second, not every minute: a requeued task starts as soon as it may.
SchedulerParameters=sched_interval=1
KillWait=5
# No slurmdbd: sacct reads the job completion log instead (`sacct --completion`).
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={root / 'jobcomp.txt'}
NodeName={NODE} NodeAddr=127.0.0.1 {node_hardware()} State=UNKNOWN
PartitionName={PARTITION} Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn(self, name: str, *command: str) -> None:
        with open(self.root / f"{name}.out", "wb") as out:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=self.env(), cwd=self.root, start_new_session=True)
        self.daemons.append((name, proc))

    def _node_idle(self) -> bool:
        result = self.run("sinfo", "--noheader", "--nodes", NODE, "--format=%T", check=False)
        return result.returncode == 0 and result.stdout.strip() == "idle"

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self.daemons:
                if proc.poll() is not None:
                    raise SlurmError(f"{name} exited {proc.returncode} while waiting for {what}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise SlurmError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs()}")
            time.sleep(0.2)

    def logs(self, lines: int = 20) -> str:
        """The end of each daemon's log, for error messages."""
        parts = []
        for path in sorted(self.root.glob("*.out")) + sorted(self.root.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- stop ------------------------------------------------------------------------------

    def cancel_all(self, timeout: float = 60) -> None:
        """Cancel every job still queued or running, and wait until they have all ended."""
        jobs = self.run("squeue", "--noheader", "--format=%A").stdout.split()
        if jobs:
            self.run("scancel", *jobs, check=False)
            self._wait(lambda: not self.run("squeue", "--noheader").stdout.strip(), timeout,
                       "the cancelled jobs to end")

    def stop(self, timeout: float = 60) -> None:
        """Cancel what is still queued or running, then end the daemons this object started, by pid,
        newest first; then remove the directory. Safe to call after a failed or partial start."""
        problems = []
        if self.daemons and all(proc.poll() is None for _, proc in self.daemons):
            # Jobs first, while slurmd can still end them: their processes (klpipe, srun, the
            # batch shell) are children of slurmstepd, not of anything held here.
            with contextlib.suppress(SlurmError, subprocess.TimeoutExpired):
                self.cancel_all(timeout)
        for name, proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    problems.append(f"{name} (pid {proc.pid}) ignored SIGTERM for {timeout:.0f} s; killed")
                    proc.kill()
                    proc.wait()
        self.daemons.clear()
        shutil.rmtree(self.root, ignore_errors=True)
        if problems:
            raise SlurmError("; ".join(problems))
