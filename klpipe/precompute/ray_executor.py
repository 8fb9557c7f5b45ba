"""`klpipe precompute --ray ADDRESS`: one Ray task per shard, driven from the calling process.

This module decides *where* shards run, not what a shard does (datatrove's executor/ray.py has the
same split): each task calls `precompute()` with its `Shard`, the library call a Slurm array task's
`klpipe precompute` makes, so a part written here is the part that task would write, bit for bit.
Not Ray Data's `map_batches`: the prefix tree needs a chunk's rows together, and resume needs
klpipe's own completion markers (sharding.py), which decide which shards a rerun still runs.

What Ray retries and what klpipe resumes: a task whose worker process dies (node lost, OOM kill,
preemption, kill -9) is run again by Ray, up to `max_retries` times, and that run resumes from the
shard's work directory wherever it survives (beside a local output, on the shared filesystem; for
an output on a store, on the node that has it). An error klpipe raises is never retried: it would
fail again; the driver names the shard and its error. A rerun of the command runs only the shards
without a completion marker.

Split by job: this module is the driver's loop (what runs, what is complete, progress, failures, stopping);
ray_task.py the task's body and the board it reports to; ray_cluster.py the cluster (joining it, its nodes and
slots, whether its nodes see a local output). Ray is imported only in these, and only once `--ray` is given:
`pip install "klpipe[ray]"`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from klpipe import cache, sharding
from klpipe.columns import ColumnMap
from klpipe.errors import InputError, KlpipeError, OutputError, Preempted, first_line
from klpipe.precompute import ray_cluster
from klpipe.precompute.config import PrecomputeConfig, RayConfig
from klpipe.precompute.logprobs import ForwardStats
from klpipe.precompute.ray_task import Board, shard_task
from klpipe.precompute.run import PrecomputeSummary
from klpipe.progress import Progress
from klpipe.sharding import Shard
from klpipe.storage.store import Location, is_remote

CANCEL_GRACE_SECONDS = 15.0  # after a stop: how long running shards get to unwind before their workers are killed
POLL_SECONDS = 1.0


@dataclass
class RaySummary:
    summary: PrecomputeSummary  # the shards' summaries summed; `seconds` is the driver's wall time
    shards: int = 0
    ran: list[int] = field(default_factory=list)  # shards this run computed
    complete: list[int] = field(default_factory=list)  # shards whose completion marker was already in place
    nodes: int = 0  # nodes the computed shards ran on
    retries: dict[int, int] = field(default_factory=dict)  # shard -> the times Ray ran it again


class ShardsFailed(KlpipeError):
    """Shards of a Ray run failed for good; the others are complete, and a rerun runs only the failed ones."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def run_on_ray(config: PrecomputeConfig, ray_config: RayConfig, log=print) -> RaySummary:
    """Run every shard of `config` not yet complete as one Ray task each, and wait for them all."""
    if config.shard is not None:
        raise InputError("with --ray the driver runs every shard: give no shard of its own")
    if config.output is None:
        raise InputError("--output DIR is required with --ray: the shards write their parts into it")
    output = config.output
    if output.is_file():
        raise OutputError(f"{output} is a file; a run on Ray writes its parts into an output directory")
    from klpipe.precompute.rollouts import open_rollouts

    # The driver reads the inputs' metadata only: bad inputs fail here, in seconds, before any task starts.
    rollouts = open_rollouts(config.inputs, ColumnMap(config.columns))
    ray = ray_cluster.import_ray()
    assert ray_config.address is not None  # RayConfig refuses a run without one
    ray_cluster.connect(ray, ray_config.address)
    started = time.perf_counter()
    try:
        nodes = ray_cluster.alive_nodes(ray)
        gpus_per_shard = ray_config.gpus_per_shard if ray_config.gpus_per_shard is not None else (
            1 if ray_cluster.has_gpus(nodes) else 0)
        count = ray_config.num_shards or _existing_count(output) or ray_cluster.shard_count(
            nodes, gpus_per_shard, ray_config.cpus_per_shard)
        if not is_remote(output):
            _check_local_output(ray, output, nodes)
        shards = [Shard(i, count) for i in range(count)]
        total = rollouts.num_rows
        inputs = [fingerprint_of(f.path) for f in rollouts.files]
        complete = [s.index for s in shards if not config.overwrite and _complete(s, output, config, inputs)]
        todo = [s for s in shards if s.index not in complete]
        result = RaySummary(summary=PrecomputeSummary(output=output), shards=count, complete=complete)
        if not todo:
            log(f"all {count} shards of {output} are already complete for these inputs and this model; nothing to do")
            result.summary.skipped = True
            return result
        log(f"ray: {len(todo)} of {count} shards to run on {len(nodes)} node(s), each with "
            f"{gpus_per_shard:g} GPU and {ray_config.cpus_per_shard:g} CPU"
            + (f"; {len(complete)} already complete" if complete else ""))
        done_rows = sum(_span(s.rows(total, config.chunk_rows)) for s in shards if s.index in complete)
        summaries = _run_tasks(ray, config, ray_config, _ShardPlan(todo, gpus_per_shard, total, done_rows), result, log)
        _sum(result.summary, summaries)
        result.summary.seconds = time.perf_counter() - started
        sharding.shard_parts(output)  # every part there, of one run: what `klpipe score DIR` will check
        return result
    finally:
        ray.shutdown()


