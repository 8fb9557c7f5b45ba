"""`klpipe precompute`: options in, PrecomputeConfig out, one call, a summary on stderr."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from klpipe.cli.app import COLUMN_HELP, app, defaults, handle_errors
from klpipe.errors import InputError
from klpipe.precompute.config import PrecomputeConfig

INPUT_PANEL = "Input columns"
MODEL_PANEL = "Reference model"
POLICY_PANEL = "Policy model (rollouts without sampler logprobs)"
BATCH_PANEL = "Batching and resume"
OUTPUT_PANEL = "Output and progress"
SHARD_PANEL = "Sharding (Slurm arrays, torchrun)"
RAY_PANEL = "Ray clusters"

# The library's defaults, written once (PrecomputeConfig): the options below read them.
PRECOMPUTE = defaults(PrecomputeConfig)


@app.command("precompute", no_args_is_help=True)
@handle_errors
def precompute_command(
    inputs: Annotated[list[str], typer.Argument(
        help="Rollout files (parquet, JSON Lines), `save_to_disk` directories, or directories of files; local "
             "paths or URIs (`s3://bucket/prefix/`, `s3://bucket/day-*.parquet`).",
        envvar="KLPIPE_INPUTS", show_default=False)],
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="Reference model: a hub id or a local directory (never fetched from the network), or a "
                              "PEFT adapter folder over its base. Default with an adapter --policy: its base.",
        envvar="KLPIPE_MODEL", rich_help_panel=MODEL_PANEL, show_default=False)] = PRECOMPUTE["model"],
    output: Annotated[str | None, typer.Option(
        "--output", "-o", help="Cache to write, a local path or a URI (s3://...). "
        "Default: INPUT.cached.parquet beside a single input.", metavar="PATH",
        envvar="KLPIPE_OUTPUT", rich_help_panel=OUTPUT_PANEL, show_default=False)] = PRECOMPUTE["output"],
    revision: Annotated[str | None, typer.Option(
        help="Hub revision (branch, tag or commit) of the model.",
        envvar="KLPIPE_REVISION", rich_help_panel=MODEL_PANEL)] = PRECOMPUTE["revision"],
    dtype: Annotated[str, typer.Option(
        help="auto | float32 | bfloat16 | float16 | float64. auto: bfloat16 on CUDA, float32 on CPU.",
        envvar="KLPIPE_DTYPE", rich_help_panel=MODEL_PANEL)] = PRECOMPUTE["dtype"],
    device: Annotated[str, typer.Option(
        help="auto | cpu | cuda | cuda:N. auto: the GPU if there is one (device_map=auto over several), else CPU.",
        envvar="KLPIPE_DEVICE", rich_help_panel=MODEL_PANEL)] = PRECOMPUTE["device"],
    temperature: Annotated[float, typer.Option(
        help="Rollout sampling temperature; logits are divided by it before the softmax.",
        envvar="KLPIPE_TEMPERATURE", rich_help_panel=MODEL_PANEL)] = PRECOMPUTE["temperature"],
    policy: Annotated[str | None, typer.Option(
        "--policy", help="The policy whose logprobs of the same tokens are written as policy_logprobs, in the same "
                         "pass as the reference's: for rollouts without sampler logprobs. A LoRA run's PEFT adapter "
                         "folder (adapter_config.json + adapter_model.safetensors: TRL, Unsloth, verl, OpenRLHF), run "
                         "on the reference's own weights with the adapter on, or a full model (hub id or local "
                         "directory). It must share the reference's tokenizer.",
        envvar="KLPIPE_POLICY", rich_help_panel=POLICY_PANEL, show_default=False)] = PRECOMPUTE["policy"],
    policy_revision: Annotated[str | None, typer.Option(
        help="Hub revision of the policy model.",
        envvar="KLPIPE_POLICY_REVISION", rich_help_panel=POLICY_PANEL)] = PRECOMPUTE["policy_revision"],
    policy_device: Annotated[str | None, typer.Option(
        help="Device of the policy model (cpu, cuda, cuda:N). Default: the reference's.",
        envvar="KLPIPE_POLICY_DEVICE", rich_help_panel=POLICY_PANEL,
        show_default=False)] = PRECOMPUTE["policy_device"],
    overwrite_policy_logprobs: Annotated[bool, typer.Option(
        "--overwrite-policy-logprobs", help="With --policy: replace an input's policy_logprobs column with the "
                                            "policy model's. Without it such an input is refused.",
        envvar="KLPIPE_OVERWRITE_POLICY_LOGPROBS", rich_help_panel=POLICY_PANEL)] = PRECOMPUTE["overwrite_policy_logprobs"],
    trust_remote_code: Annotated[bool, typer.Option(
        "--trust-remote-code", help="Run model code shipped with the checkpoint. Off unless asked.",
        envvar="KLPIPE_TRUST_REMOTE_CODE", rich_help_panel=MODEL_PANEL)] = PRECOMPUTE["trust_remote_code"],
    max_tokens_per_batch: Annotated[int | None, typer.Option(
        help="Padded tokens per forward pass. Default: 2048 on CPU, 65536 on CUDA.",
        envvar="KLPIPE_MAX_TOKENS_PER_BATCH", rich_help_panel=BATCH_PANEL,
        show_default=False)] = PRECOMPUTE["max_tokens_per_batch"],
    max_cache_mib: Annotated[int | None, typer.Option(
        help="Keys and values the prefix tree keeps alive at once, MiB. Default: 2048 on CPU, a quarter of "
             "the GPU's memory on CUDA.",
        envvar="KLPIPE_MAX_CACHE_MIB", rich_help_panel=BATCH_PANEL, show_default=False)] = PRECOMPUTE["max_cache_mib"],
    max_memory: Annotated[str | None, typer.Option(
        help="The memory this run may use (32G, 1.5GiB, 500M): a reference whose weights do not fit streams its "
             "layers from their files, one at a time. Default: the process's memory cgroup's limit, else the "
             "machine's available memory.", metavar="SIZE",
        envvar="KLPIPE_MAX_MEMORY", rich_help_panel=BATCH_PANEL, show_default=False)] = PRECOMPUTE["max_memory"],
    chunk_rows: Annotated[int, typer.Option(
        help="Rows per checkpoint; also the window in which rows are sorted by length.",
        envvar="KLPIPE_CHUNK_ROWS", rich_help_panel=BATCH_PANEL)] = PRECOMPUTE["chunk_rows"],
    work_dir: Annotated[str | None, typer.Option(
        help="Local directory for the work directories (chunk checkpoints a rerun resumes from). Default: "
             "OUTPUT.partial/ beside a local output; KLPIPE_CACHE_DIR/work for an output on a store.",
        metavar="DIR", envvar="KLPIPE_WORK_DIR", rich_help_panel=BATCH_PANEL, show_default=False)] = PRECOMPUTE["work_dir"],
    prefix_sharing: Annotated[str, typer.Option(
        help="auto | on | off. auto: every prefix the rows of a chunk share (a system prompt, a GRPO group's "
             "prompt, a multi-turn history) runs once, and rows continue from its keys and values; "
             "on: every row through that prefix tree; off: every row runs whole.",
        envvar="KLPIPE_PREFIX_SHARING", rich_help_panel=BATCH_PANEL)] = PRECOMPUTE["prefix_sharing"],
    compile: Annotated[str, typer.Option(
        "--compile", metavar="auto|on|off",
        help="torch.compile the decoder layers' norms and MLPs (fewer passes over activations), held to the model's "
             "own forward at load; a module that fails or disagrees runs eager. auto: on for CUDA, off on CPU.",
        envvar="KLPIPE_COMPILE", rich_help_panel=MODEL_PANEL)] = PRECOMPUTE["compile"],
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace an output, or discard a work directory, that a different run made.",
        envvar="KLPIPE_OVERWRITE", rich_help_panel=OUTPUT_PANEL)] = PRECOMPUTE["overwrite"],
    progress: Annotated[str, typer.Option(
        help="auto | bar | log | none. auto: a bar on a terminal, log lines under cron or Slurm.",
        envvar="KLPIPE_PROGRESS", rich_help_panel=OUTPUT_PANEL)] = PRECOMPUTE["progress"],
    log_interval: Annotated[float, typer.Option(
        help="Seconds between progress log lines.",
        envvar="KLPIPE_LOG_INTERVAL", rich_help_panel=OUTPUT_PANEL)] = PRECOMPUTE["log_interval"],
    shard_index: Annotated[int | None, typer.Option(
        help="This process's shard (0-based). Default: from SLURM_ARRAY_TASK_ID, or torchrun's RANK.",
        envvar="KLPIPE_SHARD_INDEX", rich_help_panel=SHARD_PANEL, show_default=False)] = None,
    num_shards: Annotated[int | None, typer.Option(
        help="Number of shards; --output is then a directory of part files. "
             "Default: from SLURM_ARRAY_TASK_COUNT, or torchrun's WORLD_SIZE; with --ray, the count of the parts "
             "already in --output, else the cluster's GPUs (or CPUs) per shard.",
        envvar="KLPIPE_NUM_SHARDS", rich_help_panel=SHARD_PANEL, show_default=False)] = None,
    ray: Annotated[str | None, typer.Option(
        "--ray", metavar="ADDRESS",
        help="Run every shard as a Ray task on this cluster, driven from here: `auto` (the cluster RAY_ADDRESS or "
             "this machine names), `local` (start one on this machine), or the head's HOST:PORT. Needs "
             "`pip install \"klpipe[ray]\"`.",
        envvar="KLPIPE_RAY", rich_help_panel=RAY_PANEL, show_default=False)] = None,
    ray_gpus_per_shard: Annotated[float | None, typer.Option(
        help="GPUs each shard's task asks Ray for. Default: 1 where the cluster has GPUs, else 0.",
        envvar="KLPIPE_RAY_GPUS_PER_SHARD", rich_help_panel=RAY_PANEL, show_default=False)] = None,
    ray_cpus_per_shard: Annotated[float, typer.Option(
        help="CPUs each shard's task asks Ray for (its torch threads on a CPU node).",
        envvar="KLPIPE_RAY_CPUS_PER_SHARD", rich_help_panel=RAY_PANEL)] = 1.0,
    ray_max_retries: Annotated[int, typer.Option(
        help="Times Ray runs a shard again whose worker died (node lost, OOM kill, preemption); it resumes "
             "from the shard's last checkpoint where that survives.",
        envvar="KLPIPE_RAY_MAX_RETRIES", rich_help_panel=RAY_PANEL)] = 3,
    column: Annotated[list[str] | None, typer.Option(
        "--column", metavar="ROLE=NAME", help=COLUMN_HELP,
        envvar="KLPIPE_COLUMN", rich_help_panel=INPUT_PANEL, show_default=False)] = None,
    tools: Annotated[str | None, typer.Option(
        "--tools", metavar="FILE.json",
        help="Conversational rows: a JSON list of tool schemas the chat template renders for every row, as "
             "GRPOTrainer(tools=...) does. A per-row `tools` column gives each row its own instead.",
        envvar="KLPIPE_TOOLS", rich_help_panel=INPUT_PANEL, show_default=False)] = None,
    chat_template_kwargs: Annotated[str | None, typer.Option(
        "--chat-template-kwargs", metavar="JSON",
        help="Conversational rows: keyword arguments for the chat template, TRL's chat_template_kwargs, "
             "e.g. '{\"enable_thinking\": false}'.",
        envvar="KLPIPE_CHAT_TEMPLATE_KWARGS", rich_help_panel=INPUT_PANEL, show_default=False)] = None,
    chat_template: Annotated[str | None, typer.Option(
        "--chat-template", metavar="FILE",
        help="Conversational rows: the chat template the trainer rendered with (e.g. TRL's training template, "
             "which GRPOTrainer swaps in with tools), in place of the tokenizer's own.",
        envvar="KLPIPE_CHAT_TEMPLATE", rich_help_panel=INPUT_PANEL, show_default=False)] = None,
    rollout_format: Annotated[str, typer.Option(
        "--rollout-format", metavar="trl|verl|atropos",
        help="Conversational rows with tool messages: whose tool loop built them, TRL's GRPOTrainer (trl) or "
             "verl's ToolAgentLoop (verl: refused, as its messages do not determine its ids). atropos: JSON Lines "
             "of Atropos groups (found by their columns when not given).",
        envvar="KLPIPE_ROLLOUT_FORMAT", rich_help_panel=INPUT_PANEL)] = "trl",
    output_format: Annotated[str, typer.Option(
        "--output-format", metavar="parquet|atropos",
        help="atropos: Atropos groups in, the same groups out (JSON Lines) with ref_logprobs filled and nothing "
             "else changed, for trainers that apply the KL in their loss. Default: the parquet cache.",
        envvar="KLPIPE_OUTPUT_FORMAT")] = "parquet",
):
    """Cache the reference model's logprob of every response token.

    Reads rollouts with `prompt_ids` + `response_ids` (token ids, exact), `prompt` + `response`
    or `completion` (text, tokenized with the reference tokenizer), or TRL's conversational
    `prompt` + `completion` messages (rendered with its chat template), or Atropos groups (JSON Lines of
    `tokens`, `masks`, `scores`), and writes every input
    column plus `ref_logprobs`. `--column` maps these roles to other column names. A killed run
    resumes from its last finished chunk when rerun.

    Examples:

        klpipe precompute --model google/gemma-4-E2B rollouts.parquet -o cached.parquet

        klpipe precompute -m ./checkpoints/ref --device cuda:1 --dtype bfloat16 day42/ -o day42.cached.parquet

        KLPIPE_MODEL=./ref KLPIPE_DEVICE=cpu klpipe precompute rollouts.jsonl

        klpipe precompute -m ./ref dump/ -o cached.parquet --column response_ids=completion_ids --column reward=score

        sbatch --array=0-7 --wrap "klpipe precompute -m ./ref day42/ -o day42.cached/"

        klpipe precompute -m ./ref s3://rollouts/day42/ -o s3://caches/day42/ --ray auto

        AWS_PROFILE=rl klpipe precompute -m ./ref s3://rollouts/day42/ -o s3://caches/day42.cached.parquet

        klpipe precompute -m Qwen/Qwen3-4B --policy ./grpo-lora/checkpoint-400 dump.jsonl

        klpipe precompute -m ./ref --policy ./ckpt-400 dump.jsonl --column prompt=input --column response=output

        klpipe precompute -m ./ref groups.jsonl --output-format atropos -o groups.ref.jsonl
    """
    from klpipe.columns import parse_columns
    from klpipe.precompute import precompute
    from klpipe.precompute.config import parse_template_kwargs, read_chat_template, read_tools
    from klpipe.sharding import resolve_shard

    if ray is not None and shard_index is not None:
        raise InputError("--shard-index is for one process's shard; with --ray the driver runs every shard")
    # With --ray the driver runs every shard: a Slurm or torchrun variable names none of its own.
    shard = resolve_shard(shard_index, num_shards) if ray is None else None
    config = PrecomputeConfig(
        inputs=inputs, output=output, model=model, revision=revision, dtype=dtype, device=device,
        policy=policy, policy_revision=policy_revision, policy_device=policy_device,
        overwrite_policy_logprobs=overwrite_policy_logprobs,
        temperature=temperature, max_tokens_per_batch=max_tokens_per_batch, max_cache_mib=max_cache_mib,
        max_memory=max_memory, chunk_rows=chunk_rows,
        prefix_sharing=prefix_sharing, compile=compile, work_dir=work_dir,
        trust_remote_code=trust_remote_code, overwrite=overwrite, progress=progress, log_interval=log_interval,
        shard=shard, columns=parse_columns(column), tools=read_tools(tools),
        chat_template_kwargs=parse_template_kwargs(chat_template_kwargs),
        chat_template=read_chat_template(chat_template), rollout_format=rollout_format,
        output_format=output_format,
    )
    if ray is not None:
        from klpipe.precompute.ray_executor import RayConfig, run_on_ray

        ray_config = RayConfig(address=ray, num_shards=num_shards, gpus_per_shard=ray_gpus_per_shard,
                               cpus_per_shard=ray_cpus_per_shard, max_retries=ray_max_retries)
        result = run_on_ray(config, ray_config, log=_stderr)
        if not result.summary.skipped:
            retried = ", ".join(f"shard {i} {n}x" for i, n in sorted(result.retries.items()))
            _stderr(f"ray: {len(result.ran)} shard(s) computed on {result.nodes} node(s)"
                    + (f", {len(result.complete)} already complete" if result.complete else "")
                    + (f"; Ray ran again after a worker died: {retried}" if retried else ""))
            _print_summary(result.summary)
        return
    summary = precompute(config, log=_stderr)
    if summary.skipped:
        return
    _print_summary(summary)


def _print_summary(summary) -> None:
    """The run's last line: the same for one process, one shard, and a Ray run's shards summed."""
    memory = ", ".join(f"{k.removesuffix('_mib')} {v:,.0f} MiB" for k, v in summary.peak_memory.items())
    resumed = f"{summary.resumed_chunks} chunks ({summary.resumed_rows:,} rows) finished by an earlier run"
    if summary.resumed_chunks and not summary.rows:
        _stderr(f"wrote {summary.output}: all {resumed}, nothing left to compute; peak memory {memory}")
        return
    _stderr(
        f"wrote {summary.output}: {summary.rows:,} rows, {summary.tokens:,} response tokens "
        f"in {summary.seconds:,.1f}s ({summary.tokens_per_second:,.0f} tokens/s){_left_out(summary)}, "
        f"padding efficiency {summary.padding_efficiency:.1%}, {_fed(summary.forward)}, peak memory {memory}"
        + (f"; resumed {resumed}" if summary.resumed_chunks else "") + _streamed(summary)
    )


def _streamed(summary) -> str:
    """Where the weights streamed: what was read, how often, and how much of the read the compute hid."""
    streamed = getattr(summary, "streamed", None)
    if not streamed or not streamed["groups"]:
        return ""
    per_group = streamed["bytes_read"] / streamed["groups"] / 2**20
    hint = ""
    if streamed.get("tokens_to_hide"):  # below 90%: what a group would need, and what gives it that
        hint = (f" (groups held {streamed['tokens_per_group']:,} fed tokens; about {streamed['tokens_to_hide']:,} "
                "would hide the read: a larger --max-memory, or --chunk-rows where a chunk is the smaller)")
    return (f"; weights streamed: {streamed['bytes_read'] / 2**20:,.0f} MiB read in {streamed['groups']} "
            f"layer-major group(s), {per_group:,.0f} MiB each, {streamed['hidden']:.0%} of the read hidden under "
            "compute" + hint)


def _left_out(summary) -> str:
    """The response tokens not scored, tools' and pads' apart: a pad is no tool's result."""
    if not summary.tool_tokens and not summary.pads:
        return ""
    return f", besides {summary.tool_tokens:,} tool tokens read as context and {summary.pads:,} pads left out"


def _fed(forward) -> str:
    return (f"fed {forward.fed_tokens:,} tokens where running each row whole feeds {forward.per_row_tokens:,} "
            f"({forward.fewer:.1f}x fewer)")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
