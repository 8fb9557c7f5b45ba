"""What one precompute run is asked to do: the rollouts, the reference model, batching, where the cache goes.

Each field is an option of `klpipe precompute`, its default, help and panel written once (klpipe/options.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from klpipe.errors import InputError
from klpipe.options import COLUMN_HELP, option, parse_columns
from klpipe.progress import check_progress, log_interval_field, progress_field

if TYPE_CHECKING:
    from klpipe.sharding import Shard
    from klpipe.storage.store import Location

# auto: the prefix tree for the rows that share a prefix worth a pass (every row, where the prefill
# skips layers); on: every row through the tree; off: every row on its own (the per-row path).
SHARING_MODES = ("auto", "on", "off")

# apply_chat_template's own arguments, which klpipe sets row by row: not for --chat-template-kwargs.
TEMPLATE_ARGUMENTS = frozenset({"conversation", "tools", "tokenize", "add_generation_prompt", "continue_final_message",
                                "return_dict", "return_tensors", "padding", "truncation", "max_length"})


OUTPUT_FORMATS = ("parquet", "atropos")

# --ref-topk: NeMo-RL's and verl's distillation recipes read the teacher's top 64 / top 32; 256 ids and logprobs a
# token are 2 KiB, already 2,000 times a logprob's size.
MAX_TOPK = 256

# --compile: torch.compile of the decoder layers' norms and MLPs (klpipe/model/compiled.py). auto: on for CUDA, where
# those passes over activations cost about what the GEMMs do; off on CPU, where the compile (tens of seconds) costs
# more than it wins (docs/precompute.md, "Compiled norms and MLPs").
COMPILE_MODES = ("auto", "on", "off")


INPUT_PANEL = "Input columns"
MODEL_PANEL = "Reference model"
POLICY_PANEL = "Policy model (rollouts without sampler logprobs)"
BATCH_PANEL = "Batching and resume"
OUTPUT_PANEL = "Output and progress"
SHARD_PANEL = "Sharding (Slurm arrays, torchrun)"
RAY_PANEL = "Ray clusters"


def read_tools(path: str | Path | None) -> list | None:
    """The --tools file: a JSON list of tool schemas (the JSON GRPOTrainer(tools=...) renders), or None."""
    if path is None:
        return None
    import json

    try:
        tools = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"--tools {path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise InputError(f"--tools {path}: not valid JSON ({exc})") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise InputError(f"--tools {path}: must hold a JSON list of tool schemas (objects)")
    return tools


def read_chat_template(path: str | Path | None) -> str | None:
    """The --chat-template file's text (a Jinja chat template), or None."""
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"--chat-template {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise InputError(f"--chat-template {path}: not UTF-8 text (a Jinja chat template)") from None
    if not text.strip():
        raise InputError(f"--chat-template {path}: is empty")
    return text


def parse_template_kwargs(text: str | None) -> dict:
    """--chat-template-kwargs: a JSON object, as TRL's chat_template_kwargs (`{"enable_thinking": false}`)."""
    if not text:
        return {}
    import json

    try:
        options = json.loads(text)
    except ValueError as exc:
        raise InputError(f"--chat-template-kwargs: not valid JSON ({exc})") from None
    if not isinstance(options, dict):
        raise InputError(f"--chat-template-kwargs: must be a JSON object, e.g. '{{\"enable_thinking\": false}}', "
                         f"not {text!r}")
    return options


