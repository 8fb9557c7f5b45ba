"""The scripts under examples/ run as written and give what one process gives.

The sbatch scripts run under bash with the SLURM_* variables an array task would see (the #SBATCH
lines are comments to bash). Every script runs with stand-ins for `srun`, `scontrol` and `sbatch`
first on its PATH (`srun` runs its command, each records its call), so what these tests see does not
depend on whether a real Slurm is installed on the machine, as it is on any login node. The same
scripts under a real one-node Slurm cluster are tested by tests/slurm/ (`make test-slurm`). torchrun
is real (it comes with torch) and starts 2 CPU processes. The cron line is taken from
examples/crontab itself, its paths pointed at a temporary directory.

Every result is compared with a single-process run over the same rollouts with the same
--chunk-rows: parts concatenated in shard order must equal it bit for bit (schema metadata aside:
each part records its shard), and scoring the parts must equal scoring it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from klpipe.precompute import PrecomputeConfig, precompute
from klpipe.score import ScoreConfig, score
from tests.fault_runner import Child, Fault, Runner
from tests.helpers import (
    ROLLOUTS,
    ROOT,
    TINY_LLAMA,
    repeated_rollouts,
    two_days,
    with_checkout,
)

EXAMPLES = ROOT / "examples"
VENV_BIN = Path(sys.executable).parent  # the environment running the tests, where `klpipe` is installed
CHUNK_ROWS = 4  # 48 sample rows: 12 chunks, so every shard of 2 or 3 gets several


@contextlib.contextmanager
def one_torch_thread():
    """In-process reference runs use one thread, like the script runs (OMP_NUM_THREADS=1 below)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def slurm_stand_ins(directory: Path) -> Path:
    """`srun` that runs its command, `scontrol` that does nothing, and `sbatch` that prints a job id
    ("4242;cluster1" with --parsable): each appends its command line to $FAKE_SLURM_LOG."""
    directory.mkdir(exist_ok=True)
    record = 'echo "$(basename "$0") $*" >> "$FAKE_SLURM_LOG"\n'
    tools = {
        "srun": 'while [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n',
        "scontrol": "",
        "sbatch": 'case " $* " in *" --parsable "*) echo "4242;cluster1";; *) echo "Submitted batch job 4243";; esac\n',
    }
    for tool, body in tools.items():
        (directory / tool).write_text("#!/bin/bash\n" + record + body)
        (directory / tool).chmod(0o755)
    return directory


def slurm_calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def script_env(tmp_path: Path, **settings) -> dict:
    """A clean environment: nothing inherited that could shard a run or change its settings, the Slurm
    stand-ins (recording to tmp_path/slurm.log) ahead of any real Slurm on the system PATH, and this
    checkout's klpipe."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "KLPIPE_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PATH")}
    stand_ins = slurm_stand_ins(tmp_path / "slurm-bin")
    env.update({
        "PATH": os.pathsep.join([str(stand_ins), str(VENV_BIN), "/usr/local/bin", "/usr/bin", "/bin"]),
        "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # Up to three klpipe processes share two cores here; one thread each keeps them from
        # spinning against each other (two-thread runs under contention are ~10x slower).
        "OMP_NUM_THREADS": "1",
        "KLPIPE_CHUNK_ROWS": str(CHUNK_ROWS),
    })
    env.update({k: str(v) for k, v in settings.items()})
    return with_checkout(env)


def without_metadata(table: pa.Table) -> pa.Table:
    return table.replace_schema_metadata(None)


def concatenated_parts(directory: Path, count: int) -> pa.Table:
    names = [f"part-{i:05d}-of-{count:05d}.parquet" for i in range(count)]
    assert sorted(p.name for p in directory.glob("*.parquet")) == names
    for name in names:  # each part is marked complete
        assert json.loads((directory / name.replace(".parquet", ".done")).read_text())["rows"] > 0
    return pa.concat_tables([without_metadata(pq.read_table(directory / name)) for name in names])


def controller_state(path: Path) -> dict:
    """The controller's state, minus the record of which files it read (names differ by design)."""
    state = json.loads(path.read_text())
    state["last_run"].pop("inputs")
    return state


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """One process over all the sample rollouts, then scored: what every example must reproduce."""
    directory = tmp_path_factory.mktemp("single")
    with one_torch_thread():
        precompute(PrecomputeConfig(inputs=[ROLLOUTS], output=directory / "cached.parquet", model=str(TINY_LLAMA),
                                    device="cpu", chunk_rows=CHUNK_ROWS, progress="none"), log=lambda m: None)
    score(ScoreConfig(inputs=[directory / "cached.parquet"], output=directory / "scored.parquet",
                      report=directory / "report.json", state=directory / "kl_state.json"))
    return directory


