"""Background threads that overlap reading and writing with compute, with bounded queues.

Parquet decoding and encoding and large numpy operations release the GIL, so on two cores a
reader thread, the main thread and a writer thread run side by side. Queues hold at most `depth`
items, which keeps memory bounded, and an exception in any thread surfaces in the caller.

`prefetch` reads ahead (precompute's chunks, score's record batches); `in_background` writes behind
(score's row groups; precompute's chunk checkpoints, which must survive a stop, hence `on_error`).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


def prefetch(items: Iterable[T], depth: int = 2) -> Generator[T, None, None]:
    """Yield `items`, produced up to `depth` ahead in a background thread.

    `depth` counts every item the thread holds, the one it is producing included: it waits for room
    before it starts the next one, not after (a queue of `depth` beside a producer blocked on a full
    queue held `depth + 1`). The consumer's item is its own.
    Leaving the loop early (an error, a break) stops the producer before this generator returns.
    """
    if depth < 1:
        raise ValueError("depth must be 1 or more")
    room = threading.Semaphore(depth)
    slots: queue.SimpleQueue = queue.SimpleQueue()  # never more than `depth`: `room` is taken first
    stop = threading.Event()

    def produce() -> None:
        try:
            iterator = iter(items)
            while True:
                room.acquire()
                if stop.is_set():
                    return
                item = next(iterator, _DONE)
                slots.put(item)
                if item is _DONE:
                    return
                del item  # handed over: the queue's, then the consumer's
        except BaseException as exc:  # noqa: BLE001 - raised again in the consumer's thread
            slots.put(exc)

    thread = threading.Thread(target=produce, name="klpipe-prefetch", daemon=True)
    thread.start()
    try:
        while (item := slots.get()) is not _DONE:
            room.release()
            if isinstance(item, BaseException):
                raise item
            yield item
            del item  # the consumer has moved on: not kept while the next one is waited for
    finally:
        stop.set()
        room.release()  # a producer waiting for room wakes, sees the stop and ends
        thread.join()


class Background:
    """Hands items, in order, to `consume` running in a thread; at most `depth` queued beside the one in hand.

    `depth=0`: an item is handed over only once the last one is consumed, so the caller is never more
    than one item ahead of the thread. One thread submits (the caller): after `wait_for_room`,
    `submit` does not block.
    """

    def __init__(self, consume: Callable[[T], None], depth: int = 2, name: str = "klpipe-writer"):
        if depth < 0:
            raise ValueError("depth must be 0 or more")
        self._consume = consume
        self._most = depth + 1  # pending items at most: the queued ones and the one in hand
        self._items: deque = deque()  # queued, not yet taken by the thread
        self._pending = 0  # queued plus the one being consumed
        self._closed = False  # nothing more will be submitted: the thread ends once the queue is empty
        self._failure: BaseException | None = None
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._items and not self._closed:
                    self._changed.wait()
                if not self._items:
                    return
                item = self._items.popleft()
            try:
                self._consume(item)
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
                with self._changed:
                    self._failure = exc
                    self._items.clear()  # nothing after a failed item is consumed: they keep their order
                    self._pending = 0
                    self._changed.notify_all()
                return
            del item  # consumed (a chunk written): released now, not once the next item arrives
            with self._changed:
                self._pending -= 1
                self._changed.notify_all()

    def check(self) -> None:
        """Raise the consumer's error, if it failed; for callers to stop promptly between steps of their own."""
        if self._failure is not None:
            raise self._failure

    def wait_for_room(self) -> None:
        """Block until an item can be submitted without waiting; raises the consumer's error."""
        self._wait_for_room()

    def _wait_for_room(self) -> None:
        with self._changed:
            while self._pending >= self._most and self._failure is None:
                self._changed.wait()
        self.check()

    def submit(self, item: T) -> None:
        self._wait_for_room()
        with self._changed:
            self._items.append(item)
            self._pending += 1
            self._changed.notify_all()

    __call__ = submit

    def finish(self) -> None:
        """Consume everything submitted, end the thread; raises the consumer's error."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()
        self.check()

    def abandon(self) -> None:
        """Drop what is queued, and wait for the item in hand: nothing is consumed once this returns."""
        with self._changed:
            self._pending -= len(self._items)
            self._items.clear()
            self._closed = True
            self._changed.notify_all()
        self._thread.join()


@contextmanager
def in_background(consume: Callable[[T], None], depth: int = 2, on_error: str = "drop") -> Iterator[Background]:
    """Yield a Background: `submit(item)` (or call it) hands items, in order, to `consume` in a thread.

    On a normal exit every submitted item has been consumed before the block ends; an error in
    `consume` is raised from the next `submit`, `check` or at the end. When the block itself fails,
    items still queued are dropped (`on_error="drop"`), or consumed first (`on_error="finish"`:
    they are finished work, such as a computed chunk). Either way the thread has stopped before the
    block's error goes on, so nothing is consumed after the block.
    """
    if on_error not in ("drop", "finish"):
        raise ValueError(f"on_error must be drop or finish, not {on_error!r}")
    background = Background(consume, depth)
    try:
        yield background
    except BaseException:
        if on_error == "drop":
            background.abandon()
        else:
            # The block's error is what stopped the run: it goes on, whatever finishing raises.
            with suppress(Exception):
                background.finish()
        raise
    background.finish()
