"""Bad input is refused at the door and never hurts anyone else's request.

A real scheduler + executor pair (tiny random Llama) is sent garbage frames from a raw
ZeroMQ DEALER socket (hand-written and hypothesis-generated), requests that used to be
accepted and then make the executor's step raise, and prompts long enough to take
seconds to tokenize, while ordinary greedy streams run: every bad frame gets an error,
the server keeps serving, and the ordinary streams finish with the tokens of an
undisturbed run.
"""

import asyncio
import random
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st
from serving_helpers import raw_dealer

from weir.services.launcher import ServerProcesses
from weir.shared.client import AsyncWeirClient, InvalidRequestError, WeirClient
from weir.shared.config import EngineArgs
from weir.shared.protocol import client as client_protocol
from weir.shared.sampling import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 48
MAX_MODEL_LEN = 64
KV_BYTES = NUM_BLOCKS * 2 * 2 * BLOCK_SIZE * 2 * 8 * 4
VOCAB = 49152
MAX_MESSAGE_SIZE = 8 << 20
MAX_PROMPT_CHARS = 6_000_000
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[random.Random(i).randrange(3, VOCAB) for _ in range(3 + i)] for i in range(6)]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = EngineArgs(
        model=str(tiny_model_dir),
        max_num_batched_tokens=32,
        block_size=BLOCK_SIZE,
        kv_cache_memory=KV_BYTES,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=64,
        max_message_size=MAX_MESSAGE_SIZE,
        max_prompt_chars=MAX_PROMPT_CHARS,
        device="cpu",
    )
    with ServerProcesses(engine, port=0, metrics_port=0, executor_metrics_port=0) as processes:
        yield processes
        with WeirClient(processes.client_address) as client:
            health = client.health()
        assert health["num_free_blocks"] == health["num_blocks"] and health["num_streams"] == 0


@pytest.fixture(scope="module")
def reference(server) -> list[list[int]]:
    """Greedy tokens of PROMPTS, each run alone."""
    with WeirClient(server.client_address) as client:
        return [
            [t for out in client.generate(p, GREEDY) for t in out.new_token_ids] for p in PROMPTS
        ]


async def _tokens(stream) -> list[int]:
    return [t for out in [out async for out in stream] for t in out.new_token_ids]


class Traffic:
    """Rounds of concurrent greedy streams on a thread of their own, until the block ends;
    then every round must have equalled the reference and at least one must have run."""

    def __init__(self, address: str, reference: list[list[int]]) -> None:
        self.address, self.reference = address, reference
        self.rounds: list[list[list[int]]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def rounds() -> None:
            async with AsyncWeirClient(self.address, timeout=60) as client:
                while not self._stop.is_set() or not self.rounds:
                    self.rounds.append(
                        await asyncio.gather(
                            *(_tokens(client.generate(p, GREEDY)) for p in PROMPTS)
                        )
                    )

        try:
            asyncio.run(rounds())
        except BaseException as exc:  # reported by __exit__
            self.error = exc

    def __enter__(self) -> "Traffic":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=300)
        assert not self._thread.is_alive(), "the ordinary streams never finished"
        assert self.error is None, f"an ordinary stream failed: {self.error!r}"
        assert self.rounds and all(r == self.reference for r in self.rounds)


def _answer(sock: zmq.Socket, timeout_s: float = 60.0):
    """The scheduler's answer to the last frame sent: a reply, or outputs up to a finished one."""
    outputs = []
    while True:
        assert sock.poll(int(timeout_s * 1000)), "no answer from the scheduler"
        msg = client_protocol.decode_server_message(sock.recv())
        if not isinstance(msg, list):
            return msg
        outputs += msg
        if any(o.finished for o in msg):
            return outputs


def _generate(request_id: str, prompt: object, **sampling_params: object) -> bytes:
    return msgpack.packb(
        {
            "v": client_protocol.PROTOCOL_VERSION,
            "type": "generate",
            "request_id": request_id,
            "prompt": prompt,
            "sampling_params": sampling_params,
        }
    )


def _nested(depth: int) -> object:
    value: object = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


