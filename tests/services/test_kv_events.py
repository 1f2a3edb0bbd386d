"""vLLM's KV cache events (`--kv-events-config`) as a KV-cache-aware router meets them:
a ZeroMQ SUB socket on the served engine and a REQ socket on its replay port, each
batch decoded with vLLM's own message types (msgspec's array-like tagged structs, as its
example subscriber declares them), and a router's index built from nothing but the
events, which must predict every prefix-cache hit the engine then reports."""

from __future__ import annotations

import random
import time
from typing import Any

import httpx
import msgspec
import openai
import pytest
import zmq
from serving_helpers import raw_dealer, small_server

BLOCK_SIZE = 16
TOPIC = "kv@pod-a@tiny"


# vLLM's types (vllm/distributed/kv_events.py, before its events became maps).
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


decode = msgspec.msgpack.Decoder(KVEventBatch).decode


class RouterIndex:
    """What a router knows of one engine's cache from its events: it cannot compute the
    engine's hashes, so it names a block by its parent's hash and its tokens (llm-d's
    indexer maps the engine's keys to its own the same way)."""

    def __init__(self) -> None:
        self.by_content: dict[tuple[Any, tuple[int, ...]], Any] = {}
        self.stored: set[Any] = set()
        self.removed = 0
        self.cleared = 0

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert (event.block_size, event.medium) == (BLOCK_SIZE, "GPU")
                assert len(event.token_ids) == BLOCK_SIZE * len(event.block_hashes)
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    tokens = tuple(event.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
                    self.by_content[(parent, tokens)] = block_hash
                    self.stored.add(block_hash)
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    assert block_hash in self.stored, "a block removed that was never stored"
                    self.stored.remove(block_hash)
                    self.removed += 1
            else:
                self.stored.clear()
                self.cleared += 1

    def cached_blocks(self, token_ids: list[int]) -> int:
        """Leading full blocks of ``token_ids`` the engine holds."""
        parent, count = None, 0
        for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
            block_hash = self.by_content.get((parent, tuple(token_ids[start : start + BLOCK_SIZE])))
            if block_hash is None or block_hash not in self.stored:
                break
            parent, count = block_hash, count + 1
        return count


class Subscriber:
    """A SUB socket that checks the sequence numbers and keeps every batch."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.sock.connect(address)
        self.frames: list[tuple[int, bytes]] = []

    def receive(self, timeout_ms: int) -> KVEventBatch | None:
        if not self.sock.poll(timeout_ms):
            return None
        topic, seq, payload = self.sock.recv_multipart()
        assert topic == TOPIC.encode() and len(seq) == 8
        number = int.from_bytes(seq, "big")
        if self.frames:
            assert number == self.frames[-1][0] + 1, "a batch missed on a quiet socket"
        self.frames.append((number, payload))
        batch = decode(payload)
        assert batch.data_parallel_rank == 0
        return batch


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    config = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "topic": TOPIC,
    }
    with small_server(
        tiny_model_dir, "tiny", kv_cache_memory="160KiB", kv_events_config=config
    ) as server:
        yield server


@pytest.fixture
def subscriber(served):
    """Subscribed and caught up: a SUB socket misses what is published before its
    subscription reaches the publisher, so the cache is reset until it hears of it."""
    ctx = zmq.Context()
    sub = Subscriber(ctx, served.info["kv_events_address"])
    index = RouterIndex()
    http = served.info["http_address"]
    while not index.cleared:
        httpx.post(http + "/reset_prefix_cache", timeout=10).raise_for_status()
        while (batch := sub.receive(200)) is not None:
            index.apply(batch)
    yield sub, index
    sub.sock.close()
    ctx.term()


def _complete(client: openai.OpenAI, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    reply = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return reply.choices[0].token_ids, reply.usage.prompt_tokens_details.cached_tokens


def test_a_router_index_from_the_events_predicts_each_prefix_cache_hit(served, subscriber):
    """Prompts sharing prefixes of 1-4 blocks, one at a time, through a cache of some forty
    blocks, so blocks are evicted as they go: before each request, the index built from the
    events alone says how many of its tokens the engine holds, and the engine's reply
    (usage.prompt_tokens_details.cached_tokens) agrees; every removal names a block stored
    before, and what the index holds never exceeds the cache."""
    sub, index = subscriber
    rng = random.Random(0)
    client = openai.OpenAI(base_url=served.info["http_address"] + "/v1", api_key="x")
    prefixes = [[rng.randrange(100, 40000) for _ in range(64)] for _ in range(4)]
    predicted_hits = 0
    for _ in range(24):
        prefix = rng.choice(prefixes)[: BLOCK_SIZE * rng.randint(1, 4)]
        prompt = prefix + [rng.randrange(100, 40000) for _ in range(rng.randint(1, 80))]
        limit = (len(prompt) - 1) // BLOCK_SIZE  # the last prompt token is always computed
        expected = BLOCK_SIZE * min(index.cached_blocks(prompt), limit)
        output, cached = _complete(client, prompt, 6)
        assert cached == expected, (len(prompt), index.cached_blocks(prompt))
        predicted_hits += expected
        # The reply's step published its events just after it: wait until every full block
        # of what was computed (the last output token never is) is known.
        computed = prompt + output[:-1]
        deadline = time.monotonic() + 10
        while index.cached_blocks(computed) < len(computed) // BLOCK_SIZE:
            batch = sub.receive(100)
            if batch is not None:
                index.apply(batch)
            assert time.monotonic() < deadline, "the request's blocks were never reported"
    assert predicted_hits > 0 and index.removed > 0  # both paths taken
    assert len(index.stored) <= served.info["num_blocks"]


def test_replay_sends_each_batch_again_then_the_end_marker(served, subscriber):
    """A replay request for the first batch a subscriber saw gets those batches byte for
    byte with their numbers, then (-1, b""); malformed replay requests from a raw socket
    are ignored and serving goes on."""
    sub, _ = subscriber
    client = openai.OpenAI(base_url=served.info["http_address"] + "/v1", api_key="x")
    _complete(client, list(range(1000, 1040)), 4)
    while sub.receive(300) is not None:
        pass
    replay_address = served.info["kv_events_replay_address"]
    with raw_dealer(replay_address) as dealer:
        dealer.send_multipart([b"", b"x" * 4096])  # past the socket's message size
        time.sleep(0.2)
    with raw_dealer(replay_address) as dealer:
        dealer.send_multipart([b"no delimiter"])
        dealer.send_multipart([b"", b"seven b"])
        # REQ's envelope, from a DEALER: a REQ socket would take the first reply only.
        dealer.send_multipart([b"", sub.frames[0][0].to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(10_000), "the replay did not end"
            delimiter, seq, payload = dealer.recv_multipart()
            assert delimiter == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
    assert replayed[: len(sub.frames)] == sub.frames
    output, _ = _complete(client, list(range(2000, 2030)), 3)
    assert len(output) == 3


def test_reset_prefix_cache_is_all_blocks_cleared(served, subscriber):
    sub, index = subscriber
    client = openai.OpenAI(base_url=served.info["http_address"] + "/v1", api_key="x")
    prompt = list(range(3000, 3050))
    _complete(client, prompt, 2)
    deadline = time.monotonic() + 10
    while index.cached_blocks(prompt) < 3:
        if (batch := sub.receive(100)) is not None:
            index.apply(batch)
        assert time.monotonic() < deadline
    httpx.post(served.info["http_address"] + "/reset_prefix_cache", timeout=10).raise_for_status()
    cleared = index.cleared
    while index.cleared == cleared:
        batch = sub.receive(5_000)
        assert batch is not None, "no AllBlocksCleared after the reset"
        index.apply(batch)
    assert index.cached_blocks(prompt) == 0
    _, cached = _complete(client, prompt, 2)
    assert cached == 0


def test_without_a_replay_socket_events_flow_and_the_engine_serves_on(tiny_model_dir):
    """vLLM's default: no replay_endpoint. The engine keeps serving (a replay task that ended
    at once used to stop the scheduler) and publishes on a connected endpoint, the form
    llm-d's indexer takes: it binds, each engine connects to it."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"}
    try:
        with small_server(
            tiny_model_dir, "tiny", kv_cache_memory="160KiB", kv_events_config=config
        ) as server:
            assert server.info["kv_events_replay_address"] is None
            http = server.info["http_address"]
            client = openai.OpenAI(base_url=http + "/v1", api_key="x")
            stored: list[BlockStored] = []
            deadline = time.monotonic() + 20
            # A new prompt each time: a cached one stores nothing (and the first batches may
            # go before the subscription reaches the engine).
            for start in range(500, 50_000, 100):
                assert time.monotonic() < deadline, "no BlockStored from a connecting engine"
                if stored:
                    break
                _complete(client, list(range(start, start + 40)), 2)
                while sub.poll(300):
                    _, _, payload = sub.recv_multipart()
                    stored += [e for e in decode(payload).events if isinstance(e, BlockStored)]
            time.sleep(1.5)  # past the scheduler's periodic tasks' first rounds
            assert _complete(client, [7, 8, 9], 2)[0]
    finally:
        sub.close()
        ctx.term()
