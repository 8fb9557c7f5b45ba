"""The page: one self-contained HTML file (template, style, script, data and charts inline; nothing fetched).

Everything a file supplies (ids, token text, model names) is data: the server-side parts go through
`html.escape`, the token data is JSON that the script reads with `JSON.parse` and writes with
`textContent`, never as markup. A Content-Security-Policy allows the page's own script and style alone
(by hash) and no connection at all, so even a slip in escaping could neither run code nor call out.

Token values travel as base64 of their own bytes (float32 logprobs stay float32: what the tooltip shows
is the file's value, digit for digit) and each token's text once per distinct (id, text) in a table:
about 14 bytes a response token.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass
from html import escape
from importlib import resources

import numpy as np

from klpipe import __version__
from klpipe.inspect import charts
from klpipe.inspect.decode import Decoder
from klpipe.inspect.gather import PickedRow
from klpipe.inspect.select import Curves, RowFigures, Selection, Source
from klpipe.score import report

# Piece kinds in the page's token table.
PLAIN, SPECIAL, PARTIAL = 0, 1, 2


@dataclass
class PageInput:
    """Everything the page shows."""

    source: Source
    figures: RowFigures
    curves: Curves
    selection: Selection
    rows: dict[int, PickedRow]  # the embedded rows by file position
    decoder: Decoder
    extreme_nats: float


class PieceTable:
    """Each distinct (id, text, kind, bytes) a token shows once, and per token its index into the table; a partial
    token's text is its piece, and bytes its bytes in hex where the tokenizer is byte-level."""

    def __init__(self) -> None:
        self.index: dict[tuple[int, str, int, str], int] = {}

    def add(self, decoder: Decoder, context: np.ndarray, ids: np.ndarray) -> np.ndarray:
        tokens = decoder.decode(context, ids)
        out = np.empty(len(ids), dtype=np.uint32)
        for k, (token_id, text, partial) in enumerate(zip(ids.tolist(), tokens.texts, tokens.partial, strict=True)):
            kind = PARTIAL if partial else SPECIAL if token_id in decoder.special else PLAIN
            key = (token_id, decoder.piece(token_id) if partial else text, kind,
                   decoder.piece_bytes(token_id) if partial else "")
            out[k] = self.index.setdefault(key, len(self.index))
        return out

    def rows(self) -> list[list]:
        return [list(key) for key in self.index]


def _b64(values: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()).decode()