@dataclass
class PrecomputeConfig:
    """One precompute run: the rollouts, the reference model, batching, and where the cache goes."""

    inputs: list[Location] = option(
        argument=True, help="Rollout files (parquet, JSON Lines), `save_to_disk` directories, or directories of "
        "files; local paths or URIs (`s3://bucket/prefix/`, `s3://bucket/day-*.parquet`).", show_default=False)
    model: str | None = option(
        None, flags=("--model", "-m"), panel=MODEL_PANEL, show_default=False,
        help="Reference model: a hub id or a local directory (never fetched from the network), or a PEFT adapter "
             "folder over its base. Default with an adapter --policy: its base.")
    output: Location | None = option(
        None, flags=("--output", "-o"), metavar="PATH", panel=OUTPUT_PANEL, show_default=False,
        help="Cache to write, a local path or a URI (s3://...). Default: INPUT.cached.parquet beside a single input.")
    revision: str | None = option(None, panel=MODEL_PANEL, help="Hub revision (branch, tag or commit) of the model.")
    dtype: str = option("auto", panel=MODEL_PANEL,
                        help="auto | float32 | bfloat16 | float16 | float64. auto: bfloat16 on CUDA, float32 on CPU.")
    device: str = option("auto", panel=MODEL_PANEL, help="auto | cpu | cuda | cuda:N. auto: the GPU if there is one "
                         "(device_map=auto over several), else CPU.")
    temperature: float = option(1.0, panel=MODEL_PANEL, help="Rollout sampling temperature; logits are divided by "
                                "it before the softmax.")
    max_tokens_per_batch: int | None = option(
        None, panel=BATCH_PANEL, show_default=False,
        help="Padded tokens per forward pass. Default: 2048 on CPU, 65536 on CUDA.")
    max_cache_mib: int | None = option(
        None, panel=BATCH_PANEL, show_default=False,
        help="Keys and values the prefix tree keeps alive at once, MiB. Default: 2048 on CPU, a quarter of the "
             "GPU's memory on CUDA.")
    # Weights that do not fit stream layer by layer (model/layer_major.py).
    max_memory: str | None = option(
        None, metavar="SIZE", panel=BATCH_PANEL, show_default=False,
        help="The memory this run may use (32G, 1.5GiB, 500M), on its GPU where it runs on one: a reference whose "
             "weights do not fit streams its layers from their files, one at a time. Default: the GPU's free "
             "memory; on CPU the process's memory cgroup's limit, else the machine's available memory.")
    # Also the window rows are length-sorted and grouped in.
    chunk_rows: int = option(2048, panel=BATCH_PANEL,
                             help="Rows per checkpoint; also the window in which rows are sorted by length.")
    prefix_sharing: str = option(
        "auto", panel=BATCH_PANEL,
        help="auto | on | off. auto: every prefix the rows of a chunk share (a system prompt, a GRPO group's "
             "prompt, a multi-turn history) runs once, and rows continue from its keys and values; "
             "on: every row through that prefix tree; off: every row runs whole.")
    compile: str = option(
        "auto", flags=("--compile",), metavar="auto|on|off", panel=MODEL_PANEL,
        help="torch.compile the decoder layers' norms and MLPs (fewer passes over activations), held to the model's "
             "own forward at load; a module that fails or disagrees runs eager. auto: on for CUDA, off on CPU.")
    trust_remote_code: bool = option(False, panel=MODEL_PANEL,
                                     help="Run model code shipped with the checkpoint. Off unless asked.")
    # The load-time checks' verdicts are remembered per model, versions, device and options (storage/verdicts.py).
    recheck: bool = option(
        False, panel=MODEL_PANEL,
        help="Run every load-time check of klpipe's paths against the model's own forward again, where an earlier "
             "run's verdicts for the same weights, versions, device and options are remembered (KLPIPE_CACHE_DIR). "
             "Without it they are reused, held to the model's own forward on a short probe.")
    # A second model whose logprobs of the same tokens go into policy_logprobs, in the same pass: for
    # rollouts that carry none (verl dumps, offline trajectories, a checkpoint's drift on an eval set).
    policy: str | None = option(
        None, panel=POLICY_PANEL, show_default=False,
        help="The policy whose logprobs of the same tokens are written as policy_logprobs, in the same pass as the "
             "reference's: for rollouts without sampler logprobs. A LoRA run's PEFT adapter folder "
             "(adapter_config.json + adapter_model.safetensors: TRL, Unsloth, verl, OpenRLHF), run on the "
             "reference's own weights with the adapter on, or a full model (hub id or local directory). It must "
             "share the reference's tokenizer.")
    full_kl: bool = option(
        True, flags=("--full-kl/--no-full-kl",), panel=POLICY_PANEL,
        help="With --policy: also write the exact per-token KL over the whole vocabulary, both ways "
             "(kl_policy_ref, kl_ref_policy), and both models' entropies, from the two heads applied together "
             "(`klpipe score --estimator full` reads it).")
    ref_topk: int = option(
        0, metavar="K", panel=POLICY_PANEL,
        help="Also write the reference's K most likely token ids and their logprobs per response token "
             "(ref_topk_ids, ref_topk_logprobs), for distillation; at most 256. 0: none.")
    policy_revision: str | None = option(None, panel=POLICY_PANEL, help="Hub revision of the policy model.")
    policy_device: str | None = option(None, panel=POLICY_PANEL, show_default=False,
                                       help="Device of the policy model (cpu, cuda, cuda:N). Default: the reference's.")
    overwrite_policy_logprobs: bool = option(
        False, panel=POLICY_PANEL, help="With --policy: replace an input's policy_logprobs column with the policy "
                                        "model's. Without it such an input is refused.")
    overwrite: bool = option(False, panel=OUTPUT_PANEL,
                             help="Replace an output, or discard a work directory, that a different run made.")
    progress: str = progress_field(OUTPUT_PANEL)
    log_interval: float = log_interval_field(OUTPUT_PANEL)
    shard: Shard | None = None  # set: `output` is a directory and this run writes one part of it
    columns: dict[str, str] = option(
        default_factory=dict, flags=("--column",), metavar="ROLE=NAME", panel=INPUT_PANEL, show_default=False,
        help=COLUMN_HELP, parse=parse_columns, cli_type=list[str] | None)
    work_dir: Path | None = option(
        None, metavar="DIR", panel=BATCH_PANEL, show_default=False, cli_type=str | None,  # a URI is refused whole
        help="Local directory for the work directories (chunk checkpoints a rerun resumes from). Default: "
             "OUTPUT.partial/ beside a local output; KLPIPE_CACHE_DIR/work for an output on a store.")
    # Conversational rows: the tool schemas every row's template renders (GRPOTrainer(tools=...)).
    tools: list | None = option(
        None, flags=("--tools",), metavar="FILE.json", panel=INPUT_PANEL, show_default=False, parse=read_tools,
        cli_type=str | None,
        help="Conversational rows: a JSON list of tool schemas the chat template renders for every row, as "
             "GRPOTrainer(tools=...) does. A per-row `tools` column gives each row its own instead.")
    chat_template_kwargs: dict = option(
        default_factory=dict, flags=("--chat-template-kwargs",), metavar="JSON", panel=INPUT_PANEL,
        show_default=False, parse=parse_template_kwargs, cli_type=str | None,
        help="Conversational rows: keyword arguments for the chat template, TRL's chat_template_kwargs, "
             "e.g. '{\"enable_thinking\": false}'.")
    # The template's text; None: the tokenizer's own.
    chat_template: str | None = option(
        None, flags=("--chat-template",), metavar="FILE", panel=INPUT_PANEL, show_default=False,
        parse=read_chat_template,
        help="Conversational rows: the chat template the trainer rendered with (e.g. TRL's training template, "
             "which GRPOTrainer swaps in with tools), in place of the tokenizer's own.")
    # Whose tool loop built conversational rows with tool messages (precompute/verl_loop.py: why verl's is refused).
    rollout_format: str = option(
        "trl", flags=("--rollout-format",), metavar="trl|verl|atropos", panel=INPUT_PANEL,
        help="Conversational rows with tool messages: whose tool loop built them, TRL's GRPOTrainer (trl) or "
             "verl's ToolAgentLoop (verl: refused, as its messages do not determine its ids). atropos: JSON Lines "
             "of Atropos groups (found by their columns when not given).")
    output_format: str = option(
        "parquet", flags=("--output-format",), metavar="parquet|atropos", panel=OUTPUT_PANEL,
        help="atropos: Atropos groups in, the same groups out (JSON Lines) with ref_logprobs filled and nothing "
             "else changed, for trainers that apply the KL in their loss. Default: the parquet cache.")

    def tools_digest(self) -> str | None:
        """sha256 of the --tools list as canonical JSON (provenance), or None without one."""
        if self.tools is None:
            return None
        import hashlib
        import json

        return hashlib.sha256(json.dumps(self.tools, sort_keys=True).encode()).hexdigest()

    def chat_template_digest(self) -> str | None:
        """sha256 of the --chat-template text (provenance), or None without one."""
        if self.chat_template is None:
            return None
        import hashlib

        return hashlib.sha256(self.chat_template.encode()).hexdigest()

    def _adapter_base(self) -> str:
        """Without --model, the reference is the base an adapter --policy records (TRL's reference in a LoRA run)."""
        from klpipe.precompute import adapters

        adapters.refuse_bare_weights("--policy", self.policy)
        base = adapters.recorded_base(self.policy) if adapters.is_adapter(self.policy) else None
        if base is None:
            raise InputError("--model is required" + ("" if self.policy is None else
                                                     f" (--policy {self.policy} is no adapter recording its base)"))
        return base

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise InputError("--temperature must be positive")
        if not 0 <= self.ref_topk <= MAX_TOPK:
            raise InputError(f"--ref-topk must be between 0 and {MAX_TOPK}, not {self.ref_topk}")
        if self.ref_topk and self.output_format == "atropos":
            raise InputError("--ref-topk writes list columns into the parquet cache; Atropos groups out carry "
                             "ref_logprobs alone")
        if self.chunk_rows < 1:
            raise InputError("--chunk-rows must be at least 1")
        if self.max_tokens_per_batch is not None and self.max_tokens_per_batch < 1:
            raise InputError("--max-tokens-per-batch must be at least 1")
        if self.max_cache_mib is not None and self.max_cache_mib < 0:
            raise InputError("--max-cache-mib must not be negative")
        if self.max_memory is not None:
            from klpipe.precompute.budget import parse_size

            parse_size(self.max_memory)
        from klpipe.precompute.chat import ROLLOUT_FORMATS

        formats = (*ROLLOUT_FORMATS, "atropos")  # atropos: JSON Lines of Atropos groups (atropos/reader.py)
        if self.rollout_format not in formats:
            raise InputError(f"--rollout-format must be {', '.join(formats[:-1])} or {formats[-1]}, "
                             f"not {self.rollout_format!r}")
        if self.output_format not in OUTPUT_FORMATS:
            raise InputError(f"--output-format must be {' or '.join(OUTPUT_FORMATS)}, not {self.output_format!r}")
        if self.prefix_sharing not in SHARING_MODES:
            raise InputError(f"--prefix-sharing must be auto, on or off, not {self.prefix_sharing!r}")
        if self.compile not in COMPILE_MODES:
            raise InputError(f"--compile must be auto, on or off, not {self.compile!r}")
        reserved = sorted(set(self.chat_template_kwargs) & TEMPLATE_ARGUMENTS)
        if reserved:
            raise InputError(f"--chat-template-kwargs: {', '.join(reserved)} is set by klpipe itself, as TRL sets it; "
                             "leave it out")
        if self.tools is not None and not (isinstance(self.tools, list)
                                           and all(isinstance(tool, dict) for tool in self.tools)):
            raise InputError("--tools: the file must hold a JSON list of tool schemas (objects), as "
                             "GRPOTrainer(tools=...) renders them")
        check_progress(self.progress)
        from klpipe.columns import ColumnMap  # pyarrow: not needed to read defaults
        from klpipe.storage.store import is_remote, location

        ColumnMap(self.columns)  # refuses an unknown role, or two roles on one column
        # Local paths stay Paths; URIs (s3://bucket/key) become locations on their store.
        self.inputs = [location(path) for path in self.inputs]
        self.output = location(self.output) if self.output is not None else None
        if self.policy is None and (self.policy_revision or self.policy_device or self.overwrite_policy_logprobs):
            given = [name for name, value in (("--policy-revision", self.policy_revision),
                                              ("--policy-device", self.policy_device),
                                              ("--overwrite-policy-logprobs", self.overwrite_policy_logprobs)) if value]
            raise InputError(f"{' and '.join(given)} need --policy MODEL")
        if self.model is None:
            self.model = self._adapter_base()
        for flag, name in (("--model", self.model), ("--policy", self.policy)):
            if name is not None and is_remote(location(name)):
                raise InputError(f"{flag} {name}: models are read from a local directory or the hub, not from a "
                                 "store; copy it to local disk first")
        if self.work_dir is not None:
            if is_remote(location(self.work_dir)):
                raise InputError(f"--work-dir {self.work_dir}: the work directory holds the checkpoints a rerun "
                                 "resumes from and must be on local disk")
            self.work_dir = Path(self.work_dir)


