"""The SDK's streams against a scripted server (a raw ZeroMQ ROUTER).

The stream watch: quiet streams are asked about together, a stream still hearing outputs
is not, a lost stream ends with ``EngineError``, and a server that stops answering fails
the quiet streams within the client's timeout. Batches: what arrived together is taken
together, an error comes after the outputs that preceded it, and only a stream left
before its last output is aborted."""

import asyncio
import gc
import os
import threading
import time

import pytest
import zmq
import zmq.asyncio
from serving_helpers import exit_code_of_a_fork

from weir.shared import client as sdk
from weir.shared.client import (
    AsyncWeirClient,
    EngineError,
    InvalidRequestError,
    ServerUnavailableError,
    WeirClient,
    WeirError,
)
from weir.shared.protocol import client as client_protocol
from weir.shared.sampling import SamplingParams

TIMEOUT = 1.2  # the watch looks every 0.3 s; a health request is given 0.6 s


class ScriptedServer:
    def __init__(self) -> None:
        self.context = zmq.asyncio.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.identity = b""
        self.requests: list[str] = []
        self.aborts: list[str] = []
        self.health_ids: list[list[str]] = []
        self.lost: set[str] = set()
        self.answer_health = True

    async def serve(self) -> None:
        while True:
            self.identity, frame = await self.sock.recv_multipart()
            message = client_protocol.decode_client_message(frame)
            if isinstance(message, client_protocol.GenerateRequest):
                self.requests.append(message.request_id)
            elif isinstance(message, client_protocol.AbortRequest):
                self.aborts.append(message.request_id)
            elif isinstance(message, client_protocol.HealthRequest) and self.answer_health:
                self.health_ids.append(message.stream_ids)
                lost = sorted(self.lost & set(message.stream_ids))
                reply = client_protocol.HealthReply(
                    message.request_id, {"status": "ok", "lost_request_ids": lost}
                )
                await self.send(client_protocol.encode_server_message(reply))

    async def send(self, frame: bytes) -> None:
        await self.sock.send_multipart([self.identity, frame])

    async def output(self, request_id: str, finished: bool, texts: str = "x") -> None:
        """One frame with one output per character of ``texts``; the last may finish."""
        items = [
            client_protocol.StreamOutput(
                request_id, [7], text, last, "length" if last else None, 3, 1
            )
            for i, text in enumerate(texts)
            for last in [finished and i == len(texts) - 1]
        ]
        await self.send(client_protocol.encode_outputs(items))

    async def wait_requests(self, count: int) -> None:
        while len(self.requests) < count:
            await asyncio.sleep(0.01)


async def _scenario(answer_health: bool, lost: set[str]) -> dict[str, object]:
    server = ScriptedServer()
    server.answer_health = answer_health
    server.lost = lost
    serving = asyncio.create_task(server.serve())
    results: dict[str, object] = {}
    async with AsyncWeirClient(server.address, timeout=TIMEOUT) as client:

        async def stream(rid: str) -> None:
            start = time.monotonic()
            try:
                async for out in client.generate([1, 2, 3], SamplingParams(), request_id=rid):
                    if out.finished:
                        results[rid] = "finished"
            except Exception as exc:
                results[rid] = (exc, time.monotonic() - start)

        ids = ["quiet1", "quiet2", "quiet3", "busy"]
        tasks = [asyncio.create_task(stream(rid)) for rid in ids]
        await server.wait_requests(len(ids))
        for _ in range(15):  # 1.5 s: five looks of the watch
            await server.output("busy", False)
            await asyncio.sleep(0.1)
        for rid in ids:
            if rid not in results:
                await server.output(rid, True)
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
    serving.cancel()
    server.context.destroy(linger=0)
    results["health_ids"] = server.health_ids
    results["aborts"] = server.aborts
    return results


def test_quiet_streams_are_asked_about_together_and_keep_waiting() -> None:
    results = asyncio.run(_scenario(answer_health=True, lost=set()))
    assert [results[rid] for rid in ("quiet1", "quiet2", "quiet3", "busy")] == ["finished"] * 4
    asked = results["health_ids"]
    assert asked and all(sorted(ids) == ["quiet1", "quiet2", "quiet3"] for ids in asked), asked


def test_more_quiet_streams_than_one_request_may_name_are_asked_about_in_parts(
    monkeypatch,
) -> None:
    monkeypatch.setattr(sdk, "MAX_HEALTH_STREAM_IDS", 2)
    results = asyncio.run(_scenario(answer_health=True, lost={"quiet3"}))
    error, _ = results["quiet3"]
    assert isinstance(error, EngineError) and "was lost" in str(error)
    assert results["quiet1"] == results["quiet2"] == results["busy"] == "finished"
    asked = results["health_ids"]
    assert asked and all(len(ids) <= 2 for ids in asked), asked
    assert {"quiet1", "quiet2", "quiet3"} <= {rid for ids in asked for rid in ids}


