"""The HTTP gateway's CPU per streamed token: what serving the OpenAI API costs on top of
the engine, for every token of every stream.

    .venv/bin/python benchmarks/gateway_stream.py [--streams 256] [--steps 100] [--repeats 3]

A real ``weir gateway`` process sits between a scripted engine (a ZeroMQ ROUTER in this
process, answering health and model-info requests as the scheduler does) and ``--streams``
streaming chat completions read over raw HTTP connections. Once every request has reached
the engine, it sends ``--steps`` ``outputs`` frames of one token per stream, as the
scheduler does at each step of a steady decode (encoded before the clock starts). The
gateway's CPU time (user and system, from /proc) from the first frame to the last
``[DONE]``, divided by the tokens streamed, is its cost of a token; the wall time per token
is printed too, but on a small machine it includes this process's own share of the CPU.
``--step-ms`` paces the frames as a GPU's steps would (0 sends them all at once: a gateway
that cannot keep up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import zmq
import zmq.asyncio

from weir.services.launcher import free_port
from weir.shared.protocol import client as client_protocol

_TICKS = os.sysconf("SC_CLK_TCK")
_MODEL = "scripted"


def _cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / _TICKS, int(fields[12]) / _TICKS


async def _answer(server: zmq.asyncio.Socket, identity: bytes, msg: object) -> None:
    if isinstance(msg, client_protocol.HealthRequest):
        reply: object = client_protocol.HealthReply(msg.request_id, {"status": "ok"})
    else:
        assert isinstance(msg, client_protocol.ModelInfoRequest)
        info = {"model_name": _MODEL, "max_model_len": 4096}
        reply = client_protocol.ModelInfoReply(msg.request_id, info)
    await server.send_multipart([identity, client_protocol.encode_server_message(reply)])


async def _engine(server: zmq.asyncio.Socket, generated: asyncio.Queue[tuple[bytes, str]]) -> None:
    """Answer health and model info; queue every generate request's sender and id."""
    while True:
        identity, frame = await server.recv_multipart()
        msg = client_protocol.decode_client_message(frame)
        if isinstance(msg, client_protocol.GenerateRequest):
            generated.put_nowait((identity, msg.request_id))
        elif not isinstance(msg, client_protocol.AbortRequest):
            await _answer(server, identity, msg)


async def _stream(port: int, steps: int) -> int:
    """One streaming chat completion over a raw connection; the number of events read."""
    body = json.dumps(
        {
            "model": _MODEL,
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": steps,
            "stream": True,
        }
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    received = bytearray()
    while not received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
        data = await reader.read(1 << 16)
        if not data:
            break
        received += data
    writer.close()
    if not received.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(received[:300].decode(errors="replace"))
    # Every event follows a newline (a chunk-size line's or the event before it); less [DONE].
    return received.count(b"\ndata: ") - 1


async def run(
    gateway_pid: int,
    port: int,
    server: zmq.asyncio.Socket,
    generated: asyncio.Queue[tuple[bytes, str]],
    args: argparse.Namespace,
) -> tuple[float, float, float]:
    """Gateway user CPU, system CPU and wall microseconds per token streamed."""
    clients = [asyncio.create_task(_stream(port, args.steps)) for _ in range(args.streams)]
    request_ids = []
    for _ in range(args.streams):
        identity, request_id = await generated.get()
        request_ids.append(request_id)
    frames = []
    for step in range(args.steps):
        last = step == args.steps - 1
        items = [
            client_protocol.StreamOutput(
                rid, [1000 + step], " word", last, "length" if last else None, 12, step + 1
            )
            for rid in request_ids
        ]
        frames.append(client_protocol.encode_outputs(items))
    (user0, system0), start = _cpu_seconds(gateway_pid), time.perf_counter()
    for frame in frames:
        await server.send_multipart([identity, frame])
        if args.step_ms:
            await asyncio.sleep(args.step_ms / 1000)
    events = await asyncio.gather(*clients)
    wall, (user, system) = time.perf_counter() - start, _cpu_seconds(gateway_pid)
    # The role chunk, one chunk per token; [DONE] is not counted.
    assert all(n == 1 + args.steps for n in events), set(events)
    tokens = args.streams * args.steps
    per_token = 1e6 / tokens
    return (user - user0) * per_token, (system - system0) * per_token, wall * per_token


async def main_async(args: argparse.Namespace) -> None:
    context = zmq.asyncio.Context()
    server = context.socket(zmq.ROUTER)
    engine_port = server.bind_to_random_port("tcp://127.0.0.1")
    http_port = free_port()
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weir.services.cli",
            "gateway",
            "--scheduler",
            f"tcp://127.0.0.1:{engine_port}",
            "--port",
            str(http_port),
            "--timeout",
            "600",
        ]
    )
    try:
        generated: asyncio.Queue[tuple[bytes, str]] = asyncio.Queue()
        engine = asyncio.create_task(_engine(server, generated))
        for _ in range(600):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", http_port)
                writer.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # the router's first health check
        for _ in range(args.repeats):
            user, system, wall = await run(gateway.pid, http_port, server, generated, args)
            print(
                f"{args.streams} streams x {args.steps} tokens: gateway CPU {user + system:.1f} us "
                f"per token (user {user:.1f}, system {system:.1f}; "
                f"{1e6 / (user + system):,.0f} tokens/s per core), wall {wall:.1f} us per token"
            )
        engine.cancel()
    finally:
        gateway.terminate()
        gateway.wait()
        context.destroy(linger=0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="milliseconds between two frames (0: send them all at once)",
    )
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
