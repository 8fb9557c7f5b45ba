"""`--compile on` against eager at Gemma 4 E2B's width, on CPU: steady state, and whole (the compile included).

    python benchmarks/bench_compile.py                # one GRPO group of 8, prompts ~1,900 tokens, 5 layers
    python benchmarks/bench_compile.py --layers 10    # bench_width.py's 10-layer model

Model: bench_width.py's random Gemma 4 of E2B's text width (hidden 1536, vocabulary 262,144, head size 512 on the
full layers, per-layer inputs of 256, double-wide MLPs on the KV-shared layers, window 512, softcap 30) with
--layers layers in E2B's pattern (4 sliding to 1 full; the last half KV-shared from 10 layers on), fp32, built once
under build/bench/compile. Rows: bench_width.py's GRPO groups.

One process, one loaded model: the chunk runs eager twice (the first with the prefix tree's probe, as a run's first
chunk has it; the second steady), then the layers' norms and MLPs are compiled on a cold inductor cache (a fresh
TORCHINDUCTOR_CACHE_DIR: what a cron job on a new machine pays) and held to the model's own forward
(ReferenceModel.use_compile), and the chunk runs compiled twice the same way. Whole: the compile and the first
compiled chunk against the first eager chunk. Printed: seconds, GFLOP/s of the FLOPs the tree
needs (benchmarks/flops.py) against the fp32 matmul peak measured before and after in the same run, the graphs
dynamo compiled, and the largest |Δ logprob| between the compiled and the eager run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import bench_width  # benchmarks/bench_width.py: the model's config, its rows, its FLOPs
import flops  # benchmarks/flops.py
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "bench" / "compile"


def config(layers: int):
    # Gemma 4 needs a full layer among those that keep keys and values: the last half shares them from 10 layers on.
    return bench_width.config(layers, kv_shared=layers // 2 if layers >= 10 else 0)


def build_model(layers: int) -> Path:
    import torch
    from transformers import AutoTokenizer, Gemma4ForCausalLM

    directory = WORK / f"gemma4-e2b-width-{layers}"
    if not (directory / "config.json").exists():
        started = time.perf_counter()
        torch.manual_seed(0)
        Gemma4ForCausalLM(config(layers)).eval().save_pretrained(directory, safe_serialization=True)
        AutoTokenizer.from_pretrained(ROOT / "sample_data" / "tiny-gemma4").save_pretrained(directory)
        print(f"built the model in {time.perf_counter() - started:.0f}s", flush=True)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--groups", type=int, default=1)
    args = parser.parse_args()
    sys.path.append(str(ROOT))
    cache = tempfile.mkdtemp(prefix="klpipe-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # cold: before torch reads it
    directory = build_model(args.layers)
    import torch

    from klpipe.model import ModelSpec, ReferenceModel
    from klpipe.model.compiled import graphs_compiled
    from klpipe.precompute.logprobs import run_plan
    from klpipe.precompute.sharing import Sharing

    chunk = bench_width.rows(args.groups)
    prompts, responses = [p for p, _ in chunk], [r for _, r in chunk]
    reference = ReferenceModel.load(ModelSpec(str(directory), dtype="float32", device="cpu"))
    print(f"Gemma 4 of E2B's width, {args.layers} layers, fp32, CPU, {torch.get_num_threads()} threads; "
          f"{len(chunk)} rows, {sum(map(len, responses)):,} response tokens, tree on", flush=True)
    shape = {"m": 2048, "k": 1536, "n": 6144}  # the MLP's up-projection on a 2,048-token pass
    peak_before = flops.matmul_peak(**shape)
    segments = flops.tree(prompts, responses, sharing="auto", skips_layers=reference.prefill_skips_layers)
    kv_shared = config(args.layers).num_kv_shared_layers
    needed = bench_width.model_flops(args.layers, kv_shared).method(segments, sum(map(len, responses))).total

    def chunks(label: str) -> tuple[float, float, list]:
        """(first chunk's seconds, the tree's probe included, as a run's first chunk has it; the second's; values)."""
        sharing = Sharing(reference, "auto", 1 << 14, print)  # a fresh mode: its first tree plan runs the probe
        seconds = []
        for _ in range(2):
            started = time.perf_counter()
            values = run_plan(reference, sharing.plan(chunk, 65536, None), chunk, 1.0)
            seconds.append(time.perf_counter() - started)
        print(f"{label:<9} first chunk {seconds[0]:7.1f} s, steady {seconds[1]:7.1f} s, "
              f"{needed / seconds[1] / 1e9:6.1f} GFLOP/s", flush=True)
        return seconds[0], seconds[1], values

    eager_first, eager_s, eager_values = chunks("eager:")
    started = time.perf_counter()
    reference.use_compile("on")
    compile_s = time.perf_counter() - started
    for note in reference.notes:
        print(f"  {note}")
    if reference.compiled is None:
        sys.exit("the compiled modules were dropped at load (above): nothing to measure")
    print(f"compile and its load-time probe: {compile_s:.1f} s on a cold cache", flush=True)
    graphs_at_load = graphs_compiled()
    first_s, steady_s, compiled_values = chunks("compiled:")
    graphs_after = graphs_compiled()
    peak = max(peak_before, flops.matmul_peak(**shape))
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(compiled_values, eager_values, strict=True) if len(a))
    print(f"graphs compiled: {graphs_at_load} at load, {graphs_after - graphs_at_load} more over both chunks; "
          f"compiled {', '.join(reference.compiled.classes)}")
    print(f"fp32 matmul peak {peak / 1e9:.1f} GFLOP/s; eager at {needed / eager_s / peak:.0%} of it, compiled at "
          f"{needed / steady_s / peak:.0%}")
    print(f"steady: compiled {eager_s / steady_s:.2f}x eager; whole (compile + first chunk against eager's first "
          f"chunk): {eager_first / (compile_s + first_s):.2f}x; max |Δ logprob| compiled against eager {gap:.3g}")

if __name__ == "__main__":
    main()
