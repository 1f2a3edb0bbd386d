"""The gateway's streamed chunks: each event is the JSON of OpenAI's chunk object, and the
outputs that reach the gateway together leave it in one write.

The first test compares the events ``ChunkEvents`` builds from a per-response prefix with
``json.dumps`` of the chunk built here as a dict, field by field from OpenAI's schema. The
others put a real ``weir gateway`` in front of a scripted engine (a raw ZeroMQ ROUTER that
sends several outputs in one frame, as a scheduler's step does when the gateway has
fallen behind) and read the HTTP response's chunked framing byte for byte.
"""

import json
import socket
import threading
import time

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from weir.services.gateway import openai_format as fmt
from weir.services.launcher import GatewayProcess
from weir.shared.protocol import client as client_protocol
from weir.shared.protocol.client import StreamOutput

_texts = st.text(st.characters(codec="utf-8"), max_size=12)
_logprobs = st.lists(
    st.tuples(
        _texts, st.floats(-30, 0), st.lists(st.tuples(_texts, st.floats(-30, 0)), max_size=2)
    ),
    min_size=1,
    max_size=2,
)


def _output(text, finished, reason, rows, stop_reason=None) -> StreamOutput:
    logprobs = None
    if rows is not None:
        logprobs = {
            "token_ids": [[0] * (1 + len(top)) for _, _, top in rows],
            "tokens": [[token] + [t for t, _ in top] for token, _, top in rows],
            "logprobs": [[lp] + [x for _, x in top] for _, lp, top in rows],
        }
    return StreamOutput("r", [0], text, finished, reason, 3, 1, None, logprobs, stop_reason)


def _top_logprobs(token: str, logprob: float, top: list[tuple[str, float]]) -> dict:
    """The sampled token's entry, then the alternatives': one of a text already there (a
    part of a character has none) does not replace its logprob."""
    entries = {token: logprob}
    for alternative, alternative_logprob in top:
        entries.setdefault(alternative, alternative_logprob)
    return entries


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


@settings(max_examples=300, deadline=None)
@given(
    model=_texts,
    created=st.integers(0, 2**40),
    index=st.integers(0, 127),
    before=_texts,
    text=_texts,
    finished=st.booleans(),
    reason=st.sampled_from(["stop", "length", "abort", None]),
    rows=st.none() | _logprobs,
    stop=st.none() | st.integers(0, 2**31) | _texts,
)
def test_chunk_events_are_the_json_of_openai_chunks(
    model, created, index, before, text, finished, reason, rows, stop
):
    """OpenAI's chunk fields, and vLLM's ``stop_reason`` (the stop string or token id)."""
    stop_reason = stop if finished and reason == "stop" else None
    out = _output(text, finished, reason, rows, stop_reason)
    choice = fmt.Choice(index)
    choice.add(_output(before, False, None, None))
    choice.add(out)
    final_reason = reason if finished else None

    base = {"id": "cmpl-1", "object": "text_completion", "created": created, "model": model}
    legacy = None
    if rows is not None:
        # Counted over the logprob tokens before (none here: the text before had no rows),
        # as the whole response counts them, whatever text was sent.
        offsets, offset = [], 0
        for token, _, _ in rows:
            offsets.append(offset)
            offset += len(token)
        legacy = {
            "tokens": [token for token, _, _ in rows],
            "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [_top_logprobs(token, lp, top) for token, lp, top in rows],
            "text_offset": offsets,
        }
    completion = {
        **base,
        "choices": [
            {
                "index": index,
                "text": text,
                "finish_reason": final_reason,
                "stop_reason": stop_reason,
                "logprobs": legacy,
            }
        ],
    }
    assert fmt.ChunkEvents(base).completion(out, choice) == fmt.sse(completion).decode()

    base = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
    }
    for asked in (False, True):
        chat_logprobs = None
        if asked:
            content = [
                {**_entry(token, lp), "top_logprobs": [_entry(t, x) for t, x in top]}
                for token, lp, top in rows or []
            ]
            chat_logprobs = {"content": content}
        chat = {
            **base,
            "choices": [
                {
                    "index": index,
                    "delta": {"content": text} if text or not finished else {},
                    "logprobs": chat_logprobs,
                    "finish_reason": final_reason,
                    "stop_reason": stop_reason,
                }
            ],
        }
        event = fmt.ChunkEvents(base, chat_logprobs=asked).chat(out, choice)
        assert event == fmt.sse(chat).decode()
        assert json.loads(event.removeprefix("data: ")) == chat


