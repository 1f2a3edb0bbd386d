"""The client SDK's cost per streamed output: what `LLM.generate`, `weir bench throughput`
and the HTTP gateway pay for every token on their side of the socket.

    .venv/bin/python benchmarks/client_stream.py [--streams 256] [--steps 100] [--repeats 3]

A scripted server (a ZeroMQ ROUTER in this process) takes ``--streams`` requests from a
real ``AsyncWeirClient`` and sends ``--steps`` ``outputs`` frames of one item per stream,
as the scheduler does at each step of a steady decode; every stream's generator is drained
by its own task, as ``LLM.generate`` does. The time from the first frame sent to the last
stream finished, per item, is the client's cost of a token (the frames are encoded before
the clock starts).
"""

import argparse
import asyncio
import time

import zmq
import zmq.asyncio

from weir.shared.client import AsyncWeirClient
from weir.shared.protocol import client as client_protocol
from weir.shared.sampling import SamplingParams


async def run(streams: int, steps: int) -> float:
    """Microseconds per item received."""
    context = zmq.asyncio.Context()
    server = context.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = AsyncWeirClient(f"tcp://127.0.0.1:{port}")
    received = 0

    async def drain(i: int) -> None:
        nonlocal received
        params = SamplingParams(max_tokens=steps)
        async for _ in client.generate([1, 2, 3], params, request_id=f"r{i}"):
            received += 1

    tasks = [asyncio.create_task(drain(i)) for i in range(streams)]
    request_ids: list[str] = []
    while len(request_ids) < streams:
        identity, frame = await server.recv_multipart()
        message = client_protocol.decode_client_message(frame)
        if isinstance(message, client_protocol.GenerateRequest):
            request_ids.append(message.request_id)
    frames = []
    for step in range(steps):
        last = step == steps - 1
        items = [
            client_protocol.StreamOutput(
                rid, [1000 + step], " word", last, "length" if last else None, 3, step + 1
            )
            for rid in request_ids
        ]
        frames.append(client_protocol.encode_outputs(items))
    start = time.perf_counter()
    for frame in frames:
        await server.send_multipart([identity, frame])
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    assert received == streams * steps
    await client.close()
    context.destroy(linger=0)
    return elapsed / received * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.repeats):
        us = asyncio.run(run(args.streams, args.steps))
        print(
            f"{args.streams} streams x {args.steps} outputs: {us:.2f} us per output, "
            f"{1e6 / us:,.0f} outputs/s on one core"
        )


if __name__ == "__main__":
    main()
