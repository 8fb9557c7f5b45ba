"""Agent trajectories as trainers store them, in `klpipe precompute`: a completion that interleaves the
model's turns with tool results, a mask that says which tokens the policy sampled, and TRL's
conversational messages with tool calls rendered with the tools the policy saw."""

import copy
import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import save_file
from transformers import AutoTokenizer

from klpipe.errors import InputError, ModelError, ProvenanceError
from klpipe.model import ModelSpec, ReferenceModel
from klpipe.precompute import PrecomputeConfig, precompute
from klpipe.precompute.chat import ChatError, ChatRenderer, ChatRendering
from klpipe.precompute.logprobs import ForwardStats, chunk_logprobs
from klpipe.score import ScoreConfig, score
from tests.helpers import SAMPLE, TINY_GEMMA, TINY_LLAMA, oracle_logprobs, run_cli

TOLERANCE = 1e-4
TOOL_IDS = SAMPLE / "tool_calls.parquet"  # TRL's prompt_ids, completion_ids, tool_mask
TOOL_CHAT = SAMPLE / "tool_calls_conversational.parquet"  # the same trajectories as TRL's messages
TOOL_TEMPLATE = SAMPLE / "tool_chat_template.jinja"  # the template their trainer used: turns end with <eos>
IDS_COLUMNS = {"response_ids": "completion_ids"}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather now.", "parameters": CITY}}]


@pytest.fixture(scope="module", params=["gemma4", "llama"])
def reference(request):
    path = {"gemma4": TINY_GEMMA, "llama": TINY_LLAMA}[request.param]
    return ReferenceModel.load(ModelSpec(str(path), dtype="float32", device="cpu"))


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny Gemma's tokenizer with the tool rows' template (what --chat-template gives it)."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_GEMMA)
    tokenizer.chat_template = TOOL_TEMPLATE.read_text(encoding="utf-8")
    return tokenizer


def run(tmp_path, inputs, model=TINY_GEMMA, name="out.parquet", **kwargs):
    config = PrecomputeConfig(inputs=[Path(p) for p in inputs], output=tmp_path / name, model=str(model),
                              device="cpu", progress="none", **kwargs)
    return precompute(config, log=lambda message: None)


def masked_rows(vocab: int, seed: int = 0):
    """Agent rows with masks: a shared system prompt, tool results inside completions (mask 0 runs at the start,
    middle and end), a row masked whole, a row with no mask 0, and empty and 1-token responses."""
    rng = np.random.default_rng(seed)

    def tokens(n):
        return rng.integers(0, vocab, n)

    system = tokens(30)
    rows, masks = [], []
    shapes = [[1] * 4 + [0] * 9 + [1] * 5, [1] * 3 + [0] * 6, [0] * 5 + [1] * 7, [0] * 12, [1] * 10, [1], [0], [],
              [1, 0, 1, 0, 1, 1, 0, 0, 1]]
    for k, shape in enumerate(shapes):
        prompt = np.concatenate([system, tokens(3 + k % 3)])
        for _ in range(2):  # a group of two per shape
            rows.append((prompt, tokens(len(shape))))
            masks.append(np.array(shape, dtype=bool))
    return rows, masks


@pytest.mark.parametrize("sharing", ["off", "on", "auto"])
def test_mask_1_positions_match_the_oracle_and_mask_0_get_no_head(reference, sharing, monkeypatch):
    rows, masks = masked_rows(reference.vocab_size)
    heads = []
    original = reference.head.logprobs

    def counting(hidden, targets, *args, **kwargs):
        heads.append(len(targets))
        return original(hidden, targets, *args, **kwargs)

    monkeypatch.setattr(reference.head, "logprobs", counting)
    results = chunk_logprobs(reference, rows, 64, 1.0, sharing, ForwardStats(), max_cache_tokens=200, needed=masks)
    monkeypatch.undo()
    worst = 0.0
    for (prompt, response), mask, values in zip(rows, masks, results, strict=True):
        expected = oracle_logprobs(reference.model, prompt, response)
        assert values.dtype == np.float32 and values.shape == expected.shape
        assert np.isnan(values[~mask]).all()  # no logprob where the policy did not sample
        if mask.any():
            worst = max(worst, float(np.max(np.abs(values[mask] - expected[mask]))))
    assert worst <= TOLERANCE
    # The head ran on the policy's tokens alone (the load-time probes ran before the count began).
    assert sum(heads) == sum(int(m.sum()) for m in masks)


