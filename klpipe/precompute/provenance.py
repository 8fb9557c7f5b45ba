"""How a precompute run's cache is made, recorded in it: what a rerun must match to skip or resume it.

Also the checks that decide it before any weight loads: the tokenizers agree, the chat options fit the rows, and an
existing output is this run's own (skipped) or another's (refused without --overwrite).
"""

from __future__ import annotations

import pyarrow as pa

from klpipe import __version__, cache, sharding
from klpipe.arrow import is_list_type
from klpipe.errors import InputError, OutputError
from klpipe.precompute.config import PrecomputeConfig
from klpipe.precompute.models import check_tokenizers, policy_revision, revision
from klpipe.precompute.rollouts import CHAT
from klpipe.precompute.verl_loop import VERL_MESSAGES_REFUSED
from klpipe.storage.fingerprint import fingerprint
from klpipe.storage.store import Location


def default_max_tokens(device: str) -> int:
    # CPU: measured fastest on 2 cores (make bench): larger batches spill activations out of cache.
    return 65536 if device.startswith("cuda") else 2048


def default_max_cache_mib(device: str) -> int:
    """The prefix tree's cache budget: 2 GiB on CPU, a quarter of the GPU's memory on CUDA."""
    if not device.startswith("cuda"):
        return 2048
    from klpipe.model.runtime import device_memory_bytes  # torch lives behind this import

    return device_memory_bytes(device) // 4 >> 20


def check_all_tokenizers(config: PrecomputeConfig, models, model_config, policy_config, tokenizer, rollouts) -> str:
    """The policy, and any adapter folder's own tokenizer, must read the reference's tokens as the same tokens;
    the reference's fingerprint, which the provenance records."""
    from klpipe import model as reference

    chat = rollouts.mode == CHAT
    options = chat_options(config, rollouts)

    def fingerprint_of(spec):
        return reference.tokenizer_fingerprint(with_template(reference.load_tokenizer(spec), config),
                                               chat_template=chat, chat_options=options)

    ours = reference.tokenizer_fingerprint(tokenizer, chat_template=chat, chat_options=options)
    check_tokenizers(config, models, model_config, policy_config, ours, fingerprint_of,
                     "tokenizer or chat template" if chat else "tokenizer")
    return ours


def provenance(config: PrecomputeConfig, models, model_config, tokenizer: str, rollouts, rows,
               policy_config=None) -> cache.Provenance:
    """How this run's cache is made: what a rerun must match to skip or resume it. `tokenizer`: the reference
    tokenizer's fingerprint (check_all_tokenizers)."""
    from klpipe import model as reference  # torch lives behind this import
    from klpipe.model.runtime import library_versions

    spec = models.spec
    device, _ = reference.resolve_device(spec.device)
    dtype = reference.resolve_dtype(spec.dtype, device)  # refuses float16 on CPU
    shard = config.shard
    assert config.model is not None  # PrecomputeConfig resolves it (an adapter --policy's recorded base)
    return cache.Provenance(
        model=config.model,
        revision=revision(models, model_config),
        tokenizer=tokenizer,
        dtype=str(dtype).removeprefix("torch."),
        temperature=float(config.temperature),
        klpipe_version=__version__,
        inputs=[fingerprint(f.path) for f in rollouts.files],
        shard={"index": shard.index, "count": shard.count, "rows": list(rows)} if shard else None,
        columns=recorded_columns(config, rollouts),
        device=device.split(":")[0],
        prefix_sharing=config.prefix_sharing,
        max_tokens_per_batch=config.max_tokens_per_batch or default_max_tokens(device),
        max_cache_mib=config.max_cache_mib if config.max_cache_mib is not None else default_max_cache_mib(device),
        chunk_rows=config.chunk_rows,
        versions=library_versions(),
        tools=config.tools_digest() if rollouts.mode == CHAT else None,
        chat_template_kwargs=dict(config.chat_template_kwargs) if rollouts.mode == CHAT else {},
        chat_template=config.chat_template_digest() if rollouts.mode == CHAT else None,
        rollout_format=config.rollout_format if rollouts.mode == CHAT else "trl",
        policy_model=config.policy,
        policy_revision=policy_revision(models, model_config, policy_config),
        policy_dtype=str(dtype).removeprefix("torch.") if config.policy is not None else None,
        sampler_source=sampler_source(config, rollouts),
        full_kl=config.full_kl and config.policy is not None and config.output_format == "parquet",
        ref_topk=config.ref_topk or None,
    )


