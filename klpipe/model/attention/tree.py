"""Running a chunk's prefix tree (planned by precompute/prefix_tree.py, as klpipe/plan.py's Tree and Pass):
every node once, continuing its ancestors' state (context_cache.py, as continuation.py says each kind of
layer needs), with transformers' own attention masks and no per-architecture code.

A pass runs several nodes side by side in one of two layouts (`pass_layout`):

    left  (the default):  [ pads | context, from the cache | fed tokens | pads ]
    right (Gemma 4):      [ pads | context, from the cache | pads | fed tokens ]
                          └──────────── C ───────────────┘ └─────── T ───────┘

Each node's own state is kept (keys and values cut to its real tokens) while any of its descendants
is still to run; `Pass.release` says when it goes. docs/precompute.md, "Prefix sharing" (points 3 and 7), says
why each layout is as it is.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from klpipe.model.attention import cascade, layered, packing
from klpipe.model.attention.context_cache import ContextCache, Kept
from klpipe.plan import Pass, Tree, Wanted, by_tokens

if TYPE_CHECKING:
    from klpipe.model.reference import ReferenceModel


def score_tree(reference, tree: Tree, passes: list[Pass], wanted: Wanted, temperature: float = 1.0,
               check_stop=lambda: None) -> list[np.ndarray]:
    """log p(response tokens) of every row of `tree`, each node computed once, per row (float32; fp64 models:
    float64)."""
    if reference.packed:
        try:
            return _score_tree(reference, tree, passes, wanted, temperature, check_stop)
        except packing.NotPacked as exc:
            # A call that rows alone cannot compute exactly: passes without context go padded, through the
            # model's own masks, from now on (and rows run whole with them); nothing computed so far is kept.
            reference.drop_packing(str(exc))
        except cascade.NotInPlace:
            reference.drop_cascade()
    if reference.cascade:
        try:
            return _score_tree(reference, tree, passes, wanted, temperature, check_stop)
        except cascade.NotInPlace:
            # A model that attends over what it makes of its cache (DeepSeek's MLA latents) gets its context
            # gathered, as transformers' own sdpa reads it; nothing computed so far is kept.
            reference.drop_cascade()
    return _score_tree(reference, tree, passes, wanted, temperature, check_stop)


@dataclass
class TreeRun:
    """One run of a chunk's tree: what each of its passes reads, and the state and results they leave."""

    reference: ReferenceModel
    tree: Tree
    wanted: Wanted
    temperature: float
    kinds: list  # the model's layer kinds (continuation.layer_kinds)
    layout: str  # pass_layout's
    rows_of: list[list[int]]  # per node, the rows whose sequence passes through it
    parents: set[int]  # the nodes whose state a later pass continues
    kept: dict[int, list[Kept]]  # node -> per layer, the state its own tokens leave
    results: list[np.ndarray]  # per row, its logprobs (NaN until computed)

    @classmethod
    def of(cls, reference, tree: Tree, wanted: Wanted, temperature: float) -> TreeRun:
        results = [np.full(len(t), np.nan, dtype=reference.result_dtype) for t in wanted.targets]
        parents = {int(tree.parent[n]) for n in range(1, tree.num_nodes) if tree.parent[n] != 0}
        return cls(reference, tree, wanted, temperature, reference.layer_kinds, pass_layout(reference),
                   _rows_through(tree), parents, {}, results)


def _score_tree(reference, tree: Tree, passes: list[Pass], wanted: Wanted, temperature: float,
                check_stop) -> list[np.ndarray]:
    run = TreeRun.of(reference, tree, wanted, temperature)
    results, kept, parent_of_kept = run.results, run.kept, run.parents
    streamer = reference.streamer
    with torch.inference_mode():
        if streamer is not None and reference.tree_layered:
            # Weights streamed: the tree's levels layer-major in one group where the budget holds them (layered.py).
            try:
                if layered.score(reference, tree, passes, parent_of_kept, kept,
                                 lambda step, shared: _run_pass(run, step, shared), check_stop):
                    return results
            except cascade.NotPackedPass:
                pass  # the tree's passes run as batches from now on (reference.unpack_tree_passes)
            return _score_tree(reference, tree, passes, wanted, temperature, check_stop)  # nothing of this run kept
        if streamer is not None:  # streamed, keys reused that layered.py freed: waves
            # A pass in a wave keeps every layer's keys until it ends; held None: no budget given.
            limit, budgeted = layered.group_limit(reference)
            held = layered.waiting_bytes(reference, tree, reference.kv_bytes_per_token) if budgeted else None
            for group, release in waves(tree, passes, parent_of_kept, limit, held):
                fed = sum(layered.fed_tokens(tree, step) for step in group)
                streamer.run([lambda step=step: _run_pass(run, step) for step in group],
                             check_stop, fed, None if held is None else sum(held(step) for step in group))
                for node in release:
                    kept.pop(node, None)
                check_stop()
            return results
        for step in passes:
            _run_pass(run, step)
            for node in step.release:
                kept.pop(node, None)
            check_stop()
    return results


