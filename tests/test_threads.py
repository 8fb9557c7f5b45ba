import threading
import time

import pytest

from klpipe.threads import in_background, prefetch


def test_prefetch_yields_everything_in_order():
    assert list(prefetch(iter(range(100)), depth=2)) == list(range(100))


def test_prefetch_raises_the_producers_error_in_the_consumer():
    def items():
        yield 1
        raise ValueError("bad file")

    stream = prefetch(items())
    assert next(stream) == 1
    with pytest.raises(ValueError, match="bad file"):
        next(stream)


def test_leaving_prefetch_early_stops_the_producer():
    produced = []

    def items():
        for i in range(1000):
            produced.append(i)
            yield i

    stream = prefetch(items(), depth=2)
    assert next(stream) == 0
    stream.close()
    count = len(produced)
    time.sleep(0.05)
    assert len(produced) == count < 10  # bounded read-ahead, and nothing after close
    assert not [t for t in threading.enumerate() if t.name == "klpipe-prefetch"]


def test_in_background_consumes_everything_in_order_before_the_block_ends():
    seen = []
    with in_background(seen.append, depth=1) as submit:
        for i in range(50):
            submit(i)
    assert seen == list(range(50))


def test_in_background_raises_the_consumers_error():
    def consume(item):
        if item == 3:
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        with in_background(consume, depth=1) as submit:
            for i in range(10):
                submit(i)


def test_in_background_drops_queued_items_when_the_block_fails():
    seen = []

    def slow(item):
        time.sleep(0.01)
        seen.append(item)

    with pytest.raises(KeyError):
        with in_background(slow, depth=1) as submit:
            for i in range(5):
                submit(i)
            raise KeyError("scoring failed")
    assert len(seen) < 5
    assert not [t for t in threading.enumerate() if t.name == "klpipe-writer"]