GARBAGE = [
    [b""],
    [b"not msgpack at all"],
    [b"\xc1"],
    [bytes(random.Random(0).randrange(256) for _ in range(64))],
    [msgpack.packb(None)],
    [msgpack.packb([1, 2, 3])],
    [msgpack.packb("generate")],
    [
        msgpack.packb({"v": client_protocol.PROTOCOL_VERSION, "type": [1], "request_id": "x"})
    ],  # used to stop the scheduler
    [
        msgpack.packb(
            {"v": client_protocol.PROTOCOL_VERSION, "type": {"generate": 1}, "request_id": "x"}
        )
    ],
    [msgpack.packb({"v": client_protocol.PROTOCOL_VERSION, "type": [1]})],
    [msgpack.packb({"v": True, "type": "health", "request_id": "x"})],
    [
        msgpack.packb(
            {"v": float(client_protocol.PROTOCOL_VERSION), "type": "health", "request_id": "x"}
        )
    ],
    [msgpack.packb({"v": 2**64 - 1, "type": "health", "request_id": "x"})],
    [
        msgpack.packb(
            {"v": client_protocol.PROTOCOL_VERSION, "type": "health", "request_id": {"a": [1]}}
        )
    ],
    [
        msgpack.packb(
            {
                "v": client_protocol.PROTOCOL_VERSION,
                "type": "health",
                "request_id": "x",
                "stream_ids": [[1], {}],
            }
        )
    ],
    [
        msgpack.packb(
            {b"v": client_protocol.PROTOCOL_VERSION, b"type": b"health"}, use_bin_type=True
        )
    ],
    [
        msgpack.packb(
            {
                "v": client_protocol.PROTOCOL_VERSION,
                "type": "generate",
                "request_id": "x",
                "prompt": _nested(60),
            }
        )
    ],
    [
        msgpack.packb(
            {
                "v": client_protocol.PROTOCOL_VERSION,
                "type": "generate",
                "request_id": "x",
                "prompt": [{"role": []}],
            }
        )
    ],
    [
        msgpack.packb(
            {
                "v": client_protocol.PROTOCOL_VERSION,
                "type": "generate",
                "request_id": "x",
                "prompt": [1],
                "sampling_params": [2],
            }
        )
    ],
    [_generate("x", [-1])],
    [_generate("x", [2**64 - 1])],
    [_generate("x", "hi", max_tokens=2**64 - 1)],
    [_generate("x", "hi", temperature=[1.0], top_p={})],
    [_generate("x", "hi", stop=[""], stop_token_ids="ab")],
    [b"\x91" * 3000 + b"\xc0"],  # nested deeper than msgpack unpacks
    [b"\xdd\xff\xff\xff\xff"],  # an array that claims 4 billion elements
    [
        msgpack.packb({"v": client_protocol.PROTOCOL_VERSION, "type": "health", "request_id": "x"}),
        b"second part",
    ],
    [b"a", b"b", b"c"],
]


def test_garbage_frames_are_answered_and_the_server_keeps_serving(server, reference):
    with raw_dealer(server.client_address) as sock:
        with Traffic(server.client_address, reference):
            for frames in GARBAGE:
                sock.send_multipart(frames)
                reply = _answer(sock)
                assert isinstance(reply, client_protocol.ErrorReply), (frames, reply)
                assert reply.code in (
                    client_protocol.MALFORMED_MESSAGE,
                    client_protocol.UNSUPPORTED_VERSION,
                    client_protocol.UNKNOWN_MESSAGE_TYPE,
                    client_protocol.INVALID_REQUEST,
                ), (frames, reply)
                assert reply.message


_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
_JUNK = st.recursive(
    _LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)
_SAMPLING_FIELDS = [*SamplingParams().to_dict(), "warp"]
_MESSAGES = st.fixed_dictionaries(
    {},
    optional={
        "v": st.just(client_protocol.PROTOCOL_VERSION) | _JUNK,
        "type": st.sampled_from(["generate", "abort", "health", "model_info"]) | _JUNK,
        "request_id": st.text(max_size=8) | _JUNK,
        "prompt": st.text(max_size=8) | st.lists(st.integers(-5, 2**40), max_size=4) | _JUNK,
        "sampling_params": st.dictionaries(st.sampled_from(_SAMPLING_FIELDS), _JUNK, max_size=4)
        | _JUNK,
        "stream_ids": _JUNK,
    },
) | st.dictionaries(st.text(max_size=8), _JUNK, max_size=6)


