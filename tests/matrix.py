"""The registry matrix: every family in transformers' own `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, as a tiny random model
built at test time from its config class, run through klpipe's precompute path against an fp64 forward.

The list is the registry's, not a hand list: a transformers that adds a family adds a row here, and the fast test
(tests/model/test_matrix.py) fails until its outcome is recorded. Each family's config is its default with the generic
sizes of `SHRINK` wherever it has such a field; per-layer kind lists (`layer_types`, `layers_block_type`, ...) keep
each kind's first layer, in order, so a hybrid keeps every kind it has. `OVERRIDES` holds the few families whose
default cannot be shrunk that way, each with the reason.

What a family does in each mode is recorded in tests/matrix.json (`python -m tests.matrix --record` runs every
family and rewrites it; `--docs` writes docs/architectures.md's table from it). `make test-matrix` runs the
families again and holds each to its record and to the oracle: a family whose numbers are wrong in any mode fails
there, whatever its record says.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RECORD = Path(__file__).with_name("matrix.json")
PAGE = Path(__file__).parents[1] / "docs" / "architectures.md"
BEGIN, END = "<!-- registry matrix: python -m tests.matrix --docs -->", "<!-- end of the registry matrix -->"
TOLERANCE = 1e-4  # beyond the fp32 oracle's own error against fp64
EXACT = 1e-9  # fp64 all the way through (klpipe/model/wide.py) against an fp64 forward: rounding is ~1e-14
WINDOW = 16  # sliding windows and attention chunks; the agent rows' system prompt is longer

# Set wherever the family's config has the field (or an alias of it) and its default is not None (a None there turns
# a feature off, or means "derived"): 64 wide, 2 layers, 4 heads of 16, 4 experts, state and latents of 8-32.
SHRINK = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=WINDOW,
    attention_chunk_size=WINDOW,
    # MoE: 4 experts, 2 a token, one group
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, num_experts_per_token=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, expert_intermediate_size=32, n_shared_experts=1,
    num_shared_experts=1, n_group=1, topk_group=1, num_expert_group=1, first_k_dense_replace=1,
    # MLA: latents of 16 and 32, keys of 8 rotary + 16 plain dimensions, values of 16
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, qk_head_dim=24,
    # sparse attention's indexer
    index_topk=8, index_head_dim=16, index_n_heads=2,
    # linear attention (Gated DeltaNet, KDA, lightning)
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, linear_head_dim=16, linear_num_heads=4,
    # Mamba-1/2: 128 inner channels (8 heads of 16), state 16, chunks of 16
    mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=16, mamba_num_heads=8,
    mamba_head_dim=16, ssm_state_size=16, state_size=16, n_groups=1, chunk_size=16, time_step_rank=8,
    mamba_d_ssm=128,
)
# Set wherever the field exists, None or not: the sample tokenizer's ids, and the head layout (a None head_dim or
# key-value head count is "derived" in the config, and some families' own code cannot derive it: Ministral, Nemotron).
ALWAYS = dict(pad_token_id=0, bos_token_id=2, eos_token_id=1, head_dim=16, num_key_value_heads=2)

# Families whose default config the generic shrink cannot make tiny and valid: the fields to set, and why.
OVERRIDES: dict[str, dict] = {
    "bamba": dict(attn_layer_indices=[1]),  # the default has no attention layer at all (None)
    # Input, looped and output blocks, one each; its to_dict() interleaves "mlp" kinds that __init__ takes out again.
    "dory": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_hidden_layers=3,
                 n_input_layers=1, n_recurrent_layers=1, n_output_layers=1),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),  # None by default: no layer at all
    # Its sparse layers' indexer has no default (None): a budget of 16 tokens in blocks of 4.
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16,
                           indexer_compress_ratio=4),
    # block_types cycles over the layers (recurrent, recurrent, attention): three layers hold both kinds.
    "recurrent_gemma": dict(num_hidden_layers=3, lru_width=64, attention_window_size=WINDOW),
    # Its LM head asserts is_decoder; axial position embeddings split the width (32 + 32) over a 16 x 32 grid.
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[32, 32], axial_pos_shape=[16, 32]),
    # Layers that read the keys of earlier ones: the last two of four (sliding, full) share the first two's.
    "gemma3n_text": dict(num_hidden_layers=4, num_kv_shared_layers=2, intermediate_size=[128] * 4,
                         layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=None,
                         laurel_rank=8),
    "gptj": dict(rotary_dim=8),  # 64 by default: wider than the 16-wide heads
    "codegen": dict(rotary_dim=8),
    "deepseek_v2": dict(n_routed_experts=4, num_experts_per_tok=2),  # None by default: no experts to route to
    # One Mamba layer then one attention layer, the second with experts (the default: attention every 8th).
    "jamba": dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),  # the default has Mamba layers alone
    "inkling2_text": dict(unpadded_vocab_size=500),  # the vocabulary less its padding: past the tiny one
    "inkling2_loop_text": dict(unpadded_vocab_size=500),
    # The shared transformer block ties its weights across hybrid layers: two of them, after a Mamba layer.
    "zamba": dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"]),
    "mamba2": dict(num_heads=8),  # 8 heads of head_dim 16: the 128 inner channels (expand 2 of 64)
    "xlnet": dict(d_head=16),  # d_model // n_head, checked, not derived
    "zaya": dict(num_experts_per_tok=1),  # "ZAYA currently supports num_experts_per_tok=1 only"
}

# Registry entries that are not a decoder-only language model of their own, and why (checked, not guessed: see
# `kind`). Multimodal entries whose text model is a family of its own are listed in `kind` too.
NOT_DECODER_ONLY: dict[str, str] = {
    # Its default (6 GB) is four sub-configs (patcher, encoder, global transformer, decoder) SHRINK does not reach.
    "blt": "a composite config (decoder_config, encoder_config, global_config, patcher_config) that the generic "
           "shrink does not reach",
}


@dataclass(frozen=True)
class Family:
    model_type: str  # the registry's key
    class_name: str  # the causal LM class the registry maps it to
    config_class: str


def registry() -> dict[str, Family]:
    """Every entry of transformers' causal LM registry."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # Names only: importing 196 config modules would cost make test twenty seconds.
    return {t: Family(t, c, CONFIG_MAPPING_NAMES[t]) for t, c in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}


