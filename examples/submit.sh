#!/bin/bash
# Queue both stages: the precompute array, then one score job that starts when every shard is done.
#
#   KLPIPE_MODEL=./ref ROLLOUTS=day42/ CACHE_DIR=day42.cached SCORE_DIR=day42.scored examples/submit.sh
#
# Both jobs see this environment (sbatch exports it), so the settings above reach both scripts.
# ARRAY sets the array's task ids, and so the shard count, in place of its --array line; arguments
# are sbatch options for both jobs, which override the scripts' #SBATCH lines:
#
#   ARRAY=0-15 examples/submit.sh --partition=a100 --account=rl
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

# Slurm writes logs/...out relative to the submit directory but does not create logs/ itself.
mkdir -p logs

# --parsable prints "jobid" or "jobid;cluster": keep the id.
jid=$(sbatch --parsable ${ARRAY:+--array="$ARRAY"} "$@" "$here/precompute-array.sbatch")
jid=${jid%%;*}
echo "precompute array: job $jid"

# afterok:<array id> = after every task of the array exited 0. If a task fails for good, the
# dependency can never be met: --kill-on-invalid-dep cancels the score job instead of leaving it
# pending forever.
sbatch --dependency="afterok:$jid" --kill-on-invalid-dep=yes "$@" "$here/score-after.sbatch"
