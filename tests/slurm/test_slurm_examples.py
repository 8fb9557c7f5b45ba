"""examples/submit.sh and examples/score-nightly.sbatch under a real Slurm: a one-node cluster on
127.0.0.1 (cluster.py), real klpipe, the tiny sample model. `make test-slurm` runs this directory; `make test`
does not collect it.

Each test submits examples/submit.sh from a fresh directory as a user would, then waits for Slurm to
run the precompute array and the score job queued behind it. The examples ask for a GPU node
(--gres=gpu:1, 8 CPUs, 64G per task); the test node is this machine, with a few CPUs and no GPU, so
the tests pass submit.sh the site options it forwards to both sbatch calls: --cpus-per-task=1
--mem=1G --gres=none.

Job states, exit codes, restarts, dependency reasons and start/end times come from `scontrol show
job` (the controller keeps finished jobs for MinJobAge, 300 s); the failed task's record also from
`sacct --completion`, which reads the job completion log (the cluster has no slurmdbd, so plain
sacct has nothing). What each task did comes from its log, which Slurm writes under logs/.
Results are compared with one process over the same rollouts with the same --chunk-rows.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from klpipe.precompute import PrecomputeConfig, precompute
from klpipe.score import ScoreConfig, score
from tests.fault_runner import Runner
from tests.helpers import ROLLOUTS, TINY_LLAMA, two_days
from tests.slurm.cluster import Cluster
from tests.test_examples import (
    CHUNK_ROWS,
    EXAMPLES,
    VENV_BIN,
    concatenated_parts,
    controller_state,
    night_args,
    night_holding_the_state,
    one_torch_thread,
    without_metadata,
)

SITE_OPTIONS = ["--cpus-per-task=1", "--mem=1G", "--gres=none"]


def job_env(slurm: Cluster, tmp_path: Path, **settings) -> dict:
    """What the user's shell exports to sbatch: klpipe's environment on PATH ahead of the system's
    (where the real Slurm commands are), the examples' settings, and nothing inherited that could
    shard a run or change its settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KLPIPE_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({
        "PATH": os.pathsep.join([str(VENV_BIN), os.environ["PATH"]]),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",  # two tasks share the node's two CPUs
        "KLPIPE_CHUNK_ROWS": str(CHUNK_ROWS),
        # Every row through the prefix tree, which must reproduce one process bit for bit as well.
        "KLPIPE_PREFIX_SHARING": "on",
        "KLPIPE_MODEL": str(TINY_LLAMA),
        "CACHE_DIR": str(tmp_path / "cached"),
        "SCORE_DIR": str(tmp_path / "scored"),
        "KL_STATE": str(tmp_path / "kl_state.json"),
    })
    env.update({k: str(v) for k, v in settings.items()})
    return slurm.env(env)


