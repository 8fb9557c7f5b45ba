"""What one scoring run is asked to do: inputs, outputs, the KL estimate and the controller.

The command line reads its defaults and choices from here (and from ControllerConfig), so they are
written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from klpipe.errors import InputError
from klpipe.score.controller import ControllerConfig
from klpipe.score.kl import AGGREGATES, ESTIMATORS, Aggregate, Estimator

KlFrom = Literal["trainer", "sampler"]
KL_FROM: tuple[str, ...] = ("trainer", "sampler")

if TYPE_CHECKING:
    from klpipe.files.store import Location


OUTPUT_FORMATS = ("parquet", "atropos")


@dataclass
class ScoreConfig:
    """One scoring run: inputs, outputs, the KL estimate and the controller."""

    # Every path below may be local or a URI on a store (s3://bucket/key); URIs become StorePaths.
    inputs: list[Location]  # cache files or directories of them, scored in the order given
    output: Location | None = None  # None: <first input's stem>.scored.parquet beside the first input
    report: Location | None = None  # report JSON, written atomically
    state: Location | None = None  # controller state JSON: loaded when it exists, saved at the end
    plot: Location | None = None  # three-panel PNG (needs matplotlib)
    tensorboard: Location | None = None  # directory: one event file per run, a scalar per metric per step (needs tensorboardX)
    metrics_jsonl: Location | None = None  # the same per-step metrics as JSON Lines, written atomically
    per_token: bool = False  # also write each row's per-token KL list
    reset_state: bool = False  # ignore an existing state file and start from this config
    estimator: Estimator = "k1"  # per-token estimator: k1 | abs | k2 | k3
    aggregate: Aggregate = "mean"  # per-row aggregate over response tokens: mean | sum
    clamp: bool = True  # clamp the per-row k1 at 0, as the seed does (other estimators are never negative)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    columns: dict[str, str] = field(default_factory=dict)  # role -> column (--column); overrides the caches' own
    # Whose logprobs the KL penalty reads when a cache holds both the trainer's (policy_logprobs) and the
    # sampler's (sampler_logprobs): None is the trainer's, what a KL-in-reward trainer computes (verl's old_log_prob).
    kl_from: KlFrom | None = None
    extreme_nats: float = 20.0  # warn about rows with a token whose |policy − ref| exceeds this
    batch_tokens: int = 1 << 21  # tokens per record batch read and scored; each costs ~24 bytes in flight
    batch_bytes: int = 16 << 20  # and at most this many input bytes (uncompressed) per record batch: wide columns
    row_group_bytes: int = 32 << 20  # output row groups of about this size: big ones write faster and read better
    # parquet: the scored rows. atropos: a cache made from Atropos groups written back as those groups, scores
    # penalised (klpipe/atropos/writer.py); an --output ending in .jsonl asks for it too.
    output_format: str = "parquet"
    atropos_api: str | None = None  # post the written groups to this Atropos API server (klpipe/atropos/api.py)

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
        if self.batch_tokens < 1:
            raise InputError(f"batch_tokens must be at least 1, got {self.batch_tokens}")
        if self.output_format not in OUTPUT_FORMATS:
            raise InputError(f"--output-format must be {' or '.join(OUTPUT_FORMATS)}, not {self.output_format!r}")
        if self.batch_bytes < 1:
            raise InputError(f"batch_bytes must be at least 1, got {self.batch_bytes}")
        from klpipe.columns import ColumnMap  # pyarrow: not needed to read defaults
        from klpipe.files.store import location

        ColumnMap(self.columns)  # refuses an unknown role, or two roles on one column
        self.inputs = [location(path) for path in self.inputs]
        for name in ("output", "report", "state", "plot", "tensorboard", "metrics_jsonl"):
            if getattr(self, name) is not None:
                setattr(self, name, location(getattr(self, name)))
        if self.atropos_api is not None and not self.writes_groups:
            raise InputError("--atropos-api posts Atropos groups: add --output-format atropos (or an --output "
                             "ending in .jsonl)")
