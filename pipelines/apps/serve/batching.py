"""A worker thread running a function on batches of queued items: requests arriving together share a call."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

_STOP = object()


class Batcher(Generic[T, R]):
    """Runs `fn(items) -> results` (one result per item, in order) on one worker thread.

    After the first queued item, the worker waits at most `max_wait_s` for more, up to `max_batch`;
    items whose futures were cancelled while queued (their request timed out) are dropped. When a batch
    fails, its items are run one by one so that one bad item fails only its own future.
    """

    def __init__(self, fn: Callable[[list[T]], Sequence[R]], max_batch: int, max_wait_s: float, name: str):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.fn = fn
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.calls = 0
        self.items = 0
        self.recent_sizes: deque[int] = deque(maxlen=1000)  # batch sizes of the latest calls
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: T) -> Future[R]:
        """Queue `item`; the future gets its result or the exception the function raised for it."""
        future: Future[R] = Future()
        self._queue.put((item, future))
        return future

    def queued(self) -> int:
        """Items waiting for the worker (not counting the batch it is running)."""
        return self._queue.qsize()

    def close(self) -> None:
        """Finish what is queued, then stop the worker."""
        self._queue.put(_STOP)
        self._thread.join()

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch, stop = self._gather(first)
            live = [(item, fut) for item, fut in batch if fut.set_running_or_notify_cancel()]
            if live:
                self._run(live)
            if stop:
                return

    def _gather(self, first) -> tuple[list, bool]:
        batch = [first]
        deadline = time.monotonic() + self.max_wait_s
        while len(batch) < self.max_batch:
            remaining = deadline - time.monotonic()
            try:  # items already queued join at once; more are awaited until max_wait_s is over
                entry = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if entry is _STOP:
                return batch, True
            batch.append(entry)
        return batch, False

    def _run(self, live: list) -> None:
        self.calls += 1
        self.items += len(live)
        self.recent_sizes.append(len(live))
        try:
            results = self.fn([item for item, _ in live])
            if len(results) != len(live):
                raise RuntimeError(
                    f"{self._thread.name} returned {len(results)} results for {len(live)} items"
                )
        except Exception as exc:
            if len(live) == 1:
                live[0][1].set_exception(exc)
                return
            log.warning(
                "%s: a batch of %d failed (%s); running its items one by one",
                self._thread.name,
                len(live),
                exc,
            )
            for entry in live:
                self._run([entry])
            return
        for (_, fut), result in zip(live, results, strict=True):
            fut.set_result(result)
