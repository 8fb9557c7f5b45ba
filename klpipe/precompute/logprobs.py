"""A chunk of tokenized rows in, reference logprobs out: which rows share which prefixes, and how they run.

GRPO samples every prompt G times, agent rollouts open every row with the same system prompt, and
multi-turn trajectories stored a row per turn repeat the whole history in every turn's prompt: most
of what a per-row forward pass computes is the same prefix again. The rows of a chunk form a prefix
tree (prefix_tree.py); each distinct prefix worth sharing runs once and the rows continue from its
keys and values (model/attention/tree.py). Rows that share nothing worth a pass take the per-row path
(`ReferenceModel.score_batch`, the causal kernel with no mask), except on models whose prefill skips
layers for positions nobody needs (Gemma 4's KV-shared layers), where the tree is cheaper for every
row: a prompt runs as a node of its own, its KV-shared layers on its last position alone.

Both paths give the same logprobs up to float rounding, and the plan depends only on the chunk's
rows and the budgets, so a resumed or sharded run reproduces an uninterrupted one bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from klpipe.contract import ScoringModel, Streamer
from klpipe.plan import ROOT, Pass, Tree, Wanted, by_tokens
from klpipe.plan import fed as row_fed
from klpipe.precompute import prefix_tree
from klpipe.precompute.length_batches import pack_batches, padding_efficiency, plan_batches


@dataclass
class ForwardStats:
    """What the model was fed, summed over chunks."""

    fed_tokens: int = 0  # tokens fed to the model, padding excluded
    padded_tokens: int = 0  # tokens fed to the model, padding (and a context's end fed again) included
    per_row_tokens: int = 0  # what running every row on its own would feed: its prompt and response less one
    tree_rows: int = 0  # rows computed through the prefix tree
    early_only_tokens: int = 0  # of the fed tokens, those whose layers past the KV-shared point were skipped

    @property
    def padding_efficiency(self) -> float:
        return self.fed_tokens / self.padded_tokens if self.padded_tokens else 1.0

    @property
    def fewer(self) -> float:
        """How many times fewer tokens were fed than a per-row pass feeds."""
        return self.per_row_tokens / self.fed_tokens if self.fed_tokens else 1.0


@dataclass
class ChunkPlan:
    """How a chunk's rows run: which rows go through the prefix tree and its passes, which run whole and in
    which batches. It depends on the rows, the budgets and a few properties of the model (`plan_key`), so
    a second model with the same properties (a policy fine-tuned from the reference) runs the same plan."""

    key: tuple  # plan_key of the model and mode it was made for
    needed: list[np.ndarray]  # (rows,) bool per response token: the logprobs to compute
    fed: list[np.ndarray]  # (rows,) what each row feeds
    tree_rows: np.ndarray  # rows through the tree
    tree: Tree | None  # the tree of `tree_rows`, or None
    passes: list[Pass]  # its passes
    batches: list[np.ndarray]  # rows run whole: each batch's row indices
    padded_tokens_alone: int = 0  # what the batches feed, padding included
    masked: bool = False  # whether a mask said which logprobs are needed (else every one is)


def plan_key(model: ScoringModel, sharing: str) -> tuple:
    """What a plan depends on besides the rows and the budgets (prefill_skips_layers first: plan_stats reads it).
    Rows run whole (`off`) ask nothing of the tree, so neither does their key."""
    packed = model.packed  # rows run whole go end to end, without pads (model/attention/packing.py)
    if sharing == "off":
        return (model.prefill_skips_layers, model.rope_length_limit, packed, "off")
    return (model.prefill_skips_layers, model.rope_length_limit, model.attention_cost, model.keeps_state,
            model.state_tokens_per_node if model.keeps_state else 0, packed)


def chunk_logprobs(model: ScoringModel, rows: list[tuple[np.ndarray, np.ndarray]], max_tokens: int, temperature: float,
                   sharing: str, stats: ForwardStats, check_stop: Callable[[], None] = lambda: None,
                   max_cache_tokens: int = 1 << 62, needed: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Reference logprobs of every (prompt ids, response ids) row of a chunk, in the chunk's row order.

    `sharing`: "off" runs every row on its own; "on" runs every row through the prefix tree;
    "auto" runs through the tree the rows that share a prefix worth it (every row, where the
    model's prefill skips layers). `max_cache_tokens` bounds the keys and values the tree keeps
    alive at once, in tokens. `check_stop` runs after every forward pass, so a preempted run
    abandons the chunk quickly.

    `needed` (a bool per response token, per row: the mask) says which logprobs are wanted. The
    others are fed as context but never reach the LM head, and come back NaN; a row's tokens after
    its last needed one are not fed at all, and a row with none needed is not run.
    """
    plan = plan_chunk(model, rows, max_tokens, sharing, max_cache_tokens, needed)
    plan_stats(plan, stats, packs_passes(model))
    return run_plan(model, plan, rows, temperature, check_stop)


