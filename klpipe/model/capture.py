"""Each side's run of a chunk with its head's input kept, not applied: the positions' final hidden states, then
both heads applied together (joint_head.py).

A run (rows whole, packed, the prefix tree, streamed) gathers the final hidden state of every position that predicts
a needed response token and hands it to its head. A `Capture` stands in for the head: it keeps them (tokens × hidden,
in the model's dtype, where the model computed them) and gives back each target's slot where a logprob would go, so
that every path's own bookkeeping puts slot s at the (row, position) it predicts. `finish` checks that bookkeeping
(each slot once, at a position holding the token captured with it, the same positions on both sides) and runs the
joint head over the slots.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from klpipe.errors import ModelError
from klpipe.model.head import HeadBlocks
from klpipe.model.joint_head import Settings, Side, joint

SLOT_LIMIT = 1 << 24  # slots travel in the runs' fp32 logprob arrays: integers exact below 2^24
# A KL or entropy below -this is a wrong formula, not rounding (fp32 rounds these sums by a few 1e-6 at most).
NEGATIVE_BUG = 1e-3
JOINT_BLOCKS = 4  # blocks the joint head holds at once (blocks_of)


class Capture:
    """Stands in for a model's head for one run: keeps each target's hidden state and token, and returns its slot."""

    def __init__(self, head):
        self.head = head
        self.hidden: list[torch.Tensor] = []  # (m, H) per call, where the model computed them
        self.targets: list[torch.Tensor] = []  # (m,) per call, on the host
        self.count = 0

    def __getattr__(self, name: str):
        return getattr(self.head, name)  # rows, vocab_size: what the paths read of their head besides logprobs

    def logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        """Each target's slot, as float32 on the host: (N, H), (M,), rows (M,) → (M,), as head.LMHead.logprobs."""
        picked = hidden if rows is None else hidden[rows.to(hidden.device)]  # (M, H)
        count = int(targets.shape[0])
        if self.count + count > SLOT_LIMIT:
            raise RuntimeError(f"klpipe bug: more than {SLOT_LIMIT} targets captured in one slice")
        self.hidden.append(picked.detach())
        self.targets.append(targets.cpu())
        slots = torch.arange(self.count, self.count + count, dtype=torch.float32)
        self.count += count
        return slots

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states (n, H), tokens (n,)) of every slot, in slot order; the calls' pieces let go."""
        hidden = torch.cat(self.hidden) if self.hidden else torch.empty(0)
        tokens = torch.cat(self.targets) if self.targets else torch.empty(0, dtype=torch.long)
        self.hidden, self.targets = [hidden], [tokens]
        return hidden, tokens


@dataclass(frozen=True)
class Captured:
    """One side's run of a slice: its capture, and what the run put where logprobs go (one slot per needed
    position)."""

    capture: Capture
    slots: list[np.ndarray]


class capturing(AbstractContextManager):
    """Within: `model`'s head is a Capture (`as` gives it); its own head again after."""

    def __init__(self, model):
        self.model = model

    def __enter__(self) -> Capture:
        self.head = self.model._head  # not the setter: fp64's wrapping is the real head's, which stays as it is
        self.model._head = Capture(self.head)
        return self.model._head

    def __exit__(self, *exc) -> None:
        self.model._head = self.head


def hidden_bytes(model, policy, topk: int) -> int:
    """What one needed position holds while a slice waits for the joint head: each side's final hidden state (in its
    model's dtype) and token, and the top-k's running values, ids and their merge's."""
    total = topk * 36
    for each in (model, policy):
        if each is not None:
            width = each.model.get_output_embeddings().weight.shape[1]
            total += width * each.dtype.itemsize + 8
    return total