def waves(tree: Tree, passes: list[Pass], parents: set, limit: int | None = None,
          size=None) -> list[tuple[list[Pass], list]]:
    """The passes of a streamed model that reuses keys layered.py freed (cascade.FreedKeys) in waves, each
    wave's groups run layer-major (model/layer_major.py): (group, the nodes to release after it), in order. Groups
    hold at most `limit` of `size(pass)` (by default its fed tokens). A node's state is kept when its pass ends,
    every layer at once, so a pass goes one wave after the latest wave that keeps a node it continues (an ancestor
    of its nodes), the first if none; within a wave the passes keep their planned order, cut into groups of at most
    `limit` fed tokens (their activations wait between layers). A
    streamed chunk so reads the weights once per group of a wave: about the tree's depth (system prompt, prompts,
    responses: three), not once per pass. A pass's `release` list goes after the latest wave of the passes up to
    it in the planned order: every pass that reads a node comes before the pass that releases it."""
    wave_of_kept: dict[int, int] = {}  # node -> the wave that keeps it
    cut: list[tuple[list[Pass], list[int]]] = []
    latest = -1
    for step in passes:
        nodes = step.nodes.tolist()
        wave = 1 + max((wave_of_kept.get(int(a), -1) for node in nodes for a in tree.path(node)[:-1]), default=-1)
        while len(cut) <= wave:
            cut.append(([], []))
        cut[wave][0].append(step)
        wave_of_kept.update((node, wave) for node in nodes if node in parents)
        latest = max(latest, wave)
        cut[latest][1].extend(int(node) for node in step.release)
    grouped = []
    size = size or (lambda step: layered.fed_tokens(tree, step))
    for in_wave, release in cut:  # a wave's release goes after its last group
        groups = by_tokens(in_wave, [size(step) for step in in_wave], limit)
        grouped += [(group, release if k == len(groups) - 1 else []) for k, group in enumerate(groups)]
    return grouped


def pass_layout(reference) -> str:
    """"right" where the model skips layers for positions nobody needs (every row must end at the last position),
    "left" otherwise (each node feeds exactly its own tokens): docs/precompute.md, point 3."""
    return "right" if reference.prefill_skips_layers and not reference.keeps_state else "left"


# -- one pass ---------------------------------------------------------------------------------------


def packs_passes(reference, kinds) -> bool:
    """Whether the tree's passes may run packed (`_run_packed`; Pass.runs_packed says which): the cascade is
    installed, rows run whole go packed, and every attention layer is one the cascade takes (full or sliding), with
    no state (a state is taken at a pass's end)."""
    return (reference.cascade and reference.packed and reference.tree_passes_packed
            and all(kind.continuation.keys_values is None or kind.continuation.cascade for kind in kinds)
            and not any(kind.continuation.state for kind in kinds))


