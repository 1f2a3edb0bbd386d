"""A chat choice's message read out of its text: reasoning (a reasoning parser's), content
and tool calls, whole or as the text streams; the same readers do both, so a stream's
deltas add up to the whole response's message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from weir.services.gateway.harmony import HarmonyReader
from weir.services.gateway.json_calls import ToolCall, ToolCallReader
from weir.services.gateway.openai_format import Choice, ChunkEvents
from weir.services.gateway.reasoning import REASONING_PARSERS, Markers, ReasoningReader
from weir.services.gateway.tool_calls import TOOL_CALL_PARSERS, ToolChoice
from weir.shared.protocol.client import StreamOutput

# The parsers of gpt-oss' harmony format (`harmony.py`): either reads the whole message.
HARMONY_PARSERS = ("openai_gptoss", "openai")

# The tool-call parsers whose formats mark calls with special tokens.
_SPECIAL_TOKEN_CALLS = (
    "mistral",
    "deepseek_v3",
    "deepseek_v31",
    "kimi_k2",
    "granite",
    "functiongemma",
    "gemma4",
)


@dataclass(frozen=True, slots=True)
class ChatParsers:
    """What the gateway reads out of a model's text, in the model's own format (vLLM's
    ``--tool-call-parser`` and ``--reasoning-parser``)."""

    tool_call: str | None = None  # TOOL_CALL_PARSERS: the calls under tool_choice "auto"
    reasoning: str | None = None  # REASONING_PARSERS: the reasoning before the answer

    def __post_init__(self) -> None:
        for flag, name, names in (
            ("--tool-call-parser", self.tool_call, TOOL_CALL_PARSERS),
            ("--reasoning-parser", self.reasoning, REASONING_PARSERS),
        ):
            if name is not None and name not in names:
                raise ValueError(f"{flag} {name!r}: expected one of {', '.join(names)}")

    @property
    def harmony(self) -> bool:
        """Whether the model writes the harmony format (gpt-oss), read whole by one reader."""
        return self.reasoning in HARMONY_PARSERS or self.tool_call in HARMONY_PARSERS

    def argv(self) -> list[str]:
        """The gateway's flags that give these parsers."""
        argv = []
        if self.tool_call is not None:
            argv += ["--tool-call-parser", self.tool_call]
        if self.reasoning is not None:
            argv += ["--reasoning-parser", self.reasoning]
        return argv


NO_PARSERS = ChatParsers()


class MessageReader(Protocol):
    """One choice's text, piece by piece: per piece the reasoning, content and tool-call
    deltas it completes. ``reasoned``: None where no reasoning is read, else whether the
    text held some; ``calls``: None where no calls are read, else those read so far."""

    @property
    def reasoned(self) -> bool | None: ...

    @property
    def calls(self) -> list[ToolCall] | None: ...

    def feed(self, text: str) -> tuple[str, str, list[dict[str, Any]]]: ...

    def finish(
        self, finish_reason: str | None, stop_reason: int | str | None = None
    ) -> tuple[str, str, list[dict[str, Any]]]: ...


def read_output(reader: MessageReader, out: StreamOutput) -> tuple[str, str, list[dict[str, Any]]]:
    """The reasoning, content and tool-call deltas that one output completes, with what was
    held back where it is the last."""
    reasoning, content, deltas = reader.feed(out.text)
    if out.finished:
        more_reasoning, rest, more = reader.finish(out.finish_reason, out.stop_reason)
        reasoning, content, deltas = reasoning + more_reasoning, content + rest, deltas + more
    return reasoning, content, deltas


