"""Thinking models over the chat API, through the official `openai` client, in front of real
`weir serve` processes: the tiny random Llama served with `--chat-template` (a Qwen3-style
template that renders earlier reasoning and honours `enable_thinking`) and
`--reasoning-parser qwen3 --tool-call-parser hermes`.

The references are independent of the engine: transformers renders the same chats with the
same template and arguments (`continue_final_message` included); the reasoning readers are
checked against outputs forced by a choice constraint (so tags split across tokens) and
against themselves fed in pieces of every size.
"""

import json
import shutil

import httpx
import openai
import pytest
from serving_helpers import read_chat, small_server

from weir.services.gateway.chat_output import ChatOutput, ChatParsers
from weir.services.gateway.openai_format import Choice
from weir.services.gateway.reasoning import MARKERS, Markers, ReasoningReader
from weir.services.gateway.schemas import ChatCompletionRequest
from weir.services.gateway.tool_calls import ToolChoice

transformers = pytest.importorskip("transformers")

MODEL = "tiny-thinking"

# Qwen3's chat template, abridged: earlier reasoning rendered in <think>, and an empty
# thought in the generation prompt when asked not to think.
TEMPLATE = """\
{%- for message in messages %}
{%- if message.role == "assistant" %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content is defined and message.reasoning_content %}
{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
{%- endif %}
{{- message.content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}"""

ASK = [{"role": "user", "content": "What is 2 + 2?"}]
THOUGHT = [
    *ASK,
    {"role": "assistant", "content": "4.", "reasoning": "Two and two make four."},
    {"role": "user", "content": "And 3 + 3?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("templates") / "thinking.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory, tiny_model_dir):
    """transformers' tokenizer of the model, with the template given to the server."""
    path = tmp_path_factory.mktemp("models") / "tiny-thinking"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return transformers.AutoTokenizer.from_pretrained(path)


PARSERS = ChatParsers(tool_call="hermes", reasoning="qwen3")


@pytest.fixture(scope="module")
def server(tiny_model_dir, template_file):
    # --chat-template: the model's own renders no reasoning.
    with small_server(
        tiny_model_dir, MODEL, PARSERS, chat_template=str(template_file)
    ) as processes:
        yield processes


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.info["http_address"] + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.info["http_address"], timeout=60) as http:
        yield http


def _hf_messages(messages):
    """The messages as transformers takes them (it reads both names of the reasoning)."""
    return messages


