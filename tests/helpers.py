"""Everything the tests share: paths, the two oracles (reference logprobs and the seed controller),
input files written with pyarrow, and running klpipe as a fresh process.

No torch at import time: the scoring tests must run where torch is not installed, so the
reference oracle imports it when called.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import math
import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from klpipe.arrow import offsets_from_lengths
from klpipe.cache import (
    FULL_KL_COLUMNS,
    ID,
    MASK,
    METADATA_KEY,
    POLICY_LOGPROBS,
    REF_LOGPROBS,
    REWARD,
    STEP,
    Provenance,
)
from klpipe.precompute.rollouts import Chunk
from klpipe.precompute.tokenize import TokenizedChunk
from klpipe.score.mismatch import BINS_PER_DECADE

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_data"
TINY_GEMMA = SAMPLE / "tiny-gemma4"
TINY_LLAMA = SAMPLE / "tiny-llama"
TINY_GEMMA_MM = SAMPLE / "tiny-gemma4-mm"  # the hub layout: Gemma4ForConditionalGeneration, towers, tied head
ROLLOUTS = SAMPLE / "rollouts.parquet"
CONVERSATIONAL = SAMPLE / "conversational.parquet"  # TRL prompt-completion messages
# The in-process controller klpipe's semantics come from. It is not part of this repository: where
# it sits beside the clone (as in CI) every comparison with it runs; on a bare clone they skip, and
# the hand-derived figures in test_controller.py and test_score.py still pin the rule.
SEED_PATH = Path(os.environ.get("KLPIPE_ORIGINAL_CONTROLLER") or ROOT.parent / "shared" / "seed" / "kl_controller.py")


# -- the reference oracle ---------------------------------------------------------------------------

def oracle_logprobs(model, prompt_ids, response_ids, temperature: float = 1.0) -> np.ndarray:
    """Naive: one sequence, a full forward pass, log_softmax(logits)[t-1, token_t], in fp32 (fp64 for an fp64
    model, returned as float64)."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    precise = model.dtype == torch.float64
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    logits = logits.double() if precise else logits.float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    start = len(prompt_ids)
    return np.array([logprobs[start + i - 1, tok].item() for i, tok in enumerate(response_ids)],
                    dtype=np.float64 if precise else np.float32)


def worst_error(model, rows, results, temperature: float = 1.0) -> float:
    """The largest |klpipe − oracle| over every response token of `rows` ((prompt, response) pairs), with
    `model` as the oracle; each row's result must be float32 of its response's length."""
    worst = 0.0
    for (prompt, response), values in zip(rows, results, strict=True):
        expected = oracle_logprobs(model, prompt, response, temperature)
        assert values.dtype == np.float32 and values.shape == expected.shape
        if len(expected):
            worst = max(worst, float(np.max(np.abs(values - expected))))
    return worst


class Fp64Oracle:
    """The one-row oracle of `model` in fp64 all the way through (klpipe/model/wide.py), beside the naive fp32 one.
    Random tiny models with large weights are chaotic: fp32 rounding alone moves their logprobs by more than 1e-4,
    so klpipe is held to the fp32 oracle's own error against fp64 + 1e-4. Each set of rows is computed once (a
    test's modes share them)."""

    def __init__(self, model):
        import copy

        # Copies taken now, as the model was loaded: what klpipe installs in it later (its attention) is not the oracle.
        self.model = copy.deepcopy(model)
        self.exact = None
        self.memo: dict = {}

    def expected(self, rows, temperature: float = 1.0) -> tuple[list[np.ndarray], float]:
        """(fp64 logprobs of every row, the fp32 oracle's worst |error| against them)."""
        key = (temperature, tuple((np.asarray(p).tobytes(), np.asarray(r).tobytes()) for p, r in rows))
        if key not in self.memo:
            import copy

            import torch

            if self.exact is None:
                self.exact = copy.deepcopy(self.model).to(torch.float64)
                if self.exact._can_set_experts_implementation():
                    self.exact.set_experts_implementation("eager")  # the grouped-matmul kernels take no fp64
            from klpipe.model import wide

            # fp64 all the way through: the model's own fp32 casts (a delta rule, gated norms, RoPE's angles) made
            # fp64 too, or they would round the fp64 forward as they round rows run whole, and not as the tree.
            with wide.fp64():
                expected = [oracle_logprobs(self.exact, p, r, temperature) for p, r in rows]
            naive = [oracle_logprobs(self.model, p, r, temperature) for p, r in rows]
            own = max((float(np.max(np.abs(a - b))) for a, b in zip(naive, expected, strict=True) if len(b)),
                      default=0.0)
            self.memo[key] = expected, own
        return self.memo[key]

    def errors(self, rows, results, temperature: float = 1.0) -> tuple[float, float]:
        """(klpipe's worst |error| against fp64, the fp32 oracle's own) over every response token of `rows`."""
        expected, own = self.expected(rows, temperature)
        ours = 0.0
        for values, exact in zip(results, expected, strict=True):
            assert values.dtype == np.float32 and values.shape == exact.shape
            if len(exact):
                ours = max(ours, float(np.max(np.abs(values - exact))))
        return ours, own


