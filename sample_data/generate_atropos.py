"""Write ``sample_data/atropos_groups.jsonl``: Atropos groups as an environment saves them, offline and deterministic.

The groups are built by atroposlib 0.4.0's own ``ManagedServer`` (``make test-atropos`` installs it) and written
with its own JSON Lines writer (``jsonlines``, as ``BaseEnv`` writes ``data_path_to_save_groups``):

* two single-turn groups (``ManagedServer.completion``): the prompt masked ``-100`` with ``1.0`` logprobs, the
  completion trained;
* two multi-turn groups (``ManagedServer.chat_completion`` twice per trajectory, a ``tool`` message between): the
  first turn stays trained, the tool's suffix (its message and the next generation prompt) is masked ``-100``
  with ``1.0`` logprobs, the second turn trained.

The inference server behind ``ManagedServer`` is a stand-in for vLLM (``PolicySampler``): it samples from
``tiny-gemma4-policy`` and reports the policy's logprob of each sampled token, as vLLM does with
``logprobs=0``. It samples letters only, so that a turn's decoded text renders back through the chat template
unchanged (the template trims whitespace), which is what lets ManagedServer extend a trajectory.

Run ``python sample_data/generate_atropos.py`` from the repository root; ``tests/atropos_server`` builds its groups with
the same functions.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
REFERENCE = HERE / "tiny-gemma4"
POLICY = HERE / "tiny-gemma4-policy"
OUTPUT = HERE / "atropos_groups.jsonl"
GROUP_SIZE = 2

PROMPTS = ["Write a haiku about autumn.", "Name a prime number."]
TOOL_TASKS = [("You may call tools.", "What is the weather in Paris?", "sunny, 21 C"),
              ("You may call tools.", "Look up the capital of Peru.", "Lima")]


class PolicySampler:
    """What ManagedServer calls (`tokens_and_logprobs_completion`), sampling from a local policy: vLLM's part."""

    def __init__(self, policy_dir: Path = POLICY, seed: int = 0, max_tokens: int = 6):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(policy_dir)
        self.config = SimpleNamespace(model_name="tiny-gemma4-policy")
        self.generator = torch.Generator().manual_seed(seed)
        self.max_tokens = max_tokens
        # Letters only: a turn's text then comes back unchanged through the chat template (see the docstring).
        letters = [i for i in range(len(self.tokenizer)) if self.tokenizer.decode([i]).isascii()
                   and self.tokenizer.decode([i]).isalpha()]
        self.allowed = torch.full((self.model.config.vocab_size,), float("-inf"))
        self.allowed[letters] = 0.0

    async def tokens_and_logprobs_completion(self, input_ids, n=1, max_tokens=None, **_):
        torch = self.torch
        outputs, logprobs = [], []
        for _ in range(n):
            ids = list(input_ids)
            sampled, values = [], []
            for _ in range(max_tokens or self.max_tokens):
                with torch.no_grad():
                    logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                full = torch.log_softmax(logits, dim=-1)
                token = int(torch.multinomial(torch.softmax(logits + self.allowed, dim=-1), 1,
                                              generator=self.generator))
                sampled.append(token)
                values.append(float(full[token]))  # the policy's logprob of the token, as vLLM reports it
                ids.append(token)
            outputs.append(sampled)
            logprobs.append(values)
        return list(input_ids), outputs, logprobs, ["length"] * n


def group_of(nodes: list, scores: list[float]) -> dict:
    """A ScoredDataGroup from ManagedServer's nodes, with the keys BaseEnv.handle_send_to_api fills in."""
    group = {"tokens": [node.tokens for node in nodes], "masks": [node.masked_tokens for node in nodes],
             "scores": scores, "advantages": None, "ref_logprobs": None, "messages": None,
             "generation_params": {"temperature": 1.0, "max_tokens": 6},
             "inference_logprobs": [node.logprobs for node in nodes], "group_overrides": None, "overrides": None,
             "images": None}
    group.setdefault("distill_token_ids", None)
    group.setdefault("distill_logprobs", None)
    return group


async def single_turn_group(sampler: PolicySampler, prompt: str, index: int) -> dict:
    from atroposlib.envs.server_handling.managed_server import ManagedServer

    managed = ManagedServer(sampler, tokenizer=sampler.tokenizer)
    text = sampler.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
    await managed.completion(prompt=text, n=GROUP_SIZE, max_tokens=6)
    nodes = managed.get_state()["nodes"]
    return group_of(nodes, [float((index + i) % 2) for i in range(len(nodes))])


async def tool_group(sampler: PolicySampler, system: str, user: str, result: str) -> dict:
    """GROUP_SIZE trajectories: a turn, the tool's result, a second turn (one ManagedServer each, as an env
    running one trajectory per server does)."""
    from atroposlib.envs.server_handling.managed_server import ManagedServer

    nodes = []
    for _ in range(GROUP_SIZE):
        managed = ManagedServer(sampler, tokenizer=sampler.tokenizer)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        first = await managed.chat_completion(messages=messages, n=1, max_tokens=5)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "tool", "content": result}]
        await managed.chat_completion(messages=messages, n=1, max_tokens=4)
        (node,) = managed.get_state()["nodes"]
        nodes.append(node)
    return group_of(nodes, [1.0, 0.0][:len(nodes)])


async def build_groups(sampler: PolicySampler) -> list[dict]:
    groups = [await single_turn_group(sampler, prompt, i) for i, prompt in enumerate(PROMPTS)]
    groups += [await tool_group(sampler, *task) for task in TOOL_TASKS]
    return groups


def write_groups(groups: list[dict], path: Path) -> None:
    """atroposlib's writer: BaseEnv opens `data_path_to_save_groups` with jsonlines and writes each group."""
    import jsonlines

    with jsonlines.open(path, "w") as writer:
        for group in groups:
            writer.write(group)


def main() -> None:
    import torch

    torch.manual_seed(0)
    groups = asyncio.run(build_groups(PolicySampler()))
    write_groups(groups, OUTPUT)
    print(f"wrote {OUTPUT.name}: {len(groups)} groups, {sum(len(g['tokens']) for g in groups)} completions")


if __name__ == "__main__":
    main()