RENDERINGS = [
    ({"messages": ASK}, {}),
    ({"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}, {}),
    ({"messages": THOUGHT}, {}),
    (
        {
            "messages": [
                *THOUGHT[:1],
                {**THOUGHT[1], "reasoning_content": "Sum.", "reasoning": None},
            ]
        },
        {},
    ),
    ({"messages": THOUGHT, "add_generation_prompt": False}, {}),
    (
        {
            "messages": [*ASK, {"role": "assistant", "content": "The answer is "}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        {},
    ),
    # Final messages whose text is empty, only spaces, spaced at both ends, or written again
    # later by the template (inside <|im_end|>): the cut is where the message ends.
    *(
        (
            {
                "messages": [*ASK, {"role": "assistant", "content": content, **reasoning}],
                "add_generation_prompt": False,
                "continue_final_message": True,
            },
            {},
        )
        for content, reasoning in (
            ("", {}),
            (" \n", {}),
            (" abc ", {}),
            ("im", {}),
            ("", {"reasoning": "A partial thought."}),
        )
    ),
    # Both names of the reasoning: transformers renders reasoning_content.
    (
        {
            "messages": [
                *ASK,
                {
                    "role": "assistant",
                    "content": "4.",
                    "reasoning": "R1",
                    "reasoning_content": "R2",
                },
            ]
        },
        {},
    ),
]


@pytest.mark.parametrize("body, _", RENDERINGS)
def test_chats_render_as_transformers_renders_them(http, hf_tokenizer, body, _):
    """/tokenize and a chat's prompt_tokens equal transformers' rendering of the same chat
    with the same arguments (--chat-template in place of the model's own)."""
    messages = [{k: v for k, v in m.items() if v is not None} for m in body["messages"]]
    text = hf_tokenizer.apply_chat_template(
        _hf_messages(messages),
        tokenize=False,
        add_generation_prompt=body.get("add_generation_prompt", True),
        continue_final_message=body.get("continue_final_message", False),
        **body.get("chat_template_kwargs", {}),
    )
    want = hf_tokenizer.encode(text, add_special_tokens=False)
    tokenized = http.post("/tokenize", json={"model": MODEL, **body})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == want
    chat = http.post(
        "/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "temperature": 0, **body}
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(want)


def test_continue_final_message_goes_on_with_the_last_message(http, hf_tokenizer):
    [body] = [b for b, _ in RENDERINGS if b.get("continue_final_message")][:1]
    ids = http.post("/tokenize", json={"model": MODEL, **body}).json()["tokens"]
    assert hf_tokenizer.decode(ids).endswith("<|im_start|>assistant\nThe answer is ")


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt false"),
        ({"chat_template_kwargs": {"messages": []}}, None, "'messages' is set by the request"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "dict"),
        (
            {"messages": [{"role": "user", "content": "a", "reasoning": "b"}]},
            "messages.0.reasoning",
            "only an assistant message has reasoning",
        ),
        ({"include_reasoning": "maybe"}, "include_reasoning", "bool"),
        (
            {"structured_outputs": {"regex": "a", "reasoning_end": "x"}},
            "structured_outputs",
            "reasoning_end is set by --reasoning-parser",
        ),
    ],
)
def test_bad_template_arguments_are_a_400_that_names_them(http, body, param, words):
    reply = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 1, **body}
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param
    ok = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 1})
    assert ok.status_code == 200


def test_messages_sent_back_as_clients_send_them(http, client):
    """The openai SDK's whole message (its nulls) and litellm's (its provider_specific_fields)
    come back in the next turn; a template variable may have any name."""
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    sdk = reply.choices[0].message.model_dump()
    litellm = {**sdk, "provider_specific_fields": {"reasoning": sdk["reasoning"]}}
    for message in (sdk, litellm):
        body = {"model": MODEL, "messages": [*ASK, message, *ASK], "max_tokens": 1}
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    body = {"model": MODEL, "messages": ASK, "max_tokens": 1, "chat_template_kwargs": {"self": 1}}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_continued_message_goes_on_as_content(client, stream):
    """The output of continue_final_message goes on with the message's text: content, not
    a thought (the template closed any thought before it)."""
    started = [*ASK, {"role": "assistant", "content": "The answer is", "reasoning": "Sum."}]
    kwargs = {"add_generation_prompt": False, "continue_final_message": True}
    reasoning, content, _, _ = _chat(client, stream, started, max_tokens=4, extra_body=kwargs)
    assert reasoning is None and content


def test_tokenize_refuses_chat_fields_without_messages(http):
    reply = http.post(
        "/tokenize", json={"model": MODEL, "prompt": "hi", "chat_template_kwargs": {"a": 1}}
    )
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "chat_template_kwargs"


def _forced(text: str) -> dict:
    """A body field that makes the model write ``text`` (a choice of one)."""
    return {"structured_outputs": {"choice": [text]}}


def _chat(client, stream: bool, messages=ASK, **kwargs):
    """A chat of ``MODEL`` (greedy) read by `read_chat`."""
    kwargs = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 60, **kwargs}
    return read_chat(client, stream, **kwargs)


