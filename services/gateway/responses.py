"""OpenAI's Responses API (``POST /v1/responses``) over the chat machinery: the body's
``input`` items become a chat (instructions as its system message, function calls and their
outputs as the assistant's tool calls and tool messages, reasoning items as the assistant's
earlier reasoning), the chat runs as ``/v1/chat/completions`` would run it, and each
choice's message comes back as output items: reasoning, message, function calls, whole or
as the Responses API's stream of events. A response is stored unless ``store`` is false
(`response_store.py`): ``previous_response_id`` continues its conversation.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    model_validator,
)

from weir.services.gateway.chat_output import ChatOutput, MessageReader, read_output
from weir.services.gateway.openai_format import Choice
from weir.services.gateway.schemas import (
    Body,
    BodyFieldError,
    ChatCompletionRequest,
    Options,
    ReasoningEffort,
    chat_of,
    field_errors,
    protocol_sized,
)
from weir.shared.protocol.client import StreamOutput


class TextContent(Body):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an output_text's, sent back as it came
    logprobs: list[Any] | None = None


class ImageContent(Body):
    type: Literal["input_image"]
    image_url: str  # a data URL (file ids are OpenAI's storage)
    detail: Literal["auto", "low", "high"] | None = None


ItemText = (
    Annotated[
        list[Annotated[TextContent | ImageContent, Field(discriminator="type")]],
        Field(fail_fast=True),
    ]
    | str
)


def _text(content: ItemText) -> str:
    """The text of content that holds no images (a user message's may: ``_content``)."""
    if isinstance(content, str):
        return content
    if any(isinstance(part, ImageContent) for part in content):
        raise BodyFieldError("input", "input_image parts are read in user messages only")
    return "".join(part.text for part in content if isinstance(part, TextContent))


def _content(content: ItemText) -> str | list[dict[str, Any]]:
    """A message's text, or where it holds images its parts as OpenAI's chat parts."""
    if isinstance(content, str) or not any(isinstance(p, ImageContent) for p in content):
        return _text(content)
    return [
        {"type": "text", "text": part.text}
        if isinstance(part, TextContent)
        else {"type": "image_url", "image_url": {"url": part.image_url}}
        for part in content
    ]


class _ReturnedItem(Options):
    """An item as the openai SDK sends back its own output: its newer fields, null."""

    _NEUTRAL: ClassVar[dict[str, Any]] = {
        "async": None,
        "caller": None,
        "namespace": None,
        "phase": None,
    }
    _IGNORED: ClassVar[frozenset[str]] = frozenset()
    _ACCEPTED = frozenset(_NEUTRAL)


class MessageItem(_ReturnedItem):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: ItemText
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_ReturnedItem):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: str
    output: ItemText
    id: str | None = None
    status: str | None = None


class ReasoningText(Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Body):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    id: str | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    # A message may leave its type out (OpenAI's "easy" input message).
    Discriminator(
        lambda value: value.get("type", "message") if isinstance(value, dict) else None,
        custom_error_type="input_item",
        custom_error_message="Input should be a message, function_call, function_call_output "
        "or reasoning item",
    ),
]


_INPUT_ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[InputItem])