# -- the seed controller and cache files (no torch) -----------------------------------------------

CACHE_SCHEMA = pa.schema(
    [
        (ID, pa.string()),
        (STEP, pa.int64()),
        (POLICY_LOGPROBS, pa.list_(pa.float32())),
        (REF_LOGPROBS, pa.list_(pa.float32())),
        (REWARD, pa.float64()),
    ]
)


class _HideTorch(importlib.abc.MetaPathFinder):
    """Makes the seed take its CPU path without paying for a torch import (tests stay fast)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} hidden by the test")
        return None


_seed = None


def seed_missing() -> str | None:
    """Why the seed cannot be compared with, or None when it can."""
    if SEED_PATH.is_file():
        return None
    return (f"the original controller (elizaOS's KLController) is not at {SEED_PATH} (a bare clone): comparisons "
            "with it are skipped")


def load_seed():
    """The seed module (../shared/seed/kl_controller.py), imported once; the calling test skips without it.

    KLPIPE_REQUIRE_ORIGINAL_CONTROLLER=1 (set by .ci/run) turns that skip into a failure, so CI never passes without
    having run the comparisons.
    """
    global _seed
    missing = seed_missing()
    if missing is not None:
        import pytest

        if os.environ.get("KLPIPE_REQUIRE_ORIGINAL_CONTROLLER") not in (None, "", "0"):
            pytest.fail(f"{missing}, and KLPIPE_REQUIRE_ORIGINAL_CONTROLLER is set")
        pytest.skip(missing)
    if _seed is None:
        blocker = _HideTorch()
        sys.meta_path.insert(0, blocker)
        try:
            spec = importlib.util.spec_from_file_location("seed_kl_controller", SEED_PATH)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        finally:
            sys.meta_path.remove(blocker)
        _seed = module
    return _seed


def seed_controller(**config):
    seed = load_seed()
    return seed.KLControllerBase(seed.KLConfig(reference_model_name="test", **config))


def seed_config(**ours) -> dict:
    """Our ControllerConfig keywords as the seed's KLConfig keywords."""
    renamed = dict(ours)
    if "window" in renamed:
        renamed["adaptation_window"] = renamed.pop("window")
    return renamed