def test_hypothesis_generated_maps_never_stop_the_server(server, reference):
    probe = client_protocol.HealthRequest("probe")
    with raw_dealer(server.client_address) as sock:

        @settings(max_examples=300, deadline=None, database=None)
        @given(message=_MESSAGES)
        def send(message):
            sock.send(msgpack.packb(message))
            # Whatever the map was (an accepted request streams on), the server still answers.
            sock.send(client_protocol.encode_client_message(probe))
            while True:
                assert sock.poll(60_000), f"no answer after {message!r}"
                reply = client_protocol.decode_server_message(sock.recv())
                if isinstance(reply, client_protocol.HealthReply) and reply.request_id == "probe":
                    return

        with Traffic(server.client_address, reference):
            send()


# Each of these used to be accepted and then make the executor's step raise, failing every
# request in the batch; or was accepted and then silently wrong.
POISON = [
    ({"sampling_params": {"top_k": 2**63}}, "top_k"),
    ({"sampling_params": {"max_tokens": 2**31, "min_tokens": 2**31}}, "max_tokens"),
    ({"sampling_params": {"stop_token_ids": [2**63], "min_tokens": 1}}, "stop_token_ids"),
    ({"sampling_params": {"stop_token_ids": [VOCAB], "min_tokens": 1}}, "vocabulary"),
    ({"sampling_params": {"seed": 2**64 - 1}}, "seed"),
    ({"sampling_params": {"temperature": float("inf")}}, "finite"),
    ({"request_id": "nul\x00id"}, "printable"),
    ({"request_id": "x" * 10_000}, "at most 256"),
    ({"prompt": [1, VOCAB]}, "vocabulary"),
    ({"prompt": [1] * MAX_MODEL_LEN}, "too long"),
    ({"prompt": [{"role": "hacker", "content": "hi"}]}, "chat role"),
    ({"prompt": [{"role": "", "content": "hi"}]}, "chat role"),
    ({"sampling_params": {"max_tokens": 100}}, "maximum context length is 64"),
    ({"sampling_params": {"max_tokens": None, "min_tokens": 62}}, "min_tokens is too large"),
    (
        {"prompt": "x" * (MAX_PROMPT_CHARS + 1)},
        "6000001 characters, more than this server's limit of 6000000 (its --max-prompt-chars)",
    ),
    # The template's markup counts: 60 empty messages are no short prompt (a million of them
    # held the scheduler's loop 45 s), and more messages than tokens cannot fit.
    ({"prompt": [{"role": "user", "content": "x" * 99_990}] * 60}, "6000360 characters"),
    ({"prompt": [{"role": "user", "content": ""}] * (MAX_MODEL_LEN + 1)}, "65 messages"),
    (
        {"sampling_params": {"stop": ["x" * 3_000_000, "y" * 3_000_001]}},
        "stop strings and bad words of 6000001 characters in all: more than this server's "
        "limit of 6000000 (its --max-prompt-chars)",
    ),
]


async def test_poison_requests_are_refused_at_the_door_and_fail_no_one(server, reference):
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.client_address)
    try:
        async with AsyncWeirClient(server.client_address) as client:
            victims = [client.generate(p, GREEDY) for p in PROMPTS]
            firsts = [await anext(v) for v in victims]  # every victim is in flight
            for fields, words in POISON:
                message = {"request_id": "poison", "prompt": [1, 2, 3], "sampling_params": {}}
                await sock.send(
                    msgpack.packb(
                        {
                            "v": client_protocol.PROTOCOL_VERSION,
                            "type": "generate",
                            **message,
                            **fields,
                        }
                    )
                )
                reply = client_protocol.decode_server_message(
                    await asyncio.wait_for(sock.recv(), 60)
                )
                assert isinstance(reply, client_protocol.ErrorReply), (fields, reply)
                assert reply.code == client_protocol.INVALID_REQUEST, (fields, reply)
                assert words in reply.message, (fields, reply.message)
            rests = await asyncio.gather(*(_tokens(v) for v in victims))
        got = [first.new_token_ids + rest for first, rest in zip(firsts, rests)]
        assert got == reference
    finally:
        sock.close()
        ctx.term()


