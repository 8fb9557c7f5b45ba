"""Sharding: who owns which rows, sharded runs equal one process, and checks on shard directories."""

import itertools
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from klpipe.errors import InputError, ProvenanceError
from klpipe.model.loading import local_device
from klpipe.precompute import PrecomputeConfig, precompute
from klpipe.score.input import expand_cache_inputs
from klpipe.sharding import Shard, is_complete, marker_path, parse_part_name, resolve_shard
from tests.helpers import ROLLOUTS, TINY_LLAMA, agent_rollouts


@given(st.integers(0, 5000), st.integers(1, 64), st.integers(1, 300))
def test_shards_tile_the_rows_on_chunk_boundaries(total, count, chunk_rows):
    ranges = [Shard(i, count).rows(total, chunk_rows) for i in range(count)]
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    for (_, stop), (start, _) in itertools.pairwise(ranges):
        assert stop == start  # contiguous, in shard order
    for start, _ in ranges:
        assert start % chunk_rows == 0 or start == total  # a single-process run cuts a chunk here too
    sizes = [stop - start for start, stop in ranges]
    assert max(sizes) - min(sizes) <= chunk_rows  # balanced to one chunk


def test_flags_win_over_the_environment():
    env = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4", "RANK": "1", "WORLD_SIZE": "2"}
    assert resolve_shard(0, 2, env) == Shard(0, 2)


def test_slurm_array_with_offset_and_step():
    env = {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_STEP": "2",
           "SLURM_ARRAY_TASK_COUNT": "5"}  # --array=1-9:2 -> tasks 1,3,5,7,9
    assert resolve_shard(None, None, env) == Shard(3, 5)
    assert resolve_shard(None, None, {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "4",
                                      "SLURM_ARRAY_TASK_COUNT": "4"}) == Shard(1, 4)


def test_torchrun_variables_and_no_sharding_without_them():
    assert resolve_shard(None, None, {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == Shard(1, 2)
    assert resolve_shard(None, None, {}) is None
    assert local_device("cpu", {"LOCAL_RANK": "1"}) == "cpu"


def test_bad_shard_settings():
    with pytest.raises(InputError, match=r"^shard index 4 is outside 0\.\.3 \(from SLURM_ARRAY_TASK_\*\)$"):
        resolve_shard(None, None, {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4"})
    with pytest.raises(InputError, match=r"^--shard-index and --num-shards go together$"):
        resolve_shard(1, None, {})
    with pytest.raises(InputError, match=r"^environment variable RANK='x' is not an integer$"):
        resolve_shard(None, None, {"RANK": "x", "WORLD_SIZE": "2"})


def run(output, shard=None, inputs=(ROLLOUTS,), chunk_rows=5, **settings):
    config = PrecomputeConfig(inputs=list(inputs), output=output, model=str(TINY_LLAMA), device="cpu",
                              progress="none", shard=shard, chunk_rows=chunk_rows, **settings)
    return precompute(config, log=lambda m: None)


def merged_parts(directory) -> tuple[list, pa.Table]:
    """(the parts of a sharded output directory in shard order, their rows concatenated, metadata aside)."""
    parts, _ = expand_cache_inputs([directory])
    return parts, pa.concat_tables([pq.read_table(p).replace_schema_metadata(None) for p in parts])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    path = tmp_path_factory.mktemp("single") / "cached.parquet"
    run(path)
    return pq.read_table(path).replace_schema_metadata(None)


def test_sharded_parts_through_the_prefix_tree_concatenate_to_the_single_process_output(tmp_path):
    agent = agent_rollouts(tmp_path / "agent.parquet")
    whole = run(tmp_path / "single.parquet", inputs=[agent], chunk_rows=13)
    assert whole.forward.fed_tokens < whole.forward.per_row_tokens / 2  # the tree did the work
    for index in range(3):
        run(tmp_path / "out", Shard(index, 3), inputs=[agent], chunk_rows=13)
    _, merged = merged_parts(tmp_path / "out")
    assert merged.equals(pq.read_table(whole.output).replace_schema_metadata(None))


@pytest.mark.parametrize("count", [2, 3])
def test_sharded_parts_concatenate_to_the_single_process_output(tmp_path, single, count):
    for index in range(count):
        run(tmp_path / "out", Shard(index, count))
    parts, merged = merged_parts(tmp_path / "out")
    assert [p.name for p in parts] == [f"part-{i:05d}-of-{count:05d}.parquet" for i in range(count)]
    assert merged.equals(single)  # bit-identical: shards cut where the single run cuts chunks
    marker = json.loads((tmp_path / "out" / f"part-00000-of-{count:05d}.done").read_text())
    assert marker["rows"] == pq.read_metadata(parts[0]).num_rows


def test_part_names_and_markers_have_one_owner(tmp_path):
    part = Shard(3, 12).part_path(tmp_path)
    assert part.name == "part-00003-of-00012.parquet" and parse_part_name(part.name) == Shard(3, 12)
    assert parse_part_name("part-3-of-12.parquet") == Shard(3, 12)
    assert parse_part_name("part-00003-of-00012.done") is None and parse_part_name("cached.parquet") is None
    assert marker_path(part) == tmp_path / "part-00003-of-00012.done"


def test_rerun_of_a_finished_shard_is_a_noop(tmp_path):
    first = run(tmp_path / "out", Shard(1, 2))
    stamp = first.output.stat().st_mtime_ns
    assert run(tmp_path / "out", Shard(1, 2)).skipped
    assert first.output.stat().st_mtime_ns == stamp


def test_incomplete_and_mixed_shard_directories_are_refused(tmp_path):
    out = tmp_path / "out"
    run(out, Shard(0, 3))
    run(out, Shard(2, 3))
    with pytest.raises(InputError, match=r"^.*/out: incomplete: missing shard 1 of 3; rerun those shards"):
        expand_cache_inputs([out])
    run(out, Shard(1, 3))
    assert len(expand_cache_inputs([out])[0]) == 3
    (out / "part-00001-of-00003.done").unlink()
    with pytest.raises(InputError, match="incomplete: no completion marker for shard 1 of 3"):
        expand_cache_inputs([out])
    run(out, Shard(1, 3))
    # A marker that does not describe its part: left by another run, or the part replaced since.
    marker = out / "part-00002-of-00003.done"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "rows": 99}))
    with pytest.raises(InputError) as excinfo:
        expand_cache_inputs([out])
    assert str(excinfo.value) == (f"{out}: incomplete: a completion marker that does not match its part for shard 2 "
                                  "of 3; rerun those shards of klpipe precompute first")
    assert not is_complete(out / "part-00002-of-00003.parquet")
    run(out, Shard(2, 3))  # not complete, so the rerun rewrites the part and its marker
    assert is_complete(out / "part-00002-of-00003.parquet")

    run(out, Shard(0, 2))  # a stale part from a 2-shard run of the same inputs
    with pytest.raises(ProvenanceError, match=r"holds parts of runs with different shard counts \(2, 3\)"):
        expand_cache_inputs([out])
    for stale in out.glob("*-of-00002.*"):
        stale.unlink()

    shutil.copy(out / "part-00002-of-00003.parquet", tmp_path / "keep.parquet")
    run(out, Shard(2, 3), temperature=2.0, overwrite=True)  # one shard made with other settings
    with pytest.raises(ProvenanceError, match="caches disagree on temperature"):
        expand_cache_inputs([out])