def write_cache(
    path: Path,
    rows: list[dict],
    schema: pa.Schema = CACHE_SCHEMA,
    provenance: Provenance | None = None,
    row_group_size: int | None = None,
) -> Path:
    """A real parquet cache on disk; columns not in `schema` are dropped from `rows`."""
    table = pa.Table.from_pylist([{k: r.get(k) for k in schema.names} for r in rows], schema=schema)
    if provenance is not None:
        table = table.replace_schema_metadata({METADATA_KEY: provenance.to_json()})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def make_rows(n: int, seed: int = 0, rows_per_step: int = 4, max_tokens: int = 6, dyadic: bool = True) -> list[dict]:
    """Rows with short responses (some empty). Dyadic logprobs (multiples of 1/64) make every sum exact,
    so klpipe and the seed agree to the last bit whatever their summation order."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = rng.randint(0, max_tokens)
        if dyadic:
            policy = [-rng.randint(0, 256) / 64 for _ in range(length)]
            ref = [p - rng.randint(-32, 160) / 64 for p in policy]
        else:
            policy = [-rng.expovariate(1.0) for _ in range(length)]
            ref = [p - rng.gauss(0.5, 1.0) for p in policy]
        rows.append(
            {
                ID: f"r{i}",
                STEP: i // rows_per_step,
                POLICY_LOGPROBS: policy,
                REF_LOGPROBS: ref,
                REWARD: rng.randint(-64, 64) / 16,
            }
        )
    return rows


def two_days(directory: Path, rows: int = 480, rows_per_step: int = 48, names=("day1", "day2")) -> list[Path]:
    """Two caches a day apart, as one state file continues them: one controller batch per `rows_per_step`
    rows, the second's steps carrying on from the first's."""
    first, second = make_rows(rows, seed=1, rows_per_step=rows_per_step), make_rows(rows, seed=2,
                                                                                    rows_per_step=rows_per_step)
    for row in second:
        row[STEP] += -(-rows // rows_per_step)
    return [write_cache(directory / f"{name}.parquet", day, provenance=provenance())
            for name, day in zip(names, (first, second), strict=True)]


def provenance(**changes) -> Provenance:
    fields = dict(
        model="tiny", revision="abc", tokenizer="sha-1", dtype="float32", temperature=1.0, klpipe_version="0.1.0"
    )
    fields.update(changes)
    return Provenance(**fields)


# A cache with a mask and the exact KL's columns, as `klpipe precompute --policy` writes them (cache.FULL_KL_COLUMNS).
EXACT_SCHEMA = pa.schema(list(CACHE_SCHEMA) + [pa.field(MASK, pa.list_(pa.int8()))]
                         + [pa.field(name, pa.list_(pa.float32())) for name in FULL_KL_COLUMNS])


def exact_provenance(**changes) -> Provenance:
    """The provenance of a cache `klpipe precompute --policy` made with the exact KL."""
    return provenance(**{"policy_model": "tiny-policy", "policy_revision": "local:def", "policy_dtype": "float32",
                         "full_kl": True, **changes})


def with_exact_columns(rows: list[dict], seed: int = 0) -> list[dict]:
    """`rows` (make_rows') with a mask, 0 on a tool span in every third row of 3 tokens or more, and the exact
    KL's columns: dyadic values ≥ 0 (multiples of 1/64, exact in float32), null where the mask is 0; the reference
    logprob is null there too, as precompute writes it."""
    import random

    rng = random.Random(seed)
    out = []
    for i, row in enumerate(rows):
        n = len(row[POLICY_LOGPROBS])
        mask = [0 if i % 3 == 1 and n >= 3 and 1 <= k <= n - 2 else 1 for k in range(n)]
        ref = [r if m else None for r, m in zip(row[REF_LOGPROBS], mask, strict=True)]
        row = dict(row, **{MASK: mask, REF_LOGPROBS: ref})
        for name in FULL_KL_COLUMNS:
            row[name] = [rng.randint(0, 256) / 64 if m else None for m in mask]
        out.append(row)
    return out


# -- running klpipe ---------------------------------------------------------------------------------


def with_checkout(env: dict) -> dict:
    """`env` with this checkout first on PYTHONPATH: a process started in another directory (which puts its
    own first on sys.path) imports this klpipe, whatever the environment has installed."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))}


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports free on `host` now (the kernel's pick), for a test's servers to listen on."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def run_cli(*args: str, env: dict | None = None, timeout: float = 300, cwd: Path | None = None):
    """`python -m klpipe ARGS` in a fresh process, as cron or Slurm would run it, importing this checkout's
    klpipe from any `cwd`."""
    full_env = with_checkout({**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "klpipe", *args], capture_output=True, text=True, env=full_env,
        timeout=timeout, cwd=cwd or ROOT,
    )


def block_imports(*names: str) -> str:
    """Python source that, run first in a fresh interpreter, makes `names` (and their submodules) fail to
    import as they do when they are not installed."""
    return f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {names!r}:
            raise ModuleNotFoundError(f'No module named {{name!r}}', name=name)
sys.meta_path.insert(0, Block())
"""


# Python source that runs the klpipe command line with the interpreter's arguments (after block_imports).
RUN_KLPIPE = "from klpipe.cli import main\nsys.argv = ['klpipe'] + sys.argv[1:]\nmain()"


def run_python(code: str, *args: str, timeout: float = 120):
    """`python -c CODE ARGS` in a fresh process, from the repository root."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=ROOT, timeout=timeout)


# -- memory -----------------------------------------------------------------------------------------

WIDE = 20_000  # bytes of a wide pass-through column per row: documents, images, traces


def write_wide_rows(path: Path, rows: int, *, tokens: int = 3, blob_bytes: int = WIDE, random_bytes: int = WIDE,
                    ref_logprobs: bool = False) -> Path:
    """Rollouts (a cache, with `ref_logprobs`) of `tokens`-token prompts and responses and a `blob_bytes` column.

    The first `random_bytes` of each row's blob are random and the rest zeros, which compress
    away: the ratio sets how many bytes on disk stand for how many in memory.
    """
    rng = np.random.default_rng(rows)
    writer = None
    for start in range(0, rows, 500):
        n = min(500, rows - start)
        ids = pa.array(rng.integers(3, 500, n * tokens, dtype=np.int32))
        offsets = pa.array(np.arange(n + 1, dtype=np.int32) * tokens)
        logprobs = [pa.ListArray.from_arrays(offsets, pa.array(-rng.random(n * tokens, dtype=np.float32)))
                    for _ in range(2)]
        blob = np.zeros((n, blob_bytes), dtype=np.uint8)
        blob[:, :random_bytes] = np.frombuffer(rng.bytes(n * random_bytes), np.uint8).reshape(n, random_bytes)
        columns = {
            "id": pa.array([f"r{i}" for i in range(start, start + n)]),
            "step": pa.array(np.arange(start, start + n) // 256),  # a training step of 256 rollouts
            "prompt_ids": pa.ListArray.from_arrays(offsets, ids),
            "response_ids": pa.ListArray.from_arrays(offsets, ids),
            "policy_logprobs": logprobs[0],
            "reward": pa.array(rng.random(n)),
            "blob": pa.BinaryArray.from_buffers(
                pa.binary(), n, [None, pa.array(np.arange(n + 1, dtype=np.int32) * blob_bytes).buffers()[1],
                                 pa.py_buffer(blob)]),
        }
        if ref_logprobs:
            columns["ref_logprobs"] = logprobs[1]
        table = pa.table(columns)
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()
    return path


# Runs one command and prints the peak RSS of that command alone (KiB on Linux): getrusage's
# RUSAGE_CHILDREN in a fresh wrapper counts no other child, unlike the test process's own.
_PEAK_RSS_WRAPPER = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:]).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code)
"""


def peak_rss_mib(commands: list[list], env: dict | None = None, timeout: float = 600) -> list[float]:
    """Run each `klpipe ARGS` command in a fresh process, all at once; the peak RSS of each, in MiB.

    A command that fails fails the caller's test: its stderr is in the assertion message.
    """
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    processes = [
        subprocess.Popen([sys.executable, "-c", _PEAK_RSS_WRAPPER, sys.executable, "-m", "klpipe", *map(str, command)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=ROOT)
        for command in commands
    ]
    peaks = []
    for command, process in zip(commands, processes, strict=True):
        stdout, stderr = process.communicate(timeout=timeout)
        kib, code = stdout.split()[-2:]
        assert process.returncode == 0 and code == "0", f"klpipe {' '.join(map(str, command))}: exit {code}: {stderr}"
        peaks.append(int(kib) / 1024)
    return peaks


def tokenized_chunk(rows) -> TokenizedChunk:
    """A chunk of (prompt ids, response ids) rows, flattened as ChunkTokenizer hands it to the model."""

    def flat(lists):
        values = np.concatenate([np.asarray(x, dtype=np.int64) for x in lists]) if lists else np.zeros(0, np.int64)
        return values, offsets_from_lengths([len(x) for x in lists])

    prompts, prompt_offsets = flat([p for p, _ in rows])
    responses, response_offsets = flat([r for _, r in rows])
    n = len(rows)
    chunk = Chunk(0, pa.table({"x": list(range(n))}), np.zeros(n, np.int64), np.arange(n))
    return TokenizedChunk(chunk, chunk.table, prompts, prompt_offsets, responses, response_offsets)


# -- agent-shaped rollouts --------------------------------------------------------------------------


def agent_rollouts(path: Path, tasks: int = 6, group: int = 4, turns: int = 3, seed: int = 0,
                   system_tokens: int = 60) -> Path:
    """Rollouts an agent trainer dumps, as token ids: a long system prompt in every row, GRPO groups of
    `group` responses per task, and trajectories stored a row per turn (each prompt the whole history).

    Random ids of the tiny models' vocabulary, with random policy logprobs and rewards: for the paths
    through the prefix tree, where the numbers matter only against the oracle.
    """
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(3, 512, n).tolist()

    system = [2] + ids(system_tokens - 1)
    rows = []
    for task in range(tasks):
        prompt = system + ids(int(rng.integers(4, 30)))
        for g in range(group):
            rows.append({"id": f"t{task}-g{g}", "step": task // 2, "prompt_ids": prompt,
                         "response_ids": ids(int(rng.integers(0, 24)))})
        history = system + ids(int(rng.integers(4, 12)))
        for turn in range(turns):  # a trajectory: turn k + 1's prompt is turn k's prompt and response and more
            response = ids(int(rng.integers(1, 16)))
            rows.append({"id": f"t{task}-turn{turn}", "step": task // 2, "prompt_ids": history,
                         "response_ids": response})
            history = history + response + ids(int(rng.integers(2, 8)))
    for row in rows:
        row["policy_logprobs"] = (-rng.exponential(2.0, len(row["response_ids"]))).astype(np.float32).tolist()
        row["reward"] = float(rng.random())
    schema = pa.schema([("id", pa.string()), ("step", pa.int64()), ("prompt_ids", pa.list_(pa.int32())),
                        ("response_ids", pa.list_(pa.int32())), ("policy_logprobs", pa.list_(pa.float32())),
                        ("reward", pa.float64())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def agent_rows(vocab: int, seed: int = 0, *, window: int = 8, system: int | None = None, low: int = 0,
               three_token_row: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
    """An agent's chunk of (prompt ids, response ids), shuffled: every case the prefix tree must get right.

    A system prompt (`system` tokens, 9 windows + 3 unless given) in every row but two; GRPO groups with
    responses of 0 and 1 tokens; a row whose prompt is the bare system prompt and one whose prompt is a strict
    prefix of every other; a trajectory stored a row per turn; duplicates; a row that shares nothing; with
    `three_token_row`, one of 3 tokens. Token ids are drawn from low..vocab-1.
    """
    rng = np.random.default_rng(seed)

    def tokens(n):
        return rng.integers(low, vocab, n)

    prefix = tokens(9 * window + 3 if system is None else system)
    rows = []
    for task_len, responses in ((3, [0, 1, 2, 3 * window]), (window + 5, [7, 7, 40]), (1, [9])):
        task = np.concatenate([prefix, tokens(task_len)])
        rows += [(task, tokens(n)) for n in responses]
    rows.append((prefix.copy(), tokens(5)))
    rows.append((prefix[:window + 2], tokens(4)))
    turn = (np.concatenate([prefix, tokens(6)]), tokens(2 * window))
    for _ in range(3):  # each turn's prompt holds the whole history
        rows.append(turn)
        turn = (np.concatenate([*turn, tokens(4)]), tokens(window + 1))
    rows.append(rows[0])
    rows.append(rows[-2])
    rows.append((tokens(11), tokens(6)))
    if three_token_row:
        rows.append((tokens(2), tokens(1)))
    order = rng.permutation(len(rows))
    return [rows[i] for i in order]


def repeated_rollouts(copies: int) -> pa.Table:
    """The sample rollouts `copies` times over, ids renumbered r0, r1, ...: a long run from real rows."""
    table = pa.concat_tables([pq.read_table(ROLLOUTS)] * copies)
    return table.set_column(0, "id", pa.array([f"r{i}" for i in range(table.num_rows)]))


def per_row_tokens(table: pa.Table) -> int:
    """What running every row whole feeds: its prompt and its response less the last token."""
    return sum(len(p) + len(r) - 1 for p, r in zip(table.column("prompt_ids").to_pylist(),
                                                   table.column("response_ids").to_pylist(), strict=True) if r)


@contextmanager
def crash_at_chunk(monkeypatch, index: int = 2):
    """Within the block, a precompute run dies (RuntimeError) as it writes chunk `index`: the chunks before it
    stay in the work directory, as after a kill."""
    import pytest

    from klpipe.precompute.workdir import WorkDir

    real_write = WorkDir.write_chunk

    def write_chunk(self, tokenized, *args, **kwargs):
        if tokenized.chunk.index == index:
            raise RuntimeError("simulated crash")
        real_write(self, tokenized, *args, **kwargs)

    with monkeypatch.context() as crashing:
        crashing.setattr(WorkDir, "write_chunk", write_chunk)
        with pytest.raises(RuntimeError, match="simulated crash"):
            yield


def kill_9_after_chunks(args: list, work: Path, pattern: str, chunks: int = 3, env: dict | None = None,
                        timeout: float = 120) -> int:
    """Run `python -m klpipe ARGS`, kill -9 it once `chunks` files match `pattern` under `work`, and
    return how many had been written by then."""
    import signal
    import time

    process = subprocess.Popen([sys.executable, "-m", "klpipe", *map(str, args)], cwd=ROOT, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    deadline = time.monotonic() + timeout
    while len(list(work.glob(pattern))) < chunks:
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    process.stderr.close()
    return len(list(work.glob(pattern)))


# -- the sampler against the trainer (klpipe/score/mismatch.py) -------------------------------------------

MISMATCH_FAULTS = ("temperature", "top_p", "shift", "placeholder", "nonfinite")


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def mismatch_cache(path: Path, fault: str | None = None, rows: int = 64, seed: int = 0, vocab: int = 64,
                   rows_per_step: int = 16, group: int = 4) -> Path:
    """A cache with the trainer's (policy_logprobs) and the sampler's (sampler_logprobs) logprobs of tokens drawn
    from a known softmax, and exactly one planted `fault` (MISMATCH_FAULTS), or none:

    clean: the sampler's are the trainer's with 1% relative noise (an engine in another precision);
    temperature: the sampler samples and scores at T = 0.7, the trainer at 1; top_p: the sampler renormalises over
    the top-0.9 set; shift: the sampler's list runs one token ahead; placeholder: 0.0 and 1.0 at some sampled
    tokens; nonfinite: NaN and −inf at some sampled tokens. Every fourth row has a tool result (mask 0) inside.
    """
    rng = np.random.default_rng(seed)
    records = []
    for i in range(rows):
        length = int(rng.integers(5, 40))
        logits = rng.normal(0, 1, (length, vocab)) * rng.uniform(0.5, 4, (length, 1))  # (T, V) flat to peaked
        trainer_all = _log_softmax(logits)
        if fault == "temperature":
            sampler_all = _log_softmax(logits / 0.7)
        elif fault == "top_p":
            order = np.argsort(-trainer_all, axis=1)
            sorted_p = np.exp(np.take_along_axis(trainer_all, order, axis=1))
            inside = np.zeros_like(trainer_all, dtype=bool)
            np.put_along_axis(inside, order, np.cumsum(sorted_p, axis=1) - sorted_p < 0.9, axis=1)
            sampler_all = _log_softmax(np.where(inside, trainer_all, -np.inf))
        else:
            sampler_all = trainer_all
        probs = np.exp(sampler_all)
        tokens = (np.cumsum(probs, axis=1) > rng.random((length, 1))).argmax(axis=1)
        trainer = trainer_all[np.arange(length), tokens]
        sampler = sampler_all[np.arange(length), tokens]
        if fault not in ("temperature", "top_p"):
            sampler = sampler + rng.normal(0, 0.01, length) * np.abs(sampler)
        if fault == "shift":
            sampler = np.append(sampler[1:], sampler[-1])
        mask = np.ones(length, np.int8)
        if i % 4 == 1 and length > 8:
            mask[3:6] = 0
        if fault == "placeholder" and i % 8 == 0:
            sampler[0], sampler[-1] = 1.0, 0.0
        if fault == "nonfinite" and i % 16 == 0:
            sampler[1], sampler[2] = np.nan, -np.inf
        ref = trainer - rng.normal(0.05, 0.1, length)
        records.append({
            "id": f"r{i}", "step": i // rows_per_step, "prompt_ids": [i // group] * 3,
            "response_ids": tokens.astype(np.int32).tolist(),
            "policy_logprobs": trainer.astype(np.float32).tolist(),
            "sampler_logprobs": sampler.astype(np.float32).tolist(),
            "ref_logprobs": ref.astype(np.float32).tolist(), "reward": float(rng.random()), "mask": mask.tolist(),
        })  # fmt: skip
    table = pa.Table.from_pylist(records)
    for name in ("policy_logprobs", "sampler_logprobs", "ref_logprobs"):  # float32, as caches hold them
        table = table.set_column(table.schema.get_field_index(name), name,
                                 table.column(name).cast(pa.list_(pa.float32())))
    pq.write_table(table, path)
    return path


# A quantile is its histogram bin's centre: within half a bin, 10^(0.5/100) − 1 ≈ 0.58%, of the exact value.
QUANTILE_TOLERANCE = 10 ** (0.5 / BINS_PER_DECADE) - 1 + 1e-12


def sampled_logprobs(path):
    """Per row: (trainer, sampler, ref) float64 over mask-1 tokens, the step, and the row's id."""
    rows = []
    for row in pq.read_table(path).to_pylist():
        keep = np.array(row["mask"] if "mask" in row else [1] * len(row["policy_logprobs"]), bool)
        trainer, sampler, ref = (np.array(row[c], np.float64)[keep] for c in
                                 ("policy_logprobs", "sampler_logprobs", "ref_logprobs"))
        rows.append({"t": trainer, "s": sampler, "ref": ref, "step": row["step"], "id": row["id"]})
    return rows


