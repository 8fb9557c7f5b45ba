"""The contenders of bench_grpo.py and bench_agent.py, and how both measure them.

    klpipe `klpipe.precompute` end to end, as a user runs it (whichever klpipe is imported: the
           benchmarks put an older one first on PYTHONPATH to compare with it)
    floor  the per-row minimal-work floor: each row alone (no padding), the model body over prompt +
           response, the LM head on response positions only
    trl    TRL's GRPO reference pass (trl 1.16 GRPOTrainer._get_per_token_logps_and_entropies with
           trl.trainer.utils.add_fused_lm_head): prompts left-padded and completions right-padded over
           the whole generation batch, forwarded in batches of 8 in input order. Needs `pip install
           trl` (the benchmarks only; never a klpipe dependency).

Each contender's method needs the FLOPs flops.py counts: klpipe its tree, klpipe before the tree its
whole prompts once, every other contender each row whole; `print_flops` prints them beside the
seconds, with the machine's matmul peak.

Each returns the seconds its loop took (model loading excluded), what it fed, and the logprobs of
the first `checked` rows, which the benchmarks compare across contenders.

`measure` and `print_table` are how both benchmarks judge time. Every process pays a start-up
(imports, model load, klpipe's load-time probe) of several seconds on a small machine, which caps any
whole-process ratio on data of a few tens of seconds. So each contender also runs on a one-row file;
its steady-state time is its whole time less that start-up. Both are printed; ratios are of
steady-state times. A start-up's one row shares nothing, so under --prefix-sharing auto it would skip
the prefix tree's probe, which a run whose rows share pays once (klpipe/precompute/sharing.py): the
start-up runs with --prefix-sharing on instead, which probes before its first chunk, so that it holds
every cost a sharing run pays once per process (`startup_args`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import flops  # benchmarks/flops.py: the FLOPs each method needs
import numpy as np

TRL_BATCH = 8


VOCAB = 8192
ROOT = Path(__file__).resolve().parent.parent


def build_model(model_dir: Path, max_positions: int, seed: int = 0) -> None:
    """The benchmarks' random Llama-style model (8 layers x 256, FFN 1024, vocabulary 8,192, Gemma 4 E2B's
    body-to-head FLOPs ratio), saved once into `model_dir` with a tokenizer beside it."""
    if (model_dir / "model.safetensors").exists():
        return
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)
    # klpipe loads a tokenizer beside the model; ids are given, so any tokenizer will do.
    AutoTokenizer.from_pretrained(ROOT / "sample_data" / "tiny-llama").save_pretrained(model_dir)


def write_rollouts(path: Path, one_row: Path, ids: list[str], prompts: list[list[int]],
                   responses: list[list[int]]) -> None:
    """The rollouts, and their first row alone for measuring start-up; the full file last and renamed into
    place, so an interrupted build is redone (callers build when `path` is missing)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "id": ids,
        "prompt_ids": pa.array(prompts, pa.list_(pa.int32())),
        "response_ids": pa.array(responses, pa.list_(pa.int32())),
    })
    pq.write_table(table.slice(0, 1), one_row)
    pq.write_table(table, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)


STARTUP = "KLPIPE_BENCH_STARTUP"  # set in a start-up run's environment (measure)


def startup_sharing(sharing: str) -> str:
    """The --prefix-sharing mode of a run: `on` for auto in a start-up run, so that it pays the tree's probe."""
    return "on" if sharing == "auto" and os.environ.get(STARTUP) else sharing


def startup_args(startup: bool) -> list[str]:
    """What a `klpipe precompute` command line of a start-up run adds (for benchmarks that run the CLI)."""
    return ["--prefix-sharing", "on"] if startup else []


def threads() -> int:
    """The threads every contender (and the matmul peak) runs on: KLPIPE_BENCH_THREADS, else every core."""
    return int(os.environ.get("KLPIPE_BENCH_THREADS", os.cpu_count() or 1))


def child(run, path: Path) -> None:
    """A contender's process: run it on `path` and print its RESULT line (what run_child reads)."""
    import resource

    import torch

    torch.set_num_threads(threads())
    result = run(path)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


