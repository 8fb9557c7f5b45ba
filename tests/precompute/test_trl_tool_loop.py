"""Conversational tool rows against TRL 1.16's own GRPOTrainer tool loop, on every tool-calling template TRL ships
and its training variant (tests/trl_loop.py): klpipe's prompt_ids + response_ids and mask equal the loop's
prompt_ids + completion_ids and tool_mask token for token, or the row is refused in one line that gives the true
reason and what to pass instead. make test runs five templates (seconds); make test-trl all of them (about a
minute on 2 CPU cores)."""

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from klpipe.precompute.chat import ChatError, ChatRenderer, ChatRendering
from klpipe.precompute.rollouts import iter_chunks, open_rollouts
from klpipe.precompute.tokenize import ChunkTokenizer
from tests import trl_loop

# Every template TRL 1.16 ships that its supports_tool_calling accepts, less the vision processors (the test below
# holds the list to TRL's own, in make test-trl).
TEMPLATES = ["deepseekv3", "gemma4", "gemma4_v2", "gemma4_v3", "gemma4_v4", "gemma4_v5", "glm4moe", "gptoss",
             "lfm2_2_5", "lfm2_2_5_v2", "lfm2_v2", "llama3_1", "llama3_2", "nemotron_3_5_lightning", "nemotron_3_nano",
             "nemotron_3_super", "nemotron_3_ultra", "qwen2_5", "qwen3", "qwen3_5_nothink", "qwen3_5_think", "qwen3_6",
             "qwen3_8", "qwen3_instruct_2507"]
VARIANTS = [(name, "hub") for name in TEMPLATES] + [(name, "training") for name in TEMPLATES
                                                     if trl_loop.training_variant(name) is not None]
ALL = set(trl_loop.TRAJECTORIES)
FIRST_ROUND = {"one call", "parallel calls", "reasoning"}  # no text beside a call, no second round

# Each refusal's cause, in the words of klpipe's line.
THINK_PROMPT = r"not prefix-preserving \(its generation prompt ends with 'tant\\n<think>\\n' where the rendered turn"
RE_RENDERED = r"not prefix-preserving \(its generation prompt ends with '.*' where the rendered turn"
PARSER_LEFT_STOP = r"holds the stop token '<\|observation\|>' in its content \(a response parser left the token"
IDS_ADVICE = "give prompt_ids, response_ids and the mask (TRL's completion_ids and tool_mask) instead"

# (template, variant) -> {trajectory: the refusal's cause}; every other trajectory matches the loop.
REFUSED = {
    **{(name, variant): dict.fromkeys(ALL, PARSER_LEFT_STOP)
       for name in ["glm4moe"] for variant in ("hub", "training")},
    **{(name, variant): dict.fromkeys(ALL - {"reasoning"}, THINK_PROMPT)
       for name in TEMPLATES if name.startswith("nemotron") for variant in ("hub", "training")},
    **{("gptoss", variant): dict.fromkeys(ALL - {"one call", "parallel calls"}, RE_RENDERED)
       for variant in ("hub", "training")},
    ("gemma4_v5", "hub"): dict.fromkeys(ALL - FIRST_ROUND, RE_RENDERED),
    **{("qwen3_5_nothink", variant): {"reasoning": RE_RENDERED} for variant in ("hub", "training")},
}
# Trajectories TRL's loop cannot produce on a template, and why: none of these rows can exist.
NOT_PRODUCED = {
    "llama3_1": {"parallel calls": "the template raises 'This model only supports single tool-calls at once!'"},
    "llama3_2": {"parallel calls": "the template raises 'This model only supports single tool-calls at once!'"},
}


@pytest.mark.trl
def test_the_matrix_covers_the_tool_calling_templates_trl_ships():
    assert trl_loop.templates() == TEMPLATES  # a template a new TRL release adds shows up here


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    """One GRPOTrainer per (template, variant): the tokenizer carries the variant as its own template."""
    built = {}

    def get(name, variant):
        if (name, variant) not in built:
            template = trl_loop.training_variant(name) if variant == "training" else None
            tokenizer = trl_loop.build_tokenizer(name, template)
            built[name, variant] = trl_loop.build_trainer(tokenizer, name, tmp_path_factory.mktemp(name))
        return built[name, variant]

    return get


def renderer(trainer, name, template_given):
    tokenizer = trainer.processing_class
    if trainer.chat_template is not None:  # what --chat-template FILE does: the template the trainer used
        tokenizer = trl_loop.build_tokenizer(name, trainer.chat_template)
    return ChatRenderer(tokenizer, "prompt", "completion", rendering=ChatRendering(
        tools=trl_loop.TOOL_SCHEMAS, stop_ids=trl_loop.stop_ids(tokenizer, name), template_given=template_given))