def _fields(config_class, default) -> set[str]:
    """The names a config class takes: its defaults' fields, its constructor's parameters and its aliases."""
    fields = set(default.to_dict()) | set(getattr(config_class, "attribute_map", {}))
    return fields | set(inspect.signature(config_class.__init__).parameters)


def tiny_config(model_type: str):
    """`model_type`'s config, tiny: SHRINK where it has the field, one layer of each kind, then its OVERRIDES."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    try:
        default = config_class()
    except Exception:  # noqa: BLE001 - a default that does not validate as it stands
        default = config_class(**OVERRIDES.get(model_type, {}))
    fields = _fields(config_class, default)
    given = default.to_dict()
    values = {k: v for k, v in SHRINK.items() if k in fields and _value(default, given, k) is not None}
    values.update({k: v for k, v in ALWAYS.items() if k in fields})
    if "qk_rope_head_dim" in values and "head_dim" in values:  # MLA: head_dim is the rotary part
        values.update(head_dim=SHRINK["qk_rope_head_dim"], num_key_value_heads=SHRINK["num_attention_heads"])
    layers = given.get("num_hidden_layers") or _value(default, given, "num_hidden_layers")
    per_layer = {k: v for k, v in given.items() if isinstance(v, list) and layers and len(v) == layers}
    kinds = {k: v for k, v in per_layer.items() if all(isinstance(x, str) for x in v)}
    if per_layer:  # the first layer of each kind (of each combination of kinds), in order; two of a single kind
        keep = sorted({tuple(v[i] for v in kinds.values()): i for i in reversed(range(layers))}.values())
        keep = keep if len(keep) > 1 else [keep[0], keep[0] + 1]
        values.update({k: [v[i] for i in keep] for k, v in per_layer.items() if k not in values or k in kinds})
        values["num_hidden_layers"] = len(keep)
    values.update(OVERRIDES.get(model_type, {}))
    return config_class(**{k: v for k, v in values.items() if v is not None})


def _value(config, given: dict, name: str):
    """`config`'s `name` (an alias resolved), or what to_dict() says where a per-layer config refuses a global read."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        return given.get(name)