def plan_chunk(model: ScoringModel, rows: list[tuple[np.ndarray, np.ndarray]], max_tokens: int, sharing: str,
               max_cache_tokens: int = 1 << 62, needed: list[np.ndarray] | None = None) -> ChunkPlan:
    """The plan of chunk_logprobs (same arguments), made once: any model with the same plan_key runs it."""
    masked = needed is not None
    if needed is None:
        needed = [np.ones(len(response), dtype=bool) for _, response in rows]
    limit = model.rope_length_limit  # a RoPE whose frequencies change past it, for the whole batch
    fed = _fed(rows, needed, limit)  # a row longer than it fed whole, so `long` below is its own forward's
    wanted = np.flatnonzero([bool(n.any()) for n in needed])
    long = np.array([limit is not None and len(fed[i]) > limit for i in wanted], dtype=bool)
    alone = wanted[long]  # past the limit, a row runs whole with rows like it, never sharing a prefix
    candidates = wanted[~long]
    if sharing == "off":
        alone, candidates = wanted, candidates[:0]
    tree, passes = None, []
    if len(candidates):
        candidates, shared_nothing = _worth_a_tree(model, rows, fed, needed, candidates, sharing)
        alone = np.sort(np.concatenate([alone, shared_nothing]))
        if len(candidates):
            tree, passes, _ = _plan_tree(model, rows, fed, needed, candidates,
                                         TreeBudget(max_tokens, max_cache_tokens, model.attention_cost))
    batches, padded = _plan_alone(fed, alone, set(wanted[long].tolist()), max_tokens, model.packed)
    return ChunkPlan(plan_key(model, sharing), needed, fed, candidates, tree, passes, batches, padded, masked)


def packs_passes(model: ScoringModel) -> bool:
    """Whether `model` runs the tree's passes packed (model/attention/tree.py; plan.Pass.runs_packed says which)."""
    if not model.cascade:
        return False
    from klpipe.model.attention.tree import packs_passes as packs  # torch lives behind this import

    try:
        return packs(model, model.layer_kinds)
    except Exception:  # noqa: BLE001 - a layout the tree does not know runs no tree
        return False


def plan_stats(plan: ChunkPlan, stats: ForwardStats, packed: bool = False) -> None:
    """Add what `plan` feeds a model to `stats`. `packed`: the model runs the tree's passes end to end, without pads,
    all but those plan.Pass.runs_packed keeps padded (model/attention/tree.py's packs_passes)."""
    stats.per_row_tokens += sum(len(f) for f in plan.fed)
    tree = plan.tree
    for step in plan.passes:
        assert tree is not None, "a plan's passes are its tree's"
        own = tree.end[step.nodes] - tree.start[step.nodes]
        stats.fed_tokens += int(own.sum())
        end_to_end = step.runs_packed(packed, plan.key[0])
        stats.padded_tokens += int(own.sum()) if end_to_end else len(own) * int(own.max())
        if step.only_last and plan.key[0]:  # prefill skips layers: all but each row's last position
            stats.early_only_tokens += int(own.sum()) - len(own)
    stats.tree_rows += len(plan.tree_rows)
    stats.fed_tokens += sum(len(plan.fed[i]) for batch in plan.batches for i in batch.tolist())
    stats.padded_tokens += plan.padded_tokens_alone


