"""``weir run-batch``: a file of OpenAI batch requests answered line by line (vLLM's
``vllm run-batch``).

Each input line is ``{"custom_id", "method": "POST", "url", "body"}``; each output line, in
the input's order, ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``. The bodies go through the HTTP API's own app, called in this process without a
socket, so a line is validated and answered exactly as the same request over HTTP would be.
A line that fails (not JSON, an endpoint the batch does not serve, a request the API refuses)
gets its error in ``error`` (and, when the API answered, its status and error body in
``response``): every line has its output line, and the others go on.
"""

from __future__ import annotations

import asyncio
import errno
import http.client
import json
import logging
import os
import signal
import stat
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

from pydantic import TypeAdapter, ValidationError
from starlette.types import ASGIApp, Message
from tqdm import tqdm

from weir.services.gateway.app import ApiOptions, Gateway, create_app
from weir.services.gateway.chat_output import ChatParsers
from weir.services.gateway.router import Router
from weir.services.sigterm import Terminated

# The endpoints a batch line may name: OpenAI's batch endpoints and vLLM's pooling ones.
BATCH_URLS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/score",
    "/score",
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
    "/classify",
    "/pooling",
)
_log = logging.getLogger(__name__)
_READ_HINT = 1 << 20  # bytes of lines read at a time
_UPLOAD_TIMEOUT_S = 600.0
# The API reads a body's stream as pydantic reads a bool: "true", 1, "yes" too.
_AS_BOOL = TypeAdapter(bool)


@dataclass(slots=True)
class BatchCounts:
    succeeded: int = 0
    failed: int = 0


@dataclass(slots=True)
class _Line:
    """One input line: the request to make, or why none is made."""

    custom_id: str | None
    url: str = ""
    body: bytes = b""
    error: str | None = None


def _parse_line(raw: bytes, number: int, seen: set[str]) -> _Line:
    try:
        line = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        return _Line(None, error=f"line {number} is not JSON: {exc}")
    if not isinstance(line, dict):
        return _Line(None, error=f"line {number} is not a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str):
        return _Line(None, error=f"line {number}: custom_id must be a string")
    if custom_id in seen:
        return _Line(
            custom_id, error=f"line {number}: custom_id {custom_id!r} repeats an earlier one"
        )
    seen.add(custom_id)
    method, url, body = line.get("method"), line.get("url"), line.get("body")
    if method != "POST":
        return _Line(custom_id, error=f"line {number}: method must be 'POST', got {method!r}")
    if url not in BATCH_URLS:
        return _Line(
            custom_id, error=f"line {number}: url {url!r} is none of {', '.join(BATCH_URLS)}"
        )
    if not isinstance(body, dict):
        return _Line(custom_id, error=f"line {number}: body must be a JSON object")
    if _streams(body.get("stream")):
        return _Line(
            custom_id,
            error=f"line {number}: stream is not served in a batch (one whole body a line)",
        )
    return _Line(custom_id, url, json.dumps(body).encode())


def _streams(value: object) -> bool:
    """Whether the API would stream an answer whose body's ``stream`` is ``value``."""
    try:
        return _AS_BOOL.validate_python(value)
    except ValidationError:  # the API refuses it itself
        return False


async def _post(app: ASGIApp, path: str, body: bytes, request_id: str) -> tuple[int, bytes]:
    """``app``'s answer to a POST of ``body`` to ``path``, as a server would call it; the
    client stays connected until the answer is whole."""
    answered = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    status, chunks = 500, []

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", request_id.encode()),
        ],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    try:
        await app(scope, receive, send)
    finally:
        answered.set()
    return status, b"".join(chunks)


def _local_error(message: str) -> dict[str, object]:
    """An error of a line the API was not asked about, in the shape of the API's own."""
    return {"message": message, "type": "invalid_request_error", "param": None, "code": None}


def _api_error(body: bytes) -> tuple[bytes, dict[str, object]]:
    """A failed answer's body as JSON, and its error object (OpenAI's shape)."""
    try:
        error = json.loads(body)["error"]
        if isinstance(error, dict):
            return body, error
    except (ValueError, KeyError, TypeError):
        pass
    text = body.decode(errors="replace")
    return json.dumps(text).encode(), _local_error(text[:1000])


