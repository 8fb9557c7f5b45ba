"""The task's side of `--ray`: one shard's body, as a Ray worker runs it, and the board it reports progress to.

A worker imports this module (Ray pickles `shard_task` by reference), not the driver's: ray_executor.py.
"""

from __future__ import annotations

import sys

from klpipe.precompute.config import PrecomputeConfig
from klpipe.precompute.run import PrecomputeSummary


class Board:
    """A Ray actor the tasks report to, for the driver's one progress line: who runs where, rows and tokens.

    It runs on the driver's node (ray_cluster.on_this_node): a task run again after its node was lost reports
    to the same board."""

    def __init__(self):
        self.shards: dict[int, dict] = {}

    def start(self, index: int, node: str) -> None:
        shard = self.shards.setdefault(index, {"rows": 0, "tokens": 0, "attempts": 0})
        shard["attempts"] += 1
        shard["node"] = node

    def chunk(self, index: int, rows: int, tokens: int) -> None:
        self.shards[index]["rows"] += rows
        self.shards[index]["tokens"] += tokens

    def snapshot(self) -> dict[int, dict]:
        return self.shards


def shard_task(config: PrecomputeConfig, board) -> tuple[PrecomputeSummary, str]:
    """One shard, as a Slurm array task runs it: precompute() with its Shard. Runs in a Ray worker."""
    import ray

    from klpipe.precompute.run import precompute

    index = config.shard.index
    node = f"{ray.util.get_node_ip_address()} ({ray.get_runtime_context().get_node_id()[:8]})"
    # Not waited on: a task blocked in ray.get lends its CPU back to Ray, which may start another shard on it.
    # The board runs one caller's calls in the order made, so this one comes before the shard's chunks.
    board.start.remote(index, node)

    def log(message: str) -> None:
        print(f"shard {index}: {message}", file=sys.stderr, flush=True)

    def on_chunk(rows: int, tokens: int) -> None:
        board.chunk.remote(index, rows, tokens)

    return precompute(config, log=log, on_chunk=on_chunk), node