def page_data(page: PageInput) -> dict:
    """The JSON the script reads: the embedded rows' figures and tokens, and the token table."""
    pieces = PieceTable()
    figures, decoder = page.figures, page.decoder
    encoded = []
    gaps = []
    ratios = []  # |trainer − sampler| of the embedded rows' sampled tokens
    layers: dict[str, list[np.ndarray]] = {"exact": [], "entropy": []}  # the exact layers' sampled tokens
    for rank, (index, extreme) in enumerate(zip(page.selection.indices.tolist(), page.selection.extreme.tolist(),
                                                strict=True)):
        row = page.rows[index]
        where = row.name
        decoder.check_covers(row.response_ids, where)
        prompt = row.prompt_ids if row.prompt_ids is not None else np.zeros(0, dtype=np.int64)
        decoder.check_covers(prompt, where)
        response = pieces.add(decoder, prompt, row.response_ids)
        prompt_pieces = pieces.add(decoder, np.zeros(0, dtype=np.int64), prompt) if row.prompt_ids is not None else None
        gap = row.policy.astype(np.float64) - row.ref.astype(np.float64)
        scored = np.isfinite(gap) if row.mask is None else row.mask & np.isfinite(gap)
        gaps.append(np.abs(gap[scored]))
        stored = [v for v in (row.policy, row.ref, row.sampler, row.exact, row.entropy) if v is not None]
        float_type = "<f8" if any(v.dtype == np.float64 for v in stored) else "<f4"
        for key in (layers if row.exact is not None else ()):
            values = getattr(row, key).astype(np.float64)
            layers[key].append(values[np.isfinite(values) if row.mask is None else row.mask & np.isfinite(values)])
        if row.sampler is not None:
            ratio = row.policy.astype(np.float64) - row.sampler.astype(np.float64)
            counted = np.isfinite(ratio) if row.mask is None else row.mask & np.isfinite(ratio)
            ratios.append(np.abs(ratio[counted]))
        entry = {
            "rank": rank + 1, "index": index, "name": where, "extreme": bool(extreme),
            "id": _json_value(figures.row_id(index)),
            "step": None if figures.steps is None else _json_value(figures.steps[index].as_py()),
            "reward": float(figures.reward[index]), "kl": float(figures.kl[index]),
            "coeff": None if figures.kl_coeff is None else float(figures.kl_coeff[index]),
            "penalty": None if figures.penalty is None else float(figures.penalty[index]),
            "adjusted": None if figures.adjusted is None else float(figures.adjusted[index]),
            "tokens": int(figures.tokens[index]), "masked": int(figures.masked[index]),
            "maxGap": float(figures.max_gap[index]),
            "float": "f8" if float_type == "<f8" else "f4",
            "response": response, "prompt": prompt_pieces, "promptTokens": len(prompt),
            "policy": _b64(row.policy, float_type), "ref": _b64(row.ref, float_type),
            "mask": None if row.mask is None else _b64(row.mask.astype(np.uint8), "u1"),
            "sampler": None if row.sampler is None else _b64(row.sampler, float_type),
            "logPplDiff": None if figures.log_ppl_diff is None or not np.isfinite(figures.log_ppl_diff[index])
            else float(figures.log_ppl_diff[index]),
            "exactKl": _number(figures.exact_kl, index), "entropyMean": _number(figures.policy_entropy, index),
            "exact": None if row.exact is None else _b64(row.exact, float_type),
            "entropy": None if row.entropy is None else _b64(row.entropy, float_type),
        }  # fmt: skip
        encoded.append(entry)
    # Two bytes a token into the token table while it has fewer than 65,536 entries (it nearly always has).
    index_type = "<u2" if len(pieces.index) < 1 << 16 else "<u4"
    for entry in encoded:
        entry["response"] = _b64(entry["response"], index_type)
        entry["prompt"] = None if entry["prompt"] is None else _b64(entry["prompt"], index_type)
    every_gap = np.concatenate(gaps) if gaps else np.zeros(0)
    # The colour scale saturates at the 99th percentile of the embedded tokens' |gap|: one 30-nat token
    # would otherwise wash every other token out to white.
    scale = max(0.5, float(np.percentile(every_gap, 99))) if every_gap.size else 1.0
    every_ratio = np.concatenate(ratios) if ratios else np.zeros(0)
    # The mismatch view's own scale: trainer − sampler gaps are orders of magnitude below policy − ref ones.
    mismatch_scale = max(1e-6, float(np.percentile(every_ratio, 99))) if every_ratio.size else 1.0
    # The exact layers' scales, each from 0 (white) to the 99th percentile of the embedded sampled tokens' values.
    exact_scales = {key: max(1e-6, float(np.percentile(np.concatenate(parts), 99))) if any(len(v) for v in parts)
                    else 1.0 for key, parts in layers.items()}
    return {"rows": encoded, "pieces": pieces.rows(), "index": index_type[1:], "scale": scale,
            "mismatch": figures.log_ppl_diff is not None, "mismatchScale": mismatch_scale,
            "exact": figures.exact is not None, "exactScale": exact_scales["exact"],
            "entropyScale": exact_scales["entropy"],
            "extremeNats": page.extreme_nats,
            "estimator": page.source.settings.get("estimator"), "aggregate": page.source.settings.get("aggregate")}


def _number(values: np.ndarray | None, index: int) -> float | None:
    """A row's figure for the JSON: None where the file has none or the row has no token to take it over."""
    return None if values is None or not np.isfinite(values[index]) else float(values[index])


def _json_value(value: object) -> object:
    return value if value is None or isinstance(value, (int, float, str, bool)) else str(value)


def _asset(name: str) -> str:
    return resources.files("klpipe.inspect").joinpath(name).read_text(encoding="utf-8")


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def _script_json(data: dict) -> str:
    # Inside <script type="application/json">, only "</script" (or "<!--") could end the element: with
    # every "<" written as \u003c, no text from the file can.
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False).replace("<", "\\u003c")


def render(page: PageInput) -> str:
    """The whole page as one string."""
    data = page_data(page)
    style, script = _asset("page.css"), _asset("page.js")
    csp = (f"default-src 'none'; style-src {_csp_hash(style)}; script-src {_csp_hash(script)}; img-src data:; "
           "connect-src 'none'; form-action 'none'; base-uri 'none'")
    name = page.source.path.name
    fields = {
        "csp": escape(csp, quote=False),  # no double quote in it; its single quotes must stay
        "title": escape(f"klpipe inspect: {name}"),
        "style": style,
        "heading": escape(name),
        "provenance": provenance_html(page),
        "summary": summary_html(page),
        "embedded": escape(embedded_note(page)),
        "charts": charts_html(page),
        "extreme": extreme_html(page),
        "mismatch": mismatch_html(page),
        "table_head": table_head(page),
        "data": _script_json(data),
        "script": script,
    }
    # One pass over the template: a value holding "{{script}}" (a token's text can) is never expanded.
    return re.sub(r"\{\{(\w+)\}\}", lambda match: fields[match.group(1)], _asset("page.html"))


