"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``, as
vLLM and SGLang serve them) over the chat machinery: the body's system prompt and turns
become a chat (tool uses as the assistant's tool calls, tool results as tool messages,
thinking blocks as the assistant's reasoning, a last assistant turn as the prefill the
answer goes on from), the chat runs as ``/v1/chat/completions`` would run it, and its
message comes back as Anthropic's content blocks: thinking, text, tool uses, whole or as
Anthropic's stream of events. Errors carry Anthropic's shape (``{"type": "error", ...}``).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag

from weir.services.gateway.chat_output import ChatOutput, MessageReader, read_output
from weir.services.gateway.openai_format import Choice
from weir.services.gateway.schemas import (
    Body,
    BodyFieldError,
    ChatCompletionRequest,
    Options,
    ReasoningEffort,
    chat_of,
    protocol_sized,
)
from weir.shared.protocol.client import StreamOutput

# Claude Code's first system block: a hash that changes with every request, which would
# defeat the prefix cache, and which no model reads (vLLM drops it too).
_BILLING_HEADER = "x-anthropic-billing-header"


class _Block(Options):
    """A content block; ``_IGNORED``: its fields that change nothing here."""

    _NEUTRAL: ClassVar[dict[str, Any]] = {}
    # Prompt caching's breakpoints: Weir's prefix cache keeps every full block anyway.
    _IGNORED: ClassVar[frozenset[str]] = frozenset({"cache_control"})
    _ACCEPTED = _IGNORED


class TextBlock(_Block):
    _IGNORED = frozenset({"cache_control", "citations"})
    _ACCEPTED = _IGNORED

    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    _IGNORED = frozenset({"cache_control", "caller"})
    _ACCEPTED = _IGNORED

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[list[TextBlock], Field(fail_fast=True)] | str = ""
    is_error: bool = False


class Base64Source(Body):
    type: Literal["base64"]  # the image itself (Anthropic's "url" sources are not fetched)
    media_type: str
    data: str


class ImageBlock(_Block):
    type: Literal["image"]
    source: Base64Source

    def part(self) -> dict[str, Any]:
        """The OpenAI chat part of the image: its data URL."""
        url = f"data:{self.source.media_type};base64,{self.source.data}"
        return {"type": "image_url", "image_url": {"url": url}}


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # Weir's are not checked: a thought comes back as it went


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


_BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")
ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ImageBlock, Tag("image")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
    Discriminator(
        lambda value: value.get("type") if isinstance(value, dict) else None,
        custom_error_type="content_block",
        custom_error_message="Input should be a content block of type "
        + ", ".join(_BLOCK_TYPES)
        + " (no documents)",
    ),
]


class InputMessage(Body):
    # "system" turns join the system prompt (vLLM takes them); Claude Code's newer
    # versions send "ctx" and "msg" turns, which are the user's (vLLM's reading).
    role: Annotated[
        Literal["user", "assistant", "system"],
        BeforeValidator(lambda role: "user" if role in ("ctx", "msg") else role),
    ]
    content: Annotated[list[ContentBlock], Field(fail_fast=True)] | str


class AnthropicTool(_Block):
    # What only Anthropic's own servers do with a tool (deferred loading, callers, examples).
    _IGNORED = frozenset(
        {
            "cache_control",
            "defer_loading",
            "allowed_callers",
            "input_examples",
            "strict",
            "eager_input_streaming",
        }
    )
    _ACCEPTED = _IGNORED

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class AnthropicToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(Body):
    type: Literal["enabled", "disabled", "adaptive"]
    # How long the model may think: not held to (vLLM's is not either); max_tokens bounds it.
    budget_tokens: Annotated[int, Field(ge=1)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(Body):
    _ACCEPTED = frozenset({"schema"})

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Body):
    effort: ReasoningEffort | None = None
    format: JsonOutputFormat | None = None