def test_the_sdk_refuses_an_unusable_request_id_itself(server):
    with WeirClient(server.client_address) as client:
        with pytest.raises(InvalidRequestError, match="printable"):
            list(client.generate([1, 2], request_id="a\nb"))


def test_the_sdk_refuses_a_prompt_the_protocol_cannot_carry_itself(server):
    """The server cannot decode it, so its refusal names no request: the stream waited for
    the client's timeout, then called the request lost."""
    with WeirClient(server.client_address, timeout=60) as client:
        start = time.monotonic()
        with pytest.raises(InvalidRequestError, match="1048577 items; requests carry at most"):
            list(client.generate([1] * (2**20 + 1)))
        assert time.monotonic() - start < 5


async def test_the_sdk_refuses_a_message_over_the_servers_limit_and_its_streams_go_on(
    server, reference
):
    """A message over --max-message-size would cost the connection, and every stream on it
    (the gateway's every request): the SDK, told the limit by model_info, refuses it itself.
    Text a JSON field carries is sent as itself, not as ASCII escapes three times its size."""
    async with AsyncWeirClient(server.client_address) as client:
        assert (await client.model_info())["max_message_size"] == MAX_MESSAGE_SIZE
        assert client.max_message_size == MAX_MESSAGE_SIZE
        victims = [client.generate(p, GREEDY) for p in PROMPTS]
        firsts = [await anext(v) for v in victims]
        with pytest.raises(InvalidRequestError, match="at most 8388608 .its --max-message-size"):
            await anext(client.generate("a" * MAX_MESSAGE_SIZE, GREEDY, request_id="big"))
        tools = [{"type": "function", "function": {"name": "f", "description": "😀" * 600_000}}]
        chat = [{"role": "user", "content": "hi"}]
        text = "".join([o.text async for o in client.generate(chat, GREEDY, tools=tools)])
        rests = await asyncio.gather(*(_tokens(v) for v in victims))
    assert text  # 2.4 MB of emoji, where escapes (12 bytes an emoji) took 7.2 MB of the 8 MiB
    assert [first.new_token_ids + rest for first, rest in zip(firsts, rests)] == reference


async def test_a_denormal_temperature_is_greedy_not_token_zero(server, reference):
    # 1e-45 is sent raw (the SDK's SamplingParams would already turn it into 0).
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.client_address)
    try:
        await sock.send(
            _generate("tiny-t", PROMPTS[0], max_tokens=12, temperature=1e-45, ignore_eos=True)
        )
        outs = []
        while not outs or not outs[-1].finished:
            outs += client_protocol.decode_server_message(await asyncio.wait_for(sock.recv(), 60))
        assert [t for o in outs for t in o.new_token_ids] == reference[0]
    finally:
        sock.close()
        ctx.term()


def test_a_frame_over_the_size_limit_costs_only_its_sender_the_connection(server, reference):
    with raw_dealer(server.client_address) as sock:
        with Traffic(server.client_address, reference):
            sock.send(b"\x00" * (MAX_MESSAGE_SIZE + 1))
            # ZeroMQ drops the connection (and what followed on it); the socket reconnects
            # and is served again.
            health = client_protocol.encode_client_message(client_protocol.HealthRequest("h"))
            for _ in range(60):
                sock.send(health)
                if sock.poll(1000):
                    break
            reply = client_protocol.decode_server_message(sock.recv())
            assert isinstance(reply, client_protocol.HealthReply) and reply.info["status"] == "ok"


# Sends a byte that is never valid msgpack as fast as the socket takes it, from a process of
# its own: a flooding thread in the test's process held the GIL the client's thread needed
# (on one core beside a busy one, the stream then took 30-45 s, not 0.6 s).
_FLOOD = """
import sys, zmq
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(sys.argv[1])
sock.send(b"\\xc1")
print("flooding", flush=True)
while True:
    sock.send(b"\\xc1")
"""


