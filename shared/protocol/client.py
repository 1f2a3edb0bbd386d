"""Messages between clients (SDK, CLI, gateway) and the scheduler process.

Every message is one ZeroMQ frame holding one msgpack map with a protocol
version ``v`` and a ``type``. The client talks through a DEALER socket to the
scheduler's ROUTER socket, so replies come back on the same connection.

Client -> scheduler::

    generate   {request_id, prompt, sampling_params, priority?, cache_salt?, lora_name?,
                pooling_params?, queued_with?, cap_max_tokens?, trace_headers?, CHAT...}
               queued_with: the id of this client's request in flight whose arrival it takes
               (a choice of n > 1 sent once its first began queues with it)
               cap_max_tokens: a max_tokens past max_model_len is cut to what fits, not
               refused (vLLM's offline LLM)
               trace_headers {traceparent?, tracestate?}: the W3C trace context the caller's
               span is in, which the request's span joins (--otlp-traces-endpoint)
               pooling_params {task?, dimensions?, normalize?, activation?, text_pair?}: a
               vector, not tokens (a server with the pooling runner): an embedding (task
               embed), a classifier's scores (classify), a cross-encoder's score of the
               prompt paired with text_pair (score)
               prompt: str | list[int] | list[{role, content, name?, tool_call_id?, tool_calls?,
                                                reasoning_content?}]
               content: str | list[{type: "text", text} | {type: "image"}] (image parts of
               a model that takes images only)
               images?: [bytes]: encoded images (PNG, JPEG, ...), one for each image part of
               the chat in order, or for each <image> of a text prompt
    abort      {request_id}
    health     {request_id, stream_ids?}   stream_ids: the client's quiet streams, to check
    model_info {request_id}
    tokenize   {request_id, prompt, add_special_tokens?, CHAT...}
               prompt: str | list[{role, content, ...}] (as generate's)
    detokenize {request_id, token_ids, as_tokens?}   as_tokens: each id's vocabulary entry
    lora_adapter {request_id, lora_name, lora_path?}   load an adapter (path), or unload it

    CHAT: a chat's fields for its template (``ChatTemplateArgs``), only with chat messages:
               tools?, chat_template_kwargs? (JSON text), add_generation_prompt?,
               continue_final_message?

Scheduler -> client::

    outputs    {items: [{request_id, new_token_ids, text, finished, finish_reason,
                         prompt_tokens, completion_tokens, prompt_token_ids,
                         num_cached_tokens, logprobs?, embedding?}]}
               embedding: a pooling request's vector (an embedding, or a classifier's
               scores), float32 little-endian bytes
               logprobs (when asked for): rows {token_ids, logprobs, tokens}, and for a
               chat's also bytes: each token's own bytes of the text (a part of a
               character's too, OpenAI's logprob bytes)
    error      {request_id | None, message, code}
    health     {request_id, info}
    model_info {request_id, info}
    tokens     {request_id, info}   info: {token_ids, max_model_len} | {text} | {tokens}
               (a lora_adapter request is answered with model_info, the adapters after it)

``outputs`` batches every output one step produced for one client; ``text`` is
the delta since the previous output of that request; ``prompt_token_ids`` and
``num_cached_tokens`` (the prompt's tokens found in the prefix cache) are sent once,
with the request's first output. The scheduler validates every field
of every incoming message; anything wrong becomes an ``error`` reply naming the
problem (see ``ClientProtocolError``), never a dropped connection. What needs the
model (vocabulary, ``max_model_len``) is checked by the scheduler when it tokenizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from weir.shared.pooling import PoolingParams
from weir.shared.protocol.envelope import (
    PROTOCOL_VERSION,
    ProtocolError,
    check_version,
    pack_map,
    unpack_map,
)
from weir.shared.protocol.step import WAKE_TAGS
from weir.shared.sampling import SamplingParams

MAX_REQUEST_ID_LEN = 256
MAX_CACHE_SALT_LEN = 1024
TRACE_HEADERS = ("traceparent", "tracestate")
MAX_TRACE_HEADER_LEN = 512  # W3C's tracestate limit (a traceparent is 55 characters)
MAX_LORA_NAME_LEN = 256  # as --lora-modules names are
MAX_PATH_LEN = 4096  # Linux's PATH_MAX
# Bounds on what one client frame may unpack to: a token-id prompt of a million tokens,
# maps no wider than a message needs (sampling params have 11 fields).
MAX_ARRAY_LEN = 1 << 20
MAX_MAP_LEN = 64
# Stream ids one health request may ask about: each costs the scheduler's loop a lookup and
# a reply entry (a million stalled every client's steps for a second). The SDK splits.
MAX_HEALTH_STREAM_IDS = 4096
# The roles chat templates know; "developer" is OpenAI's newer name for "system".
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})

# Error codes carried by ``error`` replies.
MALFORMED_MESSAGE = "malformed_message"
UNSUPPORTED_VERSION = "unsupported_version"
UNKNOWN_MESSAGE_TYPE = "unknown_message_type"
INVALID_REQUEST = "invalid_request"
DUPLICATE_REQUEST_ID = "duplicate_request_id"
ENGINE_ERROR = "engine_error"
SERVER_UNAVAILABLE = "server_unavailable"
NOT_FOUND = "not_found"  # what a request names (a LoRA adapter to unload) does not exist
# The client fell so far behind reading its replies that its queue filled.
CLIENT_TOO_SLOW = "client_too_slow"

Prompt = str | list[int] | list[dict[str, Any]]
TextOrChat = str | list[dict[str, Any]]  # what a template or the tokenizer reads
# Keys a chat message may hold besides role and content (OpenAI's, for tool calls and their
# results): each a string, but ``tool_calls``, a list of {id, type, function: {name,
# arguments}} maps of strings (arguments: JSON text, as OpenAI sends them).
# ``reasoning_content``: an assistant's earlier reasoning, which some templates render.
CHAT_MESSAGE_OPTIONAL_KEYS = frozenset({"name", "tool_call_id", "tool_calls", "reasoning_content"})
# Images one request may send, and the encoded bytes of each (vLLM's --limit-mm-per-prompt
# bounds the count per server; these bound what one frame may make the scheduler hold).
MAX_IMAGES = 64
MAX_IMAGE_BYTES = 32 << 20


class ClientProtocolError(ProtocolError):
    """A client message the scheduler cannot accept; becomes an ``error`` reply."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass(slots=True, frozen=True)
