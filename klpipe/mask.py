"""The mask role: which response tokens the policy sampled, and which it only read.

A tool-using agent's trajectory is often stored as one row whose completion interleaves the model's
turns with the tools' results. TRL's GRPOTrainer writes `tool_mask` (`env_mask` from a rollout
function), OpenRLHF `action_mask`, verl `response_mask`: 1 where the policy sampled the token, 0
where a tool wrote it. The policy's logprob at a 0 is a placeholder (TRL writes 0.0), so KL taken
there is a number about nothing: klpipe score takes KL over the 1s only, and precompute feeds the
0s as context but computes no logprob for them (their `ref_logprobs` value is null).

Both stages check a mask the same way, here: a list per row, one 0/1 (or boolean) per response
token. Pure numpy and pyarrow.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa

from klpipe.arrow import first_null, first_null_in_lists, is_list_type, numpy_view
from klpipe.errors import InputError

MASK_TYPE = pa.list_(pa.int8())  # what precompute writes when it derives a mask (conversational rows)


def check_mask_type(path: object, schema: pa.Schema, name: str) -> None:
    """A mask column must be a list of integers or booleans."""
    kind = schema.field(name).type
    if not (is_list_type(kind) and (pa.types.is_integer(kind.value_type) or pa.types.is_boolean(kind.value_type))):
        raise InputError(f"{path}: column {name} (the mask) must be a list of 0/1 per response token, found {kind}")


def read_mask(array: pa.Array | pa.ChunkedArray, lengths: np.ndarray, name: str, against: str,
              row_name: Callable[[int], str]) -> np.ndarray:
    """The flat (tokens,) bool mask of a batch's rows, checked against each row's `lengths` response tokens.

    Refuses a null, a row whose mask has another length than its response (`against` names the
    column it is measured against), and a value other than 0 and 1, naming the first such row.
    """
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    row = first_null(array)
    if row is not None:
        raise InputError(f"{row_name(row)}: {name} is null")
    row = first_null_in_lists(array)
    if row is not None:
        raise InputError(f"{row_name(row)}: {name} holds a null")
    offsets = numpy_view(array.offsets).astype(np.int64)
    mask_lengths = np.diff(offsets)
    wrong = np.flatnonzero(mask_lengths != lengths)
    if len(wrong):
        i = int(wrong[0])
        raise InputError(f"{row_name(i)}: {name} has {mask_lengths[i]} values but {against} has {lengths[i]} tokens; "
                         "the mask needs one value per response token")
    values = array.flatten()  # honours slicing
    if pa.types.is_boolean(values.type):
        return numpy_view(values.cast(pa.int8())).astype(bool)  # Arrow packs booleans into bits
    flat = numpy_view(values)
    bad = np.flatnonzero((flat != 0) & (flat != 1))
    if len(bad):
        i = int(np.searchsorted(offsets - offsets[0], bad[0], side="right") - 1)
        raise InputError(f"{row_name(i)}: {name} holds {int(flat[bad[0]])}; a mask holds 1 where the policy "
                         "sampled the token and 0 where it did not (a tool's result)")
    return flat.astype(bool)


def kept_offsets(keep: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Row offsets (rows + 1,) into `values[keep]`, for rows that were `offsets` into `values`."""
    cumulative = np.concatenate([[0], np.cumsum(keep, dtype=np.int64)])
    return cumulative[offsets]


# Columns named like a mask. Those whose meaning klpipe knows (1 where the policy sampled the response token) are
# read by name when the run has no mask column; any other is refused unread: a mask left unread scores its 0s.
KNOWN_MASKS = {"response_mask": "verl's", "action_mask": "OpenRLHF's"}
MASK_LIKE = ("response_mask", "action_mask", "loss_mask", "attention_mask", "labels")


def mask_by_name(path: object, schema: pa.Schema, mask: str, mapped: bool) -> str | None:
    """The column to read as the mask by its name, or None; a mask-like column the run would not read is an error.

    `mask` is the column the run reads as the mask (found or not); `mapped`: the user named it with --column,
    which says what the other columns are not.
    """
    unread = [name for name in MASK_LIKE if name in schema.names and name != mask]
    if not unread or mapped:
        return None
    if mask in schema.names:
        raise InputError(f"{path}: columns {mask} and {unread[0]} could each be the mask; name the one to use "
                         f"with --column mask={mask}")
    if len(unread) == 1 and unread[0] in KNOWN_MASKS:
        return unread[0]
    known = [name for name in unread if name in KNOWN_MASKS]
    if known:
        raise InputError(f"{path}: columns {' and '.join(unread)} are named like masks; name the one that is 1 where "
                         f"the policy sampled the token with --column mask={known[0]}")
    what = {"attention_mask": "marks pads, which klpipe reads only in a trainer's whole batch (verl's prompts, "
                              "responses, attention_mask; OpenRLHF's sequences, attention_mask, action_mask)",
            "labels": "holds -100 where no loss is taken, over the whole sequence",
            "loss_mask": "may cover the prompt or the response"}[unread[0]]
    raise InputError(f"{path}: column {unread[0]} {what}; klpipe would leave it unread: give the response's mask "
                     "(1 where the policy sampled the token) with --column mask=NAME")
