"""Reading Atropos groups (JSON Lines, one `ScoredDataGroup` a line) as klpipe's token-id rows.

A file is read line by line, never whole: once to count and check its completions (at open, so a bad
group fails before the model loads), then again for each range of rows a chunk asks for. Each
completion is one row of the token-id mode, with its id naming the group and the completion
(`FILE:LINE:INDEX`, the line counted from 1), and the group's JSON line kept on its first completion's
row (klpipe.atropos.groups.GROUP_COLUMN) so that score can write the group back.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from klpipe import cache
from klpipe.arrow import list_array, offsets_from_lengths
from klpipe.atropos.groups import GROUP_COLUMN, Completion, is_group, split_group
from klpipe.errors import InputError
from klpipe.storage.download import local_copy
from klpipe.storage.store import Location

ATROPOS = "atropos"  # --rollout-format, and the kind of a RolloutFile read here


def schema(with_policy: bool) -> pa.Schema:
    """The rows a group file reads as: token ids, the mask, the reward, and the group's line."""
    fields = [pa.field(cache.ID, pa.string()), pa.field(cache.PROMPT_IDS, pa.list_(pa.int32())),
              pa.field(cache.RESPONSE_IDS, pa.list_(pa.int32())), pa.field(cache.MASK, pa.list_(pa.int8()))]
    if with_policy:
        fields.append(pa.field(cache.POLICY_LOGPROBS, pa.list_(pa.float64())))
    fields += [pa.field(cache.REWARD, pa.float64()), pa.field(GROUP_COLUMN, pa.string())]
    return pa.schema(fields)


def looks_like_groups(path: Location) -> bool:
    """Whether a JSON Lines file's first line is an Atropos group (its columns say so)."""
    for _, line in _lines(path):
        try:
            return is_group(json.loads(line))
        except ValueError:
            return False
    return False


def scan(path: Location) -> tuple[int, pa.Schema]:
    """(completions in the file, its schema), checking every group; the first bad one raises."""
    rows, with_policy, empty = 0, False, True
    for number, line in _lines(path):
        empty = False
        completions = _parse(path, number, line)
        rows += len(completions)
        with_policy |= completions[0].policy is not None
    if empty:
        raise InputError(f"{path}: file has no groups")
    return rows, schema(with_policy)


def iter_batches(path: Location, lo: int, hi: int, batch_rows: int,
                 file_schema: pa.Schema) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(file row of the batch's first row, batch) covering the file's completions [lo, hi)."""
    pending: list[tuple[str, Completion, str | None]] = []
    first = None
    row = 0
    for number, line in _lines(path):
        if row >= hi:
            break
        completions = _parse(path, number, line)
        for index, completion in enumerate(completions):
            if lo <= row < hi:
                first = row if first is None else first
                pending.append((f"{path.name}:{number}:{index}", completion, line if index == 0 else None))
                if len(pending) == batch_rows:
                    yield first, _batch(pending, file_schema)
                    pending, first = [], None
            row += 1
    if pending and first is not None:  # `first` is set with the first pending row
        yield first, _batch(pending, file_schema)


def _batch(rows: list[tuple[str, Completion, str | None]], file_schema: pa.Schema) -> pa.RecordBatch:
    def ids(arrays: list[np.ndarray], kind) -> pa.Array:
        offsets = offsets_from_lengths([len(a) for a in arrays])
        flat = np.concatenate(arrays) if arrays else np.zeros(0)
        return list_array(offsets, flat.astype(kind))

    completions = [c for _, c, _ in rows]
    columns = {
        cache.ID: pa.array([name for name, _, _ in rows], pa.string()),
        cache.PROMPT_IDS: ids([c.prompt for c in completions], np.int32),
        cache.RESPONSE_IDS: ids([c.response for c in completions], np.int32),
        cache.MASK: ids([c.mask for c in completions], np.int8),
        cache.REWARD: pa.array([c.reward for c in completions], pa.float64()),
        GROUP_COLUMN: pa.array([group for _, _, group in rows], pa.string()),
    }
    if cache.POLICY_LOGPROBS in file_schema.names:
        # A group without inference_logprobs has none to give: null, which score names if it needs them.
        policy = [None if c.policy is None else c.policy.tolist() for c in completions]
        columns[cache.POLICY_LOGPROBS] = pa.array(policy, pa.list_(pa.float64()))
    return pa.RecordBatch.from_arrays([columns[name] for name in file_schema.names], schema=file_schema)


def _parse(path: Location, number: int, line: str) -> list[Completion]:
    where = f"{path}: line {number}"
    try:
        group = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where} is not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not is_group(group):
        found = ", ".join(group) if isinstance(group, dict) else type(group).__name__
        raise InputError(f"{where} is not an Atropos group (needs tokens, masks and scores; found {found})")
    return split_group(group, where)


def _lines(path: Location) -> Iterator[tuple[int, str]]:
    """(line number from 1, text) of every non-blank line, one at a time."""
    local = local_copy(path)
    opener = gzip.open if Path(local).name.endswith(".gz") else open
    number = 0
    try:
        with opener(local, "rt", encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                line = line.rstrip("\r\n")
                if line.strip():
                    yield number, line
    except UnicodeDecodeError:
        raise InputError(f"{path}: line {number + 1} is not UTF-8 text") from None
    except (OSError, EOFError) as exc:
        raise InputError(f"{path}: unreadable ({exc})") from None
