"""Stage 1, `klpipe precompute`: rollouts in, a cache of reference logprobs out, resumable chunk by chunk.

Rollouts are read in chunks, tokenized and checked, planned (the prefix tree, batches under a token budget), run
through the reference model, checkpointed and merged into the cache. No module here imports torch; klpipe.model is
imported when the model is loaded. docs/development.md maps the modules.
"""

# The stage's entry points, importable as `from klpipe.precompute import ...`. Loaded on first use, so that
# importing one module of the package (the CLI reads defaults from its config) stays light.
__all__ = ["OUTPUT_SUFFIX", "PrecomputeConfig", "PrecomputeSummary", "default_max_tokens", "default_output",
           "precompute"]


def __getattr__(name: str):
    if name in __all__:
        from klpipe.precompute import provenance, run

        return getattr(provenance if name == "default_max_tokens" else run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