def run_plan(model: ScoringModel, plan: ChunkPlan, rows: list[tuple[np.ndarray, np.ndarray]], temperature: float,
             check_stop: Callable[[], None] = lambda: None) -> list[np.ndarray]:
    """`model`'s logprobs of every row of the chunk, by `plan` (made for a model of the same plan_key)."""
    if plan.key != plan_key(model, "off" if plan.key[-1] == "off" else "auto"):
        raise ValueError("a chunk plan runs only on models with the plan_key it was made for")
    results = [np.full(len(response), np.nan if plan.masked else 0.0, dtype=model.result_dtype) for _, response in rows]
    if plan.tree is not None:
        from klpipe.model.attention.tree import score_tree  # torch lives behind this import

        logprobs = score_tree(model, plan.tree, plan.passes, _wanted(rows, plan.needed, plan.tree_rows), temperature,
                              check_stop)
        for i, values in zip(plan.tree_rows.tolist(), logprobs, strict=True):
            results[i] = values
    if model.streamer is not None:
        return _run_streamed(model, model.streamer, plan, rows, temperature, check_stop, results)
    for batch in plan.batches:
        scored = model.score_batch([rows[i] for i in batch], temperature, [plan.needed[i] for i in batch])
        for i, values in zip(batch.tolist(), scored, strict=True):
            results[i] = values
        check_stop()  # a preempted run abandons this chunk; finished chunks are already on disk
    return results


def _run_streamed(model: ScoringModel, streamer: Streamer, plan: ChunkPlan, rows, temperature: float, check_stop,
                  results: list) -> list:
    """run_plan's batches on a model whose weights stream (model/layer_major.py): each group of batches layer-major,
    every batch through a layer before any goes through the next, so the group reads the weights once. Groups hold
    at most `model.stream_tokens` fed tokens (their activations wait between layers), None: the whole chunk."""
    # torch lives behind this import (a streamed model has loaded it)
    from klpipe.model.attention.packing import NotPacked

    # What each batch holds while it waits, in tokens' worth: its rows end to end where they run packed, else each
    # padded to the batch's longest.
    sizes = [sum(len(plan.fed[i]) for i in batch.tolist()) if model.packed
             else len(batch) * max((len(plan.fed[i]) for i in batch.tolist()), default=0) for batch in plan.batches]
    # No group where every row went through the tree (no batch).
    for group in by_tokens(plan.batches, sizes, model.stream_tokens or None):
        calls = [lambda batch=batch: model.score_batch([rows[i] for i in batch], temperature,
                                                       [plan.needed[i] for i in batch]) for batch in group]
        fed = sum(len(plan.fed[i]) for batch in group for i in batch.tolist())
        try:
            scored = streamer.run(calls, check_stop, fed)
        except NotPacked as exc:
            model.drop_packing(str(exc))  # every pass of the group again, padded: none is left half packed
            scored = streamer.run(calls, check_stop, fed)
        for batch, values in zip(group, scored, strict=True):
            for i, row_values in zip(batch.tolist(), values, strict=True):
                results[i] = row_values
        check_stop()
    return results


def _fed(rows: list[tuple[np.ndarray, np.ndarray]], needed: list[np.ndarray], rope_limit: int | None
         ) -> list[np.ndarray]:
    """What each row feeds the model (plan.fed): its prompt and its response up to the last token whose logprob is
    needed, less that token; a long RoPE's row longer than its limit whole; nothing for a row that needs none."""
    return [row_fed(prompt, response, np.flatnonzero(need), rope_limit)
            for (prompt, response), need in zip(rows, needed, strict=True)]


def _first_needed(rows, needed, chosen: np.ndarray) -> np.ndarray:
    """Each chosen row's first needed position: the one that predicts its first needed response token (the
    prompt's last position, without a mask)."""
    return np.array([len(rows[i][0]) - 1 + int(np.argmax(needed[i])) for i in chosen], dtype=np.int64)


def _wanted(rows, needed, chosen: np.ndarray) -> Wanted:
    return Wanted(first=_first_needed(rows, needed, chosen),
                  base=np.array([len(rows[i][0]) - 1 for i in chosen], dtype=np.int64),
                  targets=[rows[i][1] for i in chosen], needed=[needed[i] for i in chosen])


def _worth_a_tree(model: ScoringModel, rows, fed, needed, candidates: np.ndarray,
                  sharing: str) -> tuple[np.ndarray, np.ndarray]:
    """(rows for the tree, rows to run whole): under "auto", on a model that skips no layers, a row that
    shares no prefix worth a pass gains nothing from a context, and runs whole (duplicates share one)."""
    if sharing != "auto" or model.prefill_skips_layers:
        return candidates, candidates[:0]
    tree = pruned_tree(rows, fed, candidates, needed)
    kids = tree.children()
    ending = np.bincount(tree.end_node, minlength=tree.num_nodes)
    shares = np.array([tree.parent[n] != ROOT or bool(kids[n]) or ending[n] > 1
                       for n in tree.end_node.tolist()], dtype=bool)
    return candidates[shares], candidates[~shares]


