# klpipe: `make demo` runs both stages on sample_data/, `make test` runs the suite.
# Both create .venv on first use. The CPU torch pin goes in first: a bare `torch`
# requirement would pull a multi-GB CUDA build. On a GPU machine, install your own
# torch build into the venv before `make install`; it is kept.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
# The transformers the tests and tests/matrix.json were recorded on. klpipe takes >=5.24,<6; a newer release adds
# registry families the matrix has not run (test_matrix names them), so the test environment stays on this one.
TRANSFORMERS_PIN ?= transformers==5.24.0
DEMO := build/demo

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install cli-docs demo lint test docs test-slow test-arch test-matrix test-bf16 test-fp64 test-compile bench-gpu-dry-run test-trl test-faults test-slurm test-s3 test-browser test-ray test-ray-hosts test-atropos bench sample-data clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_PIN)
	$(BIN)/python -m pip install -q '$(TRANSFORMERS_PIN)' -e ".[precompute,inspect,test]"
	touch $@

# The sample policy drifts ~2.4 nats per row, inside the default target band (1.5-4.5 for
# target 3); a target of 1 shows the controller adapting.
demo: install
	rm -rf $(DEMO)
	$(BIN)/klpipe precompute --model sample_data/tiny-gemma4 sample_data/rollouts.parquet \
		--output $(DEMO)/cached.parquet
	$(BIN)/klpipe score $(DEMO)/cached.parquet --output $(DEMO)/scored.parquet \
		--report $(DEMO)/report.json --state $(DEMO)/kl_state.json --plot $(DEMO)/report.png \
		--kl-target 1.0
	# Tool-calling trajectories as TRL stores them: ids with a tool_mask, and the same as messages with tools.
	$(BIN)/klpipe precompute --model sample_data/tiny-gemma4 sample_data/tool_calls.parquet \
		--column response_ids=completion_ids --output $(DEMO)/tool_calls.cached.parquet
	$(BIN)/klpipe score $(DEMO)/tool_calls.cached.parquet --output $(DEMO)/tool_calls.scored.parquet \
		--report $(DEMO)/tool_calls.report.json
	# Where the tool rows' KL comes from, token by token: one page that opens from file:.
	$(BIN)/klpipe inspect $(DEMO)/tool_calls.scored.parquet --output $(DEMO)/kl.html
	# The policy that sampled the rollouts beside the reference: the exact KL over the vocabulary, scored with it.
	$(BIN)/klpipe precompute --model sample_data/tiny-gemma4 --policy sample_data/tiny-gemma4-policy \
		sample_data/rollouts.parquet --full-kl --output $(DEMO)/full_kl.cached.parquet
	$(BIN)/klpipe score $(DEMO)/full_kl.cached.parquet --estimator full --output $(DEMO)/full_kl.scored.parquet \
		--report $(DEMO)/full_kl.report.json
	$(BIN)/klpipe precompute --model sample_data/tiny-gemma4 sample_data/tool_calls_conversational.parquet \
		--chat-template sample_data/tool_chat_template.jinja --output $(DEMO)/tool_calls_conversational.cached.parquet
	@echo "demo outputs in $(DEMO)/"

# ruff over the whole checkout and mypy over klpipe/ (pyproject.toml says which rules, and where mypy is strict). The
# lint extra goes into the venv when either is missing.
lint: install
	$(BIN)/python -c "import mypy, ruff" 2>/dev/null || $(BIN)/python -m pip install -q -e ".[lint]"
	$(BIN)/ruff check
	$(BIN)/mypy klpipe

test: install
	$(BIN)/python -m pytest -q --durations=10

# The documentation site (mkdocs.yml, docs/) into build/site. --strict with mkdocs.yml's validation: a broken
# link or anchor, or a page left out of the nav, fails the build. The docs extra (mkdocs, mkdocs-material) goes
# into the venv.
docs: install
	$(BIN)/python -m pip install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d build/site

# docs/cli.md, written from the commands' options (klpipe/cli/reference.py); tests/test_docs.py fails when it is stale.
cli-docs: install
	$(BIN)/python -m klpipe.cli.reference > docs/cli.md

# The slower half of the architecture matrix (tests/model/test_architectures.py): nine more families, every mode
# against an fp64 oracle. About three minutes on 2 CPU cores.
# The slowest end-to-end tests (-m slow): kill -9 and resume, peak memory, a fresh install, the sharing modes,
# the sbatch examples against single-process runs.
test-slow: install
	$(BIN)/python -m pytest -q -m slow

