"""A streamed prefix tree run layer-major across its levels: every pass of a group through layer k, in tree order,
before any through k + 1, so that the weights are read once per group rather than once per level of the tree.

A pass that others continue keeps its nodes' state layer by layer (context_cache.ContextCache.keep): as it
reaches layer k + 1 (layer_major.py's `on_layer`), what its own tokens made of layer k is kept, and a pass after it
in the group reads it at layer k, within the same round. Once every pass of the group is past layer k
(`after_layer`), the nodes no later group reads hold nothing of it, and each pass frees what it made of layer k as
it leaves it. So a waiting pass holds a layer or two of keys and values, where a pass in a wave holds every
layer's until it ends, and a group of a tree's levels is sized much as a group of rows run whole; the nodes it
keeps are the tree cache's, inside the cache's own budget.

A recurrent or convolution layer (Qwen3-Next's, Falcon-H1's) starts each pass from its parents' states at the end
of their tokens: its state layers are made at the pass's start from zeros, and filled from the parents' kept
states as the pass goes on through each decoder layer (`on_layer(k, resumed=True)`, after the parents have left
it); a layer that ran unfilled raises rather than start from zeros. The keys that a later layer reuses (Gemma 4's
KV-shared layers: `owners`) are held until the group ends. A layer that reuses keys this module did not know to
hold finds them freed (cascade.FreedKeys): the tree then runs again in waves, nothing kept.
"""

from __future__ import annotations

from klpipe.model import architecture
from klpipe.model.attention import cascade
from klpipe.model.attention.context_cache import Kept
from klpipe.plan import Pass, Tree, by_tokens


def owners(reference) -> frozenset[int]:
    """The layers whose keys and values a later layer reuses: Gemma 3n's and Gemma 4's "store" layers; every layer
    where a model shares keys across layers without saying which."""
    config = architecture.text_config(reference.model.config)
    if not (getattr(config, "num_kv_shared_layers", 0) or 0):
        return frozenset()
    modes = getattr(config, "kv_sharing_modes", None)
    layers = len(reference.layer_kinds)
    if modes is None or len(modes) != layers:
        return frozenset(range(layers))
    return frozenset(k for k, mode in enumerate(modes) if mode == "store")


def groups(reference, tree: Tree, passes: list[Pass], held_by_tokens: bool,
           limit: int | None) -> list[tuple[list[Pass], list[int], int | None]]:
    """The passes in their planned order, cut into groups: (passes, the nodes released after the group, the bytes
    its passes hold while they wait; None where no budget is given). A group holds at most `limit`: fed tokens where
    `held_by_tokens` (no budget), else bytes (`held`); a pass over it goes alone. The nodes the passes keep are the
    tree cache's, inside its own budget (precompute/budget.py, at every layer's keys), not the group's."""
    size = (lambda step: fed_tokens(tree, step)) if held_by_tokens else held(reference, tree)
    sizes = [size(step) for step in passes]
    cut, at = [], 0
    for group in by_tokens(passes, sizes, limit):
        cut.append((group, [int(node) for step in group for node in step.release],
                    None if held_by_tokens else sum(sizes[at:at + len(group)])))
        at += len(group)
    return cut


def group_limit(reference) -> tuple[int | None, bool]:
    """What a streamed tree's group may hold, and whether in bytes: the room the budget gives waiting passes
    (streamer.spare) where a budget is given, else fed tokens (`stream_tokens`; None: no limit)."""
    streamer = reference.streamer
    if streamer.per_token:
        return streamer.spare, True
    return reference.stream_tokens, False


def held(reference, tree: Tree):
    """pass -> what it holds while it waits in a layer-major group (`waiting_bytes`), its keys and values those of
    the `live` layers it may hold at once: the decoder layer it is in and the one it is leaving, each with as many
    attention layers as a decoder layer holds, and the owners."""
    per_decoder = -(-len(reference.layer_kinds) // len(reference.streamer.store.layers))  # LongCat-Flash: 2
    live = min((2 * per_decoder + len(owners(reference))) * reference.kv_layer_bytes_per_token,
               reference.kv_bytes_per_token)
    return waiting_bytes(reference, tree, live)


def waiting_bytes(reference, tree: Tree, kv_per_token: int):
    """pass -> what it holds while it waits between layers in a streamed group, on the safe side: per slot of its
    batch (its nodes, each as long as the longest), the residual stream and its kin (the budget's per token,
    streamer.per_token) and `kv_per_token` bytes of keys and values (a pass in a wave keeps every layer's until it
    ends: a 44-layer model with 8 key/value heads of 128 holds 352 KiB a token in fp32, 22 times the residual
    stream; a layer-major pass a few layers'); per row, its recurrent and convolution states (every state layer's,
    from the start); where the context is gathered into the pass's slots rather than read in place (no cascade),
    the context's slots at `kv_per_token` too."""
    per_slot = reference.streamer.per_token + kv_per_token
    per_row = reference.state_tokens_per_node * reference.kv_bytes_per_token
    in_place = reference.cascade

    def pass_bytes(step: Pass) -> int:
        own = tree.end[step.nodes] - tree.start[step.nodes]  # (b,)
        rows, longest = len(own), int(own.max())
        total = rows * longest * per_slot + rows * per_row
        if not in_place:
            total += rows * int(tree.start[step.nodes].max()) * kv_per_token
        return total

    return pass_bytes


def fed_tokens(tree: Tree, step: Pass) -> int:
    """The tokens `step` feeds: its nodes' own."""
    return int((tree.end - tree.start)[step.nodes].sum())


def score(reference, tree: Tree, passes: list[Pass], parents: set, kept: dict, run_pass, check_stop) -> bool:
    """Run `passes` layer-major in groups (run_pass(step, owners) runs one, its state kept layer by layer); False
    where a layer reused keys freed here (the caller runs the tree again in waves, `reference.unlayer_tree` called)."""
    streamer = reference.streamer
    limit, budgeted = group_limit(reference)
    shared = owners(reference)
    for group, release, held_bytes in groups(reference, tree, passes, not budgeted, limit):
        fed = sum(fed_tokens(tree, step) for step in group)
        local = [node for node in release if node in parents]
        written_in: dict[int, int] = {}  # cache layer -> the decoder layer that wrote it

        def leaving(k: int, resumed: bool, written_in=written_in) -> None:
            pass_cache = cascade.running()
            if pass_cache is None:
                return
            if resumed:  # the passes before it in the group are past layer k: their states there are in
                pass_cache.fill()
                return
            for index in pass_cache.leave():
                written_in.setdefault(index, k - 1)

        def past(k: int, local=local, written_in=written_in) -> None:
            # No pass of the group reads again what decoder layers up to k wrote: the nodes only it reads hold none.
            for index in [index for index, at in written_in.items() if at <= k and index not in shared]:
                del written_in[index]
                for node in local:
                    if node in kept:
                        kept[node][index] = Kept()
        try:
            streamer.run([lambda step=step: run_pass(step, shared) for step in group], check_stop, fed, held_bytes,
                         on_layer=leaving, after_layer=past)
        except cascade.FreedKeys:
            reference.unlayer_tree()
            return False
        for node in release:
            kept.pop(node, None)
        check_stop()
    return True
