"""Stage 2, `klpipe score`: cached logprobs through the KL controller into penalised rewards. No torch.

Caches are read and checked record batch by record batch, each row's KL estimated, the controller stepped once per
controller batch, and the scored rows, the report, the metrics and the state written, each whole or not at all.
docs/development.md maps the modules.
"""

from typing import Any

# The stage's entry points, importable as `from klpipe.score import ...`. Loaded on first use, so that
# importing one module of the package (the CLI reads defaults from its config) stays light.
__all__ = ["ADJUSTED_REWARD", "KL", "KL_COEFF", "KL_PENALTY", "KL_PER_TOKEN", "OUTPUT_SUFFIX",
           "SCORED_COLUMNS", "SCORE_METADATA_KEY", "ScoreConfig", "ScoreResult", "default_output", "score"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from klpipe.score import run, scored_file

        return getattr(scored_file if hasattr(scored_file, name) else run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