test-arch: install
	$(BIN)/python -m pytest -q -m arch tests/model/test_architectures.py tests/model/test_families.py tests/model/test_joint_head.py
	$(BIN)/python -m pytest -q -m arch -k "not registry" tests/model/test_streaming.py

# Every decoder-only family in transformers' causal LM registry (tests/matrix.py), tiny, under off, auto and on
# against an fp64 forward, and as tests/matrix.json records it. One thread: models this small spend two threads'
# time waiting on each other (ten times slower on a busy machine).
test-matrix: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m arch --durations=5 tests/model/test_matrix.py
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m arch -k registry tests/model/test_streaming.py  # each family streamed

# The GPU's numerics on CPU: every family of the registry matrix with an fp64 oracle, in bf16 (weights and
# activations; the head accumulates in fp32), tree on and off, against an fp64 forward of the same weights, within
# a tolerance derived from bf16's rounding (tests/model/test_bf16.py). make test runs two families of it; this the whole
# matrix, in about 4 minutes, and the tree on each of the cascade's CPU kernels (tests/model/test_cascade.py).
test-bf16: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m bf16 --durations=5 tests/model/test_bf16.py tests/model/test_cascade.py tests/model/test_streaming.py

# fp64 all the way through (--dtype float64, klpipe/model/wide.py): every family of tests/architectures.py and of the
# registry matrix, off, auto and on, within 1e-9 of an fp64 forward of the same weights, where rounding is ~1e-14: a
# wrong formula is told from rounding on every family; and LoRA adapters' sides (LoRA, DoRA, a trained head) within
# 1e-9 of PEFT's own merge done in fp64. make test runs six families of it; this the rest, in about
# 6.5 minutes on 2 shared CPU cores (2.7 minutes of CPU).
test-fp64: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m fp64 --durations=5 tests/model/test_fp64.py

# precompute --compile on for real (tests/model/test_compiled.py): inductor compiles the layers' norms and MLPs through
# gcc, on tiny Llama, Qwen3 and Gemma 4, fp32 and bf16, tree on and off, against the oracle; a compile that fails
# (no C++ compiler) falls back with one line; a LoRA adapter policy, compiled (tests/model/test_lora.py). About 5 minutes
# on 2 CPU cores, most of it compiling. Inductor's CPU kernels need g++ and the interpreter's headers: Debian's
# installed first when missing (needs root, as in CI).
test-compile: install
	@command -v g++ >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++; }
	@$(BIN)/python -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" || \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-dev; }
	$(BIN)/python -m pytest -q -m compile --durations=5 tests/model/test_compiled.py tests/model/test_lora.py

# benchmarks/bench_gpu.py's whole script on CPU, a tiny model and short rows (about a minute and a half): a typo
# never costs a GPU's minutes. benchmarks/gpu_run.sh runs it for real on a lent GPU.
bench-gpu-dry-run: install
	$(BIN)/python benchmarks/bench_gpu.py --dry-run

# Conversational tool rows against TRL 1.16's own GRPOTrainer tool loop, on every tool-calling chat template it
# ships and its training variant (-m trl; make test runs five of them). About a minute on 2 CPU cores.
# verl's own ToolAgentLoop, hermes parser and Continuous Token builder (tests/verl_agent.py) as the truth for
# --rollout-format verl: the wheel alone (--no-deps: ray, vllm, sglang stay out; tests/verl_agent.py loads the loop
# without them) in a folder of its own, as the wheel ships a top-level `tests` package that would shadow ours.
VERL_PIN ?= verl==0.9.1
# What verl's DataProto module imports, for tests/precompute/test_trainer_batches.py to save a batch with verl's own save_to_disk
# (test-only: klpipe reads those files with a restricted unpickler of its own and imports none of them).
VERL_PROTOCOL_DEPS ?= tensordict omegaconf 'ray>=2.40,<3'
test-trl: install
	test -f $(VENV)/verl/verl/experimental/agent_loop/tool_agent_loop.py || \
		$(BIN)/python -m pip install -q --no-deps --target $(VENV)/verl '$(VERL_PIN)'
	$(BIN)/python -c "import tensordict, omegaconf, ray" 2>/dev/null || \
		$(BIN)/python -m pip install -q $(VERL_PROTOCOL_DEPS)
	$(BIN)/python -m pytest -q -m trl tests/precompute/test_trl_tool_loop.py tests/precompute/test_verl_tool_loop.py tests/precompute/test_trainer_batches.py

test-faults: install
	$(BIN)/python -m pytest -q -m faults

# Both stages with inputs and outputs on S3: a moto S3 server (installed by the test extra) that the
# tests start on 127.0.0.1 and stop again. About two minutes on 2 CPU cores.
test-s3: install
	$(BIN)/python -m pytest -q --durations=5 tests/s3

