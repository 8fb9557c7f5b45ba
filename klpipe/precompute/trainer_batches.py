"""Trainers' padded batches, read whole: verl's batch keys and OpenRLHF's experience fields.

verl 0.9.1's agent loop (`agent_loop.py`, `_agent_loop_postprocess`) pads every row of a batch to its width:
`prompts` on the left, `responses` on the right, one `attention_mask` over both (0 at each pad) and
`response_mask = mask * attention_mask` (0 at a tool's tokens and at the pads). OpenRLHF's `Experience` holds
`sequences` (the prompt left-padded and the response right-padded, one row), `attention_mask` over it, and
`action_mask` and `action_log_probs` over its last `num_actions` positions. Fed as they come, the left pads are
context the policy never saw and the right pads responses it never sampled; so klpipe takes each row's
attended tokens only: the prompt where the attention mask is 1, the response up to its last attended token.
A hole in either (a 0 between 1s), or a response mask that is 1 at a pad, is refused naming the row.

verl's trainer.rollout_data_dir JSON Lines (`input`, `output`, `score`, `step`) are refused: the text is decoded
with special tokens skipped and tool results inside `output`, so no tokenizer gets back what the policy sampled.

Pure numpy and pyarrow.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa

from klpipe import cache
from klpipe.arrow import is_list_type
from klpipe.errors import InputError
from klpipe.mask import MASK_TYPE

VERL = "verl"
OPENRLHF = "openrlhf"
KEYS = {VERL: ("prompts", "responses", "attention_mask"), OPENRLHF: ("sequences", "attention_mask", "action_mask")}
DUMP_FIELDS = ("input", "output", "score", "step")  # verl's _write_generations
# The roles a batch's columns give; a --column for one of them would point it at another column.
DERIVED = (cache.PROMPT_IDS, cache.RESPONSE_IDS, cache.MASK, cache.POLICY_LOGPROBS, cache.SAMPLER_LOGPROBS,
           cache.REWARD)
LOGPROBS_TYPE = pa.list_(pa.float32())
SAVE_IDS = ("save the batch instead, which klpipe reads as it is: batch.save_to_disk(PATH), or its keys (prompts, "
            "responses, attention_mask, response_mask, rollout_log_probs) as parquet "
            "(docs/formats.md: Agent trajectories)")


def detect(schema: pa.Schema) -> str | None:
    """VERL or OPENRLHF when the columns are that trainer's batch keys, else None."""
    names = set(schema.names)
    for kind, keys in KEYS.items():
        if set(keys) <= names:
            return kind
    return None


def refuse_rollout_dump(path: object, schema: pa.Schema) -> None:
    """verl's trainer.rollout_data_dir JSONL is text that cannot give back the sampled tokens: one line why."""
    if set(DUMP_FIELDS) <= set(schema.names) and detect(schema) is None:
        raise InputError(f"{path}: is verl's rollout dump (trainer.rollout_data_dir: input, output, score, step), "
                         "text decoded with special tokens skipped and tool results unmasked inside output, not the "
                         f"tokens the policy sampled; {SAVE_IDS}")


def derived_fields(kind: str, schema: pa.Schema) -> list[pa.Field]:
    """The columns `unpad` adds to the batch's, in order: they go into the cache and score reads them."""
    names = schema.names
    fields = [pa.field(cache.PROMPT_IDS, pa.list_(pa.int32())), pa.field(cache.RESPONSE_IDS, pa.list_(pa.int32())),
              pa.field(cache.MASK, MASK_TYPE)]
    logprobs, sampler = _logprob_sources(kind, names)
    if logprobs is not None:
        fields.append(pa.field(cache.POLICY_LOGPROBS, LOGPROBS_TYPE))
    if sampler is not None:
        fields.append(pa.field(cache.SAMPLER_LOGPROBS, LOGPROBS_TYPE))
    if _reward_source(kind, schema) is not None:
        fields.append(pa.field(cache.REWARD, pa.float64()))
    return fields