class ChatTemplateArgs:
    """What a chat's template renders besides its messages (vLLM's chat request fields).
    JSON text, because a tool's parameter schema or a template variable may nest wider
    maps than a message may hold."""

    tools: str | None = None  # OpenAI's tool list
    kwargs: str | None = None  # a map of more template variables (``chat_template_kwargs``)
    add_generation_prompt: bool = True  # end with the opening of the assistant's answer
    # Render the last message open, so the model goes on with it (as transformers does).
    continue_final_message: bool = False


NO_CHAT_ARGS = ChatTemplateArgs()


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    prompt: Prompt
    sampling_params: SamplingParams
    # Lower first, under the server's --policy priority (vLLM's request priority).
    priority: int = 0
    chat: ChatTemplateArgs = NO_CHAT_ARGS
    # Its prompt's cached KV blocks are shared only with requests of the same salt (vLLM's).
    cache_salt: str | None = None
    # The LoRA adapter (one of the server's --lora-modules) its tokens run through.
    lora_name: str | None = None
    # An embedding request: the prompt's pooled hidden states come back, no tokens
    # (``sampling_params`` may then set only truncate_prompt_tokens).
    pooling_params: PoolingParams | None = None
    # A request of this client's in flight whose arrival it takes (the gateway's choices of
    # n > 1 after the first, sent once the first has begun so that they find its prompt
    # cached, queue with it, as vLLM's n choices do); unknown, it arrives now.
    queued_with: str | None = None
    # A max_tokens that does not fit max_model_len after the prompt is cut to the room left
    # (vLLM's offline LLM: the output ends at max_model_len) instead of refused (its API).
    cap_max_tokens: bool = False
    # The caller's W3C trace context (``TRACE_HEADERS``): the request's span joins its trace.
    trace_headers: dict[str, str] | None = None
    # Encoded images, in the order of the chat's image parts (or the text's <image>s).
    images: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class AbortRequest:
    request_id: str


@dataclass(slots=True)
class HealthRequest:
    request_id: str
    # Streams the client is still waiting on; the reply's ``lost_request_ids`` names those the
    # server does not know (it restarted), so they fail instead of waiting forever.
    stream_ids: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ModelInfoRequest:
    request_id: str


@dataclass(slots=True)
class TokenizeRequest:
    """A prompt's token ids as a generate request's would be (a chat's rendered by the
    template), without generating."""

    request_id: str
    prompt: TextOrChat
    # The model's special tokens (BOS): a generate request's text gets them, its chat not
    # (the template writes them).
    add_special_tokens: bool = True
    chat: ChatTemplateArgs = NO_CHAT_ARGS


@dataclass(slots=True)
class DetokenizeRequest:
    """The text of token ids, or (``as_tokens``) each id's vocabulary entry."""

    request_id: str
    token_ids: list[int]
    as_tokens: bool = False


