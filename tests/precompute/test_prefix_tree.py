"""The prefix tree of a chunk and the passes that run it: pure planning, checked against brute force."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from klpipe.precompute import prefix_tree
from klpipe.precompute.prefix_tree import ROOT, build_tree, needs, plan_passes, prune, split_prefixes

# Sequences over a 3-token alphabet with a common head: they share prefixes, often and unevenly.
SEQUENCES = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1, max_size=25).map(
    lambda rows: [np.array([7, 7] + r) for r in rows])


def path_tokens(tree, row) -> list[int]:
    return [int(t) for node in tree.path(int(tree.end_node[row])) for t in tree.tokens(node)]


def firsts(sequences, data) -> np.ndarray:
    """Each row's first needed position: somewhere in its sequence (its prompt's last position)."""
    return np.array([data.draw(st.integers(0, len(s) - 1)) for s in sequences], dtype=np.int64)


@given(SEQUENCES)
@settings(max_examples=300, deadline=None)
def test_the_tree_holds_every_sequence_and_shares_every_common_prefix(sequences):
    tree = build_tree(sequences)
    kids = tree.children()
    for row, sequence in enumerate(sequences):
        assert path_tokens(tree, row) == sequence.tolist()  # the path spells the row, exactly
    for node in range(1, tree.num_nodes):
        assert tree.end[node] > tree.start[node] == tree.end[tree.parent[node]]
    for node in range(tree.num_nodes):
        firsts_of_children = [int(tree.tokens(k)[0]) for k in kids[node]]
        assert len(set(firsts_of_children)) == len(firsts_of_children)  # no two children could have shared more
        if node != ROOT and not (tree.end_node == node).any():
            assert len(kids[node]) >= 2  # a node only ends where rows part or one ends
    # Brute force: the tree has a node ending at every distinct prefix length where rows part.
    assert tree.num_nodes - 1 == len({tuple(s[:tree.end[n]]) for n in range(1, tree.num_nodes)
                                      for s in [sequences[tree.rep[n]]]})


@given(SEQUENCES, st.data(), st.integers(0, 6))
@settings(max_examples=300, deadline=None)
def test_pruning_keeps_every_sequence_and_only_nodes_worth_sharing(sequences, data, cost):
    tree = build_tree(sequences)
    uses = needs(tree, firsts(sequences, data)).uses
    pruned = prune(tree, uses, context_cost=cost)
    for row, sequence in enumerate(sequences):
        assert path_tokens(pruned, row) == sequence.tolist()
    pruned_uses = needs(pruned, np.zeros(len(sequences), dtype=np.int64)).uses
    kids = pruned.children()
    for node in range(1, pruned.num_nodes):
        if kids[node]:  # a node that children continue saves more fed tokens than its contexts cost
            assert (pruned_uses[node] - 1) * (pruned.end[node] - pruned.start[node]) >= pruned_uses[node] * cost


@given(SEQUENCES, st.data())
@settings(max_examples=300, deadline=None)
def test_needs_and_split_prefixes_against_brute_force(sequences, data):
    first = firsts(sequences, data)
    tree = build_tree(sequences)
    need = needs(tree, first)
    for node in range(1, tree.num_nodes):
        start, end = tree.start[node], tree.end[node]
        wanted = {p for row, s in enumerate(sequences) if node in tree.path(int(tree.end_node[row]))
                  for p in range(first[row], len(s)) if start <= p < end}
        assert need.lowest[node] == (min(wanted) if wanted else end)
        assert need.only_last[node] == (wanted <= {end - 1})
        assert need.uses[node] == sum(node in tree.path(int(n)) for n in tree.end_node)
    split = split_prefixes(tree, need.lowest, min_prefix=2)
    after = needs(split, first)
    for row, sequence in enumerate(sequences):
        assert path_tokens(split, row) == sequence.tolist()
    for node in range(tree.num_nodes, split.num_nodes):  # the cut-off heads: only their last position needed
        assert after.only_last[node] and split.end[node] - split.start[node] > 2


@given(SEQUENCES, st.data(), st.integers(1, 60), st.integers(0, 40), st.booleans(), st.booleans(), st.integers(0, 6))
@settings(max_examples=300, deadline=None)
def test_passes_run_every_node_once_after_its_parent_within_the_budgets(sequences, data, budget, cache, split,
                                                                        exact_ends, node_tokens):
    tree = build_tree(sequences)
    only_last = needs(tree, firsts(sequences, data)).only_last
    passes = plan_passes(tree, only_last, budget, cache, split_by_need=split, exact_ends=exact_ends,
                         node_tokens=node_tokens)
    ran = [int(n) for p in passes for n in p.nodes]
    assert sorted(ran) == list(range(1, tree.num_nodes))  # every node once
    done, live, released = {ROOT}, {}, set()
    kids = tree.children()
    length = tree.end - tree.start
    chain = max((sum(length[a] + node_tokens for a in tree.path(n) if kids[a]) for n in range(tree.num_nodes)),
                default=0)
    for p in passes:
        nodes = p.nodes.tolist()
        for node in nodes:
            assert tree.parent[node] in done  # after its parent
            assert all(a in live for a in tree.path(int(tree.parent[node])))  # its context is still kept
        if split:
            assert len({bool(only_last[n]) for n in nodes}) == 1
        if exact_ends:  # a node that others continue ends at its pass's last position: no pads after it
            assert all(length[n] == length[nodes].max() for n in nodes if kids[n])
        assert p.only_last == bool(only_last[nodes].all())
        held = -(-tree.start[nodes] // prefix_tree.HELD_POSITIONS_PER_TOKEN)
        assert len(nodes) * int((length[nodes] + held).max()) <= budget or len(nodes) == 1
        done.update(nodes)
        live.update({n: int(length[n]) + node_tokens for n in nodes if kids[n]})
        # The keys and values kept at once: the budget, unless one chain of nodes is longer on its own.
        assert sum(live.values()) <= max(cache, chain) + int(length[nodes].max()) + node_tokens
        for node in p.release:
            assert all(d in done for d in descendants(kids, node))  # only once every descendant ran
            released.add(node)
            del live[node]
    assert released == {n for n in range(1, tree.num_nodes) if kids[n]}  # every kept node is let go


def descendants(kids, node) -> list[int]:
    found, stack = [], list(kids[node])
    while stack:
        n = stack.pop()
        found.append(n)
        stack.extend(kids[n])
    return found


def test_an_agent_day_and_multi_turn_histories_by_hand():
    system = list(range(100, 140))  # 40 tokens in every row
    rows = [system + [1, 2, 3] + [9, 9], system + [1, 2, 3] + [8], system + [4, 5] + [7, 7, 7],
            system, system + [1, 2, 3] + [9, 9] + [6, 6]]  # the last continues the first: turn two
    tree = build_tree([np.array(r) for r in rows])
    spans = sorted((int(tree.start[n]), int(tree.end[n])) for n in range(1, tree.num_nodes))
    # system; the first task; its two answers (one continued by turn two); the second task; turn two's tail.
    assert spans == [(0, 40), (40, 43), (40, 45), (43, 44), (43, 45), (45, 47)]
    assert tree.end_node[3] == next(n for n in range(1, tree.num_nodes) if tree.end[n] == 40)  # the bare system


@given(st.lists(st.tuples(st.integers(1, 80), st.integers(0, 300)), min_size=1, max_size=30), st.integers(1, 400),
       st.sampled_from([0.0, 5e-4, 3e-3]))
@settings(max_examples=300, deadline=None)
def test_a_level_is_cut_into_passes_within_the_budget(nodes, budget, attention):
    length, context = (np.array(column, dtype=np.int64) for column in zip(*nodes, strict=True))
    passes = prefix_tree.cut_level(length, context, budget, attention)
    assert sorted(i for p in passes for i in p.tolist()) == list(range(len(nodes)))  # every node once
    for p in passes:
        held = -(-context[p].max() // prefix_tree.HELD_POSITIONS_PER_TOKEN)
        assert len(p) * (length[p].max() + held) <= budget or len(p) == 1


def test_rows_that_continue_different_contexts_are_not_padded_to_each_other():
    # Two GRPO groups, prompts of 256 and 768 tokens, responses of 20: priced by length alone they make
    # one pass (16 × (20 + 768 / 8) fits 2048), where the short prompt's rows would attend to 512
    # positions of padding each: 8 × 20 × 512 × 3e-3 = 246 fed tokens' worth, more than a pass costs (128).
    length = np.full(16, 20)
    context = np.array([256] * 8 + [768] * 8)
    passes = prefix_tree.cut_level(length, context, max_tokens=2048, attention=3e-3)
    assert sorted(sorted(set(context[p].tolist())) for p in passes) == [[256], [768]]
    assert len(prefix_tree.cut_level(length, context, max_tokens=2048, attention=0.0)) == 1
