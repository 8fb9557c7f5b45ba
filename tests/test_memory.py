"""Memory stays bounded whatever the input's size: each stage, as a fresh process, on a 1× and a larger input.

The rows carry a 20 kB pass-through column and a handful of tokens, so input bytes dominate
everything else a run holds. A reader that keeps what it has read (pyarrow's pre-buffering did),
or a record batch sized by tokens alone, makes the larger run's peak grow with its input.

The precompute inputs are incompressible, because pre-buffering holds the compressed column chunks.
The score inputs compress 7:1, so 500 MB in memory cost 74 MB on disk: the smaller input must
already fill score's pipeline (a few 16 MB record batches and 32 MB output row groups), or the
comparison would measure that ramp rather than growth with the input.
"""

import os

import pytest

from tests.helpers import TINY_LLAMA, WIDE, peak_rss_mib, write_wide_rows

GROWTH = 1.3  # score: the larger run's peak RSS may be at most this multiple of the smaller run's
FLAT = 1.1  # precompute: once its pipeline is full (three chunks), its peak RSS is flat


@pytest.mark.slow
def test_precompute_peak_memory_is_flat_once_three_chunks_are_read(tmp_path):
    # At the default --chunk-rows (2,048 rows, 41 MB a chunk here): 1× is three chunks (123 MB), which already
    # fills the pipeline (one chunk read ahead, one scored, one written); 8× is 24 chunks (983 MB). A pipeline
    # that holds more chunks than a 3-chunk input has, or a merge or a write that holds more than a chunk, makes
    # the larger run's peak higher (a reader one chunk deeper than asked, a writer keeping its last chunk, and
    # 20 MB parquet pages: 1.24× here).
    rollouts = [write_wide_rows(tmp_path / f"rollouts-{n}.parquet", n) for n in (6_144, 49_152)]
    try:
        small, large = (peak_rss_mib([["precompute", "-m", TINY_LLAMA, path, "-o", f"{path}.out", "--device", "cpu",
                                        "--progress", "none"]])[0]
                        for path in rollouts)  # one at a time: nothing else competes for the cores
    finally:
        for path in tmp_path.iterdir():  # 2 GB: not worth keeping in pytest's retained tmp dirs
            os.remove(path)
    print(f"precompute peak RSS: {small:.0f} MiB at 6,144 rows, {large:.0f} MiB at 49,152")
    assert large <= FLAT * small, f"precompute peak RSS {small:.0f} MiB at 123 MB of input, {large:.0f} MiB at 983 MB"


@pytest.mark.slow
def test_score_peak_memory_does_not_grow_with_the_input(tmp_path):
    # score: 25k and 100k rows (4×), 0.5 and 2 GB in memory.
    caches = [write_wide_rows(tmp_path / f"cache-{n}.parquet", n, random_bytes=WIDE // 10, ref_logprobs=True)
              for n in (25_000, 100_000)]
    commands = [["score", path, "-o", f"{path}.out"] for path in caches]
    try:
        score_small, score_large = peak_rss_mib(commands)
    finally:
        for path in tmp_path.iterdir():  # 1.2 GB: not worth keeping in pytest's retained tmp dirs
            os.remove(path)
    print(f"score peak RSS: {score_small:.0f} → {score_large:.0f} MiB")
    assert score_large <= GROWTH * score_small, (
        f"score peak RSS {score_small:.0f} MiB at 25k rows, {score_large:.0f} MiB at 100k rows")