def test_a_row_masked_whole_or_after_its_last_1_feeds_nothing_it_does_not_need(reference):
    rows, masks = masked_rows(reference.vocab_size)
    unmasked = ForwardStats()
    chunk_logprobs(reference, rows, 64, 1.0, "off", unmasked)
    masked = ForwardStats()
    chunk_logprobs(reference, rows, 64, 1.0, "off", masked, needed=masks)
    # per row: prompt + response less its last token unmasked; up to the last needed token masked
    expected = 0
    for (prompt, _), mask in zip(rows, masks, strict=True):
        ones = np.flatnonzero(mask)
        expected += len(prompt) + int(ones[-1]) if len(ones) else 0
    assert masked.fed_tokens == expected < unmasked.fed_tokens


@pytest.mark.parametrize("sharing", ["off", "auto"])
def test_the_sample_tool_rows_through_precompute_match_the_oracle_with_nulls_where_masked(tmp_path, reference,
                                                                                          sharing):
    model_dir = TINY_GEMMA if reference.model.config.model_type.startswith("gemma") else TINY_LLAMA
    summary = run(tmp_path, [TOOL_IDS], model=model_dir, columns=IDS_COLUMNS, prefix_sharing=sharing, chunk_rows=12)
    table = pq.read_table(summary.output)
    worst = 0.0
    for row in table.to_pylist():
        mask = np.array(row["tool_mask"], dtype=bool)
        values = row["ref_logprobs"]
        assert [v is None for v in values] == (~mask).tolist()  # null is what the cache holds at a 0
        if mask.any():
            expected = oracle_logprobs(reference.model, row["prompt_ids"], row["completion_ids"])
            got = np.array([v for v in values if v is not None], dtype=np.float32)
            worst = max(worst, float(np.max(np.abs(got - expected[mask]))))
    assert worst <= TOLERANCE
    assert summary.tokens == sum(int(sum(m)) for m in table.column("tool_mask").to_pylist())


def test_score_of_the_sample_tool_rows_is_the_masked_mean_and_far_from_the_unmasked(tmp_path):
    cached = run(tmp_path, [TOOL_IDS], columns=IDS_COLUMNS).output
    result = score(ScoreConfig(inputs=[cached], output=tmp_path / "scored.parquet"))
    rows = pq.read_table(tmp_path / "scored.parquet").to_pylist()
    masked = []
    for row in rows:
        pairs = list(zip(row["policy_logprobs"], row["ref_logprobs"], row["tool_mask"], strict=True))
        own = [p - r for p, r, m in pairs if m]
        masked.append(max(sum(own) / len(own), 0.0) if own else 0.0)
        assert row["kl"] == pytest.approx(masked[-1], rel=1e-9, abs=1e-12), row["id"]
    assert result.report["summary"]["rows_without_tokens"] == 1  # the row TRL masked whole
    # What the placeholders cost when no mask is read: the reference's logprobs at a tool's tokens are
    # needed for that, so they come from an unmasked run.
    plain = pq.read_table(TOOL_IDS).rename_columns(["id", "step", "group_id", "prompt_ids", "completion_ids",
                                                    "not_a_mask", "policy_logprobs", "reward"])
    pq.write_table(plain, tmp_path / "plain.parquet")
    unmasked_cache = run(tmp_path, [tmp_path / "plain.parquet"], name="plain.cached.parquet", columns=IDS_COLUMNS)
    result = score(ScoreConfig(inputs=[unmasked_cache.output], output=tmp_path / "plain.scored.parquet"))
    assert result.report["summary"]["masked_tokens"] == 0
    assert result.report["summary"]["kl/mean"] > 5 * max(np.mean(masked), 0.1)


