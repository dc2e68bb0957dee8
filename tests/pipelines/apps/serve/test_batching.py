"""The detector's batching worker: who shares a call, bounded waiting, failures and cancelled requests."""

from __future__ import annotations

import threading
import time

import pytest

from pipelines.apps.serve.batching import Batcher


class Recorder:
    """fn(items) -> 10 * item; blocks its first call until released; refuses negative items."""

    def __init__(self):
        self.calls: list[list[int]] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, items: list[int]) -> list[int]:
        self.calls.append(list(items))
        self.entered.set()
        assert self.release.wait(10)
        if any(i < 0 for i in items):
            raise ValueError(f"negative item in {items}")
        return [10 * i for i in items]


def test_items_queued_behind_a_running_call_share_the_next_calls_up_to_max_batch():
    fn = Recorder()
    batcher = Batcher(fn, max_batch=3, max_wait_s=0.0, name="test")
    first = batcher.submit(1)
    assert fn.entered.wait(10)
    rest = [batcher.submit(i) for i in (2, 3, 4, 5)]
    assert batcher.queued() == 4
    fn.release.set()
    assert [f.result(10) for f in [first, *rest]] == [10, 20, 30, 40, 50]
    assert fn.calls == [[1], [2, 3, 4], [5]]
    assert list(batcher.recent_sizes) == [1, 3, 1] and (batcher.calls, batcher.items) == (3, 5)
    batcher.close()


def test_the_first_item_waits_for_others_at_most_max_wait():
    fn = Recorder()
    fn.release.set()
    batcher = Batcher(fn, max_batch=8, max_wait_s=0.5, name="test")
    started = time.monotonic()
    a = batcher.submit(1)
    time.sleep(0.05)
    b = batcher.submit(2)
    assert (a.result(10), b.result(10)) == (10, 20)
    assert fn.calls == [[1, 2]]
    lone = batcher.submit(3)
    assert lone.result(10) == 30 and fn.calls[-1] == [3]
    assert time.monotonic() - started < 5  # the wait is bounded (0.5 s per call here)
    batcher.close()


def test_a_failing_batch_is_rerun_item_by_item_so_only_the_bad_item_fails():
    fn = Recorder()
    batcher = Batcher(fn, max_batch=8, max_wait_s=0.0, name="test")
    first = batcher.submit(0)
    assert fn.entered.wait(10)
    good, bad, other = batcher.submit(1), batcher.submit(-1), batcher.submit(2)
    fn.release.set()
    assert first.result(10) == 0
    assert good.result(10) == 10 and other.result(10) == 20
    with pytest.raises(ValueError, match="negative item in \\[-1\\]"):
        bad.result(10)
    assert fn.calls == [[0], [1, -1, 2], [1], [-1], [2]]
    batcher.close()


def test_items_cancelled_while_queued_are_never_run():
    fn = Recorder()
    batcher = Batcher(fn, max_batch=8, max_wait_s=0.0, name="test")
    first = batcher.submit(1)
    assert fn.entered.wait(10)
    dropped, kept = batcher.submit(2), batcher.submit(3)
    assert dropped.cancel()
    fn.release.set()
    assert (first.result(10), kept.result(10)) == (10, 30)
    assert fn.calls == [[1], [3]]
    batcher.close()


def test_close_finishes_what_is_queued():
    fn = Recorder()
    batcher = Batcher(fn, max_batch=2, max_wait_s=0.0, name="test")
    first = batcher.submit(1)
    assert fn.entered.wait(10)
    queued = [batcher.submit(i) for i in (2, 3, 4)]
    fn.release.set()
    batcher.close()
    assert [f.result(0) for f in [first, *queued]] == [10, 20, 30, 40]


@pytest.mark.parametrize(("max_batch", "max_wait_s"), [(0, 0.0), (2, -1.0)])
def test_bad_settings_are_refused(max_batch, max_wait_s):
    with pytest.raises(ValueError, match="must be >= "):
        Batcher(lambda items: items, max_batch, max_wait_s, name="test")
