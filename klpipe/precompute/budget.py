"""The memory a run may use, and whether the reference's weights fit it or stream layer by layer (model/layer_major.py).

No torch: the budget is read from the command line or the machine, the model's sizes come from the model package.

    budget      --max-memory, else the process's memory cgroup (the lowest limit along its path), else MemAvailable
                plus what this process holds; on a GPU, the device's (--max-memory, else its free memory)
    in memory   footprint + growth + weights + activations <= budget (on a GPU the weights alone: a pass's
                activations are --max-tokens-per-batch's to fit)
    streamed    footprint + growth + resident + 2 x the largest layer + activations <= budget (the layer that
                computes and the one read behind it); below that the run is refused before anything loads

`footprint` is the process's resident set before the weights load, `growth` what it will add whatever the model
(GROWTH), `activations` an estimate, on the safe side, of one pass of `--max-tokens-per-batch` tokens
(model/streamed_load.py's `measure`). What is left over goes, up to half, to the prefix tree's cache, and streamed,
the rest to the tokens a layer-major group holds. docs/precompute.md, "Weights larger than memory", says more.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from klpipe import process_memory
from klpipe.contract import Streaming
from klpipe.errors import InputError

UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
UNLIMITED = 1 << 60  # a v1 cgroup without a limit reports 2^63 rounded down to a page
# What the process grows by after the decision, whatever the model: the rows read and tokenized a chunk ahead, the
# reader and writer threads, torch's first kernels (measured: about 90 MiB on the sample rollouts).
GROWTH = 128 << 20



def parse_size(text: str, option: str = "--max-memory") -> int:
    """Bytes of a size such as `32G`, `32GiB`, `1.5GB`, `500M`, `123456` (K, M, G, T are powers of 1,024)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text), flags=re.IGNORECASE)
    if found is None or (found.group(2) == "" and str(text).strip().lower().endswith("ib")):
        raise InputError(f"{option} must be a size such as 32G, 1.5GiB or 500M, not {text!r}")
    size = int(float(found.group(1)) * UNITS[found.group(2).lower()])
    if size <= 0:
        raise InputError(f"{option} must be positive, not {text!r}")
    return size


def cgroup_limit(proc: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory limit of this process's cgroup and its ancestors (the lowest), v1 or v2; None where none is set."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "" and number == "0":  # v2: one unified hierarchy
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.strip().split("/") if p]
        for depth in range(len(parts), -1, -1):
            try:
                value = (base.joinpath(*parts[:depth]) / name).read_text().strip()
            except OSError:
                continue
            if value.isdigit() and int(value) < UNLIMITED:
                limits.append(int(value))
    return min(limits) if limits else None


def available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable, in bytes, or None where the kernel does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class Budget:
    bytes: int
    source: str  # where it came from and its size, in words, for the log and the refusal


def find(max_memory: str | None) -> Budget | None:
    """The memory this run may use: --max-memory, else the cgroup's limit, else available + held; None: unknown."""
    if max_memory is not None:
        return Budget(parse_size(max_memory), f"--max-memory {max_memory}")
    limit = cgroup_limit()
    if limit is not None:
        return Budget(limit, f"the memory cgroup's limit ({fmt(limit)})")
    free = available()
    if free is None:
        return None
    total = free + process_memory.resident()
    return Budget(total, f"the machine's available memory ({fmt(total)})")


def fmt(size: int) -> str:
    """A size as the option takes it: 1.5 GiB → `1.5G`, rounded up."""
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale:
            return f"{-(-size * 10 // scale) / 10:g}{unit}"
    return str(size)


def streams(budget: Budget | None, footprint: int, weights: int, resident: int, largest_layer: int,
            activations: int, beside: int = 0, fit: int | None = None) -> bool:
    """Whether the weights stream (they do not fit `budget`, with `beside` bytes of a policy's weights held beside
    them, and `fit` bytes of activations: by default `activations`); refuses a budget too small even for streaming the
    reference alone, naming the smallest that would run."""
    fit = activations if fit is None else fit
    if budget is None or footprint + GROWTH + weights + beside + fit <= budget.bytes:
        return False
    smallest = footprint + GROWTH + resident + 2 * largest_layer + activations
    if smallest > budget.bytes:
        raise InputError(f"{budget.source} is too small for this model even streamed one layer at a time: it "
                         f"needs at least {fmt(smallest)} (this process {fmt(footprint + GROWTH)}, what stays loaded "
                         f"beside the layers {fmt(resident)}, two layers {fmt(2 * largest_layer)}, one pass's "
                         f"activations {fmt(activations)})")
    return True