class CountTokensRequest(_Block):
    """``POST /v1/messages/count_tokens``: what a message's prompt would hold."""

    # context_management: Anthropic's server-side clearing of old tool results and thoughts
    # (Claude Code asks for it); nothing is cleared here, the prompt is computed as sent.
    _IGNORED = frozenset(
        {
            "cache_control",
            "speed",
            "inference_geo",
            "user_profile_id",
            "workspace_id",
            "context_management",
        }
    )
    _ACCEPTED = _IGNORED

    model: str
    messages: Annotated[
        list[InputMessage], Field(min_length=1, fail_fast=True), BeforeValidator(protocol_sized)
    ]
    system: Annotated[list[TextBlock], Field(fail_fast=True)] | str | None = None
    tools: Annotated[list[AnthropicTool], Field(fail_fast=True)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's, as its chats take them

    def chat_request(self) -> ChatCompletionRequest:
        """The chat this body makes; ``BodyFieldError`` names the field at fault."""
        return self._chat({})

    def _chat(self, sampling: dict[str, Any]) -> ChatCompletionRequest:
        messages = _chat_messages(self.system, self.messages)
        prefill = self.messages[-1].role == "assistant"
        if prefill and "tool_calls" in messages[-1]:
            raise BodyFieldError(
                "messages", "the last message may be an assistant's prefill of text, not tool use"
            )
        kwargs = dict(self.chat_template_kwargs or {})
        if self.thinking is not None and self.thinking.type != "adaptive":
            on = self.thinking.type == "enabled"
            # Qwen3's and GLM's switch, and DeepSeek-V3.1's (the template variables they read).
            kwargs = {"enable_thinking": on, "thinking": on, **kwargs}
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "chat_template_kwargs": kwargs or None,
            "add_generation_prompt": not prefill,
            "continue_final_message": prefill,
            **sampling,
        }
        output = self.output_config
        if output is not None and output.effort is not None:
            body["reasoning_effort"] = output.effort
        if output is not None and output.format is not None:
            schema = {"name": "output", "schema": output.format.schema_}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "parameters": tool.input_schema,
                        **({"description": tool.description} if tool.description else {}),
                    },
                }
                for tool in self.tools
            ]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool":
                if choice.name is None:
                    raise BodyFieldError("tool_choice.name", 'tool_choice "tool" names one')
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                body["tool_choice"] = _TOOL_CHOICES[choice.type]
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        return chat_of(body, _FIELD_OF_CHAT)


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``: Anthropic's body, as much of it as a served model can do."""

    _IGNORED = CountTokensRequest._IGNORED | {"metadata", "service_tier"}
    _ACCEPTED = _IGNORED

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    # Anthropic's range; its newest models take none of the three, older clients send them.
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None

    def chat_request(self) -> ChatCompletionRequest:
        return self._chat(
            {
                "max_tokens": self.max_tokens,
                "stop": self.stop_sequences,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "top_k": self.top_k,
            }
        )


_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# The chat request's fields, as the Messages body names them (for its errors).
_FIELD_OF_CHAT = {
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "reasoning_effort": "output_config.effort",
}


def _joined(blocks: list[TextBlock] | str) -> str:
    if isinstance(blocks, str):
        return blocks
    return "\n".join(block.text for block in blocks)


def _system_text(prompt: list[Any] | str) -> str:
    """A system prompt's text: its text blocks but Claude Code's billing header."""
    if isinstance(prompt, str):
        return prompt
    texts = []
    for block in prompt:
        if not isinstance(block, TextBlock):
            raise BodyFieldError("system", f"a system prompt has text blocks, not {block.type}")
        if not block.text.startswith(_BILLING_HEADER):
            texts.append(block.text)
    return "\n".join(texts)


def _chat_messages(
    system: list[TextBlock] | str | None, turns: list[InputMessage]
) -> list[dict[str, Any]]:
    """The OpenAI chat of a system prompt and Anthropic's turns: a user turn's tool results
    are tool messages (before its text, which follows them); an assistant turn's thinking is
    its reasoning and its tool uses its tool calls."""
    messages: list[dict[str, Any]] = []
    prompts = [system, *(turn.content for turn in turns if turn.role == "system")]
    texts = [_system_text(prompt) for prompt in prompts if prompt]
    if any(texts):
        messages.append({"role": "system", "content": "\n".join(text for text in texts if text)})
    for turn in turns:
        if turn.role == "system":
            continue
        if isinstance(turn.content, str):
            messages.append({"role": turn.role, "content": turn.content})
            continue
        texts, reasoning, calls, parts = [], [], [], []
        for block in turn.content:
            if isinstance(block, TextBlock):
                texts.append(block.text)
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, ImageBlock) and turn.role == "user":
                parts.append(block.part())
            elif isinstance(block, ThinkingBlock) and turn.role == "assistant":
                reasoning.append(block.thinking)
            elif isinstance(block, ToolUseBlock) and turn.role == "assistant":
                arguments = json.dumps(block.input)
                function = {"name": block.name, "arguments": arguments}
                calls.append({"id": block.id, "type": "function", "function": function})
            elif isinstance(block, ToolResultBlock) and turn.role == "user":
                result = _joined(block.content)
                # Anthropic's flag has no place in a tool message: the model reads it.
                content = f"Error: {result}" if block.is_error else result
                messages.append(
                    {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}
                )
            elif not isinstance(block, RedactedThinkingBlock):  # opaque: nothing to read
                raise BodyFieldError(
                    "messages", f"a {turn.role} message has no {block.type} blocks"
                )
        # With images, the turn's parts in their order (the model's template places them).
        message: dict[str, Any] = {
            "role": turn.role,
            "content": parts if len(parts) > len(texts) else "\n".join(texts),
        }
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        if calls:
            message["tool_calls"] = calls
        if parts or reasoning or calls or not turn.content:
            messages.append(message)
    return _combined(messages)


