"""Tool calling over the chat API, through the official `openai` client, in front of real
`weir serve` processes: the tiny random Llama given Qwen2.5's chat template (which renders
tools, the calls an assistant made and the tools' answers) behind `--tool-call-parser
hermes`, and the default model for the calls it writes held to a tool's schema (a random
model writes JSON whitespace until max_tokens).

The references are independent of the gateway: transformers renders the same chat (its
own template engine, the calls' arguments as maps) and, held to the same JSON schema by
xgrammar's own logits processor, writes the arguments the API must return.
"""

import functools
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import msgpack
import openai
import pytest
import torch
import zmq
from serving_helpers import hf_constrained, read_chat, small_server

from weir.services.gateway.chat_output import NO_PARSERS, ChatOutput, ChatParsers
from weir.services.gateway.json_calls import (
    JsonCallReader,
    Llama3JsonReader,
    NamedCallReader,
    json_call,
)
from weir.services.gateway.list_calls import GraniteReader, PythonicReader
from weir.services.gateway.marked_calls import (
    DeepSeekReader,
    MistralReader,
    Phi4MiniReader,
    XlamReader,
)
from weir.services.gateway.tagged_calls import (
    HermesReader,
    glm_call,
    hunyuan_calls,
    minimax_calls,
    xml_call,
)
from weir.services.gateway.tool_calls import ToolChoice
from weir.services.launcher import GatewayProcess, ServerProcesses
from weir.shared.client import InvalidRequestError, WeirClient
from weir.shared.config import EngineArgs
from weir.shared.protocol import client as client_protocol
from weir.shared.sampling import SamplingParams
from weir.shared.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
xgr = pytest.importorskip("xgrammar")

MODEL = "tiny-tools"

# Qwen2.5-Instruct's chat template, as its tokenizer_config.json ships it.
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You "
    "are a helpful assistant.' }}{%- endif %}{{- \"\\n\\n# Tools\\n\\nYou may call one or more "
    "functions to assist with the user query.\\n\\nYou are provided with function signatures "
    'within <tools></tools> XML tags:\\n<tools>" }}{%- for tool in tools %}{{- "\\n" }}'
    '{{- tool | tojson }}{%- endfor %}{{- "\\n</tools>\\n\\nFor each function call, return a '
    "json object with function name and arguments within <tool_call></tool_call> XML tags:"
    '\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n\" }}{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    "(message.role == \"assistant\" and not message.tool_calls) %}{{- '<|im_start|>' + "
    "message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- elif message.role "
    "== \"assistant\" %}{{- '<|im_start|>' + message.role }}{%- if message.content %}"
    "{{- '\\n' + message.content }}{%- endif %}{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
    '{%- endif %}{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}'
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- elif message.role == \"tool\" %}{%- if "
    '(loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}'
    "{{- '<|im_start|>user' }}{%- endif %}{{- '\\n<tool_response>\\n' }}"
    "{{- message.content }}{{- '\\n</tool_response>' }}{%- if loop.last or "
    "(messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The forecast for a city.",
            "parameters": WEATHER,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
ASK = [{"role": "user", "content": "What is the weather in Oslo for 3 days?"}]
# A conversation after a call: the assistant's call (arguments as JSON text, as OpenAI sends
# them) and the tool's answer.
FOLLOW_UP = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 3}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Snow, -4 C."},
]


@pytest.fixture(scope="module")
def tools_model_dir(tmp_path_factory, tiny_model_dir):
    path = tmp_path_factory.mktemp("models") / "tiny-qwen-template"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN25_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(tools_model_dir):
    return transformers.AutoTokenizer.from_pretrained(tools_model_dir)


@pytest.fixture(scope="module")
def server(tools_model_dir):
    parsers = ChatParsers(tool_call="hermes")
    with small_server(tools_model_dir, MODEL, parsers, max_num_seqs=16) as processes:
        yield processes


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.info["http_address"] + "/v1", api_key="unused")


# The parsers of the gateways that tests put in front of ``server``'s engine.
GATEWAY_PARSERS = (
    NO_PARSERS,
    ChatParsers(tool_call="llama3_json"),
    ChatParsers(tool_call="pythonic"),
    ChatParsers(tool_call="qwen3_coder"),
    ChatParsers(tool_call="glm45"),
    ChatParsers(tool_call="minimax_m2", reasoning="minimax_m2"),
    ChatParsers(tool_call="granite", reasoning="granite"),
    ChatParsers(tool_call="phi4_mini_json"),
    ChatParsers(tool_call="xlam"),
    ChatParsers(tool_call="minimax_m2", reasoning="minimax_m2_append_think"),
    ChatParsers(tool_call="olmo3", reasoning="olmo3"),
    ChatParsers(tool_call="deepseek_v31", reasoning="deepseek_v3"),
    ChatParsers(tool_call="glm47", reasoning="glm47"),
    ChatParsers(tool_call="qwen3_xml", reasoning="holo2"),
    ChatParsers(tool_call="seed_oss", reasoning="seed_oss"),
    ChatParsers(tool_call="hunyuan_a13b", reasoning="hunyuan_a13b"),
    ChatParsers(tool_call="ernie45", reasoning="ernie45"),
    ChatParsers(tool_call="functiongemma"),
    ChatParsers(tool_call="gemma4", reasoning="gemma4"),
)


@pytest.fixture(scope="module")
def gateway(server):
    """An openai client of a `weir gateway` with the given parsers in front of ``server``'s
    engine: one gateway per parsers, shared by the tests (a whole and a streamed case), all
    started at once on first use (each start is seconds of imports)."""
    gateways = {p: GatewayProcess([server.client_address], parsers=p) for p in GATEWAY_PARSERS}
    with ThreadPoolExecutor(len(gateways)) as pool:
        started = {parsers: pool.submit(g.start) for parsers, g in gateways.items()}

    def client_of(parsers: ChatParsers) -> openai.OpenAI:
        info = started[parsers].result()  # a start's failure fails the tests of its gateway
        return openai.OpenAI(base_url=info["http_address"] + "/v1", api_key="-")

    try:
        yield client_of
    finally:
        for g in gateways.values():
            g.shutdown()


def _hf_ids(hf_tokenizer, messages, tools=None) -> list[int]:
    return hf_tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )


@pytest.fixture(scope="module")
def smollm2(default_model_dir):
    """The default model served with its gateway, and transformers' copy of it."""
    engine = EngineArgs(model=None, kv_cache_memory="32MiB", max_num_batched_tokens=256)
    with ServerProcesses(
        engine, port=0, metrics_port=0, executor_metrics_port=0, http_port=0
    ) as processes:
        client = openai.OpenAI(base_url=processes.info["http_address"] + "/v1", api_key="-")
        tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            default_model_dir, dtype=torch.float32
        ).eval()
        yield client, tokenizer, model


def _hf_format(smollm2, schema, max_tokens: int) -> str:
    """What transformers writes for ASK held to ``schema`` by xgrammar's own processor."""
    _, tokenizer, model = smollm2
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=49152, stop_token_ids=[tokenizer.eos_token_id]
    )
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema))
    # SmolLM2's template renders no tools.
    ids = hf_constrained(
        model, _hf_ids(tokenizer, ASK), max_tokens, grammar, tokenizer.eos_token_id
    )
    assert ids[-1] == tokenizer.eos_token_id, "the reference must complete its JSON"
    return tokenizer.decode(ids[:-1])


@pytest.fixture(scope="module")
def weather_arguments(smollm2) -> str:
    """What transformers writes for ASK held to the schema of get_weather's parameters."""
    return _hf_format(smollm2, WEATHER, 80)


def _call(client, messages=ASK, **kwargs):
    kwargs = {"max_tokens": 80, "temperature": 0, "tools": TOOLS, **kwargs}
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=messages, **kwargs
    )


def _streamed(client, messages=ASK, **kwargs):
    """A streamed chat's content, its tool calls assembled from their deltas, and its last
    finish reason."""
    content, calls, finish = "", {}, None
    for chunk in _call(client, messages, stream=True, **kwargs):
        [choice] = chunk.choices
        delta = choice.delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _answer(client, stream: bool, **kwargs):
    """A chat's content, its calls as (name, arguments), finish reason and call ids, read
    whole or from its stream."""
    if stream:
        content, calls, finish = _streamed(client, **kwargs)
        ids = [call["id"] for call in calls]
    else:
        [reply] = _call(client, **kwargs).choices
        content, finish = reply.message.content, reply.finish_reason
        calls = [c.function.model_dump() for c in reply.message.tool_calls]
        ids = [c.id for c in reply.message.tool_calls]
    return content, [(c["name"], c["arguments"]) for c in calls], finish, ids


def _hf_messages(messages):
    """OpenAI's messages as transformers' templates take them: arguments as maps."""
    messages = json.loads(json.dumps(messages))
    for message in messages:
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return messages


def test_the_template_renders_tools_calls_and_answers_as_transformers_does(
    tools_model_dir, hf_tokenizer
):
    ours = Tokenizer.from_model_dir(tools_model_dir)
    for role in ("system", "developer"):
        messages = [{"role": role, "content": "Be brief."}, *FOLLOW_UP]
        want = hf_tokenizer.apply_chat_template(
            _hf_messages([{**messages[0], "role": "system"}, *FOLLOW_UP]),
            tools=TOOLS,
            add_generation_prompt=True,
            tokenize=False,
        )
        assert ours.apply_chat_template(messages, tools=TOOLS) == want
    assert '"arguments": {"city": "Oslo", "days": 3}}' in want


def test_the_server_renders_tools_calls_and_answers_as_transformers_does(
    server, client, hf_tokenizer
):
    """prompt_tokens counts what the engine rendered: the same chat rendered by
    transformers (its calls' arguments as maps) is as many tokens."""
    for messages, tools in ((ASK, TOOLS), (FOLLOW_UP, TOOLS), (ASK, None)):
        want = _hf_ids(hf_tokenizer, _hf_messages(messages), tools)
        reply = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=1,
            tool_choice="none",
            **({"tools": tools} if tools else {}),
        )
        assert reply.usage.prompt_tokens == len(want)
        body = {"messages": messages, **({"tools": tools} if tools else {})}
        tokenized = httpx.post(server.info["http_address"] + "/tokenize", json=body, timeout=30)
        assert tokenized.json()["tokens"] == want
    # The rendering differs with and without tools: the count above is a check.
    assert len(_hf_ids(hf_tokenizer, ASK, TOOLS)) > len(_hf_ids(hf_tokenizer, ASK)) + 50


