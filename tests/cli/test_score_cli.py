import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
from typer.testing import CliRunner

from klpipe.cache import ID, POLICY_LOGPROBS, REF_LOGPROBS, REWARD, STEP
from klpipe.cli import app
from tests.helpers import (
    CACHE_SCHEMA,
    EXACT_SCHEMA,
    ROOT,
    RUN_KLPIPE,
    block_imports,
    exact_provenance,
    make_rows,
    provenance,
    run_cli,
    run_python,
    with_exact_columns,
    write_cache,
)

runner = CliRunner()


def invoke(*args, env=None):
    return runner.invoke(app, ["score", *map(str, args)], env=env)


def test_help_has_examples_and_every_option():
    result = invoke("--help", env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert (
        "klpipe score cached.parquet --output scored.parquet --report report.json --state kl_state.json"
        in result.stdout
    )
    for option in (
        "--output",
        "--report",
        "--state",
        "--plot",
        "--per-token",
        "--reset-state",
        "--estimator",
        "--aggregate",
        "--no-clamp",
        "--controller",
        "--no-adaptive",
        "--kl-coeff",
        "--kl-target",
        "--kl-coeff-min",
        "--kl-coeff-max",
        "--window",
        "--increase-factor",
        "--decrease-factor",
        "--horizon",
        "--column",
    ):
        assert option in result.stdout
    assert "KLPIPE_SCORE_KL_TARGET" in result.stdout


def test_success_keeps_stdout_empty_and_prints_the_table_to_stderr(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", make_rows(12))
    result = invoke(cache, "--output", tmp_path / "out.parquet", "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""
    assert "KL controller per step" in result.stderr and "12 rows in 3 controller batches" in result.stderr
    assert pq.read_table(tmp_path / "out.parquet").num_rows == 12


def test_options_map_onto_the_config(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", make_rows(12))
    result = invoke(
        cache,
        "-o",
        tmp_path / "out.parquet",
        "--report",
        tmp_path / "r.json",
        "--estimator",
        "k2",
        "--aggregate",
        "sum",
        "--no-clamp",
        "--controller",
        "proportional",
        "--no-adaptive",
        "--kl-coeff",
        "0.2",
        "--kl-target",
        "1.5",
        "--kl-coeff-min",
        "0.05",
        "--kl-coeff-max",
        "0.9",
        "--window",
        "4",
        "--increase-factor",
        "2",
        "--decrease-factor",
        "0.5",
        "--horizon",
        "77",
        "--per-token",
    )
    assert result.exit_code == 0, result.stderr
    config = json.loads((tmp_path / "r.json").read_text())["config"]
    assert (config["estimator"], config["aggregate"], config["clamp"], config["per_token"]) == (
        "k2",
        "sum",
        False,
        True,
    )
    assert config["controller"] == {
        "kl_coeff": 0.2,
        "kl_target": 1.5,
        "adaptive": False,
        "kl_coeff_min": 0.05,
        "kl_coeff_max": 0.9,
        "window": 4,
        "increase_factor": 2.0,
        "decrease_factor": 0.5,
        "controller": "proportional",
        "horizon": 77,
    }


def test_every_option_reads_its_environment_variable(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", make_rows(12))
    env = {
        "KLPIPE_SCORE_OUTPUT": str(tmp_path / "env.parquet"),
        "KLPIPE_SCORE_REPORT": str(tmp_path / "r.json"),
        "KLPIPE_SCORE_KL_TARGET": "2.5",
        "KLPIPE_SCORE_ESTIMATOR": "abs",
        "KLPIPE_SCORE_CLAMP": "false",
        "KLPIPE_SCORE_ADAPTIVE": "0",
        "KLPIPE_SCORE_WINDOW": "3",
        "KLPIPE_SCORE_PER_TOKEN": "1",
        "KLPIPE_KL_TARGET": "9",
    }  # precompute's prefix must not leak into score
    result = invoke(cache, env=env)
    assert result.exit_code == 0, result.stderr
    config = json.loads((tmp_path / "r.json").read_text())["config"]
    assert config["controller"]["kl_target"] == 2.5 and config["controller"]["window"] == 3
    assert (config["estimator"], config["clamp"], config["per_token"], config["controller"]["adaptive"]) == (
        "abs",
        False,
        True,
        False,
    )
    assert (tmp_path / "env.parquet").exists()


def test_day_one_then_day_two_through_the_cli_equals_one_run(tmp_path):
    rows = make_rows(64, rows_per_step=4)
    write_cache(tmp_path / "day1.parquet", rows[:28])
    write_cache(tmp_path / "day2.parquet", rows[28:])
    write_cache(tmp_path / "all.parquet", rows)
    control = ["--kl-target", "0.6", "--window", "6"]
    for day in ("day1", "day2"):
        result = invoke(tmp_path / f"{day}.parquet", "--state", tmp_path / "state.json", *control)
        assert result.exit_code == 0, result.stderr
    result = invoke(tmp_path / "all.parquet", "--state", tmp_path / "all.json", *control)
    assert result.exit_code == 0, result.stderr

    split = (
        pq.read_table(tmp_path / "day1.scored.parquet").to_pylist()
        + pq.read_table(tmp_path / "day2.scored.parquet").to_pylist()
    )
    assert split == pq.read_table(tmp_path / "all.scored.parquet").to_pylist()
    assert len({r["kl_coeff"] for r in split}) > 3
    split_state = json.loads((tmp_path / "state.json").read_text())
    whole_state = json.loads((tmp_path / "all.json").read_text())
    split_state.pop("last_run"), whole_state.pop("last_run")
    assert split_state == whole_state


def _bad_caches(tmp_path):
    """(arguments, expected stderr line) for each kind of bad input."""
    rows = make_rows(6)
    no_ref = write_cache(
        tmp_path / "rollouts.parquet", rows, schema=pa.schema([f for f in CACHE_SCHEMA if f.name != REF_LOGPROBS])
    )
    mismatch_rows = make_rows(6)
    mismatch_rows[4][REF_LOGPROBS] = mismatch_rows[4][REF_LOGPROBS] + [-1.0]
    mismatch = write_cache(tmp_path / "mismatch.parquet", mismatch_rows)
    nan_rows = make_rows(6)
    nan_rows[2][POLICY_LOGPROBS], nan_rows[2][REF_LOGPROBS] = [-1.0, float("nan")], [-1.0, -1.0]
    nan = write_cache(tmp_path / "nan.parquet", nan_rows)
    one = write_cache(tmp_path / "one.parquet", rows, provenance=provenance())
    two = write_cache(tmp_path / "two.parquet", rows, provenance=provenance(tokenizer="sha-2"))
    p, r = len(mismatch_rows[4][POLICY_LOGPROBS]), len(mismatch_rows[4][REF_LOGPROBS])
    return [
        (
            [no_ref],
            (f"Error: {no_ref}: no ref_logprobs column; "
             "run `klpipe precompute` on it first to add the reference logprobs"),
        ),
        (
            [mismatch],
            (f"Error: {mismatch}: row 4 (id 'r4'): policy_logprobs has {p} tokens but ref_logprobs has {r}; "
             "both must cover the same response tokens (rerun `klpipe precompute` with the policy's tokenization)"),
        ),
        ([nan], f"Error: {nan}: row 2 (id 'r2'): policy_logprobs holds NaN"),
        (
            [one, two],
            (f"Error: caches disagree on tokenizer: {one} has 'sha-1', {two} has 'sha-2'; "
             "score caches made with one reference model and settings at a time"),
        ),
    ]


def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path):
    for inputs, line in _bad_caches(tmp_path):
        before = sorted(p.name for p in tmp_path.iterdir())
        result = invoke(
            *inputs,
            "--output",
            tmp_path / "out.parquet",
            "--report",
            tmp_path / "r.json",
            "--state",
            tmp_path / "s.json",
            "--plot",
            tmp_path / "p.png",
        )
        assert result.exit_code == 2
        assert result.stderr == line + "\n"
        assert result.stdout == ""
        assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_bad_option_values_are_usage_errors(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", make_rows(3))
    result = invoke(cache, "--estimator", "k9")
    assert result.exit_code == 2 and "'k9' is not one of 'k1', 'abs', 'k2', 'k3', 'full'" in result.stderr
    result = invoke(cache, "--kl-coeff-min", "0.5", "--kl-coeff-max", "0.2")
    assert result.exit_code == 2 and result.stderr == "Error: kl_coeff_min 0.5 is above kl_coeff_max 0.2\n"


def test_full_without_the_exact_kl_is_one_line_naming_precompute_policy(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", make_rows(6), provenance=provenance())
    before = sorted(p.name for p in tmp_path.iterdir())
    result = invoke(cache, "--estimator", "full", "--output", tmp_path / "out.parquet", "--report", tmp_path / "r.json")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == (f"Error: {cache}: --estimator full reads the exact per-token KL (kl_policy_ref), and this "
                             "cache has no kl_policy_ref or kl_ref_policy or policy_entropy or ref_entropy column; "
                             "`klpipe precompute --policy MODEL` computes it\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_full_prints_the_exact_kl_beside_the_sampled_estimators(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", with_exact_columns(make_rows(12)), schema=EXACT_SCHEMA,
                        provenance=exact_provenance())
    result = invoke(cache, "--estimator", "full", "--output", tmp_path / "out.parquet", "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.stderr
    run = json.loads((tmp_path / "r.json").read_text())["exact"]["run"]
    assert (f"exact KL per sampled token ({run['tokens']:,} tokens): KL(π‖π_ref) {run['exact_kl']:.4g} against k1 "
            f"{run['k1_kl']:.4g} (spread {run['k1_spread']:.4g}) and k3 {run['k3_kl']:.4g}") in result.stderr


def test_state_mismatch_message_and_reset(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", make_rows(6))
    state = tmp_path / "s.json"
    assert invoke(cache, "--state", state).exit_code == 0
    result = invoke(cache, "--state", state, "--controller", "proportional", "-o", tmp_path / "b.parquet")
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {state}: state was made with the window controller and kl_target 3.0, this run uses the proportional "
        "controller and kl_target 3.0; pass --reset-state to start a fresh controller\n"
    )
    assert not (tmp_path / "b.parquet").exists()
    assert invoke(cache, "--state", state, "--controller", "proportional", "--reset-state").exit_code == 0


def test_plot_is_a_png(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", make_rows(20))
    result = invoke(cache, "--plot", tmp_path / "report.png")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_warnings_go_to_stderr(tmp_path):
    rows = make_rows(4)
    rows[0][ID], rows[0][POLICY_LOGPROBS], rows[0][REF_LOGPROBS] = "odd", [-40.0], [-1.0]
    cache = write_cache(tmp_path / "a.parquet", rows)
    result = invoke(cache, env={"COLUMNS": "400"})
    assert result.exit_code == 0 and result.stdout == ""
    warning = f"Warning: 1 row(s) have a token with |policy − ref| above 20 nats: {cache}: row 0 (id 'odd')."
    assert warning in result.stderr


# -- column mapping ---------------------------------------------------------------------------------

SCORED = ["kl", "kl_coeff", "kl_penalty", "adjusted_reward"]
# A dump with every role under another name, and a `reward` column that is not the reward.
DUMP_SCHEMA = pa.schema([("uid", pa.string()), ("global_step", pa.int64()), ("old_log_probs", pa.list_(pa.float32())),
                         ("ref", pa.list_(pa.float32())), ("reward", pa.float64()), ("score", pa.float64())])
DUMP_COLUMNS = "id=uid step=global_step policy_logprobs=old_log_probs ref_logprobs=ref reward=score"


def dump_rows(rows):
    return [{"uid": r[ID], "global_step": r[STEP], "old_log_probs": r[POLICY_LOGPROBS], "ref": r[REF_LOGPROBS],
             "reward": 99.0, "score": r[REWARD]} for r in rows]


def test_column_mapping_keeps_the_users_names(tmp_path):
    rows = make_rows(40)
    plain = write_cache(tmp_path / "plain.parquet", rows)
    dump = write_cache(tmp_path / "dump.parquet", dump_rows(rows), schema=DUMP_SCHEMA)
    control = ["--kl-target", "0.6", "--window", "6"]
    assert invoke(plain, "-o", tmp_path / "plain.out.parquet", *control).exit_code == 0
    expected = pq.read_table(tmp_path / "plain.out.parquet")

    from_env = invoke(dump, "-o", tmp_path / "env.parquet", "--report", tmp_path / "r.json", *control,
                      env={"KLPIPE_SCORE_COLUMN": DUMP_COLUMNS})
    options = [arg for spec in DUMP_COLUMNS.split() for arg in ("--column", spec)]
    from_options = invoke(dump, "-o", tmp_path / "options.parquet", *options, *control)
    assert from_env.exit_code == 0 and from_options.exit_code == 0, from_env.stderr + from_options.stderr
    for out in (tmp_path / "env.parquet", tmp_path / "options.parquet"):
        table = pq.read_table(out)
        assert table.column_names == DUMP_SCHEMA.names + SCORED
        for column in SCORED:
            assert table.column(column).equals(expected.column(column))
        assert set(table.column("reward").to_pylist()) == {99.0}  # passed through, not used
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["config"]["columns"] == dict(spec.split("=") for spec in DUMP_COLUMNS.split())
    assert [s["step"] for s in report["steps"]] == list(range(10))  # `global_step` made the controller batches


def test_column_mapping_errors_name_the_users_columns(tmp_path):
    rows = make_rows(6)
    rows[2][POLICY_LOGPROBS], rows[2][REF_LOGPROBS] = [-1.0, float("nan")], [-1.0, -1.0]
    dump = write_cache(tmp_path / "dump.parquet", dump_rows(rows), schema=DUMP_SCHEMA)
    result = invoke(dump, env={"KLPIPE_SCORE_COLUMN": DUMP_COLUMNS})
    assert result.exit_code == 2
    assert result.stderr == f"Error: {dump}: row 2 (id 'r2'): old_log_probs holds NaN\n"
    result = invoke(dump, "--column", "reward=scores", env={"KLPIPE_SCORE_COLUMN": DUMP_COLUMNS})
    assert result.exit_code == 2  # the options replace the variable, they do not add to it
    assert result.stderr == (f"Error: {dump}: --column reward=scores: no column 'scores'; "
                             "found uid, global_step, old_log_probs, ref, reward, score\n")
    result = invoke(dump)
    assert result.exit_code == 2
    assert result.stderr == (f"Error: {dump}: no policy_logprobs or ref_logprobs column; "
                             "run `klpipe precompute` on it first to add the reference logprobs\n")
    result = invoke(dump, "--column", "logprobs=old_log_probs")
    assert result.exit_code == 2 and result.stderr.startswith("Error: --column logprobs=old_log_probs: unknown role")
    assert not (tmp_path / "dump.scored.parquet").exists()


# -- β = 0 and no lower clamp -----------------------------------------------------------------------

ZERO_WARNING = ("Warning: the KL coefficient is 0: KL is measured and reported but not penalised, "
                "and the {} controller keeps a coefficient of 0 at 0")


def test_kl_coeff_zero_writes_kl_reports_and_no_penalty(tmp_path):
    rows = make_rows(40)
    cache = write_cache(tmp_path / "a.parquet", rows)
    control = ["--kl-target", "0.6", "--window", "6"]
    assert invoke(cache, "-o", tmp_path / "beta.parquet", "--report", tmp_path / "beta.json", *control).exit_code == 0
    for kind in ("window", "proportional"):
        result = invoke(cache, "-o", tmp_path / f"{kind}.parquet", "--report", tmp_path / f"{kind}.json",
                        "--kl-coeff", "0", "--controller", kind, "--state", tmp_path / f"{kind}.state.json", *control,
                        env={"COLUMNS": "400"})
        assert result.exit_code == 0, result.stderr
        assert result.stderr.count("Warning:") == 1
        assert ZERO_WARNING.format(kind) + "\n" in result.stderr
        scored = pq.read_table(tmp_path / f"{kind}.parquet")
        # The KL is what a penalised run measures; the penalty is 0 and the reward untouched.
        assert scored.column("kl").equals(pq.read_table(tmp_path / "beta.parquet").column("kl"))
        assert set(scored.column("kl_coeff").to_pylist()) == {0.0}
        assert set(scored.column("kl_penalty").to_pylist()) == {0.0}
        assert scored.column("adjusted_reward").to_pylist() == [r[REWARD] for r in rows]
        report = json.loads((tmp_path / f"{kind}.json").read_text())
        with_penalty = json.loads((tmp_path / "beta.json").read_text())
        assert report["summary"]["kl/mean"] == with_penalty["summary"]["kl/mean"] > 0
        assert report["summary"]["kl_coeff_after"] == 0 and report["summary"]["kl/adaptation_count"] == 0
        assert [s["kl_coeff_after"] for s in report["steps"]] == [0.0] * 10
        assert report["warnings"] == [ZERO_WARNING.format(kind).removeprefix("Warning: ")]
        assert json.loads((tmp_path / f"{kind}.state.json").read_text())["kl_coeff"] == 0.0
    fixed = invoke(cache, "-o", tmp_path / "fixed.parquet", "--kl-coeff", "0", "--no-adaptive")
    assert fixed.exit_code == 0 and "Warning" not in fixed.stderr


def test_kl_coeff_min_zero_is_no_lower_clamp_and_negatives_are_refused(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", make_rows(40))
    # The sample KLs sit far below 0.5 × target 100: every window decision decreases the coefficient.
    low = ["--kl-target", "100", "--window", "1", "--decrease-factor", "0.5", "--report"]
    unclamped = invoke(cache, "-o", tmp_path / "min0.parquet", "--kl-coeff-min", "0", *low, tmp_path / "min0.json")
    assert unclamped.exit_code == 0
    assert invoke(cache, "-o", tmp_path / "min.parquet", *low, tmp_path / "min.json").exit_code == 0
    unclamped = json.loads((tmp_path / "min0.json").read_text())["summary"]["kl_coeff_after"]
    clamped = json.loads((tmp_path / "min.json").read_text())["summary"]["kl_coeff_after"]
    assert clamped == 0.01 and 0 < unclamped < 1e-3
    for option, message in (("--kl-coeff", "kl_coeff must be a non-negative number, got -0.1"),
                            ("--kl-coeff-min", "kl_coeff_min must be a non-negative number, got -0.1")):
        result = invoke(cache, "-o", tmp_path / "bad.parquet", option, "-0.1")
        assert result.exit_code == 2 and result.stderr == f"Error: {message}\n"
        assert not (tmp_path / "bad.parquet").exists()


# -- no torch on the scoring path -------------------------------------------------------------------

def test_importing_the_cli_and_score_does_not_import_torch():
    result = run_python(
        "import sys, klpipe.cli, klpipe.score.run, klpipe.score.report, klpipe.api\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'datasets', 'matplotlib') if m in sys.modules)\n"
        "assert not heavy, heavy"
    )
    assert result.returncode == 0, result.stderr


def test_klpipe_score_runs_where_torch_cannot_be_imported(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", make_rows(8))
    out = tmp_path / "out.parquet"
    code = block_imports("torch", "transformers", "datasets") + RUN_KLPIPE
    result = run_python(code, "score", str(cache), "--output", str(out), "--report", str(tmp_path / "r.json"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert pq.read_table(out).column(REWARD).to_pylist() == [r[REWARD] for r in make_rows(8)]


def test_a_scoring_run_does_not_import_pandas(tmp_path):
    # pyarrow's to_numpy() and pa.array(ndarray) import pandas, ~170 ms of start-up; klpipe.arrow avoids them.
    cache = write_cache(tmp_path / "a.parquet", make_rows(8))
    code = (
        "import sys\nfrom pathlib import Path\nfrom klpipe.score import ScoreConfig, score\n"
        "score(ScoreConfig(inputs=[Path(sys.argv[1])], per_token=True))\n"
        "assert 'pandas' not in sys.modules"
    )
    result = run_python(code, str(cache))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "a.scored.parquet").exists()


def test_a_log_file_gets_whole_lines(tmp_path):
    # Under Slurm stderr is a file: no line of the table or the summary may be cut at 80 columns.
    cache = write_cache(tmp_path / "a.parquet", make_rows(12))
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    with open(tmp_path / "log", "w") as log:
        subprocess.run([sys.executable, "-m", "klpipe", "score", str(cache), "-o", str(tmp_path / "out.parquet")],
                       stderr=log, env=env, check=True, cwd=ROOT)
    lines = (tmp_path / "log").read_text().splitlines()
    header = next(line for line in lines if line.lstrip().startswith("step"))
    assert "→ reward" in header
    summary = next(line for line in lines if line.startswith("12 rows in 3 controller batches"))
    assert "adaptations in all" in summary and "negative k1 in" in summary


# -- outputs never land on inputs -------------------------------------------------------------------


def test_no_output_option_may_name_an_input_or_another_output(tmp_path):
    # `--report X` with X a cache exited 0 and replaced the cache with a report.
    cache = write_cache(tmp_path / "a.parquet", make_rows(8))
    original = cache.read_bytes()
    for option in ("--report", "--state", "--plot", "--metrics-jsonl", "--tensorboard"):
        result = invoke(cache, "-o", tmp_path / "out.parquet", option, cache)
        assert result.exit_code == 2, result.stderr
        assert result.stderr == f"Error: {cache}: is also an input; pass another {option}\n"
        assert cache.read_bytes() == original and not (tmp_path / "out.parquet").exists()
    result = invoke(cache, "-o", tmp_path / "out.parquet", "--report", tmp_path / "x.json",
                    "--state", tmp_path / "x.json")
    assert result.exit_code == 2
    assert result.stderr == (f"Error: {tmp_path / 'x.json'}: named by both --report and --state; "
                             "each output needs its own path\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.parquet"]


def test_an_output_written_into_an_input_directory_is_not_scored_again(tmp_path):
    caches = tmp_path / "caches"
    caches.mkdir()
    write_cache(caches / "day1.parquet", make_rows(12, seed=1))
    write_cache(caches / "day2.parquet", make_rows(12, seed=2))
    first = invoke(caches, "-o", caches / "scored.parquet", "--report", caches / "report.json")
    assert first.exit_code == 0, first.stderr
    scored = pq.read_table(caches / "scored.parquet")
    assert scored.num_rows == 24
    again = invoke(caches, "-o", caches / "scored.parquet", "--report", caches / "report.json")
    assert again.exit_code == 0, again.stderr
    assert (f"skipped 1 file(s) that klpipe score wrote into an input directory, so they are not scored again: "
            f"{caches / 'scored.parquet'}") in " ".join(again.stderr.split())
    assert pq.read_table(caches / "scored.parquet").equals(scored)  # 24 rows, not 24 + 24
    assert json.loads((caches / "report.json").read_text())["summary"]["rows"] == 24


def test_progress_means_what_it_means_for_precompute(tmp_path):
    """--progress and --log-interval, as precompute takes them: log lines without a terminal, none with none."""
    day1 = write_cache(tmp_path / "day1.parquet", make_rows(12, seed=1))
    day2 = write_cache(tmp_path / "day2.parquet", make_rows(20, seed=2))
    args = ["score", str(day1), str(day2), "-o", str(tmp_path / "out.parquet"), "--log-interval", "0"]
    logged = run_cli(*args)  # a process whose stderr is no terminal: auto is log lines
    assert logged.returncode == 0, logged.stderr
    lines = [line for line in logged.stderr.splitlines() if line.startswith("progress: ")]
    # One line per record batch read: here one per file.
    assert [line.split(",")[0] for line in lines] == ["progress: 12/32 rows (37.5%)", "progress: 32/32 rows (100.0%)"]
    assert "row/s" not in logged.stderr  # no bar
    quiet = run_cli(*args, "--progress", "none")
    assert quiet.returncode == 0 and "progress: " not in quiet.stderr
    drawn = run_cli(*args, "--progress", "bar")
    assert drawn.returncode == 0 and "| 32/32 [" in drawn.stderr and "row/s" in drawn.stderr  # tqdm's bar
    for command in (["score", str(day1)], ["precompute", "-m", "some/model", str(day1)]):
        refused = run_cli(*command, "--progress", "fancy")
        assert (refused.returncode, refused.stderr) == (2, ("Error: --progress must be auto, bar, log or none, "
                                                            "not 'fancy'\n"))


def test_a_negative_wait_for_the_state_is_refused(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", make_rows(8))
    result = invoke(cache, "--state", tmp_path / "s.json", "--wait-for-state", "-1")
    assert result.exit_code == 2
    assert result.stderr == "Error: --wait-for-state must be 0 or more seconds, not -1.0\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.parquet"]


def test_a_run_with_a_state_leaves_no_lock_file_behind(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", make_rows(8))
    for _ in range(2):  # the second run takes the lock again and continues the first's state
        result = invoke(cache, "-o", tmp_path / "out.parquet", "--state", tmp_path / "s.json")
        assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.parquet", "out.parquet", "s.json"]
    assert json.loads((tmp_path / "s.json").read_text())["last_run"]["controller_batches"] == 4  # 2 × 8 rows / 4
