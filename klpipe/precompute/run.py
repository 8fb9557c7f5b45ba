"""Stage 1: stream rollouts through the reference model into a per-token logprob cache.

Data flow: rollouts.iter_chunks -> ChunkTokenizer (in a reader thread) -> logprobs.chunk_logprobs
(every prefix the chunk's rows share runs once, through a prefix tree; other rows are batched per
row) -> one checkpoint file per chunk -> merged cache, renamed into place.

Resume: finished chunks live in the work directory `<output>.partial/` (workdir.py) with a
`run.json` describing the run. A rerun of the same command skips them; the chunk plan is
deterministic, so the merged output is identical to an uninterrupted run. The work directory is
removed once the output is in place.

With `--output-format atropos` (Atropos groups in), the merged cache stays in the work directory and goes out as
the groups it was read from, ref_logprobs filled (klpipe/atropos/writer.py).

Inputs and outputs may be on a store (s3://...; storage/store.py): the work directory stays on
local disk, and the merged cache is uploaded once whole (storage/upload.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from klpipe import cache, sharding
from klpipe.atropos.reader import ATROPOS
from klpipe.columns import ColumnMap
from klpipe.contract import ScoringModel
from klpipe.errors import InputError, ModelError, OutputError
from klpipe.precompute import budget, provenance, startup
from klpipe.precompute.chat import ChatRendering
from klpipe.precompute.config import PrecomputeConfig
from klpipe.precompute.logprobs import ForwardStats
from klpipe.precompute.models import Loaded, Models, load_models
from klpipe.precompute.models import resolve as resolve_models
from klpipe.precompute.rollouts import (
    CHAT,
    INPUT_SUFFIXES,
    Rollouts,
    chunk_sizes,
    iter_chunks,
    open_rollouts,
)
from klpipe.precompute.scorer import ChunkScorer, Joint, check_topk_room
from klpipe.precompute.sharing import Sharing
from klpipe.precompute.signals import StopOnSignal
from klpipe.precompute.tokenize import ChunkTokenizer
from klpipe.precompute.workdir import WorkDir
from klpipe.progress import Progress, peak_memory
from klpipe.sharding import Shard
from klpipe.storage.discover import output_beside, refuse_overwriting_inputs
from klpipe.storage.store import Location, check_output, is_glob
from klpipe.storage.verdicts import VerdictCache
from klpipe.threads import in_background, prefetch

# Default output name beside a single input (see default_output).
OUTPUT_SUFFIX = ".cached.parquet"
GROUPS_SUFFIX = ".ref.jsonl"  # --output-format atropos: the groups with ref_logprobs filled


@dataclass
class PrecomputeSummary:
    output: Location
    rows: int = 0  # rows scored in this run
    tokens: int = 0  # response tokens scored in this run (the policy's own: a mask's 0s get no logprob)
    tool_tokens: int = 0  # response tokens a mask holds 0 that are not pads: a tool's, fed as context only
    pads: int = 0  # pad tokens left out: stripped from a padded batch, or masked 0 after a response's end
    forward: ForwardStats = field(default_factory=ForwardStats)  # what the model was fed in this run
    prefix_sharing: str = "off"  # the mode in force (auto falls back to off where the tree's probe fails: sharing.py)
    seconds: float = 0.0  # scoring time, model loading excluded
    load_seconds: float = 0.0  # loading the model and its checks
    startup_seconds: float = 0.0  # from the stage's start to its first row: loading, the checks, reading the rows
    check_seconds: float = 0.0  # of which the load-time checks (model/checks.py, the tree's probes before any row)
    verdicts: str | None = None  # "reused" where every model's remembered verdict held, else "checked"
    startup_bytes_read: int | None = None  # a streamed model's bytes read before the first row, load and checks
    resumed_chunks: int = 0  # chunks an earlier run of the same command had finished
    resumed_rows: int = 0  # their rows, in the output but not counted in `rows`
    skipped: bool = False  # output already complete: nothing to do
    peak_memory: dict = field(default_factory=dict)
    streamed: dict | None = None  # where the weights streamed: bytes read, groups, share hidden (model/layer_major.py)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def padding_efficiency(self) -> float:
        return self.forward.padding_efficiency


@dataclass
class ChunkRun:
    """What scoring a run's chunks takes besides the models: the rows and their tokenizer, where they go, and who
    hears of them."""

    rollouts: Rollouts
    tokenize: ChunkTokenizer
    work: WorkDir
    config: PrecomputeConfig
    rows: tuple[int, int]  # the run's rows: a shard's, or all
    done: set[int]  # chunks an earlier run finished
    summary: PrecomputeSummary
    stop: StopOnSignal
    log: Callable[[str], None]
    on_chunk: Callable[[int, int], None] | None = None  # (rows, tokens) of each chunk once checkpointed
    started: float | None = None  # the stage's start: its start-up is measured to the first row


def default_output(inputs: list[Location], shard: Shard | None = None, groups: bool = False) -> Location:
    """<stem>.cached.parquet beside a single input, by score's rule (`a.v1.parquet` → `a.v1.cached.parquet`);
    <stem>.ref.jsonl for Atropos groups out; a sharded run, several inputs or a URI pattern need --output."""
    if shard is not None:
        raise InputError("--output DIR is required for a sharded run")
    if len(inputs) != 1 or is_glob(inputs[0]):
        raise InputError("--output is required with several inputs")
    return output_beside(inputs[0], GROUPS_SUFFIX if groups else OUTPUT_SUFFIX, INPUT_SUFFIXES)


def precompute(config: PrecomputeConfig, log: Callable[[str], None] = print,
               on_chunk: Callable[[int, int], None] | None = None) -> PrecomputeSummary:
    """Cache the reference logprob of every response token of `config.inputs`, resuming finished chunks.

    `on_chunk(rows, tokens)`, where given, hears of each chunk once it is checkpointed (a Ray driver's progress)."""
    _require_model_extra()
    from klpipe import model as reference  # torch lives behind this import

    started = time.perf_counter()
    writes = (cache.REF_LOGPROBS, cache.POLICY_LOGPROBS) if config.policy else (cache.REF_LOGPROBS,)
    rollouts = open_rollouts([*config.inputs], ColumnMap(config.columns), writes=writes,  # before anything heavy
                             rollout_format=config.rollout_format)
    if rollouts.skipped:
        log(f"skipping {len(rollouts.skipped)} klpipe output(s) found in an input directory, not rollouts: "
            f"{', '.join(str(p) for p in rollouts.skipped)}")
    provenance.check_chat_options(config, rollouts)
    shard = config.shard
    groups_out = config.output_format == ATROPOS
    if groups_out:
        _check_groups_output(config, rollouts)
    destination = config.output if config.output is not None else default_output(config.inputs, shard, groups_out)
    rows = shard.rows(rollouts.num_rows, config.chunk_rows) if shard else (0, rollouts.num_rows)
    output = shard.part_path(destination) if shard else destination
    refuse_overwriting_inputs({"--output": output}, [f.path for f in rollouts.files])
    check_output(output)  # a missing bucket fails now, not at the upload after hours of compute
    if shard and destination.is_file():
        raise OutputError(f"{destination} is a file; a sharded run writes its part into an output directory")
    models = resolve_models(config)  # the weights to load, the adapters over them, a policy of its own
    model_config = reference.load_config(models.spec)
    tokenizer = provenance.with_template(reference.load_tokenizer(models.spec), config)
    policy_config = reference.load_config(models.policy_spec) if models.policy_spec is not None else None
    fingerprint = provenance.check_all_tokenizers(config, models, model_config, policy_config, tokenizer, rollouts)
    recorded = provenance.provenance(config, models, model_config, fingerprint, rollouts, rows, policy_config)
    summary = PrecomputeSummary(output=output)

    if groups_out and output.exists() and not config.overwrite:
        raise OutputError(f"{output} exists; pass --overwrite to replace it")
    if not groups_out and provenance.already_done(output, recorded, config, log):
        summary.skipped = True
        # A kill between the final rename and the cleanup leaves the finished work directory.
        WorkDir(output, recorded, rollouts, rows, work_root=config.work_dir,
                overwrite_policy=config.overwrite_policy_logprobs).remove_if_finished()
        return summary
    # Before anything is written: the weights fit the budget, or stream, or the run is refused here.
    max_tokens, max_cache_mib = _budgets(recorded)
    decided = budget.decide(config, models, max_tokens, log, max_cache_mib)
    if shard is not None:
        sharding.unmark(output)  # a part is complete only once its marker is rewritten

    tokenize = _tokenizer(config, rollouts, tokenizer, model_config, models.spec)
    work = WorkDir(output, recorded, rollouts, rows, overwrite=config.overwrite, work_root=config.work_dir,
                   overwrite_policy=config.overwrite_policy_logprobs)
    with work.locked(), StopOnSignal(log) as stop:
        done = work.finished_chunks()
        sizes = chunk_sizes(rows, config.chunk_rows)
        summary.resumed_chunks, summary.resumed_rows = len(done), sum(sizes[i] for i in done)
        if done:  # every chunk, when a run was killed while merging: then only the merge is left
            log(f"resuming: {len(done)} of {len(sizes)} chunks already done in {work.path}")
        if len(done) < len(sizes):
            # Validate every row before loading gigabytes of weights: a bad row at the end of the
            # input should fail in seconds, not after hours of compute.
            tokens = _validate_rows(rollouts, tokenize, config.chunk_rows, rows, done, stop)
            if config.ref_topk:
                check_topk_room(config.ref_topk, rows[1] - rows[0] - summary.resumed_rows, tokens, output, work, log)
            run = ChunkRun(rollouts, tokenize, work, config, rows, done, summary, stop, log, on_chunk, started)
            _load_and_run(run, models, decided)
        _merge(work, output, rollouts, groups_out)
        summary.peak_memory = peak_memory()
        if shard is not None:
            # Its temporary file goes in the work dir, which the next line removes even after a kill.
            sharding.mark_complete(output, rows[1] - rows[0], recorded, tmp_dir=work.output_tmp_dir)
        work.remove()
    if not summary.seconds:
        summary.seconds = time.perf_counter() - started
    return summary


def _merge(work: WorkDir, output: Location, rollouts: Rollouts, groups_out: bool) -> None:
    """The chunks merged into the output: the cache, or (`groups_out`) the groups it was read from, the cache merged
    inside the work directory first."""
    if groups_out:
        from klpipe.atropos.writer import write_groups_file

        merged = work.path / "cache.parquet"
        work.merge_into(merged)
        write_groups_file(merged, output, rollouts.columns)
    else:
        work.merge_into(output)


def _tokenizer(config: PrecomputeConfig, rollouts: Rollouts, tokenizer: Any, model_config: Any,
               spec: Any) -> ChunkTokenizer:
    """The rows' tokenizer: the model's vocabulary and context, and its stop ids where a turn (or a row) ends."""
    from klpipe import model as reference  # torch lives behind this import

    vocab_size, max_positions = reference.vocab_and_context(model_config)
    stop_ids = reference.stop_token_ids(spec)  # the generation config's EOS ids: a turn ends on any, and so may a row
    chat = ChatRendering(tools=config.tools, template_kwargs=config.chat_template_kwargs,
                         stop_ids=stop_ids if rollouts.mode == CHAT else (),
                         template_given=config.chat_template is not None, rollout_format=config.rollout_format)
    return ChunkTokenizer(rollouts, tokenizer, vocab_size, max_positions, chat=chat, end_ids=stop_ids)


def _load_and_run(run: ChunkRun, models: Models, decided: budget.Streamed | budget.InMemory | None) -> None:
    """Load the models as the budget `decided`, score the chunks, and keep what the checks and the tree's probes
    decided (storage/verdicts.py)."""
    load_started = time.perf_counter()
    loaded, remembering = load_models(run.config, models, run.work.provenance, decided, VerdictCache(log=run.log))
    run.summary.load_seconds = time.perf_counter() - load_started
    from klpipe.model import layer_major  # torch lives behind this import (loaded by now)

    distinct = loaded.distinct
    streamers = [m.streamer for m in distinct if m.streamer is not None]
    for streamer in streamers:
        streamer.reset_statistics()  # the run's reads, not the load-time probes'
    run.summary.check_seconds = sum(m.check_seconds for m in distinct)
    run.summary.verdicts = "reused" if all(m.verdict_reused for m in distinct) else "checked"
    for line in startup.verdict_lines(distinct):
        run.log(line)
    try:
        _run_chunks(loaded, run)
    finally:  # what the tree's probes decided joins the verdicts, whatever the run then met
        for remembered, model in remembering:
            remembered.keep(model)
    run.summary.streamed = layer_major.figures(streamers)


def _check_groups_output(config: PrecomputeConfig, rollouts) -> None:
    """--output-format atropos writes the input's groups back: the input must be Atropos groups, in one run."""
    if not rollouts.atropos:
        raise InputError(f"--output-format atropos writes Atropos groups back, and {rollouts.files[0].path} holds "
                         "none (JSON Lines of tokens, masks and scores); write the parquet cache instead")
    if config.shard is not None:
        raise InputError("--output-format atropos writes one file of groups; a sharded run writes parquet parts")


def _budgets(recorded: cache.Provenance) -> tuple[int, int]:
    """(tokens a batch, MiB of the tree's cache): the budgets in force, which a run's provenance records."""
    if recorded.max_tokens_per_batch is None or recorded.max_cache_mib is None:
        raise ValueError("a run's provenance records its budgets (provenance.provenance)")
    return recorded.max_tokens_per_batch, recorded.max_cache_mib


def _require_model_extra() -> None:
    """torch and transformers come with the `precompute` extra: scoring hosts install without them."""
    import importlib.util

    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelError(f"klpipe precompute needs {' and '.join(missing)}, which klpipe score does not: "
                         "pip install 'klpipe[precompute]' (on a GPU machine, your CUDA build of torch first)")


def _validate_rows(rollouts, tokenize: ChunkTokenizer, chunk_rows: int, rows: tuple[int, int], done: set[int],
                   stop: StopOnSignal) -> int:
    """Tokenize and check every chunk not yet done; the first bad row raises. The response tokens they score."""
    tokens = 0
    for chunk in iter_chunks(rollouts, chunk_rows, skip=done, rows=rows):
        tokens += tokenize(chunk).scored_tokens()
        stop.check()
    return tokens


def _run_chunks(loaded: Loaded, run: ChunkRun) -> None:
    """Score every chunk not yet done (with the policy too, when there is one) and checkpoint each one.

    `loaded.policy` is the reference itself where it is an adapter over the same weights (`loaded.policy_side`, its
    adapter's name): one plan, run once with the adapter off (or the reference's on) and once with the policy's on,
    its tree probed on both sides."""
    model, own, config, summary, log = loaded.model, loaded.own, run.config, run.summary, run.log
    for note in [*model.notes, *(own.notes if own is not None else [])]:  # what the load-time check dropped
        log(note)
    for line in (model.compile_note, own.compile_note if own is not None else None):
        if line is not None:
            log(line)
    probing = time.perf_counter()
    sharing, policy_sharing = _sharing(loaded, run)
    joint = Joint(exact=run.work.provenance.full_kl, topk=run.work.provenance.ref_topk or 0)
    scorer = ChunkScorer(model, loaded.policy, loaded.policy_side, sharing, policy_sharing, config.temperature,
                         _budgets(run.work.provenance)[0], joint)  # the budgets recorded in run.json
    summary.check_seconds += time.perf_counter() - probing  # the cascade's probe, and the tree's under `on`
    startup.record(summary, [m for m in (model, own) if m is not None], run.started, config.progress != "none", log)
    progress = Progress(config.progress, total_rows=run.rows[1] - run.rows[0], initial_rows=summary.resumed_rows,
                        log=log, interval=config.log_interval)
    compute_started = time.perf_counter()
    try:
        _score_chunks(loaded, run, scorer, progress)
    finally:
        progress.close()
        summary.prefix_sharing = sharing.mode  # auto falls back to off where the tree's probe fails
        summary.seconds = time.perf_counter() - compute_started


def _sharing(loaded: Loaded, run: ChunkRun) -> tuple[Sharing, Sharing | None]:
    """The reference's sharing mode and the policy's (a policy with weights of its own), the tree's probes run where
    the mode asks now; each model's kernel note logged once."""
    model, own, log = loaded.model, loaded.own, run.log
    recorded = _budgets(run.work.provenance)[1]
    # A streamed model's tree keeps what the budget leaves it (budget.decide); the recorded figure otherwise.
    sharing = Sharing(model, run.config.prefix_sharing,
                      recorded if model.stream_cache_mib is None else model.stream_cache_mib, log,
                      sides=(loaded.policy_side,) if loaded.policy is model else ())
    if model.kernel_note:
        log(model.kernel_note)
    if own is None:
        return sharing, None
    # The two run one after the other, so each may hold the whole cache budget in turn.
    policy_sharing = Sharing(own, run.config.prefix_sharing,
                             recorded if own.stream_cache_mib is None else own.stream_cache_mib, log)
    if own.kernel_note and own.kernel_note != model.kernel_note:
        log(own.kernel_note)
    return sharing, policy_sharing


def _score_chunks(loaded: Loaded, run: ChunkRun, scorer: ChunkScorer, progress: Progress) -> None:
    """The chunks read, tokenized and planned ahead, scored here, and written behind."""
    work, summary, stop = run.work, run.summary, run.stop
    chunks = iter_chunks(run.rollouts, run.config.chunk_rows, skip=run.done, rows=run.rows)

    def read_ahead(chunk):  # in the read-ahead thread: tokenized rows and, where they can be made there, the plans
        tokenized = run.tokenize(chunk)
        pairs = [tokenized.row(i) for i in range(tokenized.num_rows)]  # (prompt ids, response ids)
        needed = None if tokenized.mask is None else [tokenized.row_mask(i) for i in range(tokenized.num_rows)]
        return tokenized, pairs, needed, scorer.plan_ahead(pairs, needed)

    def checkpoint(item):  # in the writer thread: a chunk is counted once it is on disk
        tokenized, scored = item
        work.write_chunk(tokenized, scored.ref_logprobs, scored.policy_logprobs, scored.extra)
        response_tokens = tokenized.scored_tokens()
        summary.rows += tokenized.num_rows
        summary.tokens += response_tokens
        summary.tool_tokens += tokenized.tool_tokens()
        summary.pads += tokenized.pads
        progress.update(tokenized.num_rows, response_tokens)
        if run.on_chunk is not None:
            run.on_chunk(tokenized.num_rows, response_tokens)

    # Reading, tokenizing and planning the next chunks overlap with the model's work on this one, and
    # so does writing the last one (write behind). On an error or a stop, closing the stream stops the
    # reader now, not when the stream is collected; then the writer finishes the chunk handed to it
    # (finished work, kept as every chunk written before a stop is) and ends before the error goes on.
    # depth=0: the model runs at most one chunk ahead of the disk, so a slow disk holds one chunk back.
    # Read-ahead depth 1: reading, tokenizing and planning a chunk takes far less than scoring one, so one
    # chunk ahead keeps the model fed. At most three chunks are held (read ahead, scored, written), and a
    # 3-chunk input already holds as much as any longer one: memory stops growing at the third chunk.
    with in_background(checkpoint, depth=0, on_error="finish") as writer, \
            closing(prefetch(map(read_ahead, chunks), depth=1)) as stream:
        def check():  # between batches: a stop asked for, or the writer failed (a full disk)
            stop.check()
            writer.check()

        for tokenized, pairs, needed, ahead in stream:
            scored = scorer.score(pairs, needed, ahead, summary.forward, check)
            for model in loaded.distinct:
                for line in _compile_failures(model):
                    run.log(line)  # a compiled module that failed on a shape the load-time probe did not meet: eager
            # The last chunk written first, then the check: a stop asked for during that write leaves this
            # chunk unwritten.
            writer.wait_for_room()
            check()
            writer.submit((tokenized, scored))
    # Here the last chunk is written (the block waits for it: the merge reads every chunk). A stop asked
    # for while it was written stops the run before the merge.
    stop.check()


def _compile_failures(model: ScoringModel) -> list[str]:
    """The lines to log for compiled modules that fell back to eager since the last call (compiled.py)."""
    if model.compiled is None:
        return []
    return [f"{type(model.model).__name__}: {line}" for line in model.compiled.take_failures()]
