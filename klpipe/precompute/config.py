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


@dataclass
class PrecomputeConfig:
    """One precompute run: the rollouts, the reference model, batching, and where the cache goes."""

    inputs: list[Location]  # parquet / JSON Lines files, save_to_disk dirs, or directories of files; or URIs (s3://...)
    model: str  # hub id or local directory
    output: Location | None = None  # the cache (a directory when sharded), local or a URI; None: default_output(inputs)
    revision: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"
    temperature: float = 1.0  # the rollout sampling temperature: logits / T before the softmax
    max_tokens_per_batch: int | None = None  # padded tokens per forward pass; None: by device
    max_cache_mib: int | None = None  # keys and values the prefix tree keeps alive at once; None: by device
    chunk_rows: int = 2048  # rows per checkpoint, also the window rows are length-sorted and grouped in
    prefix_sharing: str = "auto"  # auto | on | off: each prefix the chunk's rows share runs once (SHARING_MODES)
    trust_remote_code: bool = False
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

    def tools_digest(self) -> str | None:
        """sha256 of the --tools list as canonical JSON (provenance), or None without one."""
        if self.tools is None:
            return None
        import hashlib
        import json

        return hashlib.sha256(json.dumps(self.tools, sort_keys=True).encode()).hexdigest()

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise InputError("--temperature must be positive")
        if self.chunk_rows < 1:
            raise InputError("--chunk-rows must be at least 1")
        if self.max_tokens_per_batch is not None and self.max_tokens_per_batch < 1:
            raise InputError("--max-tokens-per-batch must be at least 1")
        if self.max_cache_mib is not None and self.max_cache_mib < 0:
            raise InputError("--max-cache-mib must not be negative")
        if self.prefix_sharing not in SHARING_MODES:
            raise InputError(f"--prefix-sharing must be auto, on or off, not {self.prefix_sharing!r}")
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
