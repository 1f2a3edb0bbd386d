"""uvicorn's HTTP/1.1 protocol (httptools) with the limits a public endpoint needs and
uvicorn does not set: a request head of at most ``MAX_HEAD_BYTES``, complete within
``READ_TIMEOUT_S`` of its first byte (or of the connection's start), and a body whose pieces
arrive at most ``READ_TIMEOUT_S`` apart (nginx's ``client_header_timeout`` /
``client_body_timeout``). The wait between requests is uvicorn's keep-alive timeout's.

Without them, before any API key is checked: one 200 MiB header line held the event loop
for a minute (its value grows by concatenation) and the replicas' health checks failed
with it; 80 MiB of small headers took 1.2 GB; and a header line every 10 s, or a
connection that sends nothing, held a socket forever, until file descriptors ran out.

A request pipelined behind one whose response is still going out is not timed until its
turn comes (uvicorn stops reading it until then), and nothing is written for it before:
responses go out in order (RFC 9112 9.3.2). The class also fixes two things uvicorn (0.54)
gets wrong: a disconnect reaches only the newest request, and an HTTP/1.0 client gets a
chunked body it cannot decode."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

from uvicorn._types import ASGISendEvent
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

MAX_HEAD_BYTES = 1 << 20
READ_TIMEOUT_S = 30.0


class BoundedHttpProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # reading a request head (or waiting for the next one)
        self._head_bytes = 0
        # The parser saw the head begin: its bytes may have come with the previous request's,
        # uncounted in _head_bytes.
        self._head_begun = False
        self._deadline: asyncio.TimerHandle | None = None
        self._cycles: weakref.WeakSet[RequestResponseCycle] = weakref.WeakSet()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm(self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        # uvicorn tells only the newest request, which may be one pipelined behind the
        # running one; that one's receive() would never say http.disconnect, and the
        # gateway waits for it to abort the generation
        for cycle in self._cycles:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        # An idle connection over TLS is dropped, not closed: a TLS close waits (up to 30 s)
        # for the client's close_notify, which a pooled connection sends only when next
        # used, and the gateway's stop waited for each.
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self.scheme == "https":
            self.transport.abort()
        else:
            super().shutdown()

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, f"request head larger than {MAX_HEAD_BYTES} bytes")
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_begun = True
        if self._deadline is None and not self._behind_a_response():
            self._arm(self._head_timed_out)  # else the connection's, or on_response_complete's

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes, self._head_begun = False, 0, False
        self._disarm()
        previous = self.cycle
        super().on_headers_complete()
        if self.cycle is previous:
            return  # a websocket upgrade: the connection is no longer HTTP's
        self._cycles.add(self.cycle)
        if self.scope["http_version"] == "1.0":
            _delimit_by_close(self.cycle)
        if not self._behind_a_response():
            self._arm(self._body_timed_out)  # for the body, if one follows

    def on_body(self, body: bytes) -> None:
        if not self._behind_a_response():
            self._arm(self._body_timed_out)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_head = True
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts the next pipelined request, if any
        if self.transport.is_closing() or self._behind_a_response():
            return
        # what was read behind the response is timed from its end (a head begun: not by
        # uvicorn's keep-alive timeout, which is for a connection between requests)
        if self._in_head and (self._head_bytes or self._head_begun):
            self._unset_keepalive_if_required()
            self._arm(self._head_timed_out)
        elif not self._in_head and self.cycle.more_body and not self.cycle.response_complete:
            self._arm(self._body_timed_out)

    def _behind_a_response(self) -> bool:
        """Whether the request being read is pipelined behind another whose response is not
        over (the newest cycle is the request being read once its head is complete)."""
        if self._in_head:
            return self.cycle is not None and not self.cycle.response_complete
        return bool(self.pipeline)

    def _arm(self, on_timeout: Callable[[], None]) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(READ_TIMEOUT_S, on_timeout)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_timed_out(self) -> None:
        self._deadline = None
        if self._head_bytes or self._head_begun:
            self._refuse(408, f"request not received within {READ_TIMEOUT_S:g}s")
        else:
            self.transport.close()  # nothing sent

    def _body_timed_out(self) -> None:
        self._deadline = None
        if self.cycle.response_started:
            self.transport.close()  # a body stalled under a response already begun
        else:
            self._refuse(408, f"request not received within {READ_TIMEOUT_S:g}s")

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        if self._behind_a_response():
            # a status line now would land inside that response: end the connection after
            # it (and any queued before this request) instead; data_received drops the rest
            self.cycle.keep_alive = False
            return
        body = message.encode()
        self.transport.write(
            STATUS_LINE[status]
            + b"content-type: text/plain; charset=utf-8\r\n"
            + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            + body
        )
        self.transport.close()


def _delimit_by_close(cycle: RequestResponseCycle) -> None:
    """Sends a body of unknown length as it comes, ended by the connection's close, where
    uvicorn would chunk it: RFC 9112 6.1 forbids Transfer-Encoding in a response to HTTP/1.0,
    whose clients cannot decode it (uvicorn closes a 1.0 connection after its response)."""
    send = cycle.send
    unsized = False

    async def send_unchunked(message: ASGISendEvent) -> None:
        nonlocal unsized
        if message["type"] == "http.response.start":
            headers = message.get("headers", ())
            unsized = all(name.lower() != b"content-length" for name, _ in headers)
            if unsized:
                cycle.chunked_encoding = False
        elif message["type"] == "http.response.body" and unsized:
            # uvicorn counts an unchunked body down from its Content-Length: this has none
            cycle.expected_content_length = len(message.get("body", b""))
        await send(message)

    cycle.send = send_unchunked  # type: ignore[method-assign]