class ScriptedEngine:
    """A ROUTER that answers health and model info, and sends each generate request's
    outputs from ``script`` (request id suffix -> frames of (text, finished)) when asked."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.requests: list[tuple[bytes, str]] = []
        self.stopped = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self.stopped:
            if not self.sock.poll(50):
                continue
            with self._lock:
                identity, frame = self.sock.recv_multipart()
                msg = client_protocol.decode_client_message(frame)
                if isinstance(msg, client_protocol.GenerateRequest):
                    self.requests.append((identity, msg.request_id))
                elif isinstance(msg, client_protocol.HealthRequest):
                    reply = client_protocol.HealthReply(msg.request_id, {"status": "ok"})
                    self.sock.send_multipart(
                        [identity, client_protocol.encode_server_message(reply)]
                    )
                elif isinstance(msg, client_protocol.ModelInfoRequest):
                    info = {"model_name": "scripted", "max_model_len": 64}
                    reply = client_protocol.ModelInfoReply(msg.request_id, info)
                    self.sock.send_multipart(
                        [identity, client_protocol.encode_server_message(reply)]
                    )

    def wait_requests(self, count: int) -> list[str]:
        deadline = time.monotonic() + 10
        while len(self.requests) < count:
            assert time.monotonic() < deadline, self.requests
            time.sleep(0.01)
        return [request_id for _, request_id in self.requests]

    def send(self, outputs: list[tuple[str, str, bool]]) -> None:
        """One frame: (request id, text, finished) per output."""
        items = [
            StreamOutput(rid, [1], text, done, "length" if done else None, 5, 1)
            for rid, text, done in outputs
        ]
        with self._lock:
            identity = self.requests[0][0]
            self.sock.send_multipart([identity, client_protocol.encode_outputs(items)])

    def send_error(self, request_id: str, message: str) -> None:
        reply = client_protocol.ErrorReply(request_id, message, client_protocol.ENGINE_ERROR)
        with self._lock:
            identity = self.requests[0][0]
            self.sock.send_multipart([identity, client_protocol.encode_server_message(reply)])

    def close(self) -> None:
        self.stopped = True
        self._thread.join()
        self.context.destroy(linger=0)


@pytest.fixture(scope="module")
def engine():
    engine = ScriptedEngine()
    with GatewayProcess([engine.address], timeout=30) as gateway:
        engine.http_address = gateway.info["http_address"]
        yield engine
    engine.close()


def _post(engine, path: str, body: dict) -> socket.socket:
    host, port = engine.http_address.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST %s HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data)
    )
    return sock


def _http_chunks(sock: socket.socket) -> list[list[dict | str]]:
    """The response body's HTTP chunks, each as the events it holds."""
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    sock.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    chunks = []
    while True:
        size, _, body = body.partition(b"\r\n")
        if int(size, 16) == 0:
            return chunks
        data, body = body[: int(size, 16)], body[int(size, 16) + 2 :]
        events = data.decode().split("\n\n")
        assert events.pop() == ""
        chunks.append(
            [e if e == "data: [DONE]" else json.loads(e.removeprefix("data: ")) for e in events]
        )


def test_outputs_that_arrive_together_leave_in_one_write(engine):
    engine.requests.clear()
    sock = _post(
        engine,
        "/v1/chat/completions",
        {
            "model": "scripted",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
        },
    )
    (rid,) = engine.wait_requests(1)
    engine.send([(rid, "Hel", False), (rid, "lo", False), (rid, "!", True)])
    chunks = _http_chunks(sock)
    # The role chunk and the three tokens in one write, then [DONE].
    first, last = chunks
    assert [c["choices"][0]["delta"] for c in first] == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
        {"content": "lo"},
        {"content": "!"},
    ]
    assert [c["choices"][0]["finish_reason"] for c in first] == [None, None, None, "length"]
    assert last == ["data: [DONE]"]


def test_samples_of_one_request_are_merged_into_one_write(engine):
    engine.requests.clear()
    sock = _post(
        engine,
        "/v1/completions",
        {
            "model": "scripted",
            "prompt": "hi",
            "max_tokens": 4,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    (first_id,) = engine.wait_requests(1)
    engine.send([(first_id, "a", False)])  # the second sample starts after this one's first token
    first_id, second_id = engine.wait_requests(2)
    engine.send([(first_id, "b", True), (second_id, "c", False), (second_id, "d", True)])
    chunks = _http_chunks(sock)
    assert [
        [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunk] for chunk in chunks[:2]
    ] == [
        [(0, "a")],
        [(0, "b"), (1, "c"), (1, "d")],
    ]
    # The usage chunk and [DONE] end the stream in one write.
    # (The scripted engine tells no cached tokens: no prompt_tokens_details.)
    assert chunks[2][0]["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert chunks[2][1:] == ["data: [DONE]"] and len(chunks) == 3


def test_an_error_after_the_first_output_is_an_error_event_then_done(engine):
    engine.requests.clear()
    sock = _post(
        engine,
        "/v1/completions",
        {"model": "scripted", "prompt": "hi", "max_tokens": 4, "stream": True},
    )
    (rid,) = engine.wait_requests(1)
    engine.send([(rid, "a", False)])
    time.sleep(0.2)  # the first output leaves alone: the status line is 200 by then
    engine.send_error(rid, "the engine failed")
    events = [event for chunk in _http_chunks(sock) for event in chunk]
    assert events[0]["choices"][0]["text"] == "a"
    assert events[1]["error"]["message"] == "the engine failed"
    assert events[1]["error"]["type"] == "server_error"
    assert events[1]["error"]["code"] == "engine_error"
    assert events[2:] == ["data: [DONE]"], "clients read to [DONE], as after vLLM's errors"