@pytest.mark.parametrize("stream", [False, True])
def test_a_thought_is_reasoning_and_the_answer_content(client, stream):
    body = _forced("<think>\nTwo and two make four.\n</think>\n\nThe answer is 4.")
    reasoning, content, calls, finish = _chat(client, stream, extra_body=body)
    assert (reasoning, content, calls, finish) == (
        "\nTwo and two make four.\n",
        "\n\nThe answer is 4.",
        [],
        "stop",
    )
    hidden = _chat(client, stream, extra_body={**body, "include_reasoning": False})
    assert hidden == (None, "\n\nThe answer is 4.", [], "stop")
    empty = _chat(client, stream, extra_body=_forced("<think></think>4"))
    assert empty == (None, "4", [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_a_tool_call(client, stream):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    body = _forced(f"<think>I need the weather.</think>{call}")
    reasoning, content, calls, finish = _chat(
        client, stream, tools=TOOLS, max_tokens=200, extra_body=body
    )
    assert (reasoning, content, calls, finish) == (
        "I need the weather.",
        None,
        [("get_weather", '{"city": "Oslo"}')],
        "tool_calls",
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_thinking_request_is_reasoning_until_the_thought_ends(client, stream):
    """Unconstrained, the random model never writes </think>: its output is all reasoning
    (cut short by max_tokens), unless asked not to think."""
    reasoning, content, _, finish = _chat(client, stream, max_tokens=8)
    assert reasoning and content is None and finish == "length"
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    reasoning, content, _, finish = _chat(client, stream, max_tokens=8, extra_body=kwargs)
    assert reasoning is None and content and finish == "length"


def test_every_reasoning_effort_vllm_takes(http):
    """litellm's thinking={"type": "enabled", "budget_tokens": 100} posts reasoning_effort
    "minimal", GPT-5 clients "none": both vLLM's. An effort other than "none" thinks; "none"
    asks the template not to (enable_thinking false, as vLLM sets it): the output is answer."""
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 0}

    def reply(**fields) -> dict:
        response = http.post("/v1/chat/completions", json={**body, **fields})
        assert response.status_code == 200, response.text
        return response.json()

    minimal = reply(reasoning_effort="minimal")["choices"][0]["message"]
    assert minimal["reasoning"] and minimal["content"] is None
    none = reply(reasoning_effort="none")
    off = reply(chat_template_kwargs={"enable_thinking": False})
    assert none["choices"][0]["message"] == off["choices"][0]["message"]
    assert none["usage"]["prompt_tokens"] == off["usage"]["prompt_tokens"]


def test_a_structured_output_is_content(client):
    """Held to a format from its first token, the output does not think."""
    reasoning, content, _, _ = _chat(client, False, extra_body=_forced("four"))
    assert (reasoning, content) == (None, "four")


CASES = [
    # (thinking, text, reasoning (None: none), content)
    (True, "<think>a</think>b", "a", "b"),
    (True, "  <think>a</think>b", "a", "b"),
    (True, "a</think>b", "a", "b"),  # the template opened the thought
    (True, "abc", "abc", ""),  # cut short while thinking
    (True, "<think>", "", ""),
    (True, "<thin", "<thin", ""),
    (True, "a</think", "a</think", ""),
    (True, "a</think></think>b", "a", "</think>b"),
    (False, "abc", None, "abc"),
    (False, "<think>a</think>b", "a", "b"),
    (False, "<thin", None, "<thin"),
    (False, " x<think>a</think>", None, " x<think>a</think>"),
    (False, "<think>abc", "abc", ""),
]


@pytest.mark.parametrize("thinking, text, reasoning, content", CASES)
def test_reasoning_reader_splits_alike_in_any_pieces(thinking, text, reasoning, content):
    _assert_splits_alike(Markers(), thinking, text, reasoning, content)


def _assert_splits_alike(markers, thinking, text, reasoning, content):
    """``text``, fed in pieces of every size, is ``reasoning`` (None: none) and ``content``."""
    for size in (1, 2, 3, 5, 1000):
        reader = ReasoningReader(thinking, markers)
        got = [reader.feed(text[i : i + size]) for i in range(0, len(text), size)]
        got.append(reader.finish())
        assert "".join(r for r, _ in got) == (reasoning or "")
        assert "".join(c for _, c in got) == content
        assert reader.reasoned == (reasoning is not None)


QWEN3_CASES = [
    # A tool call written before </think> ends the thought and is content (vLLM's qwen3).
    (True, "I read it.\n<tool_call>\n<function=f>", "I read it.\n", "<tool_call>\n<function=f>"),
    (True, "<think>a</think>b<tool_call>c", "a", "b<tool_call>c"),
    (True, "a<tool_call>b</think>c", "a", "<tool_call>b</think>c"),
    (True, "a<tool_cal", "a<tool_cal", ""),  # cut short
    (False, "<tool_call>a", None, "<tool_call>a"),
]


@pytest.mark.parametrize("thinking, text, reasoning, content", QWEN3_CASES)
def test_qwen3s_tool_call_ends_its_thought_in_any_pieces(thinking, text, reasoning, content):
    _assert_splits_alike(MARKERS["qwen3"], thinking, text, reasoning, content)


MARKED_CASES = [
    # (parser, thinking, text, reasoning (None: none), content)
    # Seed-OSS writes <seed:think> itself; its budget reflections are reasoning (its README).
    (
        "seed_oss",
        True,
        "<seed:think>a<seed:cot_budget_reflect>b</seed:cot_budget_reflect></seed:think>c",
        "a<seed:cot_budget_reflect>b</seed:cot_budget_reflect>",
        "c",
    ),
    ("seed_oss", True, "a\n</seed:think>\nc", "a\n", "\nc"),
    ("seed_oss", True, "<seed:think>a</think>b", "a</think>b", ""),  # not its tag
    # A thinking budget of 0: its template's prompt opens the thought and a reflection.
    (
        "seed_oss",
        True,
        "Budget 0.</seed:cot_budget_reflect>\n</seed:think>\nc",
        "Budget 0.</seed:cot_budget_reflect>\n",
        "\nc",
    ),
    # Hunyuan: its tags' lines, the answer out of its tags (vLLM's
    # test_hunyuan_reasoning_parser), with or without the newlines.
    ("hunyuan_a13b", False, "<think>\na\n</think>\n<answer>\nb\n</answer>", "a", "b"),
    ("hunyuan_a13b", False, "<think>\n\n</think>\n<answer>\nb\n</answer>", "", "b"),
    ("hunyuan_a13b", False, "<think>a\n\n</think><answer>b\n\n</answer>", "a\n", "b\n"),
    ("hunyuan_a13b", False, "<answer>\nb\n</answer>\n", None, "b"),  # enable_thinking false
    ("hunyuan_a13b", False, "<think>\na\n</think>\n<answer>\nb\n</answer>\nc", "a", "b"),
    ("hunyuan_a13b", False, "b <answer>", None, "b <answer>"),  # no tags around: as written
    ("hunyuan_a13b", False, "<think>\na\nb", "a\nb", ""),  # cut short (max_tokens)
    ("hunyuan_a13b", False, "<think>\na\n</think>\n<answer>\nb\n</ans", "a", "b\n</ans"),
    ("hunyuan_a13b", False, "\n<answ", None, "<answ"),
    # ERNIE 4.5 Thinking: its prompt opens the thought; the answer out of <response>, the
    # whitespace before a call no content (vLLM's ernie45 parsers).
    ("ernie45", True, "abc\n</think>\n\n<response>\ndef\n</response>\n", "abc\n", "\ndef\n"),
    ("ernie45", True, "abc\n</think>\n\n\n<tool_call>x", "abc\n", "<tool_call>x"),
    ("ernie45", True, "abc</think>def", "abc", "def"),
    ("ernie45", True, "abc", "abc", ""),
    # Gemma 4 opens its channel itself (not asked to think: all content); the thought label
    # after <|channel> is no reasoning, and <|tool_call> ends the thought and is content
    # (vLLM's gemma4 parser).
    ("gemma4", False, "<|channel>thought\na\nb<channel|>c", "a\nb", "c"),
    ("gemma4", False, "<|channel>thought\n<channel|>c", "", "c"),
    ("gemma4", False, "Four.", None, "Four."),
    ("gemma4", False, "<|channel>thought\na<|tool_call>x", "a", "<|tool_call>x"),
    (
        "gemma4",
        False,
        "<|channel>thought\na<|tool_call>b<channel|>c",
        "a",
        "<|tool_call>b<channel|>c",
    ),
    ("gemma4", False, "<|channel>thoughts\na<channel|>c", "thoughts\na", "c"),  # no label
    ("gemma4", False, "<|channel>a<channel|>c", "a", "c"),
    ("gemma4", False, "<|channel>thought\nthought\na", "thought\na", ""),  # cut short
    ("gemma4", False, "<|channel>though", "", ""),  # cut short in the label
    ("gemma4", False, "<|channel>thought\na<channel", "a<channel", ""),
    ("gemma4", False, "<|chan", None, "<|chan"),
    ("gemma4", False, "x<|channel>thought\na<channel|>", None, "x<|channel>thought\na<channel|>"),
]


@pytest.mark.parametrize("parser, thinking, text, reasoning, content", MARKED_CASES)
def test_each_parsers_markers_split_alike_in_any_pieces(parser, thinking, text, reasoning, content):
    _assert_splits_alike(MARKERS[parser], thinking, text, reasoning, content)


GRANITE_CASES = [
    # Granite 3.2's markers, "Here's" or "Here is" (vLLM's granite parser takes both).
    ("Here is my thought process:\na\nHere is my response:\nb", "\na\n", "\nb"),
    (" Here's my thought process: a Here's my response: b", " a ", " b"),
    ("Here's my thought process:a", "a", ""),  # cut short
    ("Four.", None, "Four."),  # not asked to think: no markers, all answer
    ("Here is my thought", None, "Here is my thought"),
    ("I said: Here is my thought process:", None, "I said: Here is my thought process:"),
]


@pytest.mark.parametrize("text, reasoning, content", GRANITE_CASES)
def test_granites_markers_split_alike_in_any_pieces(text, reasoning, content):
    body = ChatCompletionRequest.model_validate(
        {"messages": ASK, "chat_template_kwargs": {"thinking": True}}
    )
    output = body.chat_output(ChatParsers(reasoning="granite"))
    assert output.thinking is False  # the model opens its thought itself
    for size in (1, 2, 3, 5, 1000):
        reader = ReasoningReader(output.thinking, output.reasoning_markers)
        got = [reader.feed(text[i : i + size]) for i in range(0, len(text), size)]
        got.append(reader.finish())
        assert "".join(r for r, _ in got) == (reasoning or "")
        assert "".join(c for _, c in got) == content
        assert reader.reasoned == (reasoning is not None)


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("text", ["a\n</think>\n\nb", "<think>a</think>b", ""])
def test_minimax_m2_append_think_keeps_the_thought_in_the_content(thinking, text):
    """vLLM's minimax_m2_append_think: no reasoning, the content ``<think>`` and the text
    (MiniMax-M2's template opens the thought in the prompt), however the request thinks."""
    for size in (1, 2, 5, 1000):
        reader = ReasoningReader(thinking, MARKERS["minimax_m2_append_think"])
        got = [reader.feed(text[i : i + size]) for i in range(0, len(text), size)]
        got.append(reader.finish())
        assert "".join(r for r, _ in got) == ""
        assert "".join(c for _, c in got) == "<think>" + text
        assert reader.reasoned is False


def test_qwen3s_tool_call_before_the_thoughts_end_is_a_call():
    output = ChatOutput(
        True,
        ToolChoice("auto", parser="qwen3_coder", properties={"bash": {}}),
        with_tools=True,
        reasoning_markers=MARKERS["qwen3"],
    )
    text = (
        "I need the file.\n\n<tool_call>\n<function=bash>\n<parameter=command>\n"
        "cat /etc/hosts\n</parameter>\n</function>\n</tool_call>"
    )
    reader = output.reader()
    reasoning, content, deltas = reader.feed(text)
    more_reasoning, rest, more = reader.finish("stop", None)
    assert reasoning + more_reasoning == "I need the file.\n\n"
    assert (content + rest).strip() == ""
    [call] = deltas + more
    assert call["function"]["name"] == "bash"
    assert json.loads(call["function"]["arguments"]) == {"command": "cat /etc/hosts"}


@pytest.mark.parametrize(
    "parser, thinking, text",
    [
        (
            "seed_oss",
            True,
            "a</seed:think>Ok.\n<seed:tool_call>\n<function=f>\n<parameter=n>2</parameter>\n"
            "</function>\n</seed:tool_call>",
        ),
        (
            "hunyuan_a13b",
            False,
            "<think>\na\n</think>\n<answer>\nOk.\n"
            '<tool_calls>[{"name": "f", "arguments": {"n": 2}}]</tool_calls>\n</answer>',
        ),
        (
            "ernie45",
            True,
            'a</think>\n\nOk.\n<tool_call>\n{"name": "f", "arguments": {"n": 2}}\n</tool_call>\n',
        ),
        ("gemma4", False, "<|channel>thought\na<channel|>Ok.\n<|tool_call>call:f{n:2}<tool_call|>"),
    ],
)
def test_a_thought_then_a_call_read_char_by_char_as_whole(parser, thinking, text):
    """The reasoning reader of each parser, then its tool-call reader on the content (both
    named alike in vLLM): the thought, the content before the call, the call."""
    output = ChatOutput(
        thinking,
        ToolChoice("auto", parser=parser, properties={"f": {"n": {"type": "integer"}}}),
        with_tools=True,
        reasoning_markers=MARKERS[parser],
    )
    for size in (1, len(text)):
        reader = output.reader()
        got = [reader.feed(text[i : i + size]) for i in range(0, len(text), size)]
        got.append(reader.finish("stop", None))
        assert "".join(r for r, _, _ in got) == "a"
        assert "".join(c for _, c, _ in got) == "Ok.\n"
        [call] = [delta["function"] for _, _, deltas in got for delta in deltas]
        assert (call["name"], json.loads(call["arguments"])) == ("f", {"n": 2})


def test_gemma4s_tool_call_ends_its_thought_and_keeps_special_tokens():
    """--reasoning-parser gemma4 --tool-call-parser gemma4, as vLLM reads Gemma 4: a call
    written in the thought (no <channel|> before it) ends the thought and is a call; the
    text is detokenized with its special tokens (<|channel>, <|"|>...), whichever parser
    reads it."""
    body = ChatCompletionRequest.model_validate(
        {
            "messages": ASK,
            "tools": TOOLS,
            "chat_template_kwargs": {"enable_thinking": True},
        }
    )
    output = body.chat_output(ChatParsers(tool_call="gemma4", reasoning="gemma4"))
    text = '<|channel>thought\nOslo, then.<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>'
    for size in (1, len(text)):
        reader = output.reader()
        got = [reader.feed(text[i : i + size]) for i in range(0, len(text), size)]
        got.append(reader.finish("stop", None))
        assert "".join(r for r, _, _ in got) == "Oslo, then."
        assert "".join(c for _, c, _ in got) == ""
        [call] = [delta["function"] for _, _, deltas in got for delta in deltas]
        assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Oslo"})
    assert output.keeps_special_tokens
    for parsers in (ChatParsers(reasoning="gemma4"), ChatParsers(tool_call="gemma4")):
        assert body.chat_output(parsers).keeps_special_tokens
    assert not body.chat_output(ChatParsers(reasoning="qwen3")).keeps_special_tokens


def test_a_named_call_cut_off_in_its_thought_is_no_call():
    """``max_tokens`` reached before ``</think>``: the choice holds no call (a stream sends
    none), not one whose arguments are no JSON; a thought that ends gives the call."""
    output = ChatOutput(True, ToolChoice("named", "f"), with_tools=True)
    cut = Choice(0, ["<think>Let me see what", " the user"], finish_reason="length")
    message = output.message(cut)
    assert message["message"]["tool_calls"] == []
    assert message["message"]["reasoning"] == "Let me see what the user"
    reader = output.reader()
    streamed = [reader.feed(piece)[2] for piece in cut.pieces]
    assert streamed + [reader.finish("length")[2]] == [[], [], []]
    ended = Choice(0, ["<think>ok</think>", '{"a": 1}'], finish_reason="stop")
    [call] = output.message(ended)["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"a": 1}


JSON = {"response_format": {"type": "json_object"}}


@pytest.mark.parametrize(
    "parser, fields, end_is_a_token, thinking",
    [
        (None, {}, True, None),
        ("qwen3", {}, False, True),
        ("qwen3", {"chat_template_kwargs": {"enable_thinking": False}}, True, False),
        ("glm45", {}, True, True),
        ("glm45", {"chat_template_kwargs": {"enable_thinking": False}}, True, False),
        ("deepseek_r1", {"chat_template_kwargs": {"enable_thinking": False}}, False, True),
        ("deepseek_r1", JSON, False, False),
        ("deepseek_r1", JSON, True, True),
        ("glm47", {"chat_template_kwargs": {"enable_thinking": False}}, True, False),
        ("glm47", {"reasoning_effort": "none"}, True, False),
        ("olmo3", {"chat_template_kwargs": {"enable_thinking": False}}, True, True),
        ("deepseek_v3", {}, True, False),
        ("deepseek_v3", {"chat_template_kwargs": {"thinking": True}}, True, True),
        ("deepseek_v3", {"chat_template_kwargs": {"enable_thinking": True}}, True, True),
        ("deepseek_v3", {"chat_template_kwargs": {"thinking": False}}, True, False),
        ("holo2", {}, True, True),
        ("holo2", {"chat_template_kwargs": {"thinking": False}}, True, False),
        (
            "holo2",
            {"chat_template_kwargs": {"thinking": False, "enable_thinking": True}},
            True,
            True,
        ),
        ("holo2", {"chat_template_kwargs": {"thinking": None}}, True, True),
        ("holo2", JSON, False, False),
        ("qwen3", {"tools": TOOLS, "tool_choice": "required"}, False, False),
        ("qwen3", {"tools": TOOLS, "tool_choice": "required"}, True, True),
        ("seed_oss", {"chat_template_kwargs": {"thinking_budget": 0}}, True, True),
        ("hunyuan_a13b", {}, True, False),  # Hunyuan writes its <think> itself
        ("ernie45", {}, False, True),
        ("gemma4", {"chat_template_kwargs": {"enable_thinking": True}}, True, False),
    ],
)
def test_which_requests_think(parser, fields, end_is_a_token, thinking):
    body = ChatCompletionRequest.model_validate({"messages": ASK, **fields})
    assert body.chat_output(ChatParsers(reasoning=parser), end_is_a_token).thinking is thinking


@pytest.fixture(scope="module")
def thinking_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model with <think> and </think> tokens in its vocabulary (in place of two
    unused ones), not special, as Qwen3's and DeepSeek-R1's are."""
    path = tmp_path_factory.mktemp("models") / "tiny-think-tokens"
    shutil.copytree(tiny_model_dir, path)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for token_id, text in THINK_TOKENS.items():
        added = next(t for t in tokenizer["added_tokens"] if t["id"] == token_id)
        del vocab[added["content"]]
        vocab[text] = token_id
        added.update(content=text, special=False)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return path


THINK_TOKENS = {15: "<think>", 16: "</think>"}


@pytest.fixture(scope="module")
def thinking_client(thinking_model_dir, template_file):
    with small_server(
        thinking_model_dir, MODEL, PARSERS, chat_template=str(template_file)
    ) as processes:
        yield openai.OpenAI(base_url=processes.info["http_address"] + "/v1", api_key="-")


@pytest.mark.parametrize("stream", [False, True])
def test_a_structured_output_holds_after_the_reasoning(thinking_client, stream):
    """Where </think> is a token, a thinking request reasons freely and its format holds
    after: biased to end its thought first, the model writes </think> (which the format
    alone forbids), then the format's one choice. Asked not to think, the format holds
    from the first token."""
    bias = {"logit_bias": {"16": 100}}
    body = {**_forced("four"), **bias}
    reasoning, content, _, finish = _chat(thinking_client, stream, extra_body=body)
    assert (reasoning or "", content, finish) == ("", "four", "stop")
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    assert _chat(thinking_client, stream, extra_body=off) == (None, "four", [], "stop")
    # Unbiased, the random model never ends its thought: all of it is reasoning.
    reasoning, content, _, finish = _chat(
        thinking_client, stream, max_tokens=8, extra_body=_forced("four")
    )
    assert reasoning and content is None and finish == "length"