@pytest.fixture
def spawn():
    """subprocess.Popen in its own process group, killed with its children (klpipe under bash)
    if still running when the test ends, whatever assertion failed first."""
    started = []

    def start(*args, **kwargs) -> subprocess.Popen:
        started.append(subprocess.Popen(*args, start_new_session=True, **kwargs))
        return started[-1]

    yield start
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def run_array(script: Path, tasks: range, cwd: Path, env: dict, only: list[int] | None = None
              ) -> list[subprocess.CompletedProcess]:
    """The tasks of an array (`only` some of them) at once, as Slurm starts them, each with its variables."""
    procs = []
    for task in tasks if only is None else only:
        task_env = {**env, "SLURM_JOB_ID": str(9000 + task), "SLURM_ARRAY_JOB_ID": "9000",
                    "SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_COUNT": str(len(tasks)),
                    "SLURM_ARRAY_TASK_MIN": str(tasks.start), "SLURM_ARRAY_TASK_MAX": str(tasks[-1]),
                    "SLURM_ARRAY_TASK_STEP": str(tasks.step)}
        procs.append(subprocess.Popen(["bash", str(script)], cwd=cwd, env=task_env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("tasks", [range(2), range(10, 13)], ids=["2-shards", "3-shards-from-10"])
def test_sbatch_array_then_score_equals_single_process(tmp_path, single, tasks):
    env = script_env(tmp_path, KLPIPE_MODEL=TINY_LLAMA, ROLLOUTS=ROLLOUTS, CACHE_DIR=tmp_path / "cached",
                     SCORE_DIR=tmp_path / "scored", KL_STATE=tmp_path / "kl_state.json")
    for result in run_array(EXAMPLES / "precompute-array.sbatch", tasks, tmp_path, env):
        assert result.returncode == 0, result.stdout
    # In a job, each task runs klpipe as a job step.
    step = f"srun --ntasks=1 klpipe precompute --model {TINY_LLAMA} {ROLLOUTS} --output {tmp_path / 'cached'}"
    assert slurm_calls(tmp_path / "slurm.log") == [step] * len(tasks)
    expected = without_metadata(pq.read_table(single / "cached.parquet"))
    assert concatenated_parts(tmp_path / "cached", len(tasks)).equals(expected)

    scored = subprocess.run(["bash", str(EXAMPLES / "score-after.sbatch")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert scored.returncode == 0, scored.stderr
    got = pq.read_table(tmp_path / "scored" / "scored.parquet")
    assert without_metadata(got).equals(without_metadata(pq.read_table(single / "scored.parquet")))
    assert controller_state(tmp_path / "kl_state.json") == controller_state(single / "kl_state.json")
    report = json.loads((tmp_path / "scored" / "report.json").read_text())
    # Approximate: klpipe sums rewards per record batch, and a part file boundary splits a batch,
    # so the reward means differ in the last bits (reported; the per-row columns are exact).
    assert report["summary"] == pytest.approx(json.loads((single / "report.json").read_text())["summary"], rel=1e-12)
    assert (tmp_path / "scored" / "report.png").stat().st_size > 0


def test_score_after_refuses_an_array_with_a_missing_shard(tmp_path):
    """Only shard 1 of 2 is there (task 0 failed for good; someone reran task 1 by hand on the login
    node, then ran the score job by hand): score must refuse the directory rather than score half
    the rollouts, and write nothing. Run by hand, outside a job, the array script runs klpipe directly,
    not under the login node's srun (which would ask for a new allocation)."""
    env = script_env(tmp_path, KLPIPE_MODEL=TINY_LLAMA, ROLLOUTS=ROLLOUTS, CACHE_DIR=tmp_path / "cached",
                     SCORE_DIR=tmp_path / "scored", KL_STATE=tmp_path / "kl_state.json")
    task = subprocess.run(["bash", str(EXAMPLES / "precompute-array.sbatch")], cwd=tmp_path, text=True,
                          env={**env, "KLPIPE_SHARD_INDEX": "1", "KLPIPE_NUM_SHARDS": "2"},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert task.returncode == 0, task.stdout
    assert (tmp_path / "cached" / "part-00001-of-00002.done").exists()
    assert slurm_calls(tmp_path / "slurm.log") == []  # no srun, no scontrol
    result = subprocess.run(["bash", str(EXAMPLES / "score-after.sbatch")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("Error: ") and ("part-00000-of-00002" in error or "missing" in error.lower()), error
    assert not (tmp_path / "scored" / "scored.parquet").exists() and not (tmp_path / "kl_state.json").exists()


def long_rollouts(tmp_path: Path) -> Path:
    """1920 rows: with one row per forward pass (KLPIPE_MAX_TOKENS_PER_BATCH=1) half of them take ~2 s
    to score here, ample time to signal the run mid-way once its first chunk appears."""
    rollouts = tmp_path / "rollouts.parquet"
    pq.write_table(repeated_rollouts(40), rollouts)
    return rollouts


def wait_for_first_chunk(task: subprocess.Popen, work: Path) -> None:
    """A chunk on disk means klpipe is scoring, its signal handlers installed."""
    deadline = time.monotonic() + 120
    while not list(work.glob("chunk-*.parquet")):
        assert task.poll() is None, task.communicate()[0]
        assert time.monotonic() < deadline, "no chunk after 120 s"
        time.sleep(0.01)


@pytest.mark.slow
def test_sbatch_task_stopped_by_usr1_is_requeued_and_resumes(tmp_path, spawn):
    """Slurm's time-limit warning mid-run: the task exits 75 and requeues itself; the rerun resumes."""
    rollouts = long_rollouts(tmp_path)
    cache_dir = tmp_path / "cached"
    log = tmp_path / "slurm.log"
    env = script_env(tmp_path, KLPIPE_MODEL=TINY_LLAMA, ROLLOUTS=rollouts,
                     CACHE_DIR=cache_dir, KLPIPE_MAX_TOKENS_PER_BATCH=1,
                     SLURM_JOB_ID=7001, SLURM_ARRAY_JOB_ID=7000, SLURM_ARRAY_TASK_ID=1,
                     SLURM_ARRAY_TASK_COUNT=2, SLURM_ARRAY_TASK_MIN=0)
    part = cache_dir / "part-00001-of-00002.parquet"
    work = cache_dir / (part.name + ".partial")

    # The same task into another directory, never signalled: what the preempted one must end up with.
    uninterrupted = spawn(["bash", str(EXAMPLES / "precompute-array.sbatch")], cwd=tmp_path, text=True,
                          env={**env, "CACHE_DIR": str(tmp_path / "expected"),
                               "FAKE_SLURM_LOG": str(tmp_path / "expected.log")},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    task = spawn(["bash", str(EXAMPLES / "precompute-array.sbatch")], cwd=tmp_path, env=env,
                 text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for_first_chunk(task, work)
    task.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 does: to the batch shell only
    out, _ = task.communicate(timeout=120)
    assert task.returncode == 75, out
    assert "Error: stopped by SIGUSR1; finished chunks are saved" in out
    assert log.read_text().splitlines()[-1] == "scontrol requeue 7000_1"  # this task, not the array
    assert log.read_text().splitlines()[0].startswith("srun --ntasks=1 klpipe precompute")
    assert not part.exists() and not part.with_suffix(".done").exists()
    kept = len(list(work.glob("chunk-*.parquet")))
    assert kept >= 1

    # Slurm starts the requeued task again: the same script, the same command.
    rerun = subprocess.run(["bash", str(EXAMPLES / "precompute-array.sbatch")], cwd=tmp_path,
                           env={**env, "SLURM_RESTART_COUNT": "1"}, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"resuming: {kept} of " in rerun.stderr
    assert sorted(p.name for p in cache_dir.iterdir()) == [part.with_suffix(".done").name, part.name]

    out, _ = uninterrupted.communicate(timeout=300)
    assert uninterrupted.returncode == 0, out
    expected = pq.read_table(tmp_path / "expected" / part.name)
    assert pq.read_table(part).equals(expected, check_metadata=True)  # provenance included: same rows, same run


def test_sbatch_task_terminated_by_slurm_is_not_requeued_by_the_script(tmp_path, spawn):
    """On scancel or preemption Slurm sends TERM to every process: klpipe saves and exits 75, and the
    script leaves requeueing to Slurm (a --requeue job is requeued by Slurm; a cancelled one must stay so)."""
    cache_dir = tmp_path / "cached"
    log = tmp_path / "slurm.log"
    env = script_env(tmp_path, KLPIPE_MODEL=TINY_LLAMA, ROLLOUTS=long_rollouts(tmp_path),
                     CACHE_DIR=cache_dir, KLPIPE_MAX_TOKENS_PER_BATCH=1,
                     SLURM_JOB_ID=8000, SLURM_ARRAY_JOB_ID=8000, SLURM_ARRAY_TASK_ID=0, SLURM_ARRAY_TASK_COUNT=1)
    work = cache_dir / "part-00000-of-00001.parquet.partial"
    task = spawn(["bash", str(EXAMPLES / "precompute-array.sbatch")], cwd=tmp_path, env=env,
                 text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # a session: Slurm's "job"
    wait_for_first_chunk(task, work)
    os.killpg(task.pid, signal.SIGTERM)  # the whole job: the batch shell and klpipe alike
    out, _ = task.communicate(timeout=120)
    assert task.returncode == 75, out
    assert "Error: stopped by SIGTERM; finished chunks are saved" in out
    assert "received SIGTERM again" not in out  # the script did not add a second TERM
    assert not any(line.startswith("scontrol") for line in slurm_calls(log)), slurm_calls(log)


def test_sbatch_directives():
    """The #SBATCH lines say what the comments promise, and sit before the first command (sbatch
    stops reading directives there)."""
    def directives(path: Path) -> list[str]:
        found = []
        for line in path.read_text().splitlines()[1:]:
            if line.startswith("#SBATCH"):
                found.append(line.split()[1])
            elif line.strip() and not line.startswith("#"):
                break
        return found

    array = directives(EXAMPLES / "precompute-array.sbatch")
    assert any(re.fullmatch(r"--array=\d+-\d+", d) for d in array), array
    assert "--requeue" in array and "--gres=gpu:1" in array and "--open-mode=append" in array
    assert any(re.fullmatch(r"--signal=B:USR1@\d+", d) for d in array), array
    assert any(d.startswith("--output=") and "%A" in d and "%a" in d for d in array), array
    follow = directives(EXAMPLES / "score-after.sbatch")
    assert any(d.startswith("--output=") for d in follow) and not any("gres" in d for d in follow)
    nightly = directives(EXAMPLES / "score-nightly.sbatch")
    assert "--requeue" in nightly and "--open-mode=append" in nightly and not any("gres" in d for d in nightly)
    assert any(d.startswith("--output=") for d in nightly) and any(d.startswith("--time=") for d in nightly)


def test_submit_chains_score_after_the_array(tmp_path):
    result = subprocess.run(["bash", str(EXAMPLES / "submit.sh")], cwd=tmp_path, capture_output=True, text=True,
                            env=script_env(tmp_path), timeout=60)
    assert result.returncode == 0, result.stderr
    first, second = slurm_calls(tmp_path / "slurm.log")
    assert first == f"sbatch --parsable {EXAMPLES / 'precompute-array.sbatch'}"
    assert second == f"sbatch --dependency=afterok:4242 --kill-on-invalid-dep=yes {EXAMPLES / 'score-after.sbatch'}"
    assert (tmp_path / "logs").is_dir()  # Slurm would not create it


def test_submit_passes_the_array_and_site_options_on(tmp_path):
    """ARRAY goes to the array job alone; arguments go to both jobs."""
    result = subprocess.run(["bash", str(EXAMPLES / "submit.sh"), "--partition=a100", "--account=rl"],
                            cwd=tmp_path, capture_output=True, text=True, env={**script_env(tmp_path), "ARRAY": "0-15"},
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert slurm_calls(tmp_path / "slurm.log") == [
        f"sbatch --parsable --array=0-15 --partition=a100 --account=rl {EXAMPLES / 'precompute-array.sbatch'}",
        ("sbatch --dependency=afterok:4242 --kill-on-invalid-dep=yes --partition=a100 --account=rl "
         f"{EXAMPLES / 'score-after.sbatch'}"),
    ]


def test_torchrun_two_cpu_ranks_equal_single_process(tmp_path, single):
    env = script_env(tmp_path, NPROC=2, KLPIPE_MODEL=TINY_LLAMA, ROLLOUTS=ROLLOUTS, CACHE_DIR=tmp_path / "cached")
    result = subprocess.run(["bash", str(EXAMPLES / "torchrun.sh")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert concatenated_parts(tmp_path / "cached", 2).equals(without_metadata(pq.read_table(single / "cached.parquet")))


def cron_job(tmp_path: Path) -> tuple[dict, str]:
    """examples/crontab's variables and command, with its paths pointed into tmp_path and this checkout."""
    replacements = [
        ("/opt/klpipe/.venv/bin", str(VENV_BIN)),
        ("/opt/klpipe", str(ROOT)),
        ("/data/models/reference", str(TINY_LLAMA)),
        ("/data/rl", str(tmp_path / "data")),
        ("/var/lock", str(tmp_path / "lock")),
        ("/var/log/klpipe", str(tmp_path / "log")),
    ]

    def rewrite(text: str) -> str:
        for old, new in replacements:
            text = text.replace(old, new)
        return text

    variables, jobs = {}, []
    for line in (EXAMPLES / "crontab").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", line):
            name, value = line.split("=", 1)
            variables[name] = rewrite(value)
        else:
            jobs.append(line.split(None, 5))
    assert len(jobs) == 1 and len(jobs[0]) == 6, jobs
    command = rewrite(jobs[0][5])
    assert shlex.split(command)[:2] == ["flock", "-n"]
    return variables, command


def test_cron_nightly_runs_once_and_never_overlaps(tmp_path, single, spawn):
    variables, command = cron_job(tmp_path)
    for name in ("lock", "log"):
        (tmp_path / name).mkdir()
    day = "2025-01-31"
    (tmp_path / "data" / "rollouts" / day).mkdir(parents=True)
    shutil.copy(ROLLOUTS, tmp_path / "data" / "rollouts" / day / "rollouts.parquet")
    # What cron gives a job: the crontab's variables and little else. DAY pins the date (the script
    # defaults to yesterday); one thread and the test chunk size as everywhere in this module.
    env = {"HOME": str(tmp_path), "LOGNAME": "root", "SHELL": "/bin/sh", **variables,
           "DAY": day, "OMP_NUM_THREADS": "1", "KLPIPE_CHUNK_ROWS": str(CHUNK_ROWS)}
    log = tmp_path / "log" / "nightly.log"

    def start():
        return spawn(["/bin/sh", "-c", command], env=env, cwd=tmp_path)  # as cron runs it

    first = start()
    deadline = time.monotonic() + 60
    while not (log.exists() and "started" in log.read_text()):  # the first holds the lock now
        assert first.poll() is None, log.read_text() if log.exists() else "no log"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    began = time.monotonic()
    second = start()
    assert second.wait(timeout=30) == 1  # flock -n: the lock is taken, give up at once
    assert time.monotonic() - began < 10
    assert first.poll() is None  # the second really overlapped the first
    assert first.wait(timeout=300) == 0, log.read_text()
    text = log.read_text()
    assert text.count("started") == 1 and text.count("finished") == 1, text  # the second never ran

    data = tmp_path / "data"
    cache = pq.read_table(data / "cached" / f"{day}.parquet")
    assert without_metadata(cache).equals(without_metadata(pq.read_table(single / "cached.parquet")))
    scored = pq.read_table(data / "scored" / day / "scored.parquet")
    assert without_metadata(scored).equals(without_metadata(pq.read_table(single / "scored.parquet")))
    state = (data / "kl_state.json").read_bytes()
    assert controller_state(data / "kl_state.json") == controller_state(single / "kl_state.json")

    # Cron firing again for the same day (say, a manual rerun): the lock is free, the day is done.
    again = start()
    assert again.wait(timeout=60) == 0
    assert "already scored; nothing to do" in log.read_text()
    assert (data / "kl_state.json").read_bytes() == state  # the controller did not move twice


# -- a nightly score job that may overlap the previous night's (examples/score-nightly.sbatch) -----------


@pytest.fixture(scope="module")
def nights(tmp_path_factory) -> dict:
    """Two nights' caches, one controller batch per 48 rows; night 2's steps carry on from night 1's."""
    return {cache.stem: cache for cache in two_days(tmp_path_factory.mktemp("nights"), names=("night1", "night2"))}


@pytest.fixture(scope="module")
def klpipe_runs(tmp_path_factory):
    """klpipe score runs from the fault harness (tests/fault_runner.py), which can hold one paused mid-run."""
    runner = Runner(tmp_path_factory.mktemp("runs"))
    yield runner
    runner.close()


def night_args(cache: Path, directory: Path) -> list:
    """What score-nightly.sbatch runs for a night, without the wait."""
    scored = directory / "scored" / cache.stem
    return ["score", cache, "--output", scored / "scored.parquet", "--report", scored / "report.json",
            "--state", directory / "kl_state.json"]


def night_holding_the_state(runs: Runner, cache: Path, directory: Path) -> Child:
    """Last night's job, still scoring: its state read and held, paused at its first record batch."""
    return runs.start(night_args(cache, directory), Fault("score_batch", at=1, action="pause")).wait_paused()


def nightly_job(spawn, tmp_path: Path, cache: Path, log: Path, **settings) -> subprocess.Popen:
    """examples/score-nightly.sbatch as Slurm runs it for job 5150, its output appended to `log`."""
    env = script_env(tmp_path, DAY=cache.stem, CACHE=cache, SCORE_DIR=tmp_path / "scored" / cache.stem,
                     KL_STATE=tmp_path / "kl_state.json", SLURM_JOB_ID=5150, **settings)
    with open(log, "ab") as out:
        return spawn(["bash", str(EXAMPLES / "score-nightly.sbatch")], cwd=tmp_path, env=env, stdout=out,
                     stderr=subprocess.STDOUT)


def test_nightly_score_jobs_that_overlap_give_the_nights_in_order(tmp_path, nights, klpipe_runs, spawn):
    serial = tmp_path / "serial"  # the two nights one after the other
    for cache in nights.values():
        result = klpipe_runs.run(night_args(cache, serial))
        assert result.returncode == 0, result.stderr
    overlap = tmp_path / "overlap"
    overlap.mkdir()
    first = night_holding_the_state(klpipe_runs, nights["night1"], overlap)
    log = overlap / "nightly.out"
    job = nightly_job(spawn, overlap, nights["night2"], log)
    deadline = time.monotonic() + 60
    while "waiting for" not in log.read_text():
        assert job.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    assert f"another klpipe run (pid {first.pid} on host " in log.read_text()
    assert "up to 3600 s (--wait-for-state)" in log.read_text()
    first.go()
    assert first.wait().returncode == 0
    assert job.wait(timeout=120) == 0, log.read_text()
    for night in nights:
        got = pq.read_table(overlap / "scored" / night / "scored.parquet")
        assert got.equals(pq.read_table(serial / "scored" / night / "scored.parquet"), check_metadata=True), night
    assert (overlap / "kl_state.json").read_bytes() == (serial / "kl_state.json").read_bytes()
    assert slurm_calls(overlap / "slurm.log") == []  # no requeue


def test_a_nightly_job_past_its_wait_requeues_itself_having_written_nothing(tmp_path, nights, klpipe_runs, spawn):
    first = night_holding_the_state(klpipe_runs, nights["night1"], tmp_path)
    log = tmp_path / "nightly.out"
    began = time.monotonic()
    job = nightly_job(spawn, tmp_path, nights["night2"], log, WAIT=1)
    assert job.wait(timeout=60) == 75, log.read_text()
    assert time.monotonic() - began >= 1
    text = log.read_text()
    assert "still holds this state after 1 s (--wait-for-state); nothing was written: rerun later" in text
    assert "requeueing job 5150" in text
    assert slurm_calls(tmp_path / "slurm.log") == ["scontrol requeue 5150"]
    assert not (tmp_path / "scored" / "night2").exists() and not (tmp_path / "kl_state.json").exists()
    first.go()
    assert first.wait().returncode == 0
    # Slurm runs the requeued job again, now that the state is free: night 2 continues from night 1.
    again = nightly_job(spawn, tmp_path, nights["night2"], log, SLURM_RESTART_COUNT=1)
    assert again.wait(timeout=120) == 0, log.read_text()
    state = json.loads((tmp_path / "kl_state.json").read_text())
    assert state["last_run"]["controller_batches"] == 20 and state["last_run"]["last_step"] == 19
