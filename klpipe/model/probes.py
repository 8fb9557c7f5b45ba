"""The load-time check: every path klpipe computes logprobs by, held against the model's own forward.

Before any row, and before klpipe installs anything in the model, a probe sequence runs through the
model as transformers loaded it (its own attention implementation, its own head and whatever follows
it): that forward is the oracle (`take_oracle`). Each substitute klpipe would use is then compared with
it on the same probe, and one that disagrees is dropped for the model's own code, with one log line:

    the chunked head (head.LMHead)        dropped for head.ModelHead: the model's own head, by its forward
    the cascade attention (cascade.py)    dropped for the model's own attention implementation
    the compiled norms and MLPs           dropped for their eager forward (compiled.py; a module that fails to
                                          compile runs eager alone)

The prefix tree's probe (precompute/logprobs.check_tree) holds the tree against the same forward.
Two computations of klpipe's that agree with each other prove nothing; the model's own forward does.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from klpipe.errors import first_line
from klpipe.model import failures
from klpipe.model.verdict import OWN, Verdict

PROBE_LENGTH = 24
# The short probe every load runs (confirm): the oracle's first tokens, the whole and the split row each of both
# layouts' kinds; half the oracle's probe, as each of its tokens costs a forward's worth of a token plus, by the
# model's own head, a whole vocabulary's logits (Gemma 4 E2B's 262,144: 0.8 GFLOP a position).
CONFIRM_LENGTH = 12
# Why rows run by the model's own forward alone (ReferenceModel.own_forward), as the prefix tree's refusal says it.
NOT_CAUSAL = "its forward is not causal: a position's logits move when later tokens are added"
NO_HEAD = "no head klpipe can apply to hidden states reproduces its forward"
CAUSAL_PROBE_LENGTH = 64  # check_causal's probe: non-causal attention shows only past a few dozen tokens


@dataclass(frozen=True)
class Oracle:
    """The probe and its logprobs by the model's own untouched forward."""

    ids: np.ndarray  # (T,) int64 the probe's tokens
    logprobs: np.ndarray  # (T - 1,) float32: log p(ids[t] | ids[:t]) for t = 1 .. T - 1


@torch.inference_mode()
def own_logprobs(model, rows: list[tuple[np.ndarray, np.ndarray]], temperature: float = 1.0,
                 needed: list[np.ndarray] | None = None, block: int | None = None) -> list[np.ndarray]:
    """log p(response | prompt) of each row by `model`'s own forward, one row at a time, as float32 (float64 from an
    fp64 model): the naive oracle's computation, prompt + the whole response fed (a model whose forward is not causal
    reads the last token too), only the positions that predict a needed response token reaching its head
    (`logits_to_keep`), `block` of them per forward (each block a whole forward: never more than (block, V) logits
    at once)."""
    device = model.get_input_embeddings().weight.device
    keeps = "logits_to_keep" in inspect.signature(model.forward).parameters  # a model's own code may not take it
    results = []
    for k, (prompt, response) in enumerate(rows):
        out = np.full(len(response), np.nan, dtype=np.float64 if model.dtype == torch.float64 else np.float32)
        wanted = np.arange(len(response)) if needed is None else np.flatnonzero(needed[k])
        results.append(out)
        if not len(wanted):
            continue
        ids = torch.from_numpy(np.concatenate([prompt, response]).astype(np.int64))[None].to(device)
        step = len(wanted) if block is None else max(1, block)
        for start in range(0, len(wanted), step):
            part = wanted[start: start + step]
            keep = torch.from_numpy(len(prompt) - 1 + part).to(device)  # (R,) positions predicting those tokens
            if keeps:
                logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits[0]  # (R, V)
            else:
                logits = model(input_ids=ids, use_cache=False).logits[0, keep]
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32, fp64 from an fp64 model
            targets = torch.from_numpy(np.asarray(response[part], dtype=np.int64)).to(logits.device)
            logprobs = torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[:, None])[:, 0]
            out[part] = logprobs.cpu().numpy()
    return results


