"""Run one `klpipe` command in a child process with a fault injected at a chosen point.

klpipe has no test hooks and gets none: the child wraps the real seams a crash can hit (the
rollout reader, the tokenizer, the model's forward pass, the chunk writer, the merge writer, the
atomic rename, `Path.write_text`) and, at the k-th call of one of them, kills itself with SIGKILL,
signals itself with SIGTERM or SIGUSR1, raises ENOSPC, or pauses until the test says go. Then it calls
`klpipe.cli.main()` with the command's arguments, exactly as the `klpipe` entry point does.

Children are forked from a small fork server (`serve`) that has imported torch, transformers and
klpipe once. A fresh `python -m klpipe precompute` spends ~6 s of its ~7 s importing on this
machine, and the full suite runs ~250 commands; a fork costs milliseconds. The server never
runs a torch op itself, so no OpenMP thread pool exists to be broken by the fork: each child is a
pristine process as far as torch is concerned.

Every child appends to a trace file, with O_APPEND writes that survive a SIGKILL:
  `commit <chunk index>` after each checkpoint chunk is in place;
  `call <phase>`        each time a wrapped seam is reached (census runs count them);
  `go`                  each time klpipe checked for a stop between batches and went on;
  `pass`                each time a forward pass of the model ran its first layer;
  `wait`                each time precompute, a chunk computed, waits to hand it to its writer thread;
  `fault <phase> <n>`   just before the fault fires, so a test knows it really fired.

Reproduce a trial by hand:
  python -m tests.fault_runner --phase forward --at 7 --action kill -- precompute -m MODEL IN -o OUT
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fnmatch
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

# Imported here so the fork server preloads them: these are what a run would import lazily.
import matplotlib
import pyarrow.parquet as pq
import transformers
import transformers.models.llama.configuration_llama
import transformers.models.llama.modeling_llama  # noqa: F401 - preloaded, not named
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401 - preloaded, not named

import klpipe.cli
import klpipe.model.reference
import klpipe.precompute.rollouts
import klpipe.precompute.run
import klpipe.precompute.signals
import klpipe.precompute.tokenize
import klpipe.precompute.workdir
import klpipe.score.report
import klpipe.score.run
import klpipe.threads
from tests.helpers import ROOT

matplotlib.use("Agg")  # as `klpipe score --plot` does, before pyplot
import matplotlib.pyplot

PHASES = {
    # precompute
    "read": "klpipe.precompute.rollouts._iter_file_rows: before the n-th record batch is handed on",
    "tokenize": "ChunkTokenizer.__call__: before the n-th chunk is tokenized",
    "forward": "inside the model's n-th forward pass, between its first and second decoder layer",
    "write": "pyarrow.parquet.write_table (a chunk): the tmp file is cut to `fraction` of its size first",
    "commit": ("klpipe.precompute.workdir.WorkDir.write_chunk: after the n-th chunk is renamed into place, "
               "before the next"),
    "merge": "ParquetWriter.write_table: after the n-th row group of the merged output",
    "rename": "os.replace onto a file matching `match`: `when` before or after it",
    # score
    "score_batch": "klpipe.score.run._score_batch: before the n-th record batch is scored",
    "plot": "klpipe.score.report.plot: before the plot is drawn",
    "write_text": "Path.write_text of a tmp file for a name matching `match`: `fraction` of the text, then the fault",
}
ACTIONS = ("kill", "signal", "enospc", "pause", "none")
MODULE = "tests.fault_runner"  # the name the fork server imports; also when run with -m


@dataclass(frozen=True)
class Fault:
    phase: str
    at: int = 1  # fire at the at-th call of the phase (1-based), counted over the whole process
    action: str = "kill"  # kill | signal | enospc | pause (until <trace>.go exists) | none
    signal: str = "SIGTERM"  # signal: which one the process sends itself
    fraction: float = 0.5  # write / write_text: the share of the file written before the fault
    match: str = "*"  # rename / write_text: fnmatch pattern on the final file name
    when: str = "before"  # rename: fire before or after os.replace

    def __post_init__(self):
        if self.phase not in PHASES:
            raise ValueError(f"unknown phase {self.phase!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}")


@dataclass
class Result:
    returncode: int  # negative: killed by that signal
    stderr: str
    trace: list[str]

    def fired(self) -> bool:
        return any(line.startswith("fault ") for line in self.trace)

    def committed(self) -> set[int]:
        return {int(line.split()[1]) for line in self.trace if line.startswith("commit ")}

    def calls(self) -> Counter:
        return Counter(line.split()[1] for line in self.trace if line.startswith("call "))


# -- in the child -----------------------------------------------------------------------------------


class _Injector:
    def __init__(self, fault: Fault | None, trace_path: Path, census: bool):
        self.fault = fault
        self.trace_fd = os.open(trace_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.go_path = Path(str(trace_path) + ".go")
        self.paused_path = Path(str(trace_path) + ".paused")
        self.census = census
        self.counts: Counter = Counter()
        self.lock = threading.Lock()
        # Held by the thread writing a chunk until its `commit` line is logged. A kill from another thread (the
        # reader's) takes it first, so it never lands between a chunk's rename and its line: the trace's
        # commits stay exactly the chunk files. (A kill inside the write itself is the writer's own: reentrant.)
        self.commit_lock = threading.RLock()

    def log(self, line: str) -> None:
        os.write(self.trace_fd, (line + "\n").encode())  # one write(2): whole lines even on SIGKILL

    def reached(self, phase: str) -> bool:
        """Count a call of `phase`; True when the fault fires at this call."""
        with self.lock:
            self.counts[phase] += 1
            n = self.counts[phase]
        if self.census:
            self.log(f"call {phase}")
        fault = self.fault
        if fault is None or fault.phase != phase or fault.action == "none":
            return False
        return n == fault.at

    def fire(self) -> None:
        fault = self.fault
        self.log(f"fault {fault.phase} {fault.at} {fault.action}")
        if fault.action == "kill":
            with self.commit_lock:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # never reached: SIGKILL cannot be caught
        elif fault.action == "signal":
            os.kill(os.getpid(), signal.Signals[fault.signal])  # handled in the main thread, as for `kill PID`
        elif fault.action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        elif fault.action == "pause":
            self.paused_path.touch()
            while not self.go_path.exists():  # signals still arrive: their handlers run between sleeps
                time.sleep(0.01)


def _install(inj: _Injector) -> None:
    _install_precompute(inj)
    _install_model(inj)
    _install_files(inj)
    _install_score(inj)
    _install_write_text(inj)


def _install_precompute(inj: _Injector) -> None:
    rollouts = klpipe.precompute.rollouts
    tokenize = klpipe.precompute.tokenize
    workdir = klpipe.precompute.workdir

    # Always traced: which chunks were committed before a fault.
    original_write_chunk = workdir.WorkDir.write_chunk

    def write_chunk(self, tokenized, *args, **kwargs):
        with inj.commit_lock:
            original_write_chunk(self, tokenized, *args, **kwargs)
            inj.log(f"commit {tokenized.chunk.index}")
        if inj.reached("commit"):
            inj.fire()

    workdir.WorkDir.write_chunk = write_chunk

    original_check = klpipe.precompute.signals.StopOnSignal.check

    def check(self):
        original_check(self)  # raises once a stop was asked for
        inj.log("go")

    klpipe.precompute.signals.StopOnSignal.check = check

    original_handle = klpipe.precompute.signals.StopOnSignal._handle

    def handle(self, signum, frame):
        # A second signal exits at once (os._exit) from the main thread while the writer's thread may be
        # between a chunk's rename and its `commit` line; like a kill, it takes the commit lock first.
        if self.received is None:
            original_handle(self, signum, frame)
            return
        with inj.commit_lock:
            original_handle(self, signum, frame)

    klpipe.precompute.signals.StopOnSignal._handle = handle

    original_wait_for_room = klpipe.threads.Background.wait_for_room

    def wait_for_room(self):
        inj.log("wait")  # before it blocks: a test can act while the computed chunk is held back
        original_wait_for_room(self)

    klpipe.threads.Background.wait_for_room = wait_for_room

    original_iter_file_rows = rollouts._iter_file_rows

    def iter_file_rows(*args, **kwargs):
        for item in original_iter_file_rows(*args, **kwargs):
            if inj.reached("read"):
                inj.fire()
            yield item

    rollouts._iter_file_rows = iter_file_rows

    original_tokenize = tokenize.ChunkTokenizer.__call__

    def tokenize_chunk(self, chunk):
        if inj.reached("tokenize"):
            inj.fire()
        return original_tokenize(self, chunk)

    tokenize.ChunkTokenizer.__call__ = tokenize_chunk


def _install_model(inj: _Injector) -> None:
    original_load = klpipe.model.reference.ReferenceModel.load.__func__

    def load(cls, spec, *options, **fields):
        model = original_load(cls, spec, *options, **fields)  # its probe forward passes (check_head) are not counted
        layers = [m for name, m in model.model.named_modules() if name.endswith("layers.0")]

        def hook(module, args, output):
            inj.log("pass")
            if inj.reached("forward"):
                inj.fire()

        layers[0].register_forward_hook(hook)
        return model

    klpipe.model.reference.ReferenceModel.load = classmethod(load)


def _install_files(inj: _Injector) -> None:
    fault = inj.fault
    original_write_table = pq.write_table
    inside_write_table = threading.local()  # pq.write_table runs a ParquetWriter: not a merge

    def write_table(table, where, *args, **kwargs):
        inside_write_table.active = True
        try:
            original_write_table(table, where, *args, **kwargs)
        finally:
            inside_write_table.active = False
        if inj.reached("write"):
            if fault.action in ("kill", "enospc"):  # the crash or the full disk came mid-write
                size = os.path.getsize(where)
                os.truncate(where, int(size * fault.fraction))
            inj.fire()

    pq.write_table = write_table

    original_writer_write = pq.ParquetWriter.write_table

    def writer_write_table(self, table, *args, **kwargs):
        original_writer_write(self, table, *args, **kwargs)
        if not getattr(inside_write_table, "active", False) and inj.reached("merge"):
            inj.fire()

    pq.ParquetWriter.write_table = writer_write_table

    original_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        hit = fnmatch.fnmatch(os.path.basename(os.fspath(dst)), fault.match) and inj.reached("rename")
        if hit and fault.when == "before":
            inj.fire()
        original_replace(src, dst, *args, **kwargs)
        if hit and fault.when == "after":
            inj.fire()

    os.replace = replace


def _install_score(inj: _Injector) -> None:
    original_score_batch = klpipe.score.run._score_batch

    def score_batch(*args, **kwargs):
        if inj.reached("score_batch"):
            inj.fire()
        return original_score_batch(*args, **kwargs)

    klpipe.score.run._score_batch = score_batch

    original_plot = klpipe.score.report.plot

    def plot(*args, **kwargs):
        if inj.reached("plot"):
            inj.fire()
        return original_plot(*args, **kwargs)

    klpipe.score.report.plot = plot


def _install_write_text(inj: _Injector) -> None:
    fault = inj.fault
    original_write_text = Path.write_text

    def write_text(self, data, *args, **kwargs):
        # atomic_output's tmp files are named .<final name>.<random>.tmp
        final = self.name[1:].rsplit(".", 2)[0] if self.name.startswith(".") and self.name.endswith(".tmp") else None
        if final is not None and fnmatch.fnmatch(final, fault.match) and inj.reached("write_text"):
            original_write_text(self, data[: int(len(data) * fault.fraction)], *args, **kwargs)
            inj.fire()
        return original_write_text(self, data, *args, **kwargs)

    Path.write_text = write_text


def _child(args: list[str], fault: Fault | None, stderr_path: str, trace_path: str, cwd: str,
           env: dict | None, census: bool) -> None:
    os.chdir(cwd)
    if env:
        os.environ.update(env)
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _install(_Injector(fault or Fault("read", action="none"), Path(trace_path), census))
    sys.argv = ["klpipe", *args]
    code = 0
    try:
        klpipe.cli.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # skip the fork server's own teardown: the exit code is the CLI's


# -- the fork server --------------------------------------------------------------------------------


def serve() -> None:
    """Fork a child per `start` request read from stdin; answer `wait` requests with exit codes.

    One JSON object a line each way. The server never runs klpipe itself, so every child starts
    from the same freshly imported state.
    """
    requests, replies = sys.stdin, sys.stdout
    for line in requests:
        request = json.loads(line)
        if request["op"] == "start":
            pid = os.fork()
            if pid == 0:
                try:
                    null = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(null, 0)
                    fault = Fault(**request["fault"]) if request["fault"] else None
                    _child(request["args"], fault, request["stderr"], request["trace"], request["cwd"],
                           request["env"], request["census"])
                finally:
                    os._exit(70)  # only reached if _child itself failed
            reply = {"pid": pid}
        elif request["op"] == "wait":
            deadline = time.monotonic() + request["timeout"]
            status = None
            while True:
                done, raw = os.waitpid(request["pid"], os.WNOHANG)
                if done:
                    status = os.waitstatus_to_exitcode(raw)
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.005)
            reply = {"status": status}
        else:
            reply = {"error": f"unknown op {request['op']!r}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


# -- in the test process ----------------------------------------------------------------------------


class Child:
    def __init__(self, runner: Runner, pid: int, stderr_path: Path, trace_path: Path):
        self.runner = runner
        self.pid = pid
        self.stderr_path = stderr_path
        self.trace_path = trace_path

    def paused(self) -> bool:
        return Path(str(self.trace_path) + ".paused").exists()

    def go(self) -> None:
        Path(str(self.trace_path) + ".go").touch()

    def wait_paused(self, timeout: float = 60) -> Child:
        """Once the child has reached its `pause` fault (the test then acts while it waits there)."""
        deadline = time.monotonic() + timeout
        while not self.paused():
            if self.poll() is not None:
                raise RuntimeError(f"klpipe child {self.pid} exited before its pause: {self.stderr()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"klpipe child {self.pid} did not reach its pause in {timeout}s")
            time.sleep(0.01)
        return self

    def poll(self) -> Result | None:
        """The result if the child has exited, else None."""
        status = self.runner._wait(self.pid, 0)
        return None if status is None else self._result(status)

    def wait(self, timeout: float = 120) -> Result:
        status = self.runner._wait(self.pid, timeout)
        if status is None:
            self.runner._kill(self.pid)
            raise TimeoutError(f"klpipe child {self.pid} still running after {timeout}s; killed it")
        return self._result(status)

    def stderr(self) -> str:
        return self.stderr_path.read_text() if self.stderr_path.exists() else ""

    def _result(self, status: int) -> Result:
        trace = self.trace_path.read_text().splitlines() if self.trace_path.exists() else []
        return Result(status, self.stderr(), trace)


class Runner:
    """Starts `klpipe ARGS` children from a fork server that has everything heavy imported."""

    def __init__(self, log_dir: Path, root: Path | None = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.count = 0
        self.live: set[int] = set()  # started and not yet reaped: killed on close (a failed test may leave one paused)
        root = root or ROOT
        # One torch thread: on a 2-core box shared with other jobs, two spinning OpenMP threads per
        # child make a 0.5 s run take 10 s. (Outputs are compared run against run, never across settings.)
        # Nothing from the caller's environment may shard or configure a run: tests inside a Slurm
        # job or under torchrun would otherwise all become shards. Each test passes what it means.
        inherited = {k: v for k, v in os.environ.items()
                     if not k.startswith(("SLURM_", "KLPIPE_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env = {**inherited, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
        self.server = subprocess.Popen(
            [sys.executable, "-c", f"import {MODULE} as m; m.serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root, env=env,
        )

    def _wait(self, pid: int, timeout: float) -> int | None:
        status = self._request({"op": "wait", "pid": pid, "timeout": timeout})["status"]
        if status is not None:
            self.live.discard(pid)
        return status

    def _kill(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self._wait(pid, 60)

    def _request(self, request: dict) -> dict:
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        line = self.server.stdout.readline()
        if not line:
            raise RuntimeError(f"fault-runner fork server died (exit {self.server.poll()})")
        return json.loads(line)

    def start(self, args: list, fault: Fault | None = None, cwd: Path | None = None,
              env: dict | None = None, census: bool = False) -> Child:
        self.count += 1
        # The test's own cache directory (tests/conftest.py), not the one the server started under: a test's first run
        # meets the load-time checks, never a verdict another test left.
        env = {"KLPIPE_CACHE_DIR": os.environ["KLPIPE_CACHE_DIR"], **(env or {})}
        stderr_path = self.log_dir / f"run-{self.count:04d}.stderr"
        trace_path = self.log_dir / f"run-{self.count:04d}.trace"
        pid = self._request({
            "op": "start", "args": [str(a) for a in args], "fault": asdict(fault) if fault else None,
            "stderr": str(stderr_path), "trace": str(trace_path), "cwd": str(cwd or Path.cwd()),
            "env": env, "census": census,
        })["pid"]
        self.live.add(pid)
        return Child(self, pid, stderr_path, trace_path)

    def run(self, args: list, fault: Fault | None = None, timeout: float = 120, **kwargs) -> Result:
        return self.start(args, fault, **kwargs).wait(timeout)

    def close(self) -> None:
        for pid in list(self.live):
            self._kill(pid)
        self.server.stdin.close()  # EOF: the server's loop ends
        try:
            self.server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phase", choices=sorted(PHASES), required=True)
    parser.add_argument("--at", type=int, default=1)
    parser.add_argument("--action", choices=ACTIONS, default="kill")
    parser.add_argument("--signal", default="SIGTERM")
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--match", default="*")
    parser.add_argument("--when", choices=("before", "after"), default="before")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- precompute|score ARGS")
    ns = parser.parse_args()
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    fault = Fault(ns.phase, ns.at, ns.action, ns.signal, ns.fraction, ns.match, ns.when)
    runner = Runner(Path(os.environ.get("TMPDIR", "/tmp")) / f"klpipe-fault-{os.getpid()}")
    try:
        result = runner.run(command, fault)
    finally:
        runner.close()
    sys.stderr.write(result.stderr)
    print(f"exit {result.returncode}; fault {'fired' if result.fired() else 'did not fire'}")


if __name__ == "__main__":
    main()
