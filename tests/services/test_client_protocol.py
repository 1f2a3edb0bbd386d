"""Client <-> scheduler message validation: every malformed message names its problem."""

import msgpack
import pytest

from weir.shared.pooling import PoolingParams
from weir.shared.protocol import client as client_protocol
from weir.shared.sampling import SamplingParams

CHAT = [{"role": "user", "content": "a"}]


def frame(**fields) -> bytes:
    return msgpack.packb({"v": client_protocol.PROTOCOL_VERSION, **fields})


def test_round_trip_of_every_client_message():
    params = SamplingParams(max_tokens=7, temperature=0.5, stop=("x",), seed=3)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    chat = [
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": "hm"},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    template_args = client_protocol.ChatTemplateArgs(
        '[{"type": "function", "function": {"name": "f"}}]', '{"enable_thinking": false}'
    )
    continued = client_protocol.ChatTemplateArgs(None, None, False, True)
    for prompt, priority, chat_args, lora_name in (
        ("hi", 0, client_protocol.NO_CHAT_ARGS, None),
        ([1, 2, 3], -5, client_protocol.NO_CHAT_ARGS, "sql"),
        ([{"role": "user", "content": "hi"}], 7, client_protocol.NO_CHAT_ARGS, None),
        (chat, 0, template_args, "org/adapter"),
        (chat, 0, continued, None),
    ):
        msg = client_protocol.GenerateRequest(
            "r1", prompt, params, priority, chat_args, "salt", lora_name
        )
        assert (
            client_protocol.decode_client_message(client_protocol.encode_client_message(msg)) == msg
        )
    pictured = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]},
        {"role": "assistant", "content": "a cat"},
        {"role": "user", "content": [{"type": "image"}]},
    ]
    for prompt, images in ((pictured, [b"\x89PNG one", b"two"]), ("<image> and", [b"\xff"])):
        msg = client_protocol.GenerateRequest("i", prompt, params, images=images)
        assert (
            client_protocol.decode_client_message(client_protocol.encode_client_message(msg)) == msg
        )
    for msg in (
        *(
            client_protocol.GenerateRequest("e", "hi", SamplingParams(), pooling_params=pooling)
            for pooling in (PoolingParams(), PoolingParams(64, False))
        ),
        client_protocol.GenerateRequest("w", "hi", SamplingParams(), queued_with="r-0"),
        client_protocol.GenerateRequest("c", "hi", SamplingParams(), cap_max_tokens=True),
    ):
        assert (
            client_protocol.decode_client_message(client_protocol.encode_client_message(msg)) == msg
        )
    for msg in (
        client_protocol.TokenizeRequest("t", "hi"),
        client_protocol.TokenizeRequest("t", ""),  # an empty text has tokens too (none, or BOS)
        client_protocol.TokenizeRequest("t", chat, False, template_args),
        client_protocol.TokenizeRequest("t", chat, True, continued),
        client_protocol.DetokenizeRequest("d", [1, 2]),
        client_protocol.AbortRequest("a"),
        client_protocol.HealthRequest("h"),
        client_protocol.HealthRequest("h", ["s1", "s2"]),
        client_protocol.ModelInfoRequest("m"),
    ):
        assert (
            client_protocol.decode_client_message(client_protocol.encode_client_message(msg)) == msg
        )


def test_round_trip_of_server_messages():
    outs = [
        client_protocol.StreamOutput("a", [1, 2], "hi", False, None, 3, 2, [5, 6, 7]),
        client_protocol.StreamOutput(
            "b",
            [],
            "",
            True,
            "abort",
            1,
            0,
            logprobs={"token_ids": [[1, 2]], "logprobs": [[-0.1, -2.0]]},
        ),
        client_protocol.StreamOutput("c", [9], " x", False, None, 4, 3),
        client_protocol.StreamOutput(
            "d",
            [4],
            "",
            True,
            "stop",
            2,
            1,
            [1, 2],
            {"token_ids": [[4]], "logprobs": [[-0.5]], "tokens": [["y"]]},
            "</s>",
            {"token_ids": [[1], [2]], "logprobs": [[None], [-1.0]]},
            b"\x00\x00\x80?",
        ),
    ]
    assert client_protocol.decode_server_message(client_protocol.encode_outputs(outs)) == outs
    # A frame of another protocol version is refused as such, not misread.
    old = msgpack.packb({"v": 1, "type": "outputs", "items": [{"request_id": "a"}]})
    with pytest.raises(client_protocol.ClientProtocolError, match="version 1"):
        client_protocol.decode_server_message(old)
    for msg in (
        client_protocol.ErrorReply(None, "bad", client_protocol.MALFORMED_MESSAGE),
        client_protocol.HealthReply("h", {"status": "ok"}),
        client_protocol.ModelInfoReply("m", {"model_name": "x"}),
        client_protocol.TokensReply("t", {"token_ids": [1], "max_model_len": 8}),
    ):
        assert (
            client_protocol.decode_server_message(client_protocol.encode_server_message(msg)) == msg
        )


