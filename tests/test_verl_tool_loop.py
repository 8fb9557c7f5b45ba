"""Conversational tool rows against verl's own tool agent loop rendering (`--rollout-format verl`).

verl 0.9's ToolAgentLoop builds its token stream with a Continuous Token builder
(verl/utils/tokenizer/continuous_token.py, chosen by the model's config.json model_type): the prompt rendered with
the generation prompt, each sampled turn appended as the engine returned it (mask 1), each group of tool results
appended as the builder renders it (mask 0). This test drives verl's own builder, installed by make test-trl, on the
same scripted trajectories as tests/trl_loop.py, and holds klpipe's prompt_ids, response_ids and mask to it token
for token. Only the engine's sampling is a stand-in: it emits what the template renders for the scripted turn, up to
and including its first stop token.

verl's package __init__ imports ray (its DataProto); the builder's modules import only transformers, so the test
loads them under bare `verl` and `verl.utils` package entries that skip those two __init__ files. Every line run is
verl's own. make test-trl installs the wheel into a folder of its own (VERL_DIR, default .venv/verl), never into the
venv's site-packages: the wheel ships a top-level `tests` package that would shadow this one.
"""

import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from klpipe.precompute.chat import ChatError, ChatRenderer
from tests import trl_loop

pytestmark = pytest.mark.trl  # make test-trl installs verl


def verl_builder_factory():
    root = Path(os.environ.get("VERL_DIR", Path(sys.prefix) / "verl")) / "verl"
    if not (root / "utils" / "tokenizer" / "continuous_token.py").is_file():
        pytest.fail(f"verl is not installed in {root.parent}: run make test-trl, which installs it")
    for name, path in (("verl", root), ("verl.utils", root / "utils")):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    return create_continuous_token_builder


# (TRL's template file, the model_type of the model it belongs to): verl picks its builder by the model_type.
CASES = [("qwen2_5", "qwen2"), ("qwen3", "qwen3"), ("qwen3_instruct_2507", "qwen3_moe"), ("llama3_1", "llama")]
# Where verl 0.9.1's rows are not TRL 1.16's: Qwen3's hub template fails TRL's prefix check (TRL swaps in its
# training template), while verl renders its stand-in call with reasoning and the tools, which that template keeps.
# Elsewhere the two loops build the same tokens and mask.
TRL_REFUSES = {"qwen3"}
TOOLS = {tool.__name__: tool for tool in trl_loop.TOOLS}


def sampled(tokenizer, stops, history, message) -> list[int]:
    """The stand-in engine: what the template renders for `message` after the generation prompt, to the first stop."""
    def ids(messages, **options):
        return tokenizer.apply_chat_template(messages, tools=trl_loop.TOOL_SCHEMAS, tokenize=False, **options)
    header = tokenizer(ids(history, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    own = tokenizer(ids(history + [message]), add_special_tokens=False)["input_ids"]
    rest = own[len(os.path.commonprefix([header, own])):]
    return rest[: next(i for i, token in enumerate(rest) if token in stops) + 1]


def verl_loop(builder, tokenizer, stops, turns) -> dict:
    """verl's ToolAgentLoop state machine, its token handling step by step (`_handle_pending_state`,
    `_handle_generating_state`, `_handle_processing_tools_state`): every token and mask from verl's builder."""
    messages = list(trl_loop.PROMPT)
    ids = builder.build_initial_tokens(messages, tools=trl_loop.TOOL_SCHEMAS)
    mask, completion = [], []
    for turn in turns:
        merge = builder.merge_assistant_tokens(ids, sampled(tokenizer, stops, messages, turn))
        mask, _ = builder.align_response_metadata(merge, mask)
        ids = merge.token_ids
        messages.append(turn)
        completion.append(turn)
        if not turn.get("tool_calls"):
            break
        previous = list(messages)
        results = [{"role": "tool", "content": TOOLS[c["function"]["name"]](**c["function"]["arguments"])}
                   for c in turn["tool_calls"]]  # verl's tool message: role and content (no name, no call id here)
        messages += results
        completion += results
        merge = builder.merge_context_tokens(previous, messages, ids, tools=trl_loop.TOOL_SCHEMAS)
        mask, _ = builder.align_response_metadata(merge, mask)
        ids = merge.token_ids
    return {"prompt_ids": ids[: len(ids) - len(mask)], "response_ids": ids[len(ids) - len(mask):], "mask": mask,
            "completion": completion}


@pytest.mark.parametrize("name, model_type", CASES)
def test_rows_equal_verls_own_builder_token_for_token(name, model_type):
    create = verl_builder_factory()
    tokenizer = trl_loop.build_tokenizer(name)
    stops = set(trl_loop.stop_ids(tokenizer, name)) | {tokenizer.eos_token_id}
    builder = create(tokenizer, hf_model_type=model_type)
    klpipe = ChatRenderer(tokenizer, "prompt", "completion", tools=trl_loop.TOOL_SCHEMAS, stop_ids=stops,
                          rollout_format="verl", model_type=model_type)
    trl_style = ChatRenderer(tokenizer, "prompt", "completion", tools=trl_loop.TOOL_SCHEMAS, stop_ids=stops)
    differs_from_trl = []
    for trajectory, turns in trl_loop.TRAJECTORIES.items():
        if name.startswith("llama") and trajectory == "parallel calls":
            continue  # Llama's template raises on parallel calls: no such row exists
        loop = verl_loop(builder, tokenizer, stops, turns)
        assert any(m["role"] == "tool" for m in loop["completion"])
        prompts, responses, masks = klpipe.render([list(trl_loop.PROMPT)], [loop["completion"]])
        assert prompts[0] == loop["prompt_ids"], trajectory
        assert responses[0] == loop["response_ids"], (trajectory, tokenizer.decode(responses[0]),
                                                      tokenizer.decode(loop["response_ids"]))
        assert masks[0].tolist() == [bool(m) for m in loop["mask"]], trajectory
        assert 0 < int(np.count_nonzero(masks[0])) < len(masks[0])
        named = [dict(m, name="weather") if m["role"] == "tool" else m for m in loop["completion"]]  # TRL names them
        try:
            _, trl_responses, trl_masks = trl_style.render([list(trl_loop.PROMPT)], [named])
        except ChatError:
            differs_from_trl.append((trajectory, "refused as TRL"))
            continue
        if trl_responses[0] != responses[0] or trl_masks[0].tolist() != masks[0].tolist():
            differs_from_trl.append((trajectory, tokenizer.decode(trl_responses[0]), tokenizer.decode(responses[0])))
    expected = [(t, "refused as TRL") for t in trl_loop.TRAJECTORIES] if name in TRL_REFUSES else []
    assert differs_from_trl == expected


def test_a_model_type_with_its_own_verl_builder_is_refused_in_one_line():
    tokenizer = trl_loop.build_tokenizer("gemma4")
    stops = set(trl_loop.stop_ids(tokenizer, "gemma4"))
    klpipe = ChatRenderer(tokenizer, "prompt", "completion", tools=trl_loop.TOOL_SCHEMAS, stop_ids=stops,
                          rollout_format="verl", model_type="gemma4")
    turns = trl_loop.TRAJECTORIES["one call"]
    completion = [turns[0], {"role": "tool", "content": "18 C and sunny in Paris"}, turns[1]]
    with pytest.raises(ChatError, match=r"verl builds gemma4 tool rows with a builder of its own.*response_mask"):
        klpipe.render([list(trl_loop.PROMPT)], [completion])
