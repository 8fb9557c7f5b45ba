"""TRL's conversational rollouts: prompt and completion messages rendered with the chat template.

In TRL's prompt-completion format `prompt` is a list of {"role", "content"} messages and
`completion` a list holding the assistant's message. TRL (`data_utils.apply_chat_template`) renders
the prompt with the generation prompt added (continuing the last message instead when the prompt
ends with an assistant turn), renders prompt + completion, and calls the completion what the
second adds after the first; its trainers then tokenize the rendered text with
`add_special_tokens=False`, because a template writes its own BOS (a second one would be a token
the policy never saw). klpipe renders the same way and splits at the token level:

    prompt_ids   = tokens(render(prompt, generation prompt))
    response_ids = tokens(render(prompt + completion))[len(prompt_ids):]

so `prompt_ids + response_ids` is exactly `tokenizer.apply_chat_template(prompt + completion)`.
A template that renders the prompt differently once a completion follows, or a tokenizer that
merges tokens across the boundary, has no such split: that row is an error, never a guess.

No torch here: only the tokenizer (and jinja2, through transformers) is used.
"""

from __future__ import annotations

import pyarrow as pa

from klpipe.arrow import is_list_type
from klpipe.errors import first_line

# The last prompt message's role decides how TRL renders the prompt.
GENERATION_PROMPT_ROLES = ("user", "tool")  # add_generation_prompt=True
CONTINUED_ROLE = "assistant"  # continue_final_message=True


class ChatError(Exception):
    """A row that cannot be rendered; the reader names its file and row."""

    def __init__(self, row: int, problem: str):
        super().__init__(problem)
        self.row = row  # index in the rows handed to `ChatRenderer.render`


def is_messages_type(kind: pa.DataType) -> bool:
    """A list of structs with a `role` field: the Arrow type of a column of chat messages."""
    return is_list_type(kind) and pa.types.is_struct(kind.value_type) and kind.value_type.get_field_index("role") >= 0


class ChatRenderer:
    """Renders conversational rows into (prompt_ids, response_ids) with the tokenizer's chat template."""

    def __init__(self, tokenizer, prompt_column: str, response_column: str):
        self.tokenizer = tokenizer
        self.prompt_column = prompt_column  # the user's column names, for messages
        self.response_column = response_column

    @property
    def has_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render(self, prompts: list, completions: list) -> tuple[list[list[int]], list[list[int]]]:
        """(prompt ids, response ids) per row, from each row's prompt and completion messages."""
        if not self.has_template:
            raise ChatError(0, f"{self.prompt_column} holds chat messages, but the tokenizer has no chat template "
                               "to render them with; use a tokenizer that has one, or give prompt_ids and response_ids")
        texts: list[str] = []
        for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            texts.extend(self._texts(row, prompt, completion))
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]  # [prompt, whole] per row
        prompt_lists, response_lists = [], []
        for row in range(len(prompts)):
            prompt_ids, whole_ids = ids[2 * row], ids[2 * row + 1]
            if whole_ids[: len(prompt_ids)] != prompt_ids:
                raise ChatError(row, f"the tokens of the rendered {self.prompt_column} are not a prefix of those of "
                                     "the whole conversation (the tokenizer merges across the boundary); give "
                                     "prompt_ids and response_ids instead")
            prompt_lists.append(prompt_ids)
            response_lists.append(whole_ids[len(prompt_ids):])
        return prompt_lists, response_lists

    def _texts(self, row: int, prompt, completion) -> tuple[str, str]:
        """(rendered prompt, rendered prompt + completion) for one row, as TRL renders them."""
        prompt = self._messages(row, prompt, self.prompt_column)
        completion = self._messages(row, completion, self.response_column)
        last_role = prompt[-1]["role"]
        if last_role not in GENERATION_PROMPT_ROLES + (CONTINUED_ROLE,):
            raise ChatError(row, f"the last {self.prompt_column} message has role {last_role!r}; TRL renders "
                                 f"prompts that end with a {', '.join(GENERATION_PROMPT_ROLES)} or "
                                 f"{CONTINUED_ROLE} message")
        continued = last_role == CONTINUED_ROLE
        try:
            prompt_text = self.tokenizer.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=not continued, continue_final_message=continued)
            whole_text = self.tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a template is user code: jinja errors, raise_exception, ...
            raise ChatError(row, f"the chat template failed: {first_line(exc)}") from None
        if not whole_text.startswith(prompt_text):
            raise ChatError(row, f"the chat template does not keep the rendered {self.prompt_column} as a prefix of "
                                 f"{self.prompt_column} + {self.response_column}, so the response tokens cannot be "
                                 "told apart (TRL refuses such a template too); give prompt_ids and response_ids "
                                 "instead")
        return prompt_text, whole_text

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
            # none; templates test for keys (`'tool_calls' in message`), so the Nones go.
            messages.append({k: v for k, v in message.items() if v is not None or k in ("role", "content")})
        return messages
