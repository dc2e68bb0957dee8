"""ASGI middleware refusing request bodies above a byte limit with a JSON 413, before they are parsed, and
bodies that stop arriving with a JSON 408."""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class UploadTooLarge(HTTPException):
    """Raised while the body streams in; an HTTPException so FastAPI's form parsing passes it through."""

    def __init__(self, limit: int):
        super().__init__(status_code=413, detail=too_large_message(limit))


def too_large_message(limit: int) -> str:
    return f"the upload is larger than the server's {limit / 2**20:g} MiB limit; send a smaller image"


class BodyStalled(HTTPException):
    """The body's next bytes did not come in time (a client sending less than its Content-Length)."""

    def __init__(self, seconds: float):
        super().__init__(
            status_code=408,
            detail=f"the request body stopped arriving (nothing for {seconds:g} s); send it again",
        )


class UploadLimit:
    """Checks Content-Length up front, counts the bytes of bodies sent without one (chunked), and waits at
    most `body_seconds` for each part of a body (a connection held open by a short body frees its slot)."""

    def __init__(self, app: ASGIApp, max_bytes: int, body_seconds: float = 30.0):
        self.app = app
        self.max_bytes = max_bytes
        self.body_seconds = body_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            message = too_large_message(self.max_bytes) if length.isdigit() else "invalid Content-Length"
            response = JSONResponse({"error": message}, status_code=413 if length.isdigit() else 400)
            await response(scope, receive, send)
            return
        received, complete = 0, False

        async def counted() -> Message:
            nonlocal received, complete
            if complete:  # the body is in: later calls wait for the client to leave, as long as it likes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_seconds)
            except TimeoutError:
                raise BodyStalled(self.body_seconds) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > self.max_bytes:
                    raise UploadTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)
