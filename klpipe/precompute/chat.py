"""TRL's conversational rollouts: prompt and completion messages rendered with the chat template.

A row is rendered as TRL renders it and split at the token level, so that `prompt_ids + response_ids` is exactly
`tokenizer.apply_chat_template(prompt + completion)`; a completion holding tool messages is rebuilt the way TRL's
tool loop built it, turn by turn, with its mask. A row with no exact split is refused, never guessed.
docs/formats.md says how ("TRL conversational" and "Agent trajectories"). No torch here: only the tokenizer (and
jinja2, through transformers).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from klpipe.arrow import is_list_type, without_nones
from klpipe.errors import first_line
from klpipe.precompute.verl_loop import VERL_MESSAGES_REFUSED

# The last prompt message's role decides how TRL renders the prompt.
GENERATION_PROMPT_ROLES = ("user", "tool")  # add_generation_prompt=True
CONTINUED_ROLE = "assistant"  # continue_final_message=True; the policy's own messages
TOOL_ROLE = "tool"  # a tool's result: context for the policy, never sampled by it

# --rollout-format: whose tool loop built a completion with tool messages.
ROLLOUT_FORMATS = ("trl", "verl")


class ChatError(Exception):
    """A row that cannot be rendered; the reader names its file and row."""

    def __init__(self, row: int, problem: str):
        super().__init__(problem)
        self.row = row  # index in the rows handed to `ChatRenderer.render`


def is_messages_type(kind: pa.DataType) -> bool:
    """A list of structs with a `role` field: the Arrow type of a column of chat messages."""
    return is_list_type(kind) and pa.types.is_struct(kind.value_type) and kind.value_type.get_field_index("role") >= 0


@dataclass(frozen=True)
class ChatRendering:
    """How the trainer rendered its conversations: what a conversational row's tokens depend on beside its messages."""

    tools: list | None = None  # one list of tool schemas for every row (--tools), or None
    template_kwargs: dict | None = None  # TRL's chat_template_kwargs
    stop_ids: Iterable[int] = ()  # the model's generation_config.eos_token_id (the tokenizer's EOS is added)
    template_given: bool = False  # --chat-template: the template is the trainer's, as the user says
    rollout_format: str = "trl"  # whose tool loop built the rows: trl, or verl (refused)


