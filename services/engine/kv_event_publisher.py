"""The prefix cache's events on vLLM's wire (``--kv-events-config``).

A ZeroMQ PUB socket sends each batch as three frames: the topic, an 8-byte big-endian
sequence number (0, 1, ...) and the msgpack payload ``[timestamp, [event, ...],
data_parallel_rank]`` (the events: ``weir.services.scheduler.kv_events``). The last
``buffer_steps`` batches are kept; a ROUTER socket at ``replay_endpoint`` answers an
8-byte start sequence in REQ's envelope (``[b"", start]``) with each kept batch from
there (``[b"", seq, payload]``), then ``[b"", -1 as 8 signed bytes, b""]``, so a
subscriber that saw a gap in the numbers catches up (a REQ socket reads the first of
these only; a DEALER reads them all). This is vLLM's ``ZmqEventPublisher`` and what llm-d's KV cache indexer and
Dynamo's KV router subscribe to.

It runs on the scheduler's event loop, not in a thread: a batch is one ``packb`` and one
non-blocking send per step that changed the cache, and a replay yields to the step
loop every few batches, so one subscriber asking again and again delays no step by
more than a few sends.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from weir.shared.kv_events_config import KVEventsConfig
from weir.shared.log_limit import limited_logger

_log = limited_logger("weir.kv_events")  # replay requests come from outside

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_REPLAY_SENDS_PER_YIELD = 64
# A replay request is an identity, an empty delimiter and 8 bytes; anything larger is not one.
_REPLAY_MAX_MESSAGE_BYTES = 1024


def binds(endpoint: str) -> bool:
    """vLLM's rule: an address with a wildcard host or port, or an ipc or inproc name, is
    bound; any other is a subscriber's bound address, connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(
        self, ctx: zmq.asyncio.Context, config: KVEventsConfig, data_parallel_rank: int
    ) -> None:
        """Binds or connects the sockets; OSError names the address that failed."""
        self.data_parallel_rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[bytes, bytes]] = deque(maxlen=config.buffer_steps)
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, config.hwm)
        # Sent from the loop without awaiting: a PUB socket never blocks (past its
        # high-water mark a slow subscriber misses batches, and asks for them again).
        self._pub: zmq.Socket[bytes] = zmq.Socket.shadow(pub.underlying)
        self._pub_owner = pub
        self._replay: zmq.asyncio.Socket | None = None
        try:
            _attach(pub, config.endpoint, "endpoint")
            if config.replay_endpoint is not None:
                replay = self._replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.setsockopt(zmq.MAXMSGSIZE, _REPLAY_MAX_MESSAGE_BYTES)
                replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 1)  # a whole replay
                _attach(replay, config.replay_endpoint, "replay_endpoint")
        except OSError:
            self.close()
            raise
        self.address = pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
        self.replay_address = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        )

    def publish(self, events: list[list[Any]]) -> None:
        payload = msgpack.packb([time.time(), events, self.data_parallel_rank])
        seq = self._seq.to_bytes(8, "big")
        self._seq += 1
        self._pub.send_multipart((self._topic, seq, payload), copy=False)
        self._buffer.append((seq, payload))

    async def serve_replays(self) -> None:
        """Answer replay requests until cancelled (a task of the scheduler's, whose end
        would stop it: with no replay socket it waits for its cancellation)."""
        replay = self._replay
        if replay is None:
            await asyncio.Event().wait()
            return
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
                _log.warning(
                    "a KV events replay request was not [8-byte start sequence] "
                    "from a REQ socket (%d frames); ignored",
                    len(frames),
                )
                continue
            try:
                await self._replay_from(replay, frames[0], int.from_bytes(frames[2], "big"))
            except zmq.ZMQError as exc:  # the subscriber's to lose, not the scheduler's
                _log.warning("a KV events replay failed: %s", exc)

    async def _replay_from(self, replay: zmq.asyncio.Socket, client: bytes, first: int) -> None:
        sent = 0
        for seq, payload in list(self._buffer):  # batches published meanwhile are live
            if int.from_bytes(seq, "big") >= first:
                await replay.send_multipart((client, b"", seq, payload), copy=False)
                sent += 1
                if sent % _REPLAY_SENDS_PER_YIELD == 0:
                    await asyncio.sleep(0)
        await replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        self._pub_owner.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def _attach(sock: zmq.asyncio.Socket, endpoint: str, option: str) -> None:
    try:
        if binds(endpoint):
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as exc:
        raise OSError(
            exc.errno, f"cannot use {endpoint}: {exc} (--kv-events-config {option})"
        ) from None
