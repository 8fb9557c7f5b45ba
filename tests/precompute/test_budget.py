"""The memory budget (klpipe/precompute/budget.py): --max-memory, the process's cgroup (v1 and v2), the decision
to stream, and a budget too small even for streaming refused before anything runs, naming the smallest that works.

The process's own footprint is fixed by monkeypatch where a figure is asserted: it is the one input that moves
from run to run. The model's sizes come from the model loaded in memory, not from the code under test.
"""

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from klpipe import cache, process_memory
from klpipe.errors import InputError
from klpipe.precompute import budget
from klpipe.precompute.config import PrecomputeConfig
from klpipe.precompute.models import resolve
from klpipe.precompute.run import precompute
from tests.helpers import ROLLOUTS, TINY_GEMMA, TINY_GEMMA_MM, TINY_LLAMA, run_cli

MIB = 1 << 20
FOOTPRINT = 300 * MIB  # the process, as the tests fix it


@pytest.mark.parametrize("text, size", [
    ("32G", 32 << 30), ("32GiB", 32 << 30), ("32gb", 32 << 30), ("1.5G", 3 << 29), ("500M", 500 << 20),
    ("500MiB", 500 << 20), ("123456", 123456), ("2T", 2 << 40), ("64k", 64 << 10), (" 8 G ", 8 << 30)])
def test_sizes_read_as_the_option_takes_them(text, size):
    assert budget.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "0", "0G", "-1G", "1.5X", "12ib", "G"])
def test_a_size_that_is_not_one_is_refused(text):
    with pytest.raises(InputError) as caught:
        budget.parse_size(text)
    assert str(caught.value).startswith("--max-memory must be ")


def test_the_config_refuses_a_bad_max_memory():
    with pytest.raises(InputError) as caught:
        PrecomputeConfig(inputs=[ROLLOUTS], model=str(TINY_LLAMA), max_memory="plenty")
    assert str(caught.value) == "--max-memory must be a size such as 32G, 1.5GiB or 500M, not 'plenty'"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_v1_cgroup_limit_is_the_lowest_along_the_process_path(tmp_path):
    proc = tmp_path / "cgroup"
    write(proc, "12:cpuset:/\n11:memory:/slurm/uid_0/job_7\n0::/\n")
    root = tmp_path / "sys"
    write(root / "memory/memory.limit_in_bytes", "9223372036854771712\n")  # the root: no limit
    write(root / "memory/slurm/memory.limit_in_bytes", str(8 << 30))
    write(root / "memory/slurm/uid_0/job_7/memory.limit_in_bytes", str(3 << 30))
    assert budget.cgroup_limit(proc, root) == 3 << 30
    write(root / "memory/slurm/memory.limit_in_bytes", str(2 << 30))  # a parent lower than the job's own
    assert budget.cgroup_limit(proc, root) == 2 << 30


def test_a_v2_cgroup_limit_is_read_from_memory_max(tmp_path):
    proc = tmp_path / "cgroup"
    write(proc, "0::/system.slice/job.scope\n")
    root = tmp_path / "sys"
    write(root / "system.slice/job.scope/memory.max", "max\n")
    assert budget.cgroup_limit(proc, root) is None
    write(root / "system.slice/memory.max", "1610612736\n")
    assert budget.cgroup_limit(proc, root) == 1610612736
    assert budget.cgroup_limit(tmp_path / "missing", root) is None


def test_an_explicit_budget_wins_over_the_cgroup(monkeypatch):
    monkeypatch.setattr(budget, "cgroup_limit", lambda: 1 << 30)
    assert budget.find("3G").bytes == 3 << 30 and budget.find("3G").source == "--max-memory 3G"
    found = budget.find(None)
    assert found.bytes == 1 << 30 and found.source == "the memory cgroup's limit (1G)"


def test_weights_that_fit_stay_in_memory_and_others_stream():
    # footprint + growth + weights + activations against the budget; streaming needs two layers, not all.
    limit = budget.Budget(1000 * MIB, "--max-memory 1000M")
    growth = budget.GROWTH
    fits = 1000 * MIB - growth - 100 * MIB - 50 * MIB
    assert not budget.streams(limit, 100 * MIB, fits, 10 * MIB, MIB, 50 * MIB)
    assert budget.streams(limit, 100 * MIB, fits + 1, 10 * MIB, MIB, 50 * MIB)
    assert not budget.streams(None, 100 * MIB, 1 << 50, 10 * MIB, MIB, 50 * MIB)  # no budget known: as before


