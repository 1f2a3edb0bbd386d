"""OpenAI's Responses API (`POST /v1/responses`) through the official `openai` client, in
front of real `weir serve` processes on the tiny random Llama: a response is the chat its
input makes, answered as output items. References: transformers renders the same chat and
decodes greedily; the stream's events add up to the whole response.
"""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai.types.responses import Response
from serving_helpers import hf_greedy, read_metrics, small_server

from weir.services.gateway.chat_output import ChatParsers
from weir.services.gateway.response_store import ResponseStore
from weir.services.launcher import GatewayProcess

transformers = pytest.importorskip("transformers")

MODEL = "tiny-responses"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with small_server(tiny_model_dir, MODEL) as processes:
        yield processes


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.info["http_address"] + "/v1", api_key="-")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def _events(client, **kwargs) -> list:
    """A streamed response's events, checked for order: numbered from 0, opened by
    created and in_progress."""
    events = list(client.responses.create(model=MODEL, stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    return events


@pytest.mark.parametrize("form", ["text", "items"])
def test_a_response_is_transformers_greedy_answer_whole_and_streamed(
    client, tokenizer, tiny_hf_model, form
):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    want = tokenizer.decode(hf_greedy(tiny_hf_model, ids, 6), skip_special_tokens=True)
    given = "Hi" if form == "text" else [{"type": "message", "role": "user", "content": "Hi"}]
    kwargs = {"input": given, "instructions": "Be brief.", "max_output_tokens": 6, "temperature": 0}
    # tool_choice "auto", the Responses API's default, needs no tools (chat's does).
    whole = client.responses.create(model=MODEL, tool_choice="auto", **kwargs)
    assert whole.output_text == want
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (len(ids), 6)
    [item] = whole.output
    # Cut by max_output_tokens, as the response: incomplete (OpenAI's).
    assert (item.type, item.role, item.status) == ("message", "assistant", "incomplete")
    events = _events(client, **kwargs)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == want
    assert {e.item_id for e in deltas} == {events[2].item.id}
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.output_text == want
    assert [e.type for e in events[-4:-1]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert events[-2].item.status == last.response.output[0].status == "incomplete"


def test_a_completed_stream_is_the_sdks_final_response(client):
    """The SDK's stream helper accumulates the events into the response it reports."""
    kwargs = {"input": "Hi", "max_output_tokens": 40, "temperature": 0}
    format_ = {"format": {"type": "json_schema", "name": "x", "schema": {"enum": ["yes", "no"]}}}
    whole = client.responses.create(model=MODEL, text=format_, **kwargs)
    with client.responses.stream(model=MODEL, text=format_, **kwargs) as stream:
        final = stream.get_final_response()
    assert whole.status == final.status == "completed"
    assert whole.output_text == final.output_text and whole.output_text in ('"yes"', '"no"')


def test_reasoning_comes_back_as_a_reasoning_item(server, client, tokenizer, tiny_hf_model):
    """Behind --reasoning-parser, a thinking model's thought is a reasoning item: the random
    model never ends its thought, so all of its text is reasoning, and no message follows."""
    with GatewayProcess(
        [server.client_address], parsers=ChatParsers(reasoning="deepseek_r1")
    ) as gateway:
        thinking = openai.OpenAI(base_url=gateway.info["http_address"] + "/v1", api_key="-")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        want = tokenizer.decode(hf_greedy(tiny_hf_model, ids, 5), skip_special_tokens=True)
        kwargs = {"input": "Hi", "max_output_tokens": 5, "temperature": 0}
        [item] = thinking.responses.create(model=MODEL, **kwargs).output
        assert item.type == "reasoning" and item.content[0].text == want
        events = _events(thinking, **kwargs)
        deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        assert "".join(deltas) == want
        [done] = [e for e in events if e.type == "response.output_item.done"]
        assert done.item.type == "reasoning" and done.item.content[0].text == want


def test_an_aborted_response_is_cancelled_whole_and_streamed_alike(server):
    """`/pause?mode=abort` ends the requests in flight: such a response is ``cancelled``
    (OpenAI's status), never ``completed``, and whole or streamed it has the same output, one
    empty message, incomplete (behind a tool parser too, which reads no text as no content).
    The whole one is checked strictly against the openai package's type (raw JSON)."""
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    body = {"model": MODEL, "input": "Hi", "tools": [tool], "max_output_tokens": 5}
    waiting = f'weir_num_requests_waiting{{model_name="{MODEL}"}}'
    parsers = ChatParsers(tool_call="hermes")
    with GatewayProcess([server.client_address], parsers=parsers) as gateway:
        http = gateway.info["http_address"]
        client = openai.OpenAI(base_url=http + "/v1", api_key="-")
        assert httpx.post(http + "/pause", params={"mode": "keep"}).status_code == 200
        try:
            with ThreadPoolExecutor(2) as pool:
                whole = pool.submit(httpx.post, http + "/v1/responses", json=body, timeout=60)
                streamed = pool.submit(lambda: list(client.responses.create(stream=True, **body)))
                while read_metrics(server.info["metrics_address"]).get(waiting) != 2:
                    time.sleep(0.01)
                assert httpx.post(http + "/pause", params={"mode": "abort"}).status_code == 200
                response = Response.model_validate(whole.result().json(), strict=True)
                last = streamed.result()[-1]
        finally:
            httpx.post(http + "/resume")
    assert response.status == last.response.status == "cancelled"
    assert last.type == "response.incomplete"  # OpenAI's events have no cancellation
    for output in (response.output, last.response.output):
        [item] = output
        assert (item.type, item.status, [c.text for c in item.content]) == (
            "message",
            "incomplete",
            [""],
        )


def test_what_clients_send_back_or_leave_unset_is_taken(client):
    """The SDK's own items sent back whole (their newer fields null), agents' unset reasoning
    options and cache retention: accepted, as they change nothing."""
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    items = [{"role": "user", "content": "Hi"}]
    items += [item.model_dump(by_alias=True) for item in first.output]
    items.append({"role": "user", "content": "More"})
    reply = client.responses.create(
        model=MODEL,
        input=items,
        max_output_tokens=2,
        reasoning={"effort": None, "summary": None},
        extra_body={"prompt_cache_retention": "in_memory"},
    )
    assert reply.status == "incomplete"


def test_a_thought_that_nothing_followed_keeps_its_turn():
    from weir.services.gateway.responses import ResponsesRequest

    body = ResponsesRequest.model_validate(
        {
            "input": [
                {"role": "user", "content": "a"},
                {
                    "type": "reasoning",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "R"}],
                },
                {"role": "user", "content": "b"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "S"}]},
            ]
        }
    )
    assert body.messages() == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "", "reasoning_content": "R"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "", "reasoning_content": "S"},
    ]


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "'xhigh' or 'max'"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary", "Input should be None"),
        ({"include": ["message.output_text.logprobs"]}, "include", "only []"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": [{"type": "image", "url": "x"}]}, "input.0", "function_call"),
        ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice", "needs tools"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"top_k": 5}, "top_k", "unsupported field"),
        # What the engine refuses, in the request's own fields (it named the chat's).
        ({"max_output_tokens": 10**6}, "max_output_tokens", "max_output_tokens is too large"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no"}}}},
            "text.format",
            "text.format: cannot compile it",
        ),
    ],
)
def test_what_a_response_cannot_do_is_a_400_that_names_it(server, fields, param, words):
    reply = httpx.post(
        server.info["http_address"] + "/v1/responses",
        json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, **fields},
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_lone_surrogate_is_echoed_as_json_can_and_refused_where_the_model_reads_it(server):
    """JSON may escape a lone surrogate, which UTF-8 cannot encode: a response echoing the
    request's text format carries it back escaped (it failed with a 500 after generating,
    stored), and so does the stored response read back; in a tool, which the chat template
    renders, it is a 400 naming the field."""
    http = server.info["http_address"]
    headers = {"content-type": "application/json"}
    # json.dumps escapes it, as a client's JSON may.
    fields = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
    body = json.dumps({**fields, "text": {"format": {"type": "json_object", "name": "\ud800"}}})
    reply = httpx.post(http + "/v1/responses", content=body, headers=headers)
    assert reply.status_code == 200, reply.text
    response = reply.json()
    assert response["text"]["format"]["name"] == "\ud800"
    again = httpx.get(f"{http}/v1/responses/{response['id']}")
    assert again.status_code == 200 and again.json()["text"] == response["text"]
    tools = [{"type": "function", "name": "f", "description": "\ud800"}]
    body = json.dumps({**fields, "tool_choice": "none", "tools": tools})
    reply = httpx.post(http + "/v1/responses", content=body, headers=headers)
    assert reply.status_code == 400, reply.text
    assert "tools: text holds '\\ud800', a lone surrogate" in reply.json()["error"]["message"]


