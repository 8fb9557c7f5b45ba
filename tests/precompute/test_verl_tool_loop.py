"""`--rollout-format verl` on verl's `agent_data.messages`, held to verl 0.9.1's ToolAgentLoop (tests/verl_agent.py).

Each row here is built by verl's loop, its hermes parser, its Continuous Token builder and BaseTool tools, from turns
a sampler can write (raw text with compact JSON, parallel calls, a malformed call, a turn cut at the length limit);
the messages are what the loop left in `agent_data.messages`. Pairs of rows show that equal messages come from
different ids, so klpipe cannot rebuild verl's ids from them: every such row is refused in one line naming the ids
to give instead. Before, klpipe rendered these rows and 4 kinds of them silently differed from verl's ids.
"""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from klpipe.precompute.chat import ChatError, ChatRenderer, ChatRendering
from tests import trl_loop, verl_agent
from tests.helpers import TINY_LLAMA, run_cli

pytestmark = pytest.mark.trl  # make test-trl installs verl

PROMPT = trl_loop.PROMPT
MODEL_TYPE = "qwen2"  # Qwen 2.5's template and verl's Qwen builder
EOS = "<|im_end|>"


def call(name="weather", compact=False, **arguments):
    body = {"name": name, "arguments": arguments or {"city": "Paris"}}
    text = json.dumps(body, separators=(",", ":")) if compact else json.dumps(body)
    return f"<tool_call>\n{text}\n</tool_call>"


# Turns as the policy sampled them (raw text), and the loop's options: every case the issue names and more.
CASES = {
    "no call": (["It is sunny in Paris." + EOS], {}),
    "one call": ([call() + EOS, "Sunny." + EOS], {}),
    "compact JSON": ([call(compact=True) + EOS, "Sunny." + EOS], {}),
    "two rounds": ([call() + EOS, call("clock") + EOS, "Sunny, 14:05." + EOS], {}),
    "three calls, max_parallel_calls 3": ([call() + "\n" + call("clock") + "\n" + call(city="Lyon") + EOS,
                                           "Done." + EOS], {"max_parallel_calls": 3}),
    "two calls, max_parallel_calls 1": ([call() + "\n" + call("clock") + EOS, "Sunny." + EOS], {}),
    "text beside the call": (["Let me check.\n" + call() + EOS, "Sunny." + EOS], {}),
    "empty tool text": ([call("clock", text="") + EOS, "Nothing." + EOS], {}),
    "truncated tool text": ([call("clock", text="x", times=80) + EOS, "Long." + EOS], {"max_tool_response_length": 20}),
    "unknown tool": ([call("stocks") + EOS, "Sorry." + EOS], {}),
    "malformed call": ([call()[:-len("}\n</tool_call>")] + "\n</tool_call>" + EOS], {}),
    "last turn cut at the length limit": ([call() + EOS, "Sunny " * 80 + EOS], {"response_length": 200}),
    "tool block overflows the limit": ([call("clock", text="y", times=200) + EOS, "Ok." + EOS],
                                       {"response_length": 128, "max_tool_response_length": 400}),
}


@pytest.fixture(scope="module")
def tokenizer():
    return trl_loop.build_tokenizer("qwen2_5")


def verl_row(tokenizer, name):
    turns, options = CASES[name]
    return verl_agent.run(tokenizer, MODEL_TYPE, list(PROMPT), turns, **options)


def renderer(tokenizer, tools, rollout_format="verl"):
    stops = set(trl_loop.stop_ids(tokenizer, "qwen2_5")) | {tokenizer.eos_token_id}
    return ChatRenderer(tokenizer, "prompt", "completion",
                        rendering=ChatRendering(tools=tools, stop_ids=stops, rollout_format=rollout_format))


@pytest.mark.parametrize("name", list(CASES))
def test_verls_messages_are_refused_in_one_line(tokenizer, name):
    row = verl_row(tokenizer, name)
    assert row["saved"] and sum(row["response_mask"]) > 0  # verl built a row with sampled tokens
    with pytest.raises(ChatError, match=r"verl's agent_data.messages do not hold the tokens the policy sampled.*"
                                        r"--column response_ids=responses") as raised:
        renderer(tokenizer, row["tools"]).render([list(PROMPT)], [row["saved"]])
    assert "\n" not in str(raised.value)