def recorded_columns(config: PrecomputeConfig, rollouts) -> dict[str, str]:
    """The --column mapping, plus where the sampler's logprobs stay when --column policy_logprobs=NAME leaves the
    rollouts' policy_logprobs in place: score then finds them under the sampler_logprobs role."""
    columns = dict(rollouts.columns.given)
    source = sampler_source(config, rollouts)
    names = rollouts.columns
    if source is not None and source not in (names.name(cache.SAMPLER_LOGPROBS), names.name(cache.POLICY_LOGPROBS)):
        columns[cache.SAMPLER_LOGPROBS] = source
    return columns


def sampler_source(config: PrecomputeConfig, rollouts) -> str | None:
    """With --policy: the rollouts' column of the sampler's own logprobs, which the cache keeps under the
    sampler_logprobs role beside the policy's computed policy_logprobs; None when there is none to keep.

    A column mapped to (or named) sampler_logprobs is kept as it is. Otherwise the rollouts' policy_logprobs are the
    sampler's: the cache keeps them renamed sampler_logprobs, unless --overwrite-policy-logprobs drops them or
    --column policy_logprobs=NAME writes the computed ones elsewhere (then they stay where they are).
    """
    if config.policy is None:
        return None
    names = rollouts.schema.names
    sampler = rollouts.columns.name(cache.SAMPLER_LOGPROBS)
    if sampler in names:
        return sampler
    if cache.POLICY_LOGPROBS in names and not config.overwrite_policy_logprobs:
        return cache.POLICY_LOGPROBS
    return None


def check_chat_options(config: PrecomputeConfig, rollouts) -> None:
    """--tools and --chat-template-kwargs act on conversational rows' rendering; a tools column and --tools
    would each say which tools a row saw."""
    if rollouts.mode != CHAT:
        given = [name for name, value in (("--tools", config.tools),
                                          ("--chat-template-kwargs", config.chat_template_kwargs),
                                          ("--chat-template", config.chat_template),
                                          ("--rollout-format verl", config.rollout_format == "verl")) if value]
        if given:
            raise InputError(f"{' and '.join(given)} apply to conversational rows (prompt and completion as chat "
                             f"messages), which {rollouts.files[0].path} does not hold")
        return
    if config.rollout_format == "verl":  # before the model loads: no row of verl's messages can be rebuilt
        raise InputError(f"{rollouts.files[0].path}: {VERL_MESSAGES_REFUSED}")
    tools_column = rollouts.columns.name(cache.TOOLS)
    if tools_column in rollouts.schema.names:
        if config.tools is not None:
            raise InputError(f"{rollouts.files[0].path}: has a {tools_column} column and --tools was given; each "
                             "says which tools a row saw: drop one")
        kind = rollouts.schema.field(tools_column).type
        if not (is_list_type(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise InputError(f"{rollouts.files[0].path}: column {tools_column} must be a list of tool schemas or "
                             f"their JSON text, found {kind}")


def with_template(tokenizer, config: PrecomputeConfig):
    """The tokenizer, rendering with --chat-template (the trainer's template) when one is given; the template is
    then part of the tokenizer fingerprint, as the tokenizer's own is."""
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    return tokenizer


def chat_options(config: PrecomputeConfig, rollouts) -> dict | None:
    """What else decides a conversational row's tokens: the --tools list and the template's options."""
    if rollouts.mode != CHAT:
        return None
    options: dict[str, object] = {"tools": config.tools, "chat_template_kwargs": config.chat_template_kwargs}
    if config.rollout_format != "trl":  # the default adds nothing, so a cache made without the option matches
        options["rollout_format"] = config.rollout_format
    return options


def already_done(output: Location, provenance: cache.Provenance, config: PrecomputeConfig, log) -> bool:
    """True when `output` is complete and made by this very run; refuses another run's output unless --overwrite."""
    shard = config.shard
    if not (output.exists() and (shard is None or sharding.is_complete(output))):
        return False
    existing = cache.read_provenance(output) if output.is_file() else None
    if existing == provenance:
        what = f"shard {shard.index} of {shard.count} ({output})" if shard else str(output)
        log(f"{what} is already complete for these inputs, this model and these settings; nothing to do")
        return True
    if not config.overwrite:
        why = "; ".join(existing.differences(provenance)) if existing is not None else "not made by klpipe"
        raise OutputError(f"{output} exists and was made by a different run ({why}); pass --overwrite to replace it")
    return False