# make test runs a template of each kind of outcome; make test-trl (-m trl) runs them all.
QUICK = {("qwen2_5", "hub"), ("qwen3", "hub"), ("gemma4", "hub"), ("glm4moe", "hub"), ("nemotron_3_nano", "hub")}


@pytest.mark.parametrize("name, variant", [v if v in QUICK else pytest.param(*v, marks=pytest.mark.trl)
                                           for v in VARIANTS if v[0] != "deepseekv3"])
def test_rows_equal_the_loop_token_for_token_or_are_refused_with_the_cause(trainers, name, variant):
    trainer = trainers(name, variant)
    outcomes, expected = {}, {}
    for trajectory, turns in trl_loop.TRAJECTORIES.items():
        if trajectory in NOT_PRODUCED.get(name, {}):
            continue
        loop = trl_loop.run_loop(trainer, turns)
        assert any(m["role"] == "tool" for m in loop["completion"]), (trajectory, loop["completion"])
        expected[trajectory] = REFUSED.get((name, variant), {}).get(trajectory, "match")
        try:
            prompts, responses, masks = renderer(trainer, name, variant == "training").render(
                [trl_loop.PROMPT], [loop["completion"]])
        except ChatError as exc:
            message = str(exc)
            assert "\n" not in message and message.endswith(IDS_ADVICE), message
            cause = expected[trajectory]
            outcomes[trajectory] = cause if cause != "match" and re.search(cause, message) else message
            continue
        ok = (prompts[0] == loop["prompt_ids"] and responses[0] == loop["completion_ids"]
              and masks[0].astype(int).tolist() == loop["tool_mask"])
        outcomes[trajectory] = "match" if ok else first_difference(trainer, loop, prompts[0], responses[0], masks[0])
        if ok:
            # TRL's logprobs pair with the row: one per response token, the loop's 0.0 placeholder exactly at mask 0.
            logprobs = np.array(loop["logprobs"])
            assert len(logprobs) == len(responses[0]) == len(masks[0])
            assert (logprobs[~masks[0]] == 0.0).all() and (logprobs[masks[0]] != 0.0).all()
    assert outcomes == expected


def first_difference(trainer, loop, prompt_ids, response_ids, mask) -> str:
    theirs, ours = loop["prompt_ids"] + loop["completion_ids"], prompt_ids + response_ids
    # The two may differ in length: the first difference is then where the shorter ends, if not before.
    at = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b), min(len(theirs), len(ours)))
    decode = trainer.processing_class.decode
    return (f"differs at token {at} of {len(theirs)} (klpipe {len(ours)}): loop {decode(theirs[at:at + 8])!r}, "
            f"klpipe {decode(ours[at:at + 8])!r}; masks equal: {mask.astype(int).tolist() == loop['tool_mask']}")


def test_trls_tool_mask_for_a_conversational_row_is_accepted_and_agrees(trainers, tmp_path):
    # The loop's rows as a trainer's dump holds them: the messages, the tools, TRL's tool_mask and logprobs.
    trainer = trainers("qwen2_5", "hub")
    loops = [trl_loop.run_loop(trainer, trl_loop.TRAJECTORIES[t]) for t in ("two rounds", "parallel calls")]
    table = pa.Table.from_pylist([{"prompt": trl_loop.PROMPT, "completion": loop["completion"],
                                   "tools": json.dumps(trl_loop.TOOL_SCHEMAS), "tool_mask": loop["tool_mask"],
                                   "policy_logprobs": loop["logprobs"]} for loop in loops])
    pq.write_table(table, tmp_path / "dump.parquet")
    rollouts = open_rollouts([tmp_path / "dump.parquet"])
    tokenizer = trainer.processing_class
    chunk = next(iter_chunks(rollouts, 8))
    tokenized = ChunkTokenizer(rollouts, tokenizer, len(tokenizer), None,
                               chat=ChatRendering(stop_ids=trl_loop.stop_ids(tokenizer, "qwen2_5")))(chunk)
    assert not tokenized.derived_mask  # the dump's own tool_mask was read, and agreed with the roles
    for i, loop in enumerate(loops):
        prompt_ids, response_ids = tokenized.row(i)
        assert prompt_ids.tolist() == loop["prompt_ids"] and response_ids.tolist() == loop["completion_ids"]
        mask = tokenized.row_mask(i)
        assert mask.astype(int).tolist() == loop["tool_mask"] and 0 < mask.sum() < len(mask)
        assert len(loop["logprobs"]) == len(mask)
        assert all(v == 0.0 for v, m in zip(loop["logprobs"], mask, strict=True) if not m)


