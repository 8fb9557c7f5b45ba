"""The column mapping: parsing `--column ROLE=NAME`, checking it, and what score inherits from a cache."""

import pyarrow as pa
import pytest

from klpipe.columns import ROLES, ColumnMap, for_caches, parse_columns
from klpipe.errors import InputError, ProvenanceError
from klpipe.options import COLUMN_HELP
from tests.helpers import make_rows, provenance, write_cache

ROLE_LIST = ("id, step, prompt, response, prompt_ids, response_ids, policy_logprobs, sampler_logprobs, reward, "
             "ref_logprobs, mask, tools")


def test_parse_gives_role_to_column():
    specs = ["response_ids=completion_ids", "policy_logprobs = old_log_probs", "reward=score", "reward=score"]
    assert parse_columns(specs) == {
        "response_ids": "completion_ids", "policy_logprobs": "old_log_probs", "reward": "score"}
    assert parse_columns(None) == {} and parse_columns([]) == {}


@pytest.mark.parametrize("specs,message", [
    (["reward"], "--column reward: expected ROLE=NAME, e.g. --column reward=score"),
    (["=score"], "--column =score: expected ROLE=NAME, e.g. --column reward=score"),
    (["reward="], "--column reward=: expected ROLE=NAME, e.g. --column reward=score"),
    (["rewards=score"], f"--column rewards=score: unknown role 'rewards'; roles are {ROLE_LIST}"),
    (["reward=a", "reward=b"], "--column reward=a and --column reward=b: one column per role"),
    (["prompt=text", "response=text"],
     "--column prompt=text and --column response=text: two roles cannot share one column"),
])
def test_bad_mappings_are_refused(specs, message):
    with pytest.raises(InputError) as excinfo:
        parse_columns(specs)
    assert str(excinfo.value) == message


def test_the_help_text_lists_every_role():
    # Written out in the CLI so `--help` does not import pyarrow; this keeps the two together.
    assert ", ".join(ROLES) == ROLE_LIST
    assert f"Roles: {ROLE_LIST}." in COLUMN_HELP


def test_names_defaults_and_the_completion_alias():
    schema = pa.schema([("prompt", pa.string()), ("completion", pa.string()), ("score", pa.float64())])
    columns = ColumnMap({"reward": "score"}).resolve(schema)
    assert columns.name("reward") == "score"
    assert columns.name("response") == "completion"  # TRL's name, used when there is no `response`
    assert columns.name("prompt") == "prompt" and columns.name("step") == "step"
    assert columns.given == {"reward": "score"}  # what a cache records: the user's mapping alone
    both = pa.schema([("response", pa.string()), ("completion", pa.string())])
    assert ColumnMap().resolve(both).name("response") == "response"
    mapped = ColumnMap({"response": "answer"}).resolve(schema)
    assert mapped.name("response") == "answer"


def test_a_mapping_to_a_missing_column_names_role_and_column(tmp_path):
    schema = pa.schema([("prompt_ids", pa.list_(pa.int32())), ("completion_ids", pa.list_(pa.int32()))])
    columns = ColumnMap({"response_ids": "completion_ids", "reward": "score"})
    with pytest.raises(InputError) as excinfo:
        columns.check_present(tmp_path / "in.parquet", schema)
    assert str(excinfo.value) == (f"{tmp_path / 'in.parquet'}: --column reward=score: no column 'score'; "
                                  "found prompt_ids, completion_ids")
    # A role the stage writes (precompute's ref_logprobs) need not exist yet.
    ColumnMap({"ref_logprobs": "ref_log_prob"}).check_present(tmp_path / "in.parquet", schema,
                                                                outputs=("ref_logprobs",))