class FunctionTool(Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    _ACCEPTED = frozenset({"schema"})

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one a model without it has


class ReasoningOptions(Body):
    """OpenAI's reasoning options: the effort is the chat's ``reasoning_effort`` (the template
    variable gpt-oss' reads); a summary is not written (null, as agents send it unset)."""

    effort: ReasoningEffort | None = None
    summary: None = None
    generate_summary: None = None


class ResponsesRequest(Options):
    """``POST /v1/responses``: OpenAI's body, as much of it as a served model can do."""

    # Fields that change nothing at the values given, and fields that never do.
    _NEUTRAL: ClassVar[dict[str, Any]] = {
        "truncation": "disabled",
        "background": False,
        "include": [],
    }
    _IGNORED: ClassVar[frozenset[str]] = frozenset(
        {
            "metadata",
            "user",
            "service_tier",
            "prompt_cache_key",
            "prompt_cache_retention",
            "safety_identifier",
        }
    )
    _ACCEPTED = frozenset(_NEUTRAL) | _IGNORED

    model: str | None = None
    input: Annotated[list[InputItem], Field(fail_fast=True), BeforeValidator(protocol_sized)] | str
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    # None: the server's default (--generation-config), as a chat's.
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    tools: Annotated[list[FunctionTool], Field(fail_fast=True)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningOptions | None = None
    store: bool = True
    previous_response_id: str | None = None

    @model_validator(mode="after")
    def _input_not_empty(self) -> ResponsesRequest:
        if not self.input:
            raise field_errors(type(self).__name__, [("input", None, "must not be empty")])
        return self

    def input_items(self) -> list[dict[str, Any]]:
        """The input as items (a text as the user's message), as a response stores them."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(by_alias=True, exclude_none=True) for item in self.input]

    def continued(self, items: list[dict[str, Any]]) -> ResponsesRequest:
        """This request with ``items`` (a stored conversation's) before its input."""
        mine = (
            [MessageItem(role="user", content=self.input)]
            if isinstance(self.input, str)
            else self.input
        )
        return self.model_copy(update={"input": [*_INPUT_ITEMS.validate_python(items), *mine]})

    def messages(self) -> list[dict[str, Any]]:
        """The chat the input items make (OpenAI's chat messages)."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        items = (
            [MessageItem(role="user", content=self.input)]
            if isinstance(self.input, str)
            else self.input
        )
        reasoning: str | None = None  # a reasoning item's, for the assistant turn after it
        for item in items:
            if isinstance(item, ReasoningItem):
                reasoning = "".join(part.text for part in item.content or item.summary)
                continue
            if reasoning is not None and (
                isinstance(item, FunctionCallOutputItem)
                or (isinstance(item, MessageItem) and item.role != "assistant")
            ):  # a thought that nothing followed: its own assistant turn
                messages.append(
                    {"role": "assistant", "content": "", "reasoning_content": reasoning}
                )
                reasoning = None
            if isinstance(item, MessageItem) and item.role != "assistant":
                messages.append({"role": item.role, "content": _content(item.content)})
            elif isinstance(item, FunctionCallOutputItem):
                output = _text(item.output)
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
            else:
                last = messages[-1] if messages else None
                # The calls an assistant turn makes join its message (agents send them apart).
                if (
                    isinstance(item, FunctionCallItem)
                    and last is not None
                    and last["role"] == "assistant"
                    and reasoning is None
                ):
                    turn = last
                else:
                    turn = {"role": "assistant", "content": None}
                    messages.append(turn)
                if reasoning is not None:
                    turn["reasoning_content"], reasoning = reasoning, None
                if isinstance(item, MessageItem):
                    turn["content"] = (turn["content"] or "") + _text(item.content)
                else:
                    call = {
                        "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments},
                    }
                    turn.setdefault("tool_calls", []).append({"id": item.call_id, **call})
        if reasoning is not None:
            messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
        return messages

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this response runs; ``BodyFieldError`` names a field of this
        body."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
        }
        if self.tools is not None:
            body["tools"] = [
                {
                    "type": "function",
                    "function": tool.model_dump(exclude={"type"}, exclude_none=True),
                }
                for tool in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tools is not None or self.tool_choice != "auto":  # Responses' default alone
            body["tool_choice"] = self.tool_choice
        format_ = self.text.format if self.text is not None else None
        if format_ is not None and format_.type == "json_schema":
            schema = {
                "name": format_.name,
                "schema": format_.schema_ or {},
                "strict": format_.strict,
            }
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif format_ is not None:
            body["response_format"] = {"type": format_.type}
        return chat_of(body, _FIELD_OF_CHAT)

    def echo(self) -> dict[str, Any]:
        """The request's settings, as a response repeats them."""
        format_ = self.text.format if self.text is not None else None
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tool_choice": (
                self.tool_choice.model_dump()
                if isinstance(self.tool_choice, NamedFunctionChoice)
                else self.tool_choice or "auto"
            ),
            "tools": [tool.model_dump() for tool in self.tools or ()],
            "store": self.store,
            "previous_response_id": self.previous_response_id,
            "reasoning": {
                "effort": self.reasoning.effort if self.reasoning else None,
                "summary": None,
            },
            "text": {
                "format": {"type": "text"}
                if format_ is None
                else format_.model_dump(by_alias=True, exclude_none=True)
            },
        }


# The chat request's fields, as the Responses body names them (for its errors).
_FIELD_OF_CHAT = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_body(request: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """A response's fields before its output (status "in_progress")."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "output": [],
        "usage": None,
        **request.echo(),
    }


def _finished(body: dict[str, Any], items: list[dict[str, Any]], choice: Choice) -> dict[str, Any]:
    """The response whole: its output items, status and usage."""
    cut = choice.finish_reason == "length"
    # Aborted (`/pause?mode=abort`): cut short by the server, not an answer to rely on.
    status = "cancelled" if choice.finish_reason == "abort" else "completed"
    return {
        **body,
        "status": "incomplete" if cut else status,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": items,
        "usage": {
            "input_tokens": choice.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": choice.num_cached_tokens or 0,
                "cache_write_tokens": 0,  # prefix caching writes as it computes: nothing extra
            },
            "output_tokens": choice.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": choice.prompt_tokens + choice.completion_tokens,
        },
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [_output_text(text)]
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call: dict[str, Any], arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": arguments,
        "status": status,
    }


def whole_response(body: dict[str, Any], output: ChatOutput, choice: Choice) -> dict[str, Any]:
    """A finished choice as a response: its reasoning, text and calls as output items (the
    last ``incomplete`` where ``max_output_tokens`` or an abort cut it)."""
    message = output.message(choice)["message"]
    items = []
    if message.get("reasoning") is not None:
        items.append(_reasoning_item(_id("rs"), message["reasoning"], "completed"))
    calls = message.get("tool_calls") or []
    if message["content"] or (not items and not calls):  # an empty answer: an empty message
        items.append(_message_item(_id("msg"), message["content"] or "", "completed"))
    for call in calls:
        items.append(_call_item(_id("fc"), call, call["function"]["arguments"], "completed"))
    if items:
        items[-1]["status"] = _last_item_status(choice.finish_reason)
    return _finished(body, items, choice)


def _last_item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason in ("length", "abort") else "completed"


class ResponseEvents:
    """The server-sent events of one streamed response: ``opening`` (created, in progress),
    one ``chunk`` per output of its choice (each output item opened, its text or arguments
    as deltas, closed when the next begins), and ``ending`` (completed, or incomplete: cut
    by ``max_output_tokens``, or cancelled)."""

    def __init__(self, body: dict[str, Any], output: ChatOutput) -> None:
        self._body = body
        self._reader: MessageReader = output.reader()
        self._sequence = 0
        self._items: list[dict[str, Any]] = []  # closed output items
        self._open: dict[str, Any] | None = None  # the item being written
        self._text: list[str] = []  # the open item's text or arguments so far
        self.response: dict[str, Any] | None = None  # the whole response, once it ended

    def opening(self) -> bytes:
        return (
            self._event("response.created", response=self._body)
            + self._event("response.in_progress", response=self._body)
        ).encode()

    def chunk(self, out: StreamOutput, choice: Choice) -> str:
        reasoning, content, deltas = read_output(self._reader, out)
        events = []
        if reasoning:
            events.append(self._write("reasoning", reasoning))
        if content:
            events.append(self._write("message", content))
        for delta in deltas:
            events.append(self._call(delta))
        if out.finished:
            if self._open is None and not self._items:  # an empty answer is an empty message
                events.append(self._begin("message", {}))
            events.append(self._close(_last_item_status(out.finish_reason)))
        return "".join(events)

    def ending(self, choices: list[Choice]) -> bytes:
        self.response = response = _finished(self._body, self._items, choices[0])
        # The events know no cancellation: a cancelled response ends as an incomplete one.
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return self._event(kind, response=response).encode()

    def error(self, message: str, code: str | None, param: str | None) -> bytes:
        return self._event("error", message=message, code=code, param=param).encode()

    def _event(self, type_: str, **fields: Any) -> str:
        data = json.dumps({"type": type_, "sequence_number": self._sequence, **fields})
        self._sequence += 1
        return f"event: {type_}\ndata: {data}\n\n"

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self._items)}

    def _begin(self, kind: str, call: dict[str, Any]) -> str:
        """Open an output item of ``kind`` (a call's, for ``call``)."""
        if kind == "reasoning":
            self._open = _reasoning_item(_id("rs"), "", "in_progress")
            self._open["content"] = []
            part: dict[str, Any] | None = {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            self._open = _message_item(_id("msg"), "", "in_progress")
            part = _output_text("")
        else:
            self._open = _call_item(_id("fc"), call, "", "in_progress")
            part = None
        self._text = []
        events = self._event(
            "response.output_item.added", output_index=len(self._items), item=self._open
        )
        if part is not None:
            events += self._event(
                "response.content_part.added", **self._where(), content_index=0, part=part
            )
        return events

    def _write(self, kind: str, text: str) -> str:
        events = ""
        if self._open is None or self._open["type"] != kind:
            events += self._close() + self._begin(kind, {})
        self._text.append(text)
        delta_type = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        return events + self._event(
            delta_type, **self._where(), content_index=0, delta=text, **extra
        )

    def _call(self, delta: dict[str, Any]) -> str:
        """A chat tool-call delta: a new call (it has an id), or more of the open one's
        arguments."""
        events = ""
        if "id" in delta:
            events += self._close() + self._begin("function_call", delta)
        arguments = delta.get("function", {}).get("arguments", "")
        if not arguments:
            return events
        self._text.append(arguments)
        return events + self._event(
            "response.function_call_arguments.delta", **self._where(), delta=arguments
        )

    def _close(self, status: str = "completed") -> str:
        """Close the open item, if any: its text whole, and the item done (``incomplete``
        where the output was cut in it)."""
        item = self._open
        if item is None:
            return ""
        text = "".join(self._text)
        where = self._where()
        if item["type"] == "function_call":
            item = {**item, "arguments": text, "status": status}
            events = self._event("response.function_call_arguments.done", **where, arguments=text)
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item = {**item, "content": [part], "status": status}
            events = self._event(
                "response.reasoning_text.done", **where, content_index=0, text=text
            )
            events += self._event("response.content_part.done", **where, content_index=0, part=part)
        else:
            part = _output_text(text)
            item = {**item, "content": [part], "status": status}
            events = self._event(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
            )
            events += self._event("response.content_part.done", **where, content_index=0, part=part)
        events += self._event(
            "response.output_item.done", output_index=where["output_index"], item=item
        )
        self._items.append(item)
        self._open = None
        return events