_PICTURED = [{"role": "user", "content": [{"type": "image"}]}]
# (prompt, images, code, words): images that do not fit their prompt or the protocol.
_IMAGE_PROBLEMS = [
    ("<image>", "png", client_protocol.INVALID_REQUEST, "images must be a list"),
    ("<image>", ["png"], client_protocol.INVALID_REQUEST, "images must be a list"),
    ("<image>", [b""], client_protocol.INVALID_REQUEST, "images[0]: an image must be"),
    ("x", [b"i"] * 65, client_protocol.INVALID_REQUEST, "at most 64 images"),
    ([1, 2], [b"i"], client_protocol.INVALID_REQUEST, "not token ids"),
    (_PICTURED, [], client_protocol.INVALID_REQUEST, "1 image parts but the request sends 0"),
    (_PICTURED, [b"a", b"b"], client_protocol.INVALID_REQUEST, "sends 2 images"),
    (
        [{"role": "user", "content": [{"type": "image", "url": "x"}]}],
        [b"a"],
        client_protocol.INVALID_REQUEST,
        "content[0] must be",
    ),
    (
        [{"role": "user", "content": []}],
        [],
        client_protocol.INVALID_REQUEST,
        "non-empty list of parts",
    ),
    (
        [{"role": "user", "content": [{"type": "text", "text": 3}]}],
        [],
        client_protocol.INVALID_REQUEST,
        "content[0] must be",
    ),
]


