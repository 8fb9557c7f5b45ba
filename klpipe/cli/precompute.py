"""`klpipe precompute`: options in, PrecomputeConfig out, one call, a summary on stderr."""

from __future__ import annotations

import sys

from klpipe.cli.app import app, handle_errors
from klpipe.cli.fields import build, options
from klpipe.errors import InputError
from klpipe.precompute.config import PrecomputeConfig, RayConfig, ShardOptions


@app.command("precompute", no_args_is_help=True)
@handle_errors
@options(PrecomputeConfig, ShardOptions, RayConfig, env_prefix="KLPIPE_")
def precompute_command(given: dict) -> None:
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
    from klpipe.precompute import precompute
    from klpipe.sharding import resolve_shard

    sharding = build(ShardOptions, given)
    ray = given["address"]
    if ray is not None and sharding.shard_index is not None:
        raise InputError("--shard-index is for one process's shard; with --ray the driver runs every shard")
    # With --ray the driver runs every shard: a Slurm or torchrun variable names none of its own.
    shard = resolve_shard(sharding.shard_index, sharding.num_shards) if ray is None else None
    config = build(PrecomputeConfig, given, shard=shard)
    if ray is not None:
        from klpipe.precompute.ray_executor import run_on_ray

        result = run_on_ray(config, build(RayConfig, given, num_shards=sharding.num_shards), log=_stderr)
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
        + (f"; resumed {resumed}" if summary.resumed_chunks else "") + _streamed(summary) + _startup(summary)
    )


def _startup(summary) -> str:
    """Where the start-up went (precompute/startup.py): none where a Ray driver sums its shards."""
    if getattr(summary, "verdicts", None) is None:
        return ""
    from klpipe.precompute import startup

    return f"; {startup.line(summary)}"


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
    kept = (f", {streamed['kept']} of {streamed['layers']} layers kept loaded from group to group"
            if streamed.get("kept") else "")
    hidden = ("" if streamed["hidden"] is None  # on a GPU: not measured (model/layer_major.py)
              else f", {streamed['hidden']:.0%} of the read hidden under compute")
    return (f"; weights streamed: {streamed['bytes_read'] / 2**20:,.0f} MiB read in {streamed['groups']} "
            f"layer-major group(s), {per_group:,.0f} MiB each{kept}{hidden}" + hint)


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
