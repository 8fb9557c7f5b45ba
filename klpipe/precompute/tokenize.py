"""Tokenizing a chunk of rollouts into flat token-id arrays, and checking every row against the model.

Token ids are used as they are; text is tokenized with the reference tokenizer; TRL conversational
messages are rendered with its chat template (chat.py). Every row is checked against the model's
vocabulary and context before any forward pass, and a bad row is named by file and index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import pyarrow as pa

from klpipe import cache
from klpipe.arrow import (
    first_null,
    first_null_in_lists,
    list_array,
    offsets_from_lengths,
)
from klpipe.errors import InputError
from klpipe.mask import read_mask
from klpipe.precompute import trainer_batches
from klpipe.precompute.chat import ChatError, ChatRenderer, ChatRendering
from klpipe.precompute.rollouts import BATCH, CHAT, TOKEN_IDS, Chunk, Rollouts
from klpipe.rows import row_name


@dataclass
class TokenizedChunk:
    chunk: Chunk
    table: pa.Table  # input columns, plus prompt_ids/response_ids in text and chat modes
    prompt_ids: np.ndarray  # flat int64 token ids of all prompts
    prompt_offsets: np.ndarray  # (rows + 1,)
    response_ids: np.ndarray
    response_offsets: np.ndarray
    # (response tokens,) bool: 1 where the policy sampled the token (klpipe/mask.py); None: every token.
    mask: np.ndarray | None = None
    derived_mask: bool = False  # the mask came from a conversation's roles and is written to the cache
    pads: int = 0  # pad tokens left out: stripped from a padded batch, or masked 0 after a response's end (never fed)
    masked_pads: int = 0  # those of `pads` that are in the response, masked 0 (not stripped)

    @property
    def num_rows(self) -> int:
        return len(self.prompt_offsets) - 1

    def prompt_lengths(self) -> np.ndarray:
        return np.diff(self.prompt_offsets)

    def response_lengths(self) -> np.ndarray:
        return np.diff(self.response_offsets)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompt ids, response ids) of row i."""
        return (self.prompt_ids[self.prompt_offsets[i]:self.prompt_offsets[i + 1]],
                self.response_ids[self.response_offsets[i]:self.response_offsets[i + 1]])

    def row_mask(self, i: int) -> np.ndarray | None:
        """Row i's mask (a bool per response token), or None when the rows have none."""
        if self.mask is None:
            return None
        return self.mask[self.response_offsets[i]:self.response_offsets[i + 1]]

    def tool_tokens(self) -> int:
        """Response tokens the mask holds 0 that are not pads: a tool's, fed as context and not scored."""
        return 0 if self.mask is None else int(len(self.mask) - np.count_nonzero(self.mask)) - self.masked_pads

    def scored_tokens(self) -> int:
        """Response tokens whose logprob is computed: the mask's 1s, or every one."""
        return int(self.response_offsets[-1]) if self.mask is None else int(np.count_nonzero(self.mask))