@pytest.mark.parametrize(
    "data, code, words",
    [
        (b"\xc1\xff", client_protocol.MALFORMED_MESSAGE, "msgpack"),
        (msgpack.packb([1, 2]), client_protocol.MALFORMED_MESSAGE, "map"),
        (
            msgpack.packb({"type": "health", "request_id": "x"}),
            client_protocol.UNSUPPORTED_VERSION,
            "version",
        ),
        (frame(type="explode", request_id="x"), client_protocol.UNKNOWN_MESSAGE_TYPE, "explode"),
        (frame(type="health"), client_protocol.INVALID_REQUEST, "request_id"),
        (frame(type="health", request_id=5), client_protocol.INVALID_REQUEST, "request_id"),
        (frame(type="health", request_id="x" * 300), client_protocol.INVALID_REQUEST, "request_id"),
        (frame(type="abort", request_id="x", extra=1), client_protocol.INVALID_REQUEST, "extra"),
        (frame(type="generate", request_id="x"), client_protocol.INVALID_REQUEST, "prompt"),
        (
            frame(type="generate", request_id="x", prompt=""),
            client_protocol.INVALID_REQUEST,
            "empty",
        ),
        (
            frame(type="generate", request_id="x", prompt=[]),
            client_protocol.INVALID_REQUEST,
            "empty",
        ),
        (
            frame(type="generate", request_id="x", prompt=3.5),
            client_protocol.INVALID_REQUEST,
            "prompt",
        ),
        (
            frame(type="generate", request_id="x", prompt=[1, "a"]),
            client_protocol.INVALID_REQUEST,
            "prompt[1]",
        ),
        (
            frame(type="generate", request_id="x", prompt=[1, True]),
            client_protocol.INVALID_REQUEST,
            "prompt[1]",
        ),
        (
            frame(type="generate", request_id="x", prompt=[{"role": "user"}]),
            client_protocol.INVALID_REQUEST,
            "content",
        ),
        (
            frame(type="generate", request_id="x", prompt=[{"role": "user", "content": 1}]),
            client_protocol.INVALID_REQUEST,
            "content must be a string or a non-empty list of parts",
        ),
        (
            frame(type="generate", request_id="x", prompt=[{"role": "user", "content": "a"}, 3]),
            client_protocol.INVALID_REQUEST,
            "prompt[1]",
        ),
        (
            frame(type="generate", request_id="x", prompt="hi", sampling_params=[1]),
            client_protocol.INVALID_REQUEST,
            "dict",
        ),
        (
            frame(
                type="generate", request_id="x", prompt="hi", sampling_params={"temperature": "hot"}
            ),
            client_protocol.INVALID_REQUEST,
            "temperature",
        ),
        (
            frame(type="generate", request_id="x", prompt="hi", sampling_params={"max_tokens": 0}),
            client_protocol.INVALID_REQUEST,
            "max_tokens",
        ),
        (
            frame(type="generate", request_id="x", prompt="hi", sampling_params={"warp": 9}),
            client_protocol.INVALID_REQUEST,
            "warp",
        ),
        (
            frame(type="generate", request_id="x", prompt="hi", priority=2**31),
            client_protocol.INVALID_REQUEST,
            "priority must be a 32-bit int",
        ),
        (
            frame(type="generate", request_id="x", prompt="hi", priority=True),
            client_protocol.INVALID_REQUEST,
            "priority",
        ),
        # Unhashable types used to escape as TypeError and stop the scheduler.
        (frame(type=[1], request_id="x"), client_protocol.UNKNOWN_MESSAGE_TYPE, "[1]"),
        (frame(type={"a": 1}, request_id="x"), client_protocol.UNKNOWN_MESSAGE_TYPE, "type"),
        (frame(type=True, request_id="x"), client_protocol.UNKNOWN_MESSAGE_TYPE, "True"),
        (frame(type="abort", request_id="a\x00b"), client_protocol.INVALID_REQUEST, "printable"),
        (frame(type="abort", request_id="a\nb"), client_protocol.INVALID_REQUEST, "printable"),
        (msgpack.packb([[[[1]]]] * 2), client_protocol.MALFORMED_MESSAGE, "map"),
        (b"\x91" * 5000 + b"\xc0", client_protocol.MALFORMED_MESSAGE, "msgpack"),
        (
            frame(type="generate", request_id="x", prompt="hi", sampling_params={"n": 2}),
            client_protocol.INVALID_REQUEST,
            "a request samples one sequence",
        ),
        *(
            (
                frame(type="generate", request_id="x", prompt="hi", queued_with=bad),
                client_protocol.INVALID_REQUEST,
                "queued_with must be a request id",
            )
            for bad in (1, "", "a\x00b", "x" * 300, ["r-0"])
        ),
        *(
            (
                frame(type="generate", request_id="x", prompt="hi", cap_max_tokens=bad),
                client_protocol.INVALID_REQUEST,
                "cap_max_tokens must be a bool",
            )
            for bad in (1, "yes", None, [True])
        ),
        (
            frame(
                type="generate", request_id="x", prompt=[1] * (client_protocol.MAX_ARRAY_LEN + 1)
            ),
            client_protocol.MALFORMED_MESSAGE,
            "max_array_len",
        ),
        (
            frame(type="tokenize", request_id="x", prompt=[1, 2]),
            client_protocol.INVALID_REQUEST,
            "text or chat messages",
        ),
        (
            frame(type="tokenize", request_id="x", prompt="a", add_special_tokens=1),
            client_protocol.INVALID_REQUEST,
            "add_special_tokens must be a bool",
        ),
        (
            frame(type="tokenize", request_id="x", prompt=CHAT, add_generation_prompt=1),
            client_protocol.INVALID_REQUEST,
            "add_generation_prompt and continue_final_message must be bools",
        ),
        (
            frame(type="generate", request_id="x", prompt=CHAT, continue_final_message=True),
            client_protocol.INVALID_REQUEST,
            "it needs add_generation_prompt false",
        ),
        (
            frame(type="generate", request_id="x", prompt=CHAT, chat_template_kwargs={"a": 1}),
            client_protocol.INVALID_REQUEST,
            "tools and chat_template_kwargs must be JSON text",
        ),
        (
            frame(type="generate", request_id="x", prompt="a", cache_salt=5),
            client_protocol.INVALID_REQUEST,
            "cache_salt must be a non-empty string",
        ),
        (
            frame(type="generate", request_id="x", prompt="a", cache_salt=""),
            client_protocol.INVALID_REQUEST,
            "cache_salt must be a non-empty string",
        ),
        (
            frame(type="generate", request_id="x", prompt="a", lora_name=["sql"]),
            client_protocol.INVALID_REQUEST,
            "lora_name must be a non-empty string of at most 256 characters",
        ),
        (
            frame(type="generate", request_id="x", prompt="a", lora_name="s" * 257),
            client_protocol.INVALID_REQUEST,
            "lora_name must be a non-empty string of at most 256 characters",
        ),
        (
            frame(type="generate", request_id="x", prompt="a", pooling_params=[64]),
            client_protocol.INVALID_REQUEST,
            "pooling_params must be a map",
        ),
        (
            frame(type="generate", request_id="x", prompt="a", pooling_params={"dimensions": 0}),
            client_protocol.INVALID_REQUEST,
            "dimensions must be an int in",
        ),
        (
            frame(type="generate", request_id="x", prompt="a", pooling_params={"normalize": 1}),
            client_protocol.INVALID_REQUEST,
            "normalize must be a bool",
        ),
        (
            frame(type="generate", request_id="x", prompt="a", pooling_params={"pool": "MAX"}),
            client_protocol.INVALID_REQUEST,
            "pooling_params: unknown field 'pool'",
        ),
        (
            frame(type="generate", request_id="x", prompt=[1], add_generation_prompt=False),
            client_protocol.INVALID_REQUEST,
            "add_generation_prompt comes with a chat",
        ),
        (
            frame(type="tokenize", request_id="x", prompt="", tools="[]"),
            client_protocol.INVALID_REQUEST,
            "tools comes with a chat",
        ),
        (
            frame(type="tokenize", request_id="x", prompt="a", tools="[]"),
            client_protocol.INVALID_REQUEST,
            "tools comes with a chat",
        ),
        (
            frame(type="detokenize", request_id="x", token_ids=[1, -2]),
            client_protocol.INVALID_REQUEST,
            "token_ids must be a list of token ids",
        ),
        (
            frame(type="detokenize", request_id="x"),
            client_protocol.INVALID_REQUEST,
            "token_ids must be a list of token ids",
        ),
        (
            frame(type="detokenize", request_id="x", token_ids=[1], as_tokens=1),
            client_protocol.INVALID_REQUEST,
            "as_tokens must be a bool",
        ),
        (
            frame(type="generate", request_id="x", prompt="hi", tools="[]"),
            client_protocol.INVALID_REQUEST,
            "tools comes with a chat",
        ),
        (
            frame(
                type="generate", request_id="x", prompt=[{"role": "user", "content": "a"}], tools=[]
            ),
            client_protocol.INVALID_REQUEST,
            "tools and chat_template_kwargs must be JSON text",
        ),
        (
            frame(
                type="generate", request_id="x", prompt=[{"role": "user", "content": "a", "x": 1}]
            ),
            client_protocol.INVALID_REQUEST,
            "may have ['name', 'reasoning_content', 'tool_call_id', 'tool_calls']",
        ),
        (
            frame(
                type="generate",
                request_id="x",
                prompt=[{"role": "assistant", "content": "", "tool_calls": {"a": 1}}],
            ),
            client_protocol.INVALID_REQUEST,
            "prompt[0].tool_calls must be a list",
        ),
        (
            frame(
                type="generate",
                request_id="x",
                prompt=[
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"function": {"name": "f"}}],
                    }
                ],
            ),
            client_protocol.INVALID_REQUEST,
            "prompt[0].tool_calls[0].function must map name and arguments to strings",
        ),
        (
            frame(
                type="generate",
                request_id="x",
                prompt=[{"role": "assistant", "content": "", "tool_calls": [{"id": 5}]}],
            ),
            client_protocol.INVALID_REQUEST,
            'prompt[0].tool_calls[0] must be a map of id, type ("function") and function',
        ),
        (
            frame(type="generate", request_id="x", prompt=[{"role": "hacker", "content": "a"}]),
            client_protocol.INVALID_REQUEST,
            "chat role",
        ),
        (
            frame(type="generate", request_id="x", prompt=[{"role": "", "content": "a"}]),
            client_protocol.INVALID_REQUEST,
            "chat role",
        ),
        (
            frame(type="generate", request_id="x", prompt=[1], sampling_params={"top_k": 2**63}),
            client_protocol.INVALID_REQUEST,
            "top_k",
        ),
        (
            frame(
                type="generate",
                request_id="x",
                prompt=[1],
                sampling_params={"max_tokens": 2**31, "min_tokens": 2**31},
            ),
            client_protocol.INVALID_REQUEST,
            "max_tokens",
        ),
        (
            frame(type="generate", request_id="x", prompt=[1], sampling_params={"seed": 2**64 - 1}),
            client_protocol.INVALID_REQUEST,
            "seed",
        ),
        (
            frame(
                type="generate",
                request_id="x",
                prompt=[1],
                sampling_params={"stop_token_ids": [2**63], "min_tokens": 1},
            ),
            client_protocol.INVALID_REQUEST,
            "stop_token_ids",
        ),
        (
            frame(
                type="generate",
                request_id="x",
                prompt=[1],
                sampling_params={"temperature": float("nan")},
            ),
            client_protocol.INVALID_REQUEST,
            "finite",
        ),
        *(
            (frame(type="generate", request_id="x", prompt=prompt, images=images), code, words)
            for prompt, images, code, words in _IMAGE_PROBLEMS
        ),
    ],
)
def test_malformed_client_messages_name_the_problem(data, code, words):
    with pytest.raises(client_protocol.ClientProtocolError) as info:
        client_protocol.decode_client_message(data)
    assert info.value.code == code
    assert words in info.value.message