def test_a_template_trl_swaps_is_refused_without_the_trainers_template_and_the_line_names_the_option(trainers):
    # Qwen3's own template is not prefix-preserving by TRL's probe, so GRPOTrainer(tools=...) renders with its
    # training template; rows rendered with the tokenizer's own would be other tokens.
    trainer = trainers("qwen3", "hub")
    assert trainer.chat_template == trl_loop.training_variant("qwen3")
    loop = trl_loop.run_loop(trainer, trl_loop.TRAJECTORIES["one call"])
    tokenizer = trainer.processing_class
    own = ChatRenderer(tokenizer, "prompt", "completion", rendering=ChatRendering(
        tools=trl_loop.TOOL_SCHEMAS, stop_ids=trl_loop.stop_ids(tokenizer, "qwen3")))
    with pytest.raises(ChatError) as excinfo:
        own.render([trl_loop.PROMPT], [loop["completion"]])
    assert str(excinfo.value).endswith(
        "TRL 1.16 swaps in its training template (trl.chat_template_utils.get_training_chat_template) for this "
        "template when tools are used: pass the template the trainer used with --chat-template FILE, or give "
        "prompt_ids, response_ids and the mask instead")


def test_deepseek_v3_trls_own_loop_fails_on_its_template_and_its_training_template_parses_no_call(trainers):
    # The hub template rejects the stand-in call's dict arguments in TRL's own _get_tool_suffix_ids: no such row.
    with pytest.raises(TypeError, match="can only concatenate str"):
        trainers("deepseekv3", "hub")._get_tool_suffix_ids([{"role": "tool", "name": "weather", "content": "x"}])
    # The training template opens every reply with `<think>\n`: the row is refused for that, not for its tools.
    trainer = trainers("deepseekv3", "training")
    loop = trl_loop.run_loop(trainer, trl_loop.TRAJECTORIES["one call"][:1])
    with pytest.raises(ChatError, match=re.escape("its generation prompt ends with 'Assistant｜><think>\\n' where the "
                                                  "rendered turn has 'Assistant｜><｜tool▁calls▁begin｜>")):
        renderer(trainer, "deepseekv3", True).render([trl_loop.PROMPT], [loop["completion"]])


def test_qwen3s_hub_template_holds_the_loops_ids_on_the_reasoning_trajectory_alone_so_rows_need_the_trainers(trainers):
    # GRPOTrainer renders Qwen3's tool rows with its training template. On the reasoning trajectory, and on no other,
    # the hub template's rendering of the whole conversation happens to hold the loop's ids exactly, then only `\n`:
    # it keeps the <think> of the turns after the last user message, which the training template keeps always.
    # Nothing in a row's messages tells the two cases apart, so klpipe rebuilds rows only with the template the
    # trainer used (--chat-template), and refuses the reasoning row without it as it refuses the others.
    trainer = trainers("qwen3", "hub")
    tokenizer = trainer.processing_class  # the hub template
    agrees = set()
    for trajectory, turns in trl_loop.TRAJECTORIES.items():
        loop = trl_loop.run_loop(trainer, turns)
        whole = tokenizer.apply_chat_template(trl_loop.PROMPT + loop["completion"], tools=trl_loop.TOOL_SCHEMAS,
                                              tokenize=False)
        ids = tokenizer(whole, add_special_tokens=False)["input_ids"]
        theirs = loop["prompt_ids"] + loop["completion_ids"]
        if ids[:len(theirs)] == theirs:
            assert tokenizer.decode(ids[len(theirs):]) == "\n"
            agrees.add(trajectory)
        if trajectory == "reasoning":
            hub = ChatRenderer(tokenizer, "prompt", "completion", rendering=ChatRendering(
                tools=trl_loop.TOOL_SCHEMAS, stop_ids=trl_loop.stop_ids(tokenizer, "qwen3")))
            with pytest.raises(ChatError, match="pass the template the trainer used with --chat-template FILE"):
                hub.render([trl_loop.PROMPT], [loop["completion"]])
            prompts, responses, masks = renderer(trainer, "qwen3", False).render([trl_loop.PROMPT],
                                                                               [loop["completion"]])
            assert prompts[0] + responses[0] == theirs and masks[0].astype(int).tolist() == loop["tool_mask"]
    assert agrees == {"reasoning"}
