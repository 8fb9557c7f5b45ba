"""verl 0.9's tool agent loop (`--rollout-format verl`): the tool block its Continuous Token builder appends."""

from __future__ import annotations

from klpipe.precompute.chat import ChatError

# verl 0.9's Continuous Token builders, chosen by the model's config.json model_type: the Qwen builder writes the
# `\n` a turn stopped before (`<|im_end|>` then `\n`) ahead of the tool block; these have builders of their own,
# which klpipe does not rebuild; every other model_type gets verl's default builder.
VERL_QWEN_MODEL_TYPES = frozenset({"qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe"})
VERL_OWN_BUILDER_MODEL_TYPES = frozenset({"minimax", "minimax_text_01", "minimax_m2", "glm4_moe", "glm_moe_dsa",
                                          "gemma4", "gpt_oss", "deepseek_v2", "deepseek_v3", "deepseek_v4"})
# The stand-in conversation verl renders a tool group after (verl/utils/tokenizer/continuous_token.py).
VERL_SYSTEM = {"role": "system", "content": "continuous token synthetic system"}
VERL_USER = {"role": "user", "content": "continuous token synthetic user"}


def verl_tool_block(renderer, row: int, tool_messages: list[dict], tools, response: list[int]) -> list[int]:
    """What verl 0.9's tool agent loop appends after a turn that called tools (`ContinuousTokenBuilder.
    merge_context_tokens`): the tool messages rendered after a stand-in conversation (system, user, a call per
    result with reasoning), with the tools and the generation prompt, less the stand-in's own tokens; the Qwen
    builder first writes the `\n` the turn stopped before. No EOS trimming, as verl does none."""
    calls = [{"id": message.get("tool_call_id") if message.get("tool_call_id") is not None
              else f"continuous_token_call_{i}", "type": "function",
              "function": {"name": str(message["name"]) if message.get("name") else "continuous_token_tool",
                           "arguments": {}}} for i, message in enumerate(tool_messages)]
    stand_in = [VERL_SYSTEM, VERL_USER,
                {"role": "assistant", "content": "", "reasoning_content": "reasoning", "tool_calls": calls}]
    prefix = renderer._ids(renderer._apply(stand_in, tools))
    full = renderer._ids(renderer._apply(stand_in + tool_messages, tools, add_generation_prompt=True))
    if full[: len(prefix)] != prefix:
        raise ChatError(row, "the chat template renders a tool call differently once its result follows (it is "
                             "not prefix-preserving), so the tool block verl appends cannot be rebuilt; give "
                             "verl's ids: responses as response_ids and response_mask as the mask")
    boundary = []
    if renderer.model_type in VERL_QWEN_MODEL_TYPES:
        im_end = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
        newline = renderer.tokenizer.encode("\n", add_special_tokens=False)
        if len(newline) != 1:  # verl's Qwen builder refuses such a tokenizer too
            raise ChatError(row, "verl's Qwen builder needs `\\n` to be one token, and this tokenizer makes "
                                 f"{len(newline)} of it; give verl's ids: responses as response_ids and "
                                 "response_mask as the mask")
        if response and response[-1] == im_end:
            boundary = newline
    return boundary + full[len(prefix):]