def test_error_keeps_the_request_id_when_it_is_readable():
    data = frame(type="generate", request_id="r9", prompt="")
    with pytest.raises(client_protocol.ClientProtocolError) as info:
        client_protocol.decode_client_message(data)
    assert info.value.request_id == "r9"
    # An unusable id is not echoed back.
    with pytest.raises(client_protocol.ClientProtocolError) as info:
        client_protocol.decode_client_message(frame(type=[1], request_id="r\x00"))
    assert info.value.request_id is None


def test_tiny_temperatures_are_greedy_and_max_tokens_may_be_left_to_the_server():
    assert SamplingParams(temperature=1e-45).temperature == 0.0
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    params = SamplingParams(max_tokens=None, min_tokens=5)
    assert SamplingParams.from_dict(params.to_dict()) == params


def test_cap_max_tokens_is_sent_only_when_set_and_a_message_without_it_decodes():
    """An older peer's generate message, which has no cap_max_tokens, decodes as one that
    does not cap (a max_tokens past max_model_len is refused, as before)."""
    sent = frame(type="generate", request_id="r", prompt="hi", sampling_params={})
    assert client_protocol.decode_client_message(sent).cap_max_tokens is False
    plain = client_protocol.GenerateRequest("r", "hi", SamplingParams())
    assert "cap_max_tokens" not in msgpack.unpackb(client_protocol.encode_client_message(plain))
    capped = client_protocol.GenerateRequest("r", "hi", SamplingParams(), cap_max_tokens=True)
    assert msgpack.unpackb(client_protocol.encode_client_message(capped))["cap_max_tokens"]
    # An SDK caller's truthy non-bool reaches the server as given, and is refused there.
    loose = client_protocol.GenerateRequest("r", "hi", SamplingParams(), cap_max_tokens="yes")  # type: ignore[arg-type]
    with pytest.raises(client_protocol.ClientProtocolError, match="must be a bool"):
        client_protocol.decode_client_message(client_protocol.encode_client_message(loose))


def test_health_stream_ids_must_be_strings():
    frame = msgpack.packb(
        {
            "v": client_protocol.PROTOCOL_VERSION,
            "type": "health",
            "request_id": "h",
            "stream_ids": ["ok", 3],
        }
    )
    with pytest.raises(
        client_protocol.ClientProtocolError, match="stream_ids must be a list of strings"
    ):
        client_protocol.decode_client_message(frame)


def test_a_health_request_names_at_most_so_many_streams():
    def health(n: int) -> bytes:
        ids = [f"r{i}" for i in range(n)]
        message = {"v": client_protocol.PROTOCOL_VERSION, "type": "health", "request_id": "h"}
        return msgpack.packb({**message, "stream_ids": ids})

    limit = client_protocol.MAX_HEALTH_STREAM_IDS
    assert len(client_protocol.decode_client_message(health(limit)).stream_ids) == limit
    with pytest.raises(client_protocol.ClientProtocolError, match=f"at most {limit} stream_ids"):
        client_protocol.decode_client_message(health(limit + 1))
