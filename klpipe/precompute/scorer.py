"""A chunk's rows in, every column precompute computes for them out: the reference's logprobs, the policy's, and,
with the exact KL or the reference's top-k, the joint head's (model/joint_head.py).

Without either, each model runs the chunk's plan with its own head, one after the other. With them, each runs it with
its head's input kept instead (a Capture), and the two heads are applied together afterwards: both models' final
hidden states of the chunk's needed positions wait for that, so a chunk is cut into slices of at most
`SLICE_BYTES` of them, each planned, run on both sides and finished before the next.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from klpipe import cache
from klpipe.contract import ScoringModel
from klpipe.errors import OutputError
from klpipe.precompute.logprobs import ChunkPlan, ForwardStats, packs_passes, plan_stats, run_plan
from klpipe.precompute.sharing import Sharing

# The hidden states one slice holds for the joint head, both sides together: 512 MiB is 32k tokens of two 4,096-wide
# bf16 models (a GRPO group of 32 responses of 1,000 tokens), a prompt's pass repeated once a slice at most.
SLICE_BYTES = 512 << 20


@dataclass
class Scored:
    """A chunk's computed columns, a value per response token of each row (NaN where the mask is 0)."""

    ref_logprobs: list[np.ndarray]
    policy_logprobs: list[np.ndarray] | None = None
    extra: dict[str, list[np.ndarray]] = field(default_factory=dict)  # cache.FULL_KL_COLUMNS and the top-k's, by name


@dataclass(frozen=True)
class Joint:
    """What the joint head computes: the exact KL and entropies (with a policy), the reference's top-k (k > 0)."""

    exact: bool
    topk: int

    @property
    def on(self) -> bool:
        return self.exact or self.topk > 0


