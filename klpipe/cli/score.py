"""`klpipe score`: options in, ScoreConfig out, one call to klpipe.score.score, a summary on stderr."""

from __future__ import annotations

from typing import Annotated

import typer

from klpipe.cli.app import COLUMN_HELP, app, defaults, handle_errors
from klpipe.score.config import KlFrom, ScoreConfig
from klpipe.score.controller import ControllerConfig, ControllerKind
from klpipe.score.kl import Aggregate, Estimator

# Every option can come from KLPIPE_SCORE_<OPTION>; precompute reads KLPIPE_<OPTION>, and the
# separate prefix keeps one command's environment from leaking into the other.
ENV_PREFIX = "KLPIPE_SCORE_"

INPUT_PANEL = "Input columns"
OUTPUT_PANEL = "Outputs"
KL_PANEL = "Per-row KL"
CONTROLLER_PANEL = "Controller"
STATE_PANEL = "State across runs"

# The library's defaults, written once (ScoreConfig, ControllerConfig): the options below read them.
SCORE = defaults(ScoreConfig)
CONTROL = defaults(ControllerConfig)

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


def _env(option: str) -> str:
    return ENV_PREFIX + option.upper().replace("-", "_")


@app.command("score")
@handle_errors
def score_command(
    caches: Annotated[list[str], typer.Argument(
        help="Cache parquet files, or directories of them, scored in the order given; local paths or URIs "
             "(`s3://bucket/parts/`, `s3://bucket/day-*.parquet`).", envvar=_env("caches"))],
    output: Annotated[str | None, typer.Option(
        "--output", "-o", help="Scored parquet. Default: <first cache's stem>.scored.parquet beside it.",
        metavar="PATH", envvar=_env("output"), rich_help_panel=OUTPUT_PANEL)] = SCORE["output"],
    report: Annotated[str | None, typer.Option(
        help="Write the report JSON here.", metavar="PATH", envvar=_env("report"),
        rich_help_panel=OUTPUT_PANEL)] = SCORE["report"],
    plot: Annotated[str | None, typer.Option(
        help="Draw KL, coefficient and KL histogram panels into this PNG (needs matplotlib).",
        metavar="PATH", envvar=_env("plot"), rich_help_panel=OUTPUT_PANEL)] = SCORE["plot"],
    tensorboard: Annotated[str | None, typer.Option(
        metavar="DIR", help="Write per-step KL, coefficient and reward scalars as TensorBoard events into DIR "
        "(needs tensorboardX).", envvar=_env("tensorboard"), rich_help_panel=OUTPUT_PANEL)] = SCORE["tensorboard"],
    metrics_jsonl: Annotated[str | None, typer.Option(
        metavar="FILE", help="Write the same per-step metrics as JSON Lines.",
        envvar=_env("metrics_jsonl"), rich_help_panel=OUTPUT_PANEL)] = SCORE["metrics_jsonl"],
    output_format: Annotated[str, typer.Option(
        "--output-format", metavar="parquet|atropos",
        help="atropos: a cache of Atropos groups written back as those groups (JSON Lines), scores penalised, "
             "ref_logprobs filled; an --output ending in .jsonl asks for it too.",
        envvar=_env("output_format"), rich_help_panel=OUTPUT_PANEL)] = SCORE["output_format"],
    atropos_api: Annotated[str | None, typer.Option(
        "--atropos-api", metavar="URL",
        help="Post the written Atropos groups to this Atropos API server (/scored_data_list), in order; a rerun "
             "posts only what the server has not taken.",
        envvar=_env("atropos_api"), rich_help_panel=OUTPUT_PANEL)] = SCORE["atropos_api"],
    per_token: Annotated[bool, typer.Option(
        "--per-token", help="Also write each row's per-token KL list (kl_per_token).",
        envvar=_env("per_token"), rich_help_panel=OUTPUT_PANEL)] = SCORE["per_token"],
    state: Annotated[str | None, typer.Option(
        help="Controller state JSON: continued from when it exists, saved at the end.",
        metavar="PATH", envvar=_env("state"), rich_help_panel=STATE_PANEL)] = SCORE["state"],
    reset_state: Annotated[bool, typer.Option(
        "--reset-state", help="Ignore an existing --state file and start the controller from these options.",
        envvar=_env("reset_state"), rich_help_panel=STATE_PANEL)] = SCORE["reset_state"],
    estimator: Annotated[Estimator, typer.Option(
        help="Per-token KL: k1 = policy−ref, abs = |k1|, k2 = ½k1², k3 = exp(−k1)+k1−1.",
        envvar=_env("estimator"), rich_help_panel=KL_PANEL)] = SCORE["estimator"],
    aggregate: Annotated[Aggregate, typer.Option(
        help="Per-row aggregate over response tokens.",
        envvar=_env("aggregate"), rich_help_panel=KL_PANEL)] = SCORE["aggregate"],
    clamp: Annotated[bool, typer.Option(
        "--clamp/--no-clamp", help="Clamp the per-row k1 at 0 like the seed (other estimators are never negative).",
        envvar=_env("clamp"), rich_help_panel=KL_PANEL)] = SCORE["clamp"],
    kl_from: Annotated[KlFrom | None, typer.Option(
        help="Whose logprobs the KL reads when the cache holds the trainer's (policy_logprobs) and the sampler's "
             "(sampler_logprobs). Default: the trainer's where present.", envvar=_env("kl_from"),
        rich_help_panel=KL_PANEL, show_default=False)] = SCORE["kl_from"],
    controller: Annotated[ControllerKind, typer.Option(
        help="window: the seed's windowed rule; proportional: Ziegler et al. (TRL, verl); fixed.",
        envvar=_env("controller"), rich_help_panel=CONTROLLER_PANEL)] = CONTROL["controller"],
    adaptive: Annotated[bool, typer.Option(
        "--adaptive/--no-adaptive", help="The seed's switch: --no-adaptive keeps the coefficient fixed.",
        envvar=_env("adaptive"), rich_help_panel=CONTROLLER_PANEL)] = CONTROL["adaptive"],
    kl_coeff: Annotated[float, typer.Option(
        help="Starting coefficient (a loaded --state replaces it). 0: KL is measured, not penalised.",
        envvar=_env("kl_coeff"), rich_help_panel=CONTROLLER_PANEL)] = CONTROL["kl_coeff"],
    kl_target: Annotated[float, typer.Option(
        help="Target per-row KL in nats.", envvar=_env("kl_target"),
        rich_help_panel=CONTROLLER_PANEL)] = CONTROL["kl_target"],
    kl_coeff_min: Annotated[float, typer.Option(
        help="Lower clamp; 0: none.", envvar=_env("kl_coeff_min"),
        rich_help_panel=CONTROLLER_PANEL)] = CONTROL["kl_coeff_min"],
    kl_coeff_max: Annotated[float, typer.Option(
        help="Upper clamp.", envvar=_env("kl_coeff_max"), rich_help_panel=CONTROLLER_PANEL)] = CONTROL["kl_coeff_max"],
    window: Annotated[int, typer.Option(
        help="window rule: recent per-row KLs averaged before each update.",
        envvar=_env("window"), rich_help_panel=CONTROLLER_PANEL)] = CONTROL["window"],
    increase_factor: Annotated[float, typer.Option(
        help="window rule: multiplier when the mean is above 1.5×target.",
        envvar=_env("increase_factor"), rich_help_panel=CONTROLLER_PANEL)] = CONTROL["increase_factor"],
    decrease_factor: Annotated[float, typer.Option(
        help="window rule: multiplier when the mean is below 0.5×target.",
        envvar=_env("decrease_factor"), rich_help_panel=CONTROLLER_PANEL)] = CONTROL["decrease_factor"],
    horizon: Annotated[int, typer.Option(
        help="proportional rule: coeff ×= 1 + clip(mean/target−1, ±0.2)·rows/horizon.",
        envvar=_env("horizon"), rich_help_panel=CONTROLLER_PANEL)] = CONTROL["horizon"],
    column: Annotated[list[str] | None, typer.Option(
        "--column", metavar="ROLE=NAME", help=COLUMN_HELP + " Default: the mapping the caches were made with.",
        envvar=_env("column"), rich_help_panel=INPUT_PANEL, show_default=False)] = None,
) -> None:
    """Replay cached policy and reference logprobs through the adaptive KL controller.

    Writes every input column plus `kl`, `kl_coeff`, `kl_penalty` and
    `adjusted_reward = reward − kl_penalty`. Consecutive rows with the same `step` form one
    controller batch: all are penalised with the coefficient in force before the batch, then the
    controller updates once. Without a `step` column each row is its own batch.

    The table and warnings go to stderr; stdout stays empty. Every option can also be set with
    `KLPIPE_SCORE_<OPTION>`, e.g. `KLPIPE_SCORE_KL_TARGET=2`.

    Examples:

        klpipe score cached.parquet --output scored.parquet --report report.json --state kl_state.json

        klpipe score caches/ --controller proportional --horizon 20000 --plot report.png

        klpipe score day.parquet --state kl_state.json --tensorboard runs/kl

        klpipe score day2.parquet --state kl_state.json --reset-state --kl-target 2

        klpipe score dump.parquet --column policy_logprobs=old_log_probs --column reward=score --kl-coeff 0

        klpipe score groups.cached.parquet --output groups.scored.jsonl --atropos-api http://localhost:8000

        klpipe score s3://caches/day42/ -o s3://scored/day42.parquet --state s3://scored/kl_state.json
    """
    from rich.console import Console

    # Imported here so `klpipe --help` and `klpipe precompute` do not load the scoring stack.
    from klpipe.columns import parse_columns
    from klpipe.score import report as report_module
    from klpipe.score import score

    config = ScoreConfig(
        inputs=caches, output=output, report=report, state=state, plot=plot, tensorboard=tensorboard,
        metrics_jsonl=metrics_jsonl, per_token=per_token, output_format=output_format, atropos_api=atropos_api,
        reset_state=reset_state, estimator=estimator, aggregate=aggregate, clamp=clamp,
        controller=ControllerConfig(
            kl_coeff=kl_coeff, kl_target=kl_target, adaptive=adaptive, kl_coeff_min=kl_coeff_min,
            kl_coeff_max=kl_coeff_max, window=window, increase_factor=increase_factor,
            decrease_factor=decrease_factor, controller=controller, horizon=horizon,
        ),
        columns=parse_columns(column), kl_from=kl_from,
    )
    result = score(config)
    console = _stderr_console(Console)
    report_module.render_table(result.report, console)
    for warning in result.warnings:
        console.print(f"Warning: {warning}", markup=False, highlight=False, style="yellow")
    console.print(f"Wrote {result.output}", markup=False, highlight=False)
    if result.posted is not None:
        console.print(f"Posted {result.posted.sent} group(s) to {result.posted.url} ({result.posted.groups} of the "
                      f"file's groups taken in all; marker {result.posted.marker})", markup=False, highlight=False)