@dataclass(slots=True)
class LoraAdapterRequest:
    """Load a LoRA adapter from ``lora_path`` (a PEFT directory the server reads) under
    ``lora_name``, or unload ``lora_name`` (no path); a server started with
    ``--allow-runtime-lora-updating`` only."""

    request_id: str
    lora_name: str
    lora_path: str | None = None


# What an ``EngineControlRequest`` asks (vLLM's reinforcement-learning endpoints), and how
# a pause treats the requests in flight: "abort" ends them, "wait" lets them finish,
# "keep" holds them where they are until the engine resumes.
CONTROL_ACTIONS = (
    "pause",
    "resume",
    "is_paused",
    "reset_prefix_cache",
    "update_weights",
    "sleep",
    "wake_up",
    "is_sleeping",
    "start_profile",
    "stop_profile",
)
PAUSE_MODES = ("abort", "wait", "keep")
# vLLM's sleep levels: 1 frees the KV cache and moves the weights off the GPU; 2 frees both.
SLEEP_LEVELS = (1, 2)


@dataclass(slots=True)
class EngineControlRequest:
    """Pause the engine's steps (``mode``; with ``clear_cache`` every cached block is
    dropped, and requests kept are computed again on resuming), resume them, ask whether
    they are paused, drop the prefix cache, have the executors load the weights of model
    directory ``path`` (SGLang's update_weights_from_disk), put the engine to sleep at
    ``level`` and wake it up (vLLM's sleep mode; ``tags``: what wakes, of ``WAKE_TAGS``, None
    for both), or start and stop the executors' profilers (vLLM's start_profile,
    stop_profile). Answered with a ``ControlReply`` once done (a pause once no step runs)."""

    request_id: str
    action: str
    mode: str = "abort"
    clear_cache: bool = True
    path: str | None = None
    level: int = 1
    tags: list[str] | None = None


ClientMessage = (
    GenerateRequest
    | LoraAdapterRequest
    | EngineControlRequest
    | AbortRequest
    | HealthRequest
    | ModelInfoRequest
    | TokenizeRequest
    | DetokenizeRequest
)


@dataclass(slots=True)
class StreamOutput:
    """One streamed update of one request (what the SDK yields)."""

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Sent with a request's first output only (the client may have sent text).
    prompt_token_ids: list[int] | None = None
    # When asked for: {"token_ids": rows, "logprobs": rows, "tokens": rows}, one row per
    # new token, entry 0 the sampled token, then the top-n alternatives; "tokens" holds
    # each token's text (a part of a character's decoded after the tokens before it, as
    # vLLM's), and for a chat "bytes", each token's own bytes (OpenAI's).
    logprobs: dict[str, list[list[Any]]] | None = None
    # What ended a request that finished with "stop", as vLLM reports it: the stop string,
    # or the stop token's id; None for EOS (and for every other finish).
    stop_reason: str | int | None = None
    # With the first output, when asked for (``SamplingParams.prompt_logprobs``): rows as
    # in ``logprobs``, one per prompt token (entry 0 the prompt token); the first token's
    # logprob is None (nothing predicts it).
    prompt_logprobs: dict[str, list[list[Any]]] | None = None
    # A pooling request's embedding (its only output): float32, little-endian.
    embedding: bytes | None = None
    # With the first output: how many prompt tokens the prefix cache held (vLLM's
    # num_cached_tokens; usage's prompt_tokens_details.cached_tokens).
    num_cached_tokens: int | None = None


@dataclass(slots=True)
class ErrorReply:
    request_id: str | None
    message: str
    code: str


@dataclass(slots=True)
class HealthReply:
    request_id: str
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ModelInfoReply:
    request_id: str
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class TokensReply:
    """A tokenize request's ``{token_ids, max_model_len}``, a detokenize request's
    ``{text}``."""

    request_id: str
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ControlReply:
    """An ``EngineControlRequest``'s ``{is_paused, is_sleeping}`` once it is done."""

    request_id: str
    info: dict[str, Any] = field(default_factory=dict)


ServerMessage = (
    list[StreamOutput] | ErrorReply | HealthReply | ModelInfoReply | TokensReply | ControlReply
)


def _pack(type_: str, body: dict[str, Any]) -> bytes:
    return pack_map({"v": PROTOCOL_VERSION, "type": type_, **body})


def _unpack_map(frame: bytes, **limits: int) -> dict[str, Any]:
    try:
        return unpack_map(frame, "message", **limits)
    except ProtocolError as exc:
        raise ClientProtocolError(MALFORMED_MESSAGE, str(exc)) from None


