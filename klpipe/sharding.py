"""Shards: which slice of the input a process owns, and the one owner of a shard's completion.

One shard is one contiguous row range, so shard outputs in shard order concatenate to the input
order. No process talks to another: a Slurm array task or torchrun rank just takes its range
(from explicit flags, Slurm array variables, or torchrun's).

A sharded run writes `part-<i>-of-<n>.parquet` into the output directory, then a
`part-<i>-of-<n>.done` marker holding the part's row count and provenance. This module alone
names parts, parses their names, writes markers and decides whether a part is complete (as
datatrove's executor owns its completion markers); `klpipe score DIR` asks it for the parts.
The output directory may be a prefix on a store (s3://bucket/parts/): parts and markers are then
objects, each uploaded whole, the marker after its part.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from klpipe.cache import Provenance, check_compatible, read_provenance
from klpipe.errors import InputError, ProvenanceError
from klpipe.storage.atomic import write_json_atomic
from klpipe.storage.parquet import open_parquet
from klpipe.storage.store import Location

PART_PATTERN = re.compile(r"^part-(\d+)-of-(\d+)\.parquet$")
PART_SUFFIX = ".parquet"
MARKER_SUFFIX = ".done"


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
        return f"part-{self.index:05d}-of-{self.count:05d}{PART_SUFFIX}"

    def part_path(self, output_dir: Location) -> Location:
        return output_dir / self.part_name()


def resolve_shard(index: int | None, count: int | None, env: Mapping[str, str] | None = None) -> Shard | None:
    """Flags first, then SLURM_ARRAY_TASK_*, then torchrun's RANK / WORLD_SIZE; None: not sharded."""
    environ = os.environ if env is None else env
    source = "--shard-index/--num-shards"
    if index is None and count is None:
        if "SLURM_ARRAY_TASK_ID" in environ and "SLURM_ARRAY_TASK_COUNT" in environ:
            source = "SLURM_ARRAY_TASK_*"
            task, first = _int(environ, "SLURM_ARRAY_TASK_ID"), _int(environ, "SLURM_ARRAY_TASK_MIN", 0)
            step = _int(environ, "SLURM_ARRAY_TASK_STEP", 1)
            index, count = (task - first) // step, _int(environ, "SLURM_ARRAY_TASK_COUNT")
        elif "RANK" in environ and "WORLD_SIZE" in environ:
            source = "RANK/WORLD_SIZE"
            index, count = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
        else:
            return None
    if index is None or count is None:
        raise InputError("--shard-index and --num-shards go together")
    if count < 1 or not 0 <= index < count:
        raise InputError(f"shard index {index} is outside 0..{count - 1} (from {source})")
    return Shard(index, count)


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None and default is not None:
        return default
    try:
        return int(raw or "")  # a variable that is not set is no integer either
    except ValueError:
        raise InputError(f"environment variable {name}={raw!r} is not an integer") from None


# -- completion -------------------------------------------------------------------------------------


def parse_part_name(name: str) -> Shard | None:
    """The shard a part file belongs to, from its name; None for any other file."""
    match = PART_PATTERN.match(name)
    return Shard(int(match.group(1)), int(match.group(2))) if match else None


def marker_path(part: Location) -> Location:
    """`part-<i>-of-<n>.done` beside `part-<i>-of-<n>.parquet`."""
    return part.with_name(part.name.removesuffix(PART_SUFFIX) + MARKER_SUFFIX)


def mark_complete(part: Location, rows: int, provenance: Provenance, tmp_dir: Path | None) -> None:
    """Record that `part` is whole and holds `rows` rows; written atomically, its temporary file in `tmp_dir`."""
    write_json_atomic(marker_path(part), {"rows": rows, "provenance": json.loads(provenance.to_json())},
                      tmp_dir=tmp_dir)


def unmark(part: Location) -> None:
    """A part being rewritten is not complete until it is marked again."""
    marker_path(part).unlink(missing_ok=True)


def is_complete(part: Location) -> bool:
    """The part exists and its marker records the rows it holds (a stale or foreign marker does not count)."""
    return _completion(part) == "complete"


def _completion(part: Location) -> str:
    """complete | unmarked (no marker, or no part) | mismatched (a marker that does not describe the part)."""
    marker = marker_path(part)
    if not (marker.is_file() and part.is_file()):
        return "unmarked"
    try:
        recorded = json.loads(marker.read_text())["rows"]
        with open_parquet(part) as reader:
            holds = reader.metadata.num_rows
    except (OSError, ValueError, TypeError, KeyError):
        return "mismatched"
    return "complete" if recorded == holds else "mismatched"


def is_shard_directory(path: Location) -> bool:
    return path.is_dir() and any(parse_part_name(p.name) for p in path.iterdir())


def shard_parts(directory: Location) -> list[Location]:
    """The parts of a sharded run's output directory in shard order, refused unless complete and consistent.

    Scoring a directory with a missing or unfinished shard, or shards of different runs (shard
    count or provenance), would silently skip or mix rows.
    """
    parts: dict[int, Location] = {}
    counts: set[int] = set()
    children: Iterator[Location] = directory.iterdir()
    for path in sorted(children):
        shard = parse_part_name(path.name)
        if shard is not None:
            parts[shard.index] = path
            counts.add(shard.count)
    if len(counts) > 1:
        raise ProvenanceError(f"{directory}: holds parts of runs with different shard counts "
                              f"({', '.join(str(c) for c in sorted(counts))}); remove the stale parts")
    count = counts.pop()
    missing = [i for i in range(count) if i not in parts]
    completion = {i: _completion(p) for i, p in sorted(parts.items())}
    unmarked = [i for i, state in completion.items() if state == "unmarked"]
    mismatched = [i for i, state in completion.items() if state == "mismatched"]
    problems = []
    if missing:
        problems.append(f"missing {_shards(missing)}")
    if unmarked:
        problems.append(f"no completion marker for {_shards(unmarked)}")
    if mismatched:
        problems.append(f"a completion marker that does not match its part for {_shards(mismatched)}")
    if problems:
        raise InputError(f"{directory}: incomplete: {' and '.join(problems)} of {count}; "
                         "rerun those shards of klpipe precompute first")
    ordered = [parts[i] for i in range(count)]
    provenances = [(str(p), read_provenance(p)) for p in ordered]
    check_compatible(provenances)
    first_name, first_inputs = provenances[0][0], None
    next_row = 0
    for name, provenance in provenances:
        if provenance is None or provenance.shard is None:
            raise ProvenanceError(f"{name}: a part file without klpipe shard provenance")
        if first_inputs is None:  # the first part, checked first
            first_inputs = provenance.inputs
        elif provenance.inputs != first_inputs:
            raise ProvenanceError(f"caches disagree on their input files: {first_name} and {name} were made "
                                  "from different rollouts; rerun klpipe precompute into a clean directory")
        start, stop = provenance.shard["rows"]
        if start != next_row:
            raise ProvenanceError(f"{name}: covers rows {start}..{stop}, expected to start at row {next_row}")
        next_row = stop
    return ordered


def _shards(indices: list[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:10])
    more = f" and {len(indices) - 10} more" if len(indices) > 10 else ""
    return f"shard{'s' if len(indices) > 1 else ''} {shown}{more}"
