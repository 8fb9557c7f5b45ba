"""Stage 1, `klpipe precompute`: rollouts in, a cache of reference logprobs out, resumable chunk by chunk.

rollouts.py   read rollouts in fixed-size chunks (parquet, JSON Lines, save_to_disk)
chat.py       TRL conversational rows rendered with the chat template
tokenize.py   a chunk into flat token ids, every row checked against the model
batching.py   token-budget batches (pure index arithmetic)
prefix_tree.py the chunk's prefix tree and the passes that run it (pure)
logprobs.py   a chunk's rows through the reference model (klpipe.model): tree or per row; the probe
sharing.py    the sharing mode a model runs with: the tree probed the first time a chunk would use it
workdir.py    the work directory: run.json, the lock, chunk checkpoints, the merge
provenance.py what the cache records of its run, and the checks made before any weight loads
run.py        the stage: chunks → logprobs → checkpoints → the cache, with resume

No module here imports torch; klpipe.model is imported when the model is loaded.
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
