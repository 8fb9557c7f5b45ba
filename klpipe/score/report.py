"""What a scoring run tells people: the report JSON, the terminal table and the plot.

`klpipe score` gathers a run's totals and per-step entries as it streams; everything here turns
them into the report, and never reads a row itself.

Keys under `kl/` are the original controller's logging keys and keep its 4-decimal rounding, so existing dashboards
read them unchanged; every other number is written at full precision. Nothing here imports
matplotlib until a plot is asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from klpipe.errors import OutputError
from klpipe.score.controller import KLController, KLStats

if TYPE_CHECKING:
    from rich.console import Console

    from klpipe.storage.store import Location

PERCENTILES = (50, 90, 99)
HISTOGRAM_BINS = 50

# The terminal table shows this many steps from each end of a long run; report.json has them all.
TABLE_EDGE_ROWS = 20


@dataclass
class Trajectory:
    """The controller's path, one entry per controller batch, for the plot."""

    x: np.ndarray  # (batches,) step label when numeric, else the batch's position
    kl_mean: np.ndarray  # (batches,) mean per-row KL of the batch
    kl_coeff: np.ndarray  # (batches,) coefficient applied to the batch's rows
    x_label: str  # axis title: "step", or "row" when each row is its own batch


@dataclass
class RunTotals:
    """Running totals over a whole scoring run: what the summary and the histogram are made of."""

    rows: int = 0
    tokens: int = 0  # response tokens scored: the policy's own (mask 1) where the caches have a mask
    masked_tokens: int = 0  # response tokens the mask left out: tools' results, and pads kept after a response
    rows_without_tokens: int = 0  # rows with no token to score (an empty response, or masked whole): KL 0
    row_kls: list[np.ndarray] = field(default_factory=list)  # (rows,) per batch: percentiles, histogram
    reward_sums: list[float] = field(default_factory=list)
    adjusted_sums: list[float] = field(default_factory=list)
    negative_k1: int = 0
    extreme_count: int = 0
    extreme_rows: list[str] = field(default_factory=list)  # the first few, named

    def all_kls(self) -> np.ndarray:
        return np.concatenate(self.row_kls) if self.row_kls else np.zeros(0)


def step_entry(label: object, kls: np.ndarray, rewards: np.ndarray, kl_coeff: float, negative_k1: int, tokens: int,
               controller: KLController) -> dict[str, Any]:
    """A step's entry in `steps`: its rows were penalised with `kl_coeff`; `controller` has seen them since.

    Holds every value of the step's metrics record (klpipe.score.metrics): `kl_mean` is `kl/mean`
    unrounded, since the original controller's 4 decimals would flatten a small KL to 0 on a dashboard.
    """
    penalty = kl_coeff * kls  # the same arithmetic as the output columns
    adjusted = rewards - penalty
    entry: dict[str, Any] = {"step": label, "rows": len(kls), "tokens": tokens}
    entry.update(kl_statistics(kls, controller.kl_coeff, controller.adaptation_count, controller.samples_processed))
    entry.update(
        {
            "kl_mean": float(np.mean(kls)),
            "kl_coeff_before": kl_coeff,
            "kl_coeff_after": controller.kl_coeff,
            "negative_k1_fraction": negative_k1 / len(kls),
            "kl_penalty_mean": float(np.mean(penalty)),
            "reward_mean_before": float(np.mean(rewards)),
            "reward_mean_after": float(np.mean(adjusted)),
        }
    )
    return entry


@dataclass(frozen=True)
class RunFacts:
    """What a report says of the run itself, beside its figures."""

    inputs: Sequence[Location]
    output: Location
    settings: dict[str, Any]  # the report's `config`
    extreme_nats: float  # the threshold of an extreme row
    warnings: list[str]
    seconds: float  # the run's own time