def _output_line(
    custom_id: str | None,
    request_id: str,
    status: int | None,
    body: bytes = b"null",
    error: dict[str, object] | None = None,
) -> str:
    """One output line; ``body`` is the API's JSON as it answered, spliced in unparsed."""
    head = json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id})[:-1]
    response = "null"
    if status is not None:
        response = (
            f'{{"status_code": {status}, "request_id": {json.dumps(request_id)}, '
            f'"body": {body.decode()}}}'
        )
    return f'{head}, "response": {response}, "error": {json.dumps(error)}}}\n'


async def _answer(app: ASGIApp, line: _Line) -> tuple[str, bool]:
    """``line``'s output line, and whether its request succeeded."""
    request_id = f"req_{uuid.uuid4().hex}"
    if line.error is not None:
        return _output_line(line.custom_id, request_id, None, error=_local_error(line.error)), False
    try:
        status, body = await _post(app, line.url, line.body, request_id)
    except Exception as exc:  # the app answers its own errors; anything else is still a line's
        return _output_line(line.custom_id, request_id, None, error=_local_error(repr(exc))), False
    if status == 200 and body.startswith(b"{"):
        return _output_line(line.custom_id, request_id, status, body), True
    body, error = _api_error(body)
    return _output_line(line.custom_id, request_id, status, body, error), False


async def _read_lines(source: IO[bytes]) -> AsyncIterator[tuple[int, bytes]]:
    """``source``'s non-blank lines and their numbers (from 1), read off the event loop."""
    number = 0
    while True:
        try:
            chunk = await asyncio.to_thread(source.readlines, _READ_HINT)
        except OSError as exc:
            raise OSError(f"reading the input failed after line {number}: {exc}") from exc
        if not chunk:
            if _cut_short(source):
                raise OSError(
                    f"reading the input failed after line {number}: its connection closed "
                    "before the whole body came"
                )
            return
        for raw in chunk:
            number += 1
            if raw.strip():
                yield number, raw


def _cut_short(source: IO[bytes]) -> bool:
    """Whether ``source``, an HTTP response read to its end, lacks some of its body: read
    line by line, http.client takes a closed connection for the body's end."""
    if not isinstance(source, http.client.HTTPResponse):
        return False
    if source.chunked:
        return source.chunk_left is not None  # None once the last chunk came
    return bool(source.length)  # Content-Length's bytes yet to come


async def run_batch(
    app: ASGIApp,
    source: IO[bytes],
    output: IO[str],
    max_in_flight: int,
    on_done: Callable[[], None] | None = None,
) -> BatchCounts:
    """Answer every line of ``source`` through ``app`` (whose lifespan has started), at most
    ``max_in_flight`` at once, writing the output lines to ``output`` in the input's order as
    they become ready; ``on_done()`` after each line."""
    counts = BatchCounts()
    ready: dict[int, str] = {}
    next_to_write = 0
    slots = asyncio.Semaphore(max_in_flight)
    tasks: set[asyncio.Task[None]] = set()

    def finish(index: int, text: str, ok: bool) -> None:
        nonlocal next_to_write
        ready[index] = text
        if ok:
            counts.succeeded += 1
        else:
            counts.failed += 1
        while next_to_write in ready:
            output.write(ready.pop(next_to_write))
            next_to_write += 1
        if on_done is not None:
            on_done()

    async def answer(index: int, line: _Line) -> None:
        try:
            text, ok = await _answer(app, line)
        finally:
            slots.release()
        finish(index, text, ok)

    seen: set[str] = set()
    index = 0
    try:
        async for number, raw in _read_lines(source):
            line = _parse_line(raw, number, seen)
            if line.error is not None:
                finish(index, *await _answer(app, line))
            else:
                await slots.acquire()
                task = asyncio.create_task(answer(index, line))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            index += 1
        await asyncio.gather(*tasks)
    finally:
        # Stopped (Ctrl-C, SIGTERM): the lines in flight get no output line, rather than
        # the errors of the engine's client closing under them.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return counts


