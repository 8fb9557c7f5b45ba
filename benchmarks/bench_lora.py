"""What an adapter `--policy` holds in memory: one copy of the base weights, against a merged policy's two.

A LoRA run's checkpoint is a PEFT adapter folder over the reference. Three runs of `klpipe precompute`, each its
own process, on the same rows and a base model big enough for its weights to dominate (a random Llama, ~320 MB in
fp32); peak RSS from getrusage (tests/helpers.py `peak_rss_mib`, as bench_memory.py measures):

    reference alone   -m BASE
    adapter policy    -m BASE --policy ADAPTER   (rank 16 on attention and MLP: what TRL and verl train)
    merged policy     -m BASE --policy MERGED    (the same adapter merged by PEFT into a full copy)

    python benchmarks/bench_lora.py [--repeat 3]

Each contender runs `--repeat` times, in turn; the median peak counts (a run's peak moves by tens of MiB on a busy
machine).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test suite's RSS wrapper, so tests and benchmarks measure alike
from tests.helpers import peak_rss_mib

WORK = ROOT / "build" / "bench_lora"
VOCAB, ROWS, RANK = 16000, 16, 16


def build() -> tuple[Path, Path, Path, Path]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    base, adapter, merged, rows = WORK / "base", WORK / "adapter", WORK / "merged", WORK / "rows.parquet"
    if not (merged / "model.safetensors").exists():
        import torch
        from peft import LoraConfig, PeftModel, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                             num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=False)
        LlamaForCausalLM(config).save_pretrained(base)
        tokenizer = AutoTokenizer.from_pretrained(ROOT / "sample_data" / "tiny-llama")
        tokenizer.save_pretrained(base)
        lora = LoraConfig(r=RANK, lora_alpha=2 * RANK, task_type="CAUSAL_LM",
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora)
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(std=0.01)
        peft_model.save_pretrained(adapter)
        full = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).merge_and_unload()
        full.save_pretrained(merged)
        tokenizer.save_pretrained(merged)
    rng = np.random.default_rng(0)
    table = pa.table({"prompt_ids": [rng.integers(3, 512, 64).tolist() for _ in range(ROWS)],
                      "response_ids": [rng.integers(3, 512, 64).tolist() for _ in range(ROWS)]})
    pq.write_table(table, rows)
    return base, adapter, merged, rows


def size_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**20


def run(base: Path, rows: Path, name: str, extra: list) -> tuple[float, float]:
    """(peak RSS MiB, wall seconds) of one `klpipe precompute` process."""
    out = WORK / f"{name.replace(' ', '-')}.parquet"
    out.unlink(missing_ok=True)
    shutil.rmtree(out.with_name(out.name + ".partial"), ignore_errors=True)
    started = time.perf_counter()
    peak = peak_rss_mib([["precompute", "-m", base, rows, "-o", out, "--device", "cpu", "--progress", "none", *extra]])
    return peak[0], time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per contender, taken in turn; the median counts")
    args = parser.parse_args()
    base, adapter, merged, rows = build()
    contenders = {"reference alone": [], "adapter policy": ["--policy", adapter], "merged policy": ["--policy", merged]}
    runs = {name: [] for name in contenders}
    for _ in range(args.repeat):
        for name, extra in contenders.items():
            runs[name].append(run(base, rows, name, extra))
    print(f"base {size_mib(base):.0f} MiB of fp32 weights, adapter {size_mib(adapter):.1f} MiB (rank {RANK}); "
          f"{ROWS} rows of 64 + 64 tokens; median of {args.repeat}, each run its own process, one thread")
    print(f"| {'contender':16} | {'peak RSS MiB':>12} | {'runs':>17} | {'vs reference alone':>18} | {'seconds':>7} |")
    peaks = {name: statistics.median(peak for peak, _ in found) for name, found in runs.items()}
    for name, found in runs.items():
        spread = "-".join(f"{value:.0f}" for value in (min(p for p, _ in found), max(p for p, _ in found)))
        seconds = statistics.median(s for _, s in found)
        print(f"| {name:16} | {peaks[name]:12.0f} | {spread:>17} | {peaks[name] / peaks['reference alone']:18.0%} | "
              f"{seconds:7.1f} |")
    print(f"over reference alone: adapter policy {peaks['adapter policy'] - peaks['reference alone']:+.0f} MiB, "
          f"merged policy {peaks['merged policy'] - peaks['reference alone']:+.0f} MiB")


if __name__ == "__main__":
    main()
