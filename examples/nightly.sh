#!/bin/bash
# Nightly: precompute one day's rollouts, then score them, continuing the KL controller from the
# previous nights' state file. Run from cron under `flock -n` (see examples/crontab).
#
# Settings from the environment:
#   DATA_DIR       root of the data layout below                     default: /data/rl
#   DAY            which day to process                              default: yesterday
#   KLPIPE_MODEL   reference model                                   default: google/gemma-4-E2B
#   ROLLOUTS       the day's rollouts (a file or a directory)         default: $DATA_DIR/rollouts/$DAY
#   STATE          controller state, shared by every night            default: $DATA_DIR/kl_state.json
#
# Safe to rerun for the same day: a killed precompute resumes from its finished chunks, and a day
# whose scoring finished is not scored again (that would move the controller twice).
set -euo pipefail

DATA_DIR=${DATA_DIR:-/data/rl}
DAY=${DAY:-$(date -d yesterday +%F)}
KLPIPE_MODEL=${KLPIPE_MODEL:-google/gemma-4-E2B}
ROLLOUTS=${ROLLOUTS:-$DATA_DIR/rollouts/$DAY}
STATE=${STATE:-$DATA_DIR/kl_state.json}
CACHE=$DATA_DIR/cached/$DAY.parquet
SCORED=$DATA_DIR/scored/$DAY
# A log file, not a terminal: periodic progress lines instead of a bar.
export KLPIPE_PROGRESS=${KLPIPE_PROGRESS:-log}

echo "nightly $DAY: started $(date -Is)"
if [ -e "$SCORED/done" ]; then
    echo "nightly $DAY: already scored; nothing to do"
    exit 0
fi

mkdir -p "$(dirname "$CACHE")" "$SCORED"
# Says "nothing to do" if the cache is already complete, resumes if a previous night was killed.
klpipe precompute --model "$KLPIPE_MODEL" "$ROLLOUTS" --output "$CACHE"
# The state file is written last and atomically: a failed or killed score leaves yesterday's.
klpipe score "$CACHE" --output "$SCORED/scored.parquet" --report "$SCORED/report.json" --state "$STATE"
# Marked only now, so a night that failed anywhere before scores the day again. (A kill in the
# instant between the state write and this line would score it twice; klpipe warns when a state
# file already holds the inputs it is given.)
touch "$SCORED/done"
echo "nightly $DAY: finished $(date -Is)"
