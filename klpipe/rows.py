"""How both stages name a row in a message: `<file>: row <index> (id '<id>')`.

The index counts from 0 within the file the row came from (`pq.read_table(file).slice(index, 1)`
finds it), whichever chunk, batch or shard it was read in. The id part appears when the input
has an `id` column and the row's id is not null.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

if TYPE_CHECKING:
    from klpipe.storage.store import Location


def row_name(path: str | Location, index: int, row_id: object = None) -> str:
    """`<path>: row <index>`, plus ` (id <row_id!r>)` when the row has an id."""
    name = f"{path}: row {index}"
    return name if row_id is None else f"{name} (id {row_id!r})"


@dataclass(frozen=True)
class RowLocator:
    """Where the rows of one record batch come from: a file, and the index in it of the batch's first row."""

    path: Location
    first_index: int
    ids: pa.Array | None = None  # the batch's id column, when the input has one

    def name(self, i: int) -> str:
        """The name of the batch's row `i`."""
        return row_name(self.path, self.first_index + i, None if self.ids is None else self.ids[i].as_py())