# -- the server-side parts --------------------------------------------------------------------------


def _dl(items: list[tuple[str, str]]) -> str:
    return "<dl>" + "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in items) + "</dl>"


def provenance_html(page: PageInput) -> str:
    p = page.source.provenance
    settings = page.source.settings
    items: list[tuple[str, str]] = []
    if p is None:
        items.append(("reference", "unknown: the file carries no klpipe provenance"))
    else:
        items.append(("reference", f"{p.model} ({p.revision}, {p.dtype}, temperature {p.temperature:g})"))
        if p.policy_model is not None:
            items.append(("policy", (f"computed by klpipe precompute --policy {p.policy_model} "
                                     f"({p.policy_revision}, {p.policy_dtype})")))
        else:
            items.append(("policy", "the rollouts' own logprobs (a sampler's)"))
        items.append(("tokenizer fingerprint", p.tokenizer))
    items.append(("decoded with", f"{page.decoder.source} (tokenizer.json sha256 {page.decoder.fingerprint[:16]})"))
    versions = [f"precompute {p.klpipe_version}" if p is not None else None,
                f"score {settings['klpipe_version']}" if page.source.scored and "klpipe_version" in settings else None,
                f"inspect {__version__}"]
    items.append(("klpipe", ", ".join(v for v in versions if v)))
    if page.source.scored:
        controller = settings.get("controller") or {}
        items.append(("scored with", (f"{settings.get('estimator')} {settings.get('aggregate')}"
                                      f"{', clamped' if settings.get('clamp') else ''}; "
                                      f"{controller.get('controller', '?')} controller, "
                                      f"target {controller.get('kl_target', '?')}")))
    else:
        items.append(("KL", (f"not scored: computed here as klpipe score would ({settings['estimator']} "
                             f"{settings['aggregate']}{', clamped' if settings['clamp'] else ''})")))
    return _dl(items)


def summary_html(page: PageInput) -> str:
    """The figures klpipe score prints, over every row of the file."""
    f, c = page.figures, page.curves
    stats = report.kl_statistics(f.kl, 0.0, 0, len(f))
    rows = len(f)
    parts = [f"{rows:,} rows in {len(c.labels):,} controller batches",
             (f"KL mean {stats['kl/mean']:.4f} (p50 {stats['kl/p50']:.4f}, p90 {stats['kl/p90']:.4f}, "
              f"p99 {stats['kl/p99']:.4f}, max {stats['kl/max']:.4f})")]
    if c.kl_coeff is not None and len(c.kl_coeff):
        changes = int(np.count_nonzero(np.diff(c.kl_coeff)))
        parts.append(f"kl_coeff applied {c.kl_coeff[0]:.5g} → {c.kl_coeff[-1]:.5g} "
                     f"({changes} change{'' if changes == 1 else 's'} between controller batches)")
    if rows:
        reward = f"reward {np.mean(f.reward):.4f}"
        parts.append(reward + (f" → {np.mean(f.adjusted):.4f}" if f.adjusted is not None else ""))
        parts.append(f"negative k1 in {np.mean(f.negative_k1):.1%} of rows")
    parts.append(f"{int(f.tokens.sum()):,} policy tokens scored" +
                 (f", {int(f.masked.sum()):,} masked out (tool results)" if f.masked.sum() else ""))
    extreme = int(np.count_nonzero(f.max_gap > page.extreme_nats))
    if extreme:
        parts.append(f"{extreme} row(s) with a token above {page.extreme_nats:g} nats")
    exact = "" if f.exact is None else f'<p class="summary exact">{escape(report.exact_line(f.exact))}</p>'
    return "<p class=\"summary\">" + escape("; ".join(parts)) + "</p>" + exact


def embedded_note(page: PageInput) -> str:
    s = page.selection
    first = " (rows with a token above the threshold first)" if s.extreme.any() else ""
    return (f"This page embeds {len(s.indices)} of the {len(page.figures):,} rows in the file: {s.how}{first}. "
            "The curves and the summary are over every row.")


