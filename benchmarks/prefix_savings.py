"""What the prefix tree will feed on your rollouts, against running every row whole: arithmetic, no model.

    python benchmarks/prefix_savings.py rollouts/2026-11-29/*.parquet   # your own rollouts (token ids)
    python benchmarks/prefix_savings.py --chunk-rows 4096 day.parquet   # how far a larger chunk reaches
    python benchmarks/prefix_savings.py                                  # agent-shaped synthetic days

Counts the tokens fed through the model body (the last response token is never fed), per chunk of
--chunk-rows rows as `klpipe precompute` takes them, three ways:

  per row        every row runs whole                                   (--prefix-sharing off)
  whole prompt   rows with identical prompt ids run it once              (klpipe before the prefix tree)
  prefix tree    every distinct prefix worth sharing runs once           (--prefix-sharing auto)

The tree is klpipe's own (klpipe.precompute.logprobs.pruned_tree, as precompute builds it), so the
last column is what a run will feed. Time falls by less than tokens: a token of the tree attends to
the whole context it continues (see docs/operations.md, Sizing). It takes seconds on a day of rollouts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from klpipe.precompute.logprobs import pruned_tree


def work(prompts: list[list[int]], responses: list[list[int]], chunk_rows: int) -> dict:
    """Tokens fed: {per_row, whole_prompt, tree}, summed over chunks."""
    counts = {"per_row": 0, "whole_prompt": 0, "tree": 0}
    for start in range(0, len(prompts), chunk_rows):
        chunk = [(p, r) for p, r in zip(prompts[start:start + chunk_rows], responses[start:start + chunk_rows],
                                        strict=True) if r]
        fed = [np.array(p + r[:-1], dtype=np.int64) for p, r in chunk]
        counts["per_row"] += sum(len(f) for f in fed)
        counts["whole_prompt"] += sum(len(r) - 1 for _, r in chunk) + sum(len(p) for p in {tuple(p) for p, _ in chunk})
        tree = pruned_tree(chunk, fed, np.arange(len(chunk)))
        counts["tree"] += int((tree.end - tree.start).sum())
    return counts


def synthetic_day(system: int, task: int, responses: tuple[int, int], groups: int = 256, group_size: int = 8,
                  seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """One system prompt (+ tools) for the whole day, a distinct task part per group, G responses each."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 1 << 20, system).tolist()
    prompts, answers = [], []
    for _ in range(groups):
        prompt = shared + rng.integers(0, 1 << 20, int(rng.integers(task // 2, 3 * task // 2 + 1))).tolist()
        for _ in range(group_size):
            prompts.append(prompt)
            length = int(np.exp(rng.uniform(np.log(responses[0]), np.log(responses[1]))))
            answers.append(rng.integers(0, 1 << 20, length).tolist())
    return prompts, answers


def report(label: str, counts: dict) -> None:
    per_row = counts["per_row"]
    print(f"{label:<46}{per_row:>13,}{per_row / counts['whole_prompt']:>10.2f}x{per_row / counts['tree']:>10.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rollouts", nargs="*", type=Path, help="parquet files with prompt_ids and response_ids")
    parser.add_argument("--chunk-rows", type=int, default=2048)
    args = parser.parse_args()
    print(f"{'data':<46}{'per-row tokens':>13}{'whole':>11}{'tree':>11}")
    print(f"{'':<46}{'':>13}{'prompt':>11}{'':>11}")
    if args.rollouts:
        import pyarrow.parquet as pq

        for path in args.rollouts:
            table = pq.read_table(path, columns=["prompt_ids", "response_ids"])
            report(path.name, work(table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist(),
                                   args.chunk_rows))
        return
    for system, task, responses in [
        (150, 150, (128, 1024)),  # math GRPO: short system prompt and question, long reasoning
        (500, 1500, (16, 256)),  # retrieval: a short system prompt, long retrieved text per task
        (1500, 1000, (64, 512)),  # tool agent: system prompt + tool schemas, task + history
        (3000, 1000, (64, 512)),  # tool agent with a long tool list
        (3000, 500, (16, 256)),  # the most favourable: long shared preamble, short tasks and answers
    ]:
        prompts, answers = synthetic_day(system, task, responses)
        report(f"system {system}, task ~{task}, responses {responses[0]}-{responses[1]}",
               work(prompts, answers, args.chunk_rows))
    print(f"\nper-row tokens over the tokens fed with whole-prompt sharing, and with the prefix tree "
          f"(G = 8, chunks of {args.chunk_rows} rows)")


if __name__ == "__main__":
    main()