def device_budget(max_memory: str | None, device: str) -> Budget:
    """A GPU's budget: --max-memory, else the memory CUDA device `device` has free now (what this process and others
    hold left out)."""
    from klpipe.model import runtime

    if max_memory is not None:
        return Budget(parse_size(max_memory), f"--max-memory {max_memory} on {device}")
    free = runtime.device_free_bytes(device)
    return Budget(free, f"{device}'s free memory ({fmt(free)})")


def pinned_bytes(nbytes: int) -> int:
    """What torch's pinned-memory allocator may take for a layer's buffer of `nbytes`: the buffer's room to align
    (model/tensor_files.py, a block), rounded up to a power of two (the allocator's rule below a threshold)."""
    return 1 << max(nbytes + 4096 - 1, 0).bit_length()


def refuse_short_host(device: str, resident: int, largest_layer: int) -> None:
    """A GPU's streamed run stages each layer in host memory (two pinned buffers) and reads what stays on the
    device through it once, at load: refused in one line, before anything loads, where the host cannot hold that."""
    host = find(None)
    if host is None:
        return
    process = process_memory.resident() + GROWTH
    needed = process + resident + 2 * pinned_bytes(largest_layer)
    if needed > host.bytes:
        raise InputError(f"{host.source} is too small to stage the layers streamed to {device}: it needs at least "
                         f"{fmt(needed)} (this process {fmt(process)}, what stays on the "
                         f"device, read once {fmt(resident)}, two pinned layer buffers "
                         f"{fmt(2 * pinned_bytes(largest_layer))})")


@dataclass(frozen=True)
class Streamed:
    """How a streamed run shares what the budget leaves after the weights' part."""

    tokens: int  # fed tokens a layer-major group of passes may hold
    cache_mib: int  # the prefix tree's kept keys and values (its --max-cache-mib, less where the budget is short)
    policy: bool = False  # whether a --policy with weights of its own streams too (else it is held in memory)
    # The own resident memory above which the streamer hands freed memory back to the kernel (model/allocator.py): the
    # budget less the room one pass needs at its widest. Below it, freed pages stay for reuse (no faults).
    trim_above: int | None = None
    # What the groups' fed tokens may hold, at `per_token` bytes each; what a group leaves of it keeps layers loaded
    # from group to group (model/layer_major.py). 0 where the policy streams too: two streamers would each keep layers.
    spare: int = 0
    per_token: int = 0

    def share(self, policy: bool = False) -> Streaming:
        """What the reference's streamer keeps to (the loader's contract.Streaming), or, `policy`, a streaming policy's:
        it keeps no layers from group to group, and sizes its groups by fed tokens."""
        if policy:
            return Streaming(self.tokens, self.trim_above)
        return Streaming(self.tokens, self.trim_above, self.spare, self.per_token)


@dataclass(frozen=True)
class InMemory:
    """A run whose weights fit its budget, where what the budget leaves caps the prefix tree's cache below its
    --max-cache-mib."""

    cache_mib: int


