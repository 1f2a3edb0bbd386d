"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) through the
official `anthropic` client, in front of real `weir serve` processes on the tiny random
Llama: a message is the chat its turns make, answered as content blocks. References:
transformers renders the same chat and decodes greedily; the SDK's own stream accumulator
builds, from the events, the message the whole response is.
"""

import json

import anthropic
import httpx
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter
from serving_helpers import hf_greedy, small_server

from weir.services.gateway.anthropic_messages import MessageEvents, MessagesRequest, whole_message
from weir.services.gateway.chat_output import ChatParsers
from weir.services.gateway.openai_format import Choice
from weir.services.launcher import GatewayProcess
from weir.shared.protocol.client import StreamOutput

transformers = pytest.importorskip("transformers")

MODEL = "tiny-messages"
GREEDY = {"temperature": 0}  # not among the SDK's arguments any more: its newest models take none


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with small_server(tiny_model_dir, MODEL, enable_prefix_caching=True) as processes:
        yield processes


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.info["http_address"], api_key="-")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def _hf_answer(tokenizer, model, messages, num_tokens: int, prefill: bool = False):
    ids = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        tokenize=True,
        return_dict=False,
    )
    return ids, tokenizer.decode(hf_greedy(model, ids, num_tokens), skip_special_tokens=True)


def _streamed(client, **kwargs) -> Message:
    """A streamed message as the SDK's stream helper accumulates it from the events."""
    with client.messages.stream(**kwargs) as stream:
        return stream.get_final_message()


def _blocks(message) -> list[dict]:
    """A message's content blocks as dicts (a streamed text block is the SDK's parsed kind)."""
    return [block.model_dump(exclude_none=True) for block in message.content]


def _input_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_a_message_is_transformers_greedy_answer_whole_and_streamed(
    client, tokenizer, tiny_hf_model
):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids, want = _hf_answer(tokenizer, tiny_hf_model, messages, 6)
    kwargs = {
        "model": MODEL,
        "max_tokens": 6,
        "system": "Be brief.",
        "messages": messages[1:],
        "extra_body": GREEDY,
    }
    whole = client.messages.create(**kwargs)
    assert [(b.type, b.text) for b in whole.content] == [("text", want)]
    assert (whole.role, whole.stop_reason, whole.stop_sequence) == ("assistant", "max_tokens", None)
    assert whole.id.startswith("msg_") and whole.model == MODEL
    assert (_input_tokens(whole.usage), whole.usage.output_tokens) == (len(ids), 6)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(whole) and final.stop_reason == "max_tokens"
    assert (_input_tokens(final.usage), final.usage.output_tokens) == (len(ids), 6)
    types = [e.type for e in events if e.type != "text"]  # the helper's own text events
    assert types[:2] == ["message_start", "content_block_start"]
    start = events[0].message.usage  # the prompt's, before any output
    assert (_input_tokens(start), start.output_tokens) == (len(ids), 0)
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) == want and len(deltas) > 1


def test_system_blocks_and_turns_render_as_the_chat_they_are(client, tokenizer, tiny_hf_model):
    """Text blocks join as chat parts do (and consecutive user turns as one), Claude Code's
    billing header is left out (it changes each request and would defeat the prefix cache),
    a system turn joins the system prompt (and Claude Code's "msg" turn is the user's, as
    vLLM reads them), and a last assistant turn is a prefill the answer goes on from."""
    chat = [
        {"role": "system", "content": "Be brief.\nBe kind.\nBe quick."},
        {"role": "user", "content": "Hi\nthere"},
        {"role": "assistant", "content": "Hello! I"},
    ]
    ids, want = _hf_answer(tokenizer, tiny_hf_model, chat, 5, prefill=True)
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=4f2a;"},
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Be kind."},
    ]
    turns = [
        {"role": "system", "content": "Be quick."},
        {
            "role": "msg",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
        },
        {"role": "assistant", "content": "Hello! I"},
    ]
    reply = client.messages.create(
        model=MODEL, max_tokens=5, system=system, messages=turns, extra_body=GREEDY
    )
    assert reply.content[0].text == want
    assert _input_tokens(reply.usage) == len(ids)
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=turns)
    assert counted.input_tokens == len(ids)
    # Consecutive user turns are one, as Anthropic combines them.
    apart = [*turns[:1], {"role": "user", "content": "Hi"}, {"role": "user", "content": "there"}]
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=[*apart, turns[-1]])
    assert counted.input_tokens == len(ids)


def test_a_stop_sequence_ends_the_message_and_is_named(client, tokenizer, tiny_hf_model):
    messages = [{"role": "user", "content": "Hi"}]
    _, want = _hf_answer(tokenizer, tiny_hf_model, messages, 12)
    stop = want[len(want) // 2 : len(want) // 2 + 2]
    assert stop.strip() and stop in want
    # What Claude Code sends that changes nothing here: taken.
    unused = {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}
    kwargs = {
        "model": MODEL,
        "max_tokens": 12,
        "messages": messages,
        "metadata": {"user_id": "u1"},
        "extra_body": {**GREEDY, **unused},
    }
    for reply in (
        client.messages.create(stop_sequences=[stop], **kwargs),
        _streamed(client, stop_sequences=[stop], **kwargs),
    ):
        assert reply.content[0].text == want[: want.index(stop)]
        assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)


