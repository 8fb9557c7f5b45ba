"""The second pass: the token ids and logprobs of the rows the page embeds, and nothing of the others.

Record batches are read with those columns alone, and each keeps only its picked rows, so a file of
millions of rows costs one read of its token columns and the memory of a few batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from klpipe.arrow import numpy_valid, numpy_view
from klpipe.cache import (
    ID,
    KL_POLICY_REF,
    MASK,
    POLICY_ENTROPY,
    POLICY_LOGPROBS,
    PROMPT_IDS,
    REF_LOGPROBS,
    RESPONSE_IDS,
    SAMPLER_LOGPROBS,
)
from klpipe.errors import InputError
from klpipe.inspect.select import Source
from klpipe.mask import read_mask
from klpipe.score.input import read_batches


@dataclass
class PickedRow:
    """One embedded row's tokens, aligned with its response."""

    index: int  # the row's position in the file
    name: str  # `FILE: row N (id 'ID')`, as messages name it
    prompt_ids: np.ndarray | None  # (prompt tokens,) int64, when the file has prompt ids
    response_ids: np.ndarray  # (response tokens,) int64
    policy: np.ndarray  # (response tokens,) as stored (float32 or float64); NaN where null
    ref: np.ndarray  # (response tokens,) likewise; NaN where the mask is 0 (precompute computes none there)
    mask: np.ndarray | None  # (response tokens,) bool: 1 where the policy sampled the token
    sampler: np.ndarray | None = None  # (response tokens,) the sampler's logprobs as stored; NaN where null
    # With the exact KL's columns (select.py has checked them on every row): as stored, NaN where the mask is 0.
    exact: np.ndarray | None = None  # (response tokens,) KL(π ‖ π_ref) over the vocabulary
    entropy: np.ndarray | None = None  # (response tokens,) H(π)


def check_token_columns(source: Source) -> None:
    """The page decodes token ids: a file without them (text rows never precomputed) cannot be shown."""
    name = source.columns.name(RESPONSE_IDS)
    if name not in source.schema.names:
        raise InputError(f"{source.path}: no {name} column; klpipe inspect decodes the response's token ids "
                         "(a cache klpipe precompute wrote has them)")
    for role in (RESPONSE_IDS, PROMPT_IDS):
        column = source.columns.name(role)
        if column in source.schema.names:
            kind = source.schema.field(column).type
            if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
                raise InputError(f"{source.path}: {column} must be a list of integer token ids, got {kind}")


def gather(source: Source, indices: np.ndarray, batch_tokens: int) -> dict[int, PickedRow]:
    """The rows at `indices` (positions in the file), by position."""
    names = source.columns
    roles = [role for role in (PROMPT_IDS, RESPONSE_IDS, POLICY_LOGPROBS, REF_LOGPROBS, MASK, SAMPLER_LOGPROBS)
             if source.has(role)] + ([KL_POLICY_REF, POLICY_ENTROPY] if source.exact else [])
    only = [names.name(role) for role in roles] + ([names.name(ID)] if source.has(ID) else [])
    wanted = np.sort(np.asarray(indices, dtype=np.int64))
    found: dict[int, PickedRow] = {}
    for batch, rows in read_batches([source.path], batch_tokens, 1 << 62, names, only=only):
        start = rows.first_index
        local = wanted[(wanted >= start) & (wanted < start + batch.num_rows)] - start
        for i in local.tolist():
            found[start + i] = _row(batch.slice(i, 1), start + i, rows.name(i), source)
    return found


def _row(batch: pa.RecordBatch, index: int, name: str, source: Source) -> PickedRow:
    names = source.columns

    def values(role: str) -> np.ndarray | None:
        if not source.has(role):
            return None
        array = batch.column(names.name(role))
        if array.null_count:
            raise InputError(f"{name}: {names.name(role)} is null")
        flat = array.flatten()
        out = numpy_view(flat).copy() if len(flat) else np.zeros(0, dtype=_dtype(flat.type))
        if flat.null_count:  # logprobs where the mask is 0
            out[~numpy_valid(flat)] = np.nan
        return out

    def required(role: str) -> np.ndarray:
        found = values(role)
        assert found is not None, f"{role}: open_source checked that the file has it"
        return found

    response_ids = required(RESPONSE_IDS).astype(np.int64)
    policy, ref = required(POLICY_LOGPROBS), required(REF_LOGPROBS)
    if len(response_ids) != len(policy):
        raise InputError(f"{name}: {names.name(RESPONSE_IDS)} has {len(response_ids)} tokens but "
                         f"{names.name(POLICY_LOGPROBS)} has {len(policy)}; the logprobs must be of the response's "
                         "tokens")
    mask = None
    if source.has(MASK):
        mask = read_mask(batch.column(names.name(MASK)), np.array([len(policy)]), names.name(MASK),
                         names.name(POLICY_LOGPROBS), lambda _: name)
    prompt = values(PROMPT_IDS)
    sampler = None
    if source.has(SAMPLER_LOGPROBS) and batch.column(names.name(SAMPLER_LOGPROBS)).null_count == 0:
        sampler = required(SAMPLER_LOGPROBS)
        if len(sampler) != len(policy):  # another length: klpipe score names the row misaligned; nothing to align
            sampler = None
    exact, entropy = (values(KL_POLICY_REF), values(POLICY_ENTROPY)) if source.exact else (None, None)
    return PickedRow(index=index, name=name, prompt_ids=None if prompt is None else prompt.astype(np.int64),
                     response_ids=response_ids, policy=policy, ref=ref, mask=mask, sampler=sampler, exact=exact,
                     entropy=entropy)


def _dtype(kind: pa.DataType) -> np.dtype:
    return np.dtype(np.float64) if kind == pa.float64() else np.dtype(np.float32) if pa.types.is_floating(kind) \
        else np.dtype(np.int64)