def test_the_cases_are_what_they_say(tokenizer):
    """What verl keeps of each case, from its own loop: the losses that make the messages ambiguous."""
    row = verl_row(tokenizer, "two calls, max_parallel_calls 1")
    assert tokenizer.decode(row["response_ids"]).count("<tool_call>") == 2
    assert len(row["saved"][0]["tool_calls"]) == 1 and [m["role"] for m in row["saved"]] == [
        "assistant", "tool", "assistant"]
    row = verl_row(tokenizer, "three calls, max_parallel_calls 3")
    assert len(row["saved"][0]["tool_calls"]) == 3 and [m["role"] for m in row["saved"]].count("tool") == 3
    assert verl_row(tokenizer, "unknown tool")["saved"][1]["content"].startswith("Unknown function 'stocks'")
    assert verl_row(tokenizer, "empty tool text")["saved"][1]["content"] == ""
    assert "...(truncated)..." in verl_row(tokenizer, "truncated tool text")["saved"][1]["content"]
    row = verl_row(tokenizer, "compact JSON")
    assert '{"name":"weather","arguments":{"city":"Paris"}}' in tokenizer.decode(row["response_ids"])
    assert row["saved"][0]["tool_calls"][0]["function"] == {"name": "weather", "arguments": {"city": "Paris"}}
    row = verl_row(tokenizer, "malformed call")
    assert row["saved"] == [{"role": "assistant", "content": EOS}] and len(row["response_ids"]) > 10
    row = verl_row(tokenizer, "last turn cut at the length limit")
    assert row["saved"][-1]["role"] == "tool"  # the loop stopped before the cut turn's message
    text = tokenizer.decode(row["response_ids"])
    assert len(row["response_ids"]) == 200 and "Sunny Sunny" in text and not text.endswith(EOS)
    row = verl_row(tokenizer, "tool block overflows the limit")
    assert row["saved"][-1]["role"] == "tool" and "y" * 200 in row["saved"][-1]["content"]
    assert tokenizer.decode(row["response_ids"]).endswith(EOS) and set(row["response_mask"]) == {1}  # no block


# Rows whose messages are equal and whose ids are not: (turns, options) of each.
AMBIGUOUS = {
    "compact JSON": (CASES["one call"], CASES["compact JSON"]),
    "a call past max_parallel_calls": (([call() + "\n" + EOS, "Sunny." + EOS], {}),
                                       CASES["two calls, max_parallel_calls 1"]),
    "a call that did not parse": (([EOS], {}), CASES["malformed call"]),
    "the last turn cut at the limit": (CASES["last turn cut at the length limit"],
                                       ([call() + EOS, "Rainy " * 80 + EOS], {"response_length": 200})),
}


@pytest.mark.parametrize("name", list(AMBIGUOUS))
def test_equal_messages_come_from_different_ids(tokenizer, name):
    """No rebuild from messages can be right for both rows: the reason every verl messages row is refused."""
    rows = [verl_agent.run(tokenizer, MODEL_TYPE, list(PROMPT), turns, **options) for turns, options in AMBIGUOUS[name]]
    assert rows[0]["saved"] == rows[1]["saved"]
    assert rows[0]["response_ids"] != rows[1]["response_ids"]


def test_the_cli_refuses_verl_messages_with_exit_2_and_writes_nothing(tokenizer, tmp_path):
    row = verl_row(tokenizer, "no call")
    rollouts = tmp_path / "verl_messages.parquet"
    pq.write_table(pa.table({"prompt": [list(PROMPT)], "completion": [row["saved"]]}), rollouts)
    output = tmp_path / "cached.parquet"
    result = run_cli("precompute", "-m", str(TINY_LLAMA), str(rollouts), "-o", str(output), "--rollout-format", "verl")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: {rollouts}: --rollout-format verl: verl's agent_data")
    assert "give verl's ids: --column response_ids=responses" in lines[0], result.stderr
    assert not output.exists() and not list(tmp_path.glob("cached*"))