def pruned_tree(rows, fed, chosen: np.ndarray, needed=None, context_cost: int = prefix_tree.CONTEXT_COST):
    """The tree of rows `chosen` over what they feed (`fed`), with the nodes not worth a pass folded away: what
    precompute runs (benchmarks/prefix_savings.py counts it). `needed` as for chunk_logprobs (default: all)."""
    needed = needed if needed is not None else [np.ones(len(r), dtype=bool) for _, r in rows]
    first = _first_needed(rows, needed, chosen)
    tree = prefix_tree.build_tree([fed[i] for i in chosen])
    return prefix_tree.prune(tree, prefix_tree.needs(tree, first).uses, context_cost=context_cost)


@dataclass(frozen=True)
class TreeBudget:
    """What a chunk's tree is planned within (prefix_tree.plan_passes), and how far its nodes are folded."""

    max_tokens: int  # a pass's fed tokens, padding included
    max_cache_tokens: int  # the keys and values kept alive at once, in tokens
    attention: float  # what attending to one more position costs a token, in fed tokens (ReferenceModel's)
    context_cost: int = prefix_tree.CONTEXT_COST  # a node shorter than it is not worth a pass (prefix_tree.prune)
    min_prefix: int = prefix_tree.MIN_SKIPPED_PREFIX  # prefix_tree.split_prefixes's


def _plan_tree(model: ScoringModel, rows, fed, needed, chosen: np.ndarray, budget: TreeBudget):
    """(tree, passes, first needed positions) for rows `chosen`: the chunk's runs and the load-time probe's."""
    first = _first_needed(rows, needed, chosen)
    tree = pruned_tree(rows, fed, chosen, needed, budget.context_cost)
    if model.prefill_skips_layers:
        tree = prefix_tree.split_prefixes(tree, prefix_tree.needs(tree, first).lowest, min_prefix=budget.min_prefix)
    need = prefix_tree.needs(tree, first)
    exact_ends = model.keeps_state  # a recurrent state is handed on only from a pass's last position
    passes = prefix_tree.plan_passes(tree, need.only_last, budget.max_tokens, budget.max_cache_tokens,
                                     split_by_need=model.prefill_skips_layers, attention=budget.attention,
                                     exact_ends=exact_ends,
                                     node_tokens=model.state_tokens_per_node if exact_ends else 0)
    return tree, passes, first


def _plan_alone(fed, alone: np.ndarray, long_rows: set, max_tokens: int,
                packed: bool = False) -> tuple[list[np.ndarray], int]:
    """(batches of rows run whole, the tokens they feed padding included): batched by length, rows past a
    length-dependent RoPE's limit only with each other. `packed`: the model runs a batch's rows end to end
    (model/attention/packing.py), so a batch's size is its rows' tokens and it feeds no pad."""
    batches: list[np.ndarray] = []
    padded_total = 0
    if not len(alone):
        return batches, padded_total
    lengths = np.array([len(fed[i]) for i in alone], dtype=np.int64)
    past = np.array([i in long_rows for i in alone.tolist()], dtype=bool)
    for group in (np.flatnonzero(~past), np.flatnonzero(past)):
        if not len(group):
            continue
        sizes = lengths[group].tolist()
        planned = pack_batches(sizes, max_tokens) if packed else plan_batches(sizes, max_tokens)
        batches += [alone[group[batch]] for batch in planned]
        padded_total += padding_efficiency(sizes, planned)[0 if packed else 1]
    return batches, padded_total


# -- the tree's probes ------------------------------------------------------------------------------

# The probe's shared system prompt: longer than the model's sliding window (so a window that a
# context shifted would show), at least this long, and never longer than PROBE_MAX_PREFIX.
PROBE_MIN_PREFIX = 40
PROBE_MAX_PREFIX = 1024
PROBE_LONGEST_ROW = 30  # what the probe's longest row feeds beyond the system prompt (turn two's, below)


def check_layout(model: ScoringModel) -> str | None:
    """None if the model tells the planner what the prefix tree needs of it (its layer table, what a token's
    keys, values and states weigh: one token's forward); otherwise why not. Planning asks these before any
    tree runs, so they are checked first, in milliseconds; check_tree's probe comes when a tree is to run."""
    try:
        _ = model.keeps_state, model.kv_bytes_per_token, model.state_tokens_per_node  # each asked, once
    except Exception as exc:  # noqa: BLE001 - any failure means: do not share on this model
        return _in_our_words(model, _problem(exc))
    return None


