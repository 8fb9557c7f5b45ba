"""The load-time check of packed rows (packing.py): the probe packed after another row and split at another place,
held to the model's own forward on the positions it scores; a model that fails keeps its rows padded, and says why.
"""

from __future__ import annotations

import numpy as np

from klpipe.model.attention.packing import (
    CHECKING,
    DISAGREE,
    NotPacked,
    probe_ids,
    probe_row,
    refusal,
    scored,
)


def packed_rows(reference) -> list[tuple[np.ndarray, np.ndarray]]:
    """What `check` packs: the probe as probe_row cuts it, after another row, and split at another place (half way
    into the scored positions): a row that reads across the boundary, or a position that does not restart, moves
    its logprobs."""
    ids, other = probe_ids(reference)
    cut = len(ids) - scored(reference, len(ids))
    split = cut + (len(ids) - cut) // 2
    return [(ids[:cut], ids[cut:]), (other[:2], other[2:]), (ids[:split], ids[split:])]



def check(reference, verdict):
    """`verdict` (model/verdict.py) with rows run whole packed where they reproduce the model's own forward, else
    padded and why. Call after the oracle is taken and before the cascade is installed; the model is left padded
    (the caller applies what this returns)."""
    from klpipe.model.probes import klpipe_rows, own_rows

    why = refusal(reference)
    if why is not None:
        return verdict.but(packed=False, padded_why=why)
    rows = packed_rows(reference)
    expected = own_rows(reference, [probe_row(reference)], block=reference.head.rows)[0]  # (S,) the scored positions
    start = len(rows[2][0]) - len(rows[0][0])  # where the split row's response starts among them
    reference.apply(verdict.but(packed=True, padded_why=CHECKING))
    try:
        whole, _, split = klpipe_rows(reference, rows)
        found = max(float(np.max(np.abs(whole - expected))), float(np.max(np.abs(split - expected[start:]))))
    except NotPacked as exc:
        found, why = None, str(exc)
    except Exception as exc:  # noqa: BLE001 - the model's code cannot take packed rows: it keeps them padded
        # In klpipe's words, the model's own error after them: the record and the run's note say which model code
        # could not take the packed batch (qwen4_exp_text's top-k indexer reads the mask packed rows go without).
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        found, why = None, f"its forward fails on packed rows ({type(exc).__name__}: {said})"
    finally:
        reference.apply(verdict)
    if found is not None and found <= reference.probe_tolerance:
        return verdict.but(packed=True, padded_why=None)
    # The record keeps the reason; the log line its figure.
    shown = f"{DISAGREE}: max |Δ logprob| = {found:.3g}" if found is not None else why
    return verdict.but(packed=False, padded_why=why or DISAGREE).noted(
        f"{type(reference.model).__name__}: rows run whole go padded ({shown})")