def check_schema(path: object, kind: str, schema: pa.Schema, given: dict[str, str]) -> None:
    """The keys are lists of numbers, and neither a --column nor a column of the input claims a derived role."""
    for key in (*KEYS[kind], "response_mask"):
        if key in schema.names:
            found = schema.field(key).type
            if not (is_list_type(found) and (pa.types.is_integer(found.value_type)
                                             or pa.types.is_boolean(found.value_type))):
                raise InputError(f"{path}: {key} must be a list of integers per row (the batch padded), found {found}")
    trainer = "verl's batch" if kind == VERL else "OpenRLHF's experience"
    keys = ", ".join(KEYS[kind])
    for role in DERIVED:
        if role in given:
            raise InputError(f"{path}: holds {trainer} ({keys}), which klpipe reads by its keys and unpads: "
                             f"drop --column {role}={given[role]}")
    taken = [field.name for field in derived_fields(kind, schema) if field.name in schema.names]
    if taken:
        raise InputError(f"{path}: holds {trainer} ({keys}) and a {taken[0]} column too; klpipe writes "
                         f"{taken[0]} from the batch's keys: drop or rename that column")


def unpad(table: pa.Table, kind: str, row_name: Callable[[int], str]) -> tuple[pa.Table, int]:
    """The batch with each row's attended tokens as `derived_fields`' columns, and how many pads were stripped."""
    columns = {name: table.column(name).to_pylist() for name in table.column_names
               if name in (*KEYS[kind], "responses", "response_mask", "old_log_probs", "rollout_log_probs",
                           "action_log_probs", "token_level_scores")}
    rows = table.num_rows
    prompts, responses, masks, pads = [], [], [], 0
    cuts = []  # (rows,) each row's response as (first, end) positions: where its per-token columns are cut
    response_masks = columns.get("response_mask") or [None] * rows  # verl's, where the batch has one
    for i in range(rows):
        for key, values in columns.items():
            if values[i] is None:
                raise InputError(f"{row_name(i)}: {key} is null")
        attention = np.asarray(columns["attention_mask"][i], dtype=np.int64)
        if kind == VERL:
            prompt_region, response_region = np.asarray(columns["prompts"][i]), np.asarray(columns["responses"][i])
            mask_name, given = "response_mask", response_masks[i]
        else:
            sequence = np.asarray(columns["sequences"][i])
            mask_name, given = "action_mask", columns["action_mask"][i]
            actions = len(given)  # num_actions: action_mask covers the last ones of sequences
            if len(attention) != len(sequence) or actions > len(sequence):
                raise InputError(f"{row_name(i)}: attention_mask has {len(attention)} values, sequences "
                                 f"{len(sequence)} and action_mask {actions}; OpenRLHF's attention_mask covers "
                                 "sequences and action_mask its last num_actions positions")
            prompt_region, response_region = sequence[:len(sequence) - actions], sequence[len(sequence) - actions:]
        start, end = _attended(attention, len(prompt_region), len(response_region), row_name, i)
        mask = _response_mask(given, mask_name, len(response_region), end, row_name, i)
        # OpenRLHF's later layout has action_mask over the whole sequence less its first token, 0 over the prompt:
        # the masked run before the first action is context the policy never sampled, so it joins the prompt (the
        # same tokens fed, the same logprobs, and the summary does not count the prompt as a tool's tokens).
        lead = int(np.argmax(mask)) if kind == OPENRLHF and mask.any() else 0
        prompts.append(prompt_region[start:].tolist() + response_region[:lead].tolist())
        responses.append(response_region[lead:end].tolist())
        masks.append(mask[lead:].tolist())
        cuts.append((lead, end))
        pads += start + len(response_region) - end
    added = {cache.PROMPT_IDS: pa.array(prompts, pa.list_(pa.int32())),
             cache.RESPONSE_IDS: pa.array(responses, pa.list_(pa.int32())),
             cache.MASK: pa.array(masks, MASK_TYPE)}
    logprobs, sampler = _logprob_sources(kind, table.column_names)
    for role, source in ((cache.POLICY_LOGPROBS, logprobs), (cache.SAMPLER_LOGPROBS, sampler)):
        if source is not None:
            added[role] = pa.array([_cut(columns[source][i], *cuts[i], source, row_name(i)) for i in range(rows)],
                                    LOGPROBS_TYPE)
    reward = _reward_source(kind, table.schema)
    if reward == "token_level_scores":
        added[cache.REWARD] = pa.array([float(np.sum(columns[reward][i], dtype=np.float64)) for i in range(rows)],
                                       pa.float64())
    elif reward is not None:
        added[cache.REWARD] = table.column(reward).cast(pa.float64())
    for name, column in added.items():
        table = table.append_column(name, column)
    return table, pads