def _run_pass(run: TreeRun, step: Pass, shared: frozenset | None = None) -> None:
    """One pass; `shared`: in a layer-major group (layered.py), its state kept layer by layer, and the layers whose
    keys a later layer reuses."""
    reference, tree, kinds, layout = run.reference, run.tree, run.kinds, run.layout
    kept, parents = run.kept, run.parents
    nodes = step.nodes.tolist()
    start, end = tree.start[step.nodes], tree.end[step.nodes]  # (b,)
    own = end - start
    if step.runs_packed(packs_passes(reference, kinds), reference.prefill_skips_layers):
        try:
            _run_packed(run, step, shared)
            return
        except cascade.NotPackedPass:
            # Nothing of the pass was kept: it runs as a batch below, and so do the model's later passes. In a
            # layer-major group the passes after it have read what it kept: the group stops, and the tree runs again.
            reference.unpack_tree_passes()
            if shared is not None:
                raise
    fed_len = int(own.max())
    # Context positions read from the cache; on the right, a short node feeds the end of its context again.
    cached = np.maximum(start - (fed_len - own), 0) if layout == "right" else start.copy()  # (b,)
    context = int(cached.max())
    b = len(nodes)
    device = reference.input_device

    ids = np.zeros((b, fed_len), dtype=np.int64)
    positions = np.zeros((b, fed_len), dtype=np.int64)
    mask = np.zeros((b, context + fed_len), dtype=np.int64)
    first = np.zeros(b, dtype=np.int64)  # the slot of each node's first own token among the fed ones
    real = np.zeros((2, b), dtype=np.int64)  # each row's real slots among the fed ones: first, count
    for k, node in enumerate(nodes):
        fed = tree.tokens(node, start=int(cached[k]))  # the node's tokens, after any end of its context fed again
        at = fed_len - len(fed) if layout == "right" else 0
        ids[k, at:at + len(fed)] = fed
        positions[k, at:at + len(fed)] = np.arange(cached[k], end[k])
        mask[k, context - cached[k]:context] = 1
        mask[k, context + at:context + at + len(fed)] = 1
        first[k] = at + start[k] - cached[k]
        real[:, k] = at, len(fed)
    # A pass without context (every row a whole sequence from position 0) where rows run packed: each row's
    # attention over its own slots alone, as packed rows compute it (packing.Spans), with no mask and no pad read.
    alone = reference.packed and context == 0
    in_place = reference.cascade and not alone
    # In a layer-major group a parent may still be to run a layer: its states are filled as each layer comes.
    template = reference.measured_cost().states if shared is not None and reference.keeps_state else None
    cache = ContextCache(kinds, context, [tree.path(node)[:-1] for node in nodes], cached, tree, kept, in_place, real,
                         template=template)
    # Descendants continue these nodes: each keeps the state its own tokens leave.
    cache.keep([(node, k, int(first[k]), int(own[k])) for k, node in enumerate(nodes) if node in parents], fed_len,
               shared)
    extra = {}
    if step.only_last and reference.prefill_skips_layers and layout == "right":
        extra["logits_to_keep"] = 1  # the last position is every row's only needed output
    with cascade.active(cache), (packing.spans(packing.Spans(*real)) if alone else nullcontext()):
        out = reference.body(input_ids=torch.from_numpy(ids).to(device),
                             attention_mask=torch.from_numpy(mask).to(device),
                             position_ids=torch.from_numpy(positions).to(device), use_cache=True,
                             **{reference.cache_argument: cache}, **extra)
    if any(getattr(layer, "pending", False) for layer in cache.layers):
        raise cascade.NotInPlace("a layer's update handed back keys that no attention call of ours read")
    hidden = out.last_hidden_state  # (b, T, H), or (b, 1, H) with logits_to_keep
    cache.finish()
    slot_of_start = first - (fed_len - hidden.shape[1])  # hidden's slot of each node's first own token
    _gather_logprobs(run, step, hidden, slot_of_start)


