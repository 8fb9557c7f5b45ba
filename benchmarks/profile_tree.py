"""Where a precompute pass's time goes, tree on and off: linear layers, attention, the context's copies, the head.

    python benchmarks/profile_tree.py build/bench/grpo/llama-8k build/bench/grpo/rollouts-24x8.parquet
    python benchmarks/profile_tree.py MODEL ROLLOUTS --sharing auto   # one mode only

Runs klpipe's own chunk_logprobs on the rows (one chunk, the CPU budgets), in this process, with
wall-clock timers around the parts (each timer's time includes what it calls; the parts do not nest
except `attention`, which holds the repeat of GQA's keys and values and the mask's use):

    linear     every nn.Linear of the body (q, k, v, o, MLP)
    attention  the attention function: transformers' sdpa (repeat_kv + scaled_dot_product_attention), or in a
               tree pass klpipe's cascade (model/attention/cascade.py)
    gather     tree only: a pass's context keys and values copied from the kept nodes, for layers that read
               them gathered (sliding windows, calls the cascade does not take; model/attention/tree.py)
    cat        tree only: context + the pass's new keys and values, per such layer (ContextLayer.whole)
    mask       transformers building the 4D attention masks
    head       the LM head on the needed positions (model/head.py)
Within the cascade's attention, its calls of torch's CPU flash kernel are timed too: `own` (each row's
queries over the pass's own keys, causal; FLOPs of the causal half) and `context` (unmasked, over a
part of the rows' paths). They show which of the two runs below the linear layers' rate.
Beside each part: the FLOPs that the pass really computed for it (padding and re-fed tokens included),
so GFLOP/s per part says which part runs below the machine's matmul rate, and GFLOP/s of the FLOPs the
method needs (flops.py).

With both modes (the default), it then prices the tree's needed work at `off`'s own rate for each
part (linear, attention and head per needed FLOP, the rest per token fed). The FLOP limit counts a
FLOP of attention as a FLOP of a matmul; where attention runs slower per FLOP than the linear layers,
in both modes alike, a method that saves more linear work than attention work cannot reach it, and
this line says how far off's own rates would take the tree.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import flops  # benchmarks/flops.py
import numpy as np

TIMES: dict[str, float] = defaultdict(float)
WORK: dict[str, float] = defaultdict(float)  # FLOPs computed, padding included


@contextmanager
def timed(part: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        TIMES[part] += time.perf_counter() - started


def instrument() -> None:
    """Timers around the parts (see the module's docstring); each counts the FLOPs it computes."""
    import torch

    from klpipe.model import head
    from klpipe.model.attention import context_cache

    linear_forward = torch.nn.Linear.forward

    def linear(self, x):
        with timed("linear"):
            WORK["linear"] += 2.0 * x.numel() / x.shape[-1] * self.in_features * self.out_features
            return linear_forward(self, x)

    torch.nn.Linear.forward = linear
    instrument_attention()
    gather = context_cache._gather_context

    def gather_context(*args, **kwargs):
        with timed("gather"):
            return gather(*args, **kwargs)

    context_cache._gather_context = gather_context
    whole = context_cache.ContextLayer.whole

    def context_whole(self, *args, **kwargs):
        with timed("cat"):
            return whole(self, *args, **kwargs)

    context_cache.ContextLayer.whole = context_whole
    logprobs = head.LMHead.logprobs

    def head_logprobs(self, selected, *args, **kwargs):
        with timed("head"):
            WORK["head"] += 2.0 * selected.shape[0] * selected.shape[1] * self.vocab_size
            return logprobs(self, selected, *args, **kwargs)

    head.LMHead.logprobs = head_logprobs


def instrument_attention() -> None:
    """Timers around attention: transformers' sdpa, the cascade and its flash calls, and the masks."""
    import transformers.masking_utils as masking
    from transformers.integrations import sdpa_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from klpipe.model.attention import cascade

    sdpa = sdpa_attention.sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        with timed("attention"):
            b, h, t, d = query.shape
            WORK["attention"] += 4.0 * b * h * t * key.shape[2] * d
            return sdpa(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = attention
    in_place = ALL_ATTENTION_FUNCTIONS[cascade.NAME]

    def cascade_attention(module, query, key, value, attention_mask, **kwargs):
        with timed("attention"):
            flashed = WORK["own"] + WORK["context"]
            out = in_place(module, query, key, value, attention_mask, **kwargs)
            flashed = WORK["own"] + WORK["context"] - flashed  # the cascade's own and context parts, if it ran
            b, h, t, d = query.shape
            WORK["attention"] += flashed or 4.0 * b * h * t * key.shape[2] * d
            return out

    ALL_ATTENTION_FUNCTIONS[cascade.NAME] = cascade_attention
    flash = cascade._flash

    def cascade_flash(query, key, value, dropout, causal, **kwargs):  # the cascade's own and context calls
        part = "own" if causal else "context"
        with timed(part):
            b, h, t, d = query.shape
            WORK[part] += (2.0 if causal else 4.0) * b * h * t * key.shape[2] * d
            return flash(query, key, value, dropout, causal, **kwargs)

    cascade._flash = cascade_flash
    for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
        original = getattr(masking, name)

        def mask(*args, _original=original, **kwargs):
            with timed("mask"):
                return _original(*args, **kwargs)

        setattr(masking, name, mask)
        import transformers.models.llama.modeling_llama as llama

        if hasattr(llama, name):
            setattr(llama, name, mask)


PARTS = ("linear", "attention", "gather", "cat", "mask", "head")


def profile(model, rows, sharing: str, needed) -> dict:
    """One mode's pass over the rows, with `needed` its method's FLOPs (flops.ModelFlops.method): per part
    (seconds, FLOPs needed, FLOPs done), `other` as (seconds, tokens fed with padding, 0), the whole, and
    what `report` prints."""
    from klpipe.precompute.logprobs import ForwardStats, chunk_logprobs

    cache_tokens = (2048 << 20) // model.kv_bytes_per_token
    chunk_logprobs(model, rows[:16], 2048, 1.0, sharing, ForwardStats(), max_cache_tokens=cache_tokens)  # warm
    TIMES.clear()
    WORK.clear()
    stats = ForwardStats()
    started = time.perf_counter()
    chunk_logprobs(model, rows, 2048, 1.0, sharing, stats, max_cache_tokens=cache_tokens)
    whole = time.perf_counter() - started
    needs = {"linear": needed.linear, "attention": needed.attention, "head": needed.head}
    parts = {part: (TIMES.get(part, 0.0), needs.get(part, 0.0), WORK.get(part, 0.0)) for part in PARTS}
    parts["other"] = (whole - sum(TIMES[p] for p in PARTS), stats.padded_tokens, 0.0)
    return {"sharing": sharing, "parts": parts, "whole": whole, "needed": needed.total, "fed": stats.fed_tokens,
            "padded": stats.padded_tokens, "peak": flops.matmul_peak(),
            "kernel": {part: (TIMES[part], WORK[part]) for part in ("own", "context") if part in TIMES}}


def report(run: dict) -> None:
    whole = run["whole"]
    print(f"\n--prefix-sharing {run['sharing']}: {whole:.2f}s, fed {run['fed']:,} tokens ({run['padded']:,} with "
          f"padding and re-fed), needed {run['needed'] / 1e9:.1f} GFLOP ({run['needed'] / whole / 1e9:.0f} GFLOP/s); "
          f"matmul peak {run['peak'] / 1e9:.0f} GFLOP/s after it")
    print(f"{'part':<11}{'seconds':>9}{'share':>8}{'GFLOP done':>12}{'GFLOP needed':>14}{'GFLOP/s done':>14}"
          f"{'GFLOP/s needed':>16}")
    for part in PARTS:
        seconds, need, done = run["parts"][part]
        print(f"{part:<11}{seconds:>9.2f}{seconds / whole:>8.0%}{done / 1e9:>12.1f}{need / 1e9:>14.1f}"
              f"{(done / seconds / 1e9) if done and seconds else 0:>14.0f}"
              f"{(need / seconds / 1e9) if need and seconds else 0:>16.0f}")
    other = run["parts"]["other"][0]
    print(f"{'other':<11}{other:>9.2f}{other / whole:>8.0%}   (norms, RoPE, MLP activations, planning, Python)")
    for part, what in (("own", "causal, the pass's own keys"), ("context", "unmasked, a part of the rows' paths")):
        seconds, done = run["kernel"].get(part, (0.0, 0.0))
        if seconds:
            print(f"  of attention, torch's flash kernel {what}: {seconds:.2f}s, {done / 1e9:.1f} GFLOP done, "
                  f"{done / seconds / 1e9:.0f} GFLOP/s")


def at_rates(tree: dict, off: dict) -> None:
    """The tree's work at `off`'s own rate for each part (needed FLOPs per second; `other` per token fed):
    what the FLOP limit would be if the tree did each part exactly as fast as rows run whole."""
    seconds = 0.0
    for part in ("linear", "attention", "head", "other"):
        off_seconds, off_work, _ = off["parts"][part]
        tree_work = tree["parts"][part][1]
        if off_work:
            seconds += tree_work * off_seconds / off_work
    gathered = sum(tree["parts"][p][0] for p in ("gather", "cat", "mask"))  # work off does not do at all
    flop_ratio = off["needed"] / tree["needed"]
    print(f"\nthe tree at off's rates per part: {seconds:.2f}s (+{gathered:.2f}s of copies and masks off has none "
          f"of), {off['whole'] / seconds:.2f}x off where the FLOP ratio is {flop_ratio:.2f}x: "
          f"{off['whole'] / seconds / flop_ratio:.0%} of the FLOP limit is what off's own rates allow")
    print(f"the tree as run: {tree['whole']:.2f}s, {off['whole'] / tree['whole']:.2f}x off: "
          f"{off['whole'] / tree['whole'] / flop_ratio:.0%} of the FLOP limit")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("rollouts", type=Path)
    parser.add_argument("--sharing", choices=["auto", "off"], nargs="+", default=["auto", "off"])
    parser.add_argument("--repeat", type=int, default=3, help="rounds; each mode keeps its fastest")
    args = parser.parse_args()
    import pyarrow.parquet as pq
    import torch

    torch.set_num_threads(int(os.environ.get("KLPIPE_BENCH_THREADS", os.cpu_count() or 1)))
    from klpipe.model import ModelSpec, ReferenceModel

    table = pq.read_table(args.rollouts, columns=["prompt_ids", "response_ids"])
    prompts, responses = table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()
    rows = [(np.asarray(p, dtype=np.int64), np.asarray(r, dtype=np.int64))
            for p, r in zip(prompts, responses, strict=True)]
    model = ReferenceModel.load(ModelSpec(str(args.model_dir), device="cpu", dtype="float32"))
    model.use_cascade()  # as precompute installs it for a tree (precompute/sharing.py)
    instrument()
    print(f"{args.rollouts.name}, {torch.get_num_threads()} threads, the fastest of {args.repeat} round(s) per mode")
    counted = flops.ModelFlops.from_dir(args.model_dir)
    needed = {sharing: counted.method(flops.tree(prompts, responses, sharing=sharing), sum(map(len, responses)))
              for sharing in args.sharing}  # the same in every round
    fastest: dict[str, dict] = {}
    for round_ in range(args.repeat):  # the modes alternate, so a slow spell of the machine hits both
        for sharing in args.sharing if round_ % 2 == 0 else args.sharing[::-1]:
            run = profile(model, rows, sharing, needed[sharing])
            print(f"  round {round_ + 1}, {sharing}: {run['whole']:.2f}s", flush=True)
            if sharing not in fastest or run["whole"] < fastest[sharing]["whole"]:
                fastest[sharing] = run
    for sharing in args.sharing:
        report(fastest[sharing])
    if set(fastest) == {"auto", "off"}:
        at_rates(fastest["auto"], fastest["off"])


if __name__ == "__main__":
    main()