class ChatRenderer:
    """Renders conversational rows into (prompt_ids, response_ids, mask) with the tokenizer's chat template."""

    def __init__(self, tokenizer, prompt_column: str, response_column: str, tools_column: str = "tools",
                 rendering: ChatRendering | None = None):
        rendering = rendering if rendering is not None else ChatRendering()
        self.tokenizer = tokenizer
        self.prompt_column = prompt_column  # the user's column names, for messages
        self.response_column = response_column
        self.tools_column = tools_column
        self.tools = rendering.tools
        self.template_kwargs = dict(rendering.template_kwargs or {})
        self._renders_tools: dict[str, bool] = {}  # tools as JSON -> whether the template shows them
        # The tokens that end a sampled turn: the tokenizer's EOS and the model's generation_config.eos_token_id.
        self.stop_ids = frozenset(int(i) for i in rendering.stop_ids) | (
            {int(tokenizer.eos_token_id)} if getattr(tokenizer, "eos_token_id", None) is not None else set())
        self.template_given = rendering.template_given
        self.rollout_format = rendering.rollout_format

    @property
    def has_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render(self, prompts: list, completions: list, row_tools: list | None = None
               ) -> tuple[list[list[int]], list[list[int]], list[np.ndarray]]:
        """(prompt ids, response ids, mask) per row, from each row's prompt and completion messages and tools.

        `row_tools` holds each row's tools column value (a list of schemas, JSON text, or None).
        """
        if self.rollout_format == "verl" and prompts:
            raise ChatError(0, VERL_MESSAGES_REFUSED)
        if not self.has_template:
            raise ChatError(0, f"{self.prompt_column} holds chat messages, but the tokenizer has no chat template "
                               "to render them with; use a tokenizer that has one, or give prompt_ids and response_ids")
        texts: list[str] = []
        layout: list[tuple[int, list[tuple[int, int]]]] = []  # per row: first text, assistant spans as text pairs
        looped: dict[int, tuple[list[int], list[int], np.ndarray]] = {}  # rows with tool messages, rebuilt whole
        for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            tools = self._row_tools(row, None if row_tools is None else row_tools[row])
            prompt_messages = self._messages(row, prompt, self.prompt_column)
            completion_messages = self._messages(row, completion, self.response_column)
            if any(m["role"] == TOOL_ROLE for m in completion_messages):
                looped[row] = self._tool_loop_row(row, prompt_messages, completion_messages, tools)
                layout.append((-1, []))
                continue
            row_texts, spans = self._texts(row, prompt_messages, completion_messages, tools)
            layout.append((len(texts), spans))
            texts.extend(row_texts)
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []  # [prompt, whole, ...]
        prompt_lists: list[list[int]] = []
        response_lists: list[list[int]] = []
        masks: list[np.ndarray] = []
        for row, (first, spans) in enumerate(layout):
            if row in looped:
                row_prompt, row_response, row_mask = looped[row]
                prompt_lists.append(row_prompt)
                response_lists.append(row_response)
                masks.append(row_mask)
                continue
            prompt_ids, whole_ids = ids[first], ids[first + 1]
            for boundary in ids[first: first + 2 + 2 * len(spans)]:
                if whole_ids[: len(boundary)] != boundary:
                    raise ChatError(row, f"the tokens of the rendered {self.prompt_column} are not a prefix of "
                                         "those of the whole conversation (the tokenizer merges across the boundary); "
                                         "give prompt_ids and response_ids instead" if boundary is prompt_ids else
                                         "the tokens of the conversation up to a message of the "
                                         f"{self.response_column} are not a prefix of those of the whole conversation "
                                         "(the tokenizer merges across the boundary); give prompt_ids, response_ids "
                                         "and a mask instead")
            mask = np.zeros(len(whole_ids) - len(prompt_ids), dtype=bool)
            for start, end in spans:  # indices of the texts that open and close an assistant message
                mask[len(ids[first + start]) - len(prompt_ids): len(ids[first + end]) - len(prompt_ids)] = True
            prompt_lists.append(prompt_ids)
            response_lists.append(whole_ids[len(prompt_ids):])
            masks.append(mask)
        return prompt_lists, response_lists, masks

    def _apply(self, messages: list[dict], tools, **options) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **options,
                                                  **self.template_kwargs)

    def _texts(self, row: int, prompt, completion, tools) -> tuple[list[str], list[tuple[int, int]]]:
        """The texts to tokenize for one row, as TRL renders them: the prompt, the whole conversation, then
        for each assistant message of the completion the text up to its start and up to its end; and, per
        assistant message, the indices of those two texts."""
        last_role = prompt[-1]["role"]
        if last_role not in GENERATION_PROMPT_ROLES + (CONTINUED_ROLE,):
            raise ChatError(row, f"the last {self.prompt_column} message has role {last_role!r}; TRL renders "
                                 f"prompts that end with a {', '.join(GENERATION_PROMPT_ROLES)} or "
                                 f"{CONTINUED_ROLE} message")
        self._check_roles(row, prompt, completion)
        continued = last_role == CONTINUED_ROLE
        try:
            prompt_text = self._apply(prompt, tools, add_generation_prompt=not continued,
                                      continue_final_message=continued)
            whole_text = self._apply(prompt + completion, tools)
            texts, spans = [prompt_text, whole_text], []
            for k, message in enumerate(completion):
                if message["role"] != CONTINUED_ROLE:
                    continue
                # The assistant's own tokens start after its turn's header, which the trainer wrote
                # (the generation prompt), and end with its turn.
                start = (prompt_text if k == 0
                         else self._apply(prompt + completion[:k], tools, add_generation_prompt=True))
                end = whole_text if k == len(completion) - 1 else self._apply(prompt + completion[:k + 1], tools)
                spans.append((len(texts), len(texts) + 1))
                texts += [start, end]
        except ChatError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template is user code: jinja errors, raise_exception, ...
            raise ChatError(row, f"the chat template failed: {first_line(exc)}") from None
        if not whole_text.startswith(prompt_text):
            parting = _parting(prompt_text, whole_text)
            raise ChatError(row, f"the chat template does not keep the rendered {self.prompt_column} as a prefix of "
                                 f"{self.prompt_column} + {self.response_column} ({parting}), so the response tokens "
                                 "cannot be told apart; give prompt_ids and response_ids instead")
        if not all(whole_text.startswith(text) for text in texts[2:]):
            raise ChatError(row, f"the chat template renders the conversation up to a message of the "
                                 f"{self.response_column} differently once more messages follow, so the assistant's "
                                 "tokens cannot be told apart; give prompt_ids, response_ids and the mask instead")
        if tools is not None:  # last: a template that fails for another reason names that reason first
            self._check_renders_tools(row, tools)
        return texts, spans

    # -- completions with tool messages: the trainer's loop ------------------------------------------------

    def _tool_loop_row(self, row: int, prompt: list[dict], completion: list[dict], tools
                       ) -> tuple[list[int], list[int], np.ndarray]:
        """(prompt ids, response ids, mask) of a completion with tool messages, as TRL 1.16's tool loop builds
        them: prompt_ids + sampled turn + tool block + sampled turn ... + the last sampled turn."""
        last_role = prompt[-1]["role"]
        if last_role not in GENERATION_PROMPT_ROLES:
            raise ChatError(row, f"the last {self.prompt_column} message has role {last_role!r}; TRL's tool loop "
                                 f"renders a prompt that ends with a {' or '.join(GENERATION_PROMPT_ROLES)} message "
                                 "with the generation prompt")
        self._check_roles(row, prompt, completion)
        try:
            prompt_ids = self._ids(self._apply(prompt, tools, add_generation_prompt=True))
            response: list[int] = []
            mask: list[int] = []
            history, k = list(prompt), 0
            while k < len(completion):
                if completion[k]["role"] == CONTINUED_ROLE:
                    turn = self._sampled_turn(row, history, completion[k], completion[k + 1: k + 2], tools)
                    response += turn
                    mask += [1] * len(turn)
                    history.append(completion[k])
                    k += 1
                    continue
                end = k
                while end < len(completion) and completion[end]["role"] == TOOL_ROLE:
                    end += 1
                block = self._tool_block(row, completion[k:end])
                response += block
                mask += [0] * len(block)
                history += completion[k:end]
                k = end
        except ChatError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template is user code: jinja errors, raise_exception, ...
            raise ChatError(row, f"the chat template failed: {first_line(exc)}") from None
        if tools is not None:
            self._check_renders_tools(row, tools)
        return prompt_ids, response, np.array(mask, dtype=bool)

    def _ids(self, text: str) -> list[int]:
        # As the trainers tokenize a rendered template: it writes its own BOS.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _sampled_turn(self, row: int, history: list[dict], message: dict, following: list[dict], tools) -> list[int]:
        """The tokens the policy sampled for `message`: what the template renders for it after the generation
        prompt, up to and including the first stop token. A template that writes no stop token at the end of the
        turn may open the next message with one (GLM's `<|observation|>`): the policy stopped on that token."""
        for key in ("content", "reasoning_content", "reasoning", "thinking"):
            text = message.get(key)
            held = [self.tokenizer.convert_ids_to_tokens(i) for i in sorted(self.stop_ids)]
            held = [token for token in held if isinstance(text, str) and token and token in text]
            if held:
                raise ChatError(row, f"an assistant message of the {self.response_column} holds the stop token "
                                     f"{held[0]!r} in its {key} (a response parser left the token the policy stopped "
                                     "on there), so the tokens it sampled cannot be rendered from the message; give "
                                     "prompt_ids, response_ids and the mask (TRL's completion_ids and tool_mask) "
                                     "instead")
        header = self._apply(history, tools, add_generation_prompt=True)
        own = self._apply(history + [message], tools)
        if not own.startswith(header):
            raise ChatError(row, self._not_prefix_preserving(header, own))
        header_ids, own_ids = self._ids(header), self._ids(own)
        if own_ids[: len(header_ids)] != header_ids:
            raise ChatError(row, "the tokens of the conversation up to an assistant turn of the "
                                 f"{self.response_column} are not a prefix of those with the turn (the tokenizer "
                                 "merges across the boundary); give prompt_ids, response_ids and the mask instead")
        rest = own_ids[len(header_ids):]
        for i, token in enumerate(rest):
            if token in self.stop_ids:
                return rest[: i + 1]
        if following:  # the next message's first token, when it is a stop token
            after = self._apply(history + [message] + following, tools)
            if after.startswith(own):
                after_ids = self._ids(after)
                if after_ids[: len(own_ids)] == own_ids and len(after_ids) > len(own_ids) \
                        and after_ids[len(own_ids)] in self.stop_ids:
                    return rest + [after_ids[len(own_ids)]]
        raise ChatError(row, f"an assistant turn of the {self.response_column} renders no stop token (the "
                             f"tokenizer's EOS or the model's generation_config.eos_token_id: "
                             f"{self._stop_names()}), so the token the policy stopped on is not in the messages; "
                             "give prompt_ids, response_ids and the mask (TRL's completion_ids and tool_mask) instead")

    def _tool_block(self, row: int, tool_messages: list[dict]) -> list[int]:
        """What TRL 1.16 appends after a turn that called tools (`GRPOTrainer._get_tool_suffix_ids`): the tool
        messages rendered after a stand-in conversation, without the tools, with the generation prompt, less the
        stand-in's own tokens up to its last EOS."""
        name = tool_messages[0].get("name")
        if not isinstance(name, str):
            raise ChatError(row, "a tool message has no name; TRL's tool loop names each result after its tool, and "
                                 "renders the results after a stand-in call of that name")
        stand_in: list[dict] = [{"role": "user", "content": "dummy"},
                    {"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}]
        prefix = self._ids(self._apply(stand_in, None))
        full = self._ids(self._apply(stand_in + tool_messages, None, add_generation_prompt=True))
        eos = getattr(self.tokenizer, "eos_token_id", None)
        ends = [i for i, token in enumerate(prefix) if token == eos]
        if ends:  # e.g. Qwen's `\n` after `<|im_end|>` belongs to the tool block
            prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise ChatError(row, "the chat template renders a tool call differently once its result follows (it is "
                                 "not prefix-preserving), so the tool block TRL appends cannot be rebuilt; "
                                 f"{self._not_prefix_preserving_advice()}")
        return full[len(prefix):]

    def _not_prefix_preserving(self, header: str, own: str) -> str:
        problem = (f"the chat template is not prefix-preserving ({_parting(header, own)}), so the tokens the policy "
                   "sampled after the generation prompt cannot be told apart")
        return f"{problem}; {self._not_prefix_preserving_advice()}"

    def _not_prefix_preserving_advice(self) -> str:
        if not self.template_given and not self._passes_trl_prefix_check():
            return ("TRL 1.16 swaps in its training template (trl.chat_template_utils.get_training_chat_template) "
                    "for this template when tools are used: pass the template the trainer used with "
                    "--chat-template FILE, or give prompt_ids, response_ids and the mask instead")
        return "give prompt_ids, response_ids and the mask (TRL's completion_ids and tool_mask) instead"

    def _passes_trl_prefix_check(self) -> bool:
        """TRL 1.16's `is_chat_template_prefix_preserving`: the one probe by which GRPOTrainer decides to keep the
        tokenizer's template (True) or swap in its training template (False)."""
        stand_in: list[dict] = [{"role": "user", "content": "dummy"},
                    {"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": "dummy", "arguments": {}}}]}]
        try:
            before = self._ids(self._apply(stand_in, None))
            after = self._ids(self._apply(stand_in + [{"role": "tool", "name": "dummy", "content": "dummy"}], None,
                                          add_generation_prompt=True))
        except Exception:  # noqa: BLE001 - TRL retries with string arguments (DeepSeek-V3); either way not a swap here
            return True
        return after[: len(before)] == before

    def _stop_names(self) -> str:
        return ", ".join(repr(self.tokenizer.convert_ids_to_tokens(i)) for i in sorted(self.stop_ids)) or "none"

    def _check_roles(self, row: int, prompt: list[dict], completion: list[dict]) -> None:
        """The completion is what the policy sampled and the tools answered: assistant messages and tool results,
        opening with the assistant; a tool result answers an assistant's tool call."""
        if completion[0]["role"] != CONTINUED_ROLE:
            raise ChatError(row, f"the {self.response_column} opens with a {completion[0]['role']!r} message; it must "
                                 "open with the assistant's, which the policy sampled")
        for message in completion:
            if message["role"] not in (CONTINUED_ROLE, TOOL_ROLE):
                raise ChatError(row, f"the {self.response_column} holds a {message['role']!r} message; it holds the "
                                     f"assistant's messages and the tools' results ({TOOL_ROLE!r} messages)")
        previous = None
        for message in prompt + completion:
            if message["role"] == TOOL_ROLE and not (previous is not None and (
                    previous["role"] == TOOL_ROLE
                    or (previous["role"] == CONTINUED_ROLE and previous.get("tool_calls")))):
                raise ChatError(row, "a tool message answers no tool call: it must follow an assistant message with "
                                     "tool_calls, or another tool message")
            previous = message

    def _check_renders_tools(self, row: int, tools: list) -> None:
        """A template that ignores `tools` would score the policy against a prompt it never saw."""
        key = json.dumps(tools, sort_keys=True)
        if key not in self._renders_tools:
            probe = [{"role": "user", "content": "x"}]
            self._renders_tools[key] = (self._apply(probe, tools, add_generation_prompt=True)
                                        != self._apply(probe, None, add_generation_prompt=True))
        if not self._renders_tools[key]:
            raise ChatError(row, "the chat template renders nothing of the tools it is given, so the reference "
                                 "would not see the tool schemas the policy saw; use the policy's chat template")

    def _row_tools(self, row: int, value) -> list | None:
        """This row's tool schemas: its tools column (a list, or JSON text), else --tools, else None."""
        if value is None:
            return self.tools
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ChatError(row, f"{self.tools_column} is not valid JSON ({exc})") from None
        if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
            raise ChatError(row, f"{self.tools_column} must be a list of tool schemas (JSON objects)")
        return [without_nones(tool) for tool in value]

    @staticmethod
    def _messages(row: int, value, column: str) -> list[dict]:
        if value is None:
            raise ChatError(row, f"{column} is null")
        if not value:
            raise ChatError(row, f"{column} holds no messages")
        messages = []
        for message in value:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ChatError(row, f"{column} holds a message without a role")
            # Arrow gives every message every key seen in the column, None where a message had
            # none; templates test for keys (`'tool_calls' in message`), so the Nones go, inside
            # tool calls too.
            messages.append({k: (without_nones(v) if k == "tool_calls" else v) for k, v in message.items()
                             if v is not None or k in ("role", "content")})
        return messages


def _parting(prompt: str, whole: str) -> str:
    """Where a rendered prompt and the rendering with more messages part, for a person: what each has there."""
    same = len(os.path.commonprefix([prompt, whole]))  # noqa: RUF071 - two rendered strings, not paths
    start = max(0, same - 12)  # a little of what the two share
    return (f"its generation prompt ends with {prompt[start:][-40:]!r} where the rendered turn has "
            f"{whole[start: same + 28]!r}")
