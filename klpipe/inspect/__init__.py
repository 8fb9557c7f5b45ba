"""`klpipe inspect`: where a run's KL comes from, row by row and token by token, as one HTML page. No torch.

select.py   the first pass: every row's figures (KL, penalty, largest token gap), the per-step curves, the rows picked
decode.py   the tokenizer (the `tokenizers` library, not transformers) and each token's text, faithfully
gather.py   the second pass: the picked rows' token ids and logprobs
charts.py   the curves and the KL histogram as inline SVG
page.py     the self-contained page: data, charts and the template (page.html, page.css, page.js) in one file
run.py      the command: both passes, the page written atomically
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
