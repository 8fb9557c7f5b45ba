"""The cluster's side of `--ray`: joining it, what it has (nodes, CPUs, GPUs), and whether its nodes see the output.

Ray is imported only here and in the modules of `--ray` (ray_executor.py, ray_task.py), and only once `--ray`
is given: `pip install "klpipe[ray]"`.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from pathlib import Path

from klpipe.errors import InputError, first_line

INSTALL = 'pip install "klpipe[ray]"'
# `--ray local` starts a cluster of this machine alone. klpipe passes only configs and summaries through
# Ray's object store, so a small one does (Ray's own default is 30% of memory).
LOCAL_OBJECT_STORE_BYTES = 256 * 2**20
PROBE_SECONDS = 30.0  # how long a node that has just joined may stay unknown to the driver's raylet


def import_ray():
    """Ray, or one line naming the install command (exit 2)."""
    # Ray folds lines it thinks alike ("[repeated 2x]"), shards' lines among them; each names its shard.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        import ray
    except ImportError:
        raise InputError(f"--ray needs Ray, which klpipe installs only on request: {INSTALL}") from None
    return ray


def connect(ray, address: str) -> None:
    try:
        if address == "local":
            # Token authentication is Ray's default for a new local cluster (its token in ~/.ray); its warning
            # that it is on would be a stray line in klpipe's output.
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
            ray.init(address="local", include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                     logging_level=logging.WARNING)
        else:
            ray.init(address=address, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise InputError(f"--ray {address}: cannot join a Ray cluster there ({first_line(exc)})") from None


def alive_nodes(ray) -> list[dict]:
    return [node for node in ray.nodes() if node.get("Alive")]


def shard_count(nodes: list[dict], gpus_per_shard: float, cpus_per_shard: float) -> int:
    """As many shards as the cluster has slots: its GPUs per shard, or on a CPU cluster its CPUs per shard."""
    if gpus_per_shard:
        gpus = sum(node["Resources"].get("GPU", 0) for node in nodes)
        return max(1, int(gpus // gpus_per_shard))
    cpus = sum(node["Resources"].get("CPU", 0) for node in nodes)
    return max(1, int(cpus // cpus_per_shard))


def has_gpus(nodes: list[dict]) -> bool:
    return any(node["Resources"].get("GPU", 0) for node in nodes)


def on_this_node(ray):
    """A scheduling strategy that keeps an actor on the driver's own node: it dies only with the driver, never
    with a worker node lost mid-run (whose shards Ray runs again, and which report to it again)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def refuse_unseen_output(ray, output: Path, nodes: list[dict]) -> None:
    """A local output must be on storage every node sees (a shared filesystem): each node reads a probe file the
    driver writes, in a task of no CPU on that node, before any shard's task is submitted."""
    token = secrets.token_hex(8)
    probe = output / f".klpipe-ray-probe-{token}"
    probe.write_text(token)
    try:
        seen = _probe(ray, os.path.abspath(probe), token, nodes)  # a task's directory is not the driver's
    finally:
        probe.unlink(missing_ok=True)
    blind = [node_name(node) for node in nodes if seen.get(node["NodeID"]) is False]
    if blind:
        raise InputError(f"--output {output} is on this machine's disk, which {len(blind)} of the cluster's "
                         f"{len(seen)} nodes do not see ({', '.join(blind)}): write to storage every node sees "
                         "(s3://..., or a shared filesystem)")


def _probe(ray, path: str, token: str, nodes: list[dict]) -> dict[str, bool]:
    """Node id -> whether a task there reads `token` at `path`. A node the driver's raylet does not know yet (one
    that has just joined) is asked again; one that has left the cluster meanwhile is left out: it runs no shard."""
    from ray.exceptions import TaskUnschedulableError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    reads = ray.remote(num_cpus=0, max_retries=0)(_reads)
    seen: dict[str, bool] = {}
    todo = [node["NodeID"] for node in nodes]
    deadline = time.monotonic() + PROBE_SECONDS
    while todo:
        refs = {node: reads.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                .remote(path, token) for node in todo}
        todo = []
        for node, ref in refs.items():
            try:
                seen[node] = ray.get(ref)
            except TaskUnschedulableError:
                alive = {n["NodeID"] for n in alive_nodes(ray)}
                if node in alive and time.monotonic() < deadline:
                    todo.append(node)
                elif node in alive:
                    raise
        if todo:
            time.sleep(1.0)
    return seen


def _reads(path: str, token: str) -> bool:
    try:
        with open(path) as f:
            return f.read() == token
    except OSError:
        return False


def node_name(node: dict) -> str:
    return f"{node.get('NodeManagerAddress', '?')} ({node['NodeID'][:8]})"