def test_a_budget_too_small_for_one_layer_says_the_smallest_that_works():
    limit = budget.Budget(600 * MIB, "--max-memory 600M")
    # 400 MiB of process (+128 growth), 20 MiB resident, two layers of 40 MiB, 100 MiB of activations: 728 MiB.
    with pytest.raises(InputError) as caught:
        budget.streams(limit, 400 * MIB - budget.GROWTH + 128 * MIB, 10 << 30, 20 * MIB, 40 * MIB, 100 * MIB)
    assert str(caught.value) == ("--max-memory 600M is too small for this model even streamed one layer at a time: it "
                                 "needs at least 728M (this process 528M, what stays loaded beside the layers 20M, "
                                 "two layers 80M, one pass's activations 100M)")


def untied(path) -> bool:
    """Whether the model's head has a weight of its own (its config says so): its input embeddings are then a table
    a streamed run reads row by row too."""
    import json

    config = json.loads((Path(path) / "config.json").read_text())
    text = config.get("text_config", config)
    return not text.get("tie_word_embeddings", config.get("tie_word_embeddings", True))


def sizes_in_memory(path) -> tuple[int, int, int]:
    """(weights, outside the layers and the tables read row by row (Gemma's per-layer embeddings, untied input
    embeddings), largest layer) of the model as transformers loads it in memory."""
    from klpipe.model import ModelSpec, ReferenceModel

    model = ReferenceModel.load(ModelSpec(str(path), dtype="float32", device="cpu")).model
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    layers = model.model.layers
    in_layers = {id(t) for t in [*layers.parameters(), *layers.buffers()]}
    if getattr(model.model, "embed_tokens_per_layer", None) is not None:
        in_layers.add(id(model.model.embed_tokens_per_layer.weight))
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:  # both read by rows
        in_layers |= {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    weights = sum(t.numel() * t.element_size() for t in tensors.values())
    resident = sum(t.numel() * t.element_size() for key, t in tensors.items() if key not in in_layers)
    largest = max(sum(t.numel() * t.element_size() for t in layer.state_dict().values()) for layer in layers)
    return weights, resident, largest


def activations(path, tokens: int, element: int = 4) -> int:
    """streamed_load.activation_bytes by hand, from the config: `element` bytes (fp32), 8 x hidden + 3 x intermediate
    + the per-layer inputs of every layer, twice (the inputs, and the rows of the per-layer table read for them), per
    token, the input embeddings' rows where they are read row by row (untied), the head's 64 MiB, and where the head
    is untied, two of its blocks."""
    import json

    config = json.loads((Path(path) / "config.json").read_text())
    text = config.get("text_config", config)
    per_layer = (text.get("hidden_size_per_layer_input") or 0) * text["num_hidden_layers"]
    inputs = text["hidden_size"] if untied(path) else 0
    # An untied head is read a block at a time: a block as read and as cast, each 32 MiB at most (or the whole head).
    head = 2 * min(32 * MIB, 4 * text["vocab_size"] * text["hidden_size"]) if untied(path) else 0
    return tokens * element * (8 * text["hidden_size"] + 3 * text["intermediate_size"] + 2 * per_layer
                               + inputs) + 64 * MIB + head


def table_bytes(path) -> tuple[int, int]:
    """(the tables, one row of each) at fp32, from the checkpoint's header: what a streamed run leaves in its file and
    reads row by row (Gemma's per-layer embeddings, and the input embeddings where the head is untied); a forward
    reads the same ids' rows of each."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as weights:
        names = [k for k in weights.keys() if "embed_tokens_per_layer" in k  # noqa: SIM118 - safe_open is no mapping
                 or (untied(path) and k.endswith("embed_tokens.weight"))]
        shapes = [weights.get_slice(name).get_shape() for name in names]
    return sum(4 * a * b for a, b in shapes), sum(4 * b for _, b in shapes)


def head_bytes(path) -> int:
    """An untied head's bytes in the checkpoint (a streamed run reads the whole of it for each forward's head, a block
    at a time), from its header; 0 where the head is tied."""
    from safetensors import safe_open

    if not untied(path):
        return 0
    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as weights:
        a, b = weights.get_slice("lm_head.weight").get_shape()
    return 4 * a * b


def rows_and_heads(extra: int, head: int, row: int, tokens: int) -> bool:
    """Whether `extra` bytes read are whole reads of the head (`head` bytes; at least one where the head streams) and
    rows of the tables (`row` bytes a token, one to `tokens` of them)."""
    return any((extra - h * head) % row == 0 and 0 < (extra - h * head) // row <= tokens
               for h in range(1 if head else 0, (extra // head if head else 0) + 1))


@pytest.mark.parametrize("path", [TINY_LLAMA, TINY_GEMMA, TINY_GEMMA_MM], ids=["llama", "gemma4", "gemma4-tied"])
def test_the_sizes_read_off_the_config_are_the_model_in_memorys(path):
    # Before anything loads, the budget's sizes come from the model built on meta: a tied head (the multimodal Gemma
    # 4's) is counted once, as it is once loaded; untied input embeddings are not kept (read row by row).
    from klpipe.model import ModelSpec, streamed_load

    weights, resident, largest = sizes_in_memory(path)
    sizes = streamed_load.measure(ModelSpec(str(path), dtype="float32", device="cpu"), 256)
    assert (sizes.weights, sizes.resident, sizes.largest_layer) == (weights, resident, largest)


def config_for(tmp_path, name="out.parquet", **options) -> PrecomputeConfig:
    return PrecomputeConfig(inputs=[ROLLOUTS], output=tmp_path / name, model=str(TINY_GEMMA), device="cpu",
                            progress="none", max_tokens_per_batch=256, **options)


def test_the_smallest_budget_is_named_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(process_memory, "resident", lambda: FOOTPRINT)
    weights, resident, largest = sizes_in_memory(TINY_GEMMA)
    smallest = FOOTPRINT + budget.GROWTH + resident + 2 * largest + activations(TINY_GEMMA, 256)
    config = config_for(tmp_path, max_memory=str(smallest - 1))
    with pytest.raises(InputError) as caught:
        precompute(config, log=lambda line: None)
    assert f"it needs at least {budget.fmt(smallest)} " in str(caught.value)
    assert not list(tmp_path.iterdir())  # nothing written: no output, no work directory
    # One byte more streams (the weights do not fit it); the model's weights more stay in memory.
    streamed = budget.decide(config_for(tmp_path, max_memory=str(smallest)), resolve(config), 256, lambda line: None)
    assert streamed is not None
    # Freed memory goes back to the kernel once the process holds more than the budget less one pass's widest.
    assert streamed.trim_above == smallest - activations(TINY_GEMMA, 256)
    in_memory = smallest - resident - 2 * largest + weights
    assert budget.decide(config_for(tmp_path, max_memory=str(in_memory)), resolve(config), 256,
                         lambda line: None) is None


@pytest.mark.parametrize("option, value, words", [
    ("compile", "on", "--compile on"),
    ("dtype", "float64", "--dtype float64")])
def test_what_does_not_stream_yet_is_refused_in_one_line(tmp_path, monkeypatch, option, value, words):
    monkeypatch.setattr(process_memory, "resident", lambda: FOOTPRINT)
    _weights, resident, largest = sizes_in_memory(TINY_GEMMA)
    element = 8 if value == "float64" else 4
    streams = str(FOOTPRINT + budget.GROWTH + (resident + 2 * largest) * element // 4
                  + activations(TINY_GEMMA, 256, element))
    config = config_for(tmp_path, max_memory=streams, **{option: value})
    with pytest.raises(InputError) as caught:
        budget.decide(config, resolve(config), 256, lambda line: None)
    assert str(caught.value).endswith(f"and streaming them does not run with {words} yet")
    assert "\n" not in str(caught.value)


def test_a_gpus_budget_is_its_free_memory_and_weights_beyond_it_stream_to_it(tmp_path, monkeypatch):
    """No GPU here: the device, what torch would say of its free memory and of what it has reserved, and the model's
    sizes (a 70B-like reference's proportions: measured sizes are held to the model in memory above) stand in; the
    host's budget is a cgroup's limit, fixed. What is held is the budget's arithmetic, worked by hand."""
    import klpipe.model
    from klpipe.model import runtime, streamed_load

    gib = 1 << 30
    sizes = streamed_load.Measure(weights=131 * gib, resident=1 * gib, largest_layer=gib * 8 // 5, activations=20 * gib,
                             kept_per_token=64 << 10)
    monkeypatch.setattr(streamed_load, "measure", lambda spec, tokens: streamed_load.Measure(**vars(sizes)))
    device_map = None
    monkeypatch.setattr(klpipe.model, "resolve_device", lambda device: ("cuda:0", device_map))
    asked = []
    monkeypatch.setattr(runtime, "device_free_bytes", lambda device: asked.append(device) or free)
    monkeypatch.setattr(runtime, "device_reserved_bytes", lambda device: 0)  # a fresh process holds nothing there
    monkeypatch.setattr(process_memory, "resident", lambda: FOOTPRINT)
    host = FOOTPRINT + budget.GROWTH + gib + 2 * budget.pinned_bytes(sizes.largest_layer)  # the host's smallest
    monkeypatch.setattr(budget, "cgroup_limit", lambda: host)
    config = config_for(tmp_path, prefix_sharing="off")
    # The weights alone decide, as before streaming ran on a GPU: they fit, in memory, whatever the activations.
    free = budget.GROWTH + 131 * gib
    assert budget.decide(config, resolve(config), 256, lambda line: None) is None
    # Beyond the device's free memory (an H100's 79 GiB, say), the layers stream to it, that memory the budget.
    free = 79 * gib
    lines = []
    streamed_run = budget.decide(config, resolve(config), 256, lines.append)
    assert lines[0].startswith(f"{TINY_GEMMA}: its weights (131G) do not fit cuda:0's free memory (79G): its decoder "
                               "layers stream from their files to cuda:0, one at a time, over up to ")
    # What the groups may hold: the device's memory less what stays, two layers and one pass.
    spare = 79 * gib - budget.GROWTH - gib - 2 * (gib * 8 // 5) - 20 * gib
    assert streamed_run.spare == spare and streamed_run.per_token == (64 << 10) + (16 << 20) // 256
    # Too small for two layers and one pass on the device: refused, naming the smallest.
    smallest = budget.GROWTH + gib + 2 * (gib * 8 // 5) + 20 * gib
    free = smallest - 1
    with pytest.raises(InputError) as caught:
        budget.decide(config, resolve(config), 256, lambda line: None)
    assert str(caught.value).startswith(f"cuda:0's free memory ({budget.fmt(free)}) is too small for this model even "
                                        f"streamed one layer at a time: it needs at least {budget.fmt(smallest)} ")
    # --max-memory is the device's budget, not the host's.
    free = 1 << 50
    at = budget.decide(config_for(tmp_path, max_memory=str(smallest), prefix_sharing="off"), resolve(config), 256,
                       lambda line: None)
    assert at is not None and at.spare == 0
    # A host that cannot stage two layers (pinned: rounded up to a power of two) is refused before anything loads.
    monkeypatch.setattr(budget, "cgroup_limit", lambda: host - 1)
    with pytest.raises(InputError) as caught:
        budget.decide(config_for(tmp_path, max_memory=str(smallest)), resolve(config), 256, lambda line: None)
    assert str(caught.value).startswith(f"the memory cgroup's limit ({budget.fmt(host - 1)}) is too small to stage "
                                        f"the layers streamed to cuda:0: it needs at least {budget.fmt(host)} ")
    assert "\n" not in str(caught.value)
    assert set(asked) == {"cuda:0"}
    # In memory on a GPU, the tree's cache takes at most half of what the weights leave (not the activations').
    monkeypatch.setattr(budget, "cgroup_limit", lambda: host)
    free = budget.GROWTH + 131 * gib + (4 << 30)
    lines.clear()
    sharing = config_for(tmp_path)
    capped = budget.decide(sharing, resolve(sharing), 256, lines.append, cache_mib=20 << 10)
    assert isinstance(capped, budget.InMemory) and capped.cache_mib == 2 << 10
    assert lines == [(f"{TINY_GEMMA}: the prefix tree keeps up to 2,048 MiB (--max-cache-mib 20,480): what cuda:0's "
                      f"free memory ({budget.fmt(free)}) leaves beside the weights, halved")]
    count = len(asked)
    device_map = "auto"  # spread over several GPUs by accelerate: not one device's memory to compare
    assert budget.decide(config, resolve(config), 256, lambda line: None) is None
    assert len(asked) == count


def test_what_a_budget_leaves_beside_weights_held_in_memory_caps_the_prefix_trees_cache(tmp_path, monkeypatch):
    """The tree's cache is not in the weights' sum: in memory, it takes at most half of what the budget leaves beside
    the weights and one pass, else a model that just fits a tight Slurm job is killed once the cache fills."""
    monkeypatch.setattr(process_memory, "resident", lambda: FOOTPRINT)
    weights, _, _ = sizes_in_memory(TINY_GEMMA)
    fits = FOOTPRINT + budget.GROWTH + weights + activations(TINY_GEMMA, 256)
    config = config_for(tmp_path, max_memory=str(fits + (200 << 20)))
    lines = []
    capped = budget.decide(config, resolve(config), 256, lines.append, cache_mib=2048)
    assert isinstance(capped, budget.InMemory) and capped.cache_mib == 100
    assert lines == [(f"{TINY_GEMMA}: the prefix tree keeps up to 100 MiB (--max-cache-mib 2,048): what --max-memory "
                      f"{fits + (200 << 20)} leaves beside the weights and one pass, halved")]
    # A cache within it, or no tree at all: in memory as before, nothing said.
    assert budget.decide(config, resolve(config), 256, lines.append, cache_mib=100) is None
    off = config_for(tmp_path, max_memory=str(fits + (200 << 20)), prefix_sharing="off")
    assert budget.decide(off, resolve(off), 256, lines.append, cache_mib=2048) is None
    assert len(lines) == 1
    # What the run does with it: the tree's planner is handed the cap.
    from klpipe.precompute import sharing
    from klpipe.precompute.run import precompute

    handed = []
    made = sharing.Sharing.__init__

    def noted(self, model, asked, max_cache_mib, log, sides=()):
        handed.append(max_cache_mib)
        made(self, model, asked, max_cache_mib, log, sides)
    monkeypatch.setattr(sharing.Sharing, "__init__", noted)
    config.max_cache_mib = 2048
    precompute(config, log=lambda line: None)
    assert handed == [100]


def test_pinned_buffers_are_sized_as_torchs_pinned_allocator_takes_them():
    # A layer's buffer has a block more than the layer, to align its direct read (model/tensor_files.py).
    assert [budget.pinned_bytes(n) for n in (0, 1, 4096, 4097, 12_288, 3 << 29)] == [4096, 8192, 8192, 16_384,
                                                                                     16_384, 1 << 31]
    from klpipe.model.tensor_files import BLOCK

    assert BLOCK == 4096


@pytest.mark.parametrize("sharing", ["off", "on"])
def test_a_run_over_budget_streams_to_the_in_memory_result(tmp_path, monkeypatch, sharing):
    monkeypatch.setattr(process_memory, "resident", lambda: FOOTPRINT)
    weights, resident, largest = sizes_in_memory(TINY_GEMMA)
    streams = FOOTPRINT + budget.GROWTH + resident + 2 * largest + activations(TINY_GEMMA, 256)
    assert streams < FOOTPRINT + budget.GROWTH + weights + activations(TINY_GEMMA, 256)
    lines = []
    # The tree's cache as small as the smallest budget leaves a streamed run (none), in both runs: the same plan.
    streamed = precompute(config_for(tmp_path, "streamed.parquet", max_memory=str(streams), prefix_sharing=sharing,
                                     max_cache_mib=0), log=lines.append)
    assert any("its decoder layers stream from their files" in line for line in lines), lines
    # Each group read every layer's tensors once, as the checkpoint stores them, and of the per-layer embedding table
    # and the (untied) input embeddings only rows (fp32 here), one of each per distinct token of a forward at most;
    # the (untied) head once per forward; nothing else.
    from safetensors import safe_open

    with safe_open(str(TINY_GEMMA / "model.safetensors"), framework="numpy") as weights:
        layer_bytes = sum(weights.get_tensor(key).nbytes for key in weights.keys() if ".layers." in key)  # noqa: SIM118 - safe_open is no mapping
    _, row = table_bytes(TINY_GEMMA)
    assert streamed.streamed["groups"] >= 1 and 0.0 <= streamed.streamed["hidden"] <= 1.0
    if sharing == "off":  # (on: the tree's probe reads the weights once per forward too, at the first chunk)
        extra = streamed.streamed["bytes_read"] - streamed.streamed["groups"] * layer_bytes
        assert rows_and_heads(extra, head_bytes(TINY_GEMMA), row, streamed.forward.padded_tokens)
    else:
        assert streamed.forward.tree_rows > 0  # the tree ran, streamed
    in_memory = precompute(config_for(tmp_path, "memory.parquet", prefix_sharing=sharing, max_cache_mib=0),
                           log=lambda line: None)
    got = pq.read_table(streamed.output).column(cache.REF_LOGPROBS).to_pylist()
    expected = pq.read_table(in_memory.output).column(cache.REF_LOGPROBS).to_pylist()
    assert len(got) == len(expected) == pq.read_metadata(ROLLOUTS).num_rows
    gap = max(float(np.max(np.abs(np.array(a) - np.array(b)))) for a, b in zip(got, expected, strict=True) if a)
    assert gap <= 1e-5


def test_the_streamer_is_given_the_room_the_budget_leaves_its_groups(tmp_path, monkeypatch):
    # What the budget leaves beyond the smallest streamed run is the groups' (the tree's cache off), and what a group
    # leaves of it keeps layers loaded (test_streaming: ..._keeps_the_first_layers_loaded_from_group_to_group). Here,
    # the room each group was handed: the budget's arithmetic by hand. The tiny model's layers are small beside a
    # group's 16 MiB a pass, so none can be kept in a budget it does not fit in memory.
    from klpipe.model import ModelSpec, streamed_load
    from klpipe.model.layer_major import LayerMajor

    monkeypatch.setattr(process_memory, "resident", lambda: FOOTPRINT)
    weights, resident, largest = sizes_in_memory(TINY_GEMMA)
    streams = FOOTPRINT + budget.GROWTH + resident + 2 * largest + activations(TINY_GEMMA, 256)
    extra = (weights - resident - 2 * largest) // 2  # half way to the run in memory
    measured = streamed_load.measure(ModelSpec(str(TINY_GEMMA), dtype="float32", device="cpu"), 256)
    seen, run = [], LayerMajor.run

    def noted(self, calls, between=lambda: None, tokens: int = 0):
        seen.append((self.spare, self.per_token))
        return run(self, calls, between, tokens)

    monkeypatch.setattr(LayerMajor, "run", noted)
    got = precompute(config_for(tmp_path, max_memory=str(streams + extra), prefix_sharing="off"),
                     log=lambda line: None)
    assert got.streamed["groups"] >= 1 and seen
    # The load-time checks' groups too: their layers kept are the run's first groups'.
    assert set(seen) == {(extra, measured.kept_per_token + streamed_load.PASS_OVERHEAD // 256)}


POLICY = TINY_GEMMA.parent / "tiny-gemma4-policy"  # the policy that sampled the sample rollouts: other weights


@pytest.mark.parametrize("policy_streams", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_policy_of_its_own_beside_a_streamed_reference_is_held_in_memory_or_streamed(tmp_path, monkeypatch,
                                                                                      policy_streams):
    """The reference streams; the policy (weights of its own) is held in memory where it fits beside the
    reference's smallest part, else streams too; both columns equal the run in memory."""
    monkeypatch.setattr(process_memory, "resident", lambda: FOOTPRINT)
    weights, resident, largest = sizes_in_memory(TINY_GEMMA)
    policy_weights, policy_resident, _policy_largest = sizes_in_memory(POLICY)
    streams = FOOTPRINT + budget.GROWTH + resident + 2 * largest + activations(TINY_GEMMA, 256)
    limit = streams + policy_resident if policy_streams else streams + policy_weights  # both stream / policy fits
    lines = []
    got = precompute(config_for(tmp_path, "streamed.parquet", max_memory=str(limit), policy=str(POLICY),
                                prefix_sharing="off"), log=lines.append)
    said = next(line for line in lines if "stream from their files" in line)
    assert ("and so do the policy's" in said) == policy_streams and ("policy held in memory" in said) != policy_streams
    # Each group read every layer once; the per-layer tables' rows besides, one per distinct token of a forward at most,
    # and the head once per forward.
    (table, row), streaming = table_bytes(TINY_GEMMA), [TINY_GEMMA] + ([POLICY] if policy_streams else [])
    head = head_bytes(TINY_GEMMA)
    layers = weights - resident - table - head
    per_group = layers + (policy_weights - policy_resident - table - head if policy_streams else 0)
    extra = got.streamed["bytes_read"] - got.streamed["groups"] // len(streaming) * per_group
    assert rows_and_heads(extra, head, row, len(streaming) * got.forward.padded_tokens)
    expected = precompute(config_for(tmp_path, "memory.parquet", policy=str(POLICY), prefix_sharing="off"),
                          log=lambda line: None)
    for column in (cache.REF_LOGPROBS, cache.POLICY_LOGPROBS):
        a, b = (pq.read_table(r.output).column(column).to_pylist() for r in (got, expected))
        assert max(float(np.max(np.abs(np.array(x) - np.array(y))))
                   for x, y in zip(a, b, strict=True) if x) <= 1e-5, column
    a, b = (pq.read_table(r.output).column(cache.POLICY_LOGPROBS).to_pylist() for r in (got, expected))
    ref = pq.read_table(got.output).column(cache.REF_LOGPROBS).to_pylist()
    assert max(float(np.max(np.abs(np.array(x) - np.array(y))))
               for x, y in zip(a, ref, strict=True) if x) > 1e-3  # not mixed


def test_a_budget_too_small_for_both_streamed_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(process_memory, "resident", lambda: FOOTPRINT)
    _weights, resident, largest = sizes_in_memory(TINY_GEMMA)
    streams = FOOTPRINT + budget.GROWTH + resident + 2 * largest + activations(TINY_GEMMA, 256)
    with pytest.raises(InputError) as caught:
        precompute(config_for(tmp_path, max_memory=str(streams), policy=str(POLICY)), log=lambda line: None)
    assert "too small for the reference and the policy even streamed one layer at a time: it needs at least" in str(
        caught.value) and "\n" not in str(caught.value)
    assert not list(tmp_path.iterdir())


def test_the_command_line_refuses_a_budget_too_small_in_one_line(tmp_path):
    result = run_cli("precompute", str(ROLLOUTS), "--model", str(TINY_LLAMA), "--output", str(tmp_path / "o.parquet"),
                     "--max-memory", "1M", "--progress", "none")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: --max-memory 1M is too small for this model even streamed"), result.stderr
    assert not list(tmp_path.iterdir())


def test_a_config_with_an_mlp_width_per_layer_is_sized_by_the_widest_and_runs(tmp_path, monkeypatch):
    # Gemma 3n's configs name one intermediate size per layer (a list), which the budget read as one number: the run
    # stopped on a TypeError before any row, on every CPU. One pass is sized by the widest layer's MLP, and the run
    # gives the same numbers in memory and streamed.
    import torch
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    from klpipe.model import ModelSpec, streamed_load
    from tests.helpers import agent_rollouts

    config = Gemma3nTextConfig(vocab_size=512, vocab_size_per_layer_input=512, hidden_size=32,
                               hidden_size_per_layer_input=8, intermediate_size=[64, 64, 96, 64], num_hidden_layers=4,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16, laurel_rank=4,
                               altup_num_inputs=2, num_kv_shared_layers=2, sliding_window=16,
                               layer_types=["sliding_attention", "full_attention"] * 2,
                               activation_sparsity_pattern=[0.0] * 4)
    torch.manual_seed(0)
    Gemma3nForCausalLM(config).save_pretrained(tmp_path / "gemma3n")
    sizes = streamed_load.measure(ModelSpec(str(tmp_path / "gemma3n"), dtype="float32", device="cpu"), 256)
    # 8 x hidden + 3 x the widest MLP + the per-layer inputs (4 layers of 8), and as many of the per-layer table's
    # rows, per token at fp32; the head's 64 MiB.
    assert sizes.activations == 256 * 4 * (8 * 32 + 3 * 96 + 32) + 256 * 4 * 32 + 64 * MIB
    rows = agent_rollouts(tmp_path / "rows.parquet", tasks=2, group=3, turns=2)
    monkeypatch.setattr(process_memory, "resident", lambda: FOOTPRINT)
    tight = FOOTPRINT + budget.GROWTH + sizes.resident + 2 * sizes.largest_layer + sizes.activations
    outputs = []
    for name, limit in (("memory", None), ("streamed", str(tight))):
        lines = []
        result = precompute(PrecomputeConfig(inputs=[rows], output=tmp_path / f"{name}.parquet",
                                             model=str(tmp_path / "gemma3n"), device="cpu", progress="none",
                                             max_tokens_per_batch=256, max_memory=limit, max_cache_mib=0),
                            log=lines.append)
        assert any("stream from their files" in line for line in lines) == (limit is not None), lines
        outputs.append(pq.read_table(result.output).column(cache.REF_LOGPROBS).to_pylist())
    assert max(float(np.max(np.abs(np.array(a) - np.array(b)))) for a, b in zip(*outputs, strict=True) if a) <= 1e-5