def _problem(exc: Exception) -> str:
    from klpipe.errors import first_line

    return f"{type(exc).__name__}: {first_line(exc)}"


def check_tree(model: ScoringModel) -> str | None:
    """None if the prefix tree reproduces the model's own forward (as transformers loaded it) on a probe;
    otherwise why not. A model whose full-attention layers attend in place (model/attention/cascade.py) and fails the
    probe is probed again with its own attention and its context gathered, and keeps the tree that way if that
    passes: the cascade is trusted only where it agrees."""
    problem = _probe_tree(model)
    if problem is not None and model.cascade:
        model.drop_cascade()
        problem = _probe_tree(model)
    return problem


def _in_our_words(model: ScoringModel, problem: str) -> str:
    """A bare exception's text replaced by its cause where the model's config names one (failures.config_cause)."""
    from klpipe.model.failures import config_cause

    return config_cause(model.model) or problem


def _probe_tree(model: ScoringModel) -> str | None:
    """check_tree's probe, once.

    The probe is a three-level tree and more: a system prompt longer than the model's sliding
    window in every row, two tasks after it, responses of length 0, 1 and several, a row whose
    prompt is the bare system prompt, a second turn whose prompt holds the first turn's prompt and
    response, duplicates, and a row that shares nothing. Tiny budgets make several passes, contexts
    of different lengths in one pass, nodes of different lengths side by side (padded after, or, on
    Gemma 4, feeding the end of their context again), and waves that drop keys, values and states
    while their rows still need others.
    """
    from klpipe.model.architecture import text_config

    config = text_config(model.model.config)
    window = max(getattr(config, "sliding_window", None) or 0, getattr(config, "attention_chunk_size", None) or 0)
    limit = getattr(config, "max_position_embeddings", None) or 4096
    prefix = int(min(max(window + 8, PROBE_MIN_PREFIX), PROBE_MAX_PREFIX, limit // 4))
    if model.rope_length_limit is not None:
        # Rows past a long RoPE's limit never share (chunk_logprobs runs them whole, with each other):
        # the probe's rows, the longest PROBE_LONGEST_ROW past the prefix, stay within it.
        prefix = min(prefix, model.rope_length_limit - PROBE_LONGEST_ROW)
    rng = np.random.default_rng(1)

    def tokens(n: int) -> np.ndarray:
        return rng.integers(0, model.vocab_size, n)

    system, task_a, task_b = tokens(prefix), tokens(13), tokens(5)
    turn_one = np.concatenate([system, task_a]), tokens(7)
    rows = [
        turn_one,
        (turn_one[0], tokens(1)),
        (turn_one[0], tokens(0)),
        (np.concatenate([system, task_b]), tokens(6)),
        (np.concatenate([system, task_b]), tokens(9)),
        (system, tokens(4)),  # the bare system prompt
        (np.concatenate([*turn_one, tokens(6)]), tokens(5)),  # turn two: turn one's prompt + response + more
        turn_one,  # a duplicate
        (tokens(9), tokens(3)),  # shares nothing
    ]
    chosen = np.array([i for i, (_, r) in enumerate(rows) if len(r)])
    got = [np.zeros(len(r), dtype=model.result_dtype) for _, r in rows]
    try:
        from klpipe.model.attention.tree import score_tree

        # Every level kept, and tiny budgets: many passes of mixed contexts (see above).
        needed = [np.ones(len(r), dtype=bool) for _, r in rows]
        fed = _fed(rows, needed, model.rope_length_limit)
        tree, passes, _ = _plan_tree(model, rows, fed, needed, chosen,
                                     TreeBudget(max_tokens=prefix // 2 + 24, max_cache_tokens=prefix + 16,
                                                attention=0.0, context_cost=0, min_prefix=1))
        for i, values in zip(chosen, score_tree(model, tree, passes, _wanted(rows, needed, chosen)), strict=True):
            got[i] = values
    except Exception as exc:  # noqa: BLE001 - any failure means: do not share on this model
        return _in_our_words(model, _problem(exc))
    expected = model.own_logprobs(rows)
    gap = max((float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True) if len(b)), default=0.0)
    if any(a.shape != b.shape for a, b in zip(got, expected, strict=True)) or not gap <= model.probe_tolerance:
        return f"continuing a prefix's keys and values changes the logprobs (max |Δ logprob| = {gap:.3g})"
    return None
