"""`--tool-call-parser mistral` and `--reasoning-parser mistral` through the official `openai`
client, in front of a real `weir serve` of a tiny random Llama with SmolLM2's tokenizer and
Mistral's `[TOOL_CALLS]`, `[ARGS]`, `[THINK]` and `[/THINK]` special tokens: the v11 form
(`NAME[ARGS]{...}` per tag) and the older JSON array are calls, whole and streamed, with the
9-character ids Mistral's templates take back; what does not read so is content as the model
wrote it; Magistral's `[THINK]...[/THINK]` is the reasoning. Outputs are forced by a choice
constraint; the reader is also checked fed in pieces of every size."""

import re

import openai
import pytest
from conftest import save_with_markers
from serving_helpers import read_chat, small_server
from test_tool_calls import read_in_pieces as read_pieces

from weir.services.gateway.chat_output import ChatParsers
from weir.services.gateway.marked_calls import MistralReader

transformers = pytest.importorskip("transformers")

MODEL = "tiny-mistral-tools"
MARKERS = ["[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    for name in ("get_weather", "get_time")
]
ASK = [{"role": "user", "content": "Weather and time in Oslo?"}]
V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}'
ARRAY = 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
BROKEN = "Maybe [TOOL_CALLS]get_weather[ARGS]{city: Oslo}"
CALL = ("get_weather", '{"city": "Oslo"}')


@pytest.fixture(scope="module")
def client(tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp("models") / MODEL
    bias = save_with_markers(path, default_model_dir, MARKERS)
    parsers = ChatParsers(tool_call="mistral", reasoning="mistral")
    with small_server(path, MODEL, parsers) as processes:
        client = openai.OpenAI(base_url=processes.info["http_address"] + "/v1", api_key="unused")
        client.bias = bias  # type: ignore[attr-defined]
        yield client


def _chat(client, stream: bool, text: str, **kwargs):
    body = {"structured_outputs": {"choice": [text]}, "logit_bias": client.bias}
    kwargs = {"model": MODEL, "messages": ASK, "max_tokens": 300, "extra_body": body, **kwargs}
    return read_chat(client, stream, **kwargs)[1:]


@pytest.mark.parametrize("stream", [False, True])
def test_mistral_calls_are_read_in_both_forms(client, stream):
    assert _chat(client, stream, V11, tools=TOOLS) == (
        None,
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
        "tool_calls",
    )
    assert _chat(client, stream, ARRAY, tools=TOOLS) == (
        "Checking.",
        [("get_weather", '{"city": "Oslo"}')],
        "tool_calls",
    )
    assert _chat(client, stream, BROKEN, tools=TOOLS) == (BROKEN, [], "stop")
    # Without tools the text is the model's, its markers kept (Magistral's [THINK] must be).
    assert _chat(client, stream, V11) == (V11, [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_magistral_reasoning_comes_before_its_answer_or_its_calls(client, stream):
    def chat(text: str, **kwargs):
        body = {"structured_outputs": {"choice": [text]}, "logit_bias": client.bias}
        return read_chat(
            client, stream, model=MODEL, messages=ASK, max_tokens=300, extra_body=body, **kwargs
        )

    assert chat("[THINK]Oslo, so weather.[/THINK]It is sunny.") == (
        "Oslo, so weather.",
        "It is sunny.",
        [],
        "stop",
    )
    assert chat("[THINK]Need data.[/THINK]" + V11, tools=TOOLS) == (
        "Need data.",
        None,
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
        "tool_calls",
    )
    assert chat("No thought.") == (None, "No thought.", [], "stop")


def test_call_ids_are_the_nine_characters_mistral_templates_take(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        max_tokens=300,
        extra_body={"structured_outputs": {"choice": [V11]}, "logit_bias": client.bias},
    )
    ids = [call.id for call in reply.choices[0].message.tool_calls]
    assert len(ids) == 2 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_a_mistral_output_streamed_in_any_pieces_reads_as_it_does_whole(step):
    def read_in_pieces(text: str, step: int):
        return read_pieces(MistralReader(), text, step)

    assert read_in_pieces(V11, step) == (
        "",
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
    )
    assert read_in_pieces(ARRAY, step) == ("Checking.", [("get_weather", '{"city": "Oslo"}')])
    assert read_in_pieces(BROKEN, step) == (BROKEN, [])
    assert read_in_pieces("[TOOL_CALL", step) == ("[TOOL_CALL", [])
    assert read_in_pieces("No calls.", step) == ("No calls.", [])
    assert read_in_pieces('[TOOL_CALLS][{"name": "f"}]', step) == ("", [("f", "{}")])
    assert read_in_pieces('[TOOL_CALLS][{"name": ""}]', step) == ('[{"name": ""}]', [])
    assert read_in_pieces("[TOOL_CALLS]f[ARGS][1]", step) == ("[TOOL_CALLS]f[ARGS][1]", [])
    # A later call cut short (max_tokens): the calls before it, then the rest as content.
    cut = V11[: V11.rindex("[ARGS]") + len("[ARGS]")]
    assert read_in_pieces(cut, step) == ("[TOOL_CALLS]get_time[ARGS]", [CALL])
    assert read_in_pieces(V11[: V11.rindex("get_time")], step) == ("", [CALL])


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_a_pre_v11_array_is_read_as_vllm_reads_it(step):
    """vLLM's test_extract_tool_calls_pre_v11_tokenizer[trailing_data_after_json] and
    _regex_fallback(_fails): text after the array, or junk around it, does not lose the
    calls (nor is it content); text after the tag that holds no calls is content without
    the tag."""
    array = ARRAY.removeprefix("Checking.[TOOL_CALLS]")
    trailing = f"[TOOL_CALLS] {array}\nextra trailing data"
    assert read_pieces(MistralReader(), trailing, step) == ("", [CALL])
    junk = f"Hi[TOOL_CALLS]  junk {array} trail"
    assert read_pieces(MistralReader(), junk, step) == ("Hi", [CALL])
    assert read_pieces(MistralReader(), "[TOOL_CALLS] not json at all", step) == (
        "not json at all",
        [],
    )
    cut = f"[TOOL_CALLS] {array[:-5]}"  # max_tokens
    assert read_pieces(MistralReader(), cut, step) == (array[:-5], [])
