"""What each kind of decoder layer continues a prefix from, for the prefix tree (tree.py).

One table says how (`CONTINUATIONS`), keyed by the cache layer types transformers' DynamicCache reads off a
config: an attention layer from the keys and values of every context position it can see, a linear-attention,
SSM or short-convolution layer from its recurrent state and convolution window at the prefix's last token, a
KV-shared layer from nothing of its own. A type not in the table, or a layer whose own code continues no state
(`NO_CONTINUATION`), has no tree: `layer_kinds` raises UnknownLayer, and --prefix-sharing auto runs rows whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.cache_utils import get_layer_types_and_kwargs


@dataclass(frozen=True)
class Continuation:
    """What a layer needs of a prefix to continue it exactly."""

    keys_values: str | None = None  # "full" or "sliding": the keys and values of the context positions it sees
    state: bool = False  # its recurrent state and convolution window at the context's last token
    cascade: bool = False  # plain causal attention, in full or within a window: cascade.py may attend in place


# transformers' cache layer types (cache_utils.get_layer_types_and_kwargs, as DynamicCache lays out a config),
# and how each continues a prefix. A type not here has no tree: --prefix-sharing auto runs rows whole.
CONTINUATIONS = {
    "full_attention": Continuation(keys_values="full", cascade=True),
    # The last window - 1 positions; the cascade reads them in place (window_cascade.py).
    "sliding_attention": Continuation(keys_values="sliding", cascade=True),
    # Llama 4: the chunk mask is not a window; the context stays whole and the mask picks the chunk.
    "chunked_attention": Continuation(keys_values="full"),
    "dummy": Continuation(),  # Gemma 4's KV-shared layers, Nemotron-H's MLP layers: nothing of their own
    # Gated DeltaNet (Qwen3.5, Qwen3-Next), Mamba-2 (Nemotron-H): a recurrent state and a convolution window.
    "linear_attention": Continuation(state=True),
    "conv": Continuation(state=True),  # LFM2's short convolutions: a convolution window
    "hybrid": Continuation(keys_values="full", state=True, cascade=True),  # Falcon-H1: attention and Mamba-2
    "hybrid_sliding": Continuation(keys_values="sliding", state=True),
}


# Recurrent layers whose own code continues no state over several tokens, and transformers types as
# "linear_attention" all the same: the tree refuses them by name (under auto their rows run whole).
NO_CONTINUATION = {
    # Their scan over more than one token starts from a zero state: only a one-token step reads the state.
    "MambaMixer": "Mamba-1 SSM layers, whose scan over several tokens starts from a zero state",
    "FalconMambaMixer": "Mamba-1 SSM layers, whose scan over several tokens starts from a zero state",
    "JambaMambaMixer": "Mamba-1 SSM layers, whose scan over several tokens starts from a zero state",
    "ZambaMambaMixer": "Mamba-1 SSM layers, whose scan over several tokens starts from a zero state",
    "MiniMaxLightningAttention": "lightning-attention layers, which keep their state in a cache of their own",
    "RecurrentGemmaRecurrentBlock": "RG-LRU recurrent layers, which keep their state in the layers themselves",
}


@dataclass(frozen=True)
class LayerKind:
    continuation: Continuation
    window: int | None = None  # sliding: the window, in tokens
    states: int = 1  # recurrent and convolution states the layer keeps (transformers' number_of_states)

    @property
    def sliding_window(self) -> int:
        """The window of a sliding layer, which has one."""
        if self.window is None:
            raise RuntimeError("klpipe bug: a sliding layer without its window")
        return self.window


class UnknownLayer(NotImplementedError):
    """A cache layer type the prefix tree does not know how to continue."""


def layer_kinds(model) -> list[LayerKind]:
    """How each decoder layer continues a prefix, from the layer types transformers' DynamicCache reads off
    the config; a type not in CONTINUATIONS, or a layer in NO_CONTINUATION, raises UnknownLayer."""
    for module in model.modules():
        if type(module).__name__ in NO_CONTINUATION:
            raise UnknownLayer(f"the prefix tree cannot continue {NO_CONTINUATION[type(module).__name__]} "
                               f"({type(module).__name__})")
    config = model.config.get_text_config(decoder=True)
    types, kwargs = get_layer_types_and_kwargs(config)
    kinds = []
    # transformers builds `kwargs` by zipping the types with the per-layer configs: never longer than `types`.
    for index, (kind, extra) in enumerate(zip(types, kwargs, strict=False)):
        if kind not in CONTINUATIONS:
            raise UnknownLayer(f"the prefix tree does not know how a {kind!r} cache layer (layer {index}) "
                               "continues a prefix")
        continuation = CONTINUATIONS[kind]
        window = extra.get("sliding_window") if continuation.keys_values == "sliding" else None
        kinds.append(LayerKind(continuation, window, int(extra.get("number_of_states", 1))))
    return kinds
