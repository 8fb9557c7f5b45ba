"""Which prefix-sharing mode a model runs with, and the chunk plans made in it.

The prefix tree is trusted only once its probe (logprobs.check_tree) has reproduced the per-row path
on the model. The probe costs a few dozen small passes (about half a second for the benchmarks' 8-layer
model on 2 CPU cores), so it runs when it is first needed. What planning itself asks of the model (its
layer table, one token's forward: logprobs.check_layout) is checked before any chunk, under auto and on:

    off   never: rows run whole and ask nothing of the tree
    on    before any chunk, so a model that cannot share fails before any work is done
    auto  the first time a chunk's plan would run a tree. Rows that share nothing worth a pass run whole
          in both modes, with the same batches, so a run of unique prompts never pays for the probe,
          and a model that fails it falls back to rows run whole from that chunk on, with the same
          numbers for the chunks before
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from klpipe.contract import ScoringModel
from klpipe.errors import ModelError
from klpipe.precompute.logprobs import ChunkPlan, check_layout, check_tree, plan_chunk, plan_key


class Sharing:
    """`model`'s sharing mode (`asked`, until the probe fails under auto) and its chunk plans."""

    def __init__(self, model: ScoringModel, asked: str, max_cache_mib: int, log: Callable[[str], None],
                 sides: tuple[str | None, ...] = ()):
        """`sides`: the adapters over `model`'s weights (model/lora.py) whose forwards run the same plans: the tree's
        probe runs with each of them on too."""
        self.model = model
        self.sides = sides
        self.mode = asked
        self.max_cache_mib = max_cache_mib
        self.log = log
        self.probed = False  # whether check_tree has run on the model
        if asked != "off":
            # A model whose own forward computes each row whole shares nothing (a forward that is not causal: a
            # prefix's keys are not what the whole row's would be).
            with uncounted(model):
                self._refuse(check_layout(model) if model.own_forward is None else model.own_forward)
        if self.mode != "off":
            # klpipe's attention only where a tree may run, and only where it reproduces the model's own forward.
            with uncounted(model):  # its probe's forwards: the load's, though it runs in the chunks' loop
                note = model.use_cascade()
            if note is not None:
                log(note)
        if asked == "on":
            self._probe()

    @property
    def cache_tokens(self) -> int:
        """The cache budget in tokens of the model's keys and values. Only the tree keeps any (and asks the
        model what they weigh): rows run whole keep none."""
        if self.mode == "off":
            return 1 << 62
        with uncounted(self.model):  # measured once per model, by a forward of its own
            return (self.max_cache_mib << 20) // self.model.kv_bytes_per_token

    def plan(self, pairs, max_tokens: int, needed) -> ChunkPlan:
        """The chunk's plan in this mode, the model probed first if the plan runs a tree."""
        plan = plan_chunk(self.model, pairs, max_tokens, self.mode, self.cache_tokens, needed)
        if self._untried(plan):
            self._probe()
            if self.mode == "off":
                plan = plan_chunk(self.model, pairs, max_tokens, "off", self.cache_tokens, needed)
        return plan

    def plan_ahead(self, pairs, max_tokens: int, needed) -> ChunkPlan | None:
        """The chunk's plan where making it asks nothing more of the model (rows run whole, or the probe has passed),
        for the read-ahead thread: planning is numpy on the rows and what the model told the planner before any chunk
        (check_layout). None where the plan may need the probe; the main thread then plans (`plan`). The caller
        keeps a plan made ahead only while `current(plan)`: a probe that fails under auto turns the mode off."""
        mode = self.mode
        if mode != "off" and not self.probed:
            return None
        return plan_chunk(self.model, pairs, max_tokens, mode, self.cache_tokens, needed)

    def current(self, plan: ChunkPlan) -> bool:
        """Whether `plan` (made ahead) is the plan this mode makes now."""
        return plan.key == plan_key(self.model, self.mode)

    def plan_like(self, other: Sharing, plan: ChunkPlan, pairs, max_tokens: int, needed) -> ChunkPlan:
        """`plan` (made by `other`, for another model) where this model would make the same one, else its own.
        A policy fine-tuned from the reference plans alike."""
        if self._untried(plan):
            self._probe()
        if self.mode == other.mode and plan_key(self.model, self.mode) == plan.key:
            return plan
        return self.plan(pairs, max_tokens, needed)

    def _untried(self, plan: ChunkPlan) -> bool:
        """Whether `plan` runs a tree on this model before check_tree has: rows run whole ask nothing of it."""
        return plan.tree is not None and self.mode != "off" and not self.probed

    def _probe(self) -> None:
        """check_tree on the model, on each adapter's side too; or what the remembered verdict says it found."""
        self.probed = True
        with uncounted(self.model):
            self._refuse(self.model.settle_tree(self._check_tree))

    def _check_tree(self) -> str | None:
        problem = check_tree(self.model)
        for side in self.sides:
            if problem is None:
                with self.model.side(side):
                    problem = check_tree(self.model)
        return problem

    def _refuse(self, problem: str | None) -> None:
        """Under auto, rows run whole from now on, with one log line; under on, a ModelError. Nothing if no problem."""
        if problem is None:
            return
        name = type(self.model.model).__name__
        if self.mode == "on":
            raise ModelError(f"--prefix-sharing on: {name} cannot share prefixes exactly ({problem})")
        self.log(f"prefix sharing off: {name} cannot share prefixes exactly ({problem})")
        self.mode = "off"
        self.model.drop_cascade()  # rows run whole from now on: the model's own attention


def uncounted(model: ScoringModel) -> AbstractContextManager[Any]:
    """What runs inside (the tree's probes, a cost measured once per model) left out of a streamed model's figures
    (model/layer_major.py's statistics: the run's reads, groups and times), though a probe under auto runs mid-run."""
    streamer = model.streamer
    return nullcontext() if streamer is None else streamer.uncounted()