def request_id_problem(request_id: Any) -> str | None:
    """What is wrong with a request id, or None: ids are non-empty printable strings of at
    most ``MAX_REQUEST_ID_LEN`` characters (they travel NUL-joined in step plans, and in logs)."""
    if type(request_id) is not str or not request_id:
        return f"request_id must be a non-empty string, got {type(request_id).__name__}"
    if len(request_id) > MAX_REQUEST_ID_LEN:
        return f"request_id must be at most {MAX_REQUEST_ID_LEN} characters, got {len(request_id)}"
    if not request_id.isprintable():
        return f"request_id must be printable, got {request_id!r}"
    return None


# ---------------------------------------------------------------- client -> scheduler


def encode_client_message(msg: ClientMessage) -> bytes:
    if isinstance(msg, GenerateRequest):
        fields: dict[str, Any] = {
            "request_id": msg.request_id,
            "prompt": msg.prompt,
            "sampling_params": msg.sampling_params.to_dict(),
        }
        if msg.priority:
            fields["priority"] = msg.priority
        if msg.cache_salt is not None:
            fields["cache_salt"] = msg.cache_salt
        if msg.lora_name is not None:
            fields["lora_name"] = msg.lora_name
        if msg.pooling_params is not None:
            fields["pooling_params"] = msg.pooling_params.to_dict()
        if msg.queued_with is not None:
            fields["queued_with"] = msg.queued_with
        if msg.cap_max_tokens is not False:  # as given: the server refuses a non-bool
            fields["cap_max_tokens"] = msg.cap_max_tokens
        if msg.trace_headers:
            fields["trace_headers"] = msg.trace_headers
        if msg.images:
            fields["images"] = msg.images
        if msg.chat is not NO_CHAT_ARGS:
            fields.update(_chat_fields(msg.chat))
        return _pack("generate", fields)
    if isinstance(msg, TokenizeRequest):
        fields = {"request_id": msg.request_id, "prompt": msg.prompt}
        if not msg.add_special_tokens:
            fields["add_special_tokens"] = False
        return _pack("tokenize", fields | _chat_fields(msg.chat))
    if isinstance(msg, DetokenizeRequest):
        fields = {"request_id": msg.request_id, "token_ids": msg.token_ids}
        if msg.as_tokens:
            fields["as_tokens"] = True
        return _pack("detokenize", fields)
    if isinstance(msg, LoraAdapterRequest):
        fields = {"request_id": msg.request_id, "lora_name": msg.lora_name}
        if msg.lora_path is not None:
            fields["lora_path"] = msg.lora_path
        return _pack("lora_adapter", fields)
    if isinstance(msg, EngineControlRequest):
        fields = {
            "request_id": msg.request_id,
            "action": msg.action,
            "mode": msg.mode,
            "clear_cache": msg.clear_cache,
            "level": msg.level,
        }
        if msg.path is not None:
            fields["path"] = msg.path
        if msg.tags is not None:
            fields["tags"] = msg.tags
        return _pack("engine_control", fields)
    if isinstance(msg, HealthRequest) and msg.stream_ids:
        return _pack("health", {"request_id": msg.request_id, "stream_ids": msg.stream_ids})
    type_ = {AbortRequest: "abort", HealthRequest: "health", ModelInfoRequest: "model_info"}[
        type(msg)
    ]
    return _pack(type_, {"request_id": msg.request_id})


def _chat_fields(chat: ChatTemplateArgs) -> dict[str, Any]:
    """The fields of ``chat`` that are not their defaults."""
    fields: dict[str, Any] = {}
    if chat.tools is not None:
        fields["tools"] = chat.tools
    if chat.kwargs is not None:
        fields["chat_template_kwargs"] = chat.kwargs
    if not chat.add_generation_prompt:
        fields["add_generation_prompt"] = False
    if chat.continue_final_message:
        fields["continue_final_message"] = True
    return fields


_CHAT_FIELDS = {"tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"}
_CLIENT_FIELDS = {
    "generate": {
        "request_id",
        "prompt",
        "sampling_params",
        "priority",
        "cache_salt",
        "lora_name",
        "pooling_params",
        "queued_with",
        "cap_max_tokens",
        "trace_headers",
        "images",
        *_CHAT_FIELDS,
    },
    "abort": {"request_id"},
    "health": {"request_id", "stream_ids"},
    "model_info": {"request_id"},
    "tokenize": {"request_id", "prompt", "add_special_tokens", *_CHAT_FIELDS},
    "detokenize": {"request_id", "token_ids", "as_tokens"},
    "lora_adapter": {"request_id", "lora_name", "lora_path"},
    "engine_control": {"request_id", "action", "mode", "clear_cache", "path", "level", "tags"},
}