def decide(config, models, max_tokens: int, log, cache_mib: int = 0) -> Streamed | InMemory | None:
    """None where the reference's weights fit this run's budget (the in-memory path), or InMemory where what they
    leave of it caps the prefix tree's cache (`cache_mib` at most, half what is left at most: the tree's cache is
    not in the weights' sum, and 2 GiB on CPU, a quarter of a GPU by default, could take a tight Slurm job or a
    nearly full GPU over); else how a streamed run shares what is left (model/layer_major.py), after one line saying
    so: the prefix tree's cache (the same rule) and the fed tokens a layer-major group may hold. Refuses, before
    anything loads, a budget too small for streaming and what does not stream yet."""
    from klpipe.model import resolve_device, runtime, streamed_load  # torch lives behind this import

    device, device_map = resolve_device(models.spec.device)
    if device_map is not None:  # spread over several GPUs by accelerate: not one device's memory to budget
        return None
    # On a GPU the budget is the device's memory; what the process holds there before the weights load is what
    # torch's allocator has reserved (nothing, for a fresh process: its CUDA context is outside the free memory).
    gpu = device != "cpu"
    limit = device_budget(config.max_memory, device) if gpu else find(config.max_memory)
    sizes = streamed_load.measure(models.spec, max_tokens)  # None: a model built by its own code loads in memory
    # A --policy with weights of its own is held beside the reference: in memory where it fits, else streamed too.
    policy = streamed_load.measure(models.policy_spec, max_tokens) if models.policy_spec is not None else None
    footprint = runtime.device_reserved_bytes(device) if gpu else process_memory.resident()
    beside = policy.weights if policy is not None else 0
    if sizes is None:
        return None
    # LoRA adapters over the reference (--model's, --policy's) stay resident, in memory or streamed beside it.
    adapters = streamed_load.adapter_bytes(tuple(models.adapters)) if models.adapters else 0
    sizes.weights, sizes.resident = sizes.weights + adapters, sizes.resident + adapters
    weights = f"weights{' and adapters' if adapters else ''} ({fmt(sizes.weights)})"  # what the lines below count
    # On a GPU the weights alone decide whether they stream: a pass's activations are for --max-tokens-per-batch to
    # fit, and their estimate, on the safe side, would stream models that run in memory.
    fit = 0 if gpu else sizes.activations
    if limit is None or not streams(limit, footprint, sizes.weights, sizes.resident, sizes.largest_layer,
                                    sizes.activations, beside, fit):
        if limit is None or config.prefix_sharing == "off":
            return None
        left = limit.bytes - footprint - GROWTH - sizes.weights - beside - fit
        cap = max(left, 0) // 2 >> 20
        if cap >= cache_mib:
            return None
        log(f"{models.spec.name}: the prefix tree keeps up to {cap:,} MiB (--max-cache-mib {cache_mib:,}): what "
            f"{limit.source} leaves beside the weights{' and adapters' if adapters else ''}"
            f"{'' if gpu else ' and one pass'}, halved")
        return InMemory(cap)
    refused = ("--compile on" if config.compile == "on" else "--dtype float64" if config.dtype == "float64"
               else None)
    if refused is not None:
        raise InputError(f"the reference's {weights} do not fit {limit.source}, and streaming "
                         f"them does not run with {refused} yet")
    held = sizes.resident + 2 * sizes.largest_layer + beside
    activations = sizes.activations
    # The policy's sizes where it streams too; None where it is held in memory (or there is none).
    streaming = policy if policy is not None and footprint + GROWTH + held + sizes.activations > limit.bytes else None
    policy_streams = streaming is not None
    if streaming is not None:  # both stream: one runs at a time, so two layers of the larger at once
        held = sizes.resident + streaming.resident + 2 * max(sizes.largest_layer, streaming.largest_layer)
        activations = max(sizes.activations, streaming.activations)  # the wider pass of the two
        smallest = footprint + GROWTH + held + activations
        if smallest > limit.bytes:
            raise InputError(f"{limit.source} is too small for the reference and the policy even streamed one layer "
                             f"at a time: it needs at least {fmt(smallest)}")
    if gpu:
        refuse_short_host(device, sizes.resident + (streaming.resident if streaming is not None else 0),
                          max(sizes.largest_layer, streaming.largest_layer if streaming is not None else 0))
    spare = limit.bytes - footprint - GROWTH - held - activations
    # The tree's kept keys and values come out of the budget too (rows run whole keep none).
    cache = 0 if config.prefix_sharing == "off" else min(cache_mib << 20, max(spare, 0) // 2)
    spare -= cache
    # Each waiting pass keeps its residual stream and kin per token, and its thread's own buffers per pass.
    per_token = sizes.kept_per_token + streamed_load.PASS_OVERHEAD // max(max_tokens, 1)
    tokens = max(spare // max(per_token, 1), max_tokens)
    with_policy = " with the policy's" if models.policy_spec is not None else ""
    log(f"{models.spec.name}: its {weights}{with_policy} do not fit {limit.source}: its "
        f"decoder layers stream from their files{f' to {device}' if gpu else ''}, one at a time, over up to "
        f"{tokens:,} tokens of rows at once"
        + (", and so do the policy's" if policy_streams else ", the policy held in memory" if with_policy else "")
        + (f", the prefix tree keeping up to {cache >> 20:,} MiB" if cache else ""))
    return Streamed(tokens, cache >> 20, policy_streams, limit.bytes - activations,
                    0 if policy_streams else max(spare, 0), per_token)
