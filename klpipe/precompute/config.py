"""What one precompute run is asked to do: the rollouts, the reference model, batching, where the cache goes.

The command line reads its defaults from here, so they are written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from klpipe.errors import InputError
from klpipe.progress import PROGRESS_MODES

if TYPE_CHECKING:
    from klpipe.files.store import Location
    from klpipe.sharding import Shard

# auto: the prefix tree for the rows that share a prefix worth a pass (every row, where the prefill
# skips layers); on: every row through the tree; off: every row on its own (the per-row path).
SHARING_MODES = ("auto", "on", "off")

# apply_chat_template's own arguments, which klpipe sets row by row: not for --chat-template-kwargs.
TEMPLATE_ARGUMENTS = frozenset({"conversation", "tools", "tokenize", "add_generation_prompt", "continue_final_message",
                                "return_dict", "return_tensors", "padding", "truncation", "max_length"})


OUTPUT_FORMATS = ("parquet", "atropos")

# --compile: torch.compile of the decoder layers' norms and MLPs (klpipe/model/compiled.py). auto: on for CUDA, where
# those passes over activations cost about what the GEMMs do; off on CPU, where the compile (tens of seconds) costs
# more than it wins (README, "Compiled norms and MLPs").
COMPILE_MODES = ("auto", "on", "off")


@dataclass
class PrecomputeConfig:
    """One precompute run: the rollouts, the reference model, batching, and where the cache goes."""

    inputs: list[Location]  # parquet / JSON Lines files, save_to_disk dirs, or directories of files; or URIs (s3://...)
    # hub id or local directory, or a PEFT adapter folder over a base; None: the base an adapter --policy records
    model: str | None = None
    output: Location | None = None  # the cache (a directory when sharded), local or a URI; None: default_output(inputs)
    revision: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"
    temperature: float = 1.0  # the rollout sampling temperature: logits / T before the softmax
    max_tokens_per_batch: int | None = None  # padded tokens per forward pass; None: by device
    max_cache_mib: int | None = None  # keys and values the prefix tree keeps alive at once; None: by device
    # The memory this run may use (a size: 32G, 1.5GiB): weights that do not fit it stream layer by layer
    # (model/streaming.py); None: the process's memory cgroup's limit, else the machine's available memory.
    max_memory: str | None = None
    chunk_rows: int = 2048  # rows per checkpoint, also the window rows are length-sorted and grouped in
    prefix_sharing: str = "auto"  # auto | on | off: each prefix the chunk's rows share runs once (SHARING_MODES)
    compile: str = "auto"  # auto | on | off: torch.compile of the layers' norms and MLPs (COMPILE_MODES)
    trust_remote_code: bool = False
    # A second model whose logprobs of the same tokens go into policy_logprobs, in the same pass: for
    # rollouts that carry none (verl dumps, offline trajectories, a checkpoint's drift on an eval set).
    policy: str | None = None  # hub id or local directory, or a PEFT adapter folder (a LoRA run's checkpoint)
    policy_revision: str | None = None
    policy_device: str | None = None  # None: the reference's device
    overwrite_policy_logprobs: bool = False  # replace an input's policy_logprobs column with the policy's
    overwrite: bool = False  # replace an existing output made by a different run
    progress: str = "auto"  # auto (bar on a terminal, log lines otherwise) | bar | log | none
    log_interval: float = 30.0  # seconds between progress log lines
    shard: Shard | None = None  # set: `output` is a directory and this run writes one part of it
    columns: dict[str, str] = field(default_factory=dict)  # role -> the input's column name (--column)
    work_dir: Path | None = None  # where work directories go; None: beside a local output, KLPIPE_CACHE_DIR/work for a remote one
    # Conversational rows: the tool schemas every row's template renders (GRPOTrainer(tools=...)), read from
    # --tools FILE.json; a per-row tools column instead gives each row its own.
    tools: list | None = None
    chat_template_kwargs: dict = field(default_factory=dict)  # TRL's chat_template_kwargs, e.g. enable_thinking
    # Conversational rows: the template the trainer rendered with (--chat-template FILE, e.g. TRL's training
    # template), in place of the tokenizer's own; None: the tokenizer's.
    chat_template: str | None = None
    # Conversational rows with tool messages: whose tool loop built them, TRL 1.16's GRPOTrainer or verl's
    # ToolAgentLoop (--rollout-format; refused: verl's messages do not determine its ids, precompute/verl_loop.py).
    rollout_format: str = "trl"
    # parquet: the cache. atropos (Atropos groups only): the groups as they came, with ref_logprobs filled in
    # and nothing else changed, as JSON Lines, for trainers that apply the KL in their loss.
    output_format: str = "parquet"

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

        base = adapters.recorded_base(self.policy) if adapters.is_adapter(self.policy) else None
        if base is None:
            raise InputError("--model is required" + ("" if self.policy is None else
                                                     f" (--policy {self.policy} is no adapter recording its base)"))
        return base

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise InputError("--temperature must be positive")
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

        formats = (*ROLLOUT_FORMATS, "atropos")  # atropos: JSON Lines of Atropos groups (precompute/atropos.py)
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
        if self.progress not in PROGRESS_MODES:
            raise InputError(f"--progress must be {', '.join(PROGRESS_MODES[:-1])} or {PROGRESS_MODES[-1]}, "
                             f"not {self.progress!r}")
        from klpipe.columns import ColumnMap  # pyarrow: not needed to read defaults
        from klpipe.files.store import is_remote, location

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
        for option, name in (("--model", self.model), ("--policy", self.policy)):
            if name is not None and is_remote(location(name)):
                raise InputError(f"{option} {name}: models are read from a local directory or the hub, not from a "
                                 "store; copy it to local disk first")
        if is_remote(location(self.model)):
            raise InputError(f"--model {self.model}: the reference model is read from a local directory or the hub, "
                             "not from a store; copy it to local disk first")
        if self.work_dir is not None:
            if is_remote(location(self.work_dir)):
                raise InputError(f"--work-dir {self.work_dir}: the work directory holds the checkpoints a rerun "
                                 "resumes from and must be on local disk")
            self.work_dir = Path(self.work_dir)


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
