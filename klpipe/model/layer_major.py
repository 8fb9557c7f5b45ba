"""A reference model larger than the memory the job may use: its weights stream, one decoder layer at a time.

A chunk's passes run layer-major, each layer read once per group of passes rather than once per forward: every pass
of a group, each the model's own forward in a greenlet of its own, goes through layer k (loaded at its pre-forward
hook) before any goes through k + 1, while k + 1 is read in the background. docs/precompute.md, "How a streamed model
runs", says why it is built so and what each family needs of it.
"""

from __future__ import annotations

import contextvars
import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import greenlet
import torch

from klpipe.contract import Streaming
from klpipe.model import allocator
from klpipe.model.weight_store import WeightStore


class _Abandoned(BaseException):
    """Raised inside a waiting pass when its group stops (another pass failed, or a stop was asked for)."""


class _Pass:
    def __init__(self, call):
        self.call = call
        self.at = -1  # the layer it waits at; -1: not started
        self.done = False
        self.result = None
        self.error: BaseException | None = None
        self.greenlet: greenlet.greenlet | None = None


class LayerMajor:
    """The store's decoder layers, loaded at their hooks; `run` takes several passes through them layer-major."""

    # The run's figures (`figures`), besides the store's bytes read: what reset_statistics zeroes and what
    # `uncounted` leaves as it found it.
    STATISTICS = ("groups", "read_seconds", "waited_seconds", "group_seconds", "tokens")

    def __init__(self, store: WeightStore, share: Streaming | None = None):
        """`share`: what the budget gives the groups (precompute/budget.py decides it); None: no budget."""
        share = share if share is not None else Streaming()
        self.store = store
        allocator.one_arena()  # before the reader's thread: see allocator.py
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="klpipe-layer-read")
        self._ahead: tuple[int, Future[None]] | None = None  # (layer, its read's future)
        self._steps: dict = {}  # greenlet -> the _Pass it runs, in a group
        self._abandon = False
        # The process's own resident memory above which what it freed is handed back to the kernel (allocator.trim);
        # None: always. A run's budget, less room for its widest pass (precompute/budget.py).
        self.trim_above = share.trim_above
        self.layer_reads = 0  # layers read since load
        self.groups = 0  # groups run layer-major since load
        self.read_seconds = 0.0  # spent reading layers, in the background or not
        self.waited_seconds = 0.0  # of which the forwards waited for: the read not hidden under compute
        self.group_seconds = 0.0  # groups' wall time, waits included
        self.tokens = 0  # fed tokens the groups held, as their callers said
        # Memory the budget gives a group's waiting passes (`spare`, at `per_token` bytes a fed token: the run's
        # budget). What a group leaves of it keeps layers loaded from group to group (`kept`: layer -> bytes), read once
        # rather than once a group; 0: none kept.
        self.spare = share.spare
        self.per_token = share.per_token
        self.kept: dict[int, int] = {}
        self._room = 0  # what the group running now leaves for kept layers; 0 outside a group
        self._on_layer = None  # the running group's: see run
        self._hooks = [layer.register_forward_pre_hook(self._make_hook(k)) for k, layer in enumerate(store.layers)]
        self._hooks.append(store.layers[-1].register_forward_hook(self._after_last))

    def _after_last(self, module, args, output) -> None:
        """A forward on its own is over once its last layer is: nothing stays loaded (a group frees at its end)."""
        if self._steps.get(greenlet.getcurrent()) is None:
            self.release_all()

    def _make_hook(self, k: int):
        def hook(module, args):
            step = self._steps.get(greenlet.getcurrent())
            if step is None:  # a forward on its own: this layer now, the next in the background
                self.ensure(k)
                return
            if self._on_layer is not None:
                self._on_layer(k, False)
            step.at = k
            step.greenlet.parent.switch()  # back to the scheduler, until it resumes this pass
            if self._abandon:
                raise _Abandoned()
            if self._on_layer is not None:
                self._on_layer(k, True)
        return hook

    def ensure(self, k: int) -> None:
        """Layer k loaded (from the read ahead, or now), every other freed but the kept ones, the next layer not kept
        read in the background."""
        store = self.store
        started = time.perf_counter()
        # A kept layer computes while a later one is read ahead: that read is left to go on. Otherwise the read ahead
        # is waited for (k's own, or one not needed now, then freed).
        if self._ahead is not None and not (k in self.kept and store.loaded(k) and self._ahead[0] > k):
            layer = self._wait_ahead()
            if layer != k and layer not in self.kept:
                store.release(layer)
        ahead = self._ahead[0] if self._ahead is not None else None
        for other in range(len(store.layers)):  # before layer k is read: its buffer may be one of theirs
            if other not in (k, ahead) and other not in self.kept and store.loaded(other):
                store.release(other)
        if not store.loaded(k):
            self._read(k, self._keeps(k))
        self.waited_seconds += time.perf_counter() - started
        self._trim()  # the layers just freed given back, where the process is over (allocator.py)
        later = k + 1
        while later < len(store.layers) and later in self.kept and store.loaded(later):
            later += 1
        self._read_ahead(later)

    def _wait_ahead(self) -> int:
        """The layer read ahead, once its read is over; a read that failed raises its error here, its layer freed
        (none of it half loaded, nor kept), and nothing is left read ahead."""
        ahead, self._ahead = self._ahead, None
        assert ahead is not None, "a layer is waited for only where one is read ahead"
        layer, future = ahead
        try:
            future.result()
        except BaseException:
            self.kept.pop(layer, None)
            self.store.release(layer)
            raise
        return layer

    def _keeps(self, k: int) -> bool:
        """Whether layer k, about to be read, stays loaded from group to group (marked kept now): where what the group
        leaves of the budget holds it beside the layers kept already."""
        if k not in self.kept and sum(self.kept.values()) + self.store.sizes.layers[k] <= self._room:
            self.kept[k] = self.store.sizes.layers[k]
        return k in self.kept

    def _read_ahead(self, k: int) -> None:
        """Layer k read in the background, if there is one and it is not loaded or being read already."""
        if k < len(self.store.layers) and self._ahead is None and not self.store.loaded(k):
            self._ahead = (k, self._reader.submit(self._read, k, self._keeps(k)))

    def _read(self, k: int, keep: bool = False) -> None:
        started = time.perf_counter()
        self.store.load(k, own=keep)  # a kept layer in memory of its own: the two layer buffers are read into again
        self.layer_reads += 1
        self.read_seconds += time.perf_counter() - started

    def statistics(self) -> dict:
        """What streaming cost since load: bytes read, groups run, the share of the read hidden under compute, and
        where less than 90% hid, the fed tokens a group would need to hide it (its tokens scaled by read over compute
        time: the read is the same whatever the group holds, the compute grows with its tokens)."""
        hidden = max(1.0 - self.waited_seconds / self.read_seconds if self.read_seconds > 0 else 1.0, 0.0)
        figures: dict[str, float | None] = {"bytes_read": self.store.reads, "groups": self.groups, "hidden": hidden,
                                            "kept": len(self.kept), "layers": len(self.store.layers)}
        if self.store.device.type != "cpu":
            # On a GPU a layer's copy waits, in the device's one stream, behind the compute queued before it, and
            # the forwards wait for that copy: the host's clocks cannot tell the read from the compute. Not said.
            figures["hidden"] = None
            return figures
        compute = self.group_seconds - self.waited_seconds
        # Only where the reads outlast the compute: otherwise what did not hide is the first layer's read, which
        # nothing can overlap, and more tokens would not help.
        if hidden < 0.9 and self.tokens and self.groups and 0 < compute < self.read_seconds:
            figures["tokens_per_group"] = self.tokens // self.groups
            figures["tokens_to_hide"] = int(self.tokens / self.groups * self.read_seconds / compute) + 1
        return figures

    def reset_statistics(self) -> None:
        """From now on (the load-time probes' reads left out of the run's figures)."""
        self.store.reads = 0
        for name in self.STATISTICS:
            setattr(self, name, 0)

    @contextmanager
    def uncounted(self):
        """What runs inside (a probe, a cost measured once per model) left out of the run's figures."""
        saved = self.store.reads, [getattr(self, name) for name in self.STATISTICS]
        try:
            yield
        finally:
            self.store.reads = saved[0]
            for name, value in zip(self.STATISTICS, saved[1], strict=True):
                setattr(self, name, value)

    def release_all(self, room: int | None = None) -> None:
        """Every layer freed (after a forward on its own, or a group) but the kept ones; with `room` (a group's: see
        run), the last kept too while they hold more than that."""
        if self._ahead is not None:
            self._wait_ahead()
        while room is not None and sum(self.kept.values()) > room:
            self.kept.pop(max(self.kept))
        for k in range(len(self.store.layers)):
            if k not in self.kept and self.store.loaded(k):
                self.store.release(k)

    def run(self, calls: list, between=lambda: None, tokens: int = 0, held: int | None = None,
            on_layer=None, after_layer=None) -> list:
        """Each of `calls` (no arguments; each runs forwards of the model) in a greenlet of its own, layer-major:
        every call's forward through layer k before any call's through k + 1, the calls in their order within a
        layer. Their results, in order.

        `between` runs after each layer (a stop asked for raises there), after `after_layer(k)` once every call is
        past layer k; `on_layer(k, resumed)` in a call's own greenlet as it reaches layer k and as it goes on through
        it (layered.py). `tokens`: the fed tokens the calls hold, for the statistics; `held`: the bytes they hold
        while they wait, where the caller knows it better than `tokens` x `per_token` (tree.py)."""
        steps = [_Pass(call) for call in calls]
        self.groups += 1
        self.tokens += tokens
        started = time.perf_counter()
        # What this group's passes leave of the budget's room for them holds the layers kept; a group with more fed
        # tokens than the last frees kept layers first.
        self._room = max(self.spare - (tokens * self.per_token if held is None else held), 0)
        self.release_all(self._room)
        for step in steps:
            step.greenlet = greenlet.greenlet(functools.partial(self._body, step))
            step.greenlet.gr_context = contextvars.copy_context()  # each pass's own, as a thread's would be
            self._steps[step.greenlet] = step
        self._abandon, self._on_layer = False, on_layer
        first = next((k for k in range(len(self.store.layers)) if k not in self.kept or not self.store.loaded(k)), 0)
        self._read_ahead(first)  # while the passes embed their rows and run the layers kept
        # Every pass runs on this thread, so its torch state is theirs: inference mode for the whole group, so that
        # a pass's own inference-mode guards, entered and left out of order as the passes take turns, save and
        # restore the same state.
        try:
            with torch.inference_mode():
                for step in steps:  # each to its first layer (embeddings and what comes before it)
                    self._resume(step)
                while not all(step.done for step in steps):
                    k = min(step.at for step in steps if not step.done)
                    self.ensure(k)
                    for step in steps:
                        if not step.done and step.at == k:
                            self._resume(step)
                    if after_layer is not None:
                        after_layer(k)
                    between()
        except BaseException:
            self._abandon = True
            with torch.inference_mode():
                for step in steps:
                    if not step.done:
                        self._resume(step)
            raise
        finally:
            for step in steps:
                self._steps.pop(step.greenlet, None)
            self._room, self._on_layer = 0, None  # a forward on its own (a probe, the oracle) keeps no more
            self.release_all()
            self.group_seconds += time.perf_counter() - started
        return [step.result for step in steps]

    def _resume(self, step: _Pass) -> None:
        """Run `step` until it stops at its next layer or ends; its error, if it failed, raised here, so that no other
        pass runs on after it."""
        assert step.greenlet is not None, "run gives each pass its greenlet before any runs"
        step.greenlet.switch()
        # What the pass freed (its layer's activations) given back now if the process is over its allowance, before
        # the next pass allocates its own: otherwise a group's passes could together hold a layer's activations
        # several times over. Under it, the free pages stay for the next pass to reuse (allocator.py).
        self._trim()
        if step.error is not None and not self._abandon and not isinstance(step.error, _Abandoned):
            raise step.error

    def _trim(self) -> None:
        """What the process freed handed back to the kernel where it is over its allowance (allocator.py); on a GPU
        the layers and the passes' activations are the device's, held by torch's caching allocator: nothing to trim."""
        if self.store.device.type == "cpu":
            allocator.trim(self.trim_above)

    def _body(self, step: _Pass) -> None:
        try:
            if self._abandon:
                raise _Abandoned()
            step.result = step.call()
        except BaseException as exc:  # noqa: BLE001 - handed to the scheduler, which raises it
            step.error = exc
        finally:
            step.done = True

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._reader.shutdown(wait=True)
        self.store.close()


def figures(streamers: list) -> dict | None:
    """The streamed models' figures summed (the reference's, and the policy's where it streams too), or None."""
    if not streamers:
        return None
    figures = [s.statistics() for s in streamers]
    read = sum(s.read_seconds for s in streamers)
    waited = sum(s.waited_seconds for s in streamers)
    total = {"bytes_read": sum(f["bytes_read"] for f in figures), "groups": sum(f["groups"] for f in figures),
             "hidden": (None if any(f["hidden"] is None for f in figures)
                        else max(1.0 - waited / read, 0.0) if read > 0 else 1.0),
             "kept": sum(f["kept"] for f in figures), "layers": sum(f["layers"] for f in figures)}
    hint = next((f for f in figures if "tokens_to_hide" in f), None)  # where a model's read did not hide
    if hint is not None:
        total.update(tokens_per_group=hint["tokens_per_group"], tokens_to_hide=hint["tokens_to_hide"])
    return total
