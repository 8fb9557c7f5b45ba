"""The prefix tree of a chunk: every distinct prefix of the rows' token sequences, computed once.

Pure index arithmetic (numpy), no torch: model/attention/tree.py runs the passes this module plans, and the plan's
types (Tree, Pass) live below both, in klpipe/plan.py.

A row feeds the model its prompt and its response less the last token (that one is only ever a
target), and needs the hidden states at the positions that predict its response tokens. The rows of
a chunk form a token tree over what they feed: a GRPO group shares its prompt, every task of an
agent's day shares a system prompt, and turn k of a multi-turn trajectory (a row per turn, the
prompt holding the history) is a prefix of turn k + 1. Each node of the tree holds the tokens its
rows share beyond its parent; computing each node once, continuing its parent's keys and values,
computes every distinct prefix once.

    build_tree     the radix tree of the rows' fed sequences (sorted, then longest common prefixes)
    prune          fold away nodes whose sharing costs more than it saves
    split_prefixes where the model skips layers for positions whose output nobody needs (Gemma 4's
                   KV-shared layers), cut a node where its needed positions begin
    plan_passes    which nodes run together, level by level, within the token budget, and when each
                   node's keys and values can be dropped, within the cache budget

The plan depends only on the chunk's rows and the budgets, so resumed and sharded runs reproduce
an uninterrupted run bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from klpipe.plan import ROOT, Pass, Tree
from klpipe.precompute.length_batches import cheapest_cut, within_budget

# A pass charges one budget token for every this many context positions a row attends to. Those
# positions are held as keys and values, gathered one layer at a time, while a fed token carries
# every activation of a layer: for GQA models a held position costs far less memory (about 1/13 for
# the benchmark Llama, 1/20 to 1/40 for Gemma 4 E2B, 1/23 for Llama 3 8B), so 1/8 is a conservative
# price. Charging them in full made passes of 2-3 rows and cost ~5-10% on CPU.
HELD_POSITIONS_PER_TOKEN = 8

# A node is shared only where that saves more than it costs: every row that continues a context pays
# about this many fed tokens' worth for it (gathering the context's keys and values, a masked
# attention where a row run whole gets the causal kernel with no mask, a share of one more pass).
# A node on the paths of u rows, ℓ tokens long, saves (u − 1)·ℓ fed tokens and costs u of these;
# unique prompts, which share only their BOS token, run whole. Measured with make bench.
CONTEXT_COST = 16

# Where the model skips layers for positions whose output nobody needs, a run of at least this many
# such positions before a node's first needed position is cut off into a node of its own.
MIN_SKIPPED_PREFIX = 16


def build_tree(sequences: list[np.ndarray]) -> Tree:
    """The radix tree of `sequences`, exactly: identical tokens share a node, never a hash of them.

    Sorting the sequences lexicographically puts every sequence next to the ones it shares the most
    with; the longest common prefix of each neighbouring pair then gives the tree in one pass (the
    way a suffix tree is built from a suffix array), with no Python loop over tokens.
    """
    rows = len(sequences)
    # Big-endian fixed-width bytes sort as the token sequences do, a prefix before its extensions.
    order = sorted(range(rows), key=lambda i: np.asarray(sequences[i], dtype=">u4").tobytes())
    parent, start, end, rep = [ROOT], [0], [0], [-1]
    end_node = np.full(rows, -1, dtype=np.int64)
    stack = [ROOT]  # the path from the root to the previous sequence's node
    previous = None
    for row in order:
        sequence = sequences[row]
        length = len(sequence)
        if length == 0:
            continue
        shared = 0 if previous is None else _common_prefix(previous, sequence)
        popped = None
        while end[stack[-1]] > shared:
            popped = stack.pop()
        top = stack[-1]
        if end[top] < shared:
            # The previous node goes deeper than the shared part: split it where they part.
            middle = len(parent)
            assert popped is not None  # the previous sequence's node ends past `shared`, so it was popped
            parent.append(top)
            start.append(end[top])
            end.append(shared)
            rep.append(rep[popped])
            parent[popped], start[popped] = middle, shared
            stack.append(middle)
            top = middle
        if length > shared:
            leaf = len(parent)
            parent.append(top)
            start.append(shared)
            end.append(length)
            rep.append(row)
            stack.append(leaf)
            end_node[row] = leaf
        else:  # the same sequence as the previous one (a prefix would have sorted before it)
            end_node[row] = top
        previous = sequence
    return Tree(list(sequences), np.array(parent), np.array(start), np.array(end), np.array(rep), end_node)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


@dataclass
class Needs:
    """The positions whose hidden states the rows need, node by node.

    Row r needs positions `first[r] .. len(sequences[r]) - 1`: position p predicts token p + 1 of
    the row's prompt + response, so the first is the prompt's last position.
    """

    first: np.ndarray  # (rows,) int64 first needed position of each row
    lowest: np.ndarray  # (nodes,) int64 the lowest needed position inside each node; end if none
    only_last: np.ndarray  # (nodes,) bool the node's last position is the only one any row needs
    uses: np.ndarray  # (nodes,) int64 rows whose sequence passes through the node


def needs(tree: Tree, first: np.ndarray) -> Needs:
    lowest = tree.end.copy()
    only_last = np.ones(tree.num_nodes, dtype=bool)
    uses = np.zeros(tree.num_nodes, dtype=np.int64)
    for row, node in enumerate(tree.end_node):
        if node < 0:
            continue
        for n in tree.path(int(node)):
            uses[n] += 1
            low = max(int(first[row]), int(tree.start[n]))
            high = min(len(tree.sequences[row]), int(tree.end[n]))  # this row's positions in the node
            if low < high:
                lowest[n] = min(lowest[n], low)
                if low < tree.end[n] - 1:
                    only_last[n] = False
    return Needs(first=first, lowest=lowest, only_last=only_last, uses=uses)


def prune(tree: Tree, uses: np.ndarray, context_cost: int = CONTEXT_COST) -> Tree:
    """Fold every node whose sharing saves less than it costs into its children.

    A node on the paths of u rows, ℓ tokens long, saves (u − 1)·ℓ fed tokens and costs u contexts
    of `context_cost` each. A folded node's children take its tokens as their own first tokens; if
    rows end in it, it stays, as a leaf of those rows alone.
    """
    parent, start = tree.parent.copy(), tree.start.copy()
    kids = tree.children()
    rows_ending = np.bincount(tree.end_node[tree.end_node >= 0], minlength=tree.num_nodes)
    removed = np.zeros(tree.num_nodes, dtype=bool)
    queue = list(kids[ROOT])
    while queue:  # top down: a child decides with the tokens it took from a folded parent
        node = queue.pop()
        saved = (uses[node] - 1) * (tree.end[node] - start[node])
        if kids[node] and saved < uses[node] * context_cost:
            for child in kids[node]:
                parent[child], start[child] = parent[node], start[node]
            queue.extend(kids[node])
            kids[node] = []
            removed[node] = rows_ending[node] == 0
        else:
            queue.extend(kids[node])
    return _renumber(tree, parent, start, removed)


def split_prefixes(tree: Tree, lowest: np.ndarray, min_prefix: int = MIN_SKIPPED_PREFIX) -> Tree:
    """Cut each node whose first `min_prefix` or more positions nobody needs, so that they form a node of
    their own whose only needed output is its last position (a model that skips layers for the rest
    then runs them on that position alone). Call `needs` again on the result."""
    parent, start, end, rep = (list(map(int, a)) for a in (tree.parent, tree.start, tree.end, tree.rep))
    for node in range(1, tree.num_nodes):
        cut = int(lowest[node]) + 1  # the first needed position stays the new node's last
        if cut - start[node] > min_prefix and cut < end[node]:
            parent.append(parent[node])
            start.append(start[node])
            end.append(cut)
            rep.append(rep[node])
            parent[node], start[node] = len(parent) - 1, cut  # children and rows stay with the second half
    return Tree(tree.sequences, np.array(parent), np.array(start), np.array(end), np.array(rep), tree.end_node)


def _renumber(tree: Tree, parent: np.ndarray, start: np.ndarray, removed: np.ndarray) -> Tree:
    keep = np.flatnonzero(~removed)
    number = np.full(tree.num_nodes, -1, dtype=np.int64)
    number[keep] = np.arange(len(keep))
    end_node = np.where(tree.end_node >= 0, number[np.maximum(tree.end_node, 0)], -1)
    return Tree(tree.sequences, number[parent[keep]], start[keep], tree.end[keep], tree.rep[keep], end_node)


# -- the passes -------------------------------------------------------------------------------------


def plan_passes(tree: Tree, only_last: np.ndarray, max_tokens: int, max_cache_tokens: int,
                split_by_need: bool, attention: float = 0.0, exact_ends: bool = False,
                node_tokens: int = 0) -> list[Pass]:
    """Every node but the root in passes that respect the budgets, each after its parent's.

    Subtrees are taken in waves whose inner nodes' keys and values fit `max_cache_tokens`, each wave
    level by level (the widest batches that the cache allows). A subtree too big for the cache on
    its own runs its top node, then its children's subtrees in waves of their own; a single node
    longer than either budget still runs, alone. Within a level, nodes are cut into passes by the
    token budget, pricing attention at `attention` fed tokens per position attended (`cut_level`).
    With `split_by_need`, nodes that need only their last position run in passes of their own.
    With `exact_ends` (a model whose recurrent layers hand on only the state after a pass's last
    position), a node that others continue runs only with nodes no longer than itself: nodes with
    children run in passes of one length each, leaves wherever they fit. Each kept node costs
    `node_tokens` of the cache budget beyond its length (its recurrent and convolution states).
    """
    kids = tree.children()
    length = tree.end - tree.start
    inner = _inner_tokens(kids, length, node_tokens)
    passes: list[Pass] = []
    continued = np.array([bool(k) for k in kids], dtype=bool)

    def run_level(level: list[int]) -> None:
        nodes = np.asarray(level, dtype=np.int64)
        groups = [nodes[only_last[nodes]], nodes[~only_last[nodes]]] if split_by_need else [nodes]
        if exact_ends:
            groups = [part for group in groups for part in _by_exact_end(group, length, continued)]
        for group in groups:
            if len(group):
                for batch in cut_level(length[group], tree.start[group], max_tokens, attention):
                    passes.append(Pass(nodes=group[batch], only_last=bool(only_last[group[batch]].all())))

    def run_wave(roots: list[int]) -> None:
        level = roots
        while level:
            run_level(level)
            level = [child for node in level for child in kids[node]]

    def schedule(roots: list[int], budget: int) -> None:
        wave: list[int] = []
        held = 0
        for root in roots:
            if inner[root] > budget:  # too big for the cache as a whole
                if wave:
                    run_wave(wave)
                wave, held = [], 0
                run_level([root])
                schedule(kids[root], max(budget - int(length[root]) - node_tokens, 0))
            elif held + inner[root] > budget:
                run_wave(wave)
                wave, held = [root], int(inner[root])
            else:
                wave.append(root)
                held += int(inner[root])
        if wave:
            run_wave(wave)

    schedule(kids[ROOT], max_cache_tokens)
    # A node's keys and values are part of every descendant's context: it is done with after the
    # last pass that runs one of them.
    last = {}
    for index, p in enumerate(passes):
        for node in p.nodes.tolist():
            for ancestor in tree.path(int(tree.parent[node])):
                last[ancestor] = index
    for node, index in sorted(last.items()):
        passes[index].release.append(node)
    return passes


def cut_level(length: np.ndarray, context: np.ndarray, max_tokens: int, attention: float = 0.0,
              batch_cost: int | None = None) -> list[np.ndarray]:
    """Cut one level's nodes into passes: lists of indices into `length` and `context` (their path's start).

    A pass pads every row to its longest node and its deepest context, so what it really costs, in
    fed-token equivalents, is b rows × longest × (1 + `attention` × (deepest + longest / 2)): each
    padded token's layers, and the context positions and earlier tokens it attends to, at `attention`
    fed tokens each (the model's attention FLOPs per position over its linear FLOPs per token), plus
    `batch_cost` per pass (default max_tokens / 16). Its memory, b × (longest + deepest /
    HELD_POSITIONS_PER_TOKEN), must fit `max_tokens` unless a node is alone. Nodes are sorted (deepest
    context first, or longest first) and cut by dynamic programming; the cheaper of the two plans
    wins. Cutting by length alone mixed contexts of 256 and 768 tokens in one pass and left 44% of
    GRPO-shaped rows' attention scores padding.
    """
    if batch_cost is None:
        batch_cost = max_tokens // 16
    plans = [_cut(np.lexsort((-length, -context)), length, context, max_tokens, attention, batch_cost),
             _cut(np.lexsort((-context, -length)), length, context, max_tokens, attention, batch_cost)]
    return min(plans, key=lambda plan: plan[0])[1]


def _cut(order: np.ndarray, length: np.ndarray, context: np.ndarray, max_tokens: int, attention: float,
         batch_cost: int) -> tuple[float, list[np.ndarray]]:
    """(cost, passes): the cheapest cut of nodes in `order` into consecutive passes."""
    size = np.maximum(length[order], 1).astype(np.float64)
    depth = context[order].astype(np.float64)

    def last_pass(j: int) -> np.ndarray:  # the cost of sorted nodes [start, j) as one pass, every start
        longest = np.maximum.accumulate(size[:j][::-1])[::-1]
        deepest = np.maximum.accumulate(depth[:j][::-1])[::-1]
        rows = j - np.arange(j)
        memory = rows * (longest + np.ceil(deepest / HELD_POSITIONS_PER_TOKEN))
        return within_budget(rows * longest * (1.0 + attention * (deepest + longest / 2)) + batch_cost,
                             memory, rows, max_tokens)

    return cheapest_cut(order, last_pass)


def _by_exact_end(nodes: np.ndarray, length: np.ndarray, continued: np.ndarray) -> list[np.ndarray]:
    """`nodes` in groups where no continued node is shorter than another node: one group per length of the
    continued nodes, each with the leaves no longer than it (the longest first), then the other leaves."""
    groups, leaves = [], nodes[~continued[nodes]]
    for size in sorted(set(length[nodes[continued[nodes]]].tolist()), reverse=True):
        fits = length[leaves] <= size
        groups.append(np.concatenate([nodes[continued[nodes] & (length[nodes] == size)], leaves[fits]]))
        leaves = leaves[~fits]
    return groups + [leaves]


def _inner_tokens(kids: list[list[int]], length: np.ndarray, node_tokens: int = 0) -> np.ndarray:
    """Tokens of the nodes with children in each subtree (each `node_tokens` more): the most its kept state
    holds at once."""
    inner = np.zeros(len(kids), dtype=np.int64)
    order, stack = [], [ROOT]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(kids[node])
    for node in reversed(order):  # children before parents
        inner[node] = (length[node] + node_tokens if kids[node] else 0) + sum(inner[k] for k in kids[node])
    return inner