def fingerprint_of(path) -> dict:
    from klpipe.storage.fingerprint import fingerprint

    return fingerprint(path)


def _check_local_output(ray, output: Path, nodes: list[dict]) -> None:
    """On a cluster of several nodes a local output must be one every node sees; refused before any shard's
    task, and without leaving behind a directory this check made."""
    made = not output.exists()
    output.mkdir(parents=True, exist_ok=True)
    if len(nodes) > 1:
        try:
            ray_cluster.refuse_unseen_output(ray, output, nodes)
        except InputError:
            if made:
                output.rmdir()
            raise


def _span(rows: tuple[int, int]) -> int:
    return rows[1] - rows[0]


def _existing_count(output: Location) -> int | None:
    """The shard count of the parts already in `output`, so that a rerun on a cluster of another size resumes them."""
    if not output.is_dir():
        return None
    counts = {s.count for p in output.iterdir() if (s := sharding.parse_part_name(p.name)) is not None}
    return counts.pop() if len(counts) == 1 else None


def _complete(shard: Shard, output: Location, config: PrecomputeConfig, inputs: list[dict]) -> bool:
    """The shard's completion marker is in place, for a part made from these inputs with this model and settings.

    What the driver cannot know (the device's dtype and budgets, the weights' hash where the model lives on the
    workers only) a task checks itself: a marked part that disagrees here goes to a task, which refuses it as a
    single run does (or replaces it with --overwrite)."""
    part = shard.part_path(output)
    if not sharding.is_complete(part):
        return False
    made = cache.read_provenance(part)
    return made is not None and made.model == config.model and made.inputs == inputs and (
        made.temperature == float(config.temperature) and made.chunk_rows == config.chunk_rows
        and made.columns == dict(config.columns) and made.prefix_sharing == config.prefix_sharing
        and made.policy_model == config.policy)


@dataclass(frozen=True)
class _ShardPlan:
    """The shards a run sends to Ray's tasks, and what each task is given."""

    todo: list[Shard]  # the shards not already complete
    gpus_per_shard: float
    total: int  # rows in all the inputs
    done_rows: int  # rows of the shards already complete


def _run_tasks(ray, config: PrecomputeConfig, ray_config: RayConfig, plan: _ShardPlan, result: RaySummary,
               log) -> list[PrecomputeSummary]:
    todo, total = plan.todo, plan.total
    board = ray.remote(num_cpus=0)(Board).options(scheduling_strategy=ray_cluster.on_this_node(ray)).remote()
    task = ray.remote(shard_task).options(
        name="klpipe-shard", num_cpus=ray_config.cpus_per_shard, num_gpus=plan.gpus_per_shard,
        max_retries=ray_config.max_retries, retry_exceptions=False)
    # The driver shows the run's progress; a shard's own progress lines would only repeat it.
    # Each task runs in the driver's directory, where the config's relative paths lead (ray_task.in_directory).
    directory = os.getcwd()
    pending = {task.remote(dataclasses.replace(config, shard=shard, progress="none"), board, directory): shard
               for shard in todo}
    summaries, failures, nodes = [], {}, set()
    progress = Progress(config.progress, total_rows=total, initial_rows=plan.done_rows, log=log,
                        interval=config.log_interval)
    seen = {"rows": 0, "tokens": 0}
    stop = _StopOnSignal()
    try:
        with stop:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_SECONDS)
                for ref in ready:
                    shard = pending.pop(ref)
                    try:
                        summary, node = ray.get(ref)
                    except Exception as exc:  # noqa: BLE001 - each shard's error is reported, after the others end
                        failures[shard.index] = _describe(ray, exc, ray_config.max_retries)
                        log(f"shard {shard.index} of {shard.count} failed: {failures[shard.index][0]}")
                        continue
                    summaries.append(summary)
                    nodes.add(node)
                    result.ran.append(shard.index)
                    # The task's own time (model load, then scoring): the rest of a shard's wall time is Ray's.
                    log(f"shard {shard.index} of {shard.count} done on {node}: {summary.rows:,} rows"
                        + (f" (and {summary.resumed_rows:,} resumed)" if summary.resumed_rows else "")
                        + f" in {summary.load_seconds:.1f} s + {summary.seconds:.1f} s (load + score)")
                board_state = _snapshot(ray, board)
                _show(progress, board_state, seen, pending, result, total, config.chunk_rows, todo)
                if stop.received is not None:
                    _cancel(ray, list(pending), log)
                    name = signal.Signals(stop.received).name
                    raise Preempted(f"stopped by {name}: cancelled {len(pending)} running shard(s); completed "
                                    "shards are kept, rerun the same command to run the rest")
    finally:
        progress.close()
    state = _snapshot(ray, board)
    result.retries = {i: s["attempts"] - 1 for i, s in state.items() if s.get("attempts", 0) > 1}
    result.nodes = len(nodes)
    ray.kill(board)
    if failures:
        ran = len(result.ran) + len(result.complete)
        named = "; ".join(f"shard {i}: {line}" for i, (line, _) in sorted(failures.items()))
        codes = {code for _, code in failures.values()}
        raise ShardsFailed(f"{len(failures)} of {todo[0].count} shards failed ({named}); the other {ran} are "
                           "complete: rerun the same command to run only the failed ones",
                           exit_code=codes.pop() if len(codes) == 1 else 1)
    return summaries