def save_tiny(model_type: str, directory: Path, seed: int = 0, scale: float = 4.0, head_scale: float = 4.0) -> Path:
    """A random tiny `model_type` model in `directory` as safetensors, with the sample tokenizer beside it; weights
    scaled up as tests/architectures.py does, so that logprobs spread over nats."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.architectures import save_spread

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    with torch.no_grad():
        model(input_ids=torch.arange(3, 3 + 2 * WINDOW)[None])  # the tiny config runs: what fails after is klpipe
    return save_spread(model, directory, scale, head_scale)


def agent_rows(vocab: int, seed: int = 0):
    """An agent's chunk (helpers.agent_rows): a system prompt longer than every window, GRPO groups, multi-turn."""
    from tests import helpers

    return helpers.agent_rows(vocab, seed, window=WINDOW, system=2 * WINDOW + 5, low=3)


# -- one family through klpipe, every mode -------------------------------------------------------------


@dataclass
class Run:
    """What one family did: the outcome recorded in matrix.json, and the figures behind it."""

    oracle: str  # "fp64", or "fp32" where the model's own code cannot run in fp64
    off: str  # "runs whole: no tree" unless it crashes
    auto: str  # "shares", or "runs whole: why" (the line auto logged)
    on: str  # "shares", or "refused: why" (the one-line error)
    errors: dict  # mode -> klpipe's worst |error| against the oracle
    own: float  # the fp32 oracle's own worst error against fp64 (0 under an fp32 oracle)
    wrong: list  # the modes whose numbers are beyond the bound
    crashed: dict  # mode -> the raw error it raised (no refusal: a failure)
    rows: str = "packed"  # how rows run whole went: "packed" (model/attention/packing.py), or "padded: why"
    seconds: float = 0.0

    def record(self) -> dict:
        entry = {"oracle": self.oracle, "auto": self.auto, "on": self.on, "rows": self.rows}
        if self.wrong:
            entry["wrong"] = {m: f"{self.errors[m]:.3g}" for m in self.wrong}
        if self.crashed:
            entry["crashes"] = self.crashed
        return entry


def _oracle(model, rows):
    """(expected logprobs, the fp32 oracle's own error, "fp64" or "fp32")."""
    import torch

    from tests.helpers import Fp64Oracle, oracle_logprobs

    try:
        expected, own = Fp64Oracle(model).expected(rows)
        if all(np.isfinite(e).all() for e in expected):
            return expected, own, "fp64"
    except (RuntimeError, TypeError, ValueError):  # an fp32 cast inside meets fp64 weights
        pass
    with torch.no_grad():
        return [oracle_logprobs(model, p, r).astype(np.float64) for p, r in rows], 0.0, "fp32"


def fp64_forward(model, rows) -> list[np.ndarray]:
    """The naive oracle of an fp64 `model` with every fp32 its code asks for made fp64 (wide.fp64())."""
    import torch

    from klpipe.model import wide
    from tests.helpers import oracle_logprobs

    model.to(torch.float64)  # what a model keeps in fp32 (its `_keep_in_fp32_modules`) too
    if model._can_set_experts_implementation():
        model.set_experts_implementation("eager")  # the grouped-matmul kernels take no fp64
    with wide.fp64():
        return [oracle_logprobs(model, p, r) for p, r in rows]


def _worst(results, expected, dtype=np.float32) -> float:
    worst = 0.0
    for values, exact in zip(results, expected, strict=True):
        assert values.dtype == dtype and values.shape == exact.shape
        if len(exact):
            worst = max(worst, float(np.max(np.abs(values - exact))))
    return worst