def _attended(attention: np.ndarray, prompt_width: int, response_width: int, row_name: Callable[[int], str],
              i: int) -> tuple[int, int]:
    """(start, end): row i's first attended prompt position and its response's attended length, its attention
    mask checked to pad the prompt on the left only and the response on the right only."""
    width = prompt_width + response_width
    if len(attention) != width:
        raise InputError(f"{row_name(i)}: attention_mask has {len(attention)} values but prompts and responses "
                         f"{width} tokens; verl's attention_mask covers both")
    if ((attention != 0) & (attention != 1)).any():
        raise InputError(f"{row_name(i)}: attention_mask holds a value other than 0 and 1")
    prompt_attention, response_attention = attention[:prompt_width], attention[prompt_width:]
    start = len(prompt_attention) - int(prompt_attention.sum())
    if not prompt_attention[start:].all():
        raise InputError(f"{row_name(i)}: attention_mask has a 0 inside the prompt (a pad between its tokens); "
                         "klpipe reads a prompt padded on the left only")
    end = int(response_attention.sum())
    if not response_attention[:end].all():
        raise InputError(f"{row_name(i)}: attention_mask has a 0 inside the response (a pad between its tokens); "
                         "klpipe reads a response padded on the right only")
    if start == prompt_width:
        raise InputError(f"{row_name(i)}: the prompt has no attended token")
    return start, end


def _response_mask(given: list | None, mask_name: str, response_width: int, end: int,
                   row_name: Callable[[int], str], i: int) -> np.ndarray:
    """Row i's mask over its `end` attended response tokens (int8), from the batch's `mask_name`, checked."""
    if given is None:  # verl without response_mask: its compute_response_mask is the response's attention
        return np.ones(end, dtype=np.int8)
    mask = np.asarray(given, dtype=np.int64)
    if len(mask) != response_width:
        raise InputError(f"{row_name(i)}: {mask_name} has {len(mask)} values but the padded response "
                         f"{response_width}")
    if ((mask != 0) & (mask != 1)).any():
        raise InputError(f"{row_name(i)}: {mask_name} holds a value other than 0 and 1")
    if mask[end:].any():
        raise InputError(f"{row_name(i)}: {mask_name} is 1 at a pad (response position "
                         f"{end + int(np.flatnonzero(mask[end:])[0])}, after the last attended token)")
    return mask[:end].astype(np.int8)


def _cut(values: list, first: int, end: int, source: str, name: str) -> list:
    """A padded per-token column cut to the response's attended tokens from `first` (an OpenRLHF prompt's run)."""
    if len(values) < end:
        raise InputError(f"{name}: {source} has {len(values)} values, fewer than the response's {end} tokens")
    return values[first:end]


def _logprob_sources(kind: str, names: list[str]) -> tuple[str | None, str | None]:
    """(the column read as policy_logprobs, the one kept as sampler_logprobs beside it)."""
    if kind == OPENRLHF:
        return ("action_log_probs" if "action_log_probs" in names else None), None
    if "old_log_probs" in names:  # the trainer's, with the sampler's (vLLM's) beside them
        return "old_log_probs", ("rollout_log_probs" if "rollout_log_probs" in names else None)
    return ("rollout_log_probs" if "rollout_log_probs" in names else None), None


def _reward_source(kind: str, schema: pa.Schema) -> str | None:
    if kind == VERL and "token_level_scores" in schema.names:
        return "token_level_scores"  # per token, the score at the last one: their sum is the row's reward
    kind_ = schema.field("score").type if "score" in schema.names else None
    if kind_ is not None and (pa.types.is_floating(kind_) or pa.types.is_integer(kind_)):
        return "score"  # a scalar per row
    return None