def load_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_grad_enabled(False)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def load_rows(path: Path) -> tuple[list[list[int]], list[list[int]]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    return table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()


def run_klpipe(model_dir: Path, rollouts: Path, sharing: str, checked: int) -> dict:
    import pyarrow.parquet as pq

    import klpipe
    from klpipe.precompute import PrecomputeConfig, precompute

    out = rollouts.parent / f"out-{os.getpid()}.parquet"
    started = time.perf_counter()
    try:
        summary = precompute(PrecomputeConfig(inputs=[rollouts], output=out, model=str(model_dir), device="cpu",
                                              dtype="float32", overwrite=True, progress="none",
                                              prefix_sharing=startup_sharing(sharing)), log=lambda m: None)
        seconds = time.perf_counter() - started - summary.load_seconds
        assert summary.rows and not summary.skipped
        first = pq.read_table(out).column("ref_logprobs").slice(0, checked).to_pylist()
    finally:
        out.unlink(missing_ok=True)
    return {"seconds": seconds, "fed_tokens": summary.forward.fed_tokens,
            "padded_tokens": summary.forward.padded_tokens, "checked": first, "klpipe": klpipe.__file__}


def run_floor(model_dir: Path, rollouts: Path, checked: int) -> dict:
    import torch

    model = load_model(model_dir)
    prompts, responses = load_rows(rollouts)
    body, head = model.model, model.lm_head
    first, fed = [], 0
    started = time.perf_counter()
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids = torch.tensor([p + r[:-1]])
        fed += ids.shape[1]
        hidden = body(input_ids=ids).last_hidden_state[0, len(p) - 1:]  # response positions only
        logits = head(hidden).float()
        values = logits.gather(1, torch.tensor(r)[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
        if i < checked:
            first.append(values.tolist())
    return {"seconds": time.perf_counter() - started, "fed_tokens": fed, "padded_tokens": fed, "checked": first}


def run_trl(model_dir: Path, rollouts: Path, checked: int) -> dict:
    """GRPOTrainer's reference pass, as trl 1.16 runs it for one generation batch."""
    import torch
    from trl.trainer.utils import add_fused_lm_head

    model = load_model(model_dir)
    add_fused_lm_head(model)
    prompts, responses = load_rows(rollouts)
    # GRPOTrainer pads the generation batch once: prompts on the left, completions on the right.
    prompt_len, completion_len = max(map(len, prompts)), max(map(len, responses))
    n = len(prompts)
    input_ids = torch.zeros(n, prompt_len + completion_len, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        input_ids[i, prompt_len - len(p):prompt_len] = torch.tensor(p)
        input_ids[i, prompt_len:prompt_len + len(r)] = torch.tensor(r)
        attention_mask[i, prompt_len - len(p):prompt_len + len(r)] = 1
    all_logps = []
    started = time.perf_counter()
    for start in range(0, n, TRL_BATCH):  # _get_per_token_logps_and_entropies, batch_size 8
        ids, mask = input_ids[start:start + TRL_BATCH], attention_mask[start:start + TRL_BATCH]
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-completion_len] = -100
        with torch.no_grad():
            outputs = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        all_logps.append(outputs.log_probs[:, -completion_len:])
    seconds = time.perf_counter() - started
    logps = torch.cat(all_logps)
    first = [logps[i, :len(responses[i])].tolist() for i in range(min(checked, n))]
    return {"seconds": seconds, "fed_tokens": int(attention_mask.sum()),
            "padded_tokens": n * (prompt_len + completion_len), "checked": first}


# -- measuring --------------------------------------------------------------------------------------


def parser(doc: str, names: list[str]) -> argparse.ArgumentParser:
    """The options both benchmarks take: which contenders, how many rounds, and a child's own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=names, help="run only these contenders")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; each contender keeps its fastest")
    parser.add_argument("--child", choices=names, help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    return parser


def run_child(script: str, name: str, path: Path, env: dict[str, str] | None = None) -> tuple[float, dict]:
    """Run `script --child NAME --path PATH` in a fresh process: (whole wall seconds, its RESULT)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    started = time.perf_counter()
    out = subprocess.run([sys.executable, script, "--child", name, "--path", str(path)],
                         capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - started
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not line:
        sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
    return wall, json.loads(line[0][7:])


def fastest(runs: dict[str, Callable[[], tuple[float, float, dict]]], repeat: int,
            before_round: Callable[[], None] = lambda: None) -> dict[str, dict]:
    """Rounds of every contender in turn (a slow spell of the machine hits them all), each run as
    `runs[name]()` -> (whole seconds, start-up seconds, result). Noise only ever adds time, so each
    contender keeps its fastest whole run (with its result) and, separately, its fastest start-up:
    steady = fastest whole - fastest start-up. The difference of one round's pair moved by a second
    either way with the start-up's own noise. `before_round` runs before each round."""
    best: dict[str, dict] = {}
    for round_ in range(repeat):
        before_round()
        for name, run in runs.items():
            whole, startup, result = run()
            print(f"  round {round_ + 1}, {name}: whole {whole:.1f}s, start-up {startup:.1f}s"
                  + (f", in-process {result['seconds']:.1f}s" if "seconds" in result else ""), flush=True)
            kept = best.get(name)
            if kept is not None:
                startup = min(startup, kept["startup"])
            if kept is None or whole < kept["whole"]:
                kept = {**result, "whole": whole}
            best[name] = {**kept, "startup": startup, "steady": kept["whole"] - startup}
    return best


def print_steady(best: dict[str, dict], label_width: int = 10) -> None:
    """The fastest whole and start-up of each contender, and their difference."""
    print(f"{'contender':<{label_width}} {'whole s':>8} {'start-up s':>10} {'steady s':>9}")
    for name, r in best.items():
        print(f"{name:<{label_width}} {r['whole']:>8.2f} {r['startup']:>10.2f} {r['steady']:>9.2f}")


def measure(script: str, names: list[str], path: Path, one_row: Path, repeat: int,
            env_for=lambda name: None) -> dict[str, dict]:
    """`fastest` over the contenders `names` of `script`, each in its own process on `path` and on the
    one-row `one_row`. Checks that every contender's logprobs agree with the floor's."""
    PEAKS.clear()  # this measurement's own

    def run(name):
        startup, _ = run_child(script, name, one_row, {**(env_for(name) or {}), STARTUP: "1"})
        whole, result = run_child(script, name, path, env_for(name))
        return whole, startup, result

    best = fastest({name: (lambda name=name: run(name)) for name in names}, repeat, before_round=note_peak)
    note_peak()  # and after the last round
    reference = best.get("floor") or next(iter(best.values()))
    for name, result in best.items():
        gap = max(float(np.max(np.abs(np.subtract(a, b))))
                  for a, b in zip(result["checked"], reference["checked"], strict=True))
        assert gap < 1e-3, f"{name} disagrees with the reference contender's logprobs by {gap:.3g}"
    return best


def print_table(best: dict[str, dict], labels: dict[str, str], targets: dict[str, float] | None = None) -> None:
    """Whole, start-up and steady seconds, tokens and memory per contender; then (a)'s ratios."""
    print(f"\n{'contender':<34}{'whole s':>9}{'start-up s':>11}{'steady s':>10}{'tokens fed':>12}"
          f"{'padded':>11}{'peak RSS MiB':>14}")
    for name, r in best.items():
        print(f"{labels[name]:<34}{r['whole']:>9.1f}{r['startup']:>11.1f}{r['steady']:>10.1f}"
              f"{r['fed_tokens']:>12,}{r['padded_tokens']:>11,}{r['peak_rss_mib']:>14,.0f}")
    a = best.get("klpipe")
    if not a:
        return
    print()
    for other, o in best.items():
        if other != "klpipe":
            target = (targets or {}).get(other)
            goal = f"   (target >= {target:g}x steady)" if target else ""
            print(f"(a) vs {labels[other][:3]}: steady {o['steady'] / a['steady']:.2f}x, "
                  f"whole process {o['whole'] / a['whole']:.2f}x, "
                  f"tokens fed {o['fed_tokens'] / a['fed_tokens']:.2f}x{goal}")


def methods(best: dict[str, dict], model_dir: Path, prompts: list[list[int]], responses: list[list[int]]) -> dict:
    """The FLOPs each contender's method needs (see flops.py); checks that klpipe fed what its count says."""
    model = flops.ModelFlops.from_dir(model_dir)
    scored = sum(map(len, responses))
    segments = {"klpipe": flops.tree(prompts, responses), "main": flops.whole_prompt(prompts, responses)}
    every_row = flops.per_row(prompts, responses)
    for name in ("klpipe", "off", "klpipe-off"):
        if name in best:
            fed = flops.fed_tokens(segments.get(name, every_row))
            assert best[name]["fed_tokens"] == fed, f"{name} fed {best[name]['fed_tokens']:,} tokens, the count {fed:,}"
    return {name: model.method(segments.get(name, every_row), scored) for name in best}


# The fp32 matmul peak, measured before every round and after the last: the machine is shared, and a
# busy neighbour only ever lowers a measurement, so the table takes the highest.
PEAK_SHAPE = (2048, 256, 1024)  # a CPU pass's tokens x the benchmark model's MLP up-projection
PEAKS: list[float] = []


def note_peak() -> None:
    import torch

    torch.set_num_threads(threads())
    PEAKS.append(flops.matmul_peak(*PEAK_SHAPE))


def print_flops(best: dict[str, dict], labels: dict[str, str], model_dir: Path, prompts, responses, shape: str) -> None:
    m, k, n = PEAK_SHAPE
    peak = (max(PEAKS), (f"{m} x {k} @ {k} x {n}, highest of {len(PEAKS)} measurements: "
                         f"{', '.join(f'{p / 1e9:.0f}' for p in PEAKS)}"))
    flops.print_flops_table(best, labels, methods(best, model_dir, prompts, responses), peak, shape=shape)
