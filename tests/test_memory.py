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

GROWTH = 1.3  # the larger run's peak RSS may be at most this multiple of the smaller run's


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_input(tmp_path):
    # precompute: 30 MB and 240 MB (8×); --chunk-rows 256 keeps its own pipeline (a few 5 MB chunks) small.
    rollouts = [write_wide_rows(tmp_path / f"rollouts-{n}.parquet", n) for n in (1_500, 12_000)]
    # score: 25k and 100k rows (4×), 0.5 and 2 GB in memory.
    caches = [write_wide_rows(tmp_path / f"cache-{n}.parquet", n, random_bytes=WIDE // 10, ref_logprobs=True)
              for n in (25_000, 100_000)]
    commands = [["precompute", "-m", TINY_LLAMA, path, "-o", f"{path}.out", "--chunk-rows", "256",
                 "--device", "cpu", "--progress", "none"] for path in rollouts]
    commands += [["score", path, "-o", f"{path}.out"] for path in caches]
    try:
        precompute_small, precompute_large, score_small, score_large = peak_rss_mib(commands)
    finally:
        for path in tmp_path.iterdir():  # 1.4 GB: not worth keeping in pytest's retained tmp dirs
            os.remove(path)
    print(f"peak RSS: precompute {precompute_small:.0f} → {precompute_large:.0f} MiB, "
          f"score {score_small:.0f} → {score_large:.0f} MiB")
    assert precompute_large <= GROWTH * precompute_small, (
        f"precompute peak RSS {precompute_small:.0f} MiB at 30 MB of input, {precompute_large:.0f} MiB at 240 MB")
    assert score_large <= GROWTH * score_small, (
        f"score peak RSS {score_small:.0f} MiB at 25k rows, {score_large:.0f} MiB at 100k rows")
