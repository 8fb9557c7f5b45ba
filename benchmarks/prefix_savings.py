"""How much model work prompt sharing saves, and how much more a common-prefix trie would save.

    python benchmarks/prefix_savings.py rollouts/2026-11-29/*.parquet   # your own rollouts (token ids)
    python benchmarks/prefix_savings.py                                  # agent-shaped synthetic days

Counts tokens fed through the model body (the last response token is never fed), per chunk of
--chunk-rows rows as klpipe batches them, three ways:

  per row         every row runs its whole prompt                      (--prefix-sharing off)
  whole prompt    rows with identical prompt ids run it once            (klpipe's --prefix-sharing auto)
  common prefix   every distinct prompt prefix runs once: the size of the prompts' token trie,
                  e.g. one system prompt and tool list shared by every group of the day

No model runs: this is arithmetic on token ids, so it takes seconds on a day of rollouts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def trie_size(prompts: list[tuple[int, ...]]) -> int:
    """Nodes of the token trie of `prompts`: each distinct prefix once."""
    ordered = sorted(set(prompts))
    total, previous = 0, ()
    for prompt in ordered:
        common = 0
        for a, b in zip(prompt, previous):
            if a != b:
                break
            common += 1
        total += len(prompt) - common
        previous = prompt
    return total


def work(prompts: list[tuple[int, ...]], response_lengths: list[int], chunk_rows: int) -> dict:
    fed_responses = sum(max(r - 1, 0) for r in response_lengths)
    per_row = sum(len(p) for p in prompts) + fed_responses
    whole = common = fed_responses
    for start in range(0, len(prompts), chunk_rows):
        chunk = prompts[start:start + chunk_rows]
        whole += sum(len(p) for p in set(chunk))
        common += trie_size(chunk)
    return {"per_row": per_row, "whole": whole, "common": common}


def synthetic_day(system: int, task: int, responses: tuple[int, int], groups: int = 256, group_size: int = 8,
                  seed: int = 0) -> tuple[list[tuple[int, ...]], list[int]]:
    """One system prompt (+ tools) for the whole day, a distinct task part per group, G responses each."""
    rng = np.random.default_rng(seed)
    shared = tuple(rng.integers(0, 1 << 20, system).tolist())
    prompts, lengths = [], []
    for _ in range(groups):
        prompt = shared + tuple(rng.integers(0, 1 << 20, int(rng.integers(task // 2, 3 * task // 2 + 1))).tolist())
        for _ in range(group_size):
            prompts.append(prompt)
            lengths.append(int(np.exp(rng.uniform(np.log(responses[0]), np.log(responses[1])))))
    return prompts, lengths


def report(label: str, counts: dict) -> None:
    per_row, whole, common = counts["per_row"], counts["whole"], counts["common"]
    print(f"{label:<46}{per_row / whole:>10.2f}x{per_row / common:>10.2f}x{1 - common / whole:>13.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rollouts", nargs="*", type=Path, help="parquet files with prompt_ids and response_ids")
    parser.add_argument("--chunk-rows", type=int, default=2048)
    args = parser.parse_args()
    print(f"{'data':<46}{'whole':>11}{'common':>11}{'further cut':>13}")
    print(f"{'':<46}{'prompt':>11}{'prefix':>11}{'of whole':>13}")
    if args.rollouts:
        import pyarrow.parquet as pq

        for path in args.rollouts:
            table = pq.read_table(path, columns=["prompt_ids", "response_ids"])
            prompts = [tuple(p) for p in table.column("prompt_ids").to_pylist()]
            lengths = [len(r) for r in table.column("response_ids").to_pylist()]
            report(path.name, work(prompts, lengths, args.chunk_rows))
        return
    for system, task, responses in [
        (150, 150, (128, 1024)),  # math GRPO: short system prompt and question, long reasoning
        (500, 1500, (16, 256)),  # retrieval: a short system prompt, long retrieved text per task
        (1500, 1000, (64, 512)),  # tool agent: system prompt + tool schemas, task + history
        (3000, 1000, (64, 512)),  # tool agent with a long tool list
        (3000, 500, (16, 256)),  # the most favourable: long shared preamble, short tasks and answers
    ]:
        prompts, lengths = synthetic_day(system, task, responses)
        label = f"system {system}, task ~{task}, responses {responses[0]}-{responses[1]}"
        report(label, work(prompts, lengths, args.chunk_rows))
    print("\nwhole prompt / common prefix: per-row work over work with that sharing (G = 8, chunks of "
          f"{args.chunk_rows} rows);\nfurther cut: the share of klpipe's current work a common-prefix trie would remove.")


if __name__ == "__main__":
    main()
