"""The uvicorn server `xmodal serve` runs: each request must arrive whole (headers and body) within a
deadline, and the connections held at once are bounded (uvicorn's `limit_concurrency`: more get 503)."""

from __future__ import annotations

import asyncio
import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pipelines.apps.serve.config import ServeConfig


def _timeout_response(seconds: float) -> bytes:
    body = json.dumps(
        {"error": f"the request did not arrive whole within {seconds:g} s (headers and body); send it again"}
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode("ascii") + body


class _DeadlineProtocol(H11Protocol):
    """h11 with a deadline on reading each request: armed when a connection opens and when the next request
    on a kept-alive one begins, met once the request's headers and body are in (h11's `their_state` is
    DONE). Uvicorn's own limits act on idle kept-alive connections and on each read, so a client sending
    one byte every few seconds would otherwise hold its connection forever."""

    request_seconds = 60.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            self._arm()  # bytes of a next request on a kept-alive connection: its own deadline
        elif self.conn.their_state is not h11.SEND_BODY:
            self._disarm()  # the request is in (or the connection is done)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.request_seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        headers_in = self.conn.their_state is not h11.IDLE  # else self.cycle is an earlier request's
        if not (headers_in and self.cycle is not None and self.cycle.response_started):
            # nothing of this request's response was sent: say why the connection ends
            self.transport.write(_timeout_response(self.request_seconds))
        self.transport.close()


def make_server(app, config: ServeConfig, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for `app` with `config`'s request deadline and connection bound."""
    protocol = type("DeadlineProtocol", (_DeadlineProtocol,), {"request_seconds": config.request_timeout_s})
    return uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            http=protocol,
            limit_concurrency=config.max_connections,
            log_level=log_level,
        )
    )
