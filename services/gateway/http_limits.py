"""uvicorn's HTTP/1.1 protocol (httptools) with the limits a public endpoint needs and
uvicorn does not set: a request head of at most ``MAX_HEAD_BYTES``, complete within
``READ_TIMEOUT_S`` of its start, and a body whose pieces arrive at most ``READ_TIMEOUT_S``
apart (nginx's ``client_header_timeout`` / ``client_body_timeout``).

Without them, before any API key is checked: one 200 MiB header line held the event loop
for a minute (its value grows by concatenation) and the replicas' health checks failed
with it; 80 MiB of small headers took 1.2 GB; and a header line every 10 s, or a
connection that sends nothing, held a socket forever, until file descriptors ran out."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

MAX_HEAD_BYTES = 1 << 20
READ_TIMEOUT_S = 30.0


class BoundedHttpProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # reading a request head (or waiting for the next one)
        self._head_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, f"request head larger than {MAX_HEAD_BYTES} bytes")
                return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        self._arm()  # for the body, if one follows
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._arm()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_head = True
        self._arm()  # the next head (an idle connection is closed sooner: keep-alive)
        super().on_message_complete()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(READ_TIMEOUT_S, self._read_timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _read_timed_out(self) -> None:
        self._deadline = None
        if self._in_head and not self._head_bytes:
            if self.cycle is not None and not self.cycle.response_complete:
                return  # between requests while a response goes on (keep-alive follows it)
            self.transport.close()  # nothing sent
        elif self.cycle is not None and self.cycle.response_started:
            self.transport.close()  # a body stalled under a response already begun
        else:
            self._refuse(408, f"request not received within {READ_TIMEOUT_S:g}s")

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        body = message.encode()
        self.transport.write(
            STATUS_LINE[status]
            + b"content-type: text/plain; charset=utf-8\r\n"
            + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            + body
        )
        self.transport.close()