def test_a_stored_response_is_continued_read_back_and_deleted(
    server, client, tokenizer, tiny_hf_model
):
    """store (OpenAI's default): previous_response_id continues a conversation as if its
    input and output were sent again (its instructions not carried over, as OpenAI's),
    whole or streamed; retrieve reads a response back and delete drops it; store: false
    keeps nothing."""
    kwargs = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    first = client.responses.create(input="Hi", instructions="Be brief.", **kwargs)
    second = client.responses.create(input="More", previous_response_id=first.id, **kwargs)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "More"},
    ]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert second.usage.input_tokens == len(ids)
    want = tokenizer.decode(hf_greedy(tiny_hf_model, ids, 4), skip_special_tokens=True)
    assert second.output_text == want and second.previous_response_id == first.id
    streamed = {key: value for key, value in kwargs.items() if key != "model"}
    events = _events(client, input="Again", previous_response_id=second.id, **streamed)
    third = events[-1].response
    ids = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": want}, {"role": "user", "content": "Again"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert third.usage.input_tokens == len(ids)
    # It begins with the second's prompt, whose blocks the prefix cache holds.
    assert 0 < third.usage.input_tokens_details.cached_tokens < len(ids)
    assert client.responses.retrieve(third.id).output_text == third.output_text
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id 'resp_"):
        client.responses.create(input="Hi", previous_response_id=first.id, **kwargs)
    unstored = client.responses.create(input="Hi", store=False, **kwargs)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    # The gateway's metrics name these routes (they were "other", with unknown paths).
    samples = read_metrics(server.info["http_address"] + "/metrics")
    assert samples['weir_gateway_requests_total{route="/v1/responses",status="200"}'] >= 4
    stored = 'weir_gateway_requests_total{route="/v1/responses/{response_id}",status="404"}'
    assert samples[stored] >= 2