def decode_client_message(frame: bytes) -> ClientMessage:
    """Parse and validate one client frame; raises ``ClientProtocolError`` naming the problem."""
    data = _unpack_map(frame, max_array_len=MAX_ARRAY_LEN, max_map_len=MAX_MAP_LEN)
    raw_id: Any = data.get("request_id")  # a valid id once request_id_problem says so
    id_problem = request_id_problem(raw_id)
    request_id = raw_id if id_problem is None else None  # errors name only a valid id
    try:
        check_version(data.get("v"), "message")
    except ProtocolError as exc:
        raise ClientProtocolError(UNSUPPORTED_VERSION, str(exc), request_id) from None
    type_ = data.get("type")
    # A type that is not a string (an array, a map) cannot even be looked up.
    if type(type_) is not str or type_ not in _CLIENT_FIELDS:
        raise ClientProtocolError(
            UNKNOWN_MESSAGE_TYPE,
            f"unknown message type {_short(type_)}; expected one of {sorted(_CLIENT_FIELDS)}",
            request_id,
        )
    unknown = sorted(set(data) - _CLIENT_FIELDS[type_] - {"v", "type"}, key=str)
    if unknown:
        raise ClientProtocolError(
            INVALID_REQUEST, f"{type_}: unknown field(s) {_short(unknown)}", request_id
        )
    if id_problem is not None:
        raise ClientProtocolError(INVALID_REQUEST, id_problem)
    if type_ == "abort":
        return AbortRequest(raw_id)
    if type_ == "health":
        stream_ids = data.get("stream_ids", [])
        if not isinstance(stream_ids, list):
            raise ClientProtocolError(
                INVALID_REQUEST, "health: stream_ids must be a list of strings", raw_id
            )
        if len(stream_ids) > MAX_HEALTH_STREAM_IDS:
            raise ClientProtocolError(
                INVALID_REQUEST,
                f"health: at most {MAX_HEALTH_STREAM_IDS} stream_ids per request, got "
                f"{len(stream_ids)}; split them",
                raw_id,
            )
        if not all(isinstance(i, str) for i in stream_ids):
            raise ClientProtocolError(
                INVALID_REQUEST, "health: stream_ids must be a list of strings", raw_id
            )
        return HealthRequest(raw_id, stream_ids)
    if type_ == "model_info":
        return ModelInfoRequest(raw_id)
    if type_ == "lora_adapter":
        name, path = data.get("lora_name"), data.get("lora_path")
        if type(name) is not str or not 0 < len(name) <= MAX_LORA_NAME_LEN:
            raise ClientProtocolError(
                INVALID_REQUEST,
                f"lora_name must be a non-empty string of at most {MAX_LORA_NAME_LEN} characters",
                raw_id,
            )
        if path is not None and (type(path) is not str or not 0 < len(path) <= MAX_PATH_LEN):
            raise ClientProtocolError(
                INVALID_REQUEST,
                f"lora_path must be a non-empty string of at most {MAX_PATH_LEN} characters",
                raw_id,
            )
        return LoraAdapterRequest(raw_id, name, path)
    if type_ == "engine_control":
        action, mode = data.get("action"), data.get("mode", "abort")
        clear_cache = data.get("clear_cache", True)
        if (
            action not in CONTROL_ACTIONS
            or mode not in PAUSE_MODES
            or type(clear_cache) is not bool
        ):
            raise ClientProtocolError(
                INVALID_REQUEST,
                f"engine_control: action must be one of {CONTROL_ACTIONS}, mode one of "
                f"{PAUSE_MODES} and clear_cache a bool, got {_short(action)}, {_short(mode)}, "
                f"{_short(clear_cache)}",
                raw_id,
            )
        path = data.get("path")
        if (path is None) != (action != "update_weights") or (
            path is not None and (type(path) is not str or not 0 < len(path) <= MAX_PATH_LEN)
        ):
            raise ClientProtocolError(
                INVALID_REQUEST,
                f"engine_control: update_weights takes a path (a non-empty string of at most "
                f"{MAX_PATH_LEN} characters), the other actions none",
                raw_id,
            )
        level = data.get("level", 1)
        if type(level) is not int or level not in SLEEP_LEVELS:
            raise ClientProtocolError(
                INVALID_REQUEST,
                f"engine_control: level must be one of {SLEEP_LEVELS}, got {_short(level)}",
                raw_id,
            )
        tags = data.get("tags")
        if tags is not None and (
            action != "wake_up"
            or type(tags) is not list
            or not tags
            or not all(type(tag) is str and tag in WAKE_TAGS for tag in tags)
        ):
            raise ClientProtocolError(
                INVALID_REQUEST,
                f"engine_control: tags are wake_up's, some of {WAKE_TAGS}, got {_short(tags)}",
                raw_id,
            )
        return EngineControlRequest(raw_id, action, mode, clear_cache, path, level, tags)
    if type_ == "detokenize":
        token_ids = data.get("token_ids")
        if not isinstance(token_ids, list) or any(type(t) is not int or t < 0 for t in token_ids):
            raise ClientProtocolError(
                INVALID_REQUEST, "detokenize: token_ids must be a list of token ids", raw_id
            )
        as_tokens = data.get("as_tokens", False)
        if type(as_tokens) is not bool:
            raise ClientProtocolError(
                INVALID_REQUEST, "detokenize: as_tokens must be a bool", raw_id
            )
        return DetokenizeRequest(raw_id, token_ids, as_tokens)
    if type_ == "tokenize":
        try:  # an empty text has tokens too: none, or the model's BOS
            prompt = "" if data.get("prompt") == "" else validate_prompt(data.get("prompt"))
        except ValueError as exc:
            raise ClientProtocolError(INVALID_REQUEST, str(exc), raw_id) from None
        if not isinstance(prompt, str) and not isinstance(prompt[0], dict):
            raise ClientProtocolError(
                INVALID_REQUEST, "tokenize: the prompt must be text or chat messages", raw_id
            )
        special = data.get("add_special_tokens", True)
        if type(special) is not bool:
            raise ClientProtocolError(
                INVALID_REQUEST, "tokenize: add_special_tokens must be a bool", raw_id
            )
        return TokenizeRequest(raw_id, prompt, special, _chat_args(data, prompt, raw_id))
    try:
        prompt = validate_prompt(data.get("prompt"))
        sampling_params = SamplingParams.from_dict(data.get("sampling_params", {}))
        pooling = data.get("pooling_params")
        pooling_params = None if pooling is None else PoolingParams.from_dict(pooling)
    except (ValueError, TypeError) as exc:
        raise ClientProtocolError(INVALID_REQUEST, str(exc), raw_id) from None
    if sampling_params.n != 1:
        raise ClientProtocolError(
            INVALID_REQUEST,
            f"sampling_params.n is {sampling_params.n}: a request samples one sequence; send "
            "n requests (LLM and the HTTP API's n do, with seed + i where seeded)",
            raw_id,
        )
    priority = data.get("priority", 0)
    if type(priority) is not int or not -(2**31) <= priority < 2**31:
        raise ClientProtocolError(
            INVALID_REQUEST, f"priority must be a 32-bit int, got {_short(priority)}", raw_id
        )
    salt = data.get("cache_salt")
    if salt is not None and (type(salt) is not str or not 0 < len(salt) <= MAX_CACHE_SALT_LEN):
        raise ClientProtocolError(
            INVALID_REQUEST,
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_LEN} characters",
            raw_id,
        )
    lora_name = data.get("lora_name")
    if lora_name is not None and (
        type(lora_name) is not str or not 0 < len(lora_name) <= MAX_LORA_NAME_LEN
    ):
        raise ClientProtocolError(
            INVALID_REQUEST,
            f"lora_name must be a non-empty string of at most {MAX_LORA_NAME_LEN} characters",
            raw_id,
        )
    queued_with = data.get("queued_with")
    if queued_with is not None and (
        type(queued_with) is not str or request_id_problem(queued_with) is not None
    ):
        raise ClientProtocolError(
            INVALID_REQUEST, f"queued_with must be a request id, got {_short(queued_with)}", raw_id
        )
    cap_max_tokens = data.get("cap_max_tokens", False)
    if type(cap_max_tokens) is not bool:
        raise ClientProtocolError(
            INVALID_REQUEST, f"cap_max_tokens must be a bool, got {_short(cap_max_tokens)}", raw_id
        )
    trace_headers = data.get("trace_headers")
    if trace_headers is not None and (
        not isinstance(trace_headers, dict)
        or not trace_headers.keys() <= set(TRACE_HEADERS)
        or not all(
            type(v) is str and 0 < len(v) <= MAX_TRACE_HEADER_LEN for v in trace_headers.values()
        )
    ):
        raise ClientProtocolError(
            INVALID_REQUEST,
            f"trace_headers must map {' and/or '.join(TRACE_HEADERS)} to their text (at most "
            f"{MAX_TRACE_HEADER_LEN} characters), got {_short(trace_headers)}",
            raw_id,
        )
    chat = _chat_args(data, prompt, raw_id)
    images = data.get("images", [])
    try:
        _check_images(prompt, images)
    except ValueError as exc:
        raise ClientProtocolError(INVALID_REQUEST, str(exc), raw_id) from None
    return GenerateRequest(
        raw_id,
        prompt,
        sampling_params,
        priority,
        chat,
        salt,
        lora_name,
        pooling_params,
        queued_with,
        cap_max_tokens,
        trace_headers,
        images,
    )