def own_rows(reference, rows: list[tuple[np.ndarray, np.ndarray]], block: int | None = None) -> list[np.ndarray]:
    """own_logprobs of `rows`: those `prefetch` ran already, taken (once) from its memo; for a model whose layers
    stream (layer_major.py), the others each a pass of one layer-major group, so that each layer is read once for them
    all rather than once per row: the same forwards, in another order."""
    memo = reference.own_memo
    found = [memo.pop(_key(row, block), None) for row in rows]
    missing = [row for row, value in zip(rows, found, strict=True) if value is None]
    if reference.streamer is None or len(missing) < 2:
        computed = own_logprobs(reference.model, missing, block=block) if missing else []
    else:
        computed = _as_group(reference, [(row, block) for row in missing])
    remaining = iter(computed)
    return [value if value is not None else next(remaining) for value in found]


def _as_group(reference, calls: list[tuple[tuple[np.ndarray, np.ndarray], int | None]]) -> list[np.ndarray]:
    """own_logprobs of each (row, block) of `calls`, each row a pass of one layer-major group of the streamed model."""
    return [values[0] for values in reference.streamer.run(
        [functools.partial(own_logprobs, reference.model, [row], block=block) for row, block in calls])]


def _key(row: tuple[np.ndarray, np.ndarray], block: int | None) -> tuple:
    return row_key(row) + (block,)


def row_key(row: tuple[np.ndarray, np.ndarray]) -> tuple:
    """A row as a key: its prompt's and its response's ids."""
    return np.asarray(row[0], dtype=np.int64).tobytes(), np.asarray(row[1], dtype=np.int64).tobytes()


def prefetch(reference, more: Sequence[tuple] = (), klpipe: tuple = ()) -> None:
    """A streamed model's load-time probes by its own forward (the oracle's row, the causality probe's, packing's),
    run as passes of one layer-major group before any of them is asked for (own_rows takes them from the memo): each
    of its layers read once for all of them, not once per probe. Run only while nothing of klpipe's is installed, as
    those probes are; where the group fails, each probe runs alone after, and fails in its own words. `more`: other
    (row, block) to run with them (packing's, which this module does not import).

    `klpipe`: (rows, needed, packed, attention implementation) of klpipe's own rows run whole that the checks will
    ask for (klpipe_rows takes them): passes of the same group, each under its own implementation (probe_group.py),
    their body's hidden states kept and the head applied when asked, so that the head the checks settle on is the
    one applied. A pass that fails keeps its error, raised when asked for."""
    if reference.streamer is None:
        return
    from klpipe.model import probe_group

    calls = [(oracle_row(reference), None), *((row, reference.head.rows) for row in causal_rows(reference)), *more]
    try:
        results = probe_group.run(reference, [_own_pass(reference, row, block) for row, block in calls]
                                  + [probe_group.hidden(reference, rows, needed, packed, implementation)
                                     for rows, needed, packed, implementation in klpipe])
    except Exception:  # noqa: BLE001 - each probe runs alone after, and says what failed
        reference.streamer.release_all()
        return
    reference.own_memo = {_key(row, block): values[0]
                          for (row, block), values in zip(calls, results[:len(calls)], strict=True)}
    reference.probe_memo = {klpipe_key(rows, needed, packed): kept
                            for (rows, needed, packed, _), kept in zip(klpipe, results[len(calls):], strict=True)}


def _own_pass(reference, row: tuple[np.ndarray, np.ndarray], block: int | None):
    """(the model's own implementation, own_logprobs of `row`): a pass of probe_group.run by the oracle's path."""
    return reference.own_attention, functools.partial(own_logprobs, reference.model, [row], block=block)


def klpipe_key(rows: list[tuple[np.ndarray, np.ndarray]], needed, packed: bool) -> tuple:
    return (tuple(_key(row, None) for row in rows),
            None if needed is None else tuple(n.tobytes() for n in needed), packed)


