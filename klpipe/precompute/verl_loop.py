"""verl's tool agent loop (`--rollout-format verl`): why its `agent_data.messages` cannot be turned back into ids.

verl 0.9.1's ToolAgentLoop (verl/experimental/agent_loop/tool_agent_loop.py) builds a row's ids as the engine
sampled them, and keeps beside them, in `agent_data.messages`, what its tool parser made of each turn. With the
hermes parser (tool_parser.py) an assistant message is the decoded turn with every `<tool_call>...</tool_call>`
span cut out, plus the calls it parsed, re-serialised (`json.loads` then the template's `tojson`) and cut to
`max_parallel_calls`. So the messages do not hold the tokens the policy sampled:
- a call's JSON as written (compact JSON renders 4 tokens longer), and where in the turn each call stood;
- the calls past `max_parallel_calls` (dropped from the message, their tokens still in the ids);
- a call whose JSON did not parse: cut from the content without a trace, its tokens still in the ids, so even a
  row with no tool call in its messages may have sampled one;
- the last turn when the response reached `response_length` or a turn limit (the loop stops before appending it),
  and the tool block that overflowed it (the tool messages are kept, their tokens are not).
Rows whose messages show none of these cannot be told from rows that had them
(tests/precompute/test_verl_tool_loop.py runs pairs of verl rows with equal messages and different ids), so klpipe
refuses every such row instead of guessing;
verl's ids (its `responses`, `response_mask`) are exact.
"""

VERL_MESSAGES_REFUSED = (
    "--rollout-format verl: verl's agent_data.messages do not hold the tokens the policy sampled (its tool parser "
    "re-serialises the calls it parses, drops those past max_parallel_calls and cuts a call it cannot parse from the "
    "text without a trace, and a turn cut at response_length is left out), so verl's ids cannot be rebuilt from "
    "them; give verl's ids: --column response_ids=responses and its response_mask as the mask")
