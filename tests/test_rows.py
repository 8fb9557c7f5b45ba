"""Row names: one format for both stages, `<file>: row <index in that file> (id '<id>')`."""

from pathlib import Path

import pyarrow as pa

from klpipe.rows import RowLocator, row_name


def test_row_name_with_and_without_an_id():
    assert row_name(Path("day/a.parquet"), 7, "r7") == "day/a.parquet: row 7 (id 'r7')"
    assert row_name("a.parquet", 7, 12) == "a.parquet: row 7 (id 12)"
    assert row_name("a.parquet", 0) == "a.parquet: row 0"


def test_a_locator_counts_from_the_batch_start_and_skips_null_ids():
    rows = RowLocator(Path("a.parquet"), first_index=100, ids=pa.array(["x", None, "z"]))
    assert [rows.name(i) for i in range(3)] == ["a.parquet: row 100 (id 'x')", "a.parquet: row 101",
                                               "a.parquet: row 102 (id 'z')"]
    assert RowLocator(Path("b.parquet"), 5).name(1) == "b.parquet: row 6"