def _run_packed(run: TreeRun, step: Pass, shared: frozenset | None = None) -> None:
    """A pass, its nodes' own tokens end to end in one sequence with no pad and no mask (whether they continue a
    context or not):

        input_ids     [ node 0's own tokens | node 1's | ... ]   (1, N), N = the nodes' own tokens
        position_ids  [ start_0 .. end_0 - 1 | start_1 .. | ... ]

    Each node's attention is the cascade's over its own tokens and its path (window_cascade.attend_packed). Not for
    a pass that keeps only each node's last position on a model that skips layers for the rest (Pass.runs_packed):
    logits_to_keep needs every row to end at the batch's last slot."""
    reference, tree = run.reference, run.tree
    nodes = step.nodes.tolist()
    start, end = tree.start[step.nodes], tree.end[step.nodes]  # (b,)
    own = (end - start).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(own)[:-1]]).astype(np.int64)  # each node's first slot
    ids = np.concatenate([tree.tokens(node) for node in nodes]).astype(np.int64)
    positions = np.concatenate([np.arange(s, e) for s, e in zip(start, end, strict=True)]).astype(np.int64)
    segments = (offsets.tolist(), own.tolist())
    device = reference.input_device
    cache = ContextCache(run.kinds, int(start.max()), [tree.path(node)[:-1] for node in nodes], start.copy(), tree,
                         run.kept, True, None, segments)
    cache.keep([(node, 0, int(offsets[k]), int(own[k])) for k, node in enumerate(nodes) if node in run.parents],
               len(ids), shared)
    with cascade.active(cache):
        out = reference.body(input_ids=torch.from_numpy(ids)[None].to(device),
                             position_ids=torch.from_numpy(positions)[None].to(device), use_cache=True,
                             **{reference.cache_argument: cache})
    if any(getattr(layer, "pending", False) for layer in cache.layers):
        raise cascade.NotInPlace("a layer's update handed back keys that no attention call of ours read")
    hidden = out.last_hidden_state  # (1, N, H)
    cache.finish()
    _gather_logprobs(run, step, hidden, offsets, batch_rows=np.zeros(len(nodes), dtype=np.int64))


def _gather_logprobs(run: TreeRun, step: Pass, hidden: torch.Tensor, slot_of_start: np.ndarray,
                     batch_rows: np.ndarray | None = None) -> None:
    """The logprobs of every row's needed positions that fall inside this pass's nodes (node k in hidden's batch row
    batch_rows[k], k by default)."""
    tree, wanted, rows_of, results = run.tree, run.wanted, run.rows_of, run.results
    batch_row_parts: list[np.ndarray] = []
    slot_parts: list[np.ndarray] = []
    row_parts: list[np.ndarray] = []
    position_parts: list[np.ndarray] = []
    width = hidden.shape[1]
    for k, node in enumerate(step.nodes.tolist()):
        start, end = int(tree.start[node]), int(tree.end[node])
        for r in rows_of[node]:  # rows whose sequence passes through the node
            low, high = max(int(wanted.first[r]), start), min(len(tree.sequences[r]), end)
            if low >= high:
                continue
            p = np.arange(low, high)
            if wanted.needed is not None:  # a masked token is context only: no head for it
                p = p[wanted.needed[r][p - wanted.base[r]]]
            batch_row_parts.append(np.full(len(p), k if batch_rows is None else batch_rows[k]))
            slot_parts.append(slot_of_start[k] + p - start)
            row_parts.append(np.full(len(p), r))
            position_parts.append(p)
    if not batch_row_parts:
        return
    batch_row, slot, row, position = (np.concatenate(parts)
                                      for parts in (batch_row_parts, slot_parts, row_parts, position_parts))
    # One hidden state per (batch row, slot), read by every target that needs it.
    key = batch_row * width + slot
    unique, which = np.unique(key, return_inverse=True)
    selected = hidden[torch.from_numpy(unique // width).to(hidden.device),
                      torch.from_numpy(unique % width).to(hidden.device)]  # (n, H)
    offset = position - wanted.base[row]  # index into each row's response
    # Per row, not per token: the targets read and the logprobs put back a row's run at a time.
    order = np.argsort(row, kind="stable")
    runs = np.flatnonzero(np.diff(row[order], prepend=-1))  # where each row's run starts in `order`
    parts = np.split(order, runs[1:])
    targets = np.empty(len(row), dtype=np.int64)
    for part in parts:
        targets[part] = wanted.targets[int(row[part[0]])][offset[part]]
    logprobs = run.reference.head.logprobs(selected, torch.from_numpy(targets), run.temperature,
                                       rows=torch.from_numpy(which.astype(np.int64))).numpy()
    for part in parts:
        results[int(row[part[0]])][offset[part]] = logprobs[part]


def _rows_through(tree: Tree) -> list[list[int]]:
    """For each node, the rows whose sequence passes through it (and may need positions in it)."""
    through: list[list[int]] = [[] for _ in range(tree.num_nodes)]
    for row, node in enumerate(tree.end_node.tolist()):
        if node >= 0:
            for n in tree.path(node):
                through[n].append(row)
    return through