# The examples under a real one-node Slurm cluster that tests/slurm starts on 127.0.0.1 and stops
# again. Installs Debian's slurm-wlm and munge first when they are missing (needs root, as in CI).
test-slurm: install
	@PATH="$$PATH:/usr/sbin:/sbin"; \
	command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v sbatch >/dev/null || { \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge; }
	$(BIN)/python -m pytest -q --durations=0 tests/slurm

# klpipe inspect's pages in a real headless Chromium: Debian's, installed first when missing (needs root, as
# in CI), driven by Playwright from PyPI, which is pointed at it and never downloads a browser of its own.
PLAYWRIGHT_PIN ?= playwright==1.65.*

test-browser: install
	@command -v chromium >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }
	$(BIN)/python -c "import playwright" 2>/dev/null || $(BIN)/python -m pip install -q '$(PLAYWRIGHT_PIN)'
	PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 $(BIN)/python -m pytest -q -rP --durations=5 tests/browser

# `precompute --ray` on a real one-node Ray cluster (Ray keeps a second node off a loopback-only cluster) that
# tests/ray starts on 127.0.0.1 and stops again by pid. Ray is the `ray` extra, never a base dependency:
# installed here for these tests only.
test-ray: install
	$(BIN)/python -c "import ray" 2>/dev/null || $(BIN)/python -m pip install -q -e ".[ray]"
	$(BIN)/python -m pytest -q --durations=0 tests/ray

# Atropos groups against atroposlib's own code (tests/atropos_server): its ManagedServer builds them, its writer saves them,
# its ScoredData checks what klpipe writes back, and its API server (`run-api`, started on 127.0.0.1 and stopped by pid)
# hands klpipe's scored groups to a trainer. atroposlib is test-only, never a klpipe dependency: its wheel without its
# dependencies (wandb, gymnasium, polars, nltk, math-verify: its environments', not these modules'), plus what the
# modules used here import.
ATROPOS_PIN ?= atroposlib==0.4.0
ATROPOS_DEPS ?= fastapi uvicorn jsonlines openai tenacity
test-atropos: install
	$(BIN)/python -c "import atroposlib.api.server, atroposlib.envs.server_handling.managed_server, jsonlines" 2>/dev/null || { \
		$(BIN)/python -m pip install -q $(ATROPOS_DEPS) && $(BIN)/python -m pip install -q --no-deps '$(ATROPOS_PIN)'; }
	$(BIN)/python -m pytest -q --durations=5 tests/atropos_server
# `precompute --ray` on a Ray cluster of three hosts: network namespaces on a private bridge that tests/ray_hosts
# makes (root, as in CI; iproute2's `ip` and util-linux's `unshare` and `nsenter`), a head and two one-CPU worker
# nodes, the S3 server on the bridge; stopped by pid and removed at the end. About two minutes on 2 CPU cores.
test-ray-hosts: install
	@PATH="$$PATH:/usr/sbin:/sbin"; command -v ip >/dev/null || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2; }
	$(BIN)/python -c "import ray" 2>/dev/null || $(BIN)/python -m pip install -q -e ".[ray]"
	PATH="$$PATH:/usr/sbin:/sbin" $(BIN)/python -m pytest -q -rP --durations=0 tests/ray_hosts

# TRL is a contender in bench_grpo.py and bench_agent.py, never a klpipe dependency (the test extra has it too).
TRL_PIN ?= trl==1.16.*

bench: install
	$(BIN)/python -c "import trl" 2>/dev/null || $(BIN)/python -m pip install -q '$(TRL_PIN)'
	$(BIN)/python benchmarks/bench_precompute.py
	$(BIN)/python benchmarks/bench_head.py
	$(BIN)/python benchmarks/bench_grpo.py
	$(BIN)/python benchmarks/bench_agent.py
	$(BIN)/python benchmarks/bench_pairs.py
	$(BIN)/python benchmarks/bench_tool_mask.py
	$(BIN)/python benchmarks/bench_policy.py
	$(BIN)/python benchmarks/bench_lora.py
	$(BIN)/python benchmarks/bench_full_kl.py
	$(BIN)/python benchmarks/bench_score.py
	$(BIN)/python benchmarks/bench_memory.py
	$(BIN)/python benchmarks/bench_stream.py
	$(BIN)/python benchmarks/bench_startup.py

# Rebuild the tiny models and rollouts under sample_data/ (deterministic).
sample-data: install
	$(BIN)/python sample_data/generate.py

clean:
	rm -rf build .pytest_cache
