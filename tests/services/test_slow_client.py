"""A client that stops reading its replies: once its send queue is full its requests end,
and it is told so when it reads again; a client beside it loses nothing.

A real ``ClientFrontend`` over a real ``Scheduler`` serves two real ZeroMQ clients over
inproc, whose queues are a few frames deep (the server's is 100,000 frames), and steps of
made-up tokens are published as an executor's would be.
"""

import asyncio
import logging
import time

import zmq
import zmq.asyncio
from serving_helpers import frontend_over, published_step

from weir.services.scheduler import Scheduler
from weir.services.scheduler.output import EngineOutput
from weir.shared.config import CacheConfig, SchedulerConfig
from weir.shared.protocol import client as client_protocol
from weir.shared.sampling import SamplingParams
from weir.shared.tokenizer import Tokenizer

STEPS = 60
QUEUE = 4  # frames each side of the pipe may hold


async def _serve(tokenizer: Tokenizer) -> tuple[list, list, set[str]]:
    context = zmq.asyncio.Context()
    server = context.socket(zmq.ROUTER)
    server.setsockopt(zmq.ROUTER_MANDATORY, 1)
    server.setsockopt(zmq.SNDHWM, QUEUE)
    server.bind("inproc://slow-client")
    clients = []
    for name in (b"slow", b"fine"):
        client = context.socket(zmq.DEALER)
        client.setsockopt(zmq.IDENTITY, name)
        client.setsockopt(zmq.RCVHWM, QUEUE)
        client.connect("inproc://slow-client")
        clients.append(client)
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, max_model_len=128),
        CacheConfig(block_size=16, num_blocks=32),
    )
    frontend = frontend_over(server, tokenizer, scheduler, "slow_client")
    receiving = asyncio.create_task(frontend.run())
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    for client, rid in zip(clients, ("s", "f")):
        request = client_protocol.GenerateRequest(rid, [300, 301], params)
        await client.send(client_protocol.encode_client_message(request))
    while len(frontend.streams) < 2:
        await asyncio.sleep(0.01)
    slow, fine = clients
    heard: tuple[list, list] = ([], [])
    for step in range(STEPS):
        last = step == STEPS - 1
        outputs = [
            EngineOutput(rid, [400 + step], last, "length" if last else None)
            for rid in ("s", "f")
            if rid in frontend.streams
        ]
        frontend.publish([published_step(step, outputs, ["s", "f"] if step == 0 else [])])
        while await fine.poll(0):
            heard[1].extend(client_protocol.decode_server_message(await fine.recv()))
        await asyncio.sleep(0)
    # A client with no stream that asks without reading: its answers are dropped once its
    # queue is full, and one warning (not one per answer) says so.
    idle = context.socket(zmq.DEALER)
    idle.setsockopt(zmq.RCVHWM, QUEUE)
    idle.connect("inproc://slow-client")
    for i in range(30):
        await idle.send(
            client_protocol.encode_client_message(client_protocol.HealthRequest(f"h{i}"))
        )
    await asyncio.sleep(0.2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(
        isinstance(m, client_protocol.ErrorReply) for m in heard[0]
    ):
        if await slow.poll(100):
            heard[0].append(client_protocol.decode_server_message(await slow.recv()))
    live = set(scheduler.requests)
    receiving.cancel()
    frontend.close()
    context.destroy(linger=0)
    return heard[0], heard[1], live


def test_a_client_that_stops_reading_is_told_its_request_ended(default_model_dir, caplog) -> None:
    tokenizer = Tokenizer.from_model_dir(default_model_dir)
    with caplog.at_level(logging.WARNING, logger="weir.services.engine.frontend"):
        slow, fine, live = asyncio.run(_serve(tokenizer))
    warned = [r.getMessage() for r in caplog.records if "stopped reading" in r.getMessage()]
    assert len(warned) == 2, warned  # the slow client, the idle one
    assert "s" not in live  # ended in the scheduler, not left running
    outputs = [o for m in slow if isinstance(m, list) for o in m]
    assert 0 < len(outputs) < STEPS and not outputs[-1].finished
    error = slow[-1]
    assert isinstance(error, client_protocol.ErrorReply)
    assert error.request_id == "s" and error.code == client_protocol.CLIENT_TOO_SLOW
    assert "stopped reading" in error.message
    tokens = [t for o in fine for t in o.new_token_ids]
    assert tokens == [400 + step for step in range(STEPS)] and fine[-1].finished