def _check_images(prompt: Prompt, images: Any) -> None:
    """A request's images: a list of bytes, as many as its chat's image parts (a text's
    ``<image>`` count is the model's to check, once the prompt is tokenized)."""
    if type(images) is not list or not all(type(image) is bytes for image in images):
        raise ValueError(f"images must be a list of encoded images (bytes), got {_short(images)}")
    if len(images) > MAX_IMAGES:
        raise ValueError(f"a request may send at most {MAX_IMAGES} images, got {len(images)}")
    for i, image in enumerate(images):
        if not 0 < len(image) <= MAX_IMAGE_BYTES:
            raise ValueError(
                f"images[{i}]: an image must be 1 byte to {MAX_IMAGE_BYTES >> 20} MiB "
                f"encoded, got {len(image)} bytes"
            )
    if images and not isinstance(prompt, str) and not isinstance(prompt[0], dict):
        raise ValueError("images come with a text or a chat, not token ids")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        parts = sum(image_parts(message["content"]) for message in prompt)
        if parts != len(images):
            raise ValueError(
                f"the chat has {parts} image parts but the request sends {len(images)} "
                "images: send one image for each image part"
            )


def image_parts(content: str | list[dict[str, str]]) -> int:
    """How many image parts a chat message's content holds."""
    return 0 if isinstance(content, str) else sum(part["type"] == "image" for part in content)