# The tools as Anthropic's Messages API takes them.
ANTHROPIC_TOOLS = [
    {
        "name": tool["function"]["name"],
        "input_schema": tool["function"]["parameters"],
        **(
            {"description": tool["function"]["description"]}
            if "description" in tool["function"]
            else {}
        ),
    }
    for tool in TOOLS
]


def test_anthropics_tool_use_and_result_render_as_the_chat_they_are(server, hf_tokenizer):
    """A Messages conversation after a call (the assistant's tool_use, the user's
    tool_result) counts the tokens of the same chat in OpenAI's form, as transformers
    renders it with the tools."""
    client = anthropic.Anthropic(base_url=server.info["http_address"], api_key="-")
    call = FOLLOW_UP[1]["tool_calls"][0]
    turns = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": call["function"]["name"],
                    "input": json.loads(call["function"]["arguments"]),
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call["id"], "content": "Snow, -4 C."}
            ],
        },
    ]
    want = _hf_ids(hf_tokenizer, _hf_messages(FOLLOW_UP), TOOLS)
    counted = client.messages.count_tokens(model=MODEL, messages=turns, tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == len(want)
    reply = client.messages.create(
        model=MODEL,
        max_tokens=1,
        messages=turns,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "none"},
    )
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(want)


@pytest.mark.slow
def test_anthropics_tool_use_holds_what_transformers_writes(smollm2, weather_arguments):
    """Anthropic's tool_use block, whole and streamed (its input_json deltas, accumulated by
    the SDK's stream helper), holds the arguments transformers writes under the tool's
    schema; a forced tool's use is stop_reason "tool_use", as Anthropic's."""
    base_url = str(smollm2[0].base_url).removesuffix("/v1/")
    client = anthropic.Anthropic(base_url=base_url, api_key="-")
    kwargs = {
        "model": smollm2[0].models.list().data[0].id,
        "max_tokens": 80,
        "messages": ASK,
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "extra_body": {"temperature": 0},
    }
    whole = client.messages.create(**kwargs)
    [block] = whole.content
    assert (block.type, block.name, block.input) == (
        "tool_use",
        "get_weather",
        json.loads(weather_arguments),
    )
    assert whole.stop_reason == "tool_use"
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    [streamed] = final.content
    assert (streamed.name, streamed.input) == (block.name, block.input)  # ids: each its own
    assert final.stop_reason == "tool_use"
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) == weather_arguments


@pytest.mark.slow
def test_a_named_function_returns_its_arguments_as_transformers_writes_them(
    smollm2, weather_arguments
):
    client, want = smollm2[0], weather_arguments
    choice = {"type": "function", "function": {"name": "get_weather"}}
    [reply] = _call(client, tool_choice=choice).choices
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == want
    assert call.type == "function" and call.id.startswith("call_")
    assert reply.message.content is None and reply.finish_reason == "stop"
    assert set(json.loads(want)) == {"city", "days"}
    content, [streamed], finish = _streamed(client, tool_choice=choice)
    assert content == "" and finish == "stop"
    assert streamed["name"] == "get_weather" and streamed["arguments"] == want


@pytest.mark.slow
def test_the_responses_api_calls_a_function_as_transformers_writes_it(smollm2, weather_arguments):
    """The Responses API's function_call item, whole and streamed (its arguments' deltas,
    and the SDK's stream helper), holds what transformers writes under the same schema; a
    call and its output sent back as items render as the chat with the call and the tool's
    answer does."""
    client, want = smollm2[0], weather_arguments
    model = client.models.list().data[0].id
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    kwargs = {
        "model": model,
        "input": ASK[0]["content"],
        "tools": tools,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "temperature": 0,
        "max_output_tokens": 80,
    }
    [call] = client.responses.create(**kwargs).output
    assert (call.type, call.name, call.arguments, call.status) == (
        "function_call",
        "get_weather",
        want,
        "completed",
    )
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        [streamed] = stream.get_final_response().output
    assert streamed.arguments == want
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == want
    followed = FOLLOW_UP[1]["tool_calls"][0]
    items = [
        *ASK,
        {
            "type": "function_call",
            "call_id": followed["id"],
            "name": followed["function"]["name"],
            "arguments": followed["function"]["arguments"],
        },
        {"type": "function_call_output", "call_id": followed["id"], "output": "Snow, -4 C."},
    ]
    answer = client.responses.create(
        model=model, input=items, tools=tools, max_output_tokens=1, tool_choice="none"
    )
    chat = _call(client, FOLLOW_UP, max_tokens=1, tool_choice="none")
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.slow
def test_required_returns_the_calls_the_model_writes_in_its_array(smollm2):
    """One call (parallel_tool_calls false): an array of one {name, parameters} object of
    either tool, written here without the gateway's code."""
    schema = {
        "type": "array",
        "minItems": 1,
        "maxItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": parameters,
                    },
                    "required": ["name", "parameters"],
                }
                for name, parameters in (("get_weather", WEATHER), ("get_time", {"type": "object"}))
            ]
        },
    }
    client = smollm2[0]
    [want] = json.loads(_hf_format(smollm2, schema, 120))
    kwargs = {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 120}
    [reply] = _call(client, **kwargs).choices
    [call] = reply.message.tool_calls
    assert call.function.name == want["name"]
    assert json.loads(call.function.arguments) == want["parameters"]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    content, [streamed], finish = _streamed(client, **kwargs)
    assert (content, finish) == ("", "tool_calls")
    assert (streamed["name"], streamed["arguments"]) == (
        call.function.name,
        call.function.arguments,
    )