@dataclass
class ShardOptions:
    """Which part of the rows this process computes, as the command line gives it (klpipe.sharding resolves it)."""

    shard_index: int | None = option(
        None, panel=SHARD_PANEL, show_default=False,
        help="This process's shard (0-based). Default: from SLURM_ARRAY_TASK_ID, or torchrun's RANK.")
    num_shards: int | None = option(
        None, panel=SHARD_PANEL, show_default=False,
        help="Number of shards; --output is then a directory of part files. Default: from SLURM_ARRAY_TASK_COUNT, "
             "or torchrun's WORLD_SIZE; with --ray, the count of the parts already in --output, else the "
             "cluster's GPUs (or CPUs) per shard.")


@dataclass
class RayConfig:
    """Where and how the shards of one precompute run go on a Ray cluster (precompute/ray_executor.py)."""

    address: str | None = option(
        None, flags=("--ray",), metavar="ADDRESS", panel=RAY_PANEL, show_default=False,
        help="Run every shard as a Ray task on this cluster, driven from here: `auto` (the cluster RAY_ADDRESS or "
             "this machine names), `local` (start one on this machine), or the head's HOST:PORT. Needs "
             "`pip install \"klpipe[ray]\"`.")
    num_shards: int | None = None  # --num-shards; None: the parts already in the output, else one per GPU (or CPU)
    gpus_per_shard: float | None = option(
        None, flags=("--ray-gpus-per-shard",), panel=RAY_PANEL, show_default=False,
        help="GPUs each shard's task asks Ray for. Default: 1 where the cluster has GPUs, else 0.")
    cpus_per_shard: float = option(1.0, flags=("--ray-cpus-per-shard",), panel=RAY_PANEL,
                                   help="CPUs each shard's task asks Ray for (its torch threads on a CPU node).")
    max_retries: int = option(
        3, flags=("--ray-max-retries",), panel=RAY_PANEL,
        help="Times Ray runs a shard again whose worker died (node lost, OOM kill, preemption); it resumes from the "
             "shard's last checkpoint where that survives.")

    def __post_init__(self) -> None:
        if not self.address:
            raise InputError("--ray needs an address: auto, local, or HOST:PORT of the cluster's head")
        if self.num_shards is not None and self.num_shards < 1:
            raise InputError("--num-shards must be at least 1")
        if self.gpus_per_shard is not None and self.gpus_per_shard < 0:
            raise InputError("--ray-gpus-per-shard must not be negative")
        if self.cpus_per_shard <= 0:
            raise InputError("--ray-cpus-per-shard must be positive")
        if self.max_retries < 0:
            raise InputError("--ray-max-retries must not be negative")