def test_a_repeated_prompt_reads_its_blocks_from_the_cache(client):
    """Anthropic's usage counts the prompt's tokens read from the cache apart from those
    computed (the template's opening may be cached by the tests before)."""
    messages = [{"role": "user", "content": "A question only this test asks, " * 20}]
    first = client.messages.create(model=MODEL, max_tokens=1, messages=messages)
    again = client.messages.create(model=MODEL, max_tokens=1, messages=messages)
    assert first.usage.cache_read_input_tokens < 32
    # Every full block of 16 but the last, which holds the token the engine computes.
    assert again.usage.cache_read_input_tokens == 16 * ((_input_tokens(again.usage) - 1) // 16)
    assert _input_tokens(again.usage) == _input_tokens(first.usage)
    assert (
        again.usage.input_tokens == _input_tokens(again.usage) - again.usage.cache_read_input_tokens
    )


def test_max_tokens_bounds_the_output_and_the_models_context_ends_it(client):
    """Anthropic's max_tokens is a bound, not a demand (Claude Code asks for 32,000 of any
    model): past the context it is not refused; the output ends at the context, and says
    so, whole and streamed."""
    messages = [{"role": "user", "content": "word " * 450}]
    prompt = client.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    assert prompt < 500
    kwargs = {"model": MODEL, "max_tokens": 32_000, "messages": messages}
    streamed = _streamed(client, **kwargs)
    # The SDK asks a whole request of that many tokens for a timeout of its own.
    for reply in (client.messages.create(**kwargs, timeout=60), streamed):
        assert _input_tokens(reply.usage) == prompt
        assert reply.usage.output_tokens == 512 - prompt
        assert reply.stop_reason == "model_context_window_exceeded"
    fits = client.messages.create(**{**kwargs, "max_tokens": 512 - prompt - 1})
    assert fits.stop_reason == "max_tokens"


def test_thinking_comes_back_as_a_thinking_block(server, tokenizer, tiny_hf_model):
    """Behind --reasoning-parser a thought is a thinking block (with a signature, which
    clients send back): the random model never ends its thought, so all of its text is
    thinking; sent back, the thought is the assistant's reasoning again."""
    with GatewayProcess(
        [server.client_address], parsers=ChatParsers(reasoning="deepseek_r1")
    ) as gateway:
        thinking = anthropic.Anthropic(base_url=gateway.info["http_address"], api_key="-")
        _, want = _hf_answer(tokenizer, tiny_hf_model, [{"role": "user", "content": "Hi"}], 5)
        kwargs = {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "Hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "extra_body": GREEDY,
        }
        [block] = thinking.messages.create(**kwargs).content
        assert (block.type, block.thinking) == ("thinking", want) and block.signature
        [streamed] = _streamed(thinking, **kwargs).content
        assert (streamed.type, streamed.thinking) == ("thinking", want) and streamed.signature
        turns = [
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "content": [block.model_dump(), {"type": "text", "text": "Yes."}],
            },
            {"role": "user", "content": "More"},
        ]
        reply = thinking.messages.create(model=MODEL, max_tokens=1, messages=turns)
        assert reply.stop_reason == "max_tokens"