HERMES_OUTPUT = (
    "Checking both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_hermes_calls_out_of_the_text(client, stream):
    """The model is held to a text with two calls (a choice of one string), so the parser
    meets them split across tokens wherever the tokenizer splits them."""
    kwargs = {"extra_body": {"guided_choice": [HERMES_OUTPUT]}, "max_tokens": 120}
    content, calls, finish, ids = _answer(client, stream, **kwargs)
    assert (content, finish) == ("Checking both.\n", "tool_calls")
    assert calls == [("get_weather", '{"city": "Oslo", "days": 3}'), ("get_time", "{}")]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_auto_without_a_call_is_content_and_tool_choice_none_lists_no_calls(client):
    plain = {"extra_body": {"guided_choice": ["It is <b>snowing</b>."]}}
    for kwargs in (plain, {**plain, "tool_choice": "none"}):
        [reply] = _call(client, **kwargs).choices
        assert reply.message.content == "It is <b>snowing</b>."
        assert reply.message.tool_calls == [] and reply.finish_reason == "stop"
    assert _streamed(client, **plain) == ("It is <b>snowing</b>.", [], "stop")


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": "auto"}, "tool_choice", "'auto' needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "names 'nope', which is not among the tools",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "function 'get_weather' is given twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools.0.function.name",
            "String should match pattern",
        ),
        (
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            None,
            "not response_format and tool_choice",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
            "messages.0.tool_calls.0.function.arguments",
            "Field required",
        ),
        (
            {"messages": [{**ASK[0], "tool_calls": []}]},
            "messages.0.tool_calls",
            "only an assistant message makes tool calls",
        ),
        (
            {"messages": [{**ASK[0], "tool_call_id": "c"}]},
            "messages.0.tool_call_id",
            "only a tool message answers a tool call",
        ),
        ({"tools": TOOLS, "tool_choice": 5}, "tool_choice", '"required" or a named function'),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"}},
            "tool_choice.name",
            "unsupported field",
        ),
        # A tool's schema the engine cannot hold an output to is the tools' fault.
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}
                ],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tool_choice",
            "tool_choice: the schema of the tools' parameters: cannot compile it",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": f"f{i}", "parameters": {"description": "x" * 300}},
                    }
                    for i in range(250)
                ],
                "tool_choice": "required",
            },
            "tool_choice",
            "the tools' parameters: 117694 characters, more than this server compiles",
        ),
    ],
)
def test_bad_tool_requests_are_400_naming_the_problem(server, body, param, fragment):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, **body}
    reply = httpx.post(server.info["http_address"] + "/v1/chat/completions", json=body, timeout=30)
    error = reply.json()["error"]
    assert reply.status_code == 400 and fragment in error["message"], error
    assert error["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_a_last_call_whose_end_tag_never_came_is_a_call(client, stream):
    """Clients stop on the end tag: the stop string is not in the text, the call is."""
    kwargs = {
        "extra_body": {"guided_choice": [HERMES_OUTPUT]},
        "max_tokens": 120,
        "stop": ["</tool_call>"],
    }
    content, calls, finish, _ = _answer(client, stream, **kwargs)
    assert (content, finish) == ("Checking both.\n", "tool_calls")
    assert calls == [("get_weather", '{"city": "Oslo", "days": 3}')]


def test_a_function_without_a_schema_still_takes_an_object(client):
    """OpenAI's rule: arguments are an object, whatever ``parameters`` leaves open."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    choice = {"type": "function", "function": {"name": "f"}}
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=tools, tool_choice=choice, max_tokens=1, temperature=0
    )
    assert reply.choices[0].message.tool_calls[0].function.arguments.startswith("{")


def test_tools_the_engine_cannot_read_are_refused_by_the_sdk_and_the_scheduler(server):
    with WeirClient(server.client_address) as sdk:
        with pytest.raises(InvalidRequestError, match="tools must be a list of maps"):
            list(sdk.generate(ASK, tools={"a": 1}))
        for tools in ("[" * 5000 + "]" * 5000, "[1, 2]", "{}"):
            ctx = zmq.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(server.client_address)
            request = client_protocol.GenerateRequest("raw", ASK, SamplingParams(max_tokens=1))
            frame = msgpack.unpackb(client_protocol.encode_client_message(request))
            sock.send(msgpack.packb({**frame, "tools": tools}))
            assert sock.poll(30_000)
            reply = client_protocol.decode_server_message(sock.recv())
            sock.close()
            ctx.term()
            assert isinstance(reply, client_protocol.ErrorReply)
            assert reply.code == client_protocol.INVALID_REQUEST and "tools" in reply.message
        assert sdk.tokenize(ASK, tools=TOOLS)  # still serving


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_llama3_json_calls_out_of_the_text(gateway, stream):
    """A gateway with --tool-call-parser llama3_json in front of the same engine: an output
    that is calls (one after another, ';' between) is calls, any other is content."""
    calls_text = (
        '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}; '
        '{"name": "get_time", "parameters": {}}'
    )
    llama = gateway(ChatParsers(tool_call="llama3_json"))
    got = []
    for text in (calls_text, "Snow {all week}."):
        kwargs = {"extra_body": {"guided_choice": [text]}, "max_tokens": 120}
        got.append(_answer(llama, stream, **kwargs)[:3])
    assert got == [
        (
            "" if stream else None,
            [("get_weather", '{"city": "Oslo", "days": 3}'), ("get_time", "{}")],
            "tool_calls",
        ),
        ("Snow {all week}.", [], "stop"),
    ]


def test_auto_reads_pythonic_calls_out_of_the_text(gateway):
    """--tool-call-parser pythonic (Llama 3.2's and 4's format): an output that is a Python
    list of calls is calls; any other, or a list that is not of calls, is content (whole and
    streamed alike: the reader is the same, fed in any pieces below)."""
    calls_text = '[get_weather(city="Oslo", days=3), get_time()]'
    llama = gateway(ChatParsers(tool_call="pythonic"))
    got = []
    for text in (calls_text, "Snow [all week].", "[get_weather(city=Oslo)]"):
        kwargs = {"extra_body": {"guided_choice": [text]}, "max_tokens": 120}
        got.append(_answer(llama, False, **kwargs)[:3])
    assert got == [
        (
            None,
            [("get_weather", '{"city": "Oslo", "days": 3}'), ("get_time", "{}")],
            "tool_calls",
        ),
        ("Snow [all week].", [], "stop"),
        ("[get_weather(city=Oslo)]", [], "stop"),  # Oslo is a name, not a literal
    ]


def test_auto_reads_qwen3_coder_calls_out_of_the_text(gateway):
    """--tool-call-parser qwen3_coder: <tool_call> blocks of <function=NAME> and its
    <parameter=KEY> values, each read by its type in the tool's schema (days an integer,
    the string "3" where the schema says string: Oslo's twin tool)."""
    block = (
        "<tool_call>\n<function={name}>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    text = "Checking.\n" + block.format(name="get_weather") + "\n" + block.format(name="echo")
    echo = {
        "type": "function",
        "function": {
            "name": "echo",
            "parameters": {"type": "object", "properties": {"days": {"type": "string"}}},
        },
    }
    qwen = gateway(ChatParsers(tool_call="qwen3_coder"))
    kwargs = {"extra_body": {"guided_choice": [text]}, "max_tokens": None}
    got = _answer(qwen, True, tools=[*TOOLS, echo], **kwargs)[:3]
    assert got == (
        "Checking.\n",  # streamed: hermes' reader, whose whole reading its tests check
        [
            ("get_weather", '{"city": "Oslo", "days": 3}'),
            ("echo", '{"city": "Oslo", "days": "3"}'),
        ],
        "tool_calls",
    )


def test_qwen3_coder_values_are_read_by_their_schema_types():
    properties = {
        "f": {
            "s": {"type": "string"},
            "i": {"type": "integer"},
            "n": {"type": "number"},
            "b": {"type": "boolean"},
            "o": {"type": "object"},
            "a": {"type": "array"},
        }
    }
    values = {"s": "\n 007 \n", "i": "42", "n": "2.5", "b": "false", "o": '{"k": [1]}',
              "a": "[1, 2]", "u": "[3]", "w": "two words", "z": "null"}  # fmt: skip
    block = (
        "<function=f>"
        + "".join(f"<parameter={k}>\n{v}\n</parameter>" for k, v in values.items())
        + "</function>"
    )
    call = xml_call(properties, block)
    assert json.loads(call.arguments) == {
        "s": "\n 007 \n", "i": 42, "n": 2.5, "b": False, "o": {"k": [1]}, "a": [1, 2],
        "u": "[3]", "w": "two words", "z": None,  # u: no type, the text as written
    }  # fmt: skip
    assert json_call('{"name": "f", "arguments": {"a": Infinity}}') is None  # hermes' too
    huge = xml_call(properties, "<function=f><parameter=n>1e400</parameter></function>")
    assert json.loads(huge.arguments) == {"n": "1e400"}  # past a JSON number's range
    assert (
        xml_call(properties, '<function=f><parameter=o>{"k": 1e400}</parameter></function>') is None
    )
    assert xml_call(properties, "<function=f>stray<parameter=s>x</parameter></function>") is None
    assert xml_call(properties, '{"name": "f"}') is None
    bad = xml_call(properties, "<function=f><parameter=i>\nmany\n</parameter></function>")
    assert json.loads(bad.arguments) == {"i": "many"}  # not an integer: the text as written
    # A client's schema that is no schema (properties not an object, a property a string)
    # leaves its values untyped rather than failing the response.
    for odd in ({"f": "x"}, {"f": {"i": "integer"}}, {"f": {"i": {"anyOf": "integer"}}}):
        call = xml_call(odd, "<function=f><parameter=i>\n4\n</parameter></function>")
        assert json.loads(call.arguments) == {"i": "4"}


def test_qwen3_coder_and_minimax_m2_values_are_read_by_nullable_and_union_types():
    """Pydantic writes an Optional[T] field as anyOf T and null, or as a list of types: a
    value is read as the first of the types, null aside, that it is text of (vLLM's
    test_extract_tool_calls_anyof_type_conversion; "float" as some clients write it)."""
    properties = {
        "f": {
            "i": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 5},
            "s": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "a": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
            "o": {"oneOf": [{"type": "object"}, {"type": "null"}]},
            "l": {"type": ["integer", "null"]},
            "m": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
            "n": {"anyOf": [{"type": "integer"}, {"type": "object"}]},
            "x": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "b": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
            "f": {"type": "float"},
            "z": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        }
    }
    values = {"i": "5", "s": "hello", "a": '["a", "b"]', "o": '{"k": "v", "c": 42}',
              "l": "42", "m": "42", "n": '{"k": 1}', "x": "many", "b": "true", "f": "3.14",
              "z": "null"}  # fmt: skip
    expected = {"i": 5, "s": "hello", "a": ["a", "b"], "o": {"k": "v", "c": 42}, "l": 42,
                "m": "42", "n": {"k": 1}, "x": "many", "b": True, "f": 3.14, "z": None}  # fmt: skip
    qwen = "".join(f"<parameter={k}>{v}</parameter>" for k, v in values.items())
    call = xml_call(properties, f"<function=f>{qwen}</function>")
    assert json.loads(call.arguments) == expected
    minimax = "".join(f'<parameter name="{k}">{v}</parameter>' for k, v in values.items())
    [call] = minimax_calls(properties, f'<invoke name="f">{minimax}</invoke>')
    assert json.loads(call.arguments) == expected


# vLLM's cases of qwen3_xml and qwen3_coder (tests/tool_parsers/test_qwen3_xml_coder_shared.py):
# (value written, its schema, the argument read).
QWEN3_VALUES = [
    ("null", {"type": "string"}, "null"),  # a string stays one
    ("None", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, None),  # Qwen3.5's null
    ("None", {"anyOf": [{"type": "string"}, {"type": "null"}]}, None),
    ("null", {"anyOf": [{"type": "string"}, {"type": "null"}]}, None),
    ("None", {}, "None"),
    ("{'key': 'value'}", {"type": "object"}, {"key": "value"}),  # a Python literal
    ("\"{'key': 'value', 'n': 1}\"", {"type": "object"}, {"key": "value", "n": 1}),
    ('["a", "b", 1, true]', {"type": "array"}, ["a", "b", 1, True]),
]


@pytest.mark.parametrize("step", [1, 1000])
@pytest.mark.parametrize("value, schema, read", QWEN3_VALUES)
def test_qwen3_xml_values_read_as_vllm_reads_them(value, schema, read, step):
    choice = ToolChoice("auto", parser="qwen3_xml", properties={"f": {"v": schema}})
    text = f"<tool_call>\n<function=f>\n<parameter=v>\n{value}\n</parameter>\n</function>\n</tool_call>"
    assert read_in_pieces(choice.reader(), text, step) == ("", [("f", json.dumps({"v": read}))])


def _write_file(path: str, content: str) -> str:
    return (
        "<tool_call>\n<function=write_file>\n"
        f"<parameter=path>\n{path}\n</parameter>\n"
        f"<parameter=content>\n{content}</parameter>\n</function>\n</tool_call>"
    )


_WRITE_FILE = {"write_file": {"path": {"type": "string"}, "content": {"type": "string"}}}
_FOO = "<tool_call>\n<function=foo>\n<parameter=bar>baz</parameter>\n</function>\n</tool_call>"
# vLLM's cases of a value that holds the format's own tags as text, as a coding agent writes
# a parser's test (tests/tool_parsers/test_qwen3_xml_coder_shared.py, test_content_with_*
# and test_two_tools_second_with_out_of_schema_nested_literal): write_file's content.
QWEN3_TAGS_IN_VALUES = {
    "xml tags in content": (
        '[\n    "<tool_call>\\n",\n    "<parameter=query>\\n",\n'
        '    "\\n</parameter>\\n",\n    "</function>\\n",\n]\n'
    ),
    "param-like lines": (
        '"""\n</parameter>\n<parameter=new_string>\n#!/usr/bin/env python3\n</parameter>\n"""\n'
    ),
    "real param name literal": 'doc = """\n<parameter=path>\nliteral/value\n</parameter>\n"""\n',
    "full nested call": 'doc = """\n' + _write_file("literal/value.txt", "hello\n") + '\n"""\n',
    "out of schema nested": f'template = """\n{_FOO}\n"""\n',  # after a call of foo
}


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("parser", ["qwen3_coder", "seed_oss"])
@pytest.mark.parametrize("case", QWEN3_TAGS_IN_VALUES)
def test_qwen3_xml_values_holding_its_tags_read_as_vllm_reads_them(case, parser, step):
    """A value ends at a </parameter> that a parameter of the tool's schema or the
    function's end follows and that closes no <parameter=KEY> opening a line in it; a block
    at the first end tag that closes no start tag opening a line in it, as it arrives."""
    content = QWEN3_TAGS_IN_VALUES[case]
    text = _write_file("fixture.py", content)
    calls = [("write_file", {"path": "fixture.py", "content": content.removesuffix("\n")})]
    if case == "out of schema nested":
        text, calls = _FOO + "\n\n" + text, [("foo", {"bar": "baz"}), *calls]
    if parser == "seed_oss":  # the same blocks in Seed-OSS' tags, those in values too
        text = text.replace("tool_call>", "seed:tool_call>")
        calls = [
            (n, {k: v.replace("tool_call>", "seed:tool_call>") for k, v in a.items()})
            for n, a in calls
        ]
    choice = ToolChoice("auto", parser=parser, properties=_WRITE_FILE)
    got, read = read_in_pieces(choice.reader(), text, step)
    assert (got, [(name, json.loads(arguments)) for name, arguments in read]) == ("", calls)
    reader = choice.reader()
    assert len(reader.feed(text[:-1])[1]) == len(calls) - 1
    assert len(reader.feed(text[-1])[1]) == 1  # the last read as its end tag arrives


_PHANTOM = "<tool_call>\n<function={{ tc.name }}>\n<parameter={{ k }}>\n{{ v }}\n</parameter>\n"
_PHANTOM += "</function>\n</tool_call>\n\n"
_NESTED = QWEN3_TAGS_IN_VALUES["full nested call"]
# Around those: (the output, its tools' schemas, the content and call read). A block that
# holds no call (vLLM's unrendered Jinja, an inline <tool_call>example</tool_call>) is
# content up to its first end tag; a schema that lists no properties filters no key (vLLM's
# reading: new_string a parameter); a key outside the schema is still one; a block cut at
# its end tag (a stop string) is still read whole, and one whose <tool_call> opening a line
# in a value is never closed ends at its first end tag when the output ends.
QWEN3_AROUND_TAGS_IN_VALUES = [
    (_PHANTOM + _write_file("a", "b\n"), _WRITE_FILE, _PHANTOM, {"path": "a", "content": "b"}),
    ("Show: <tool_call>example</tool_call>. Now:\n" + _write_file("a", "b\n"), _WRITE_FILE,
     "Show: <tool_call>example</tool_call>. Now:\n", {"path": "a", "content": "b"}),
    (_write_file("t.py", QWEN3_TAGS_IN_VALUES["param-like lines"]), {"write_file": {}}, "",
     {"path": "t.py", "content": '"""', "new_string": '#!/usr/bin/env python3\n</parameter>\n"""'}),
    (_write_file("a", "b\n").replace("content>", "mode>"), _WRITE_FILE, "",
     {"path": "a", "mode": "b"}),
    (_write_file("a", _NESTED).removesuffix("</tool_call>"), _WRITE_FILE, "",
     {"path": "a", "content": _NESTED.removesuffix("\n")}),
    (_write_file("a", "see:\n<tool_call>\n") + "\nDone.", _WRITE_FILE, "\nDone.",
     {"path": "a", "content": "see:\n<tool_call>"}),
]  # fmt: skip


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
@pytest.mark.parametrize("text, properties, content, arguments", QWEN3_AROUND_TAGS_IN_VALUES)
def test_qwen3_xml_blocks_around_tags_in_values(text, properties, content, arguments, step):
    choice = ToolChoice("auto", parser="qwen3_coder", properties=properties)
    got, [(name, read)] = read_in_pieces(choice.reader(), text, step)
    assert (got, name, json.loads(read)) == (content, "write_file", arguments)


@pytest.mark.parametrize("step", [1, 1000])
def test_qwen3_xml_parameter_without_its_end_tag_ends_at_the_next(step):
    """vLLM's test_extract_tool_calls_missing_closing_parameter_tag."""
    text = (
        "Let me check:\n<tool_call>\n<function=f>\n<parameter=city>\nDallas\n"
        "<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nF\n</function>\n</tool_call>"
    )
    choice = ToolChoice("auto", parser="qwen3_xml")
    assert read_in_pieces(choice.reader(), text, step) == (
        "Let me check:\n",
        [("f", '{"city": "Dallas", "state": "TX", "unit": "F"}')],
    )


def test_auto_reads_glm45_calls_out_of_the_text(gateway):
    """--tool-call-parser glm45: GLM-4.5's <tool_call> blocks (newlines between its tags)
    and GLM-4.7's (none), each value read as JSON or a Python literal, as written where the
    tool's schema says string (Oslo's twin tool)."""
    glm45 = "<tool_call>{name}\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
    glm45 += "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    glm47 = "<tool_call>{name}<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
    glm47 += "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    text = "Checking.\n" + glm45.format(name="get_weather") + glm47.format(name="echo")
    echo = {
        "type": "function",
        "function": {
            "name": "echo",
            "parameters": {"type": "object", "properties": {"days": {"type": "string"}}},
        },
    }
    glm = gateway(ChatParsers(tool_call="glm45"))
    kwargs = {"extra_body": {"guided_choice": [text]}, "max_tokens": None}
    got = _answer(glm, False, tools=[*TOOLS, echo], **kwargs)[:3]
    assert got == (
        "Checking.\n",
        [
            ("get_weather", '{"city": "Oslo", "days": 3}'),
            ("echo", '{"city": "Oslo", "days": "3"}'),
        ],
        "tool_calls",
    )


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_minimax_m2_reasoning_and_calls_out_of_the_text(gateway, stream):
    """--tool-call-parser minimax_m2 --reasoning-parser minimax_m2: MiniMax-M2's reasoning,
    then a <minimax:tool_call> block of two invokes (values by their schema types: the
    string "3" for Oslo's twin tool), as its chat template writes them."""
    invoke = (
        '<invoke name="{name}">\n<parameter name="city">Oslo</parameter>\n'
        '<parameter name="days">3</parameter>\n</invoke>\n'
    )
    text = (
        "<think>\nThe weather, then an echo.\n</think>\n\nChecking.\n<minimax:tool_call>\n"
        + invoke.format(name="get_weather")
        + invoke.format(name="echo")
        + "</minimax:tool_call>"
    )
    echo = {
        "type": "function",
        "function": {
            "name": "echo",
            "parameters": {"type": "object", "properties": {"days": {"type": "string"}}},
        },
    }
    minimax = gateway(ChatParsers(tool_call="minimax_m2", reasoning="minimax_m2"))
    got = read_chat(
        minimax,
        stream,
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[*TOOLS, echo],
        extra_body={"guided_choice": [text]},
        max_tokens=None,
    )
    assert got == (
        "\nThe weather, then an echo.\n",
        "\n\nChecking.\n",
        [
            ("get_weather", '{"city": "Oslo", "days": 3}'),
            ("echo", '{"city": "Oslo", "days": "3"}'),
        ],
        "tool_calls",
    )


# Two calls as a JSON array of {"name", "arguments"} objects, as Granite 3, Phi-4-mini and
# xLAM write them.
CALLS_ARRAY = (
    '[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}, '
    '{"name": "get_time", "arguments": {}}]'
)
TWO_CALLS = [("get_weather", '{"city": "Oslo", "days": 3}'), ("get_time", "{}")]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_granite_reasoning_and_calls_out_of_the_text(gateway, stream):
    """--tool-call-parser granite --reasoning-parser granite: Granite 3.2's thought and
    response markers (its chat template asks "Write your thoughts after 'Here is my thought
    process:' and write your response after 'Here is my response:'" when thinking is on),
    the response ``<|tool_call|>`` and a JSON array of calls (Granite 3.1's template writes
    an assistant's calls so; llama.cpp's granite format and vLLM's test_granite_tool_parser
    read it); an output without the markers is all answer, and calls that max_tokens cut
    short are content."""
    thought = "Here is my thought process:\nOslo, 3 days.\n\nHere is my response:\n"
    granite = gateway(ChatParsers(tool_call="granite", reasoning="granite"))
    got = [
        read_chat(
            granite,
            stream,
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            extra_body={"guided_choice": [text], "chat_template_kwargs": {"thinking": True}},
            max_tokens=max_tokens,
        )
        for text, max_tokens in (
            (thought + "<|tool_call|>" + CALLS_ARRAY, None),
            ("Snow all week.", None),
            ("<|tool_call|>" + CALLS_ARRAY, 12),
        )
    ]
    assert got[:2] == [
        ("\nOslo, 3 days.\n\n", None, TWO_CALLS, "tool_calls"),
        (None, "Snow all week.", [], "stop"),
    ]
    reasoning, content, calls, finish = got[2]
    assert (reasoning, calls, finish) == (None, [], "length")
    assert content and ("<|tool_call|>" + CALLS_ARRAY).startswith(content)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_phi4_mini_json_calls_out_of_the_text(gateway, stream):
    """--tool-call-parser phi4_mini_json: ``functools[...]``, the array of calls vLLM's
    tool_chat_template_phi4_mini.jinja asks Phi-4-mini for ("prefix function calls with
    functools marker"); the text before it is content."""
    phi4 = gateway(ChatParsers(tool_call="phi4_mini_json"))
    kwargs = {"extra_body": {"guided_choice": ["Checking. functools" + CALLS_ARRAY]}}
    got = _answer(phi4, stream, max_tokens=None, **kwargs)[:3]
    assert got == ("Checking. ", TWO_CALLS, "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_xlam_calls_out_of_the_text(gateway, stream):
    """--tool-call-parser xlam: xLAM-2's output, the JSON array of calls alone (as its chat
    template writes an assistant's calls, and vLLM's test_xlam_tool_parser has them), or
    in a json code fence after text (the text the content)."""
    xlam = gateway(ChatParsers(tool_call="xlam"))
    got = [
        _answer(xlam, stream, max_tokens=None, extra_body={"guided_choice": [text]})[:3]
        for text in (CALLS_ARRAY, "Checking.\n```json\n" + CALLS_ARRAY + "\n```")
    ]
    assert got == [
        ("" if stream else None, TWO_CALLS, "tool_calls"),
        ("Checking.\n", TWO_CALLS, "tool_calls"),
    ]


ECHO = {
    "type": "function",
    "function": {
        "name": "echo",
        "parameters": {"type": "object", "properties": {"days": {"type": "string"}}},
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_olmo3_reasoning_and_calls_out_of_the_text(gateway, stream):
    """--tool-call-parser olmo3 --reasoning-parser olmo3: OLMo 3 Think's reasoning, its
    answer, then ``<function_calls>`` and one Python call a line, JSON's literals too
    (vLLM's olmo3 parser and its tests, tests/tool_parsers/test_olmo3_tool_parser.py; the
    chat template, allenai/open-instruct's "olmo_thinker" in
    open_instruct/dataset_transformation.py, writes ``'<function_calls>' + calls +
    '</function_calls>'`` after the content). Its template opens the thought in the prompt
    (``<|im_start|>assistant\\n<think>``), but an output forced from its first token does not
    think unless it opens with ``<think>``, so it is written here."""
    text = (
        "<think>Oslo's weather, then the time.</think>Checking.\n<function_calls>"
        "get_weather(city='Oslo', days=3)\necho(city=\"Oslo\", days='3', loud=true, to=null)"
        "</function_calls>"
    )
    olmo = gateway(ChatParsers(tool_call="olmo3", reasoning="olmo3"))

    def chat(text: str, max_tokens: int | None) -> tuple:
        extra = {"guided_choice": [text]}
        return read_chat(
            olmo,
            stream,
            model=MODEL,
            messages=ASK,
            tools=[*TOOLS, ECHO],
            extra_body=extra,
            max_tokens=max_tokens,
        )

    assert chat(text, None) == (
        "Oslo's weather, then the time.",
        "Checking.\n",
        [
            ("get_weather", '{"city": "Oslo", "days": 3}'),
            ("echo", '{"city": "Oslo", "days": "3", "loud": true, "to": null}'),
        ],
        "tool_calls",
    )
    # Cut short by max_tokens, the block is content, as written.
    block = "<function_calls>get_weather(city='Oslo')"
    _, content, calls, finish = chat(block, 6)
    assert content and block.startswith(content) and content != block
    assert (calls, finish) == ([], "length")


@pytest.mark.parametrize("stream", [False, True])
def test_deepseek_v3_and_holo2_think_as_their_templates_are_asked(gateway, stream):
    """--reasoning-parser deepseek_v3: DeepSeek-V3.1's template opens the thought (its
    generation prompt ends ``<think>``) only given ``thinking: true`` (else it ends
    ``</think>``: the model answers), so vLLM's parser reads reasoning only then; holo2
    (Holo2, of Qwen3) thinks unless ``thinking`` or ``enable_thinking`` is given and neither
    is true (vLLM's deepseek_v3_reasoning_parser.py). The random model never ends a thought:
    a thinking request's output is all reasoning, cut short."""
    deepseek = gateway(ChatParsers(tool_call="deepseek_v31", reasoning="deepseek_v3"))
    holo2 = gateway(ChatParsers(tool_call="qwen3_xml", reasoning="holo2"))
    for client, kwargs, thinks in (
        (deepseek, None, False),
        (deepseek, {"thinking": True}, True),
        (holo2, None, True),
        (holo2, {"enable_thinking": False}, False),
    ):
        extra = {"chat_template_kwargs": kwargs}
        reasoning, content, _, finish = read_chat(
            client, stream, model=MODEL, messages=ASK, max_tokens=8, extra_body=extra
        )
        got = (reasoning is not None, content is not None, finish)
        assert got == (thinks, not thinks, "length"), (client.base_url, kwargs)


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_xml_and_glm47_read_as_qwen3_coder_and_glm45(gateway, stream):
    """vLLM's other names: qwen3_xml reads Qwen3-Coder's blocks, glm47 GLM-4.7's (here after
    their thoughts: holo2's and glm47's reasoning parsers in front)."""
    qwen = (
        "<tool_call>\n<function=echo>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    glm = "<tool_call>echo<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
    glm += "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    for parsers, calls in (
        (ChatParsers(tool_call="qwen3_xml", reasoning="holo2"), qwen),
        (ChatParsers(tool_call="glm47", reasoning="glm47"), glm),
    ):
        got = read_chat(
            gateway(parsers),
            stream,
            model=MODEL,
            messages=ASK,
            tools=[*TOOLS, ECHO],
            extra_body={"guided_choice": [f"<think>Echo.</think>Checking.\n{calls}"]},
            max_tokens=None,
        )
        want = ("Echo.", "Checking.\n", [("echo", '{"city": "Oslo", "days": "3"}')], "tool_calls")
        assert got == want, parsers


@pytest.mark.parametrize("stream", [False, True])
def test_minimax_m2_append_think_keeps_the_thought_in_the_content(gateway, stream):
    """--reasoning-parser minimax_m2_append_think (vLLM's): MiniMax-M2's template opens the
    thought in the prompt, so its output is the thought, ``</think>``, then the answer and
    its calls; the content is all of it, ``<think>`` put first, the calls read out of it."""
    invoke = '<invoke name="get_time">\n</invoke>\n'
    text = f"The time.\n</think>\n\nChecking.\n<minimax:tool_call>\n{invoke}</minimax:tool_call>"
    minimax = gateway(ChatParsers(tool_call="minimax_m2", reasoning="minimax_m2_append_think"))
    got = read_chat(
        minimax,
        stream,
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        extra_body={"guided_choice": [text]},
        max_tokens=None,
    )
    content = "<think>The time.\n</think>\n\nChecking.\n"
    assert got == (None, content, [("get_time", "{}")], "tool_calls")


def test_minimax_m2_blocks_hold_invokes_only():
    invoke = '<invoke name="f"><parameter name="i">4</parameter></invoke>'
    calls = minimax_calls({"f": {"i": {"type": "integer"}}}, f"\n{invoke}\n{invoke}\n")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"i": 4})] * 2
    assert minimax_calls({}, "") is None
    assert minimax_calls({}, f"{invoke} stray") is None
    assert (
        minimax_calls({}, '<invoke name="f">stray<parameter name="i">4</parameter></invoke>')
        is None
    )
    text = f"Go.<minimax:tool_call>{invoke}{invoke}</minimax:tool_call><minimax:tool_call>{invoke}"
    tags = ("<minimax:tool_call>", "</minimax:tool_call>")
    for step in (1, 7, len(text)):  # the last block's end tag never came: still a call
        reader = HermesReader(functools.partial(minimax_calls, {}), tags)
        assert read_in_pieces(reader, text, step) == ("Go.", [("f", '{"i": "4"}')] * 3)


ECHO = {
    "type": "function",
    "function": {
        "name": "echo",
        "parameters": {"type": "object", "properties": {"days": {"type": "string"}}},
    },
}


def _read(client, stream: bool, text: str, tools=(*TOOLS, ECHO), max_tokens=None, **kwargs):
    """`read_chat` of a chat whose output is ``text`` (less what ``max_tokens`` cuts), with
    the tools (Oslo's twin too)."""
    body = {"guided_choice": [text], **kwargs.pop("extra_body", {})}
    return read_chat(
        client,
        stream,
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=list(tools),
        extra_body=body,
        max_tokens=max_tokens,
        **kwargs,
    )


# Seed-OSS-36B-Instruct's chat template (chat_template.jinja) writes an assistant's turn as
# "\n<seed:think>REASONING</seed:think>", "\nCONTENT\n", then per call "\n<seed:tool_call>\n
# <function=NAME>\n", "<parameter=KEY>VALUE</parameter>\n" per argument and "</function>\n
# </seed:tool_call>"; its README shows the budget reflections inside the thought.
SEED_OSS_OUTPUT = (
    "<seed:think>The weather, then the time.\n<seed:cot_budget_reflect>I have used 9 tokens."
    "</seed:cot_budget_reflect>\n</seed:think>\nChecking.\n\n<seed:tool_call>\n"
    "<function=get_weather>\n<parameter=city>Oslo</parameter>\n<parameter=days>3</parameter>\n"
    "</function>\n</seed:tool_call>\n<seed:tool_call>\n<function=get_time>\n</function>\n"
    "</seed:tool_call>"
)
OSLO_TWICE = [
    ("get_weather", '{"city": "Oslo", "days": 3}'),
    ("echo", '{"city": "Oslo", "days": "3"}'),
]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_seed_oss_reasoning_and_calls_out_of_the_text(gateway, stream):
    """--tool-call-parser seed_oss --reasoning-parser seed_oss: Seed-OSS' thought (its budget
    reflections in it), then <seed:tool_call> blocks read as qwen3_coder's (days by its
    schema type, an integer)."""
    seed = gateway(ChatParsers(tool_call="seed_oss", reasoning="seed_oss"))
    assert _read(seed, stream, SEED_OSS_OUTPUT, tools=TOOLS) == (
        "The weather, then the time.\n<seed:cot_budget_reflect>I have used 9 tokens."
        "</seed:cot_budget_reflect>\n",
        "\nChecking.\n\n",
        [("get_weather", '{"city": "Oslo", "days": 3}'), ("get_time", "{}")],
        "tool_calls",
    )


# Hunyuan-A13B's README ("think_pattern"): "<think>\n{think}\n</think>\n<answer>\n{answer}
# \n</answer>", a fast thought (/no_think) "<think>\n\n</think>\n<answer>\n..."; its calls a
# <tool_calls> JSON array inside the answer (vLLM's test_hunyuan_a13b_tool_parser_streaming).
HUNYUAN_OUTPUT = (
    "<think>\nThe weather, then an echo.\n</think>\n<answer>\n<tool_calls>["
    '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}, '
    '{"name": "echo", "arguments": {"city": "Oslo", "days": "3"}}]</tool_calls>\n</answer>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_hunyuan_a13b_reasoning_and_calls_out_of_the_text(gateway, stream):
    """--tool-call-parser hunyuan_a13b --reasoning-parser hunyuan_a13b: the thought less the
    newlines of its tags' lines, the answer out of its <answer> tags, the calls out of the
    answer; a fast thought is none, and a request that does not think answers in the tags."""
    hunyuan = gateway(ChatParsers(tool_call="hunyuan_a13b", reasoning="hunyuan_a13b"))
    assert _read(hunyuan, stream, HUNYUAN_OUTPUT) == (
        "The weather, then an echo.",
        None,
        OSLO_TWICE,
        "tool_calls",
    )
    fast = "<think>\n\n</think>\n<answer>\nSnow, -4 C.\n</answer>"
    assert _read(hunyuan, stream, fast) == (None, "Snow, -4 C.", [], "stop")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    answer = "<answer>\nSnow.\n</answer>"
    assert _read(hunyuan, stream, answer, extra_body=off) == (None, "Snow.", [], "stop")


# vLLM's ernie45 parsers (ERNIE-4.5-21B-A3B-Thinking, whose prompt opens the thought): "abc\n
# </think>\n\n<response>\ndef\n</response>\n" or, calling, "abc\n</think>\n\n\n<tool_call>\n
# {json}\n</tool_call>\n". Forced by a choice, a structured output, the output thinks only
# where it opens with <think> (the tiny model has no </think> token to hold the format after).
ERNIE_OUTPUT = (
    "<think>The weather, then an echo.\n</think>\n\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "echo", "arguments": {"city": "Oslo", "days": "3"}}\n</tool_call>\n'
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_ernie45_reasoning_and_calls_out_of_the_text(gateway, stream):
    """--tool-call-parser ernie45 --reasoning-parser ernie45: the thought up to </think>, then
    hermes' <tool_call> blocks (the newlines before them no content), or the answer out of
    its <response> tags, as vLLM's parsers read them."""
    ernie = gateway(ChatParsers(tool_call="ernie45", reasoning="ernie45"))
    assert _read(ernie, stream, ERNIE_OUTPUT) == (
        "The weather, then an echo.\n",
        None,
        OSLO_TWICE,
        "tool_calls",
    )
    answer = "<think>Snow.\n</think>\n\n<response>\nSnow, -4 C.\n</response>\n"
    assert _read(ernie, stream, answer) == ("Snow.\n", "\nSnow, -4 C.\n", [], "stop")


# FunctionGemma's chat template (google/functiongemma-270m-it) writes each call as
# "<start_function_call>call:" + NAME + "{", then KEY:VALUE per argument, "," between, and
# "}<end_function_call>"; its format_argument writes a string between <escape> tokens and a
# number or boolean bare (Google's "FunctionGemma formatting and best practices").
FUNCTIONGEMMA_OUTPUT = (
    "Checking.\n<start_function_call>call:get_weather{city:<escape>Oslo<escape>,days:3}"
    "<end_function_call><start_function_call>call:echo{city:<escape>Oslo<escape>,"
    "days:<escape>3<escape>}<end_function_call>"
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_functiongemma_calls_out_of_the_text(gateway, stream):
    """--tool-call-parser functiongemma: FunctionGemma's calls after the text before them;
    a call cut short by max_tokens is content, as written."""
    gemma = gateway(ChatParsers(tool_call="functiongemma"))
    assert _read(gemma, stream, FUNCTIONGEMMA_OUTPUT) == (
        None,
        "Checking.\n",
        OSLO_TWICE,
        "tool_calls",
    )
    block = "<start_function_call>call:get_weather{city:<escape>Oslo<escape>,days:3}"
    _, content, calls, finish = _read(gemma, stream, block, max_tokens=8)
    assert content and block.startswith(content) and content != block
    assert (calls, finish) == ([], "length")


# Gemma 4's output as vLLM's gemma4 parsers read it: a thought "<|channel>thought\n...
# <channel|>", then the answer, each call "<|tool_call>call:NAME{KEY:VALUE,...}<tool_call|>",
# one after another, a string between <|"|> tokens.
GEMMA4_OUTPUT = (
    "<|channel>thought\nThe weather, then an echo.<channel|>Checking.\n"
    '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:3}<tool_call|>'
    '<|tool_call>call:echo{city:<|"|>Oslo<|"|>,days:<|"|>3<|"|>}<tool_call|>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_gemma4_reasoning_and_calls_out_of_the_text(gateway, stream):
    """--tool-call-parser gemma4 --reasoning-parser gemma4: the thought less its label, the
    answer, then the calls; a call written in the thought ends it."""
    gemma = gateway(ChatParsers(tool_call="gemma4", reasoning="gemma4"))
    assert _read(gemma, stream, GEMMA4_OUTPUT) == (
        "The weather, then an echo.",
        "Checking.\n",
        OSLO_TWICE,
        "tool_calls",
    )
    early = GEMMA4_OUTPUT.replace("<channel|>Checking.\n", "")
    assert _read(gemma, stream, early) == (
        "The weather, then an echo.",
        None,
        OSLO_TWICE,
        "tool_calls",
    )


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_functiongemma_output_streamed_in_any_pieces_reads_as_it_does_whole(step):
    """vLLM's tests/tool_parsers/test_functiongemma_tool_parser.py, and the notation's other
    values (bare numbers, booleans and null, objects, arrays, strings holding its
    punctuation). Where Weir differs: text before a call is content as written (vLLM strips
    it), streamed before the call is known; a string between <escape> tokens stays a string
    (vLLM reads it as JSON: count 42) unless the tool's schema types the parameter
    otherwise; a block cut short is content as written (vLLM reads the arguments it holds);
    vLLM's streamed case writes no "," between its arguments, which the template always
    writes (here with it: without, the block is no call, content as written)."""
    schema = {"count": {"type": "integer"}, "enabled": {"type": "boolean"}}

    def read(text, properties=None):
        choice = ToolChoice("auto", parser="functiongemma", properties=properties or {})
        return read_in_pieces(choice.reader(), text, step)

    def call(name, body):
        return f"<start_function_call>call:{name}{{{body}}}<end_function_call>"

    london = call("get_weather", "location:<escape>London<escape>")
    assert read("Hello, how can I help you today?") == ("Hello, how can I help you today?", [])
    assert read(london) == ("", [("get_weather", '{"location": "London"}')])
    two = "location:<escape>San Francisco<escape>,unit:<escape>celsius<escape>"
    sf = ("get_weather", '{"location": "San Francisco", "unit": "celsius"}')
    assert read(call("get_weather", two)) == ("", [sf])
    paris = call("get_weather", "location:<escape>Paris<escape>")
    assert read("Let me check the weather for you. " + paris) == (
        "Let me check the weather for you. ",
        [("get_weather", '{"location": "Paris"}')],
    )
    utc = call("get_time", "timezone:<escape>UTC<escape>")
    assert read(london + utc) == (
        "",
        [("get_weather", '{"location": "London"}'), ("get_time", '{"timezone": "UTC"}')],
    )
    assert read(call("f", "")) == ("", [("f", "{}")])
    counted = call("get_weather", "count:<escape>42<escape>,enabled:<escape>true<escape>")
    assert read(counted, {"get_weather": schema}) == (
        "",
        [("get_weather", '{"count": 42, "enabled": true}')],
    )
    assert read(counted) == ("", [("get_weather", '{"count": "42", "enabled": "true"}')])
    hello = call("f", "message:<escape>Hello World<escape>")
    assert read(hello) == ("", [("f", '{"message": "Hello World"}')])
    nyc = call("get_weather", "city:<escape>NYC<escape>,unit:<escape>celsius<escape>")
    assert read(nyc) == ("", [("get_weather", '{"city": "NYC", "unit": "celsius"}')])
    search = "query:<escape>python<escape>,limit:10,sort:<escape>relevance<escape>"
    assert read(call("search", search)) == (
        "",
        [("search", '{"query": "python", "limit": 10, "sort": "relevance"}')],
    )
    typed = "a:1,ratio:0.5,on:false,to:null,note:<escape>x, {y}: [z]<escape>,o:{k:[1,{b:true}]}"
    assert read(call("f", typed)) == (
        "",
        [
            (
                "f",
                '{"a": 1, "ratio": 0.5, "on": false, "to": null, "note": "x, {y}: [z]", '
                '"o": {"k": [1, {"b": true}]}}',
            )
        ],
    )
    # A string written bare, not between <escape> tokens, is read as written (vLLM's: {}).
    bare = call("get_weather", "location:Paris,unit:celsius")
    assert read(bare) == ("", [("get_weather", '{"location": "Paris", "unit": "celsius"}')])
    assert read("\n" + london + "\n") == ("\n", [("get_weather", '{"location": "London"}')])
    # Ended on its end token: a whole call without its end tag is still one.
    assert read(london.removesuffix("<end_function_call>")) == (
        "",
        [("get_weather", '{"location": "London"}')],
    )
    for text in (
        "<start_function_call>call:get_weather{location:<escape>Lon",  # cut short
        call("get_weather", "city:<escape>NYC<escape>unit:<escape>celsius<escape>"),
        call("f", "a:1,"),
        "<start_function_call>get_weather{}<end_function_call>",
        call("f", "a:1}"),
        "<start_function_",
    ):
        assert read(text) == (text, [])
    # <start_function_call>, <end_function_call> and <escape> are FunctionGemma's special
    # tokens: the text must keep them (vLLM's parser sets skip_special_tokens False).
    assert ChatOutput(None, ToolChoice("auto", parser="functiongemma")).keeps_special_tokens


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_gemma4_output_streamed_in_any_pieces_reads_as_it_does_whole(step):
    """Gemma 4's calls, FunctionGemma's notation with <|"|> tokens around its strings, read as
    vLLM's gemma4 parser reads them: a bare word true or false, a null (null, none or nil in
    any case), a number (a float where it holds a "."), else as written; a string as written
    whatever the tool's schema says. Where Weir differs, as for FunctionGemma: text before a
    call is content as written, and a block that is no whole call is content as written
    (vLLM makes arguments out of what it holds)."""

    def read(text, properties=None):
        choice = ToolChoice("auto", parser="gemma4", properties=properties or {})
        return read_in_pieces(choice.reader(), text, step)

    def call(name, body):
        return f"<|tool_call>call:{name}{{{body}}}<tool_call|>"

    def arguments(**values):
        return json.dumps(values, ensure_ascii=False)

    q = '<|"|>'  # Gemma 4's string delimiter, a token of its own
    london = call("get_weather", f"location:{q}London{q}")
    assert read("Hello, how can I help you today?") == ("Hello, how can I help you today?", [])
    assert read(london) == ("", [("get_weather", '{"location": "London"}')])
    utc = call("get_time", f"timezone:{q}UTC{q}")
    # Several calls, one after another with nothing between (Gemma 4's template).
    assert read("Let me check. " + london + utc) == (
        "Let me check. ",
        [("get_weather", '{"location": "London"}'), ("get_time", '{"timezone": "UTC"}')],
    )
    assert read(call("f", "")) == ("", [("f", "{}")])
    typed = (
        "a:42,b:-7,ratio:0.5,big:1.5e3,on:true,off:false,n:null,m:None,k:NIL,"
        f"note:{q}x, {{y}}: [z] \"q\" 'p' <escape>{q},o:{{k:[1,{{b:true}},{q}s{q}]}},l:[],"
        f"{q}quoted key{q}:1"
    )
    assert read(call("f", typed)) == (
        "",
        [
            (
                "f",
                arguments(
                    a=42,
                    b=-7,
                    ratio=0.5,
                    big=1500.0,
                    on=True,
                    off=False,
                    n=None,
                    m=None,
                    k=None,
                    note="x, {y}: [z] \"q\" 'p' <escape>",
                    o={"k": [1, {"b": True}, "s"]},
                    l=[],
                    **{"quoted key": 1},
                ),
            )
        ],
    )
    # vLLM's reading, not JSON's nor Python's: these bare words stay words.
    words = call("f", "a:True,b:1e5,c:Paris")
    assert read(words) == ("", [("f", arguments(a="True", b="1e5", c="Paris"))])
    # A string is a string, even where the tool's schema types the parameter otherwise.
    counted = call("f", f"count:{q}42{q}")
    assert read(counted, {"f": {"count": {"type": "integer"}}}) == ("", [("f", '{"count": "42"}')])
    assert read("\n" + london + "\n") == ("\n", [("get_weather", '{"location": "London"}')])
    # Ended on its end token: a whole call without its end tag is still one.
    assert read(london.removesuffix("<tool_call|>")) == (
        "",
        [("get_weather", '{"location": "London"}')],
    )
    for text in (
        f"<|tool_call>call:get_weather{{location:{q}Lon",  # cut short (max_tokens)
        call("f", f"a:{q}x{q}b:1"),  # no separator
        call("f", f"a:{q}x"),  # a string never closed
        call("f", "a:1,"),
        call("f", "a:1}"),
        call("f", "a:1.5e999"),  # no JSON for an infinite number
        "<|tool_call>get_weather{}<tool_call|>",
        "<|tool_c",
    ):
        assert read(text) == (text, [])
    # Gemma 4's <|tool_call>, <tool_call|> and <|"|> are special tokens: the text must keep
    # them (vLLM's parser sets skip_special_tokens False).
    assert ChatOutput(None, ToolChoice("auto", parser="gemma4")).keeps_special_tokens


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_seed_oss_and_hunyuan_calls_streamed_in_any_pieces_read_as_they_do_whole(step):
    """Seed-OSS' blocks as qwen3_coder's (a block cut short by max_tokens is content, as
    written); Hunyuan's array: an item that is no call is passed over, its siblings kept
    (vLLM's parser), and an array of none, or no array, is content."""
    properties = {"get_weather": WEATHER["properties"]}
    tags = ("<seed:tool_call>", "</seed:tool_call>")

    def seed(text):
        return read_in_pieces(
            HermesReader(functools.partial(xml_call, properties), tags), text, step
        )

    calls = SEED_OSS_OUTPUT[SEED_OSS_OUTPUT.index("Checking") :]
    both = [("get_weather", '{"city": "Oslo", "days": 3}'), ("get_time", "{}")]
    assert seed(calls) == ("Checking.\n\n", both)
    cut = calls[: calls.rindex("</function>")]  # max_tokens: the last block is content
    assert seed(cut) == ("Checking.\n\n" + cut[cut.rindex("<seed:tool_call>") :], both[:1])

    def hunyuan(text):
        return read_in_pieces(
            HermesReader(hunyuan_calls, ("<tool_calls>", "</tool_calls>")), text, step
        )

    block = '<tool_calls>[{{"name": "f", "arguments": {}}}, 3, {{"arguments": {{}}}}]</tool_calls>'
    assert hunyuan("Go. " + block.format('{"a": [1]}')) == ("Go. ", [("f", '{"a": [1]}')])
    assert hunyuan(block.format("Infinity")) == (block.format("Infinity"), [])
    assert hunyuan('<tool_calls>{"name": "f"}</tool_calls>')[1] == []
    assert hunyuan('<tool_calls>[{"name": "f", "argu') == ('<tool_calls>[{"name": "f", "argu', [])


# vLLM's seed_oss cases (tests/tool_parsers/test_seed_oss_tool_parser.py): without a
# reasoning parser, a <seed:think> thought is content, and a call it writes out no call.
SEED_CALL = (
    "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Oslo</parameter>\n"
    "</function>\n</seed:tool_call>"
)
SEED_THOUGHT = "<seed:think>\nThe format is " + SEED_CALL + ". Call it.</seed:think>\n"


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize(
    "text, content, calls",
    [
        (SEED_CALL, "", 1),  # thinking_budget 0
        (SEED_THOUGHT + SEED_CALL, SEED_THOUGHT, 1),
        (" " + SEED_THOUGHT + "Sure.\n" + SEED_CALL, " " + SEED_THOUGHT + "Sure.\n", 1),
        (SEED_THOUGHT, SEED_THOUGHT, 0),
        (SEED_THOUGHT[:-20], SEED_THOUGHT[:-20], 0),  # cut short in the thought
        ("<seed:th", "<seed:th", 0),
    ],
)
def test_seed_oss_reads_calls_after_a_thought_left_in_the_content(text, content, calls, step):
    choice = ToolChoice(
        "auto", parser="seed_oss", properties={"get_weather": WEATHER["properties"]}
    )
    assert read_in_pieces(choice.reader(), text, step) == (
        content,
        [("get_weather", '{"city": "Oslo"}')] * calls,
    )


DEEP = "[" * 100_000  # past the JSON parser's depth


@pytest.mark.parametrize(
    "reader, template",
    [
        (HermesReader, '<tool_call>{{"name": "f", "arguments": {}}}</tool_call>'),
        (Llama3JsonReader, '{{"name": "f", "parameters": {}}}'),
        (MistralReader, '[TOOL_CALLS][{{"name": "f", "arguments": {}}}]'),
        (MistralReader, "[TOOL_CALLS]f[ARGS]{}"),
        (
            DeepSeekReader,
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
        ),
    ],
    ids=["hermes", "llama3_json", "mistral", "mistral_v11", "deepseek"],
)
@pytest.mark.parametrize("arguments", [DEEP, '{"a": Infinity}'], ids=["deep", "infinity"])
def test_arguments_json_has_no_text_for_are_no_call_and_no_error(reader, template, arguments):
    """A model may write arguments nested past the parser's depth or a number JSON has no
    text for (a client's constraint can make it): the reader returns no call, not an error
    that would end the response (Kimi K2's reader keeps such arguments as written, as
    vLLM's does: test_deepseek_tool_calls)."""
    content, calls = read_in_pieces(reader(), template.format(arguments), 100_000)
    assert calls == [] and content


def test_glm45_values_are_json_then_python_literals_then_text():
    properties = {"f": {"s": {"type": "string"}}}
    values = {"s": " [1] ", "j": '{"k": [1, null]}', "p": "{'k': (1, True, None)}",
              "t": "two words", "n": "1e400", "e": "...", "b": "false"}  # fmt: skip
    block = "f\n" + "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in values.items()
    )
    assert json.loads(glm_call(properties, block).arguments) == {
        "s": " [1] ", "j": {"k": [1, None]}, "p": {"k": [1, True, None]}, "t": "two words",
        "n": "1e400", "e": "...", "b": False,  # n: past JSON's range; e: no JSON text
    }  # fmt: skip
    # A string keeps its whitespace, as vLLM's test_whitespace_preserved_in_arg_values
    # has it: the indent of code the model writes.
    code = "f\n<arg_key>s</arg_key>\n<arg_value>    indented code    </arg_value>\n"
    assert json.loads(glm_call(properties, code).arguments) == {"s": "    indented code    "}
    assert json.loads(glm_call({}, " ping \n").arguments) == {}  # no arguments
    assert glm_call({}, "f stray<arg_key>a</arg_key><arg_value>1</arg_value>") is None
    assert glm_call({}, "f<arg_key>a</arg_key><arg_value>1</arg_value> and more") is None
    assert glm_call({}, "") is None


def read_in_pieces(reader, text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    """A tool-call reader's content and calls (name, arguments) for ``text`` fed ``step``
    characters at a time; the calls' indices checked to count up."""
    content, deltas = [], []
    for i in range(0, len(text), step):
        piece, found = reader.feed(text[i : i + step])
        content.append(piece)
        deltas += found
    rest, found = reader.finish()
    calls = [(d["function"]["name"], d["function"]["arguments"]) for d in deltas + found]
    assert [d["index"] for d in deltas + found] == list(range(len(calls)))
    return "".join(content) + rest, calls


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_a_pythonic_output_streamed_in_any_pieces_reads_as_it_does_whole(step):
    def read(text):
        return read_in_pieces(PythonicReader(), text, step)

    llama4 = ' <|python_start|>[f(a=[1, {"b": None}], c=True)]<|python_end|>'
    assert read(llama4) == ("", [("f", '{"a": [1, {"b": null}], "c": true}')])
    assert read("[f(s='])'), g()]") == ("", [("f", '{"s": "])"}'), ("g", "{}")])
    assert read("[f(a=true, b=null)]") == ("", [("f", '{"a": true, "b": null}')])  # vLLM's
    assert read("[f(1)]") == ("[f(1)]", [])  # positional: no parameter names
    assert read("[f(a=1e400)]") == ("[f(a=1e400)]", [])  # no JSON for an infinite number
    assert read("[f(a=1)] and more") == ("[f(a=1)] and more", [])
    assert read("[f(a=") == ("[f(a=", [])  # cut short
    assert read("[]") == ("[]", [])
    assert read("Hi [f(a=1)]") == ("Hi [f(a=1)]", [])
    assert read("<|python_s") == ("<|python_s", [])
    # As vLLM's parser (test_bad_sibling_call_does_not_drop_good_calls and others): a call
    # with no JSON text for its arguments, or that is no Python, does not drop the others.
    good = ("g", '{"c": "X"}')
    assert read("[bad(x=b'z'), g(c='X')]") == ("", [good])
    assert read("[calc(x=1e999), g(c='X'), h(1)]") == ("", [good])
    assert read("[g(c='X'), f(a='x 'y', b='z')]") == ("", [good])
    for text in ("[f(a='x 'y' 'z), g(b='p 'q' 'r)]", "[foo(x=1])]", "[g(c='X'), 2]"):
        assert read(text) == (text, [])


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_llama3_output_streamed_in_any_pieces_reads_as_it_does_whole(step):
    def read(text):
        return read_in_pieces(Llama3JsonReader(), text, step)

    assert read(' <|python_tag|>{"name": "f", "parameters": {"s": "};{"}};{"name": "g"') == (
        '{"name": "g"',
        [("f", '{"s": "};{"}')],
    )
    assert read('\n{"name": "f", "arguments": {}} then') == (" then", [("f", "{}")])
    # Text that is not calls is content as the model wrote it: its spaces, brackets and
    # quoted words too, and a stray closing brace does not hide the object after it.
    prose = '{"answer": 42} is the JSON you asked "for", ok; done]'
    assert read(prose) == (prose, [])
    assert read('{"name": "f", "parameters": {}}}} and "x"') == ('}} and "x"', [("f", "{}")])
    assert read('{"x": 1}} {"name": "f", "parameters": {}}') == ('{"x": 1}} ', [("f", "{}")])
    assert read('{"name": "f", "parameters": {}} ; {"name": "g", "parameters": {"a": 1}}\n') == (
        "",
        [("f", "{}"), ("g", '{"a": 1}')],
    )
    assert read("<|pyth") == ("<|pyth", [])
    assert read("  <b>{not a call}</b>") == ("  <b>{not a call}</b>", [])
    assert read('{"x": 1}') == ('{"x": 1}', [])


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_granite_output_streamed_in_any_pieces_reads_as_it_does_whole(step):
    def read(text):
        return read_in_pieces(GraniteReader(), text, step)

    assert read("<|tool_call|>" + CALLS_ARRAY) == ("", TWO_CALLS)
    assert read(" <tool_call>\n" + CALLS_ARRAY + "\n") == ("", TWO_CALLS)  # Granite 3.0's
    assert read(CALLS_ARRAY) == ("", TWO_CALLS)
    serialized = '<|tool_call|>[{"name": "f", "arguments": "{\\"a\\": 1}"}]'
    assert read(serialized) == ("", [("f", '{"a": 1}')])
    # As vLLM's parser: anything but the array (text before or after it, an object, an item
    # that is no call, an array cut short) is content as written.
    # <|tool_call|> is a special token of Granite 3.1 on: the text must keep it.
    assert ChatOutput(None, ToolChoice("auto", parser="granite")).keeps_special_tokens
    for text in (
        "Hi <|tool_call|>" + CALLS_ARRAY,
        "<|tool_call|>" + CALLS_ARRAY + " done",
        '<|tool_call|>{"name": "f", "arguments": {}}',
        '<|tool_call|>[{"name": "f"}, 2]',
        '<|tool_call|>[{"name": "f", "arguments": {',
        "<|tool_call|>[]",
        "<|tool_c",
        "[1] is a list",
    ):
        assert read(text) == (text, [])


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_phi4_mini_output_streamed_in_any_pieces_reads_as_it_does_whole(step):
    def read(text):
        return read_in_pieces(Phi4MiniReader(), text, step)

    assert read("functools" + CALLS_ARRAY) == ("", TWO_CALLS)
    nested = 'functools[{"name": "f", "parameters": {"a": [1, [2]]}}] '  # Llama's key too
    assert read(nested) == ("", [("f", '{"a": [1, [2]]}')])
    assert read("Use functools.partial.") == ("Use functools.partial.", [])
    prose = Phi4MiniReader()  # the word alone begins no call: it streams
    assert prose.feed("Use functools.") == ("Use functools.", [])
    for text in ('functools[{"name": "f", "arguments": {', "functools[] text", "functools[{}]"):
        assert read(text) == (text, [])
    assert read("I'll ask. functool") == ("I'll ask. functool", [])


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_an_xlam_output_streamed_in_any_pieces_reads_as_it_does_whole(step):
    def read(text):
        return read_in_pieces(XlamReader(), text, step)

    # vLLM's test_extract_tool_calls cases: the array alone, after a thought, in a fence,
    # after [TOOL_CALLS], in <tool_call> tags.
    assert read(" " + CALLS_ARRAY) == ("", TWO_CALLS)
    assert read("<think>Weather.</think>" + CALLS_ARRAY) == ("<think>Weather.</think>", TWO_CALLS)
    assert read("I'll help.\n```json\n" + CALLS_ARRAY + "\n```\nDone.") == (
        "I'll help.\nDone.",
        TWO_CALLS,
    )
    assert read("Checking.[TOOL_CALLS]" + CALLS_ARRAY) == ("Checking.", TWO_CALLS)
    assert read("Ok.<tool_call>" + CALLS_ARRAY + "</tool_call>") == ("Ok.", TWO_CALLS)
    assert read('[{"name": "f", "arguments": {}}, {"no": "call"}]') == ("", [("f", "{}")])
    for text in (
        "Snow [all week].",
        "```python\nprint([1])\n```",
        "[1, 2]",
        '[{"name": "f", "argu',  # cut short
        '```json\n{"name": "f", "arguments": {}}\n```',  # no array
        "<think>a</think>  ",
        "Done.</thi",
    ):
        assert read(text) == (text, [])


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_an_olmo3_output_streamed_in_any_pieces_reads_as_it_does_whole(step):
    def read(text):
        return read_in_pieces(ToolChoice("auto", parser="olmo3").reader(), text, step)

    calls = "f(a=[1, {'b': None}], c=True)\n\ng(d=false, e=null)\n"
    f, g = ("f", '{"a": [1, {"b": null}], "c": true}'), ("g", '{"d": false, "e": null}')
    assert read(f"Hi <b>.<function_calls>\n{calls}</function_calls>\n") == ("Hi <b>.", [f, g])
    assert read(f"<function_calls>{calls}") == ("", [f, g])  # ended on its end token
    # As vLLM's: a call that has no JSON text or is no Python does not drop the others.
    assert read("<function_calls>bad(x=b'z')\ng(d=false, e=null)</function_calls>") == ("", [g])
    assert read("<function_calls>calc(x=1e999)\nf(a=[1, {'b': None}], c=True)") == ("", [f])
    for text in (
        "No call.",
        "<function_calls>f(a=",  # cut short
        "<function_calls>g(d=1)\nnot a call</function_calls>",
        "<function_calls>\n</function_calls>",
        "<function_calls>foo(x=1])</function_calls>",
        "<function_ca",
    ):
        assert read(text) == (text, [])


def test_auto_needs_a_parser_and_the_other_choices_do_not(gateway):
    """A gateway started without --tool-call-parser refuses "auto" (OpenAI's default with
    tools), as vLLM does, and serves the rest."""
    plain = gateway(NO_PARSERS)
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser") as refused:
        _call(plain)
    assert refused.value.body["param"] == "tool_choice"
    choice = {"type": "function", "function": {"name": "get_time"}}
    [reply] = _call(plain, tool_choice=choice, max_tokens=5).choices
    [call] = reply.message.tool_calls
    assert call.function.name == "get_time" and call.function.arguments.startswith("{")


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_a_hermes_text_streamed_in_any_pieces_reads_as_it_does_whole(step):
    text = (
        "a <b> <tool_call>\n"
        '{"name": "f", "arguments": {"x": "</tool_call"}}\n</tool_call>\n'
        "<tool_call>not json</tool_call>\n <tool_call>\n"
        '{"name": "g", "arguments": {"y": [1, 2]}}\n</tool_call>\n\n'
        '<tool_call>\n{"name": "h"'  # cut short
    )
    reader = HermesReader()
    content, deltas = [], []
    for i in range(0, len(text), step):
        piece, found = reader.feed(text[i : i + step])
        content.append(piece)
        deltas += found
    rest, found = reader.finish()
    # Whitespace between calls is not content; a block that is no call, or is cut short, is.
    assert "".join(content) + rest == (
        'a <b> <tool_call>not json</tool_call><tool_call>\n{"name": "h"'
    )
    assert [(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [
        (0, "f", '{"x": "</tool_call"}'),
        (1, "g", '{"y": [1, 2]}'),
    ]
    if step == 1:  # content streams as it comes, less what may begin a tag
        assert content[:6] == ["a", " ", "", "<b", ">", " "]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_arguments_written_as_a_json_string_of_an_object_are_that_object(step):
    """vLLM's test_hermes_parser_non_streaming_serialized_arguments: Granite 4 writes the
    arguments serialized, which must not reach the client encoded twice; any other string
    (not JSON, or JSON of no object) stays the string it is."""

    def read(arguments: str):
        block = json.dumps({"name": "f", "arguments": arguments})
        return read_in_pieces(HermesReader(), f"<tool_call>{block}</tool_call>", step)

    assert read('{"param": "max_connections"}') == ("", [("f", '{"param": "max_connections"}')])
    for plain in ("hello", "{hello world}", "[oops", '{"a": 1} tail text', "[1]", "3"):
        assert read(plain) == ("", [("f", json.dumps(plain))])


def test_a_hermes_call_without_its_end_tag_is_read_at_the_end():
    reader = HermesReader()
    assert reader.feed('ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n') == ("ok ", [])
    _, [delta] = reader.finish()
    assert (delta["index"], delta["function"]) == (0, {"name": "f", "arguments": '{"a": 1}'})
    cut = HermesReader()
    cut.feed('<tool_call>{"name": "f", "argu')
    assert cut.finish() == ('<tool_call>{"name": "f", "argu', []) and not cut.calls


def test_a_call_array_cut_short_ends_as_content_and_braces_in_strings_are_text():
    reader = JsonCallReader(2)
    text = '[{"name": "f", "parameters": {"s": "}]\\"{"}}, {"name": "g", "para'
    content, deltas = reader.feed(text)
    rest, _ = reader.finish()
    assert content + rest == '{"name": "g", "para'
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [
        ("f", '{"s": "}]\\"{"}')
    ]


def test_a_named_call_streams_its_arguments_and_announces_itself_once():
    reader = NamedCallReader("f")
    _, first = reader.feed('{"a"')
    _, second = reader.feed(": 1}")
    assert first == [
        {
            "index": 0,
            "id": reader.calls[0].id,
            "type": "function",
            "function": {"name": "f", "arguments": '{"a"'},
        }
    ]
    assert second == [{"index": 0, "function": {"arguments": ": 1}"}}]
    assert reader.calls[0].arguments == '{"a": 1}' and reader.finish() == ("", [])