@pytest.mark.timeout(60)  # a loop held by the flood answers health, so nothing else ends
def test_a_client_sending_without_pause_does_not_hold_up_the_others(server, reference):
    """Its frames are handled one per turn of the scheduler's loop, not all while they keep
    coming: another client's stream goes on at once."""
    command = [sys.executable, "-c", _FLOOD, server.client_address]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as flooder:
        try:
            assert flooder.stdout.readline() == "flooding\n"
            time.sleep(0.5)
            with WeirClient(server.client_address, timeout=20) as client:
                got = [t for out in client.generate(PROMPTS[2], GREEDY) for t in out.new_token_ids]
            assert got == reference[2]
            assert flooder.poll() is None  # still flooding: the stream went on beside it
        finally:
            flooder.kill()  # the context's exit then reaps it and closes its pipe


def _long_text(num_chars: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    rng = random.Random(num_chars)
    text = " ".join(rng.choice(words) for _ in range(num_chars // 5))
    return text[:num_chars]


async def test_a_long_prompt_is_tokenized_while_other_streams_go_on(server, reference):
    """A prompt of millions of characters takes seconds to tokenize (and is then refused as
    too long): meanwhile other streams keep receiving tokens, an abort still reaches it,
    its id cannot be reused until it ends (by the abort too), and the liveness check knows it."""
    big = _long_text(2_500_000)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.client_address)
    arrivals: list[float] = []
    stop = asyncio.Event()

    async def ordinary(client: AsyncWeirClient) -> None:
        while not stop.is_set():
            async for out in client.generate(PROMPTS[1], GREEDY):
                arrivals.extend([time.monotonic()] * len(out.new_token_ids))

    async def recv() -> object:
        return client_protocol.decode_server_message(await asyncio.wait_for(sock.recv(), 120))

    try:
        async with AsyncWeirClient(server.client_address) as client:
            task = asyncio.create_task(ordinary(client))
            while not arrivals:
                await asyncio.sleep(0.01)
            sent = time.monotonic()
            await sock.send(_generate("big", big, max_tokens=4))
            await sock.send(_generate("big", [1, 2], max_tokens=4))
            duplicate = await recv()
            assert duplicate.code == client_protocol.DUPLICATE_REQUEST_ID
            await sock.send(
                client_protocol.encode_client_message(client_protocol.HealthRequest("h", ["big"]))
            )
            health = await recv()
            assert health.info["lost_request_ids"] == []
            refused = await recv()
            answered = time.monotonic()
            assert refused.request_id == "big" and refused.code == client_protocol.INVALID_REQUEST
            assert "prompt is too long" in refused.message and "tokens" in refused.message
            during = [t for t in arrivals if sent < t < answered]
            assert len(during) >= 2, (answered - sent, len(during))

            # Aborted while it tokenizes: the abort is answered at once, nothing follows.
            await sock.send(_generate("big2", big, max_tokens=4))
            await sock.send(
                client_protocol.encode_client_message(client_protocol.AbortRequest("big2"))
            )
            aborted = await recv()
            assert [(o.request_id, o.finished, o.finish_reason) for o in aborted] == [
                ("big2", True, "abort")
            ]
            # Its id is free at once (the client was told it ended), while the long prompt
            # is still being tokenized; the new request gets its own tokens, and only those.
            await sock.send(_generate("big2", [1, 2], max_tokens=4, ignore_eos=True))
            tokens: list[int] = []
            while True:
                reply = await recv()
                assert isinstance(reply, list), reply
                assert {o.request_id for o in reply} == {"big2"}
                tokens += [t for o in reply for t in o.new_token_ids]
                if reply[-1].finished:
                    assert reply[-1].finish_reason == "length"
                    break
            assert len(tokens) == 4
            await sock.send(
                client_protocol.encode_client_message(client_protocol.HealthRequest("h2", []))
            )
            assert isinstance(await recv(), client_protocol.HealthReply)  # nothing came between
            stop.set()
            await task
    finally:
        sock.close()
        ctx.term()
