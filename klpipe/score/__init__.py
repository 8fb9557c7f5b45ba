"""Stage 2, `klpipe score`: cached logprobs through the KL controller into penalised rewards. No torch.

input.py       open caches, read them in record batches, check every row
kl.py          per-token KL estimators and per-row aggregates (numpy)
exact.py       the exact KL's columns read and checked; beside k1 and k3, per step and for the run
controller.py  the KL controllers: window (the original controller's rule), proportional, fixed
steps.py       controller batches: the coefficient each row gets, one update per step
report.py      the report JSON, the per-step table, warnings, the plot
metrics.py     per-step metrics as TensorBoard events (tensorboardX, imported only then) and JSON Lines
run.py         the stage: stream caches through the controller, write outputs and state
"""

from typing import Any

# The stage's entry points, importable as `from klpipe.score import ...`. Loaded on first use, so that
# importing one module of the package (the CLI reads defaults from its config) stays light.
__all__ = ["ADJUSTED_REWARD", "KL", "KL_COEFF", "KL_PENALTY", "KL_PER_TOKEN", "OUTPUT_SUFFIX",
           "SCORED_COLUMNS", "SCORE_METADATA_KEY", "ScoreConfig", "ScoreResult", "default_output", "score"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from klpipe.score import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