# -- conversational rows with tool calls ------------------------------------------------------------


def sample_chat_rows():
    return pq.read_table(TOOL_CHAT).to_pylist()


def test_rendering_and_mask_are_the_trainers_loop_by_the_templates_layout(tokenizer):
    rows = sample_chat_rows()
    renderer = ChatRenderer(tokenizer, "prompt", "completion")
    prompt_lists, response_lists, masks = renderer.render([r["prompt"] for r in rows], [r["completion"] for r in rows],
                                                          [r["tools"] for r in rows])
    for row, prompt_ids, response_ids, mask in zip(rows, prompt_lists, response_lists, masks, strict=True):
        tools = json.loads(row["tools"])
        assert prompt_ids == tokenizer.apply_chat_template(row["prompt"], tools=tools, add_generation_prompt=True,
                                                           tokenize=True, return_dict=True)["input_ids"]
        # By the template's own layout: each sampled turn up to and including its stop token (<eos>) is 1; what
        # TRL's loop appends after it (the rest of the turn's line, the tool's turn, the next header) is 0; nothing
        # follows the last <eos>. tests/precompute/test_trl_tool_loop.py holds this to TRL's own loop.
        call, result, answer = row["completion"]
        spans = np.split(np.array(response_ids), np.flatnonzero(np.diff(mask.astype(int))) + 1)
        assert [tokenizer.decode(s) for s in spans] == [
            call["content"].strip() + f'<tool_call>{{"name": "{call["tool_calls"][0]["function"]["name"]}", '
                                      f'"arguments": {call["tool_calls"][0]["function"]["arguments"]}}}</tool_call>'
                                      "<eos>",
            f"\n<start_of_turn>tool\n{result['content']}<eos>\n<start_of_turn>model\n",
            answer["content"].strip() + "<eos>"]
        assert mask[0] and not mask[len(spans[0])] and mask[-1]


def test_messages_and_ids_of_one_trajectory_give_one_cache(tmp_path):
    chat = run(tmp_path, [TOOL_CHAT], name="chat.parquet", chat_template=TOOL_TEMPLATE.read_text())
    ids = run(tmp_path, [TOOL_IDS], name="ids.parquet", columns=IDS_COLUMNS)
    from_chat, from_ids = pq.read_table(chat.output).to_pylist(), pq.read_table(ids.output).to_pylist()
    for a, b in zip(from_chat[:-1], from_ids[:-1], strict=True):  # the ids file's last row is masked whole
        assert a["prompt_ids"] == b["prompt_ids"] and a["response_ids"] == b["completion_ids"]
        assert a["mask"] == b["tool_mask"]
        np.testing.assert_allclose(np.array(a["ref_logprobs"], dtype=float), np.array(b["ref_logprobs"], dtype=float),
                                   atol=TOLERANCE, rtol=0)


def test_tools_from_a_file_and_template_options_reach_the_template(tmp_path, tokenizer):
    rows = sample_chat_rows()[:4]
    thinking = copy.deepcopy(tokenizer)
    thinking.chat_template = tokenizer.chat_template.replace(
        "{{- '<start_of_turn>model\\n' -}}", "{{- '<start_of_turn>model\\n' + ('' if enable_thinking is false else "
                                              "'<think>') -}}")
    assert thinking.chat_template != tokenizer.chat_template
    renderer = ChatRenderer(thinking, "prompt", "completion",
                            rendering=ChatRendering(tools=TOOLS, template_kwargs={"enable_thinking": False}))
    prompt_lists, _, _ = renderer.render([r["prompt"] for r in rows], [r["completion"] for r in rows])
    for row, prompt_ids in zip(rows, prompt_lists, strict=True):
        expected = thinking.apply_chat_template(row["prompt"], tools=TOOLS, add_generation_prompt=True,
                                                enable_thinking=False, tokenize=True, return_dict=True)["input_ids"]
        assert prompt_ids == expected
        assert "<think>" not in thinking.decode(prompt_ids) and '"name":"weather"' in thinking.decode(prompt_ids)