def finish(ref: Side, policy: Side | None, ref_run: Captured, policy_run: Captured | None,
           responses: list[np.ndarray], settings: Settings, wide_: bool) -> dict[str, list[np.ndarray]]:
    """The joint head over both runs of a slice: per column name (ref_logprobs, policy_logprobs, cache.FULL_KL_COLUMNS,
    the top-k's), a value per response token of each row (NaN where no slot was captured: the mask's 0s).

    Each run's slots are checked to be a permutation of its capture's slots, at the same positions on both sides,
    each predicting the token the row holds there."""
    from klpipe import cache
    from klpipe.model import wide

    # The joint head runs in the reference's slot order (its hidden states as they were captured, no copy); a
    # position's values are read back by its slot.
    hidden, tokens = ref_run.capture.stacked()
    where, slots = _positions(ref_run.slots, ref_run.capture.count, tokens, responses)
    policy_hidden = None
    if policy_run is not None:
        policy_all, policy_tokens = policy_run.capture.stacked()
        policy_where, policy_slots_found = _positions(policy_run.slots, policy_run.capture.count, policy_tokens,
                                                      responses)
        if not all(np.array_equal(a, b) for a, b in zip(where, policy_where, strict=True)):
            raise RuntimeError("klpipe bug: the policy's run scored other positions than the reference's")
        order = np.empty_like(slots)
        order[slots] = policy_slots_found  # the policy's slot of each reference slot's position
        same = np.array_equal(order, np.arange(len(order)))
        policy_hidden = policy_all if same else policy_all[torch.from_numpy(order).to(policy_all.device)]
    with wide.fp64() if wide_ else nullcontext():
        exact = joint(ref, policy, hidden, policy_hidden, tokens, settings)
    columns = {cache.REF_LOGPROBS: exact.ref_logprobs, cache.POLICY_LOGPROBS: exact.policy_logprobs,
               cache.KL_POLICY_REF: exact.kl_policy_ref, cache.KL_REF_POLICY: exact.kl_ref_policy,
               cache.POLICY_ENTROPY: exact.policy_entropy, cache.REF_ENTROPY: exact.ref_entropy,
               cache.REF_TOPK_LOGPROBS: exact.topk_logprobs}
    for name in cache.FULL_KL_COLUMNS:  # never below 0; rounding leaves a few 1e-7 of either sign around it
        values = columns[name]
        if values is not None:
            if len(values) and float(values.min()) < -NEGATIVE_BUG:
                raise RuntimeError(f"klpipe bug: the joint head's {name} is {float(values.min()):.3g}, below 0")
            np.maximum(values, 0, out=values)
    out = {name: _scattered(values[slots], where, responses) for name, values in columns.items() if values is not None}
    for name, rows in out.items():
        bad = next((i for i, (row, w) in enumerate(zip(rows, where, strict=True)) if not np.isfinite(row[w]).all()),
                   None)
        if bad is not None:
            raise ModelError(f"row {bad} of a chunk: the joint head's {name} is not finite (a logit of -inf or nan in "
                             "one model's head where the other gives the token mass)")
    if exact.topk_ids is not None:
        out[cache.REF_TOPK_IDS] = _scattered(exact.topk_ids[slots], where, responses, fill=-1)
    return out


def _positions(slots: list[np.ndarray], count: int, tokens: torch.Tensor, responses: list[np.ndarray]
               ) -> tuple[list[np.ndarray], np.ndarray]:
    """(each row's positions that hold a slot, their slots in row order), checked: each of the `count` captured slots
    once, each at a position whose token is the one captured with it (`tokens`, in slot order)."""
    where = [np.flatnonzero(~np.isnan(values)) for values in slots]
    found = np.concatenate([values[w] for values, w in zip(slots, where, strict=True)]) if slots else np.zeros(0)
    index = found.astype(np.int64)
    if not (np.array_equal(index, found) and np.array_equal(np.sort(index), np.arange(count))):
        raise RuntimeError("klpipe bug: a run's captured hidden states do not map one to one onto its positions")
    expected = np.concatenate([r[w] for r, w in zip(responses, where, strict=True)]) if responses else np.zeros(0)
    if not np.array_equal(tokens.numpy()[index], expected.astype(np.int64)):
        raise RuntimeError("klpipe bug: a captured hidden state predicts another token than its position holds")
    return where, index


def _scattered(values: np.ndarray, where: list[np.ndarray], responses: list[np.ndarray], fill=np.nan
               ) -> list[np.ndarray]:
    """Flat per-position `values` ((n,) or (n, K)) back into per-row arrays the length of each response."""
    rows, start = [], 0
    for response, w in zip(responses, where, strict=True):
        row = np.full((len(response), *values.shape[1:]), fill, dtype=values.dtype)
        row[w] = values[start:start + len(w)]
        start += len(w)
        rows.append(row)
    return rows


def refusal(model, policy, topk: int) -> str | None:
    """Why the joint head cannot run on these models (the reference, and the policy where the exact KL is asked), or
    None: it reads klpipe's own head input, which a model run by its own forward never hands over."""
    for each in (model, policy):
        if each is not None and each.own_forward is not None:
            return f"{type(each.model).__name__} runs each row by its own forward ({each.own_forward})"
    sides = [Side.of(model)] + ([] if policy is None else [Side.of(policy)])
    if any(side.streamed is not None for side in sides) and any(side.own is not None for side in sides):
        return "one model's head streams from its file and the other's runs by the model's own forward"
    return None


def blocks_of(model) -> HeadBlocks:
    """How the joint head cuts its work: blocks a quarter of the fused head's (head.py), as four of them are live at
    once (both sides' logits, their difference, the weights e^(z−m)), which the fused head's single block is sized to
    keep in the L2 (CUDA) or L3 (CPU)."""
    from klpipe.model.head import FUSED_CPU_BLOCK, FUSED_GPU_BLOCK

    device = str(model.device)
    budget = getattr(model.head, "logits_budget", None) or (
        FUSED_GPU_BLOCK if device.startswith("cuda") else FUSED_CPU_BLOCK)
    return HeadBlocks.for_device(model.vocab_size, device, max(budget // JOINT_BLOCKS, 1 << 16))