def _combined(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user turns as one, and consecutive assistant turns (but after a tool
    call), as Anthropic combines them: templates that want roles to alternate refuse them
    apart."""
    combined: list[dict[str, Any]] = []
    for message in messages:
        last = combined[-1] if combined else None
        if (
            last is None
            or message["role"] != last["role"]
            or last["role"] not in ("user", "assistant")
            or "tool_calls" in last
        ):
            combined.append(message)
            continue
        last["content"] = _joined_content(last["content"], message["content"])
        if "reasoning_content" in message:
            last["reasoning_content"] = (
                last.get("reasoning_content", "") + message["reasoning_content"]
            )
        if "tool_calls" in message:
            last["tool_calls"] = message["tool_calls"]
    return combined


def _joined_content(
    first: str | list[dict[str, Any]], second: str | list[dict[str, Any]]
) -> str | list[dict[str, Any]]:
    """Two turns' contents as one: texts joined by a newline, or, where either holds
    images, their parts one after the other."""
    if isinstance(first, str) and isinstance(second, str):
        return "\n".join(text for text in (first, second) if text)
    return _parts(first) + _parts(second)


def _parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(content, list):
        return content
    return [{"type": "text", "text": content}] if content else []


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _signature() -> str:
    """A thinking block's signature: Anthropic's proves its thought was the model's; Weir's
    is a placeholder that clients send back as they got it."""
    return uuid.uuid4().hex


def usage(choice: Choice) -> dict[str, Any]:
    """Anthropic's usage: the prompt's tokens read from the prefix cache apart from those
    computed (nothing is written to a cache beyond what computing does)."""
    cached = choice.num_cached_tokens or 0
    return {
        "input_tokens": choice.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": choice.completion_tokens,
    }


def stop_fields(
    finish_reason: str | None, stop_reason: str | int | None, tool_use: bool, context_full: bool
) -> dict[str, Any]:
    """A message's ``stop_reason`` and ``stop_sequence``: a stop string is a stop sequence;
    an output cut by the model's context, not by ``max_tokens``, says so; an abort
    (``/pause``) is a paused turn, which the client may send back to go on with."""
    if finish_reason == "length":
        reason = "model_context_window_exceeded" if context_full else "max_tokens"
    elif finish_reason == "abort":
        reason = "pause_turn"
    elif tool_use:
        reason = "tool_use"
    elif isinstance(stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
    else:
        reason = "end_turn"
    return {"stop_reason": reason, "stop_sequence": None}


def _tool_use(call: dict[str, Any], arguments: str) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": call["id"],
        "name": call["function"]["name"],
        "input": _input(arguments),
    }


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as Anthropic's ``input`` object; text that is none (an output cut
    in the middle of it) is kept under ``_raw`` rather than lost."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"_raw": arguments}


def whole_message(
    message_id_: str, model: str, output: ChatOutput, choice: Choice, max_model_len: int
) -> dict[str, Any]:
    """A finished choice as Anthropic's message."""
    message = output.message(choice)["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning"):
        content.append(
            {"type": "thinking", "thinking": message["reasoning"], "signature": _signature()}
        )
    if message["content"]:
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    for call in calls:
        content.append(_tool_use(call, call["function"]["arguments"]))
    full = choice.prompt_tokens + choice.completion_tokens >= max_model_len
    return {
        "id": message_id_,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        **stop_fields(choice.finish_reason, choice.stop_reason, bool(calls), full),
        "usage": usage(choice),
    }


def model_info(name: str) -> dict[str, Any]:
    """A served model as Anthropic's models API describes one."""
    # No creation date is known: the epoch's, as the OpenAI card's created is 0.
    return {"type": "model", "id": name, "display_name": name, "created_at": _EPOCH}


def model_list(names: list[str]) -> dict[str, Any]:
    """The served models as Anthropic's models API lists them: one page of all."""
    return {
        "data": [model_info(name) for name in names],
        "has_more": False,
        "first_id": names[0] if names else None,
        "last_id": names[-1] if names else None,
    }


_EPOCH = "1970-01-01T00:00:00Z"


def error_body(message: str, type_: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(type_, type_), "message": message}}