def test_the_tools_and_template_options_are_part_of_the_cache_identity(tmp_path):
    table = pq.read_table(TOOL_CHAT).drop_columns(["tools"])
    pq.write_table(table, tmp_path / "chat.parquet")
    template = TOOL_TEMPLATE.read_text()
    first = run(tmp_path, [tmp_path / "chat.parquet"], tools=TOOLS, chat_template=template)
    provenance = json.loads(pq.read_schema(first.output).metadata[b"klpipe"])
    assert provenance["tools"] and provenance["chat_template_kwargs"] == {}
    assert provenance["chat_template"] == hashlib.sha256(template.encode()).hexdigest()
    other = [dict(TOOLS[0], function=dict(TOOLS[0]["function"], description="Weather later."))]
    with pytest.raises(Exception, match=r"the --tools list changed") as excinfo:
        run(tmp_path, [tmp_path / "chat.parquet"], tools=other, chat_template=template)
    assert isinstance(excinfo.value, (ProvenanceError, InputError)) or "different run" in str(excinfo.value)
    with pytest.raises(Exception, match=r"chat_template_kwargs \{\} → \{'enable_thinking': False\}"):
        run(tmp_path, [tmp_path / "chat.parquet"], tools=TOOLS, chat_template_kwargs={"enable_thinking": False},
            chat_template=template)
    # Another template is another tokenizer fingerprint and another --chat-template.
    with pytest.raises(Exception, match=r"the tokenizer changed .*; the --chat-template changed"):
        run(tmp_path, [tmp_path / "chat.parquet"], tools=TOOLS, chat_template=template.replace("Tools:", "Tools -"))


def test_tools_given_as_a_list_column_render_like_their_json(tmp_path, tokenizer):
    rows = sample_chat_rows()[:3]
    as_list = [dict(r, tools=json.loads(r["tools"])) for r in rows]
    renderer = ChatRenderer(tokenizer, "prompt", "completion")
    from_json = renderer.render(*([r[k] for r in rows] for k in ("prompt", "completion", "tools")))
    # Through Arrow a list of schemas becomes structs whose missing keys read back as None: dropped again.
    back = pa.Table.from_pylist(as_list).to_pylist()
    from_list = renderer.render(*([r[k] for r in back] for k in ("prompt", "completion", "tools")))
    assert from_json[0] == from_list[0] and from_json[1] == from_list[1]


# -- bad input: one line naming the file and row, exit 2, before the model loads -----------------------


def broken_model(tmp_path) -> Path:
    """A copy of the tiny Gemma whose weights are readable but are not the model's, so it fails to load: an error
    about them means the rows were not checked first."""
    model = tmp_path / "broken-model"
    shutil.copytree(TINY_GEMMA, model)
    save_file({"not.the.model": np.zeros(2, dtype=np.float32)}, str(model / "model.safetensors"))
    return model


def cli_fails(tmp_path, path, *extra) -> str:
    if path == TOOL_CHAT:  # the template its trainer used
        extra = ("--chat-template", TOOL_TEMPLATE, *extra)
    result = run_cli("precompute", "-m", broken_model(tmp_path), path, "-o", tmp_path / "out.parquet", *extra)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "out.parquet").exists()
    return result.stderr.strip()


def with_row(table: pa.Table, index: int, column: str, value) -> pa.Table:
    values = table.column(column).to_pylist()
    values[index] = value
    kind = table.schema.field(column).type
    return table.set_column(table.column_names.index(column), pa.field(column, kind), pa.array(values, kind))


