"""The contenders klpipe is measured against, shared by bench_grpo.py and bench_agent.py.

    floor  the per-row minimal-work floor: each row alone (no padding), the model body over prompt +
           response, the LM head on response positions only
    trl    TRL's GRPO reference pass (trl 1.16 GRPOTrainer._get_per_token_logps_and_entropies with
           trl.trainer.utils.add_fused_lm_head): prompts left-padded and completions right-padded over
           the whole generation batch, forwarded in batches of 8 in input order. Needs `pip install
           trl` (the benchmarks only; never a klpipe dependency).

Each returns the seconds its loop took (model loading excluded), what it fed, and the logprobs of
the first `checked` rows, which the benchmarks compare across contenders.
"""

from __future__ import annotations

import time
from pathlib import Path

TRL_BATCH = 8


def load_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_grad_enabled(False)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def load_rows(path: Path) -> tuple[list[list[int]], list[list[int]]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    return table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()


def run_floor(model_dir: Path, rollouts: Path, checked: int) -> dict:
    import torch

    model = load_model(model_dir)
    prompts, responses = load_rows(rollouts)
    body, head = model.model, model.lm_head
    first, fed = [], 0
    started = time.perf_counter()
    for i, (p, r) in enumerate(zip(prompts, responses)):
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
    for i, (p, r) in enumerate(zip(prompts, responses)):
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
    return {"seconds": seconds, "fed_tokens": int(attention_mask.sum()), "padded_tokens": n * (prompt_len + completion_len),
            "checked": first}