class ChunkTokenizer:
    """Turns a chunk into flat token-id arrays and checks every row against the model's limits."""

    def __init__(self, rollouts: Rollouts, tokenizer, vocab_size: int, max_positions: int | None,
                 chat: ChatRendering | None = None, end_ids=()):
        self.rollouts = rollouts
        self.names = rollouts.columns.name  # role -> the user's column
        self.tokenizer = tokenizer  # only used in text and chat modes
        self.chat = ChatRenderer(tokenizer, self.names(cache.PROMPT), self.names(cache.RESPONSE),
                                 self.names(cache.TOOLS), chat)
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        # Where ids come as they are, a pad at the prompt's left or after the response's end is refused (or, masked
        # 0 at the end, counted and never fed); once where it is also the BOS or a stop token the policy sampled.
        self.pad_id = getattr(tokenizer, "pad_token_id", None)
        self.bos_id = getattr(tokenizer, "bos_token_id", None)
        self.end_ids = {*end_ids, getattr(tokenizer, "eos_token_id", None)} - {None}

    def __call__(self, chunk: Chunk) -> TokenizedChunk:
        table = chunk.table
        names = self.names
        derived = None  # conversational rows: the mask their roles give
        pads = 0
        if self.rollouts.mode == BATCH:  # the attended tokens of a trainer's padded batch, as prompt_ids & co.
            assert self.rollouts.batch is not None  # open_rollouts names the batch's kind with mode BATCH
            table, pads = trainer_batches.unpad(table, self.rollouts.batch, lambda i: self._row_name(chunk, i))
        if self.rollouts.mode in (TOKEN_IDS, BATCH):
            prompt, prompt_off = self._flat_ids(chunk, names(cache.PROMPT_IDS), table)
            response, response_off = self._flat_ids(chunk, names(cache.RESPONSE_IDS), table)
        else:
            if self.rollouts.mode == CHAT:
                prompt_lists, response_lists, derived = self._render_chat(chunk)
            else:
                prompt_lists, response_lists = self._tokenize_text(chunk)
            prompt, prompt_off = _flatten(prompt_lists)
            response, response_off = _flatten(response_lists)
            table = self._with_ids(table, prompt, prompt_off, response, response_off)
        tokenized = TokenizedChunk(chunk, table, prompt, prompt_off, response, response_off, pads=pads)
        self._validate(tokenized)
        self._read_mask(tokenized, derived)
        if self.rollouts.mode == TOKEN_IDS:
            self._check_pads(tokenized)
        return tokenized

    def _check_pads(self, t: TokenizedChunk) -> None:
        """Ids as they came: a left pad would be fed as context the policy never saw, a right pad scored as
        sampled. Refused naming the row, but trailing pads the mask holds 0 (never fed: nothing after a row's last 1
        is), which are counted as pads."""
        pad = self.pad_id
        if pad is None:
            return
        names = self.names
        for i in range(t.num_rows):
            prompt, response = t.row(i)
            lead = _run_length(prompt, pad)
            if lead > (1 if pad == self.bos_id else 0):
                self._fail(t.chunk, i, f"{names(cache.PROMPT_IDS)} starts with {lead} pad tokens (id {pad}): left "
                                       "padding would be fed as context the policy never saw; give the prompt "
                                       "unpadded, or a trainer's batch whole (verl's prompts, responses, "
                                       "attention_mask), which klpipe unpads")
            trail = _run_length(response[::-1], pad)
            if not trail:
                continue
            mask = t.row_mask(i)
            sampled = trail if mask is None else int(np.count_nonzero(mask[len(response) - trail:]))
            if sampled > (1 if pad in self.end_ids else 0):
                self._fail(t.chunk, i, f"{names(cache.RESPONSE_IDS)} ends with {trail} pad tokens (id {pad}) "
                                       f"{'that its mask holds 1' if mask is not None else 'and no mask'}: they "
                                       "would be scored as sampled; give the response unpadded, or a mask that "
                                       "holds 0 at its pads (--column mask=NAME)")
            t.pads += trail - sampled
            t.masked_pads += trail - sampled

    def _read_mask(self, t: TokenizedChunk, derived: list[np.ndarray] | None) -> None:
        """The chunk's mask: the mask column, checked against the response tokens; for conversational rows, the
        mask their roles give, checked against the column when there is one too."""
        name = self.names(cache.MASK)
        lengths = t.response_lengths()
        against = self.names(cache.RESPONSE_IDS)
        given = None
        if name in t.table.column_names:
            given = read_mask(t.table.column(name), lengths, name, against,
                              lambda i: self._row_name(t.chunk, i))
        if derived is None:
            t.mask = given
            return
        flat = np.concatenate(derived) if derived else np.zeros(0, dtype=bool)
        if given is not None:
            differs = np.flatnonzero(given != flat)
            if len(differs):
                row = int(np.searchsorted(t.response_offsets, differs[0], side="right") - 1)
                token = int(differs[0] - t.response_offsets[row])
                self._fail(t.chunk, row, f"{name} differs from the mask the conversation's roles give (response token "
                                         f"{token}: {int(given[differs[0]])} in {name}, {int(flat[differs[0]])} "
                                         "from the roles; 1 is an assistant's token, 0 a tool's)")
        t.mask = flat
        t.derived_mask = given is None

    def _tokenize_text(self, chunk: Chunk) -> tuple[list[list[int]], list[list[int]]]:
        prompts = self._texts(chunk, self.names(cache.PROMPT))
        responses = self._texts(chunk, self.names(cache.RESPONSE))
        for i, text in enumerate(prompts):
            if not text:
                self._fail(chunk, i, f"{self.names(cache.PROMPT)} is empty")
        # The prompt is the exact text the policy saw, so it gets the tokenizer's default special
        # tokens (BOS for Gemma); the response continues it and must not get a second BOS.
        prompt_lists = self.tokenizer(prompts)["input_ids"]
        response_lists = self.tokenizer(responses, add_special_tokens=False)["input_ids"]
        # Text a chat template rendered may already start with BOS (Gemma's writes `<bos>`): the
        # one the tokenizer adds in front of it is a token no policy was given.
        bos, bos_id = self.tokenizer.bos_token, self.tokenizer.bos_token_id
        if bos and bos_id is not None:
            prompt_lists = [ids[1:] if ids[:2] == [bos_id, bos_id] and text.startswith(bos) else ids
                            for text, ids in zip(prompts, prompt_lists, strict=True)]
        return prompt_lists, response_lists

    def _render_chat(self, chunk: Chunk) -> tuple[list[list[int]], list[list[int]], list[np.ndarray]]:
        tools = self.names(cache.TOOLS)
        try:
            table = chunk.table
            return self.chat.render(table.column(self.names(cache.PROMPT)).to_pylist(),
                                    table.column(self.names(cache.RESPONSE)).to_pylist(),
                                    table.column(tools).to_pylist() if tools in table.column_names else None)
        except ChatError as exc:
            self._fail(chunk, exc.row, str(exc))

    def _flat_ids(self, chunk: Chunk, column: str, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        array = table.column(column).combine_chunks()
        row = first_null(array)
        if row is not None:
            self._fail(chunk, row, f"{column} is null")
        row = first_null_in_lists(array)  # as ints a null would read as -2**63, "outside the vocabulary"
        if row is not None:
            self._fail(chunk, row, f"{column} holds a null")
        # `flatten()` honours slicing; `.values` would not.
        flat = np.asarray(array.flatten(), dtype=np.int64)
        offsets = np.asarray(array.offsets, dtype=np.int64)
        offsets = offsets - offsets[0]
        return flat, offsets

    def _texts(self, chunk: Chunk, column: str) -> list[str]:
        array = chunk.table.column(column)
        row = first_null(array)
        if row is not None:
            self._fail(chunk, row, f"{column} is null")
        return array.to_pylist()

    def _with_ids(self, table, prompt, prompt_off, response, response_off) -> pa.Table:
        for name, flat, offsets in (
            (self.names(cache.PROMPT_IDS), prompt, prompt_off),
            (self.names(cache.RESPONSE_IDS), response, response_off),
        ):
            column = list_array(offsets, flat.astype(np.int32))  # TOKEN_ID_TYPE
            if name in table.column_names:  # text mode wins only when ids were incomplete
                table = table.set_column(table.column_names.index(name), name, column)
            else:
                table = table.append_column(name, column)
        return table

    def _validate(self, t: TokenizedChunk) -> None:
        chunk = t.chunk
        prompt_len = t.prompt_lengths()
        empty = np.flatnonzero(prompt_len == 0)
        if len(empty):
            self._fail(chunk, int(empty[0]),
                       f"{self.names(cache.PROMPT_IDS)} is empty (a response needs at least one prompt token)")
        for column, flat, offsets in (
            (self.names(cache.PROMPT_IDS), t.prompt_ids, t.prompt_offsets),
            (self.names(cache.RESPONSE_IDS), t.response_ids, t.response_offsets),
        ):
            bad = np.flatnonzero((flat < 0) | (flat >= self.vocab_size))
            if len(bad):
                row = int(np.searchsorted(offsets, bad[0], side="right") - 1)
                self._fail(
                    chunk, row,
                    f"token id {int(flat[bad[0]])} in {column} is outside the model's vocabulary "
                    f"(0..{self.vocab_size - 1})",
                )
        if self.max_positions:
            total = prompt_len + t.response_lengths()
            too_long = np.flatnonzero(total > self.max_positions)
            if len(too_long):
                row = int(too_long[0])
                self._fail(
                    chunk, row,
                    f"{int(total[row])} tokens (prompt + response) exceed the model's context of {self.max_positions}",
                )

    def _fail(self, chunk: Chunk, row: int, problem: str) -> NoReturn:
        raise InputError(f"{self._row_name(chunk, row)}: {problem}")

    def _row_name(self, chunk: Chunk, row: int) -> str:
        # A chunk may span input files: each row knows its own file and its index there.
        path = self.rollouts.files[int(chunk.file_index[row])].path
        id_column = self.names(cache.ID)
        row_id = chunk.table.column(id_column)[row].as_py() if id_column in chunk.table.column_names else None
        return row_name(path, int(chunk.file_row[row]), row_id)


def _run_length(ids: np.ndarray, value: int) -> int:
    """How many of `ids`' first values are `value`."""
    differs = np.flatnonzero(ids != value)
    return int(differs[0]) if len(differs) else len(ids)


def _flatten(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = offsets_from_lengths([len(x) for x in lists])
    flat = np.fromiter((tok for x in lists for tok in x), dtype=np.int64, count=int(offsets[-1]))
    return flat, offsets