@pytest.mark.parametrize("value, problem", [
    ([1, 0], "tool_mask has 2 values but completion_ids has {n} tokens; the mask needs one value per response token"),
    ("two", ("tool_mask holds 2; a mask holds 1 where the policy sampled the token and 0 where it did not (a tool's "
             "result)")),
])
def test_a_bad_mask_row_is_one_line_before_the_model_loads(tmp_path, value, problem):
    table = pq.read_table(TOOL_IDS)
    n = len(table.column("completion_ids")[30].as_py())
    if value == "two":
        value = [1] * (n - 1) + [2]
    pq.write_table(with_row(table, 30, "tool_mask", value), tmp_path / "bad.parquet")
    message = cli_fails(tmp_path, tmp_path / "bad.parquet", "--column", "response_ids=completion_ids")
    assert message == f"Error: {tmp_path / 'bad.parquet'}: row 30 (id 'tool3-g6'): {problem.format(n=n)}"


def test_a_mask_that_is_not_a_list_is_one_line(tmp_path):
    table = pq.read_table(TOOL_IDS)
    table = table.set_column(5, "tool_mask", pa.array(["".join(map(str, m)) for m in table["tool_mask"].to_pylist()]))
    pq.write_table(table, tmp_path / "bad.parquet")
    message = cli_fails(tmp_path, tmp_path / "bad.parquet", "--column", "response_ids=completion_ids")
    assert message == (f"Error: {tmp_path / 'bad.parquet'}: column tool_mask (the mask) must be a list of 0/1 per "
                       "response token, found string")


def test_a_mask_column_that_disagrees_with_the_roles_is_one_line(tmp_path):
    ids = pq.read_table(TOOL_IDS).column("tool_mask").to_pylist()
    table = pq.read_table(TOOL_CHAT).append_column("tool_mask", pa.array(ids, pa.list_(pa.int8())))
    pq.write_table(table, tmp_path / "chat.parquet")  # the last row's mask was zeroed: it differs
    message = cli_fails(tmp_path, tmp_path / "chat.parquet", "--chat-template", TOOL_TEMPLATE)
    assert message.startswith(f"Error: {tmp_path / 'chat.parquet'}: row 31 (id 'tool3-g7'): tool_mask differs from "
                              "the mask the conversation's roles give (response token 0: 0 in tool_mask, 1 from the "
                              "roles")


def test_a_tool_message_that_answers_no_call_is_one_line(tmp_path):
    table = pq.read_table(TOOL_CHAT)
    prompts = table.column("prompt").to_pylist()
    prompts[2] = prompts[2] + [{"role": "tool", "content": "12 C", "name": "weather", "tool_calls": None}]
    table = table.set_column(table.column_names.index("prompt"), table.schema.field("prompt"),
                             pa.array(prompts, table.schema.field("prompt").type))
    pq.write_table(table, tmp_path / "bad.parquet")
    message = cli_fails(tmp_path, tmp_path / "bad.parquet", "--chat-template", TOOL_TEMPLATE)
    assert message == (f"Error: {tmp_path / 'bad.parquet'}: row 2 (id 'tool0-g2'): a tool message answers no tool "
                       "call: it must follow an assistant message with tool_calls, or another tool message")


def test_a_template_that_cannot_render_the_tools_is_one_line(tmp_path, tokenizer):
    blind = copy.deepcopy(tokenizer)
    blind.chat_template = tokenizer.chat_template.replace("{%- if tools -%}", "{%- if false -%}")
    rows = sample_chat_rows()[:1]
    with pytest.raises(ChatError, match="the chat template renders nothing of the tools it is given"):
        ChatRenderer(blind, "prompt", "completion").render([rows[0]["prompt"]], [rows[0]["completion"]],
                                                           [rows[0]["tools"]])
    model = tmp_path / "blind"
    shutil.copytree(TINY_LLAMA, model)
    (model / "chat_template.jinja").write_text(blind.chat_template)
    result = run_cli("precompute", "-m", model, TOOL_CHAT, "-o", tmp_path / "out.parquet")
    assert result.returncode == 2 and result.stderr.strip() == (
        f"Error: {TOOL_CHAT}: row 0 (id 'tool0-g0'): the chat template renders nothing of the tools it is given, so "
        "the reference would not see the tool schemas the policy saw; use the policy's chat template")


