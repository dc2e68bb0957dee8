"""The server's request deadline and connection bound, against loopback clients that stop by themselves:
slow clients are answered 408 and disconnected within the deadline, whatever their pace, while normal
requests are still answered; connections beyond the bound get 503."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from pipelines.apps.serve.config import ServeConfig
from pipelines.apps.serve.http_server import make_server

DEADLINE = 2.0
GIVE_UP = 10.0  # every client stops by itself after this long


async def echo(scope, receive, send) -> None:
    """A minimal ASGI app: reads the whole body, answers its length."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = json.dumps({"received": size}).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def serving(config: ServeConfig) -> Iterator[int]:
    server = make_server(echo, config, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    started = time.monotonic()
    while not server.started:
        assert thread.is_alive() and time.monotonic() - started < 30, "the test server did not start"
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)


def slow_client(port: int, first: bytes, drip: bytes, every: float, out: list) -> None:
    """Send `first`, then `drip` every `every` s, until the server closes the connection (or GIVE_UP);
    append (seconds from the first byte to the close, what the server sent)."""
    reply = b""
    with socket.create_connection(("127.0.0.1", port), timeout=GIVE_UP) as sock:
        started = time.monotonic()
        sock.sendall(first)
        sock.settimeout(every)
        while time.monotonic() - started < GIVE_UP:
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                with contextlib.suppress(OSError):
                    sock.sendall(drip)
                continue
            except OSError:
                break
            if not chunk:
                break
            reply += chunk
        out.append((time.monotonic() - started, reply))


def request(port: int, raw: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=GIVE_UP) as sock:
        sock.sendall(raw)
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    return reply


SLOW_BODY = (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n", b"a")
SLOW_HEADERS = (b"GET /echo HTTP/1.1\r\nHost: x\r\n", b"X-More: 1\r\n")
NORMAL = b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 5\r\n\r\nhello"


@pytest.mark.parametrize("every", [0.3, 1.5])
def test_slow_clients_get_408_within_the_deadline_while_others_are_answered(every):
    config = ServeConfig(port=0, request_timeout_s=DEADLINE, max_connections=32)
    with serving(config) as port:
        results: list = []
        clients = [
            threading.Thread(target=slow_client, args=(port, *kind, every, results))
            for kind in [SLOW_BODY] * 5 + [SLOW_HEADERS] * 5
        ]
        for client in clients:
            client.start()
        time.sleep(DEADLINE / 2)
        answered = time.monotonic()
        normal = request(port, NORMAL)  # while the ten slow ones are held
        answered = time.monotonic() - answered
        for client in clients:
            client.join(GIVE_UP + 5)
    assert normal.startswith(b"HTTP/1.1 200") and b'{"received": 5}' in normal and answered < DEADLINE
    assert len(results) == 10
    for seconds, reply in results:
        assert DEADLINE - 0.5 < seconds < DEADLINE + 2, (seconds, reply)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert "did not arrive whole within 2 s" in json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]


def test_connections_beyond_the_bound_get_503():
    config = ServeConfig(port=0, request_timeout_s=DEADLINE, max_connections=3)
    with serving(config) as port:
        results: list = []
        held = [
            threading.Thread(target=slow_client, args=(port, *SLOW_HEADERS, 0.3, results)) for _ in range(3)
        ]
        for client in held:
            client.start()
        time.sleep(DEADLINE / 2)
        refused = request(port, NORMAL)
        for client in held:
            client.join(GIVE_UP + 5)
        answered = request(port, NORMAL)  # the held ones are gone: room again
    assert refused.startswith(b"HTTP/1.1 503"), refused
    assert answered.startswith(b"HTTP/1.1 200"), answered
    assert [reply[:12] for _, reply in results] == [b"HTTP/1.1 408"] * 3
