"""Where a precompute run's start-up goes, before its first row: loading the weights, the load-time checks (model/
checks.py; reused where an earlier run's verdicts are remembered: verdict_key.py), and a streamed model's reads.

    start-up 6.1 s (load 4.0, checks 2.1, verdicts reused)

The line goes to the log where progress is shown, and its figures into the run's summary.
"""

from __future__ import annotations

import time


def verdict_lines(models: list) -> list[str]:
    """One line per model whose remembered verdict was reused, or not taken where the short probe disagreed."""
    lines = []
    for m in models:
        name = type(m.model).__name__
        if m.verdict_reused:
            lines.append(f"{name}: the load-time checks' verdicts of an earlier run with the same weights, versions, "
                         f"device and options reused, held to its own forward on a short probe (--recheck runs them)")
        elif m.recheck_why is not None:
            lines.append(f"{name}: the remembered verdicts were not taken: {m.recheck_why}; every load-time check "
                         "ran again")
    return lines


def record(summary, models: list, started: float | None, say: bool, log) -> None:
    """Where the start-up went, before the first row: the summary's figures, and a line where progress is shown."""
    if started is None:
        return
    summary.startup_seconds = time.perf_counter() - started
    streamers = [m.streamer for m in models if m.streamer is not None]
    summary.startup_bytes_read = sum(s.store.reads_total for s in streamers) if streamers else None
    if say:
        log(line(summary))


def line(summary) -> str:
    """`start-up 6.1 s (load 4.0, checks 2.1, verdicts reused)`, and a streamed model's bytes read before any row."""
    read = (f", {summary.startup_bytes_read / 2**20:,.0f} MiB of weights read"
            if summary.startup_bytes_read is not None else "")
    return (f"start-up {summary.startup_seconds:,.1f} s (load {summary.startup_seconds - summary.check_seconds:,.1f}, "
            f"checks {summary.check_seconds:,.1f}, verdicts {summary.verdicts}{read})")
