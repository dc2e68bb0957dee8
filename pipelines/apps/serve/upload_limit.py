"""ASGI middleware refusing request bodies above a byte limit with a JSON 413, before they are parsed."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class UploadTooLarge(HTTPException):
    """Raised while the body streams in; an HTTPException so FastAPI's form parsing passes it through."""

    def __init__(self, limit: int):
        super().__init__(status_code=413, detail=too_large_message(limit))


def too_large_message(limit: int) -> str:
    return f"the upload is larger than the server's {limit / 2**20:g} MiB limit; send a smaller image"


class UploadLimit:
    """Checks Content-Length up front and counts the bytes of bodies sent without one (chunked)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

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
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise UploadTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)
