"""What one scoring run is asked to do: inputs, outputs, the KL estimate and the controller.

Each field is an option of `klpipe score` (ControllerConfig's too), its default, help and panel written once
(klpipe/options.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from klpipe.errors import InputError
from klpipe.options import COLUMN_HELP, option, parse_columns
from klpipe.progress import check_progress, log_interval_field, progress_field
from klpipe.score.controller import ControllerConfig
from klpipe.score.kl import AGGREGATES, ESTIMATORS, Aggregate, Estimator

KlFrom = Literal["trainer", "sampler"]
KL_FROM: tuple[str, ...] = ("trainer", "sampler")

if TYPE_CHECKING:
    from klpipe.storage.store import Location


OUTPUT_FORMATS = ("parquet", "atropos")

INPUT_PANEL = "Input columns"
OUTPUT_PANEL = "Outputs"
KL_PANEL = "Per-row KL"
STATE_PANEL = "State across runs"


@dataclass
class ScoreConfig:
    """One scoring run: inputs, outputs, the KL estimate and the controller."""

    # Every path below may be local or a URI on a store (s3://bucket/key); URIs become StorePaths.
    inputs: list[Location] = option(
        argument=True, name="caches", help="Cache parquet files, or directories of them, scored in the order "
        "given; local paths or URIs (`s3://bucket/parts/`, `s3://bucket/day-*.parquet`).")
    output: Location | None = option(
        None, flags=("--output", "-o"), metavar="PATH", panel=OUTPUT_PANEL,
        help="Scored parquet. Default: <first cache's stem>.scored.parquet beside it.")
    report: Location | None = option(None, metavar="PATH", panel=OUTPUT_PANEL,
                                     help="Write the report JSON here.")  # written atomically
    state: Location | None = option(None, metavar="PATH", panel=STATE_PANEL,
                                    help="Controller state JSON: continued from when it exists, saved at the end.")
    plot: Location | None = option(
        None, metavar="PATH", panel=OUTPUT_PANEL,
        help="Draw KL, coefficient and KL histogram panels into this PNG (needs matplotlib).")
    # One event file per run, a scalar per metric per step.
    tensorboard: Location | None = option(
        None, metavar="DIR", panel=OUTPUT_PANEL,
        help="Write per-step KL, coefficient and reward scalars as TensorBoard events into DIR (needs tensorboardX).")
    metrics_jsonl: Location | None = option(None, metavar="FILE", panel=OUTPUT_PANEL,
                                            help="Write the same per-step metrics as JSON Lines.")
    per_token: bool = option(False, panel=OUTPUT_PANEL, help="Also write each row's per-token KL list (kl_per_token).")
    progress: str = progress_field(OUTPUT_PANEL)
    log_interval: float = log_interval_field(OUTPUT_PANEL)
    reset_state: bool = option(False, panel=STATE_PANEL, help="Ignore an existing --state file and start the "
                               "controller from these options.")
    # The state is held from its read to its write (score/state.py): a second run on it waits this long.
    wait_for_state: float = option(
        300.0, metavar="SECONDS", panel=STATE_PANEL,
        help="How long to wait for another klpipe run that holds the --state file, then continue from the state "
             "it saved; past it, exit 75 (rerun later) having written nothing. 0: do not wait.")
    estimator: Estimator = option(
        "k1", panel=KL_PANEL,
        help="Per-token KL: k1 = policy−ref, abs = |k1|, k2 = ½k1², k3 = exp(−k1)+k1−1; full = the exact KL over the "
             "vocabulary, from a cache `klpipe precompute --policy` wrote it into (kl_policy_ref).")
    aggregate: Aggregate = option("mean", panel=KL_PANEL, help="Per-row aggregate over response tokens.")
    clamp: bool = option(True, flags=("--clamp/--no-clamp",), panel=KL_PANEL,
                         help="Clamp the per-row k1 at 0, so that a row whose policy sits below the reference is "
                              "not rewarded for it (other estimators are never negative).")
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    # Overrides the caches' own mapping.
    columns: dict[str, str] = option(
        default_factory=dict, flags=("--column",), metavar="ROLE=NAME", panel=INPUT_PANEL, show_default=False,
        help=COLUMN_HELP + " Default: the mapping the caches were made with.", parse=parse_columns,
        cli_type=list[str] | None)
    # Whose logprobs the KL penalty reads when a cache holds both the trainer's (policy_logprobs) and the
    # sampler's (sampler_logprobs): None is the trainer's, what a KL-in-reward trainer computes (verl's old_log_prob).
    kl_from: KlFrom | None = option(
        None, panel=KL_PANEL, show_default=False,
        help="Whose logprobs the KL reads when the cache holds the trainer's (policy_logprobs) and the sampler's "
             "(sampler_logprobs). Default: the trainer's where present.")
    extreme_nats: float = 20.0  # warn about rows with a token whose |policy − ref| exceeds this
    batch_tokens: int = 1 << 21  # tokens per record batch read and scored; each costs ~24 bytes in flight
    batch_bytes: int = 16 << 20  # and at most this many input bytes (uncompressed) per record batch: wide columns
    row_group_bytes: int = 32 << 20  # output row groups of about this size: big ones write faster and read better
    # A cache made from Atropos groups written back as those groups, scores penalised (klpipe/atropos/writer.py).
    output_format: str = option(
        "parquet", flags=("--output-format",), metavar="parquet|atropos", panel=OUTPUT_PANEL,
        help="atropos: a cache of Atropos groups written back as those groups (JSON Lines), scores penalised, "
             "ref_logprobs filled; an --output ending in .jsonl asks for it too.")
    atropos_api: str | None = option(
        None, flags=("--atropos-api",), metavar="URL", panel=OUTPUT_PANEL,
        help="Post the written Atropos groups to this Atropos API server (/scored_data_list), in order; a rerun "
             "posts only what the server has not taken.")  # klpipe/atropos/post.py

    @property
    def writes_groups(self) -> bool:
        """Whether the output is Atropos groups (JSON Lines) rather than parquet."""
        name = self.output.name if self.output is not None else ""
        return self.output_format == "atropos" or name.endswith(".jsonl")

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise InputError(f"unknown estimator {self.estimator!r}; choose one of {', '.join(ESTIMATORS)}")
        if self.aggregate not in AGGREGATES:
            raise InputError(f"unknown aggregate {self.aggregate!r}; choose one of {', '.join(AGGREGATES)}")
        if self.kl_from is not None and self.kl_from not in KL_FROM:
            raise InputError(f"unknown --kl-from {self.kl_from!r}; choose one of {', '.join(KL_FROM)}")
        if self.estimator == "full" and self.kl_from == "sampler":
            # The exact KL is of the distribution precompute --policy computed: the trainer's, never the sampler's.
            raise InputError("--estimator full reads the exact KL of the policy model klpipe precompute --policy ran, "
                             "not the sampler's: drop --kl-from sampler, or choose a sampled estimator")
        if self.batch_tokens < 1:
            raise InputError(f"batch_tokens must be at least 1, got {self.batch_tokens}")
        if self.output_format not in OUTPUT_FORMATS:
            raise InputError(f"--output-format must be {' or '.join(OUTPUT_FORMATS)}, not {self.output_format!r}")
        if self.batch_bytes < 1:
            raise InputError(f"batch_bytes must be at least 1, got {self.batch_bytes}")
        if not self.wait_for_state >= 0:  # NaN too
            raise InputError(f"--wait-for-state must be 0 or more seconds, not {self.wait_for_state}")
        check_progress(self.progress)
        from klpipe.columns import ColumnMap  # pyarrow: not needed to read defaults
        from klpipe.storage.store import location

        ColumnMap(self.columns)  # refuses an unknown role, or two roles on one column
        self.inputs = [location(path) for path in self.inputs]
        for name in ("output", "report", "state", "plot", "tensorboard", "metrics_jsonl"):
            if getattr(self, name) is not None:
                setattr(self, name, location(getattr(self, name)))
        if self.atropos_api is not None and not self.writes_groups:
            raise InputError("--atropos-api posts Atropos groups: add --output-format atropos (or an --output "
                             "ending in .jsonl)")
