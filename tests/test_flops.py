"""benchmarks/flops.py: the FLOPs a method needs, held against hand counts and brute force."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

# benchmarks/ is scripts, not a package: load the module from its file (dataclasses need it in sys.modules).
_SPEC = importlib.util.spec_from_file_location("benchmarks_flops",
                                               Path(__file__).resolve().parent.parent / "benchmarks" / "flops.py")
flops = sys.modules.setdefault("benchmarks_flops", importlib.util.module_from_spec(_SPEC))
_SPEC.loader.exec_module(flops)

# hidden 8, 2 query heads and 1 KV head of dim 4, FFN 16, 2 layers, vocabulary 10.
TINY = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16,
        "num_hidden_layers": 2, "vocab_size": 10}
# Per layer: q and o 8 x 8 each, k and v 8 x 4 each, gate, up and down 8 x 16 each: 576 weights.
LINEAR = 2 * 576
PAIR = 4 * 2 * 4  # QK^T and AV: 2 x head dim each, per query head
HEAD = 2 * 8 * 10


def brute_pairs(context: int, length: int, window: int | None) -> int:
    """The causal (and sliding) mask's ones, counted one by one."""
    queries = np.arange(context, context + length)[:, None]
    keys = np.arange(context + length)[None, :]
    allowed = keys <= queries
    if window is not None:
        allowed &= queries - keys < window
    return int(allowed.sum())


def test_causal_pairs_by_hand():
    assert flops.causal_pairs(0, 4) == 1 + 2 + 3 + 4
    assert flops.causal_pairs(3, 2) == 4 + 5  # two queries after three context positions
    assert flops.causal_pairs(0, 5, window=3) == 1 + 2 + 3 + 3 + 3
    assert flops.causal_pairs(1, 3, window=3) == 2 + 3 + 3
    assert flops.causal_pairs(4, 2, window=3) == 3 + 3
    assert flops.causal_pairs(7, 0) == 0


@pytest.mark.parametrize("window", [None, 1, 3, 8])
def test_causal_pairs_match_the_mask(window):
    for context in range(12):
        for length in range(12):
            assert flops.causal_pairs(context, length, window) == brute_pairs(context, length, window)


def test_model_flops_from_a_config_by_hand():
    model = flops.ModelFlops.from_config(TINY)
    assert [layer.linear for layer in model.layers] == [LINEAR, LINEAR]
    assert [layer.attention for layer in model.layers] == [PAIR, PAIR]
    assert [layer.window for layer in model.layers] == [None, None]
    assert model.head == HEAD
    # One row of prompt 3 + response 2: 4 tokens fed, pairs 1 + 2 + 3 + 4, two scored tokens.
    row = model.method(flops.per_row([[1, 2, 3]], [[4, 5]]), scored_tokens=2)
    assert row == flops.Flops(linear=2 * LINEAR * 4, attention=2 * PAIR * 10, head=HEAD * 2)
    assert row.total == row.linear + row.attention + row.head


def test_linear_flops_are_twice_the_weights_of_a_real_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**TINY))
    weights = sum(m.weight.numel() for m in model.model.modules() if isinstance(m, torch.nn.Linear))
    counted = flops.ModelFlops.from_config(model.config)
    assert sum(layer.linear for layer in counted.layers) == 2 * weights
    assert counted.head == 2 * model.lm_head.weight.numel()


def test_sliding_layers_from_layer_types():
    config = {**TINY, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}
    model = flops.ModelFlops.from_config(config)
    assert [layer.window for layer in model.layers] == [3, None]
    got = model.segment(flops.Segment(context=0, length=5))
    assert got.attention == PAIR * (1 + 2 + 3 + 3 + 3) + PAIR * (1 + 2 + 3 + 4 + 5)
    qwen = {**TINY, "sliding_window": 3, "use_sliding_window": False}  # a window given but not used
    assert flops.ModelFlops.from_config(qwen).layers[0].window is None


def test_a_skippable_layer_runs_only_the_last_position_of_an_only_last_segment():
    model = flops.ModelFlops((flops.Layer(10.0, 1.0), flops.Layer(100.0, 2.0, skippable=True)), head=0.0)
    got = model.segment(flops.Segment(context=2, length=3, only_last=True))
    assert got.linear == 10 * 3 + 100 * 1
    assert got.attention == 1 * (3 + 4 + 5) + 2 * 5  # the last query sees all 5 positions
    assert model.segment(flops.Segment(2, 3)).linear == 110 * 3


def test_methods_by_hand():
    system = list(range(100, 200))  # 100 tokens two rows share
    prompts = [system, system, [7, 8]]
    responses = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    assert flops.per_row(prompts, responses) == [flops.Segment(0, 102), flops.Segment(0, 104), flops.Segment(0, 2)]
    assert sorted(flops.whole_prompt(prompts, responses), key=lambda s: (s.context, s.length)) == [
        flops.Segment(0, 2), flops.Segment(0, 100), flops.Segment(100, 2), flops.Segment(100, 4)]
    # The tree: the system prompt once, each response continuing it; the unrelated row runs whole.
    tree = sorted(flops.tree(prompts, responses), key=lambda s: (s.context, s.length))
    assert tree == [flops.Segment(0, 2), flops.Segment(0, 100), flops.Segment(100, 2), flops.Segment(100, 4)]
    assert flops.fed_tokens(tree) == 108 and flops.fed_tokens(flops.per_row(prompts, responses)) == 208
    model = flops.ModelFlops.from_config(TINY)
    saved = model.method(flops.per_row(prompts, responses), 9).attention - model.method(tree, 9).attention
    assert saved == 2 * PAIR * (100 * 101 // 2)  # per row, the second row's prompt pairs again
    assert flops.tree(prompts, responses, sharing="off") == flops.per_row(prompts, responses)


def test_a_row_without_a_response_needs_nothing():
    assert flops.per_row([[1, 2]], [[]]) == []
    assert flops.tree([[1, 2]], [[]]) == []
    assert flops.ModelFlops.from_config(TINY).method([], 0) == flops.Flops()
