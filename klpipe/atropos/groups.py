"""One Atropos group: split into klpipe's rows, and its JSON line filled back in.

atroposlib 0.4.0's `ScoredDataGroup` (envs/base.py): `tokens` holds one token list per completion, prompt
included; `masks` the same shape, -100 where the trainer does not train and the token id where it does;
`scores` one reward each; `inference_logprobs`, when there, aligned with `tokens`, with 1.0 at untrained
positions (its ManagedServer writes them so). A multi-turn completion keeps earlier turns trained and masks
each tool or environment suffix with -100.

A completion becomes one row: the prompt is every token before the first trained one, the response the
rest, and the mask `masks != -100` over the response.

A group goes back out as the line it came in, with only the values of the fields klpipe fills spliced in
(`fill_line`): every other field keeps its bytes, whatever the writer's spacing or number formatting.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from klpipe.errors import InputError

UNTRAINED = -100  # a mask value: the trainer does not train this position
PLACEHOLDER = 1.0  # Atropos's logprob at an untrained position (ManagedServer's inference_logprobs)
REQUIRED = ("tokens", "masks", "scores")  # what makes a JSON line an Atropos group

# Cache column: the group's JSON line as it came, on the row of its first completion (null on the others),
# so that score can write the group back in order with every field as it came.
GROUP_COLUMN = "atropos_group"

# What klpipe records in each completion's `overrides` when score penalises it.
RAW_SCORE = "klpipe_raw_score"  # the environment's reward, before the KL penalty
KL = "klpipe_kl"  # the completion's KL (the estimator and aggregate score ran with)
KL_COEFF = "klpipe_kl_coeff"  # the coefficient applied: score = raw score - coefficient * KL


@dataclass
class Completion:
    prompt: np.ndarray  # (prompt tokens,) int64: every token before the first trained one
    response: np.ndarray  # (response tokens,) int64: the rest
    mask: np.ndarray  # (response tokens,) int8: 1 where trained, 0 at a tool's or environment's suffix
    policy: np.ndarray | None  # (response tokens,) float64: inference_logprobs over the response, or None
    reward: float


def is_group(row: object) -> bool:
    """Whether a parsed JSON line is shaped like an Atropos group."""
    return isinstance(row, dict) and all(key in row for key in REQUIRED)


def split_group(group: dict, where: str) -> list[Completion]:
    """The group's completions as klpipe's rows; `where` ("FILE line N") names the group in errors."""
    tokens, masks, scores = group["tokens"], group["masks"], group["scores"]
    if not isinstance(tokens, list) or not tokens:
        raise InputError(f"{where}: tokens must be a non-empty list of token lists, one per completion")
    size = len(tokens)
    for name, value in (("masks", masks), ("scores", scores)):
        if not isinstance(value, list) or len(value) != size:
            raise InputError(f"{where}: {name} must hold one entry per completion ({size}, as tokens), "
                             f"found {len(value) if isinstance(value, list) else type(value).__name__}")
    logprobs = group.get("inference_logprobs")
    if logprobs is not None and (not isinstance(logprobs, list) or len(logprobs) != size):
        raise InputError(f"{where}: inference_logprobs must hold one list per completion ({size}), or be null")
    completions = []
    for i in range(size):
        name = f"{where}, completion {i}"
        ids = _int_list(tokens[i], f"{name}: tokens")
        mask = _int_list(masks[i], f"{name}: masks")
        if len(mask) != len(ids):
            raise InputError(f"{name}: masks holds {len(mask)} values and tokens {len(ids)}; they align")
        trained = mask != UNTRAINED
        wrong = np.flatnonzero(trained & (mask != ids))
        if len(wrong):
            p = int(wrong[0])
            raise InputError(f"{name}, position {p}: masks holds {int(mask[p])} where tokens holds {int(ids[p])}; "
                             f"a trained position's mask is its token id, an untrained one's {UNTRAINED}")
        first = int(np.argmax(trained)) if trained.any() else len(ids)
        policy = None
        if logprobs is not None:
            row = logprobs[i]
            if not isinstance(row, list) or len(row) != len(ids):
                found = len(row) if isinstance(row, list) else type(row).__name__
                raise InputError(f"{name}: inference_logprobs holds {found} values and tokens {len(ids)}; "
                                 "they align")
            try:
                policy = np.asarray(row[first:], dtype=np.float64)
            except (TypeError, ValueError):
                raise InputError(f"{name}: inference_logprobs must hold numbers") from None
        reward = scores[i]
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise InputError(f"{name}: scores must hold numbers, found {reward!r}")
        completions.append(Completion(prompt=ids[:first], response=ids[first:],
                                      mask=trained[first:].astype(np.int8), policy=policy, reward=float(reward)))
    return completions


def _int_list(value: object, name: str) -> np.ndarray:
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise InputError(f"{name} must be a list of integers")
    return np.asarray(value, dtype=np.int64)


# -- writing a group back ---------------------------------------------------------------------------

_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def top_level_spans(line: str) -> tuple[dict[str, tuple[int, int]], int]:
    """Where each top-level field's value lies in a JSON object's text, and where its closing brace is."""
    pos = _past_space(line, 0)
    if line[pos:pos + 1] != "{":
        raise ValueError("not a JSON object")
    pos = _past_space(line, pos + 1)
    spans: dict[str, tuple[int, int]] = {}
    if line[pos] == "}":
        return spans, pos
    while True:
        key, pos = _DECODER.raw_decode(line, pos)  # line[pos] is the key's opening quote
        pos = _past_space(line, pos) + 1  # past the colon
        start = _past_space(line, pos)
        _, end = _DECODER.raw_decode(line, start)
        spans[key] = (start, end)
        pos = _past_space(line, end)
        if line[pos] == "}":
            return spans, pos
        pos = _past_space(line, pos + 1)  # past the comma


def _past_space(line: str, pos: int) -> int:
    """The first position at or after `pos` that is not JSON whitespace."""
    space = _SPACE.match(line, pos)
    assert space is not None  # the pattern also matches the empty string
    return space.end()


def fill_line(line: str, values: dict[str, object]) -> str:
    """`line` (one group's JSON) with the top-level fields in `values` set; every other byte kept.

    A field the line lacks is added at its end, in the line's own spacing."""
    spans, close = top_level_spans(line)
    compact = '":' in line and '": ' not in line
    separators = (",", ":") if compact else (", ", ": ")
    added = [key for key in values if key not in spans]
    tail = "".join(f"{separators[0] if spans or i else ''}{json.dumps(key)}{separators[1]}"
                   f"{json.dumps(values[key], separators=separators, ensure_ascii=False)}"
                   for i, key in enumerate(added))
    out = line[:close] + tail + line[close:]
    for key, (start, end) in sorted(((k, s) for k, s in spans.items() if k in values), key=lambda ks: -ks[1][0]):
        out = out[:start] + json.dumps(values[key], separators=separators, ensure_ascii=False) + out[end:]
    return out


def aligned_ref_logprobs(prompt_length: int, ref: list[float | None]) -> list[float]:
    """A completion's reference logprobs aligned with its `tokens`: the placeholder at every position nothing was
    computed for (the prompt, and the response's untrained suffixes, null in the cache)."""
    return [PLACEHOLDER] * prompt_length + [PLACEHOLDER if value is None else float(value) for value in ref]
