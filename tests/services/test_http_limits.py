"""The gateway's HTTP protocol bounds what a client can make it hold before any API key is
checked: the size of a request head, and how long the head and the body may take to
arrive. A real uvicorn server on a real socket, with the timeout shortened."""

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from weir.services.gateway import http_limits
from weir.services.gateway.http_limits import MAX_HEAD_BYTES, BoundedHttpProtocol

TIMEOUT_S = 0.5


async def _app(scope, receive, send):
    """Reads the whole body, then streams for longer than the read timeout."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for _ in range(4):
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
        await asyncio.sleep(TIMEOUT_S / 2)
    await send({"type": "http.response.body", "body": b"done"})


@pytest.fixture(scope="module")
def port():
    patch = pytest.MonkeyPatch()
    patch.setattr(http_limits, "READ_TIMEOUT_S", TIMEOUT_S)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_app, http=BoundedHttpProtocol, log_level="error", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield listener.getsockname()[1]
    server.should_exit = True
    thread.join(10)
    patch.undo()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """What the server sent before it closed; a reset (it closed with our bytes unread)
    may have dropped its reply: b"" then."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        return b""
    return b"".join(chunks)


def test_a_whole_request_is_served_however_long_its_response(port):
    with _connect(port) as sock:
        sock.sendall(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc"
        )
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"done\r\n0\r\n\r\n"), reply


def test_a_head_larger_than_the_limit_is_431_as_soon_as_it_passes_it(port):
    start = time.monotonic()
    with _connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ")
        try:  # the server closes while the value still streams (unless buffers take it all)
            for _ in range(4 * MAX_HEAD_BYTES // 65536):
                sock.sendall(b"a" * 65536)
        except OSError:
            pass
        reply = _read_all(sock)
    assert reply == b"" or reply.startswith(b"HTTP/1.1 431"), reply
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # a connection that says nothing
        b"GET / HTTP/1.1\r\nHost: x\r\n",  # a head never finished
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc",  # a body stalled
    ],
)
def test_a_request_that_stops_arriving_is_dropped_after_the_read_timeout(port, sent):
    with _connect(port) as sock:
        sock.sendall(sent)
        start = time.monotonic()
        reply = _read_all(sock)  # returns once the server closes
        waited = time.monotonic() - start
    assert TIMEOUT_S * 0.8 < waited < TIMEOUT_S * 6, waited
    assert reply in (b"",) or reply.startswith(b"HTTP/1.1 408"), reply


def test_a_head_trickled_in_does_not_reset_its_deadline(port):
    """slowloris: a header line every so often kept a connection open for ever."""
    with _connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        try:
            for i in range(40):
                time.sleep(TIMEOUT_S / 5)
                sock.sendall(b"X-%d: y\r\n" % i)
        except OSError:
            pass
        reply = _read_all(sock)
    assert reply == b"" or reply.startswith(b"HTTP/1.1 408"), reply
    assert time.monotonic() - start < TIMEOUT_S * 6