def build_report(run: RunFacts, controller: KLController, kl_coeff_before: float, batch_count: int,
                 steps: list[dict[str, Any]], totals: RunTotals) -> dict[str, Any]:
    """The report JSON: the run's settings, summary, per-step entries, histogram and warnings."""
    kls = totals.all_kls()
    rows = totals.rows
    summary: dict[str, Any] = {"rows": rows, "batches": batch_count, "tokens": totals.tokens,
                               "masked_tokens": totals.masked_tokens, "rows_without_tokens": totals.rows_without_tokens}
    summary.update(kl_statistics(kls, controller.kl_coeff, controller.adaptation_count, controller.samples_processed))
    summary.update(
        {
            "kl_coeff_before": kl_coeff_before,
            "kl_coeff_after": controller.kl_coeff,
            "negative_k1_fraction": totals.negative_k1 / rows if rows else 0.0,
            "reward_mean_before": math.fsum(totals.reward_sums) / rows if rows else 0.0,
            "reward_mean_after": math.fsum(totals.adjusted_sums) / rows if rows else 0.0,
        }
    )
    return {
        "inputs": [str(p) for p in run.inputs],
        "output": str(run.output),
        "config": run.settings,
        "summary": summary,
        "steps": steps,
        "histogram": histogram(kls),
        "extreme_rows": {"threshold_nats": run.extreme_nats, "count": totals.extreme_count,
                         "named": totals.extreme_rows},
        "warnings": list(run.warnings),
        "seconds": round(run.seconds, 3),
    }


def trajectory(has_steps: bool, steps: list[dict[str, Any]], totals: RunTotals,
               row_coeffs: list[np.ndarray]) -> Trajectory:
    """The plot's x axis and series: one point per step, or per row when each row is its own batch."""
    if has_steps:
        labels = [s["step"] for s in steps]
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in labels)
        return Trajectory(
            x=np.array(labels if numeric else range(len(labels)), dtype=np.float64),
            kl_mean=np.array([s["kl_mean"] for s in steps]),
            kl_coeff=np.array([s["kl_coeff_before"] for s in steps]),
            x_label="step" if numeric else "step (in order)",
        )
    kls = totals.all_kls()
    return Trajectory(
        x=np.arange(len(kls), dtype=np.float64),
        kl_mean=kls,
        kl_coeff=np.concatenate(row_coeffs) if row_coeffs else np.zeros(0),
        x_label="row",
    )


def kl_statistics(kls: np.ndarray, kl_coeff: float, adaptation_count: int, samples_processed: int) -> dict[str, Any]:
    """The original controller's `kl/` keys over `kls`, plus `kl/p50`, `kl/p90` and `kl/p99` in the same rounding."""
    if kls.size == 0:
        stats = KLStats(
            current_coeff=kl_coeff, adaptation_count=adaptation_count, samples_processed=samples_processed
        ).to_dict()
        stats.update({f"kl/p{q}": 0.0 for q in PERCENTILES})
        return stats
    stats = KLStats(
        mean_kl=float(np.mean(kls)),
        max_kl=float(np.max(kls)),
        min_kl=float(np.min(kls)),
        std_kl=float(np.std(kls)),  # population std, as the original controller
        current_coeff=kl_coeff,
        adaptation_count=adaptation_count,
        samples_processed=samples_processed,
    ).to_dict()
    for q, value in zip(PERCENTILES, np.percentile(kls, PERCENTILES), strict=True):
        stats[f"kl/p{q}"] = round(float(value), 4)
    return stats


def histogram(kls: np.ndarray) -> dict[str, Any]:
    counts, edges = np.histogram(kls, bins=HISTOGRAM_BINS) if kls.size else (np.zeros(0), np.zeros(0))
    return {"edges": edges.tolist(), "counts": [int(c) for c in counts]}


