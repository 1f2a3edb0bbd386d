"""gpt-oss' harmony format over the chat API, through the official `openai` client, in front
of a real `weir serve` of a tiny random gpt-oss (SmolLM2's tokenizer with harmony's special
tokens added, a harmony chat template) started with `--reasoning-parser openai_gptoss
--tool-call-parser openai`, as vLLM serves gpt-oss.

The outputs are forced by a choice constraint, so markers split across ordinary tokens; the
reader is also checked against itself fed in pieces of every size, and the server against
transformers' detokenization of the special tokens it was asked to keep.
"""

import shutil

import openai
import pytest
import torch
from serving_helpers import read_chat, small_server
from spread_weights import spread_weights_

from weir.services.gateway.chat_output import ChatParsers
from weir.services.gateway.harmony import HarmonyReader
from weir.services.gateway.schemas import ChatCompletionRequest

transformers = pytest.importorskip("transformers")

MODEL = "tiny-gpt-oss"
PARSERS = ChatParsers(tool_call="openai", reasoning="openai_gptoss")
HARMONY_TOKENS = [
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
]
# The harmony format, abridged: each message <|start|>ROLE<|channel|>...<|message|>...<|end|>.
TEMPLATE = """\
{%- if reasoning_effort is defined -%}
<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == "assistant" -%}
<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>
{%- else -%}
<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
THOUGHT = "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
ANSWER = "<|start|>assistant<|channel|>final<|message|>It is 4."
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo"}<|call|>'
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp("models") / MODEL
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"]),
    )
    model = transformers.GptOssForCausalLM(config).eval()
    spread_weights_(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    shutil.copy(default_model_dir / "generation_config.json", path)
    return path


@pytest.fixture(scope="module")
def client(model_dir):
    with small_server(model_dir, MODEL, PARSERS) as processes:
        yield openai.OpenAI(base_url=processes.info["http_address"] + "/v1", api_key="unused")


def _forced(text: str) -> dict:
    """A body field that makes the model write ``text`` (a choice of one)."""
    return {"structured_outputs": {"choice": [text]}}


def _chat(client, stream: bool, **kwargs):
    """A chat of ``MODEL`` (greedy) read by `read_chat`."""
    kwargs = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 300, **kwargs}
    return read_chat(client, stream, **kwargs)


@pytest.mark.parametrize("stream", [False, True])
def test_the_analysis_is_reasoning_and_the_final_message_content(client, stream):
    got = _chat(client, stream, extra_body=_forced(THOUGHT + ANSWER))
    assert got == ("User asks 2+2. Easy.", "It is 4.", [], "stop")
    hidden = _chat(
        client, stream, extra_body={**_forced(THOUGHT + ANSWER), "include_reasoning": False}
    )
    assert hidden == (None, "It is 4.", [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_a_message_to_a_function_is_a_tool_call(client, stream):
    got = _chat(client, stream, tools=TOOLS, extra_body=_forced(THOUGHT + CALL))
    assert got == (
        "User asks 2+2. Easy.",
        None,
        [("get_weather", '{"city": "Oslo"}')],
        "tool_calls",
    )
    # A stop string inside the call cuts it short: content, as max_tokens would.
    cut = _chat(client, stream, tools=TOOLS, stop=["Oslo"], extra_body=_forced(THOUGHT + CALL))
    assert cut == ("User asks 2+2. Easy.", '{"city": "', [], "stop")
    # Without tools (or with tool_choice none) it is the model's text, as it wrote it.
    reasoning, content, calls, _ = _chat(client, stream, extra_body=_forced(THOUGHT + CALL))
    assert (reasoning, content, calls) == ("User asks 2+2. Easy.", '{"city": "Oslo"}', [])


def test_a_preamble_is_content_and_an_unfinished_call_too(client):
    preamble = "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    got = _chat(client, False, tools=TOOLS, extra_body=_forced(THOUGHT + preamble + CALL))
    assert got == (
        "User asks 2+2. Easy.",
        "Checking.",
        [("get_weather", '{"city": "Oslo"}')],
        "tool_calls",
    )
    cut = _chat(client, False, tools=TOOLS, max_tokens=40, extra_body=_forced(THOUGHT + CALL))
    assert cut[2] == [] and cut[3] == "length"


def test_the_special_tokens_the_model_writes_are_read(client, model_dir):
    """Unconstrained, with the harmony markers made likely by a bias: the server keeps the
    special tokens in the text it reads (skip_special_tokens false, as vLLM reads gpt-oss by
    its token ids); read otherwise, the markers vanish and the headers' words become content.
    The reference text is transformers' detokenization of the same token ids."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.convert_tokens_to_ids(["<|channel|>", "<|message|>", "<|end|>", "<|start|>"])
    bias = {str(i): 8.0 for i in ids}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        temperature=0,
        max_tokens=40,
        logit_bias=bias,
        extra_body={"return_token_ids": True},
    )
    [choice] = reply.choices
    token_ids = choice.model_dump()["token_ids"]
    assert set(ids) & set(token_ids), "the bias must make the model write markers"
    text = tokenizer.decode(token_ids, skip_special_tokens=False)
    reader = HarmonyReader(read_calls=False)
    reasoning, content, _ = reader.feed(text)
    more_reasoning, rest, _ = reader.finish(choice.finish_reason)
    message = choice.message.model_dump()
    assert message["content"] == ((content + rest) or None)
    assert message["reasoning"] == ((reasoning + more_reasoning) or None)


def test_a_named_call_holds_to_its_json_from_the_first_token(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=30
    )
    # The random model spends its tokens on the JSON's whitespace: an object begun.
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments.startswith("{") and reply.choices[0].message.content is None