def _snapshot(ray, board) -> dict[int, dict]:
    try:
        return ray.get(board.snapshot.remote(), timeout=10)
    except Exception:  # noqa: BLE001 - progress is best effort; the tasks' results are what count
        return {}


def _show(progress: Progress, state: dict, seen: dict, pending: dict, result: RaySummary, total: int,
          chunk_rows: int, todo: list[Shard]) -> None:
    rows = sum(min(s["rows"], _span(shard.rows(total, chunk_rows))) for shard in todo
               if (s := state.get(shard.index)) is not None)
    tokens = sum(s["tokens"] for s in state.values())
    running = [shard.index for shard in pending.values() if shard.index in state]
    where = ", ".join(f"shard {i} on {state[i]['node']}" for i in sorted(running))
    detail = f"{len(result.ran) + len(result.complete)}/{todo[0].count} shards done" + (
        f", running: {where}" if where else "")
    progress.update(rows - seen["rows"], tokens - seen["tokens"], detail)
    seen["rows"], seen["tokens"] = rows, tokens


def _describe(ray, exc: Exception, max_retries: int) -> tuple[str, int]:
    """A failed shard's last error line, as its own `klpipe precompute` would print it, and its exit code."""
    from ray import exceptions

    cause = exc.cause if isinstance(exc, exceptions.RayTaskError) else exc
    if isinstance(cause, KlpipeError):
        return " ".join(str(cause).split()), cause.exit_code
    if isinstance(cause, (exceptions.WorkerCrashedError, exceptions.NodeDiedError, exceptions.OutOfMemoryError)):
        return (f"its Ray worker died {max_retries + 1} time(s) ({type(cause).__name__}: {first_line(cause)})", 1)
    return f"unexpected {type(cause).__name__}: {first_line(cause)}", 1


def _cancel(ray, refs: list, log) -> None:
    """Cancel running shards: KeyboardInterrupt in each task first (finished chunks stay), then their workers."""
    if not refs:
        return
    log(f"cancelling {len(refs)} running shard(s)")
    for ref in refs:
        ray.cancel(ref, force=False)
    _, left = ray.wait(refs, num_returns=len(refs), timeout=CANCEL_GRACE_SECONDS)
    for ref in left:
        ray.cancel(ref, force=True)
    ray.wait(left, num_returns=len(left), timeout=CANCEL_GRACE_SECONDS)


class _StopOnSignal:
    """SIGINT or SIGTERM to the driver: the loop cancels the tasks, then stops (not a KeyboardInterrupt mid-wait)."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            print(f"received {signal.Signals(signum).name}: cancelling the shards still running", file=sys.stderr,
                  flush=True)
        self.received = signum


def _sum(total: PrecomputeSummary, summaries: list[PrecomputeSummary]) -> None:
    """The run's summary from its shards': counts summed, the largest shard's peak memory and load time."""
    total.forward = ForwardStats(**{f.name: sum(getattr(s.forward, f.name) for s in summaries)
                                    for f in dataclasses.fields(ForwardStats)})
    for name in ("rows", "tokens", "tool_tokens", "pads", "resumed_chunks", "resumed_rows"):
        setattr(total, name, sum(getattr(s, name) for s in summaries))
    total.load_seconds = max((s.load_seconds for s in summaries), default=0.0)
    modes = {s.prefix_sharing for s in summaries}
    total.prefix_sharing = modes.pop() if len(modes) == 1 else "mixed"
    for s in summaries:
        for key, value in s.peak_memory.items():
            total.peak_memory[key] = max(total.peak_memory.get(key, 0.0), value)
