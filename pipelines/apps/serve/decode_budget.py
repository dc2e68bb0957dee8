"""`DecodeBudget`: the memory the server's image decoding may hold at once; uploads wait their turn in
arrival order, and are refused with 503 when the wait runs out (413 when one image alone is too big)."""

from __future__ import annotations

import asyncio
from collections import deque

from pipelines.apps.serve.service import ServiceError


class DecodeBudget:
    """Bytes of decoding in flight; every method runs on the event loop (release from a worker thread
    through `loop.call_soon_threadsafe`)."""

    def __init__(self, total_bytes: int, wait_s: float):
        self.total = total_bytes
        self.wait_s = wait_s
        self.used = 0
        self._waiting: deque[tuple[int, asyncio.Future]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self, cost: int, name: str) -> None:
        """Hold `cost` bytes of the budget for decoding `name`, waiting up to `wait_s` behind earlier
        uploads; the caller must `release(cost)` once the decoded pixels are gone."""
        if cost > self.total:
            raise ServiceError(
                413,
                f"image {name!r} needs about {_mib(cost)} to decode, above the server's {_mib(self.total)} "
                "decoding budget (--max-decode-mb); send a smaller image or one in JPEG, which is "
                "decoded at the detector's working size",
            )
        if not self._waiting and self.used + cost <= self.total:
            self.used += cost
            return
        granted = asyncio.get_running_loop().create_future()
        entry = (cost, granted)
        self._waiting.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(granted), self.wait_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if granted.done():  # granted as the wait ended: give it back
                self.release(cost)
            else:
                granted.cancel()
                self._waiting.remove(entry)
                self._grant()  # a big upload at the head may have held smaller ones back
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise ServiceError(
                503,
                f"server busy decoding other images: {_mib(self.used)} of its {_mib(self.total)} decoding "
                f"budget (--max-decode-mb) stayed in use for {self.wait_s:g} s; retry shortly",
                {"Retry-After": "1"},
            ) from None

    def release(self, cost: int) -> None:
        self.used -= cost
        self._grant()

    def _grant(self) -> None:
        """Admit waiting uploads in arrival order while the next one fits."""
        while self._waiting and self.used + self._waiting[0][0] <= self.total:
            cost, granted = self._waiting.popleft()
            self.used += cost
            granted.set_result(None)


def _mib(size: int) -> str:
    return f"{size / 2**20:.0f} MiB"
