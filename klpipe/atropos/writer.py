"""Writing a cache's or a scored file's rows back as Atropos groups, one JSON line each, in their order.

Each group comes out as the line it came in (kept in the cache's GROUP_COLUMN), with only these set:
- `ref_logprobs`: one list per completion, aligned with `tokens`, Atropos's placeholder (1.0) at every
  untrained position;
- scored only: `scores`, the penalised rewards, and each completion's `overrides` with the raw score,
  the KL and the coefficient applied (groups.RAW_SCORE, groups.KL, groups.KL_COEFF) added to what it held.

A group's rows are consecutive (precompute and score keep the row order), so one group is held at a time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

import pyarrow as pa

from klpipe import cache
from klpipe.atropos.groups import GROUP_COLUMN, KL, KL_COEFF, RAW_SCORE, aligned_ref_logprobs, fill_line
from klpipe.columns import ColumnMap
from klpipe.errors import InputError
from klpipe.storage.store import Location

# score's columns (klpipe/score/run.py), read here by name: this module sits below score.
SCORED = ("kl", "kl_coeff", "adjusted_reward")


def check_groups(schema: pa.Schema, what: str) -> None:
    """Refuses rows that did not come from Atropos groups: there is no group to write back."""
    if GROUP_COLUMN not in schema.names:
        raise InputError(f"{what}: not made from Atropos groups (no {GROUP_COLUMN} column), so there are no groups "
                         "to write back; write parquet instead")


class GroupWriter:
    """Rows in (record batches), group lines out (to `out`), in order."""

    def __init__(self, out: TextIO, names: ColumnMap, scored: bool) -> None:
        self.out = out
        self.names = names
        self.scored = scored
        self.groups = 0
        self._line: str | None = None  # the group being filled
        self._size = 0  # its completions
        self._rows: list[dict] = []  # what each of its completions read so far gets

    def add(self, batch: pa.RecordBatch | pa.Table) -> None:
        columns = {GROUP_COLUMN: batch.column(GROUP_COLUMN).to_pylist(),
                   "prompt": batch.column(self.names.name(cache.PROMPT_IDS)).to_pylist(),
                   "ref": batch.column(self.names.name(cache.REF_LOGPROBS)).to_pylist(),
                   "id": batch.column(self.names.name(cache.ID)).to_pylist()}
        if self.scored:
            columns["reward"] = batch.column(self.names.name(cache.REWARD)).to_pylist()
            for name in SCORED:
                columns[name] = batch.column(name).to_pylist()
        for i in range(batch.num_rows):
            line = columns[GROUP_COLUMN][i]
            if line is not None:
                self._begin(line, columns["id"][i])
            elif self._line is None:
                raise InputError(f"row {columns['id'][i]!r} belongs to no group: the rows of an Atropos group must "
                                 "stay together and in order, as precompute wrote them")
            row = {"ref": aligned_ref_logprobs(len(columns["prompt"][i]), columns["ref"][i] or [])}
            if self.scored:
                row.update({name: columns[name][i] for name in ("reward", *SCORED)})
            self._rows.append(row)
            if len(self._rows) == self._size:
                self._emit()

    def close(self) -> None:
        if self._line is not None:
            raise InputError(f"the last Atropos group ends after {len(self._rows)} of its {self._size} completions: "
                             "score every row precompute wrote for it")

    def _begin(self, line: str, first_id: str) -> None:
        if self._line is not None:
            raise InputError(f"the group before row {first_id!r} ends after {len(self._rows)} of its {self._size} "
                             "completions: the rows of an Atropos group must stay together and in order")
        self._line = line
        self._size = len(json.loads(line)["tokens"])
        self._rows = []

    def _emit(self) -> None:
        assert self._line is not None, "a group is open"
        values: dict[str, object] = {"ref_logprobs": [row["ref"] for row in self._rows]}
        if self.scored:
            values["scores"] = [row["adjusted_reward"] for row in self._rows]
            before = json.loads(self._line).get("overrides")
            overrides = before if isinstance(before, list) and len(before) == self._size else [None] * self._size
            values["overrides"] = [
                {**(old if isinstance(old, dict) else {}),
                 RAW_SCORE: row["reward"], KL: row["kl"], KL_COEFF: row["kl_coeff"]}
                for old, row in zip(overrides, self._rows, strict=True)
            ]
        self.out.write(fill_line(self._line, values) + "\n")
        self.groups += 1
        self._line, self._size, self._rows = None, 0, []


def write_groups_file(cache_path: Path, output: Location, columns: ColumnMap) -> None:
    """A precompute cache's rows as the Atropos groups they came from, ref_logprobs filled, appearing whole."""
    import pyarrow.parquet as pq

    from klpipe.storage.atomic import atomic_output

    with atomic_output(output) as tmp, open(tmp, "w", encoding="utf-8") as out:
        writer = GroupWriter(out, columns, scored=False)
        parquet = pq.ParquetFile(cache_path)
        for group in range(parquet.num_row_groups):  # one row group (a chunk) in memory at a time
            writer.add(parquet.read_row_group(group))
        writer.close()