def submit(cwd: Path, env: dict, array: str) -> tuple[str, str]:
    """examples/submit.sh with ARRAY and the site options: (precompute array job id, score job id)."""
    result = subprocess.run(["bash", str(EXAMPLES / "submit.sh"), *SITE_OPTIONS], cwd=cwd,
                            env={**env, "ARRAY": array}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    array_job = re.fullmatch(r"precompute array: job (\d+)", first)
    score_job = re.fullmatch(r"Submitted batch job (\d+)", second)
    assert array_job and score_job, result.stdout
    return array_job[1], score_job[1]


def queued(slurm: Cluster, *jobs: str) -> str:
    """squeue's lines for these jobs (an array id stands for all its tasks); empty once all have ended."""
    return slurm.run("squeue", "--noheader", "--format=%i %T %r", f"--jobs={','.join(jobs)}").stdout.strip()


def wait_until_done(slurm: Cluster, *jobs: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while queue := queued(slurm, *jobs):
        assert time.monotonic() < deadline, f"still queued after {timeout:.0f} s:\n{queue}"
        time.sleep(0.5)


def job_records(slurm: Cluster, job: str) -> list[dict]:
    """`scontrol show job`, one dict per job record (an array job id gives one per task)."""
    out = slurm.run("scontrol", "show", "job", "--oneliner", job).stdout
    return [dict(field.split("=", 1) for field in line.split() if "=" in field) for line in out.splitlines()]


def array_tasks(slurm: Cluster, array_job: str) -> dict[int, dict]:
    return {int(r["ArrayTaskId"]): r for r in job_records(slurm, array_job)}


def when(record: dict, field: str) -> datetime:
    return datetime.fromisoformat(record[field])


def task_log(cwd: Path, array_job: str, task: int) -> str:
    return (cwd / "logs" / f"klpipe-precompute-{array_job}_{task}.out").read_text()


def reference(rollouts: Path, directory: Path, **settings) -> Path:
    """One process over all the rollouts, then scored: what the cluster's jobs must reproduce."""
    directory.mkdir()
    with one_torch_thread():
        precompute(PrecomputeConfig(inputs=[rollouts], output=directory / "cached.parquet", model=str(TINY_LLAMA),
                                    device="cpu", progress="none", prefix_sharing="on", **settings),
                   log=lambda m: None)
    score(ScoreConfig(inputs=[directory / "cached.parquet"], output=directory / "scored.parquet",
                      report=directory / "report.json", state=directory / "kl_state.json"))
    return directory


def assert_same_results(tmp_path: Path, expected: Path, shards: int) -> None:
    """The parts concatenate bit for bit to the single run (each part's metadata records its shard),
    and the score job's output and controller state equal scoring that run."""
    assert concatenated_parts(tmp_path / "cached", shards).equals(
        without_metadata(pq.read_table(expected / "cached.parquet")))
    scored = pq.read_table(tmp_path / "scored" / "scored.parquet")
    assert without_metadata(scored).equals(without_metadata(pq.read_table(expected / "scored.parquet")))
    assert controller_state(tmp_path / "kl_state.json") == controller_state(expected / "kl_state.json")


def test_submit_runs_every_shard_then_the_score_job(slurm, tmp_path):
    env = job_env(slurm, tmp_path, ROLLOUTS=ROLLOUTS)
    array_job, score_job = submit(tmp_path, env, array="0-2")
    wait_until_done(slurm, array_job, score_job)

    tasks = array_tasks(slurm, array_job)
    assert sorted(tasks) == [0, 1, 2]
    for index, task in tasks.items():
        log = task_log(tmp_path, array_job, index)
        assert (task["JobState"], task["ExitCode"], task["Restarts"]) == ("COMPLETED", "0:0", "0"), log
        assert f"klpipe-array: task {index} (count 3) on " in log  # Slurm's array variables reached the script
        # ... and klpipe, in its job step: it wrote its own part, 16 of the 48 rows.
        assert re.search(rf"^wrote \S+/part-{index:05d}-of-00003\.parquet: 16 rows, ", log, re.MULTILINE), log
    [follow] = job_records(slurm, score_job)
    assert (follow["JobState"], follow["ExitCode"]) == ("COMPLETED", "0:0")
    # afterok: the score job became eligible, and started, only once the last task had ended.
    last_end = max(when(task, "EndTime") for task in tasks.values())
    assert when(follow, "EligibleTime") >= last_end and when(follow, "StartTime") >= last_end, (follow, tasks)

    assert_same_results(tmp_path, reference(ROLLOUTS, tmp_path / "single", chunk_rows=CHUNK_ROWS), shards=3)


def long_rollouts(path: Path, copies: int) -> Path:
    table = pa.concat_tables([pq.read_table(ROLLOUTS)] * copies)
    pq.write_table(table.set_column(0, "id", pa.array([f"r{i}" for i in range(table.num_rows)])), path)
    return path


def wait_for_first_chunk(slurm: Cluster, cwd: Path, array_job: str, task: int) -> None:
    """A chunk in the task's work directory: klpipe is scoring, its signal handlers installed."""
    work = cwd / "cached" / f"part-{task:05d}-of-00002.parquet.partial"
    deadline = time.monotonic() + 300
    while not list(work.glob("chunk-*.parquet")):
        assert queued(slurm, f"{array_job}_{task}"), \
            f"task {task} ended before its first chunk:\n" + task_log(cwd, array_job, task)
        assert time.monotonic() < deadline, f"task {task} wrote no chunk in 300 s"
        time.sleep(0.05)


def assert_lines_in_order(log: str, patterns: list[str]) -> None:
    lines, at = log.splitlines(), 0
    for pattern in patterns:
        found = [i for i, line in enumerate(lines) if i >= at and re.fullmatch(pattern, line)]
        assert found, f"no line matching {pattern!r} after line {at} of:\n{log}"
        at = found[0] + 1


def test_array_tasks_stopped_mid_run_are_requeued_and_resume(slurm, tmp_path):
    """Both ways Slurm stops a task early, for real, one task each:
    - task 1: the time-limit warning (--signal=B:USR1@300), USR1 to the batch shell alone. The script
      passes it to klpipe through srun; klpipe exits 75 after its current batch; the script requeues;
    - task 0: a requeue by Slurm (`scontrol requeue`, what preemption with PreemptMode=REQUEUE
      does): TERM to every process of the job; klpipe stops after its current batch, keeping its
      chunks, and the script leaves the requeueing to Slurm.
    Slurm starts each task again, klpipe resumes from its chunks, and the score job waits for both."""
    # 3840 rows, one per forward pass, in chunks of 16: each task has 120 chunks, seconds of work
    # left after its first chunk is on disk, which is when the signals go.
    rollouts = long_rollouts(tmp_path / "rollouts.parquet", copies=80)
    env = job_env(slurm, tmp_path, ROLLOUTS=rollouts, KLPIPE_CHUNK_ROWS=16, KLPIPE_MAX_TOKENS_PER_BATCH=1)
    array_job, score_job = submit(tmp_path, env, array="0-1")
    wait_for_first_chunk(slurm, tmp_path, array_job, 1)
    slurm.run("scancel", "--signal=USR1", "--batch", f"{array_job}_1")
    wait_for_first_chunk(slurm, tmp_path, array_job, 0)
    slurm.run("scontrol", "requeue", f"{array_job}_0")
    wait_until_done(slurm, array_job, score_job)

    # Each task's runs append to one log (--open-mode=append).
    def runs(task: int, stopped: list[str]) -> list[str]:
        return [rf"klpipe-array: task {task} \(count 2\) on \S+, restart 0", *stopped,
                rf"klpipe-array: task {task} \(count 2\) on \S+, restart 1",
                rf"resuming: \d+ of 120 chunks already done in \S+/part-0000{task}-of-00002\.parquet\.partial"]

    warned = task_log(tmp_path, array_job, 1)
    assert_lines_in_order(warned, runs(1, [
        r"klpipe-array: USR1 \(time limit near\): klpipe stops after its current batch",
        r"received SIGUSR1: stopping after the current batch \(send it again to exit at once\)",
        r"Error: stopped by SIGUSR1; finished chunks are saved, rerun the same command to resume",
        r"srun: error: \S+: task 0: Exited with exit code 75",
        (rf"klpipe-array: klpipe exited 75 \(stopped early, finished chunks kept\); requeueing {array_job}_1 "
         r"to finish this shard"),
    ]))
    # Slurm is ending this one: srun may be gone before it can report klpipe's exit code, and the
    # batch shell killed before its last words, so the log's word is klpipe's own.
    requeued = task_log(tmp_path, array_job, 0)
    assert_lines_in_order(requeued, runs(0, [
        r"received SIGTERM: stopping after the current batch \(send it again to exit at once\)",
        r"Error: stopped by SIGTERM; finished chunks are saved, rerun the same command to resume",
    ]))
    # One TERM reached klpipe (srun did not add a second, which would stop it at once), and the
    # script left the requeueing to Slurm.
    assert "received SIGTERM again" not in requeued and "requeueing" not in requeued, requeued
    for log in (warned, requeued):
        resumed = int(re.search(r"resuming: (\d+) of 120", log)[1])
        assert 1 <= resumed < 120, log  # stopped mid-run, and the rerun skipped what was done

    tasks = array_tasks(slurm, array_job)
    for task in tasks.values():
        assert (task["JobState"], task["ExitCode"], task["Restarts"]) == ("COMPLETED", "0:0", "1"), task
    [follow] = job_records(slurm, score_job)
    assert follow["JobState"] == "COMPLETED"
    # The requeues neither satisfied nor broke the dependency: scoring waited for both reruns.
    assert when(follow, "StartTime") >= max(when(task, "EndTime") for task in tasks.values())

    expected = reference(rollouts, tmp_path / "single", chunk_rows=16, max_tokens_per_batch=1)
    assert_same_results(tmp_path, expected, shards=2)


def test_a_failed_task_means_the_score_job_never_runs(slurm, tmp_path):
    """A bad row in shard 1 of 3: that task fails (exit 2), the others finish, and the score job is
    cancelled, never started, because its afterok dependency can no longer be met."""
    table = pq.read_table(ROLLOUTS)
    bad_row = 20  # 48 rows in chunks of 4: shard 1 of 3 holds rows 16-31
    ids = table.column("response_ids").to_pylist()
    ids[bad_row] = [5, 1_000_000]
    table = table.set_column(table.column_names.index("response_ids"), "response_ids",
                             pa.array(ids, table.schema.field("response_ids").type))
    rollouts = tmp_path / "rollouts.parquet"
    pq.write_table(table, rollouts)
    env = job_env(slurm, tmp_path, ROLLOUTS=rollouts)
    array_job, score_job = submit(tmp_path, env, array="0-2")
    wait_until_done(slurm, array_job, score_job)

    tasks = array_tasks(slurm, array_job)
    assert [(i, t["JobState"], t["ExitCode"]) for i, t in sorted(tasks.items())] == [
        (0, "COMPLETED", "0:0"), (1, "FAILED", "2:0"), (2, "COMPLETED", "0:0")]
    row_id = table.column("id")[bad_row].as_py()
    error = (f"Error: {rollouts}: row {bad_row} (id {row_id!r}): token id 1000000 in response_ids "
             "is outside the model's vocabulary (0..511)")
    assert error in task_log(tmp_path, array_job, 1).splitlines()

    [follow] = job_records(slurm, score_job)
    assert (follow["JobState"], follow["Reason"]) == ("CANCELLED", "DependencyNeverSatisfied"), follow
    assert follow["Dependency"] == f"afterok:{array_job}_*(failed)", follow
    assert not (tmp_path / "logs" / f"klpipe-score-{score_job}.out").exists()  # its log: made when a job starts
    assert not (tmp_path / "scored").exists() and not (tmp_path / "kl_state.json").exists()

    # The job completion log, through sacct, tells the same story: the task failed with klpipe's
    # exit code 2, and the score job was cancelled having run on no node. (sacct 22.05 names array
    # tasks by their own job ids here, and complains on stderr about the array fields it cannot read.)
    completions = slurm.run("sacct", "--completion", "--noheader", "--parsable2",
                            "--format=JobID,JobName,State,ExitCode,NNodes").stdout.splitlines()
    assert f"{tasks[1]['JobId']}|klpipe-precompute|FAILED|2:0|1" in completions, completions
    assert f"{score_job}|klpipe-score|CANCELLED|0:0|0" in completions, completions


def test_a_nightly_score_job_that_finds_the_state_held_is_requeued_by_slurm_and_continues_it(slurm, tmp_path):
    """examples/score-nightly.sbatch submitted while last night's klpipe score still holds the controller state,
    with a wait of 1 s: klpipe exits 75 having written nothing, the script asks Slurm to requeue the job, and Slurm
    runs it again; once last night's run has saved the state, the rerun continues from it. The two nights end as
    they would have one after the other."""
    night1, night2 = two_days(tmp_path, names=("night1", "night2"))
    serial = tmp_path / "serial"
    runs = Runner(tmp_path / "runs")
    try:
        for night in (night1, night2):
            assert runs.run(night_args(night, serial)).returncode == 0
        overlap = tmp_path / "overlap"
        (overlap / "logs").mkdir(parents=True)
        holder = night_holding_the_state(runs, night1, overlap)
        env = job_env(slurm, overlap, DAY="night2", CACHE=night2, SCORE_DIR=overlap / "scored" / "night2",
                      KL_STATE=overlap / "kl_state.json", WAIT=1)
        submitted = subprocess.run(["sbatch", "--parsable", *SITE_OPTIONS[:2], str(EXAMPLES / "score-nightly.sbatch")],
                                   cwd=overlap, env=env, capture_output=True, text=True, timeout=60)
        assert submitted.returncode == 0, submitted.stderr
        job = submitted.stdout.strip()
        log = overlap / "logs" / f"klpipe-score-nightly-{job}.out"
        deadline = time.monotonic() + 120
        while "requeueing job" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
            time.sleep(0.2)
        assert not (overlap / "scored" / "night2").exists()  # the refused night wrote nothing
        holder.go()
        assert holder.wait().returncode == 0
        wait_until_done(slurm, job)
    finally:
        runs.close()
    [record] = job_records(slurm, job)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), record
    assert int(record["Restarts"]) >= 1, record
    text = log.read_text()
    assert_lines_in_order(text, [
        r"klpipe-score-nightly: night2 on \S+, restart 0",
        r".*still holds this state after 1 s \(--wait-for-state\); nothing was written: rerun later.*",
        rf"klpipe-score-nightly: klpipe exited 75 \(the state is busy\); requeueing job {job}",
        r"klpipe-score-nightly: night2 on \S+, restart [1-9]\d*",
    ])
    for night in ("night1", "night2"):
        got = pq.read_table(overlap / "scored" / night / "scored.parquet")
        assert got.equals(pq.read_table(serial / "scored" / night / "scored.parquet"), check_metadata=True), night
    assert (overlap / "kl_state.json").read_bytes() == (serial / "kl_state.json").read_bytes()