@pytest.mark.parametrize("extra, message", [
    (["--tools", "{tools}"], ("{chat}: has a tools column and --tools was given; each says which tools a row saw: "
                              "drop one")),
    (["--chat-template-kwargs", "[1]"], ("--chat-template-kwargs: must be a JSON object, e.g. "
                                         "'{{\"enable_thinking\": false}}', not '[1]'")),
    (["--chat-template-kwargs", '{{"tools": []}}'], ("--chat-template-kwargs: tools is set by klpipe itself, as TRL "
                                                     "sets it; leave it out")),
    (["--tools", "{missing}"], "--tools {missing}: cannot read it (No such file or directory)"),
])
def test_bad_tool_options_are_one_line(tmp_path, extra, message):
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    names = {"tools": tmp_path / "tools.json", "missing": tmp_path / "none.json", "chat": TOOL_CHAT}
    extra = [e.format(**names) for e in extra]
    assert cli_fails(tmp_path, TOOL_CHAT, *extra) == "Error: " + message.format(**names)


def test_tools_for_rows_that_are_not_conversational_are_refused(tmp_path):
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    message = cli_fails(tmp_path, TOOL_IDS, "--column", "response_ids=completion_ids",
                        "--tools", tmp_path / "tools.json")
    assert message == (f"Error: --tools apply to conversational rows (prompt and completion as chat messages), which "
                       f"{TOOL_IDS} does not hold")


def test_without_the_trainers_template_a_turn_that_renders_no_stop_token_is_refused(tmp_path):
    # The tiny Gemma's own template ends a turn with `<end_of_turn>`, which its tokenizer holds as several tokens:
    # no stop token the policy could have stopped on, so the row is refused and the line says what to pass.
    with pytest.raises(InputError) as excinfo:
        run(tmp_path, [TOOL_CHAT], model=broken_model(tmp_path))
    assert str(excinfo.value) == (
        f"{TOOL_CHAT}: row 0 (id 'tool0-g0'): an assistant turn of the completion renders no stop token (the "
        "tokenizer's EOS or the model's generation_config.eos_token_id: '<eos>'), so the token the policy stopped on "
        "is not in the messages; give prompt_ids, response_ids and the mask (TRL's completion_ids and tool_mask) "
        "instead")
    assert not (tmp_path / "out.parquet").exists()


def damaged_weights(tmp_path, damage: str) -> Path:
    model = tmp_path / "model"
    shutil.copytree(TINY_GEMMA, model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    header = int.from_bytes(data[:8], "little")
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "corrupt":
        data = data[:8] + b"\xff" * 16 + data[24:]
    else:  # a dtype safetensors does not know, in place of one it does
        data = data[: 8 + header].replace(b'"F32"', b'"F31"', 1) + data[8 + header:]
    weights.write_bytes(data)
    return model


def rows_with_a_bad_mask(tmp_path) -> Path:
    path = tmp_path / "bad.parquet"  # a row error would show the rows were read before the weights
    pq.write_table(with_row(pq.read_table(TOOL_IDS), 0, "tool_mask", [1, 0]), path)
    return path


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "dtype"])
def test_weights_that_cannot_be_read_are_named_before_any_row(tmp_path, damage):
    model = damaged_weights(tmp_path, damage)
    with pytest.raises(ModelError, match=rf"^{re.escape(str(model / 'model.safetensors'))}: cannot read the weights "
                                         r"\(.+\)$"):
        run(tmp_path, [rows_with_a_bad_mask(tmp_path)], model=model, columns=IDS_COLUMNS)
    assert not (tmp_path / "out.parquet").exists()


def test_weights_that_cannot_be_read_are_one_line_and_exit_2(tmp_path):
    model = damaged_weights(tmp_path, "corrupt")
    result = run_cli("precompute", "-m", model, rows_with_a_bad_mask(tmp_path), "-o", tmp_path / "out.parquet",
                     "--column", "response_ids=completion_ids")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"Error: {model / 'model.safetensors'}: cannot read the weights (")
