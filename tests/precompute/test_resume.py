"""kill -9 in the middle of a run, rerun the same command: same output as an uninterrupted run."""

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from klpipe.precompute import PrecomputeConfig, precompute
from tests.helpers import TINY_GEMMA, kill_9_after_chunks, repeated_rollouts, run_cli


def many_rollouts(tmp_path: Path) -> Path:
    path = tmp_path / "rollouts.parquet"
    pq.write_table(repeated_rollouts(40), path, row_group_size=100)
    return path


@pytest.mark.slow
def test_kill_9_then_rerun_resumes_to_identical_output(tmp_path):
    source = many_rollouts(tmp_path)
    out = tmp_path / "cached.parquet"
    work = tmp_path / "cached.parquet.partial"
    args = ["precompute", "-m", str(TINY_GEMMA), str(source), "-o", str(out), "--chunk-rows", "8",
            "--device", "cpu", "--progress", "none"]
    finished = kill_9_after_chunks(args, work, "chunk-*.parquet")
    assert not out.exists()
    assert 3 <= finished < 240, finished

    rerun = run_cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert f"resuming: {finished} of 240 chunks already done" in rerun.stderr
    assert not work.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cached.parquet", "rollouts.parquet"]

    uninterrupted = precompute(PrecomputeConfig(inputs=[source], output=tmp_path / "ref" / "cached.parquet",
                                                model=str(TINY_GEMMA), device="cpu", chunk_rows=8, progress="none"),
                               log=lambda m: None)
    expected = pq.read_table(uninterrupted.output)
    got = pq.read_table(out)
    assert got.column("id").to_pylist() == [f"r{i}" for i in range(1920)]
    assert got.equals(expected)  # bit-identical, schema metadata aside