def run_family(directory: Path, dtype: str = "float32") -> Run:
    """The tiny model in `directory` through klpipe's precompute path (sharing.Sharing, plan, run_plan) under off,
    auto and on, held to the oracle. `dtype` float64: klpipe in fp64 all the way through, held to the fp64 forward
    within EXACT."""
    from klpipe.errors import ModelError
    from klpipe.model import ModelSpec, ReferenceModel
    from klpipe.precompute.logprobs import ForwardStats, plan_stats, run_plan
    from klpipe.precompute.sharing import Sharing

    started = time.perf_counter()
    from transformers import AutoModelForCausalLM

    # The oracle is the model as transformers loads it, never klpipe's loaded copy: whatever klpipe installs in it
    # (an attention function, a head) would be in the oracle too, and two things that agree prove nothing.
    untouched = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    reference = ReferenceModel.load(ModelSpec(str(directory), dtype=dtype, device="cpu"))
    rows = agent_rows(reference.vocab_size)
    if dtype == "float64":
        expected, own, oracle = fp64_forward(untouched, rows), 0.0, "fp64"
    else:
        expected, own, oracle = _oracle(untouched, rows)
    del untouched
    errors, said, crashed = {}, {}, {}
    for mode in ("off", "auto", "on"):
        lines = []
        try:
            sharing = Sharing(reference, mode, 1 << 10, lines.append)
        except ModelError as exc:
            said[mode] = f"refused: {_why(str(exc))}"
            continue
        except Exception as exc:  # noqa: BLE001 - a raw error is no refusal: the mode fails
            crashed[mode] = _first_line(exc)
            said[mode] = f"crashes: {crashed[mode]}"
            continue
        stats = ForwardStats()
        try:
            plan = sharing.plan(rows, 96, None)
            plan_stats(plan, stats)
            results = run_plan(reference, plan, rows, 1.0)
        except ModelError as exc:  # the probe ran with the first plan
            said[mode] = f"refused: {_why(str(exc))}"
            continue
        except Exception as exc:  # noqa: BLE001
            crashed[mode] = _first_line(exc)
            said[mode] = f"crashes: {crashed[mode]}"
            continue
        errors[mode] = _worst(results, expected, reference.result_dtype)
        said[mode] = "shares" if stats.tree_rows else f"runs whole: {_why(lines[0]) if lines else 'no tree'}"
    wrong = [m for m, e in errors.items() if not e <= own + (EXACT if dtype == "float64" else TOLERANCE)]
    rows_path = "packed" if reference.packed else f"padded: {reference.padded_why}"  # after every mode ran
    return Run(oracle, said["off"], said["auto"], said["on"], errors, own, wrong, crashed, rows_path,
               time.perf_counter() - started)


def _why(line: str) -> str:
    """The reason in a sharing line ('... cannot share prefixes exactly (why)'), else the line."""
    match = re.search(r"cannot share prefixes exactly \((.*)\)$", line)
    return match.group(1) if match else line


# -- which entries are decoder-only and build tiny ------------------------------------------------------


def kind(family: Family, families: dict[str, Family]) -> str | None:
    """None for a decoder-only family that the matrix runs; else why it is not run."""
    if family.model_type in NOT_DECODER_ONLY:
        return NOT_DECODER_ONLY[family.model_type]
    from transformers import CONFIG_MAPPING

    try:
        config = CONFIG_MAPPING[family.model_type]()
    except Exception:  # noqa: BLE001 - a default that does not validate: its tiny config (OVERRIDES) decides
        return None
    if getattr(config, "is_encoder_decoder", False):
        return "the decoder half of an encoder-decoder model"
    if "add_cross_attention" in config.to_dict() and not getattr(config, "is_decoder", False):
        return "an encoder (BERT-like): bidirectional unless `is_decoder=True`, its causal head an encoder-decoder's"
    text = config.get_text_config()
    if text is not config or family.class_name.endswith("ForConditionalGeneration"):
        own = [t for t, f in families.items() if t != family.model_type and f.config_class == type(text).__name__]
        if own:
            return f"a composite config: klpipe loads its text model, family `{own[0]}`"
        parts = sorted(k for k, v in config.to_dict().items() if isinstance(v, dict) and "model_type" in v)
        return f"a composite config ({', '.join(parts) or 'sub-models'}) that the generic shrink does not reach"
    return None


def record_all(names=None, log=print, done=lambda record: None) -> dict:
    """Run every family (or `names`) and return the record: model_type -> outcome, or {"not_built": why}.
    `done` sees the record so far after each family (a long run is kept as it goes)."""
    families = registry()
    record = {}
    for name in names or sorted(families):
        family = families[name]
        why = kind(family, families)
        if why is not None:
            record[name] = {"not_run": why}
            log(f"{name}: not run ({why})")
            continue
        with tempfile.TemporaryDirectory() as directory:
            try:
                save_tiny(name, Path(directory))
            except Exception as exc:  # noqa: BLE001 - the reason is what the record keeps
                record[name] = {"not_built": _first_line(exc)}
                log(f"{name}: not built ({record[name]['not_built']})")
                continue
            try:
                run = run_family(Path(directory))
            except Exception as exc:  # noqa: BLE001
                record[name] = {"error": _first_line(exc)}
                log(f"{name}: ERROR {record[name]['error']}")
                continue
        record[name] = run.record()
        done(record)
        figures = ", ".join(f"{m} {e:.2g}" for m, e in run.errors.items())
        log(f"{name}: {run.record()} [{figures}; own {run.own:.2g}; {run.seconds:.1f}s]")
    return record


