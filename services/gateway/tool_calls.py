"""OpenAI's tool calls over the chat API: the output each ``tool_choice`` holds the model to,
and the calls read back out of its text, whole or as it streams.

* a named function: the output is that function's arguments, a JSON object of its
  parameters' schema (a structured output);
* ``required``: a JSON array of one or more ``{"name", "parameters"}`` objects, one per call
  (a structured output, vLLM's);
* ``auto``: free text in which the model's own format marks its calls; the parser the
  gateway was started with finds them. ``hermes``: ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, as Qwen2.5, Qwen3 and Hermes models write them; ``llama3_json``:
  an output that is ``{"name": ..., "parameters": {...}}`` objects, as Llama 3.1-3.3 write;
  ``pythonic``: an output that is a Python list of calls, ``[f(a=1), g(b="x")]``, as Llama 3.2
  and 4 write (vLLM's parser of the name); ``qwen3_coder``: Qwen3-Coder's ``<tool_call>
  <function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`` blocks, each
  value read by its parameter's type in the tool's schema (the format's tags in it text, as
  vLLM's parser tells them); ``mistral``: Mistral's
  ``[TOOL_CALLS]`` and a JSON array of calls (its tokenizers before v11) or ``NAME[ARGS]{...}``
  per ``[TOOL_CALLS]`` (v11 on); ``glm45``: GLM-4.5's to 4.7's ``<tool_call>NAME<arg_key>KEY
  </arg_key><arg_value>VALUE</arg_value>...</tool_call>`` blocks; ``openai``: gpt-oss'
  harmony messages (read whole by ``harmony.py``); ``deepseek_v3`` and ``deepseek_v31``:
  DeepSeek's ``<｜tool▁calls▁begin｜>`` calls, V3's and R1's (``function<｜tool▁sep｜>NAME``
  and a fenced JSON block) and V3.1's (``NAME<｜tool▁sep｜>{...}``), either read by both;
  ``kimi_k2``: Kimi K2's ``<|tool_calls_section_begin|>`` calls, ``functions.NAME:N`` (its
  call id) then ``<|tool_call_argument_begin|>{...}``; ``minimax_m2``: MiniMax-M2's ``<minimax:tool_call>`` blocks of one or more ``<invoke
  name="NAME">`` and their ``<parameter name="KEY">VALUE</parameter>``s, read as
  qwen3_coder's; ``granite``: Granite 3's ``<|tool_call|>`` (or 3.0's ``<tool_call>``) and a
  JSON array of ``{"name", "arguments"}`` objects, the whole output; ``phi4_mini_json``:
  Phi-4-mini's ``functools[{"name": ..., "arguments": {...}}, ...]``; ``xlam``: xLAM's JSON
  array of calls, the whole output or in a ```json fence, a ``[TOOL_CALLS]`` line or a
  ``<tool_call>`` block; ``olmo3``: OLMo 3's ``<function_calls>`` blocks, one Python call a
  line, ``f(a=1)``, its values Python's or JSON's literals (``true``, ``null``);
  ``seed_oss``: Seed-OSS' ``<seed:tool_call>`` blocks of qwen3_coder's ``<function=NAME>``,
  read as its (a ``<seed:think>`` thought left in the content holds none); ``hunyuan_a13b``: Hunyuan's ``<tool_calls>`` block of a JSON array of
  ``{"name": ..., "arguments": {...}}`` calls; ``ernie45``: ERNIE 4.5's ``<tool_call>``
  blocks, read as hermes'; ``functiongemma``: FunctionGemma's ``<start_function_call>call:NAME
  {KEY:VALUE,...}<end_function_call>``, a string value between ``<escape>`` tokens, others
  bare; ``gemma4``: Gemma 4's ``<|tool_call>call:NAME{KEY:VALUE,...}<tool_call|>``, the same
  notation with its strings between ``<|"|>`` tokens. ``qwen3_xml`` and ``glm47`` are vLLM's
  other names of qwen3_coder and glm45.

A reader takes a choice's text as it streams and returns, per piece, the content to send
and the tool-call deltas (OpenAI's chunk form); reading the whole text at once gives what
the streamed deltas add up to. This module holds the parsers' names and which reader each
choice takes (``ToolChoice.reader``); the readers, by the shape of the text they read:
``json_calls.py`` (the call itself, named and required choices' JSON, llama3_json),
``tagged_calls.py`` (blocks between tags: hermes, qwen3_coder, seed_oss, hunyuan_a13b, ernie45,
olmo3's blocks, glm45, minimax_m2, functiongemma, gemma4), ``list_calls.py`` (an output that
is a list of calls: pythonic, granite, olmo3's lines), ``marked_calls.py`` (calls after a
marker: mistral, phi4_mini_json, xlam, deepseek_v3, kimi_k2).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Literal

from weir.services.gateway.json_calls import (
    JsonCallReader,
    Llama3JsonReader,
    NamedCallReader,
    ToolCall,
    ToolCallReader,
)
from weir.services.gateway.list_calls import GraniteReader, PythonicReader, olmo3_calls
from weir.services.gateway.marked_calls import (
    DeepSeekReader,
    KimiK2Reader,
    MistralReader,
    Phi4MiniReader,
    XlamReader,
)
from weir.services.gateway.tagged_calls import (
    AfterThought,
    HermesReader,
    functiongemma_call,
    gemma4_call,
    glm_call,
    hunyuan_calls,
    minimax_calls,
    xml_call,
)

TOOL_CALL_PARSERS = (
    "hermes",
    "llama3_json",
    "pythonic",
    "qwen3_coder",
    "qwen3_xml",
    "mistral",
    "glm45",
    "glm47",
    "deepseek_v3",
    "deepseek_v31",
    "minimax_m2",
    "kimi_k2",
    "granite",
    "phi4_mini_json",
    "xlam",
    "olmo3",
    "seed_oss",
    "hunyuan_a13b",
    "ernie45",
    "functiongemma",
    "gemma4",
    "openai",
)


ToolChoiceKind = Literal["named", "required", "auto"]


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """How a chat request's output holds tool calls."""

    kind: ToolChoiceKind
    name: str | None = None  # the named function's
    parser: str | None = None  # auto's: one of TOOL_CALL_PARSERS (None: the server has none)
    # Each tool's parameters' schemas by name, which qwen3_coder (seed_oss, minimax_m2),
    # glm45 and functiongemma read values by.
    properties: dict[str, Any] = field(default_factory=dict)

    def reader(self) -> ToolCallReader:
        if self.kind == "named":
            assert self.name is not None
            return NamedCallReader(self.name)
        if self.kind == "required":
            return JsonCallReader(2)
        if self.parser in ("hermes", "ernie45"):
            return HermesReader()
        if self.parser in ("qwen3_coder", "qwen3_xml"):
            return self._xml_reader(("<tool_call>", "</tool_call>"))
        if self.parser == "seed_oss":
            calls = self._xml_reader(("<seed:tool_call>", "</seed:tool_call>"))
            return AfterThought(calls, "<seed:think>", "</seed:think>")
        if self.parser == "hunyuan_a13b":
            return HermesReader(hunyuan_calls, ("<tool_calls>", "</tool_calls>"))
        if self.parser in ("glm45", "glm47"):
            return HermesReader(functools.partial(glm_call, self.properties))
        if self.parser == "olmo3":
            return HermesReader(olmo3_calls, ("<function_calls>", "</function_calls>"))
        if self.parser == "functiongemma":
            tags = ("<start_function_call>", "<end_function_call>")
            return HermesReader(functools.partial(functiongemma_call, self.properties), tags)
        if self.parser == "gemma4":
            return HermesReader(gemma4_call, ("<|tool_call>", "<tool_call|>"))
        if self.parser == "minimax_m2":
            tags = ("<minimax:tool_call>", "</minimax:tool_call>")
            return HermesReader(functools.partial(minimax_calls, self.properties), tags)
        if self.parser == "mistral":
            return MistralReader()
        if self.parser in ("deepseek_v3", "deepseek_v31"):
            return DeepSeekReader()
        if self.parser == "kimi_k2":
            return KimiK2Reader()
        if self.parser == "granite":
            return GraniteReader()
        if self.parser == "phi4_mini_json":
            return Phi4MiniReader()
        if self.parser == "xlam":
            return XlamReader()
        return PythonicReader() if self.parser == "pythonic" else Llama3JsonReader()

    def _xml_reader(self, tags: tuple[str, str]) -> HermesReader:
        """Qwen3-Coder's blocks in ``tags``."""
        return HermesReader(functools.partial(xml_call, self.properties), tags, nested=True)

    def finish_reason(self, calls: list[ToolCall], reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (not when a named function
        was forced), unless the output was cut short."""
        if reason == "stop" and calls and self.kind != "named":
            return "tool_calls"
        return reason