def test_a_stream_the_server_lost_ends_with_engine_error() -> None:
    results = asyncio.run(_scenario(answer_health=True, lost={"quiet2"}))
    error, _ = results["quiet2"]
    assert isinstance(error, EngineError) and "was lost" in str(error)
    assert results["quiet1"] == results["quiet3"] == results["busy"] == "finished"
    assert results["aborts"] == []  # a stream the server does not know has nothing to free


def test_a_server_that_stops_answering_fails_the_quiet_streams_within_the_timeout() -> None:
    """...naming each, and aborts them: a server that was only slow frees them, rather than
    running them to the end for nobody and refusing their ids sent again."""
    results = asyncio.run(_scenario(answer_health=False, lost=set()))
    for rid in ("quiet1", "quiet2", "quiet3"):
        error, seconds = results[rid]
        assert isinstance(error, ServerUnavailableError), error
        assert str(error).startswith(f"request {rid}: "), error
        assert seconds < TIMEOUT * 1.25, seconds
    assert results["busy"] == "finished"
    assert sorted(results["aborts"]) == ["quiet1", "quiet2", "quiet3"]


async def _batches() -> dict[str, object]:
    server = ScriptedServer()
    serving = asyncio.create_task(server.serve())
    seen: dict[str, object] = {}
    async with AsyncWeirClient(server.address, timeout=TIMEOUT) as client:
        whole = client.generate_batches([1], SamplingParams(), request_id="whole")
        one_by_one = client.generate([1], SamplingParams(), request_id="one_by_one")
        failed = client.generate_batches([1], SamplingParams(), request_id="failed")
        left = client.generate_batches([1], SamplingParams(), request_id="left")
        pending = [asyncio.ensure_future(anext(s)) for s in (whole, one_by_one, failed, left)]
        await server.wait_requests(4)
        await server.output("whole", True, "abc")
        await server.output("one_by_one", True, "abc")
        await server.output("failed", False, "ab")
        error = client_protocol.ErrorReply("failed", "no such thing", "invalid_request")
        await server.send(client_protocol.encode_server_message(error))
        await server.output("left", False, "ab")
        first = await asyncio.gather(*pending)
        seen["whole"] = [[o.text for o in first[0]]] + [[o.text for o in b] async for b in whole]
        seen["one_by_one"] = [first[1].text] + [o.text async for o in one_by_one]
        try:
            async for batch in failed:
                first[2] += batch
        except InvalidRequestError as exc:
            seen["failed"] = ([o.text for o in first[2]], str(exc))
        seen["left"] = [o.text for o in first[3]]
        await left.aclose()
        await asyncio.sleep(0.2)
    serving.cancel()
    server.context.destroy(linger=0)
    seen["aborts"] = server.aborts
    return seen


def test_batches_hold_what_arrived_together_and_end_as_the_stream_does() -> None:
    seen = asyncio.run(_batches())
    assert seen["whole"] == [["a", "b", "c"]]
    assert seen["one_by_one"] == ["a", "b", "c"]
    assert seen["failed"] == (["a", "b"], "no such thing")
    assert seen["left"] == ["a", "b"]
    assert seen["aborts"] == ["left"]


async def _unencodable() -> tuple[list[str], list[str], list[str]]:
    server = ScriptedServer()
    serving = asyncio.create_task(server.serve())
    problems = []
    async with AsyncWeirClient(server.address, timeout=TIMEOUT) as client:
        for prompt in ("caf\ud800", [1, 2**64], [1, -(2**63) - 1]):
            try:
                async for _ in client.generate(prompt, request_id="bad"):
                    pass
            except InvalidRequestError as exc:
                problems.append(str(exc))
        stream = client.generate([1, 2], request_id="good")
        first = asyncio.ensure_future(anext(stream))
        await server.wait_requests(1)
        await server.output("good", True)
        await first
        await stream.aclose()
    serving.cancel()
    server.context.destroy(linger=0)
    return problems, server.requests, server.aborts


def test_a_request_msgpack_cannot_carry_is_refused_before_it_is_sent() -> None:
    """Lone surrogates and integers past 64 bits: InvalidRequestError naming the problem,
    nothing sent (no abort of a request the server never saw), and the client goes on."""
    problems, requests, aborts = asyncio.run(_unencodable())
    assert len(problems) == 3 and "'\\ud800', a lone surrogate" in problems[0]
    assert all("64-bit" in problem for problem in problems[1:])
    assert requests == ["good"] and aborts == []