def _chat_args(data: dict[str, Any], prompt: Prompt, request_id: str) -> ChatTemplateArgs:
    if _CHAT_FIELDS.isdisjoint(data):
        return NO_CHAT_ARGS
    given = [name for name in _CHAT_FIELDS if name in data]
    problem = None
    if isinstance(prompt, str) or not isinstance(prompt[0], dict):
        problem = f"{given[0]} comes with a chat (a list of messages), not a text or token ids"
    elif any(type(data.get(name, "")) is not str for name in ("tools", "chat_template_kwargs")):
        problem = "tools and chat_template_kwargs must be JSON text"
    elif any(
        type(data.get(name, False)) is not bool
        for name in ("add_generation_prompt", "continue_final_message")
    ):
        problem = "add_generation_prompt and continue_final_message must be bools"
    if problem is not None:
        raise ClientProtocolError(INVALID_REQUEST, problem, request_id)
    chat = ChatTemplateArgs(
        data.get("tools"),
        data.get("chat_template_kwargs"),
        data.get("add_generation_prompt", True),
        data.get("continue_final_message", False),
    )
    if chat.add_generation_prompt and chat.continue_final_message:
        raise ClientProtocolError(
            INVALID_REQUEST,
            "continue_final_message goes on with the last message: it needs "
            "add_generation_prompt false",
            request_id,
        )
    return chat


def _short(value: Any, limit: int = 100) -> str:
    """``repr`` of a client's value for an error message, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


_CHAT_MESSAGE_KEYS = CHAT_MESSAGE_OPTIONAL_KEYS | {"role", "content"}
_TOOL_CALL_KEYS = frozenset({"id", "type", "function"})


def _check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list")
    for j, call in enumerate(calls):
        if (
            not isinstance(call, dict)
            or not call.keys() <= _TOOL_CALL_KEYS
            or type(call.get("id", "")) is not str
            or call.get("type", "function") != "function"
        ):
            raise ValueError(f'{where}[{j}] must be a map of id, type ("function") and function')
        function = call.get("function")
        if (
            not isinstance(function, dict)
            or function.keys() != {"name", "arguments"}
            or not all(type(value) is str for value in function.values())
        ):
            raise ValueError(f"{where}[{j}].function must map name and arguments to strings")


_TEXT_PART_KEYS = frozenset({"type", "text"})


def _check_content(content: Any, where: str) -> None:
    """A message's content: a string, or a list of text parts and image parts (the
    shape chat templates of models that take images read)."""
    if type(content) is str:
        return
    if type(content) is not list or not content:
        raise ValueError(
            f"{where} must be a string or a non-empty list of parts, got {type(content).__name__}"
        )
    for j, part in enumerate(content):
        text_part = (
            type(part) is dict
            and part.keys() == _TEXT_PART_KEYS
            and part["type"] == "text"
            and type(part["text"]) is str
        )
        if not text_part and part != {"type": "image"}:
            raise ValueError(
                f'{where}[{j}] must be {{"type": "text", "text": STRING}} or '
                f'{{"type": "image"}}, got {_short(part)}'
            )


def validate_prompt(prompt: Any) -> Prompt:
    """Check a prompt's shape (not its length or vocabulary: that needs the model)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt
    if not isinstance(prompt, list):
        raise ValueError(
            "prompt must be a string, a list of token ids or a list of chat "
            f"messages, got {type(prompt).__name__}"
        )
    if not prompt:
        raise ValueError("prompt must not be empty")
    if isinstance(prompt[0], dict):
        for i, message in enumerate(prompt):
            if not isinstance(message, dict):
                raise ValueError(
                    f"prompt[{i}]: chat messages must be maps, got {type(message).__name__}"
                )
            if not {"role", "content"} <= message.keys() <= _CHAT_MESSAGE_KEYS:
                raise ValueError(
                    f"prompt[{i}]: a chat message must have the keys 'role' and 'content', "
                    f"and may have {sorted(CHAT_MESSAGE_OPTIONAL_KEYS)}; got "
                    f"{_short(sorted(message, key=str))}"
                )
            for key in message.keys() - {"tool_calls", "content"}:
                if type(message[key]) is not str:
                    raise ValueError(
                        f"prompt[{i}]: chat message {key} must be a string (all but "
                        f"content and tool_calls are strings), got {type(message[key]).__name__}"
                    )
            _check_content(message["content"], f"prompt[{i}].content")
            if "tool_calls" in message:
                _check_tool_calls(message["tool_calls"], f"prompt[{i}].tool_calls")
            if message["role"] not in CHAT_ROLES:
                raise ValueError(
                    f"prompt[{i}]: unknown chat role {_short(message['role'])}; "
                    f"expected one of {sorted(CHAT_ROLES)}"
                )
        return prompt
    for i, token_id in enumerate(prompt):
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise ValueError(
                f"prompt[{i}]: token ids must be integers, got {type(token_id).__name__}"
            )
    return prompt


