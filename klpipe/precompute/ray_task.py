"""The task's side of `--ray`: one shard's body, as a Ray worker runs it, and the board it reports progress to.

A worker imports this module (Ray pickles `shard_task` by reference), not the driver's: ray_executor.py.

A Ray worker runs in a directory of Ray's choosing, not the driver's, so a relative path the user gave the driver
(`-m sample_data/ref data.parquet -o cached/`) would name another file there, or none: each task runs in the
driver's directory, as a Slurm array task runs in the directory it was submitted from.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

from klpipe.errors import InputError
from klpipe.precompute.config import PrecomputeConfig
from klpipe.precompute.run import PrecomputeSummary
from klpipe.storage.store import is_remote


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


def shard_task(config: PrecomputeConfig, board, directory: str) -> tuple[PrecomputeSummary, str]:
    """One shard, as a Slurm array task runs it: precompute() with its Shard. Runs in a Ray worker."""
    import ray

    from klpipe.precompute.run import precompute

    assert config.shard is not None  # the driver gives each task's config its shard
    index = config.shard.index
    node = f"{ray.util.get_node_ip_address()} ({ray.get_runtime_context().get_node_id()[:8]})"
    # Not waited on: a task blocked in ray.get lends its CPU back to Ray, which may start another shard on it.
    # The board runs one caller's calls in the order made, so this one comes before the shard's chunks.
    board.start.remote(index, node)

    def log(message: str) -> None:
        print(f"shard {index}: {message}", file=sys.stderr, flush=True)

    def on_chunk(rows: int, tokens: int) -> None:
        board.chunk.remote(index, rows, tokens)

    with in_directory(directory, config, node):
        return precompute(config, log=log, on_chunk=on_chunk), node


def relative_paths(config: PrecomputeConfig) -> list[str]:
    """The local paths of `config` that are relative: inputs, output, work directory, and a model or policy given
    as a relative path (a hub id is relative too, so these two count only where they name a directory here)."""
    paths = [*config.inputs, config.output, config.work_dir]
    found = [str(p) for p in paths if p is not None and not is_remote(p) and not Path(p).is_absolute()]
    found += [name for name in (config.model, config.policy)
              if name is not None and not Path(name).is_absolute() and Path(name).exists()]
    return found


@contextmanager
def in_directory(directory: str, config: PrecomputeConfig, node: str):
    """Within: the driver's working directory (`directory`), where the config's relative paths lead, and back
    after (Ray runs the worker's next task in the same process). Refused in one line where the node has no such
    directory and the config holds relative local paths: they would name other files, or none."""
    before = os.getcwd()
    if not os.path.isdir(directory):
        relative = relative_paths(config)
        if relative:
            raise InputError(f"{', '.join(relative)}: relative to the driver's directory {directory}, which node "
                             f"{node} does not have; give absolute paths on storage every node sees")
        yield
        return
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(before)
