"""Client <-> scheduler message validation: every malformed message names its problem."""

import msgpack
import pytest

from weir.shared.protocol import client as cp
from weir.shared.sampling import SamplingParams


def frame(**fields) -> bytes:
    return msgpack.packb({"v": 1, **fields})


def test_round_trip_of_every_client_message():
    params = SamplingParams(max_tokens=7, temperature=0.5, stop=("x",), seed=3)
    for prompt in ("hi", [1, 2, 3], [{"role": "user", "content": "hi"}]):
        msg = cp.GenerateRequest("r1", prompt, params)
        assert cp.decode_client_message(cp.encode_client_message(msg)) == msg
    for msg in (
        cp.AbortRequest("a"),
        cp.HealthRequest("h"),
        cp.HealthRequest("h", ["s1", "s2"]),
        cp.ModelInfoRequest("m"),
    ):
        assert cp.decode_client_message(cp.encode_client_message(msg)) == msg


def test_round_trip_of_server_messages():
    outs = [
        cp.StreamOutput("a", [1, 2], "hi", False, None, 3, 2, [5, 6, 7]),
        cp.StreamOutput(
            "b",
            [],
            "",
            True,
            "abort",
            1,
            0,
            logprobs={"token_ids": [[1, 2]], "logprobs": [[-0.1, -2.0]]},
        ),
    ]
    assert cp.decode_server_message(cp.encode_outputs(outs)) == outs
    for msg in (
        cp.ErrorReply(None, "bad", cp.MALFORMED_MESSAGE),
        cp.HealthReply("h", {"status": "ok"}),
        cp.ModelInfoReply("m", {"model_name": "x"}),
    ):
        assert cp.decode_server_message(cp.encode_server_message(msg)) == msg


@pytest.mark.parametrize(
    "data, code, words",
    [
        (b"\xc1\xff", cp.MALFORMED_MESSAGE, "msgpack"),
        (msgpack.packb([1, 2]), cp.MALFORMED_MESSAGE, "map"),
        (msgpack.packb({"type": "health", "request_id": "x"}), cp.UNSUPPORTED_VERSION, "version"),
        (frame(type="explode", request_id="x"), cp.UNKNOWN_MESSAGE_TYPE, "explode"),
        (frame(type="health"), cp.INVALID_REQUEST, "request_id"),
        (frame(type="health", request_id=5), cp.INVALID_REQUEST, "request_id"),
        (frame(type="health", request_id="x" * 300), cp.INVALID_REQUEST, "request_id"),
        (frame(type="abort", request_id="x", extra=1), cp.INVALID_REQUEST, "extra"),
        (frame(type="generate", request_id="x"), cp.INVALID_REQUEST, "prompt"),
        (frame(type="generate", request_id="x", prompt=""), cp.INVALID_REQUEST, "empty"),
        (frame(type="generate", request_id="x", prompt=[]), cp.INVALID_REQUEST, "empty"),
        (frame(type="generate", request_id="x", prompt=3.5), cp.INVALID_REQUEST, "prompt"),
        (frame(type="generate", request_id="x", prompt=[1, "a"]), cp.INVALID_REQUEST, "prompt[1]"),
        (frame(type="generate", request_id="x", prompt=[1, True]), cp.INVALID_REQUEST, "prompt[1]"),
        (
            frame(type="generate", request_id="x", prompt=[{"role": "user"}]),
            cp.INVALID_REQUEST,
            "content",
        ),
        (
            frame(type="generate", request_id="x", prompt=[{"role": "user", "content": 1}]),
            cp.INVALID_REQUEST,
            "strings",
        ),
        (
            frame(type="generate", request_id="x", prompt=[{"role": "user", "content": "a"}, 3]),
            cp.INVALID_REQUEST,
            "prompt[1]",
        ),
        (
            frame(type="generate", request_id="x", prompt="hi", sampling_params=[1]),
            cp.INVALID_REQUEST,
            "dict",
        ),
        (
            frame(
                type="generate", request_id="x", prompt="hi", sampling_params={"temperature": "hot"}
            ),
            cp.INVALID_REQUEST,
            "temperature",
        ),
        (
            frame(type="generate", request_id="x", prompt="hi", sampling_params={"max_tokens": 0}),
            cp.INVALID_REQUEST,
            "max_tokens",
        ),
        (
            frame(type="generate", request_id="x", prompt="hi", sampling_params={"warp": 9}),
            cp.INVALID_REQUEST,
            "warp",
        ),
    ],
)
def test_malformed_client_messages_name_the_problem(data, code, words):
    with pytest.raises(cp.ClientProtocolError) as info:
        cp.decode_client_message(data)
    assert info.value.code == code
    assert words in info.value.message


def test_error_keeps_the_request_id_when_it_is_readable():
    data = frame(type="generate", request_id="r9", prompt="")
    with pytest.raises(cp.ClientProtocolError) as info:
        cp.decode_client_message(data)
    assert info.value.request_id == "r9"


def test_health_stream_ids_must_be_strings():
    frame = msgpack.packb(
        {"v": cp.PROTOCOL_VERSION, "type": "health", "request_id": "h", "stream_ids": ["ok", 3]}
    )
    with pytest.raises(cp.ClientProtocolError, match="stream_ids must be a list of strings"):
        cp.decode_client_message(frame)