def _is_url(path: str) -> bool:
    return path.startswith(("http://", "https://"))


def open_input(path: str) -> IO[bytes]:
    """The input file, or the body of a GET of an http(s) URL; ``OSError`` if neither opens."""
    if _is_url(path):
        response: IO[bytes] = urllib.request.urlopen(path, timeout=60)
        return response
    return open(path, "rb")


def same_file(input_path: str, output_path: str) -> bool:
    """Whether the output is the input's own file, which opening it to write would empty
    before a line is read."""
    if _is_url(input_path) or _is_url(output_path) or not os.path.isfile(output_path):
        return False
    try:
        return os.path.samefile(input_path, output_path)
    except OSError:  # the input's own error comes when it is opened
        return False


def check_output(path: str) -> None:
    """Raise ``OSError`` if the output file cannot be written, leaving it as it is (and not
    there if it was not): the engines start before it is emptied, as vLLM's do."""
    if _is_url(path):
        return
    try:
        mode: int | None = os.stat(path).st_mode
    except FileNotFoundError:  # no file (or a symlink to none): made and removed below
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        # A FIFO, /dev/stdout, a device: opened here and again for the results, a FIFO's
        # reader would take the first close for the end of its input (the second open then
        # waits for a reader forever); whether it is writable is all there is to tell.
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return
    with open(path, "a", encoding="utf-8"):
        pass
    if mode is None:  # a symlink's missing target is what was made
        os.unlink(os.path.realpath(path))


@contextmanager
def open_output(path: str) -> Iterator[IO[str]]:
    """The output file; for an http(s) URL a temporary file, PUT to it once written. An
    upload that fails keeps the file and says where it is."""
    if not _is_url(path):
        with open(path, "w", encoding="utf-8") as file:
            yield file
        return
    fd, local = tempfile.mkstemp(prefix="weir-batch-", suffix=".jsonl")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            yield file
    except BaseException:
        _log.warning("the output lines written before the stop are in %s", local)
        raise
    try:
        with open(local, "rb") as data:
            request = urllib.request.Request(
                path,
                data=data,
                method="PUT",
                headers={
                    "Content-Type": "application/jsonl",
                    "Content-Length": str(os.path.getsize(local)),
                },
            )
            with urllib.request.urlopen(request, timeout=_UPLOAD_TIMEOUT_S):
                pass
    except OSError as exc:
        raise OSError(
            f"uploading the results to {path} failed ({exc}); they are in {local}"
        ) from exc
    os.unlink(local)


async def answer_batch(
    addresses: list[str],
    keys_dir: str | None,
    parsers: ChatParsers,
    options: ApiOptions,
    source: IO[bytes],
    output: IO[str],
    max_in_flight: int,
) -> BatchCounts:
    """``run_batch`` through the HTTP API's app over the engines at ``addresses``, with a
    progress bar on a terminal's stderr."""
    gateway = Gateway(Router(addresses, keys_dir=keys_dir), parsers=parsers, options=options)
    app = create_app(gateway)
    # SIGTERM stops the batch as Ctrl-C does under asyncio.run, by cancelling this task: a
    # handler that raises would raise in whatever callback the loop runs, which logs and
    # drops it (the batch went on, or hung).
    main = asyncio.current_task()
    assert main is not None
    terminated = False

    def terminate() -> None:
        nonlocal terminated
        terminated = True
        main.cancel()

    loop = asyncio.get_running_loop()
    handler = signal.getsignal(signal.SIGTERM)
    loop.add_signal_handler(signal.SIGTERM, terminate)
    try:
        with tqdm(
            desc="run-batch", unit="req", mininterval=5, file=sys.stderr, disable=None
        ) as bar:
            async with app.router.lifespan_context(app):
                return await run_batch(app, source, output, max_in_flight, bar.update)
    except asyncio.CancelledError:
        if terminated:
            raise Terminated from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, handler)  # the caller's again, as it stops the engine
