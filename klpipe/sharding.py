"""Which slice of the input this process owns: explicit flags, Slurm array variables, or torchrun's.

One shard is one contiguous row range, so shard outputs in shard order concatenate to the input
order. No process talks to another: a Slurm array task or torchrun rank just takes its range.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from klpipe.errors import InputError


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    def rows(self, total: int, chunk_rows: int) -> tuple[int, int]:
        """This shard's contiguous row range, cut on chunk boundaries.

        Cutting where a single-process run would cut its chunks means every shard batches its
        rows exactly as that run does, so the concatenated parts equal its output bit for bit.
        Shards differ in size by at most one chunk.
        """
        chunks = -(-total // chunk_rows)
        first, last = self.index * chunks // self.count, (self.index + 1) * chunks // self.count
        return min(first * chunk_rows, total), min(last * chunk_rows, total)

    def part_name(self) -> str:
        return f"part-{self.index:05d}-of-{self.count:05d}.parquet"

    def part_path(self, output_dir: Path) -> Path:
        return output_dir / self.part_name()

    def marker_path(self, output_dir: Path) -> Path:
        return output_dir / self.part_name().replace(".parquet", ".done")


def resolve_shard(index: int | None, count: int | None, env: dict | None = None) -> Shard | None:
    """Flags first, then SLURM_ARRAY_TASK_*, then torchrun's RANK / WORLD_SIZE; None: not sharded."""
    env = os.environ if env is None else env
    source = "--shard-index/--num-shards"
    if index is None and count is None:
        if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
            source = "SLURM_ARRAY_TASK_*"
            task, first = _int(env, "SLURM_ARRAY_TASK_ID"), _int(env, "SLURM_ARRAY_TASK_MIN", 0)
            step = _int(env, "SLURM_ARRAY_TASK_STEP", 1)
            index, count = (task - first) // step, _int(env, "SLURM_ARRAY_TASK_COUNT")
        elif "RANK" in env and "WORLD_SIZE" in env:
            source = "RANK/WORLD_SIZE"
            index, count = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        else:
            return None
    if index is None or count is None:
        raise InputError("--shard-index and --num-shards go together")
    if count < 1 or not 0 <= index < count:
        raise InputError(f"shard index {index} is outside 0..{count - 1} (from {source})")
    return Shard(index, count)


def local_device(device: str, env: dict | None = None) -> str:
    """Under torchrun each rank takes its own GPU: `auto` becomes cuda:LOCAL_RANK."""
    env = os.environ if env is None else env
    if device == "auto" and "LOCAL_RANK" in env:
        import torch

        if torch.cuda.is_available():
            return f"cuda:{_int(env, 'LOCAL_RANK')}"
    return device


def _int(env, name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None and default is not None:
        return default
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise InputError(f"environment variable {name}={raw!r} is not an integer") from None