def test_reasoning_effort_reaches_the_template(client, model_dir):
    """OpenAI's reasoning_effort (the Responses API's reasoning.effort) is the template
    variable gpt-oss' template reads: the prompt is transformers' rendering with it."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    plain, high = (
        tokenizer.apply_chat_template(ASK, add_generation_prompt=True, **effort)["input_ids"]
        for effort in ({}, {"reasoning_effort": "high"})
    )
    assert len(high) > len(plain)

    def prompt_tokens(**kwargs) -> int:
        reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, **kwargs)
        return reply.usage.prompt_tokens

    assert prompt_tokens() == len(plain)
    assert prompt_tokens(reasoning_effort="high") == len(high)
    reply = client.responses.create(
        model=MODEL, input=ASK[0]["content"], max_output_tokens=1, reasoning={"effort": "high"}
    )
    assert reply.usage.input_tokens == len(high)
    assert reply.reasoning.effort == "high"  # echoed, as OpenAI's response does


HEAD = "<|channel|>analysis<|message|>think<|end|>"
CASES = [
    # (tools read, text, reasoning, content, calls, finish reason)
    (False, HEAD + "<|start|>assistant<|channel|>final<|message|>ok", "think", "ok", [], "stop"),
    (False, "plain answer", "", "plain answer", [], "stop"),
    (False, "<|chan", "", "<|chan", [], "length"),
    (False, HEAD, "think", "", [], "stop"),
    (False, "<|channel|>analysis<|message|>cut <|en", "cut <|en", "", [], "length"),
    (False, "<|channel|>anal", "", "", [], "length"),  # an unfinished header is markup
    (
        True,
        HEAD + "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>",
        "think",
        "",
        [("f", "{}")],
        "stop",
    ),
    # Stopped on <|call|> (out of the text): a call; cut short: content.
    (
        True,
        HEAD + "<|channel|>commentary to=functions.f<|message|>{}",
        "think",
        "",
        [("f", "{}")],
        "stop",
    ),
    (
        True,
        HEAD + '<|channel|>commentary to=functions.f<|message|>{"a"',
        "think",
        '{"a"',
        [],
        "length",
    ),
    # Not a function's: content, as without tools.
    (
        True,
        HEAD + "<|channel|>commentary to=browser.search<|message|>q<|call|>",
        "think",
        "q",
        [],
        "stop",
    ),
    (False, HEAD + "<|channel|>commentary to=functions.f<|message|>{}", "think", "{}", [], "stop"),
    (
        True,
        "<|channel|>commentary to=functions.f<|message|>{}<|call|><|start|>assistant"
        '<|channel|>commentary to=functions.g<|message|>{"x": 1}<|call|>',
        "",
        "",
        [("f", "{}"), ("g", '{"x": 1}')],
        "stop",
    ),
    (False, "<|channel|>final<|message|>a<|return|>", "", "a", [], "stop"),
    # The recipient before the channel in the first header (its <|start|>assistant the
    # prompt's), a header of no channel, a header begun without the last message's end.
    (
        True,
        ' to=functions.f<|channel|>commentary json<|message|>{"a": 1}',
        "",
        "",
        [("f", '{"a": 1}')],
        "stop",
    ),
    (False, "<|message|>hi<|end|>", "", "hi", [], "stop"),
    (False, "<|channel|>final<|message|>x<|channel|>analysis<|message|>y", "y", "x", [], "stop"),
    (
        False,
        "<|channel|>final<|message|>x<|start|>assistant<|channel|>analysis<|message|>y",
        "y",
        "x",
        [],
        "stop",
    ),
    (
        True,
        HEAD
        + "<|channel|>commentary to=functions.f<|message|>{}<|start|>assistant<|channel|>final<|message|>z",
        "think",
        "z",
        [("f", "{}")],
        "length",
    ),
]


@pytest.mark.parametrize("read_calls, text, reasoning, content, calls, finish_reason", CASES)
def test_the_reader_reads_alike_in_any_pieces(
    read_calls, text, reasoning, content, calls, finish_reason
):
    for size in (1, 2, 3, 5, 1000):
        reader = HarmonyReader(read_calls)
        got = [reader.feed(text[i : i + size]) for i in range(0, len(text), size)]
        got.append(reader.finish(finish_reason))
        assert "".join(r for r, _, _ in got) == reasoning
        assert "".join(c for _, c, _ in got) == content
        deltas = [d for _, _, ds in got for d in ds]
        assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == calls
        assert [d["index"] for d in deltas] == list(range(len(calls)))
        assert reader.reasoned == ("<|channel|>analysis<|message|>" in text)


def test_a_call_a_stop_string_cut_short_is_content():
    """Only a stop token (<|call|>, stop_reason None or its id) ends a call; a stop string
    (its text the stop_reason) cuts it as max_tokens does."""
    text = HEAD + '<|channel|>commentary to=functions.f<|message|>{"city": "'
    for stop_reason, calls in ((None, 1), (200012, 1), ("Oslo", 0)):
        reader = HarmonyReader(read_calls=True)
        reader.feed(text)
        _, content, deltas = reader.finish("stop", stop_reason)
        assert len(deltas) == len(reader.calls) == calls
        assert content == ("" if calls else '{"city": "')


@pytest.mark.parametrize(
    "fields, harmony",
    [
        ({}, True),
        ({"tools": TOOLS}, True),
        ({"tools": TOOLS, "tool_choice": "required"}, False),
        ({"response_format": {"type": "json_object"}}, True),
    ],
)
def test_which_requests_are_read_as_harmony(fields, harmony):
    body = ChatCompletionRequest.model_validate({"messages": ASK, **fields})
    output = body.chat_output(PARSERS)
    assert output.harmony is harmony and not output.plain
    assert (
        ChatCompletionRequest.model_validate({"messages": ASK}).chat_output(ChatParsers()).harmony
        is False
    )