def test_score_inherits_the_caches_mapping_and_the_command_line_wins(tmp_path):
    made = provenance(columns={"policy_logprobs": "old_log_probs", "reward": "score"})
    first = write_cache(tmp_path / "a.parquet", make_rows(2), provenance=made)
    second = write_cache(tmp_path / "b.parquet", make_rows(2), provenance=made)
    plain = write_cache(tmp_path / "c.parquet", make_rows(2))  # not made by klpipe: no mapping recorded
    columns = for_caches({}, [first, second])
    assert columns.name("policy_logprobs") == "old_log_probs" and columns.name("reward") == "score"
    columns = for_caches({"reward": "reward_v2"}, [first, second])
    assert columns.name("reward") == "reward_v2" and columns.name("policy_logprobs") == "old_log_probs"
    assert for_caches({"reward": "r"}, [plain]).given == {"reward": "r"}

    with pytest.raises(ProvenanceError) as excinfo:
        for_caches({}, [first, plain])
    assert str(excinfo.value) == (
        f"caches disagree on columns: {first} was made with --column policy_logprobs=old_log_probs "
        f"--column reward=score, {plain} with no --column; score caches made with one column mapping at a time"
    )


def test_leaf_index_counts_nested_columns_as_parquet_does(tmp_path):
    import pyarrow.parquet as pq

    from klpipe.storage.parquet import leaf_index

    table = pa.table({
        "a": [1],
        "s": pa.array([{"x": 1, "y": [2.0]}]),
        "m": pa.array([[("k", 1)]], type=pa.map_(pa.string(), pa.int64())),
        "l": pa.array([[[1.0]]], type=pa.list_(pa.list_(pa.float32()))),
        "old.log probs ✓": pa.array([[0.5]], type=pa.list_(pa.float32())),
    })
    pq.write_table(table, tmp_path / "t.parquet")
    leaves = pq.ParquetFile(tmp_path / "t.parquet").schema
    for name in table.column_names:
        # Parquet's own leaf paths start with the field's name (unambiguous here but for the dotted one).
        first = next(i for i in range(len(leaves)) if leaves.column(i).path.startswith(name))
        assert leaf_index(table.schema, name) == first, name
    assert leaf_index(table.schema, "old.log probs ✓") == 6  # a, s.x, s.y, m.key, m.value, l, then this


def test_columns_with_dots_spaces_and_unicode_in_both_stages(tmp_path):
    """`--column` takes any column name: a dotted one made `klpipe score` fail with 'unexpected RuntimeError'."""
    import pyarrow.parquet as pq

    from tests.helpers import ROLLOUTS, TINY_LLAMA, run_cli

    names = {"prompt_ids": "prompt ids ✓", "response_ids": "réponse.ids", "policy_logprobs": "old.log.probs",
             "reward": "my.reward", "step": "global.step", "ref_logprobs": "ref.logprobs"}
    table = pq.read_table(ROLLOUTS)
    pq.write_table(table.rename_columns([names.get(n, n) for n in table.column_names]), tmp_path / "dump.parquet")
    options = [arg for role, name in names.items() for arg in ("--column", f"{role}={name}")]
    made = run_cli("precompute", "-m", str(TINY_LLAMA), str(tmp_path / "dump.parquet"), "-o",
                   str(tmp_path / "cached.parquet"), "--progress", "none", *options)
    assert made.returncode == 0, made.stderr
    plain = run_cli("precompute", "-m", str(TINY_LLAMA), str(ROLLOUTS), "-o", str(tmp_path / "plain.parquet"),
                    "--progress", "none")
    assert plain.returncode == 0, plain.stderr
    cached = pq.read_table(tmp_path / "cached.parquet")
    assert cached.column("ref.logprobs").equals(pq.read_table(tmp_path / "plain.parquet").column("ref_logprobs"))
    plain_scored = run_cli("score", str(tmp_path / "plain.parquet"), "-o", str(tmp_path / "plain.scored.parquet"))
    assert plain_scored.returncode == 0, plain_scored.stderr
    theirs = pq.read_table(tmp_path / "plain.scored.parquet")
    for args in ([], options):  # the cache recorded the mapping; naming it again changes nothing
        scored = run_cli("score", str(tmp_path / "cached.parquet"), "-o", str(tmp_path / "scored.parquet"), *args)
        assert scored.returncode == 0, scored.stderr
        ours = pq.read_table(tmp_path / "scored.parquet")
        for column in ("kl", "kl_coeff", "kl_penalty", "adjusted_reward"):
            assert ours.column(column).equals(theirs.column(column)), column