class ChunkScorer:
    """Runs chunks on the reference and, where there is one, the policy: `policy` is `model` itself where it is an
    adapter over the same weights (`policy_side` names it), a model of its own, or None."""

    def __init__(self, model: ScoringModel, policy: ScoringModel | None, policy_side: str | None, sharing: Sharing,
                 policy_sharing: Sharing | None, temperature: float, max_tokens: int, joint: Joint):
        self.model, self.policy, self.policy_side = model, policy, policy_side
        self.own = policy if policy is not None and policy is not model else None  # a policy with weights of its own
        self.sharing, self.policy_sharing = sharing, policy_sharing
        self.temperature, self.max_tokens, self.joint = temperature, max_tokens, joint
        self.hidden_bytes = 0
        if joint.on:
            from klpipe.errors import ModelError
            from klpipe.model import capture, joint_head  # torch lives behind this import (the models have loaded it)

            problem = capture.refusal(model, self.own if joint.exact else None, joint.topk)
            if problem is not None:
                asked = " and ".join(f for f, on in (("--full-kl", joint.exact), ("--ref-topk", joint.topk)) if on)
                raise ModelError(f"{asked} cannot run: {problem}" + (" (pass --no-full-kl)" if joint.exact else ""))

            self.sides = (joint_head.Side.of(model), None if not joint.exact else
                          joint_head.Side.of(model, lambda: model.side(policy_side)) if policy is model else
                          joint_head.Side.of(self.own))
            self.hidden_bytes = capture.hidden_bytes(model, policy if joint.exact else None, joint.topk)

    def slices(self, pairs, needed: list[np.ndarray] | None) -> list[np.ndarray]:
        """The chunk's rows in consecutive slices whose needed positions' hidden states fit SLICE_BYTES (one slice of
        them all without the joint head). `needed`: as plan_chunk's (None: every response token)."""
        if not self.joint.on:
            return [np.arange(len(pairs))]
        cap = max(1, SLICE_BYTES // max(self.hidden_bytes, 1))
        counts = [len(r) for _, r in pairs] if needed is None else [int(n.sum()) for n in needed]
        cuts, held = [0], 0
        for i, count in enumerate(counts):
            if held and held + count > cap:
                cuts.append(i)
                held = 0
            held += count
        cuts.append(len(counts))
        return [np.arange(a, b) for a, b in itertools.pairwise(cuts) if b > a]

    def plan_ahead(self, pairs, needed) -> list[tuple[np.ndarray, ChunkPlan | None]]:
        """Each slice's plan where it can be made in the read-ahead thread (Sharing.plan_ahead), else None."""
        return [(rows, self.sharing.plan_ahead(_take(pairs, rows), self.max_tokens, _take(needed, rows)))
                for rows in self.slices(pairs, needed)]

    def score(self, pairs, needed, ahead, stats: ForwardStats, check_stop: Callable[[], None] = lambda: None) -> Scored:
        """Every row of the chunk, slice by slice (`ahead`: plan_ahead's, its plans kept while still current)."""
        parts = []
        for rows, plan in ahead:
            slice_pairs, slice_needed = _take(pairs, rows), _take(needed, rows)
            if plan is None or not self.sharing.current(plan):  # not made ahead, or under a mode since changed
                plan = self.sharing.plan(slice_pairs, self.max_tokens, slice_needed)
            plan_stats(plan, stats, packs_passes(self.model))
            policy_plan = None
            if self.own is not None and self.policy_sharing is not None:  # one plan for both where it plans alike
                policy_plan = self.policy_sharing.plan_like(self.sharing, plan, slice_pairs, self.max_tokens,
                                                            slice_needed)
            parts.append(self._run(plan, policy_plan, slice_pairs, check_stop))
        return _joined(parts)

    def _run(self, plan: ChunkPlan, policy_plan: ChunkPlan | None, pairs, check_stop) -> Scored:
        if self.joint.on:
            return self._run_joint(plan, policy_plan, pairs, check_stop)
        scored = Scored(run_plan(self.model, plan, pairs, self.temperature, check_stop))
        if self.policy is not None:
            scored.policy_logprobs = self._policy_logprobs(plan, policy_plan, pairs, check_stop)
        return scored


    def _run_joint(self, plan: ChunkPlan, policy_plan: ChunkPlan | None, pairs, check_stop) -> Scored:
        """Both runs with their heads' inputs kept, then the two heads together (model/joint_head.py)."""
        from klpipe.model import capture, joint_head  # torch lives behind this import

        model, temperature = self.model, self.temperature
        with capture.capturing(model) as ref_capture:
            ref_run = capture.Captured(ref_capture, run_plan(model, plan, pairs, temperature, check_stop))
        policy_run = None
        if self.joint.exact and self.policy is model:
            with model.side(self.policy_side), capture.capturing(model) as policy_capture:
                policy_run = capture.Captured(policy_capture, run_plan(model, plan, pairs, temperature, check_stop))
        elif self.joint.exact:
            with capture.capturing(self.own) as policy_capture:
                policy_run = capture.Captured(policy_capture, self._own_logprobs(policy_plan, pairs, check_stop))
        wide = any(m is not None and m.result_dtype == np.float64 for m in (model, self.own))
        settings = joint_head.Settings(temperature, capture.blocks_of(model), model.vocab_size, self.joint.topk)
        columns = capture.finish(*self.sides, ref_run, policy_run, [response for _, response in pairs], settings,
                                 wide)
        scored = Scored(columns.pop(cache.REF_LOGPROBS), columns.pop(cache.POLICY_LOGPROBS, None), columns)
        if self.policy is not None and not self.joint.exact:  # the top-k alone: the policy's logprobs its own way
            scored.policy_logprobs = self._policy_logprobs(plan, policy_plan, pairs, check_stop)
        return scored

    def _policy_logprobs(self, plan: ChunkPlan, policy_plan: ChunkPlan | None, pairs, check_stop) -> list[np.ndarray]:
        if self.policy is self.model:  # the same weights, the policy's adapter on: the same plan, its own caches
            with self.model.side(self.policy_side):
                return run_plan(self.model, plan, pairs, self.temperature, check_stop)
        return self._own_logprobs(policy_plan, pairs, check_stop)

    def _own_logprobs(self, policy_plan: ChunkPlan | None, pairs, check_stop) -> list[np.ndarray]:
        """A policy of its own on its plan (planned beside the reference's: `score`)."""
        assert self.own is not None and policy_plan is not None, "a policy of its own is planned for in `score`"
        return run_plan(self.own, policy_plan, pairs, self.temperature, check_stop)


def _take(items: list | None, rows: np.ndarray) -> list | None:
    return None if items is None else [items[i] for i in rows.tolist()]


def _joined(parts: list[Scored]) -> Scored:
    """The slices' columns back in the chunk's row order (slices are consecutive runs of rows)."""
    if len(parts) == 1:
        return parts[0]

    def cat(lists):
        return [values for part in lists for values in part]

    joined = Scored(cat(p.ref_logprobs for p in parts))
    if parts[0].policy_logprobs is not None:
        joined.policy_logprobs = cat(p.policy_logprobs for p in parts)
    for name in parts[0].extra:
        joined.extra[name] = cat(p.extra[name] for p in parts)
    return joined


def check_topk_room(k: int, rows: int, tokens: int, output, work, log) -> None:
    """--ref-topk's size said before any row, and refused where the disks cannot hold it: the checkpoints in the work
    directory, then the merged cache beside them (on its own disk, or staged in the work directory for a store)."""
    import shutil
    from pathlib import Path

    from klpipe.storage.store import is_remote

    size = tokens * k * 8  # an int32 id and a float32 logprob each
    log(f"--ref-topk {k}: {rows:,} rows, {tokens:,} response tokens x {k} x 8 bytes = {_size(size)} of top-k "
        "(before parquet's compression)")
    places = [work.path, work.path if is_remote(output) else Path(output).parent]
    need: dict[int, tuple[Path, int]] = {}
    for place in places:
        device = place.stat().st_dev
        need[device] = (place, need.get(device, (place, 0))[1] + size)
    for place, wanted in need.values():
        free = shutil.disk_usage(place).free
        if free < wanted:
            raise OutputError(f"--ref-topk {k} would write {_size(wanted)} onto {place}, which has {_size(free)} free; "
                              "lower --ref-topk or make room")


def _size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size} bytes"
