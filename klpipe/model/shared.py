"""Rows that share a prompt: the prompt runs once, and every response continues from its KV cache.

This is transformers' own generation machinery (a left-padded prefill, a `DynamicCache`, an
attention mask and position ids), so any causal LM whose cache transformers implements works,
sliding windows and KV-shared layers included; `probes.check_prefix_sharing` verifies that at load time.
"""

from __future__ import annotations

import numpy as np
import torch


def score_shared(reference, prompts: list[np.ndarray], responses: list[np.ndarray], prompt_of: np.ndarray,
                 passes: list[np.ndarray], temperature: float = 1.0) -> list[np.ndarray]:
    """log p(response tokens) for rows that continue shared prompts, each prompt run once.

    `prompts` are prefilled together; row i continues prompts[prompt_of[i]] with responses[i].
    Each of `passes` (row indices, every row with two or more response tokens exactly once)
    is one forward of those rows' responses against the prompts' KV cache.
    """
    results = [np.zeros(0, dtype=np.float32) for _ in responses]
    cache, prompt_mask, last_hidden = _prefill(reference, prompts)  # last_hidden: (n, H)
    prompt_lengths = torch.tensor([len(p) for p in prompts], device=reference.input_device)
    # Response token 0 is predicted by the prompt's last position: one hidden state per prompt.
    first = [i for i, r in enumerate(responses) if len(r)]
    if first:
        index = torch.as_tensor(prompt_of[first], device=last_hidden.device)
        targets = torch.tensor([int(responses[i][0]) for i in first])
        for i, value in zip(first, reference.head.logprobs(last_hidden[index], targets, temperature).numpy()):
            results[i] = np.array([value], dtype=np.float32)
    for rows in passes:
        fed = [responses[i][:-1] for i in rows]  # (b,) lists of R_i - 1 tokens: the last is only a target
        groups = torch.as_tensor(prompt_of[rows], device=reference.input_device)
        hidden = _continue(reference, cache, prompt_mask, prompt_lengths, groups, fed)  # (b, T, H)
        # Fed token j (response token j) predicts response token j + 1.
        rest = reference.targets_logprobs(hidden, [0] * len(rows), [responses[i][1:] for i in rows], temperature)
        for i, values in zip(rows, rest):
            results[i] = np.concatenate([results[i], values])
    return results


def _prefill(reference, prompts: list[np.ndarray]):
    """Run prompts once, left-padded so that they all end at the same position.

    Left padding (as in batched generation) keeps each prompt's tokens contiguous and its end
    aligned, so a sliding window measured in cache positions is the window in real tokens; the
    attention mask hides the pads and position ids restart at 0 after them.
    """
    from transformers import DynamicCache

    longest = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), longest), dtype=np.int64)
    mask = np.zeros((len(prompts), longest), dtype=np.int64)
    for k, prompt in enumerate(prompts):
        ids[k, longest - len(prompt):] = prompt
        mask[k, longest - len(prompt):] = 1
    input_ids = torch.from_numpy(ids).to(reference.input_device)
    mask_t = torch.from_numpy(mask).to(reference.input_device)
    positions = (mask_t.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=reference.model.config)
    extra = {}
    if reference.accepts_logits_to_keep:
        # Only the last position's hidden state is needed: Gemma 4 then runs its KV-shared layers
        # (20 of E2B's 35) on that one position instead of the whole prompt.
        extra["logits_to_keep"] = 1
    out = reference.body(input_ids=input_ids, attention_mask=mask_t, position_ids=positions, use_cache=True,
                    **{reference.cache_argument: cache}, **extra)
    return cache, mask_t, out.last_hidden_state[:, -1]

def _continue(reference, cache, prompt_mask: torch.Tensor, prompt_lengths: torch.Tensor, groups: torch.Tensor,
              fed: list[np.ndarray]) -> torch.Tensor:
    """Hidden states of `fed` token rows, each continuing prompt `groups[k]` from the prefill cache."""
    longest = max(len(f) for f in fed)
    ids = np.zeros((len(fed), longest), dtype=np.int64)
    for k, tokens in enumerate(fed):
        ids[k, : len(tokens)] = tokens  # right padding: no real token ever attends to a later pad
    input_ids = torch.from_numpy(ids).to(reference.input_device)
    mask = torch.cat([prompt_mask[groups], torch.ones_like(input_ids)], dim=1)  # (b, P_max + T)
    positions = prompt_lengths[groups][:, None] + torch.arange(longest, device=input_ids.device)[None]
    out = reference.body(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    **{reference.cache_argument: _continuing(cache, groups)})
    return out.last_hidden_state


def _continuing(cache, rows: torch.Tensor):
    """A cache through which batch row k continues `cache`'s row rows[k], and that stores nothing.

    Each attention layer reads its prompt keys and values for the rows it needs and appends the
    response's own, per layer and only for that layer's attention: the prompt's cache stays as the
    prefill left it, for the next pass, and no pass holds copies of every layer at once. Everything
    the masks are built from (lengths, sliding windows, KV-shared layers) is the prefill's.
    """
    from transformers import Cache

    class Continuing(Cache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            layer = self.layers[layer_idx]
            keys = torch.cat([layer.keys.index_select(0, rows), key_states], dim=-2)
            values = torch.cat([layer.values.index_select(0, rows), value_states], dim=-2)
            return keys, values

    return Continuing(layers=cache.layers)
