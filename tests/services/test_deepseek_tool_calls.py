"""`--tool-call-parser deepseek_v3` (and `deepseek_v31`, and `kimi_k2`) through the official
`openai` client, in front of a real `weir serve` of a tiny random Llama with SmolLM2's
tokenizer and DeepSeek's and Kimi K2's tool-call markers as special tokens: V3's and R1's
calls (`function<｜tool▁sep｜>NAME` and a fenced JSON block) and V3.1's
(`NAME<｜tool▁sep｜>{...}`) are calls, whole and streamed; a call cut short is content after
the calls before it; Kimi K2's calls keep their `functions.NAME:N` ids. Outputs are forced
by a choice constraint; the readers are also checked fed in pieces of every size."""

import openai
import pytest
from conftest import save_with_markers
from serving_helpers import read_chat, small_server
from test_tool_calls import read_in_pieces

from weir.services.gateway.chat_output import ChatParsers
from weir.services.gateway.marked_calls import DeepSeekReader, KimiK2Reader
from weir.services.launcher import GatewayProcess

transformers = pytest.importorskip("transformers")

MODEL = "tiny-deepseek-tools"
BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
KIMI = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_end|>",
    "<|tool_call_argument_begin|>",
)
MARKERS = [BEGIN, END, CALL, CALL_END, SEP, *KIMI]
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
V3 = (
    f"Checking.{BEGIN}{CALL}function{SEP}get_weather\n```json\n"
    + '{"city": "Oslo"}'
    + f"\n```{CALL_END}{CALL}function{SEP}get_time\n```json\n"
    + "{}"
    + f"\n```{CALL_END}{END}"
)
V31 = f'{BEGIN}{CALL}get_weather{SEP}{{"city": "Oslo"}}{CALL_END}{CALL}get_time{SEP}{{}}{CALL_END}{END}'
BOTH = [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]


@pytest.fixture(scope="module")
def client(tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp("models") / MODEL
    bias = save_with_markers(path, default_model_dir, MARKERS)
    with small_server(path, MODEL, ChatParsers(tool_call="deepseek_v3")) as processes:
        client = openai.OpenAI(base_url=processes.info["http_address"] + "/v1", api_key="unused")
        client.bias = bias  # type: ignore[attr-defined]
        client.address = processes.client_address  # type: ignore[attr-defined]
        yield client


def _chat(client, stream: bool, text: str, **kwargs):
    body = {"structured_outputs": {"choice": [text]}, "logit_bias": client.bias}
    kwargs = {"model": MODEL, "messages": ASK, "max_tokens": 300, "extra_body": body, **kwargs}
    return read_chat(client, stream, **kwargs)[1:]


@pytest.mark.parametrize("stream", [False, True])
def test_deepseek_calls_are_read_in_both_forms(client, stream):
    assert _chat(client, stream, V3, tools=TOOLS) == ("Checking.", BOTH, "tool_calls")
    assert _chat(client, stream, V31, tools=TOOLS) == (None, BOTH, "tool_calls")
    # Without tools the text is content, its special tokens skipped as any others.
    plain = 'get_weather{"city": "Oslo"}get_time{}'
    assert _chat(client, stream, V31) == (plain, [], "stop")


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_a_deepseek_output_streamed_in_any_pieces_reads_as_it_does_whole(step):
    def read(text: str):
        return read_in_pieces(DeepSeekReader(), text, step)

    assert read(V3) == ("Checking.", BOTH)
    assert read(V31) == ("", BOTH)
    # A later call cut short (max_tokens): the calls before it, as vLLM reads them.
    cut = V31[: V31.rindex(CALL_END)]
    assert read(cut) == ("", BOTH[:1])
    broken = f"{BEGIN}{CALL}get_weather{SEP}{{city: Oslo}}{CALL_END}"
    assert read(broken) == (broken, [])
    assert read(f"{BEGIN}{CALL}{SEP}{{}}{CALL_END}")[1] == []  # no name: no call
    assert read("No calls <｜tool") == ("No calls <｜tool", [])


def test_kimi_k2_calls_are_read_with_their_ids(client):
    """Kimi's chat template writes each call's id (functions.NAME:N) back in the call and
    in the tool's answer: the id is the model's text, not one of Weir's."""
    k_begin, k_end, k_call, k_call_end, k_args = KIMI
    text = (
        f"Checking.{k_begin}{k_call}functions.get_weather:0{k_args}"
        + '{"city": "Oslo"}'
        + f"{k_call_end}{k_call}functions.get_time:1{k_args}{{}}{k_call_end}{k_end}"
    )
    body = {"structured_outputs": {"choice": [text]}, "logit_bias": client.bias}
    with GatewayProcess([client.address], parsers=ChatParsers(tool_call="kimi_k2")) as gateway:
        kimi = openai.OpenAI(base_url=gateway.info["http_address"] + "/v1", api_key="-")
        kwargs = {"model": MODEL, "messages": ASK, "max_tokens": 300, "extra_body": body}
        for stream in (False, True):
            got = read_chat(kimi, stream, tools=TOOLS, **kwargs)[1:]
            assert got == ("Checking.", BOTH, "tool_calls")
        [choice] = kimi.chat.completions.create(tools=TOOLS, **kwargs).choices
        ids = [call.id for call in choice.message.tool_calls]
        assert ids == ["functions.get_weather:0", "functions.get_time:1"]
    for step in (1, 7, 1000):
        assert read_in_pieces(KimiK2Reader(), text, step) == ("Checking.", BOTH)
        cut = text[: text.rindex(k_call_end)]  # the last call cut short: passed over
        assert read_in_pieces(KimiK2Reader(), cut, step) == ("Checking.", BOTH[:1])


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_the_content_is_the_text_before_the_calls_and_bad_blocks_are_passed_over(step):
    """As vLLM's parsers (test_extract_tool_calls_with_multiple_tools): the section's end
    marker and any text after it are not content; a block that is no call does not drop
    the calls after it."""
    bad = f"{CALL}bad{SEP}{{x: 1}}{CALL_END}"
    text = f"some prefix text{BEGIN}{V31[len(BEGIN) :]} some suffix text"
    text = text.replace(CALL, bad + CALL, 1)
    assert read_in_pieces(DeepSeekReader(), text, step) == ("some prefix text", BOTH)


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_a_bad_kimi_k2_call_keeps_the_others_and_no_marker_is_content(step):
    """vLLM's test_invalid_json_still_extracted and test_invalid_funcall_id_skipped: arguments
    that are no JSON are kept as written, a call whose id is not NAME:N is none, and the
    calls after either are read; the content is the text before the section."""
    k_begin, k_end, k_call, k_call_end, k_args = KIMI

    def call(call_id: str, arguments: str) -> str:
        return f"{k_call}{call_id} {k_args}{arguments}{k_call_end}"

    text = (
        f"Help. {k_begin}"
        + call("functions.bad:0", '{"city": "Oslo"')
        + call("functions.invalid.1", '{"city": "Oslo"}')
        + call("functions.get_weather:2", '{"city": "Oslo"}')
        + f"{k_end} Done."
    )
    assert read_in_pieces(KimiK2Reader(), text, step) == (
        "Help. ",
        [("bad", '{"city": "Oslo"'), BOTH[0]],
    )