def expected_figures(rows) -> dict:
    """verl's definitions, written out: token-weighted over every sampled token, row-weighted over rows with one."""
    rows = [r for r in rows if len(r["t"])]
    ratio = np.concatenate([r["t"] - r["s"] for r in rows])
    r = np.exp(ratio)
    k1_trainer = np.concatenate([r_["t"] - r_["ref"] for r_ in rows])
    k1_sampler = np.concatenate([r_["s"] - r_["ref"] for r_ in rows])
    mean_t = np.array([np.mean(x["t"]) for x in rows])
    mean_s = np.array([np.mean(x["s"]) for x in rows])
    sums = np.array([np.sum(x["t"] - x["s"]) for x in rows])
    seq = np.exp(np.clip(sums, -20, 20))
    geo = np.exp(sums / np.array([len(x["t"]) for x in rows]))
    return {
        "rollout_corr/kl": np.mean(-ratio),
        "rollout_corr/k3_kl": np.mean(np.exp(ratio) - 1 - ratio),
        "rollout_corr/chi2_token": np.mean(r ** 2) - 1,
        "rollout_corr/training_ppl": np.mean(np.exp(-mean_t)),
        "rollout_corr/rollout_ppl": np.mean(np.exp(-mean_s)),
        "rollout_corr/log_ppl_diff": np.mean(mean_s - mean_t),
        "rollout_corr/ppl_ratio": np.mean(np.exp(-mean_t) / np.exp(-mean_s)),
        "rollout_corr/chi2_seq": np.mean(seq ** 2) - 1,
        "mismatch/tokens": len(ratio),
        "mismatch/rows": len(rows),
        "mismatch/kl_trainer": np.mean(k1_trainer),
        "mismatch/kl_sampler": np.mean(k1_sampler),
        "mismatch/kl_importance_corrected": np.mean(r * k1_trainer),
        "mismatch/ess_token_is": np.sum(r) ** 2 / (len(r) * np.sum(r ** 2)),
        "mismatch/ess_sequence_is": np.sum(seq) ** 2 / (len(seq) * np.sum(seq ** 2)),
        "mismatch/ess_geometric": np.sum(geo) ** 2 / (len(geo) * np.sum(geo ** 2)),
    }


def order_statistic(values: np.ndarray, q: float) -> float:
    """The inverted-CDF quantile: the k-th smallest value, k = ⌈q·n⌉."""
    ordered = np.sort(values)
    return float(ordered[max(math.ceil(q * len(values) - 1e-9), 1) - 1])


def assert_quantile(reported, exact):
    if abs(exact) < 1e-9:
        assert reported == 0.0
    else:
        assert np.sign(reported) == np.sign(exact), (reported, exact)
        assert abs(reported / exact - 1) <= QUANTILE_TOLERANCE, (reported, exact)


def assert_mismatch_figures(figures: dict, rows: list[dict]) -> None:
    for name, value in expected_figures(rows).items():
        assert figures[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name
    ratio = np.concatenate([r["t"] - r["s"] for r in rows])
    for name, q in (("p0.1", 0.001), ("p1", 0.01), ("p50", 0.5), ("p99", 0.99), ("p99.9", 0.999)):
        assert_quantile(figures[f"mismatch/log_ratio_{name}"], order_statistic(ratio, q))
        assert_quantile(figures[f"mismatch/abs_log_ratio_{name}"], order_statistic(np.abs(ratio), q))