def _first_line(exc: BaseException) -> str:
    """The error's first line; a config validator's cause, where transformers wraps it."""
    if type(exc).__name__ == "StrictDataclassClassValidationError" and exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


# -- the table on docs/architectures.md -------------------------------------------------------------------


def table(record: dict) -> str:
    """docs/architectures.md's table of `record`: a row per registry entry."""
    families = registry()
    # A row opens with the class, not a backticked name: tests/test_docs.py reads those as options.
    lines = ["| family: class (`model_type`) | `off` | `auto` | `on` | rows run whole |", "|---|---|---|---|---|"]
    for name in sorted(families):
        entry = record.get(name, {"not_run": "not recorded"})
        head = f"{families[name].class_name} (`{name}`)"
        if "not_run" in entry or "not_built" in entry:
            why = entry.get("not_run") or f"not built tiny: {entry['not_built']}"
            lines.append(f"| {head} | {why} | | | |")
            continue
        if "error" in entry:
            lines.append(f"| {head} | **klpipe fails: {entry['error']}** | | | |")
            continue
        lines.append(f"| {head} | {_cell(entry, 'off')} | {_cell(entry, 'auto', entry['auto'])} "
                     f"| {_cell(entry, 'on', entry['on'])} | {entry.get('rows', 'not recorded').replace('|', '/')} |")
    return "\n".join(lines)


def _cell(entry: dict, mode: str, said: str | None = None) -> str:
    """One mode's cell of an entry's row: wrong, crashing, or what the record says of it."""
    if mode in entry.get("wrong", {}):
        return f"**wrong by {entry['wrong'][mode]}**"
    if mode in entry.get("crashes", {}):
        return f"**crashes: {entry['crashes'][mode]}**"
    return said or f"at the {entry['oracle']} oracle"


def tally(record: dict) -> str:
    run = {n: e for n, e in record.items() if "oracle" in e}
    failing = sorted(n for n, e in record.items() if "error" in e)
    not_run = sum("not_run" in e for e in record.values())
    not_built = sum("not_built" in e for e in record.values())
    exact_off = sum("off" not in e.get("wrong", {}) for e in run.values())
    shares = sum(e["auto"] == "shares" and "auto" not in e.get("wrong", {}) for e in run.values())
    refused = sum(e["on"].startswith("refused") for e in run.values())
    wrong = sorted(n for n, e in run.items() if e.get("wrong") or e.get("crashes"))
    packed = sum(e.get("rows") == "packed" for e in run.values())
    return (f"{len(record)} registry entries: {not_run} not a decoder-only model of their own, {not_built} not built "
            f"tiny, {len(run) + len(failing)} decoder-only families run; {exact_off} at the oracle under `off`, "
            f"{shares} sharing prefixes under `auto`, {refused} refused under `on`, {packed} running rows whole packed"
            + (f"; wrong numbers: {', '.join(wrong)}" if wrong else "")
            + (f"; klpipe fails at load: {', '.join(failing)}" if failing else ""))


def page_block(record: dict) -> str:
    return f"{BEGIN}\n{tally(record)}.\n\n{table(record)}\n{END}"


def write_page(record: dict, path: Path = PAGE) -> None:
    text = path.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    path.write_text(text[:start] + page_block(record) + text[end:])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="run the families and rewrite matrix.json")
    parser.add_argument("--docs", action="store_true", help="write docs/architectures.md's table from matrix.json")
    parser.add_argument("names", nargs="*", help="only these model types (with --record: merged into the record)")
    args = parser.parse_args(argv)
    if args.record:
        import warnings

        warnings.filterwarnings("ignore")
        old = json.loads(RECORD.read_text()) if RECORD.exists() and args.names else {}

        def write(new):
            RECORD.write_text(json.dumps(dict(sorted({**old, **new}.items())), indent=1) + "\n")

        write(record_all(args.names or None, done=write))
    if args.docs:
        write_page(json.loads(RECORD.read_text()))
    if not (args.record or args.docs):
        parser.print_help()


if __name__ == "__main__":
    main()
