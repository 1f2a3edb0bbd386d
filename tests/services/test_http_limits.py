"""The gateway's HTTP protocol bounds what a client can make it hold before any API key is
checked: the size of a request head, and how long the head and the body may take to
arrive, without breaking the HTTP/1.1 a client may use (pipelining, keep-alive, HTTP/1.0).
A real uvicorn server on a real socket, with the timeout shortened."""

import asyncio
import contextlib
import re
import socket
import threading
import time
from urllib import parse

import pytest
import uvicorn

from weir.services.gateway import http_limits
from weir.services.gateway.http_limits import MAX_HEAD_BYTES, BoundedHttpProtocol

TIMEOUT_S = 0.5
_left = threading.Event()  # /watch saw its client leave


async def _app(scope, receive, send):
    """Reads the whole body, then streams ?n pieces "x" (3 unless told: longer than the read
    timeout) half a read timeout apart, then "done", of a length not said up front; ?n=0:
    "done" at once, with its Content-Length. /watch first waits for its client to leave,
    as the gateway does to abort a request."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/watch":
        with contextlib.suppress(TimeoutError):
            if (await asyncio.wait_for(receive(), 5))["type"] == "http.disconnect":
                _left.set()
                return
    pieces = int(dict(parse.parse_qsl(scope["query_string"].decode())).get("n", 3))
    if not pieces:
        headers = [(b"content-length", b"4")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"done"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for _ in range(pieces):
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
        await asyncio.sleep(TIMEOUT_S / 2)
    await send({"type": "http.response.body", "body": b"done"})


# _app's streamed response, whole and chunked (RFC 9112 7.1)
STREAMED = rb"HTTP/1\.1 200 OK\r\n(?:[^\r\n]+\r\n)*\r\n(?:1\r\nx\r\n)+4\r\ndone\r\n0\r\n\r\n"


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


def _post(path: bytes = b"/", last: bool = False) -> bytes:
    """A request with a body; ``last``: the server closes the connection after it."""
    close = b"Connection: close\r\n" if last else b""
    return b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: 3\r\n\r\nabc" % (path, close)


def _read_response(sock: socket.socket) -> bytes:
    """One of _app's streamed responses (a keep-alive connection stays open after it)."""
    reply = b""
    while not reply.endswith(b"done\r\n0\r\n\r\n"):
        chunk = sock.recv(65536)
        assert chunk, reply
        reply += chunk
    assert re.fullmatch(STREAMED, reply), reply
    return reply


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


def _assert_dropped_after_the_read_timeout(sock: socket.socket) -> None:
    start = time.monotonic()
    reply = _read_all(sock)  # returns once the server closes
    waited = time.monotonic() - start
    assert TIMEOUT_S * 0.8 < waited < TIMEOUT_S * 6, waited
    assert reply in (b"",) or reply.startswith(b"HTTP/1.1 408"), reply


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
        _assert_dropped_after_the_read_timeout(sock)


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


def test_a_head_after_a_response_longer_than_the_read_timeout_is_timed_too(port):
    with _connect(port) as sock:
        sock.sendall(_post())
        _read_response(sock)
        sock.sendall(b"G")
        sock.settimeout(TIMEOUT_S * 6)
        _assert_dropped_after_the_read_timeout(sock)


def test_a_head_is_timed_from_its_first_byte_not_from_the_previous_request(port):
    """The wait between requests is keep-alive's, and the previous request's run nobody's."""
    with _connect(port) as sock:
        sock.sendall(_post(b"/?n=1"))  # answered within the read timeout
        _read_response(sock)
        time.sleep(TIMEOUT_S * 0.4)
        sock.sendall(b"GET /?n=1 HTTP/1.1\r\nHost: x\r\n")
        time.sleep(TIMEOUT_S / 2)  # past the read timeout of the first request's end
        sock.sendall(b"Connection: close\r\n\r\n")
        reply = _read_all(sock)
    assert re.fullmatch(STREAMED, reply), reply


def test_pipelined_requests_are_answered_in_order_however_slowly_they_arrive(port):
    """RFC 9112 9.3.2: a request pipelined behind a long response is read and timed once
    its turn comes, and nothing is written inside the response before it."""
    second_head, second_body = _post(last=True).split(b"\r\n\r\n")
    with _connect(port) as sock:
        sock.sendall(_post())
        time.sleep(TIMEOUT_S / 5)
        sock.sendall(second_head + b"\r\n\r\n")
        time.sleep(TIMEOUT_S / 5)
        sock.sendall(second_body)
        reply = _read_all(sock)
    assert re.fullmatch(STREAMED * 2, reply), reply


def test_a_head_pipelined_behind_a_long_response_is_timed_from_its_end(port):
    with _connect(port) as sock:
        sock.sendall(_post())
        time.sleep(TIMEOUT_S / 5)
        sock.sendall(b"GET /?n=1 HTTP/1.1\r\nHost: x\r\n")
        first = _read_response(sock)
        time.sleep(TIMEOUT_S / 5)
        sock.sendall(b"Connection: close\r\n\r\n")
        reply = first + _read_all(sock)
    assert re.fullmatch(STREAMED * 2, reply), reply


def test_a_head_begun_in_the_previous_requests_packet_is_timed_not_taken_for_idle(port):
    """A head that came with the request before it (its bytes read while that one's were)
    stalls: after that response it gets the read timeout's 408, not the silent close that
    uvicorn's keep-alive timeout (5 s) gives an idle connection."""
    with _connect(port) as sock:
        sock.sendall(_post() + b"GET /?n=1 HTTP/1.1\r\nHo")
        _read_response(sock)
        start = time.monotonic()
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert time.monotonic() - start < TIMEOUT_S * 6


def test_a_head_too_large_behind_a_response_ends_the_connection_after_it(port):
    with _connect(port) as sock:
        sock.sendall(_post() + b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ")
        for _ in range(2 * MAX_HEAD_BYTES // 65536):
            sock.sendall(b"a" * 65536)
        reply = _read_all(sock)
    assert re.fullmatch(STREAMED, reply), reply


def test_a_client_that_pipelines_and_leaves_is_seen_leaving_by_the_running_request(port):
    """The gateway aborts a request whose client left when its receive() says so."""
    _left.clear()
    with _connect(port) as sock:
        sock.sendall(_post(b"/watch") + b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(TIMEOUT_S / 5)
    assert _left.wait(TIMEOUT_S * 4)


@pytest.mark.parametrize(("path", "body"), [(b"/?n=1", b"xdone"), (b"/?n=0", b"done")])
def test_an_http_1_0_client_gets_no_transfer_coding(port, path, body):
    """RFC 9112 6.1: no Transfer-Encoding in a response to HTTP/1.0, which cannot decode it;
    a body of unknown length ends with the connection (6.3)."""
    with _connect(port) as sock:
        sock.sendall(b"POST %s HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc" % path)
        reply = _read_all(sock)
    head, _, rest = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower(), reply
    assert rest == body, reply