# Weir's (OpenAI's) error types that Anthropic names otherwise.
_ERROR_TYPES = {
    "server_error": "api_error",
    "service_unavailable_error": "overloaded_error",
}


def _event(type_: str, **fields: Any) -> str:
    return f"event: {type_}\ndata: {json.dumps({'type': type_, **fields})}\n\n"


class MessageEvents:
    """The server-sent events of one streamed message: ``opening`` (message_start, with the
    prompt's usage), one ``chunk`` per output (each content block started, its text,
    thought or input JSON as deltas, stopped when the next begins), and ``ending``
    (message_delta with the stop reason and usage, message_stop)."""

    def __init__(
        self, message_id_: str, model: str, output: ChatOutput, max_model_len: int
    ) -> None:
        self._id, self._model, self._max_model_len = message_id_, model, max_model_len
        self._reader: MessageReader = output.reader()
        self._output = output
        self._index = -1  # the open block's
        self._open: str | None = None  # its type
        self._tool_use = False

    def opening(self, first: list[tuple[int, list[StreamOutput]]] | None) -> bytes:
        """message_start: the prompt's usage, which the first output tells, and nothing
        generated yet (the first output's text follows as its chunk); then a ping, as
        Anthropic's streams send one."""
        choice = Choice(0)
        if first:
            out = first[0][1][0]
            choice.prompt_tokens, choice.num_cached_tokens = (
                out.prompt_tokens,
                out.num_cached_tokens,
            )
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(choice),
        }
        return (_event("message_start", message=message) + _event("ping")).encode()

    def chunk(self, out: StreamOutput, choice: Choice) -> str:
        reasoning, content, deltas = read_output(self._reader, out)
        events = []
        if reasoning and self._output.include_reasoning:
            events.append(self._write("thinking", "thinking_delta", "thinking", reasoning))
        if content:
            events.append(self._write("text", "text_delta", "text", content))
        for delta in deltas:
            events.append(self._call(delta))
        if out.finished:
            events.append(self._stop())
        return "".join(events)

    def ending(self, choices: list[Choice]) -> bytes:
        choice = choices[0]
        full = choice.prompt_tokens + choice.completion_tokens >= self._max_model_len
        delta = stop_fields(choice.finish_reason, choice.stop_reason, self._tool_use, full)
        return (
            _event("message_delta", delta=delta, usage=usage(choice)) + _event("message_stop")
        ).encode()

    @staticmethod
    def error(message: str, type_: str) -> bytes:
        return f"event: error\ndata: {json.dumps(error_body(message, type_))}\n\n".encode()

    def _start(self, block: dict[str, Any]) -> str:
        events = self._stop()
        self._index += 1
        self._open = block["type"]
        return events + _event("content_block_start", index=self._index, content_block=block)

    def _write(self, kind: str, delta_type: str, key: str, text: str) -> str:
        events = ""
        if self._open != kind:
            block: dict[str, Any] = {"type": kind, key: ""}
            if kind == "thinking":
                block["signature"] = ""
            events = self._start(block)
        return events + _event(
            "content_block_delta", index=self._index, delta={"type": delta_type, key: text}
        )

    def _call(self, delta: dict[str, Any]) -> str:
        """A chat tool-call delta: a new call (it has an id), or more of its arguments."""
        events = ""
        if "id" in delta:
            self._tool_use = True
            block = {
                "type": "tool_use",
                "id": delta["id"],
                "name": delta["function"]["name"],
                "input": {},
            }
            events = self._start(block)
        arguments = delta.get("function", {}).get("arguments", "")
        if not arguments:
            return events
        return events + _event(
            "content_block_delta",
            index=self._index,
            delta={"type": "input_json_delta", "partial_json": arguments},
        )

    def _stop(self) -> str:
        if self._open is None:
            return ""
        events = ""
        if self._open == "thinking":
            delta = {"type": "signature_delta", "signature": _signature()}
            events = _event("content_block_delta", index=self._index, delta=delta)
        self._open = None
        return events + _event("content_block_stop", index=self._index)
