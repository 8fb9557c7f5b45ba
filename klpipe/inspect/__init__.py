"""`klpipe inspect`: where a run's KL comes from, row by row and token by token, as one HTML page. No torch.

Two passes over the file: every row's figures to pick the rows, then the picked rows' tokens, decoded with the
`tokenizers` library (not transformers); the page holds its data, charts and script in one file.
docs/development.md maps the modules.
"""

__all__ = ["InspectConfig", "InspectResult", "inspect"]


def __getattr__(name: str):
    if name == "InspectConfig":
        from klpipe.inspect.config import InspectConfig

        return InspectConfig
    if name in __all__:
        from klpipe.inspect import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
