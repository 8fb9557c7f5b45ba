"""The plan of a chunk: the contract between planning (precompute/prefix_tree.py) and running (model/attention/tree.py).

precompute/ builds these and model/ runs them; both import them from here, below both, as both stages read
the cache's contract from cache.py. Pure numpy: importing this module never pulls in torch.

    Tree    the radix tree over a chunk's fed token sequences: each node a span of tokens its rows share
    Pass    one forward: the nodes that run side by side, and whose state is done with after it
    Wanted  the positions of each row whose hidden states the chunk needs, and their target tokens
    fed     what one row feeds the model (both sides use it, so the rule is written once)
    by_tokens  passes or batches cut into the groups a streamed model runs layer-major (both sides cut so)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

T = TypeVar("T")

ROOT = 0  # node 0 is the empty prefix: no tokens, never run


@dataclass
class Tree:
    """A radix tree over token sequences. Node 0 is the root; every other node is a span of tokens.

    A node's tokens are `sequences[rep[n]][start[n]:end[n]]`: positions `start..end` of the path
    from the root, which every row below the node shares.
    """

    sequences: list[np.ndarray]  # (rows,) the fed token ids of each row
    parent: np.ndarray  # (nodes,) int64; the root is its own parent
    start: np.ndarray  # (nodes,) int64 path position of the node's first token
    end: np.ndarray  # (nodes,) int64 path position after its last token
    rep: np.ndarray  # (nodes,) int64 a row whose sequence passes through the node
    end_node: np.ndarray  # (rows,) int64 the node where each row's sequence ends; -1 for an empty one

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    def tokens(self, node: int, start: int | None = None) -> np.ndarray:
        """The node's tokens, or the path's tokens from `start` to the node's end."""
        path: np.ndarray = self.sequences[self.rep[node]]
        return path[self.start[node] if start is None else start:self.end[node]]

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for node in range(1, self.num_nodes):
            kids[self.parent[node]].append(node)
        return kids

    def path(self, node: int) -> list[int]:
        """The nodes from the root's first child down to `node`."""
        nodes = []
        while node != ROOT:
            nodes.append(node)
            node = int(self.parent[node])
        return nodes[::-1]


@dataclass
class Pass:
    """One forward: its nodes side by side, each continuing its parent's state, in the layout model/attention/tree.py
    picks."""

    nodes: np.ndarray  # (rows,) node ids
    only_last: bool  # no node needs more than its last position's output
    release: list[int] = field(default_factory=list)  # nodes whose keys and values are done with after it

    def runs_packed(self, packs_passes: bool, prefill_skips_layers: bool) -> bool:
        """Whether model/attention/tree.py runs this pass packed (its nodes' own tokens end to end, no pad) on a model
        that `packs_passes`. All but one kind do, context or none: a pass that needs only each node's last position on a
        model that skips layers for the rest (Gemma 4's KV-shared layers, under logits_to_keep = 1) keeps the right
        layout, whose rows must all end at the batch's last slot. The plan's counts (precompute/logprobs.py) and
        the run read this one rule."""
        return packs_passes and not (self.only_last and prefill_skips_layers)


@dataclass
class Wanted:
    """The hidden states a chunk's rows need: row r, positions base[r] + j for each response token j that
    needed[r] marks (all of them without a mask), all between first[r] and len(sequence r) - 1."""

    first: np.ndarray  # (rows,) int64 the first needed position, which the planner runs from
    base: np.ndarray  # (rows,) int64 the position that predicts response token 0: the prompt's length − 1
    targets: list[np.ndarray]  # (rows,) the row's response: position base + j predicts targets[j]
    needed: list[np.ndarray] | None = None  # (rows,) bool per response token: the logprobs to compute


def fed(prompt: np.ndarray, response: np.ndarray, wanted: np.ndarray, rope_limit: int | None) -> np.ndarray:
    """What a row feeds the model, `wanted` its response indices to score (ascending): the prompt and the response up
    to its last scored token, less that token, which is only ever a target; nothing when none is scored.

    But a long RoPE takes its frequencies from the row's length, past `rope_limit` (architecture.rope_length_limit): the
    row's own forward over prompt + response uses the long ones as soon as the whole row is longer, so such a row is
    fed whole, or cut one token (or a masked tail) short it would get the short ones: a silently wrong logprob.
    """
    if not len(wanted):
        return prompt[:0]
    if rope_limit is not None and len(prompt) + len(response) > rope_limit:
        return np.concatenate([prompt, response])
    return np.concatenate([prompt, response[:int(wanted[-1])]])


def by_tokens(items: list[T], sizes: list[int], limit: int | None) -> list[list[T]]:
    """`items` in their order, cut into groups of at most `limit` fed tokens by their `sizes` (an item over it goes
    alone); None: one group. A streamed model runs each group layer-major, its activations waiting between layers."""
    groups: list[list[T]] = []
    tokens = 0
    for item, size in zip(items, sizes, strict=True):
        if not groups or (limit is not None and tokens + size > limit):
            groups.append([])
            tokens = 0
        groups[-1].append(item)
        tokens += size
    return groups