def _hermes_message(stream: bool, pieces: list[str]) -> dict:
    """A hermes tool-call output read into Anthropic's message, whole or through its events
    (accumulated by the SDK's own code)."""
    output = (
        MessagesRequest.model_validate(
            {
                "model": "m",
                "max_tokens": 100,
                "messages": [{"role": "user", "content": "?"}],
                "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            }
        )
        .chat_request()
        .chat_output(ChatParsers(tool_call="hermes"))
    )
    assert output.tool_choice is not None and output.tool_choice.kind == "auto"
    last = len(pieces) - 1
    outs = [
        StreamOutput(
            "r",
            [1],
            text,
            finished=i == last,
            finish_reason="stop" if i == last else None,
            prompt_tokens=7,
            completion_tokens=i + 1,
        )
        for i, text in enumerate(pieces)
    ]
    if not stream:
        choice = Choice(0)
        for out in outs:
            choice.add(out)
        return whole_message("msg_1", "m", output, choice, 512)
    events = MessageEvents("msg_1", "m", output, 512)
    choice = Choice(0)
    text = events.opening([(0, [outs[0]])]).decode()
    for out in outs:
        choice.add(out)
        text += events.chunk(out, choice)
    text += events.ending([choice]).decode()
    adapter: TypeAdapter = TypeAdapter(RawMessageStreamEvent)
    snapshot, json_bufs = None, {}
    for event in text.split("\n\n")[:-1]:
        name, data = event.split("\n")
        if name == "event: ping":  # the SDK's stream skips it
            continue
        parsed = adapter.validate_python(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {parsed.type}"
        snapshot = accumulate_event(event=parsed, current_snapshot=snapshot, json_bufs=json_bufs)
    return snapshot.model_dump(exclude_none=True)


def test_tool_uses_read_by_a_tool_call_parser_are_the_same_whole_and_streamed():
    text = (
        "Checking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'
    )
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    whole = Message.model_validate(_hermes_message(False, pieces), strict=True)
    assert [b.type for b in whole.content] == ["text", "tool_use"]
    assert whole.content[0].text == "Checking.\n"
    assert (whole.content[1].name, whole.content[1].input) == (
        "get_weather",
        {"city": "Oslo", "days": 3},
    )
    assert whole.stop_reason == "tool_use"
    streamed = _hermes_message(True, pieces)
    for block in (*streamed["content"], *(whole := whole.model_dump(exclude_none=True))["content"]):
        assert block.pop("id", "toolu_").startswith(("toolu_", "call_"))  # each reader's own
    assert streamed["content"] == whole["content"]
    assert streamed["stop_reason"] == "tool_use"


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
        ({"temperature": 1.5}, "temperature: Input should be less than or equal to 1"),
        ({"messages": []}, "messages: List should have at least 1 item"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "(no documents)",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "source.type: Field required",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "AA==",
                                },
                            }
                        ],
                    }
                ]
            },
            "this model takes no images",
        ),
        ({"mcp_servers": []}, "mcp_servers: unsupported field"),
        (
            {
                "messages": [
                    {"role": "system", "content": [{"type": "tool_result", "tool_use_id": "1"}]},
                    {"role": "user", "content": "Hi"},
                ]
            },
            "system: a system prompt has text blocks, not tool_result",
        ),
        (
            {"tools": [{"name": "f", "input_schema": {"type": "object"}}]},
            'tool_choice "auto" (the default with tools) needs a server started with',
        ),
        (
            {"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool"}},
            'tool_choice.name: tool_choice "tool" names one',
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "1", "name": "f", "input": {}}],
                    }
                ]
            },
            "messages: a user message has no tool_use blocks",
        ),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {"type": "no"}}}},
            "output_config.format",
        ),
    ],
)
def test_what_a_message_cannot_do_is_a_400_in_anthropics_shape(client, fields, words):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.post("/v1/messages", body={**body, **fields}, cast_to=Message)
    error = caught.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"], error


def test_an_unknown_model_and_a_wrong_key_are_anthropics_errors(server, client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(
            model="claude-x", max_tokens=1, messages=[{"role": "user", "content": "Hi"}]
        )
    assert caught.value.body["error"]["type"] == "not_found_error"
    with GatewayProcess([server.client_address], api_key="s3cret") as gateway:
        http = gateway.info["http_address"]
        turns = [{"role": "user", "content": "Hi"}]
        wrong = anthropic.Anthropic(base_url=http, api_key="nope")
        with pytest.raises(anthropic.AuthenticationError) as caught:
            wrong.messages.create(model=MODEL, max_tokens=1, messages=turns)
        assert caught.value.body["error"]["type"] == "authentication_error"
        right = anthropic.Anthropic(base_url=http, api_key="s3cret")
        assert (
            right.messages.create(model=MODEL, max_tokens=1, messages=turns).usage.output_tokens
            == 1
        )
        # The openai SDK's header, on Anthropic's route too.
        reply = httpx.post(
            http + "/v1/messages/count_tokens",
            json={"model": MODEL, "messages": turns},
            headers={"Authorization": "Bearer s3cret"},
        )
        assert reply.status_code == 200 and reply.json()["input_tokens"] > 0


def test_the_models_are_listed_in_anthropics_shape_to_its_client(server, client):
    """The SDK's models.list and models.retrieve (it sends anthropic-version) get Anthropic's
    shape, an unknown model its 404; the openai SDK's request, OpenAI's list."""
    listed = list(client.models.list())
    assert [(m.type, m.id, m.display_name) for m in listed] == [("model", MODEL, MODEL)]
    page = client.models.list()
    assert (page.has_more, page.first_id, page.last_id) == (False, MODEL, MODEL)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.models.retrieve("claude-x")
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "not_found_error"
    openai_shape = httpx.get(server.info["http_address"] + "/v1/models").json()
    assert openai_shape["object"] == "list" and openai_shape["data"][0]["object"] == "model"


def test_a_stream_pings_after_its_message_starts(server):
    """Anthropic's streams send a ping event (the SDK skips it): read off the wire."""
    body = {"model": MODEL, "max_tokens": 2, "stream": True}
    body["messages"] = [{"role": "user", "content": "Hi"}]
    with httpx.stream("POST", server.info["http_address"] + "/v1/messages", json=body) as reply:
        events = [line[7:] for line in reply.iter_lines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert events[-1] == "message_stop"