def extreme_rows_warning(row_names: list[str], count: int, threshold_nats: float, policy_computed: bool = False) -> str:
    """The warning for rows with a token whose |policy − ref| exceeds `threshold_nats`."""
    named = "; ".join(row_names)  # each name holds a file path, which may hold a comma
    more = f" and {count - len(row_names)} more" if count > len(row_names) else ""
    # Logprobs klpipe computed for both models come from one tokenization: then it is the models that disagree.
    why = ("The policy logprobs were computed by klpipe precompute --policy on the reference's tokens, so the "
           "two models disagree that much there." if policy_computed else
           "This almost always means the policy and the reference tokenized the text differently.")
    return f"{count} row(s) have a token with |policy − ref| above {threshold_nats:g} nats: {named}{more}. {why}"


def render_table(report: dict[str, Any], console: Console) -> None:
    """The per-step trajectory and the run summary as a rich table on `console` (stderr in the CLI)."""
    from rich import box  # rich is only needed when a person is watching
    from rich.table import Table

    summary = report["summary"]
    steps = report["steps"]
    if steps:
        # "coeff" is the coefficient applied to the step's rows and "→ coeff" the one after its update;
        # "→ reward" is the mean adjusted reward.
        table = Table(title="KL controller per step", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        for name in ("step", "rows", "KL mean", "p90", "max", "coeff", "→ coeff", "reward", "→ reward"):
            table.add_column(name, justify="right", no_wrap=True)
        shown = steps
        if len(steps) > 2 * TABLE_EDGE_ROWS:
            shown = steps[:TABLE_EDGE_ROWS] + [None] + steps[-TABLE_EDGE_ROWS:]
        for step in shown:
            if step is None:
                hidden = len(steps) - 2 * TABLE_EDGE_ROWS
                table.add_row("…", f"{hidden} more", *[""] * 7)
                continue
            table.add_row(
                str(step["step"]),
                str(step["rows"]),
                f"{step['kl/mean']:.3f}",
                f"{step['kl/p90']:.3f}",
                f"{step['kl/max']:.3f}",
                f"{step['kl_coeff_before']:.4g}",
                f"{step['kl_coeff_after']:.4g}",
                f"{step['reward_mean_before']:.3f}",
                f"{step['reward_mean_after']:.3f}",
            )
        console.print(table)
    console.print(
        f"{summary['rows']} rows in {summary['batches']} controller batches: "
        f"KL mean {summary['kl/mean']:.4f} (p50 {summary['kl/p50']:.4f}, p90 {summary['kl/p90']:.4f}, "
        f"p99 {summary['kl/p99']:.4f}, max {summary['kl/max']:.4f}); "
        f"kl_coeff {summary['kl_coeff_before']:.5g} → {summary['kl_coeff_after']:.5g} "
        f"({summary['kl/adaptation_count']} adaptations in all); "
        f"reward {summary['reward_mean_before']:.4f} → {summary['reward_mean_after']:.4f}; "
        f"negative k1 in {summary['negative_k1_fraction']:.1%} of rows"
        + (f"; {summary['tokens']:,} policy tokens scored, {summary['masked_tokens']:,} masked out "
           "(mask 0: tool results, pads)"
           + (f", {summary['rows_without_tokens']:,} rows with none (KL 0)" if summary['rows_without_tokens'] else "")
           if summary.get("masked_tokens") else ""),
        markup=False,
        highlight=False,
    )
    source = report.get("policy_logprobs") or {}
    mismatch = report.get("mismatch")
    if source.get("computed"):
        kept = f"; the sampler's kept in {mismatch['sampler_logprobs']}" if mismatch else ""
        console.print(f"policy logprobs computed by klpipe precompute --policy {source['model']} "
                      f"({source['revision']}, {source['dtype']}), not by a sampler{kept}", markup=False,
                      highlight=False)
    if mismatch:
        for line in mismatch_lines(mismatch):
            console.print(line, markup=False, highlight=False)
    if report.get("exact"):
        console.print(exact_line(report["exact"]), markup=False, highlight=False)


def exact_line(exact: dict[str, Any]) -> str:
    """The exact KL beside the sampled estimators', and both entropies, for the whole run, in one line."""
    run = exact["run"]

    def number(key: str) -> str:
        value = run.get(key)
        return "n/a" if value is None else f"{value:.4g}"

    return (f"exact KL per sampled token ({run['tokens']:,} tokens): KL(π‖π_ref) {number('exact_kl')} against k1 "
            f"{number('k1_kl')} (spread {number('k1_spread')}) and k3 {number('k3_kl')} (spread "
            f"{number('k3_spread')}); KL(π_ref‖π) {number('exact_kl_ref_policy')}; entropy π "
            f"{number('policy_entropy')}, π_ref {number('ref_entropy')}")


def mismatch_lines(mismatch: dict[str, Any]) -> list[str]:
    """The mismatch section in a few lines for the terminal: the headline figures, then one line per finding."""
    run = mismatch["run"]

    def number(key: str) -> str:
        value = run.get(key)
        return "n/a" if value is None else f"{value:.4g}"

    lines = [
        (f"sampler against trainer ({mismatch['sampler_logprobs']} vs {mismatch['trainer_logprobs']}, "
         f"{run['mismatch/tokens']:,} sampled tokens): rollout_corr/kl {number('rollout_corr/kl')}, "
         f"k3_kl {number('rollout_corr/k3_kl')}, |ℓ| p99 {number('mismatch/abs_log_ratio_p99')}, "
         f"ESS token IS {number('mismatch/ess_token_is')}; KL from the {mismatch['kl_from']}'s logprobs "
         f"(trainer's {number('mismatch/kl_trainer')}, sampler's {number('mismatch/kl_sampler')}, importance-corrected "
         f"{number('mismatch/kl_importance_corrected')} per token)"),
    ]
    codes = mismatch["mismatch/diagnosis"]
    lines.append(f"mismatch diagnosis: {', '.join(codes) if codes else 'none'}")
    lines += [f"  {f['code']}: {f['evidence']}" + (f" (rows {', '.join(f['rows'])})" if f["rows"] else "")
              for f in mismatch["findings"]]
    return lines


def plot(path: Path, trajectory: Trajectory, report: dict[str, Any]) -> None:
    """Three panels into the PNG `path`: batch KL against the target band, the coefficient, a histogram of row KL.

    The caller makes it appear atomically (score/run.py writes it to a temporary file of its OutputGroup).
    """
    try:
        import matplotlib
    except ImportError:
        raise OutputError(f"{path}: --plot needs matplotlib: pip install 'klpipe[plot]'") from None
    matplotlib.use("Agg")  # files only; never open a window from a cron job
    import matplotlib.pyplot as plt

    target = report["config"]["controller"]["kl_target"]
    fig, (kl_ax, coeff_ax, hist_ax) = plt.subplots(3, 1, figsize=(9, 10), constrained_layout=True)

    kl_ax.axhspan(0.5 * target, 1.5 * target, color="tab:green", alpha=0.15, label="target band (0.5–1.5×)")
    kl_ax.axhline(target, color="tab:green", linewidth=1, label=f"target {target:g}")
    marker = "." if len(trajectory.x) <= 200 else None  # points help on short runs, clutter long ones
    kl_ax.plot(trajectory.x, trajectory.kl_mean, color="tab:blue", linewidth=1, marker=marker, label="mean KL")
    kl_ax.set(xlabel=trajectory.x_label, ylabel="KL (nats)", title="KL per controller batch")
    kl_ax.legend(loc="best", fontsize="small")

    coeff_ax.plot(
        trajectory.x, trajectory.kl_coeff, drawstyle="steps-post", color="tab:orange", linewidth=1, marker=marker
    )
    coeff_ax.set(xlabel=trajectory.x_label, ylabel="kl_coeff", title="Coefficient applied")

    edges, counts = report["histogram"]["edges"], report["histogram"]["counts"]
    if counts:
        hist_ax.stairs(counts, edges, fill=True, color="tab:purple", alpha=0.7)
    hist_ax.set(xlabel="per-row KL (nats)", ylabel="rows", title="Per-row KL")

    try:
        fig.savefig(path, format="png", dpi=110)
    finally:
        plt.close(fig)