def test_closing_a_client_ends_the_calls_waiting_on_it_at_once() -> None:
    """A stream read and a reply waited on in other threads raise ``WeirError`` when the
    client closes (they waited forever: the loop they waited on was stopped under them);
    a closed client's calls raise it too, and a timeout that is no wait is refused."""
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)  # takes the requests, never answers
    address = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    client = WeirClient(address, timeout=30)
    errors: dict[str, BaseException] = {}

    def wait(name: str, call) -> None:
        try:
            call()
        except BaseException as exc:
            errors[name] = exc

    waiters = [
        threading.Thread(target=wait, args=(name, call), daemon=True)
        for name, call in (
            ("stream", lambda: list(client.generate([1], SamplingParams()))),
            ("reply", client.model_info),
        )
    ]
    for waiter in waiters:
        waiter.start()
    for _ in waiters:
        assert server.poll(10_000), "the requests never arrived"
        server.recv_multipart()
    start = time.monotonic()
    client.close()
    for waiter in waiters:
        waiter.join(timeout=5)
    assert not [w for w in waiters if w.is_alive()] and time.monotonic() - start < 5
    for name in ("stream", "reply"):
        assert isinstance(errors[name], WeirError) and "client is closed" in str(errors[name])
    with pytest.raises(WeirError, match="client is closed"):
        next(client.generate([1], SamplingParams()))
    context.destroy(linger=0)
    for timeout in (None, 0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            WeirClient(address, timeout=timeout)


def _router() -> tuple[zmq.Context, zmq.Socket, str]:
    """A server that takes requests and answers only what a test sends itself."""
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    return context, server, f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"


def _collect_on_loop_thread(loop: sdk.EventLoopThread) -> None:
    """What the cyclic GC does when the loop thread happens to allocate next: finalize the
    garbage there (gc is disabled meanwhile so that no other thread collects it first)."""
    loop.loop.call_soon_threadsafe(gc.collect)


def test_a_stream_left_in_a_cycle_and_collected_on_the_loop_thread_is_aborted() -> None:
    """The stream's finalizer, run on the client's loop thread, waited there for its own
    loop: every later call hung, and the request was never aborted."""
    context, server, address = _router()
    client = WeirClient(address, timeout=30)

    def answer() -> None:
        identity, _ = server.recv_multipart()
        out = client_protocol.StreamOutput("cycle", [7], "x", False, None, 3, 1)
        server.send_multipart([identity, client_protocol.encode_outputs([out])])

    def read_first_then_fail() -> None:
        stream = client.generate([1], SamplingParams(), request_id="cycle")
        try:
            for _ in stream:
                raise ValueError("stop reading")
        except ValueError as exc:
            kept = exc  # noqa: F841 (exc -> traceback -> this frame -> stream: a cycle)

    answering = threading.Thread(target=answer)
    answering.start()
    gc.disable()
    try:
        read_first_then_fail()
        answering.join()
        _collect_on_loop_thread(client._loop)
        assert server.poll(5000), "the stream was not aborted (the loop thread hangs)"
        abort = client_protocol.decode_client_message(server.recv_multipart()[1])
    finally:
        gc.enable()
    assert isinstance(abort, client_protocol.AbortRequest) and abort.request_id == "cycle"
    client.close()
    context.destroy(linger=0)


def test_a_client_collected_on_its_loop_thread_still_closes() -> None:
    """Its finalizer returned there without closing (and never ran again): the loop thread,
    its socket and its file descriptors leaked."""
    context, server, address = _router()
    client = WeirClient(address, timeout=30)
    loop, inner = client._loop, client._client
    client.me = client  # a cycle
    gc.disable()
    try:
        del client
        _collect_on_loop_thread(loop)
        loop.thread.join(timeout=5)
    finally:
        gc.enable()
    assert not loop.thread.is_alive() and loop.loop.is_closed() and inner._sock.closed
    context.destroy(linger=0)


def test_a_fork_of_a_process_with_a_client_neither_hangs_nor_uses_it() -> None:
    """The child's calls waited forever on a loop that has no thread there, and so did its
    exit (the client's finalizer); now they raise, and its exit leaves the parent's client
    alone."""
    context, server, address = _router()
    client = WeirClient(address, timeout=30)

    def child() -> None:
        with pytest.raises(WeirError, match=f"client was created in process {os.getppid()}"):
            client.health()
        client.close()  # what its finalizer does at exit

    assert exit_code_of_a_fork(child) == 0, "the child hung or failed"
    client.abort("parent")  # and the parent's client still sends
    assert server.poll(5000), "the parent's client no longer sends"
    client.close()
    context.destroy(linger=0)


async def test_a_cancelled_close_is_cancelled_and_still_closes_the_socket() -> None:
    """close() swallowed its caller's cancellation while it awaited its own tasks' ends."""
    server = ScriptedServer()
    serving = asyncio.create_task(server.serve())
    client = AsyncWeirClient(server.address, timeout=TIMEOUT)
    await client.health()  # starts the client's tasks
    closing = asyncio.create_task(client.close())
    await asyncio.sleep(0)  # it now waits for its tasks
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert client._sock.closed
    serving.cancel()
    server.context.destroy(linger=0)