class ChoiceReader:
    """One choice's text, piece by piece: its reasoning first, then its content, out of
    which the tool-call reader takes the calls."""

    def __init__(self, reasoning: ReasoningReader | None, tools: ToolCallReader | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def reasoned(self) -> bool | None:
        return None if self.reasoning is None else self.reasoning.reasoned

    @property
    def calls(self) -> list[ToolCall] | None:
        return None if self.tools is None else self.tools.calls

    def feed(self, text: str) -> tuple[str, str, list[dict[str, Any]]]:
        """The reasoning, content and tool-call deltas that ``text`` completes."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if self.tools is None:
            return reasoning, content, []
        content, deltas = self.tools.feed(content)
        return reasoning, content, deltas

    def finish(
        self, finish_reason: str | None, stop_reason: int | str | None = None
    ) -> tuple[str, str, list[dict[str, Any]]]:
        """What was held back, at the end of the output (however it ended)."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        if self.tools is None:
            return reasoning, content, []
        content, deltas = self.tools.feed(content)
        rest, more = self.tools.finish()
        return reasoning, content + rest, deltas + more


@dataclass(frozen=True, slots=True)
class ChatOutput:
    """How a chat request's choices are read: ``thinking`` None without a reasoning parser,
    else whether the request thinks (``ReasoningReader``); ``tool_choice`` None without
    tools (or with ``"none"``)."""

    thinking: bool | None
    tool_choice: ToolChoice | None
    include_reasoning: bool = True
    with_tools: bool = False  # a request with tools lists its calls, maybe none
    harmony: bool = False  # read as gpt-oss' harmony format (HarmonyReader)
    # The reasoning's opening and closing markers (the reasoning parser's).
    reasoning_markers: Markers = Markers()
    role: str = "assistant"  # the message's

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the text is detokenized with the special tokens its format marks with:
        harmony's, reasoning markers that are special tokens (Mistral's ``[THINK]``, Gemma
        4's ``<|channel>``), Mistral's ``[TOOL_CALLS]``, DeepSeek's, Kimi K2's, Granite's,
        FunctionGemma's and Gemma 4's tool-call markers (as vLLM's parsers ask)."""
        tool_choice = self.tool_choice
        return (
            self.harmony
            or (self.thinking is not None and self.reasoning_markers.special)
            or (
                tool_choice is not None
                and tool_choice.kind == "auto"
                and tool_choice.parser in _SPECIAL_TOKEN_CALLS
            )
        )

    @property
    def plain(self) -> bool:
        """Whether the text is all content."""
        return self.thinking is None and self.tool_choice is None and not self.harmony

    def reader(self) -> MessageReader:
        if self.harmony:
            auto = self.tool_choice is not None and self.tool_choice.kind == "auto"
            return HarmonyReader(read_calls=auto)
        return ChoiceReader(
            None
            if self.thinking is None
            else ReasoningReader(self.thinking, self.reasoning_markers),
            None if self.tool_choice is None else self.tool_choice.reader(),
        )

    def message(self, choice: Choice) -> dict[str, Any]:
        """A whole choice's message and finish reason."""
        if self.plain:  # all content, "" too (null content stands for calls)
            message: dict[str, Any] = {"role": self.role, "content": choice.text}
            if self.with_tools:
                message["tool_calls"] = []
            return {"message": message, "finish_reason": choice.finish_reason}
        reader = self.reader()
        reasoning, content, _ = reader.feed(choice.text)
        more_reasoning, rest, _ = reader.finish(choice.finish_reason, choice.stop_reason)
        message = {"role": self.role, "content": (content + rest) or None}
        if reader.reasoned is not None:
            # An empty thought is none, as a stream (which sends no empty delta) has it.
            reasoned = reader.reasoned and self.include_reasoning
            message["reasoning"] = message["reasoning_content"] = (
                (reasoning + more_reasoning or None) if reasoned else None
            )
        finish_reason = choice.finish_reason
        calls = reader.calls
        if calls is not None:
            assert self.tool_choice is not None
            message["tool_calls"] = [call.to_dict() for call in calls]
            finish_reason = self.tool_choice.finish_reason(calls, finish_reason)
        elif self.with_tools:
            message["tool_calls"] = []
        return {"message": message, "finish_reason": finish_reason}


class ChatChunks:
    """The chat chunks of a streamed response whose text is read (reasoning, tool calls):
    each delta holds what each choice's reader found in it."""

    def __init__(self, events: ChunkEvents, output: ChatOutput) -> None:
        self._events = events
        self._output = output
        self._readers: dict[int, MessageReader] = {}

    def chat(self, out: StreamOutput, choice: Choice) -> str:
        reader = self._readers.get(choice.index)
        if reader is None:
            reader = self._readers[choice.index] = self._output.reader()
        reasoning, content, deltas = read_output(reader, out)
        finish_reason = None
        if out.finished:
            finish_reason = out.finish_reason
            calls = reader.calls
            if calls is not None:
                assert self._output.tool_choice is not None
                finish_reason = self._output.tool_choice.finish_reason(calls, finish_reason)
        if not self._output.include_reasoning:
            reasoning = ""
        if not (
            reasoning
            or content
            or deltas
            or out.finished
            or out.logprobs is not None
            or (self._events.token_ids and out.new_token_ids)
        ):
            return ""  # text held back (a tag's start, a call's unfinished object)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if deltas:
            delta["tool_calls"] = deltas
        return self._events.chat_delta(choice.index, delta, out, finish_reason)
