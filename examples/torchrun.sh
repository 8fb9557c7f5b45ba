#!/bin/bash
# klpipe precompute on one multi-GPU node: one process per GPU, each on its own shard.
#
#   NPROC=8 KLPIPE_MODEL=./ref ROLLOUTS=day42/ CACHE_DIR=day42.cached examples/torchrun.sh
#
# torchrun starts NPROC copies of klpipe with RANK, WORLD_SIZE and LOCAL_RANK set. klpipe takes
# shard RANK of WORLD_SIZE and, with --device auto (the default), GPU cuda:LOCAL_RANK. The ranks
# never talk to each other (klpipe starts no process group), so one slow or failed rank does not
# stall the others' work: rerunning this command finishes what is missing and skips finished parts.
# The result is CACHE_DIR/part-<rank>-of-<NPROC>.parquet plus .done markers; score it with
# `klpipe score CACHE_DIR` as usual.
#
# Also works on CPU (NPROC processes on one machine), which is how the tests run it.
set -euo pipefail

KLPIPE_MODEL=${KLPIPE_MODEL:-google/gemma-4-E2B}
ROLLOUTS=${ROLLOUTS:-rollouts}
CACHE_DIR=${CACHE_DIR:-cached}
# Several processes share one terminal: log lines rather than interleaved progress bars.
export KLPIPE_PROGRESS=${KLPIPE_PROGRESS:-log}

# --standalone: a single node, no rendezvous server to set up.
# --no-python: `klpipe` is the console script itself, not a Python file.
exec torchrun --standalone --nproc_per_node="${NPROC:-8}" --no-python \
    klpipe precompute --model "$KLPIPE_MODEL" "$ROLLOUTS" --output "$CACHE_DIR"