def test_the_store_keeps_each_conversation_once_within_its_bounds():
    """Each response holds the items it added; a conversation is walked back through the
    responses it continued, and ends where one of them was dropped (deleted, or the oldest
    past the count or the bytes the store keeps)."""

    def body(response_id: str, text: str) -> dict:
        return {
            "id": response_id,
            "output": [{"type": "message", "role": "assistant", "content": text}],
        }

    def ask(text: str) -> list[dict]:
        return [{"type": "message", "role": "user", "content": text}]

    store = ResponseStore(capacity=3, max_bytes=10_000)
    store.put(body("r1", "a1"), ask("q1"), None)
    store.put(body("r2", "a2"), ask("q2"), "r1")
    conversation = store.conversation("r2")
    assert [item["content"] for item in conversation] == ["q1", "a1", "q2", "a2"]
    store.put(body("r3", "a3"), ask("q3"), "r2")
    store.put(body("x", "y" * 20), ask("z"), None)  # the fourth: the oldest, r1, goes
    assert store.get("r1") is None and store.conversation("r3") is None
    assert store.conversation("r2") is None and store.get("r2") is not None
    # Past the bytes: the least recently read go (r2 was just read: r3 and x).
    store.put(body("big", "y" * 4_700), ask("z"), None)
    assert (store.get("r3"), store.get("x")) == (None, None)
    assert store.get("r2") is not None and store.get("big") is not None
    assert store.delete("big") and not store.delete("big") and store.get("big") is None