def klpipe_rows(reference, rows: list[tuple[np.ndarray, np.ndarray]],
                needed: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """reference.score_batch(rows, 1.0, needed), taken from what prefetch ran ahead where it did (a streamed model's
    checks: the body's hidden states, this model's head applied now), else computed."""
    kept = reference.probe_memo.get(klpipe_key(rows, needed, reference.packed))
    if kept is None or reference.own_forward is not None or reference.rows_alone:
        return reference.score_batch(rows, 1.0, needed)
    if isinstance(kept, BaseException):
        raise kept
    return kept.logprobs(reference)


def oracle_row(reference, length: int = PROBE_LENGTH) -> tuple[np.ndarray, np.ndarray]:
    """The oracle's probe: `length` ids drawn from a fixed seed, fed as a one-token prompt and a response."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, reference.vocab_size, (PROBE_LENGTH,), generator=generator).numpy()[:length]
    return ids[:1], ids[1:]


def take_oracle(reference) -> Oracle:
    """The probe's logprobs by the model as transformers loaded it: call before anything of klpipe's is installed."""
    prompt, response = oracle_row(reference)
    # The model's own code fails: nothing klpipe computes could be right.
    with failures.failing_in_one_line(reference.model):
        return Oracle(np.concatenate([prompt, response]), own_rows(reference, [(prompt, response)])[0])


def check_causal(reference, verdict: Verdict) -> Verdict:
    """Where a position's logits move when later tokens are added, the model's forward is not causal: log p(token |
    prefix) is then what the naive oracle computes, one forward over the whole row, and every shortcut that assumes
    causality (the last token never fed, right pads, a row cut after its last needed token, the prefix tree) would
    give other numbers. Such a model runs each row alone by its own forward (own_logprobs), noted.

    Seen in transformers' DSA families (DeepSeek-V3.2, GLM-MoE-DSA, A.X K2, dots3: the indexer's top-k picks among
    every key slot), DeepSeek-V4 and HY-V4, and XLM, XLNet and CPM-Ant (tests/matrix.py)."""
    whole, *shorter = own_rows(reference, causal_rows(reference), block=reference.head.rows)
    found = max(float(np.max(np.abs(values - whole[: len(values)]))) for values in shorter)
    if found <= reference.probe_tolerance:
        return verdict
    return verdict.but(own_forward=NOT_CAUSAL).noted(
        f"{type(reference.model).__name__}: its forward is not causal (a position's logprobs move by {found:.3g} when "
        "later tokens are added); each row runs alone, whole, by the model's own forward")


def causal_rows(reference) -> list[tuple[np.ndarray, np.ndarray]]:
    """check_causal's probe, whole and cut at three places."""
    from klpipe.model.architecture import text_config

    # Long enough that a sparse attention picking its top-k keys has more slots than k to pick from (DeepSeek-V3.2's
    # index_topk): below that, every slot is picked and its forward can look causal.
    length = max(CAUSAL_PROBE_LENGTH, 2 * int(getattr(text_config(reference.model.config), "index_topk", 0) or 0) + 1)
    # Within the RoPE's limit: past it a long RoPE changes its frequencies for the whole row, which the planner
    # handles (rows past the limit run only with each other); that is not the forward reading later tokens.
    length = min(length, reference.rope_length_limit or length)
    ids = torch.randint(0, reference.vocab_size, (length,), generator=torch.Generator().manual_seed(1)).numpy()
    cuts = (length - 1, length - length // 4, length // 2)
    rows = [(ids[:1], ids[1:])] + [(ids[:1], ids[1:cut]) for cut in cuts]
    return rows


def gap(reference, oracle: Oracle) -> float:
    """The largest |Δ logprob| between klpipe's rows run whole (the probe split at two places) and the oracle."""
    half = len(oracle.ids) // 2
    whole, split = klpipe_rows(reference, gap_rows(oracle.ids))
    return max(float(np.max(np.abs(whole - oracle.logprobs))),
               float(np.max(np.abs(split - oracle.logprobs[half - 1:]))))


def gap_rows(ids: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """gap's rows: the probe whole, and split at its middle."""
    half = len(ids) // 2
    return [(ids[:1], ids[1:]), (ids[:half], ids[half:])]


def check_head(reference, oracle: Oracle, verdict: Verdict) -> Verdict:
    """Keep the chunked head where it reproduces the oracle; else the model's own head (head.ModelHead), noted.

    Where even the model's own head on given hidden states does not reproduce it (or cannot run: Inkling's routers),
    each row runs alone by the model's own forward (own_forward = NO_HEAD)."""
    name = type(reference.model).__name__
    chunked = gap(reference, oracle)
    unapplied = getattr(reference.head, "unapplied", [])
    if chunked <= reference.probe_tolerance and not unapplied:
        return verdict
    reference.apply(verdict.but(head=OWN))  # tried; the caller applies what this returns
    try:
        own, why = gap(reference, oracle), None
    except Exception as exc:  # noqa: BLE001 - a forward that cannot take given hidden states (Inkling's routers)
        own, why = None, f"{type(exc).__name__}: {first_line(exc)}"
    if own is not None and own <= reference.probe_tolerance:
        why = (f"does not apply its head's {', '.join(unapplied)}" if unapplied else
               f"disagrees with the model's own logits (max |Δ logprob| = {chunked:.3g})")
        return verdict.but(head=OWN).noted(f"{name}: klpipe's chunked LM head {why}; logprobs come from the model's "
                                           "own head, in blocks")
    # Neither head reproduces the forward on given hidden states: the forward itself computes every row (the chunked
    # head kept: only its block size is used from now on).
    return verdict.but(own_forward=NO_HEAD).noted(
        f"{name}: neither klpipe's chunked LM head (max |Δ logprob| = {chunked:.3g}) nor the model's own head on given "
        f"hidden states ({why or f'max |Δ logprob| = {own:.3g}'}) reproduces its forward; each row runs alone, "
        "whole, by the model's own forward")


def padding_rows(ids: np.ndarray, rope_length_limit: int | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """check_padding's rows: the probe, and a row twice as long beside it, so that the probe gets pads."""
    longer = np.concatenate([ids, ids[::-1], ids])
    # Within the RoPE's limit: a batch whose rows pass it changes its frequencies for every row (long RoPE), and the
    # planner keeps such rows apart already (logprobs.plan_chunk); this check is about pads alone.
    longer = longer[: max(len(ids) + 1, rope_length_limit or len(longer))]
    return [(ids[:1], ids[1:]), (longer[:1], longer[1:])]


def check_padding(reference, oracle: Oracle, verdict: Verdict) -> Verdict:
    """Run rows one at a time where a row's logprobs change beside a longer row's pads, noted.

    Right pads come after every real token, so a causal model's rows cannot see them, but a model may still
    read the batch's length: DeepSeek-V3.2's sparse attention picks its top-k keys with `topk` over every key
    slot, and how it breaks ties moves with the slots' count."""
    beside = klpipe_rows(reference, padding_rows(oracle.ids, reference.rope_length_limit))[0]  # (T - 1,)
    found = float(np.max(np.abs(beside - oracle.logprobs)))
    if found <= reference.probe_tolerance:
        return verdict
    return verdict.but(rows_alone=True).noted(
        f"{type(reference.model).__name__}: a row's logprobs change beside a longer row's pads (max |Δ logprob| = "
        f"{found:.3g}); rows run whole one at a time")


def check_attention(reference, oracle: Oracle) -> str | None:
    """None if klpipe's attention, now installed, reproduces the oracle; else the line to log (the caller drops it)."""
    found = gap(reference, oracle)
    if found <= reference.probe_tolerance:
        return None
    return (f"{type(reference.model).__name__}: klpipe's cascade attention disagrees with the model's own "
            f"{reference.own_attention} attention (max |Δ logprob| = {found:.3g}); the model's own runs instead")


def check_compile(reference, oracle: Oracle, verdict: Verdict) -> Verdict:
    """Keep the compiled norms and MLPs (compiled.py) where klpipe's rows run whole reproduce the oracle with them;
    else every module eager again, noted. A class that fails to compile runs eager on its own, noted.

    The probe runs the shapes a run meets (rows packed or padded, a batch of one-token rows, a lone token: dynamo
    specialises a length of 1), so their compiles happen here, before any row, and are held to the oracle too."""
    name = type(reference.model).__name__
    ids = oracle.ids
    found = gap(reference, oracle)
    first = oracle.logprobs[:1]  # log p(ids[1] | ids[0]): a row of one token fed
    for rows in ([(ids[:1], ids[1:2])], [(ids[:1], ids[1:2])] * 2):
        found = max(found, *(float(np.max(np.abs(values - first))) for values in reference.score_batch(rows)))
    for length in (len(ids), 1):  # a batch of two rows, as the prefix tree's passes are (the batch's 1 specialised)
        found = max(found, _body_gap(reference, np.stack([ids[:length], ids[::-1][:length]])))
    compiled = reference.compiled
    verdict = verdict.noted(*(f"{name}: {line}" for line in compiled.take_failures()))
    # fp32: the oracle's own bound (compiled and eager differ by the order of a few sums, ~1e-6); bf16: the probes'.
    tolerance = 1e-4 if reference.dtype == torch.float32 else reference.probe_tolerance
    if found > tolerance:
        return verdict.but(compiled=()).noted(f"{name}: its compiled norms and MLPs disagree with its own forward "
                                              f"(max |Δ logprob| = {found:.3g}); they run eager")
    return verdict.but(compiled=tuple(compiled.classes))


def confirm(reference) -> float:
    """The check run on every load where a verdict is remembered: the largest |Δ logprob| between klpipe's rows run
    whole as installed now (the remembered verdict applied: its head, packed or not) and the model's own forward (the
    oracle, taken again: the model as transformers loaded it) on the oracle's first CONFIRM_LENGTH tokens, on each
    adapter's side too. A streamed model's forwards go in one layer-major group (probe_group.py): its layers read
    once."""
    ids = np.concatenate(oracle_row(reference, CONFIRM_LENGTH))
    row = (ids[:1], ids[1:])
    adapters = reference.adapters
    sides = [None] if adapters is None else [adapters.default, *(n for n in adapters.adapters if n != adapters.default)]
    found, oracle = 0.0, None
    for side in sides:
        with reference.side(side):
            if reference.streamer is not None and reference.own_forward is None and not reference.rows_alone:
                from klpipe.model import probe_group

                own, kept = probe_group.run(reference, [_own_pass(reference, row, None), probe_group.hidden(
                    reference, gap_rows(ids), None, reference.packed, reference.attention_name)])
                if isinstance(kept, BaseException):
                    raise kept
                got, own = kept.logprobs(reference), own[0]
            else:
                own = reference.own_logprobs([row])[0]
                got = reference.score_batch(gap_rows(ids))
            half = len(ids) // 2
            found = max(found, float(np.max(np.abs(got[0] - own))), float(np.max(np.abs(got[1] - own[half - 1:]))))
            oracle = oracle or Oracle(ids, own)
    reference.oracle = oracle
    return found


@torch.inference_mode()
def _body_gap(reference, ids: np.ndarray) -> float:
    """The largest |Δ logprob| of every next token of `ids` ((B, T), each row from position 0) between the body run
    as installed and the body run eager (the model's own), through the same head."""
    batch = torch.from_numpy(ids.astype(np.int64)).to(reference.input_device)  # (B, T)
    rows, length = ids.shape
    targets = torch.from_numpy(np.roll(ids, -1, axis=1).reshape(-1).astype(np.int64))  # (B·T,) the next token
    values = []
    for eager in (False, True):
        with reference.eager() if eager else nullcontext():
            hidden = reference.body(input_ids=batch, use_cache=False).last_hidden_state  # (B, T, H)
        values.append(reference.head.logprobs(hidden.reshape(rows * length, -1), targets, 1.0).numpy())
    return float(np.max(np.abs(values[0] - values[1])))