# ---------------------------------------------------------------- scheduler -> client


# An output item is an array, not a map (a step's frame holds an item per running request,
# packed and unpacked between two steps): StreamOutput's first _NUM_FIELDS fields in order,
# then, only where any is set, a map of the optional fields that are.
_NUM_FIELDS = 7
_OPTIONAL_OUTPUT_FIELDS = (
    "prompt_token_ids",
    "logprobs",
    "stop_reason",
    "prompt_logprobs",
    "embedding",
    "num_cached_tokens",
)


def encode_outputs(outputs: list[StreamOutput]) -> bytes:
    items = []
    for o in outputs:
        item: list[Any] = [
            o.request_id,
            o.new_token_ids,
            o.text,
            o.finished,
            o.finish_reason,
            o.prompt_tokens,
            o.completion_tokens,
        ]
        if (
            o.prompt_token_ids is not None
            or o.logprobs is not None
            or o.stop_reason is not None
            or o.prompt_logprobs is not None
            or o.embedding is not None
            or o.num_cached_tokens is not None
        ):
            item.append(
                {
                    name: value
                    for name in _OPTIONAL_OUTPUT_FIELDS
                    if (value := getattr(o, name)) is not None
                }
            )
        items.append(item)
    return _pack("outputs", {"items": items})


_REPLY_TYPES = {
    HealthReply: "health",
    ModelInfoReply: "model_info",
    TokensReply: "tokens",
    ControlReply: "control",
}


def encode_server_message(
    msg: ErrorReply | HealthReply | ModelInfoReply | TokensReply | ControlReply,
) -> bytes:
    if isinstance(msg, ErrorReply):
        return _pack(
            "error", {"request_id": msg.request_id, "message": msg.message, "code": msg.code}
        )
    return _pack(_REPLY_TYPES[type(msg)], {"request_id": msg.request_id, "info": msg.info})


def decode_server_message(frame: bytes) -> ServerMessage:
    """Parse a scheduler frame (trusted peer: shape errors raise ``ClientProtocolError``)."""
    data = _unpack_map(frame)
    try:
        type_ = data["type"]
        if type_ == "outputs":
            # Items changed shape in version 2 (the replies did not: a server of another
            # version still has its error read, "unsupported protocol version").
            try:
                check_version(data.get("v"), "outputs")
            except ProtocolError as exc:
                raise ClientProtocolError(UNSUPPORTED_VERSION, str(exc)) from None
            return [
                StreamOutput(*item)
                if len(item) == _NUM_FIELDS
                else StreamOutput(*item[:_NUM_FIELDS], **item[_NUM_FIELDS])
                for item in data["items"]
            ]
        if type_ == "error":
            return ErrorReply(data["request_id"], data["message"], data["code"])
        if type_ == "health":
            return HealthReply(data["request_id"], data["info"])
        if type_ == "model_info":
            return ModelInfoReply(data["request_id"], data["info"])
        if type_ == "tokens":
            return TokensReply(data["request_id"], data["info"])
        if type_ == "control":
            return ControlReply(data["request_id"], data["info"])
    except (KeyError, TypeError) as exc:
        raise ClientProtocolError(MALFORMED_MESSAGE, f"bad server message: {exc!r}") from None
    raise ClientProtocolError(UNKNOWN_MESSAGE_TYPE, f"unknown server message type {type_!r}")
