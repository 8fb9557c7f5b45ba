#!/usr/bin/env bash
# benchmarks/bench_gpu.py on a lent GPU machine, in one command (docs/gpu.md, "One run on a lent GPU").
#
# The machine has torch and an older transformers than klpipe's range (>=5.24), and no package index: carry the
# wheel in .whl/ (gitignored), made beside the checkout first with
#
#     .venv/bin/python -m pip download --no-deps -d .whl "transformers==$(.venv/bin/python -c 'import transformers; print(transformers.__version__)')"
#
# then run this script there from the repository's root (the device tool: command `bash benchmarks/gpu_run.sh`,
# carry [".whl"], timeout_s 540). It installs the wheel into /tmp/site ahead of the machine's own packages, runs
# klpipe from the checkout, and keeps the log in $OUT when that is set. GRPO and agent rows of ~400k tokens each,
# auto, off and padded: about 6 minutes on one H200 with the model's build (estimated; not yet run).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/transformers-*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
log="${OUT:-build}/bench_gpu.log"
mkdir -p "$(dirname "$log")"
timeout 510 python3 benchmarks/bench_gpu.py "$@" 2>&1 | tee "$log"
