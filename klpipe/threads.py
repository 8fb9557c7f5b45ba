"""Background threads that overlap reading and writing with compute, with bounded queues.

Parquet decoding and encoding and large numpy operations release the GIL, so on two cores a
reader thread, the main thread and a writer thread run side by side. Queues hold at most `depth`
items, which keeps memory bounded, and an exception in any thread surfaces in the caller.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


def prefetch(items: Iterable[T], depth: int = 2) -> Iterator[T]:
    """Yield `items`, produced up to `depth` ahead in a background thread.

    Leaving the loop early (an error, a break) stops the producer before this generator returns.
    """
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                if stop.is_set():
                    return
                slots.put(item)
            slots.put(_DONE)
        except BaseException as exc:  # raised again in the consumer's thread
            slots.put(exc)

    thread = threading.Thread(target=produce, name="klpipe-prefetch", daemon=True)
    thread.start()
    try:
        while (item := slots.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                slots.get(timeout=0.05)
            except queue.Empty:
                pass


@contextmanager
def in_background(consume: Callable[[T], None], depth: int = 2) -> Iterator[Callable[[T], None]]:
    """Yield a `submit(item)` that hands items, in order, to `consume` running in a thread.

    On a normal exit every submitted item has been consumed before the block ends; an error in
    `consume` is raised from the next `submit` or at the end. When the block itself fails, items
    still queued are dropped.
    """
    slots: queue.Queue = queue.Queue(maxsize=depth)
    failure: list[BaseException] = []

    def run() -> None:
        while (item := slots.get()) is not _DONE:
            if failure:
                continue  # drain, so that submit never blocks on a dead consumer
            try:
                consume(item)
            except BaseException as exc:
                failure.append(exc)

    thread = threading.Thread(target=run, name="klpipe-writer", daemon=True)
    thread.start()

    def submit(item: T) -> None:
        if failure:
            raise failure[0]
        slots.put(item)

    try:
        yield submit
    except BaseException:
        failure.append(RuntimeError("abandoned"))  # makes the thread drop what is queued
        slots.put(_DONE)
        thread.join()
        raise
    slots.put(_DONE)
    thread.join()
    if failure:
        raise failure[0]
