"""`klpipe score`: options in, ScoreConfig out, one call to klpipe.score.score, a summary on stderr."""

from __future__ import annotations

import sys

from klpipe.cli.app import app, handle_errors
from klpipe.cli.fields import build, options
from klpipe.score.config import ScoreConfig
from klpipe.score.controller import ControllerConfig

# Every option can come from KLPIPE_SCORE_<OPTION>; precompute reads KLPIPE_<OPTION>, and the
# separate prefix keeps one command's environment from leaking into the other.
ENV_PREFIX = "KLPIPE_SCORE_"

# Under Slurm or cron stderr is a log file, where rich would wrap at 80 columns and split the
# table's rows and the summary line across lines: a log gets room and long lines stay whole.
LOG_WIDTH = 160


def _stderr_console(console_class):
    """A rich console on stderr: a terminal's own width, or LOG_WIDTH and no wrapping in a log."""
    import os
    import sys

    if sys.stderr.isatty() or "COLUMNS" in os.environ:
        return console_class(stderr=True)
    return console_class(stderr=True, width=LOG_WIDTH, soft_wrap=True)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@app.command("score")
@handle_errors
@options(ScoreConfig, ControllerConfig, env_prefix=ENV_PREFIX)
def score_command(given: dict) -> None:
    """Replay cached policy and reference logprobs through the adaptive KL controller.

    Writes every input column plus `kl`, `kl_coeff`, `kl_penalty` and
    `adjusted_reward = reward − kl_penalty`. Consecutive rows with the same `step` form one
    controller batch: all are penalised with the coefficient in force before the batch, then the
    controller updates once. Without a `step` column each row is its own batch.

    The table and warnings go to stderr, as do progress and a wait for the `--state` file that
    another run holds; stdout stays empty. Every option can also be set with
    `KLPIPE_SCORE_<OPTION>`, e.g. `KLPIPE_SCORE_KL_TARGET=2`.

    Examples:

        klpipe score cached.parquet --output scored.parquet --report report.json --state kl_state.json

        klpipe score caches/ --controller proportional --horizon 20000 --plot report.png

        klpipe score day.parquet --state kl_state.json --tensorboard runs/kl

        klpipe score day2.parquet --state kl_state.json --reset-state --kl-target 2

        klpipe score dump.parquet --column policy_logprobs=old_log_probs --column reward=score --kl-coeff 0

        klpipe score groups.cached.parquet --output groups.scored.jsonl --atropos-api http://localhost:8000

        klpipe score s3://caches/day42/ -o s3://scored/day42.parquet --state s3://scored/kl_state.json

        klpipe score day43.parquet --state kl_state.json --wait-for-state 3600 --progress log
    """
    from rich.console import Console

    # Imported here so `klpipe --help` and `klpipe precompute` do not load the scoring stack.
    from klpipe.score import report as report_module
    from klpipe.score import score

    config = build(ScoreConfig, given, controller=build(ControllerConfig, given))
    result = score(config, log=_stderr)
    console = _stderr_console(Console)
    report_module.render_table(result.report, console)
    for warning in result.warnings:
        console.print(f"Warning: {warning}", markup=False, highlight=False, style="yellow")
    console.print(f"Wrote {result.output}", markup=False, highlight=False)
    if result.posted is not None:
        console.print(f"Posted {result.posted.sent} group(s) to {result.posted.url} ({result.posted.groups} of the "
                      f"file's groups taken in all; marker {result.posted.marker})", markup=False, highlight=False)
