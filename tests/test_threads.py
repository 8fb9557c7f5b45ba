import threading
import time
import weakref

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


class Chunk:
    """Stands for a chunk of rows (40 MB of them in precompute): tests count the ones still alive."""


def test_prefetch_holds_at_most_depth_items_beside_the_consumers():
    # depth counts the item being produced: a producer blocked on a full queue of `depth` held one more,
    # and precompute a 40 MB chunk more than it said.
    for depth in (1, 2):
        alive = weakref.WeakSet()

        def items(alive):
            for _ in range(8):
                chunk = Chunk()
                alive.add(chunk)
                yield chunk
                del chunk

        counts = []
        for _item in prefetch(items(alive), depth):
            time.sleep(0.05)  # a slow consumer: the producer fills all the room it has
            counts.append(len(alive))
        assert max(counts) == depth + 1, (depth, counts)  # the room ahead, and the consumer's own


def test_in_background_lets_go_of_an_item_once_it_is_consumed():
    # Write behind: the writer thread kept a written chunk until the next one came, a chunk more held.
    alive = weakref.WeakSet()
    with in_background(lambda item: None, depth=0) as background:
        for _ in range(3):
            chunk = Chunk()
            alive.add(chunk)
            background.submit(chunk)
            del chunk
            background.wait_for_room()  # consumed
            assert len(alive) == 0

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

    with pytest.raises(OSError, match="disk full"), in_background(consume, depth=1) as submit:
        for i in range(10):
            submit(i)


def test_in_background_drops_queued_items_when_the_block_fails():
    seen = []

    def slow(item):
        time.sleep(0.01)
        seen.append(item)

    with pytest.raises(KeyError), in_background(slow, depth=1) as submit:
        for i in range(5):
            submit(i)
        raise KeyError("scoring failed")
    assert len(seen) < 5
    assert not [t for t in threading.enumerate() if t.name == "klpipe-writer"]


def test_depth_0_hands_an_item_over_only_once_the_last_is_consumed():
    # Write behind in precompute: the model is never more than one chunk ahead of the disk.
    log = []

    def consume(item):
        log.append(f"consumed {item}")

    with in_background(consume, depth=0) as background:
        for i in range(20):
            background.submit(i)
            log.append(f"handed {i}")
    handed = [log.index(f"handed {i}") for i in range(20)]
    consumed = [log.index(f"consumed {i}") for i in range(20)]
    assert all(consumed[i] < handed[i + 1] for i in range(19)), log
    assert [line for line in log if line.startswith("consumed")] == [f"consumed {i}" for i in range(20)]


def test_wait_for_room_waits_for_the_item_in_hand_then_submit_does_not_block():
    release, started = threading.Event(), threading.Event()
    order = []

    def consume(item):
        started.set()
        assert release.wait(timeout=30)
        order.append(f"consumed {item}")

    with in_background(consume, depth=0) as background:
        background.submit(0)
        assert started.wait(timeout=30)
        threading.Thread(target=lambda: (order.append("released"), release.set())).start()
        background.wait_for_room()
        order.append("room")
        background.submit(1)
    assert order == ["released", "consumed 0", "room", "consumed 1"]


@pytest.mark.parametrize("stop", [KeyError, KeyboardInterrupt])  # an error, or Ctrl-C (SIGINT)
def test_on_error_finish_consumes_what_was_submitted_before_the_blocks_error_goes_on(stop):
    # A stop (SIGTERM: Preempted; SIGINT) in precompute: the chunk computed and handed over is still written.
    seen = []

    def slow(item):
        time.sleep(0.01)
        seen.append(item)

    with pytest.raises(stop), in_background(slow, depth=1, on_error="finish") as background:
        for i in range(5):
            background.submit(i)
        raise stop("stopped")
    assert seen == list(range(5))
    assert not [t for t in threading.enumerate() if t.name == "klpipe-writer"]


def test_check_raises_the_consumers_error_without_a_submit():
    # precompute calls check between the model's batches, so a full disk stops the model at once.
    failed = threading.Event()

    def consume(item):
        failed.set()
        raise OSError(28, "No space left on device")

    raises = pytest.raises(OSError, match="No space left")
    with raises, in_background(consume, depth=0, on_error="finish") as background:
        background.submit(0)
        assert failed.wait(timeout=30)
        with pytest.raises(OSError, match="No space left"):
            background.wait_for_room()
        background.check()
        raise AssertionError("check did not raise")


def test_on_error_finish_keeps_the_blocks_error_when_the_consumer_fails_too():
    def consume(item):
        raise OSError(28, "No space left on device")

    with pytest.raises(KeyError, match="stopped"), in_background(consume, depth=1, on_error="finish") as background:
        background.submit(0)
        raise KeyError("stopped")
