"""Flipped bits: every page klpipe writes carries a checksum, and every reader verifies it.

One flipped byte in a cache's `ref_logprobs` pages used to let `klpipe score` finish with
different KL values. Now it stops with one line naming the file, and writes nothing computed from it.
"""

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from klpipe.cli import app
from klpipe.precompute import PrecomputeConfig, precompute
from tests.helpers import ROLLOUTS, TINY_LLAMA, crash_at_chunk

runner = CliRunner()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "cached.parquet"
    precompute(PrecomputeConfig(inputs=[ROLLOUTS], output=out, model=str(TINY_LLAMA), device="cpu", progress="none"),
               log=lambda message: None)
    return out


def page_payload_positions(path, column: str, per_page: int = 5) -> list[int]:
    """Byte offsets inside the pages (dictionary page, if any, and data page) of `column`, clear of headers."""
    meta = pq.ParquetFile(path).metadata.row_group(0)
    chunk = next(meta.column(i) for i in range(meta.num_columns) if meta.column(i).path_in_schema.startswith(column))
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    end = start + chunk.total_compressed_size
    header = 80  # a page header is a few dozen bytes of thrift; keep well clear of it
    pages = [start, chunk.data_page_offset] if chunk.has_dictionary_page else [start]
    spans = [(page + header, following) for page, following in zip(pages, pages[1:] + [end], strict=True)]
    assert all(hi - lo > per_page for lo, hi in spans), spans
    return [lo + (hi - lo) * k // (per_page + 1) for lo, hi in spans for k in range(1, per_page + 1)]


def flip_byte(path, position: int, source: bytes | None = None) -> None:
    """Write `source` (default: the file as it is) to `path` with one bit of byte `position` flipped."""
    data = bytearray(path.read_bytes() if source is None else source)
    data[position] ^= 0x10
    path.write_bytes(bytes(data))


def test_without_checksums_a_flipped_byte_reads_back_as_another_number(cache, tmp_path):
    # What the checksums are for: plain float pages, written as other tools write them, take a flip
    # silently. (It also shows that the positions used below land in payload bytes.)
    table = pq.read_table(cache)
    plain = tmp_path / "plain.parquet"
    pq.write_table(table, plain, use_dictionary=False, compression="none")
    flip_byte(plain, page_payload_positions(plain, "ref_logprobs")[-1])
    damaged = pq.read_table(plain, page_checksum_verification=True)
    assert damaged.num_rows == table.num_rows and not damaged.equals(table)


def test_a_flipped_byte_in_a_cache_stops_score_and_writes_nothing(cache, tmp_path):
    original = cache.read_bytes()
    clean = runner.invoke(app, ["score", str(cache), "-o", str(tmp_path / "clean.parquet")])
    assert clean.exit_code == 0, clean.stderr
    for column in ("ref_logprobs", "policy_logprobs"):
        for position in page_payload_positions(cache, column):
            damaged = tmp_path / "damaged.parquet"
            flip_byte(damaged, position, source=original)
            outputs = tmp_path / f"out-{column}-{position}"
            result = runner.invoke(app, ["score", str(damaged), "-o", str(outputs / "scored.parquet"),
                                         "--report", str(outputs / "report.json"), "--state", str(outputs / "s.json")])
            where = f"{column} byte {position}"
            assert result.exit_code == 2, f"{where}: exit {result.exit_code}: {result.stderr}"
            assert result.stderr.startswith(f"Error: {damaged}: corrupt or unreadable ("), where
            assert result.stderr.count("\n") == 1, where
            assert not outputs.exists() or not any(outputs.iterdir()), where  # no rewards computed from it


def test_a_damaged_checkpoint_is_never_merged(tmp_path, monkeypatch):
    """A chunk file corrupted on disk between a crash and the resume: named, never merged; removed, recomputed."""
    from klpipe.errors import OutputError

    def run(name):
        config = PrecomputeConfig(inputs=[ROLLOUTS], output=tmp_path / name, model=str(TINY_LLAMA), device="cpu",
                                  chunk_rows=16, progress="none")
        return precompute(config, log=lambda message: None)

    expected = pq.read_table(run("expected.parquet").output)
    with crash_at_chunk(monkeypatch, 2):
        run("cached.parquet")
    chunk = tmp_path / "cached.parquet.partial" / "chunk-00000001.parquet"
    flip_byte(chunk, page_payload_positions(chunk, "ref_logprobs")[-1])

    with pytest.raises(OutputError, match=f"^{chunk}: a damaged checkpoint .*delete this file and rerun"):
        run("cached.parquet")
    assert not (tmp_path / "cached.parquet").exists()
    chunk.unlink()
    assert pq.read_table(run("cached.parquet").output).equals(expected)