def charts_html(page: PageInput) -> str:
    c, f = page.curves, page.figures
    x = np.array(c.labels if c.numeric else range(len(c.labels)), dtype=np.float64)
    controller = page.source.settings.get("controller") or {}
    target = controller.get("kl_target") if page.source.scored else None
    band = (0.5 * target, target, 1.5 * target) if target else None
    out = [charts.line_chart("Mean KL per controller batch", x, [("mean KL", c.kl_mean, "kl")], c.x_label,
                             "KL (nats)", band=band)]
    if c.kl_coeff is not None:
        out.append(charts.line_chart("Coefficient applied", x, [("kl_coeff", c.kl_coeff, "coeff")], c.x_label,
                                     "kl_coeff", steps=True))
    rewards = [("reward", c.reward_mean, "reward")]
    if c.adjusted_mean is not None:
        rewards.append(("adjusted reward", c.adjusted_mean, "adjusted"))
    out.append(charts.line_chart("Mean reward per controller batch", x, rewards, c.x_label, "reward"))
    hist = report.histogram(f.kl)
    out.append(charts.histogram_chart("Per-row KL, every row", hist["counts"], hist["edges"], "per-row KL (nats)"))
    return "".join(f"<figure>{svg}</figure>" for svg in out)


def extreme_html(page: PageInput) -> str:
    s = page.selection
    count = int(s.extreme.sum())
    if not count:
        return ""
    computed = page.source.provenance is not None and page.source.provenance.policy_model is not None
    why = ("The policy logprobs were computed by klpipe precompute --policy on the reference's own tokens, so the "
           "two models really disagree that much there: look at what the token is." if computed else
           "A gap that size is almost never drift. Usual causes: the policy and the reference tokenized the text "
           "differently, so the logprobs belong to different tokens (look for a token boundary that moved, a "
           "special token written as text, a BOS added twice); a placeholder logprob the sampler wrote for a "
           "token it did not sample (TRL's 0.0 on tool results) with no mask to say so; or sampling logprobs "
           "taken at another temperature, or after top-k/top-p, than the reference's.")
    return (f'<aside class="extreme-note" role="note"><strong>{count} embedded row(s) have a token with '
            f"|policy − ref| above {page.extreme_nats:g} nats</strong>, the rows klpipe score warns about; they come "
            f"first below. {escape(why)}</aside>")


def table_head(page: PageInput) -> str:
    columns = [("rank", "#", "num"), ("id", "id", "text"), ("step", "step", "num"), ("reward", "reward", "num"),
               ("kl", "KL", "num"), ("penalty", "penalty", "num"), ("tokens", "tokens", "num"),
               ("masked", "masked", "num"), ("maxGap", "largest gap", "num")]
    if page.figures.penalty is None:
        columns = [col for col in columns if col[0] != "penalty"]
    if page.figures.exact_kl is not None:  # beside the row's KL: its mean exact KL over the same tokens
        columns.insert(5, ("exactKl", "exact KL", "num"))
    if page.figures.log_ppl_diff is not None:
        columns.append(("logPplDiff", "log_ppl_diff", "num"))
    return "".join(f'<th scope="col" data-key="{key}" data-type="{kind}" aria-sort="none">'
                   f'<button type="button">{escape(label)}</button></th>' for key, label, kind in columns)


def mismatch_html(page: PageInput) -> str:
    """The sampler-against-trainer section: the headline, the correction sweep as a chart, the findings, and the
    embedded rows by |log_ppl_diff| (their tokens, coloured by ℓ_t, sit under each row's policy − ref view)."""
    section, log_ppl_diff = page.figures.mismatch, page.figures.log_ppl_diff
    if section is None or log_ppl_diff is None:  # both come with a sampler column
        return ""
    lines = report.mismatch_lines(section)
    table = section["corrections"]
    chart = charts.bar_chart(
        "What each correction would do: rows truncated, masked or rejected",
        [f"{e['scheme']} {e['threshold']}" + (f" ({e['default_of']})" if e["default_of"] else "") for e in table],
        [e["rows_affected_fraction"] or 0.0 for e in table], "fraction of rows")
    rows = [page.rows[i] for i in page.selection.indices.tolist()]
    ranked = sorted(range(len(rows)), key=lambda k: -abs(_finite(log_ppl_diff[rows[k].index])))
    worst = "".join(
        f'<li><a href="#row-{k + 1}">{escape(rows[k].name)}</a>: log_ppl_diff '
        f"{_finite(log_ppl_diff[rows[k].index]):+.4g}</li>" for k in ranked[:10])
    return ('<section class="mismatch" aria-labelledby="mismatch-heading"><h2 id="mismatch-heading">Sampler against '
            "trainer</h2>" + "".join(f"<p>{escape(line)}</p>" for line in lines)
            + f'<figure class="sweep">{chart}</figure>'
            + f"<p>Embedded rows, worst |log_ppl_diff| first (each row's tokens below carry a second line coloured by "
              f"ℓ = trainer − sampler):</p><ol class=\"worst\">{worst}</ol></section>")


def _finite(value: float) -> float:
    return float(value) if np.isfinite(value) else 0.0
