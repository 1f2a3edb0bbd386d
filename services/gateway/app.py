"""The OpenAI-compatible HTTP API (FastAPI), in front of the engine replicas' ``Router``.

Every generation runs as one or more sample streams of the client SDK; a request
with ``n`` samples (or several prompts) starts its first sample of each prompt at
once and the others when that one has produced its first token, so they find the
prompt's full KV blocks in the prefix cache instead of computing them again. A
client that disconnects cancels the response, which closes every sample stream,
which aborts the requests and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import re
import reprlib
import time
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client.exposition import choose_encoder
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from weir.services.gateway import anthropic_messages as anthropic
from weir.services.gateway import openai_format as fmt
from weir.services.gateway.chat_output import NO_PARSERS, ChatChunks, ChatOutput, ChatParsers
from weir.services.gateway.embeddings import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    classification_response,
    embedding_response,
    pooling_response,
    rerank_response,
    score_response,
)
from weir.services.gateway.engine_metrics import EngineMetrics
from weir.services.gateway.metrics import GatewayMetrics
from weir.services.gateway.reasoning import markers_of
from weir.services.gateway.response_store import MAX_STORED_RESPONSES, ResponseStore
from weir.services.gateway.responses import (
    ResponseEvents,
    ResponsesRequest,
    response_body,
    whole_response,
)
from weir.services.gateway.router import NoReplicaError, Replica, Router
from weir.services.gateway.schemas import (
    BodyFieldError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    LoadLoraAdapterBody,
    StreamOptions,
    TokenizeBody,
    UnloadLoraAdapterBody,
    UpdateWeightsBody,
    chat_prompt,
)
from weir.services.gateway.sglang_generate import FIELD_NAMES as SGLANG_FIELD_NAMES
from weir.services.gateway.sglang_generate import (
    NativeGenerateRequest,
    SglangAbortBody,
    SglangMemoryBody,
    SglangPauseBody,
)
from weir.services.gateway.sglang_generate import result as sglang_result
from weir.shared.beam_search import BeamSearchParams
from weir.shared.client import (
    AsyncWeirClient,
    ClassificationOutput,
    EmbeddingOutput,
    EngineError,
    InvalidRequestError,
    ScoreOutput,
    ServerUnavailableError,
    gather_all,
)
from weir.shared.config import DEFAULT_MAX_MESSAGE_BYTES
from weir.shared.log_limit import limited_logger
from weir.shared.pooling import cosine
from weir.shared.protocol.client import (
    NOT_FOUND,
    PAUSE_MODES,
    SERVER_UNAVAILABLE,
    SLEEP_LEVELS,
    TRACE_HEADERS,
    Prompt,
    StreamOutput,
)
from weir.shared.protocol.step import WAKE_TAGS
from weir.shared.sampling import SamplingParams

VERSION = "0.1.0"
_ROUTES = (
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
    "/classify",
    "/pooling",
    "/score",
    "/rerank",
    "/v2/rerank",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/pause",
    "/resume",
    "/is_paused",
    "/reset_prefix_cache",
    "/update_weights_from_disk",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/start_profile",
    "/stop_profile",
    "/tokenize",
    "/detokenize",
    "/health",
    "/ping",
    "/invocations",
    "/metrics",
    "/version",
    "/load",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    # SGLang's
    "/generate",
    "/flush_cache",
    "/get_model_info",
    "/pause_generation",
    "/continue_generation",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/abort_request",
    "/health_generate",
)
# The routes with a path parameter, labelled by their template.
_TEMPLATE_ROUTES = {
    "/v1/responses/": "/v1/responses/{response_id}",
    "/v1/models/": "/v1/models/{name}",
}


def _route_label(path: str) -> str:
    """A request's ``route`` label: its route (one with a parameter by its template), or
    "other" for any other path, so that a client cannot mint series."""
    if path in _ROUTES:
        return path
    return next((t for p, t in _TEMPLATE_ROUTES.items() if path.startswith(p)), "other")


def _not_json_content(request: Request) -> APIError:
    """A body sent as another type: FastAPI reads JSON only under its content type (a
    browser's form cannot forge that without asking CORS first)."""
    sent = request.headers.get("content-type", "none")[:100]
    message = f"the body must be JSON sent with Content-Type: application/json (got {sent})"
    return APIError(400, message, "invalid_request_error")


# The routes whose requests /load counts (vLLM's --enable-server-load-tracking: those of
# its load_aware_call handlers that Weir serves; /invocations is one of them by its body).
_LOAD_COUNTED = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/messages",
        "/generate",
        "/v1/embeddings",
        "/classify",
        "/pooling",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/invocations",
    }
)


# Routes outside /v1 that still make the engine work: they need the API key too.
_ENGINE_ROUTES = frozenset(
    {
        "/tokenize",
        "/detokenize",
        "/classify",
        "/pooling",
        "/score",
        "/rerank",
        "/v2/rerank",
        "/invocations",
        "/pause",
        "/resume",
        "/is_paused",
        "/reset_prefix_cache",
        "/update_weights_from_disk",
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/start_profile",
        "/stop_profile",
        # SGLang's native API
        "/generate",
        "/flush_cache",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
    }
)


class APIError(Exception):
    """An error answered in OpenAI's schema (Anthropic's, on its routes)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code
        self.param = param  # the field at fault, as OpenAI names it

    def response(self, anthropic_route: bool = False) -> Response:
        # A message may quote the caller's text.
        if anthropic_route:
            return ascii_json(anthropic.error_body(self.message, self.type), self.status)
        return ascii_json(
            fmt.error_body(self.message, self.type, self.code, self.param), self.status
        )


def _anthropic_shaped(scope: Scope) -> bool:
    """Whether a request's answers and errors take Anthropic's shape: those of its Messages
    API, and of the model routes where its client asks (its SDK sends anthropic-version)."""
    path = _route_path(scope)  # without --root-path's prefix
    if path.startswith("/v1/messages"):
        return True
    return path.startswith("/v1/models") and any(
        name == b"anthropic-version" for name, _ in scope["headers"]
    )


def ascii_json(content: Any, status: int = 200) -> Response:
    """JSON in ASCII, for a body that echoes the caller's text, which need not be valid
    Unicode (a lone surrogate, "\\ud800", is valid JSON): UTF-8 could not encode it."""
    return Response(json.dumps(content), status, media_type="application/json")


def _unavailable(exc: Exception) -> bool:
    """Whether the replica could not take or serve the request (not the request's fault)."""
    return isinstance(exc, NoReplicaError | ServerUnavailableError)


_faults_log = limited_logger(__name__)


def _served_names(info: dict[str, Any]) -> list[str]:
    """Every name the model answers to; a scheduler older than the gateway (a rolling
    update) tells its one."""
    names: list[str] = info.get("model_names") or [info["model_name"]]
    return names


def _api_error(exc: Exception) -> APIError:
    """The HTTP status and OpenAI error type of an engine-side failure."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        if exc.code == NOT_FOUND:  # the LoRA adapter a request names (unloaded since)
            return APIError(404, str(exc), "not_found_error", "model_not_found", "model")
        return APIError(400, str(exc), "invalid_request_error", exc.code)
    if _unavailable(exc):
        return APIError(503, str(exc), "service_unavailable_error", SERVER_UNAVAILABLE)
    if isinstance(exc, EngineError):
        return APIError(500, str(exc), "server_error", exc.code)
    # The gateway's own fault: the operator gets its traceback (once a second at most).
    _faults_log.error("request failed in the gateway: %r", exc, exc_info=exc)
    return APIError(500, f"{type(exc).__name__}: {exc}", "server_error")


# The status recorded for a request whose client left before its response (nginx's 499):
# nobody receives it, the gateway's metrics count it.
CLIENT_CLOSED_REQUEST = 499

# How long SGLang's /health_generate waits for each replica's token (SGLang's own wait).
HEALTH_GENERATE_TIMEOUT = 20.0

# Every choice is a request of its own: one HTTP request may not ask for more.
MAX_CHOICES = 128
# How the engine names the structured output a tool choice asks for in its refusals.
_TOOL_SCHEMA_FIELD = "structured_output.json"
# Fields the engine names in its errors, and the Responses (and Messages) fields they came
# from.
_RESPONSES_FIELDS = (("max_tokens", "max_output_tokens"), (_TOOL_SCHEMA_FIELD, "text.format"))
_ANTHROPIC_FIELDS = ((_TOOL_SCHEMA_FIELD, "output_config.format"), ("stop:", "stop_sequences:"))


def _in_fields_of(exc: Exception, fields: Sequence[tuple[str, str]]) -> APIError:
    """An engine's refusal in the fields the client sent: the engine names the chat's."""
    error = _api_error(exc)
    for engine_field, client_field in fields:
        if error.message.startswith(engine_field):
            message = error.message.replace(engine_field, client_field)
            return APIError(error.status, message, error.type, error.code, client_field)
    return error


# A request's outputs as they arrive: per batch, each choice index with its new outputs.
T = TypeVar("T")
Batches = AsyncGenerator[list[tuple[int, list[StreamOutput]]], None]


class _ChatResponder(Protocol):
    """How a chat's outputs become the response (a chat completion, a Responses API
    response): given the request, how its text is read, the model's name, an id and the
    outputs."""

    def __call__(
        self,
        body: ChatCompletionRequest,
        output: ChatOutput,
        model: str,
        response_id: str,
        outputs: Batches,
    ) -> Awaitable[Response]: ...


@dataclass(slots=True)
class _Sample:
    """One stream of one request: choice ``index``, sample ``number`` of prompt ``group``."""

    index: int
    group: int
    number: int
    prompt: Prompt
    params: SamplingParams
    priority: int
    chat: dict[str, Any] = field(default_factory=dict)  # a chat's template arguments (SDK's)
    cache_salt: str | None = None
    lora_name: str | None = None
    prompt_field: str | None = None  # how an error names its prompt, one of several
    trace_headers: dict[str, str] | None = None  # the caller's W3C trace context
    # A max_tokens past max_model_len cut to the room left (Anthropic's), not refused.
    cap_max_tokens: bool = False
    rid: str | None = None  # SGLang's request id, which /abort_request names


@dataclass(slots=True)
class _InFlight:
    """A sample in flight, which SGLang's /abort_request may end: its ``rid``, and the
    client of the replica it was sent to (None before)."""

    rid: str | None
    client: AsyncWeirClient | None = None
    aborted: bool = False


@dataclass(slots=True, frozen=True)
class Caller:
    """What a request's HTTP headers say of it: its ``X-Request-Id``, and the W3C trace
    context (``traceparent``, ``tracestate``) that its span joins on an engine exporting
    traces."""

    request_id: str | None = None
    trace_headers: dict[str, str] | None = None

    @classmethod
    def of(cls, headers: Mapping[str, str]) -> Caller:
        trace = {name: headers[name] for name in TRACE_HEADERS if name in headers}
        return cls(headers.get("x-request-id"), trace or None)


NO_CALLER = Caller()


@dataclass(slots=True, frozen=True)
class _Model:
    """What a request's ``model`` names: the served model, or one of its LoRA adapters."""

    info: dict[str, Any]  # the served model's (``model_info``)
    name: str  # what responses call it
    lora_name: str | None  # the adapter, None for the base model


def _inputs(
    body: EmbeddingRequest | ClassificationRequest | PoolingRequest,
) -> list[str | list[int]]:
    """A pooling body's inputs, each one prompt; a 400 names a bad one."""
    try:
        return body.inputs()
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_request_error", param="input") from None


def _input_fields(prompts: Sequence[object]) -> list[str]:
    """How an error names each input of an embeddings or classification body."""
    return [f"input[{i}]" for i in range(len(prompts))] if len(prompts) > 1 else ["input"]


def _samples(
    prompts: Sequence[Prompt],
    n: int,
    params: Callable[[int], SamplingParams],
    priority: int,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    trace_headers: dict[str, str] | None = None,
) -> list[_Sample]:
    """``n`` samples of each prompt, choice ``p * n + i``; invalid parameters are a 400."""
    if len(prompts) * n > MAX_CHOICES:
        raise APIError(
            400,
            f"{len(prompts)} prompt(s) x n={n} is more than {MAX_CHOICES} choices per request",
            "invalid_request_error",
        )
    try:
        return [
            _Sample(
                p * n + i,
                p,
                i,
                prompt,
                params(i),
                priority,
                {},
                cache_salt,
                lora_name,
                f"prompt[{p}]" if len(prompts) > 1 else None,
                trace_headers,
            )
            for p, prompt in enumerate(prompts)
            for i in range(n)
        ]
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_request_error") from None


async def _echoed(
    outputs: Batches,
    samples: list[_Sample],
    detokenize: Callable[[list[int]], Awaitable[str]],
    *,
    with_logprobs: bool,
) -> Batches:
    """The outputs with each sample's prompt before its first output's text (the prompt as
    sent, or for token ids their text decoded whole, as vLLM's: a character split across
    tokens has no text of its own) and, ``with_logprobs``, its prompt's rows before the
    first output's rows."""
    texts: dict[int, str] = {}  # prompt -> the text of its token ids
    async with aclosing(outputs):
        async for batch in outputs:
            for index, outs in batch:
                first = outs[0]
                if first.prompt_token_ids is None:
                    continue  # not a first output
                rows = first.prompt_logprobs or {}
                sample = samples[index]
                prompt = sample.prompt
                if not isinstance(prompt, str):
                    if sample.group not in texts:
                        texts[sample.group] = await detokenize(first.prompt_token_ids)
                    prompt = texts[sample.group]
                logprobs = first.logprobs
                if with_logprobs:
                    logprobs = {
                        key: rows.get(key, []) + (first.logprobs or {}).get(key, [])
                        for key in ("token_ids", "logprobs", "tokens")
                    }
                outs[0] = dataclasses.replace(first, text=prompt + first.text, logprobs=logprobs)
            yield batch


async def _none() -> AsyncGenerator[list[StreamOutput], None]:
    """A stream that has ended."""
    return
    yield


async def _without_completion(outputs: Batches) -> Batches:
    """The outputs with no completion: no tokens, text or logprob rows of their own, each
    ended by its length (the prompt is the whole answer)."""
    async with aclosing(outputs):
        async for batch in outputs:
            for _, outs in batch:
                for i, out in enumerate(outs):
                    outs[i] = dataclasses.replace(
                        out,
                        new_token_ids=[],
                        text="",
                        completion_tokens=0,
                        logprobs=None if out.logprobs is None else dict.fromkeys(out.logprobs, []),
                        finish_reason="length" if out.finished else None,
                        stop_reason=None,
                    )
            yield batch


async def _tokens_as_ids(
    outputs: Batches,
) -> Batches:
    """The outputs with each logprob row's tokens written as ``token_id:ID`` (vLLM's
    return_tokens_as_token_ids: a token that is part of a character has no text)."""
    async with aclosing(outputs):
        async for batch in outputs:
            for _, outs in batch:
                for i, out in enumerate(outs):
                    if out.logprobs is not None:
                        tokens = [
                            [f"token_id:{t}" for t in row] for row in out.logprobs["token_ids"]
                        ]
                        outs[i] = dataclasses.replace(
                            out, logprobs={**out.logprobs, "tokens": tokens}
                        )
            yield batch


def _token_ids(choice: fmt.Choice, prompt_key: str = "") -> dict[str, Any]:
    """A whole choice's token-id fields, when asked for (vLLM's return_token_ids)."""
    if choice.token_ids is None:
        return {}
    fields: dict[str, Any] = {"token_ids": choice.token_ids}
    if prompt_key:
        fields[prompt_key] = choice.prompt_token_ids
    return fields


@dataclass(frozen=True, slots=True)
class ApiOptions:
    """vLLM's options of what the API answers and logs (``weir serve``, ``weir gateway`` and
    ``weir run-batch`` take them as vLLM spells them)."""

    # A chat's message role where the request adds the generation prompt (--response-role).
    response_role: str = "assistant"
    # Streams carry usage as though stream_options asked for it, in every chunk too
    # (--enable-force-include-usage).
    force_include_usage: bool = False
    # The most characters of a logged prompt's texts, and ids of its token ids (--max-log-len;
    # None: the log's own cut).
    max_log_len: int | None = None


class Gateway:
    def __init__(
        self,
        router: Router,
        api_key: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        allowed_origins: Sequence[str] = ("*",),
        parsers: ChatParsers = NO_PARSERS,
        options: ApiOptions = ApiOptions(),
        engine_metrics: Sequence[str] = (),
    ) -> None:
        self.router = router
        self.parsers = parsers
        self.options = options
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.allowed_origins = allowed_origins  # CORS: the web pages that may call the API
        self.metrics = GatewayMetrics(router)
        self.engine_metrics = EngineMetrics(engine_metrics)  # their series join /metrics
        self._model: dict[str, Any] | None = None
        self._model_lookup: asyncio.Future[dict[str, Any]] | None = None
        self._reasoning_end_token: bool | None = None  # whether the reasoning end is one token
        self.stored_responses = ResponseStore()
        self._in_flight: dict[str, _InFlight] = {}  # by the engine's request id
        self._generation_check: asyncio.Future[list[str]] | None = None  # /health_generate's

    async def model(self, fresh: bool = False) -> dict[str, Any]:
        """The served model's info: asked of a replica once, then kept. ``fresh`` asks
        again (its LoRA adapters come and go) and keeps the answer, while other callers go
        on with the kept one, so a failed question fails only its askers. Callers share
        the question in flight."""
        if self._model is not None and not fresh:
            return self._model
        lookup = self._model_lookup
        if lookup is None or lookup.done():
            lookup = self._model_lookup = asyncio.ensure_future(self.router.model_info())
        self._model = await asyncio.shield(lookup)  # a caller that leaves cancels only itself
        return self._model

    async def update_lora(self, name: str, path: str | None) -> Response:
        """vLLM's ``/v1/load_lora_adapter`` (a path) and ``/v1/unload_lora_adapter`` (none),
        on every replica in turn (each answering, else none is asked): a failure stops
        there, and the replicas before it keep the change."""
        try:
            for replica in await self.router.every_replica():
                if path is None:
                    await replica.client.unload_lora_adapter(name)
                else:
                    await replica.client.load_lora_adapter(name, path)
        except InvalidRequestError as exc:
            if exc.code == NOT_FOUND:
                raise APIError(404, str(exc), "not_found_error", NOT_FOUND, "lora_name") from None
            raise
        finally:
            self._model = None  # the adapters listed changed: the next request asks again
        done = "removed" if path is None else "added"
        return PlainTextResponse(f"Success: LoRA adapter '{name}' {done} successfully.")

    async def control(
        self,
        action: str,
        mode: str = "abort",
        clear_cache: bool = True,
        level: int = 1,
        tags: list[str] | None = None,
    ) -> Response:
        """vLLM's reinforcement-learning endpoints, on every replica in turn (each answering,
        else a 503 names those that do not and none is asked): ``/pause``
        (answered once no step runs), ``/resume``, ``/is_paused`` and ``/reset_prefix_cache``
        say ``is_paused``; the sleep mode's ``/sleep`` (``level`` 1 or 2), ``/wake_up`` and
        ``/is_sleeping`` say ``is_sleeping``: true once every replica is (and until both of
        ``/wake_up``'s ``tags`` woke); ``/start_profile`` and ``/stop_profile`` (the
        executors' torch.profiler, a server started with --profiler-dir) answer an empty
        200."""
        for param, value, choices in (("mode", mode, PAUSE_MODES), ("level", level, SLEEP_LEVELS)):
            if value not in choices:
                raise APIError(
                    400,
                    f"{param} must be one of {choices}, got {value!r}",
                    "invalid_request_error",
                    param=param,
                )
        sleep_route = action in ("sleep", "wake_up", "is_sleeping")
        states = []
        for replica in await self.router.every_replica():
            client = replica.client
            if action == "pause":
                await client.pause(mode, clear_cache)
            elif action == "resume":
                await client.resume()
            elif action == "reset_prefix_cache":
                await client.reset_prefix_cache()
            elif action == "sleep":
                await client.sleep(level)
            elif action == "wake_up":
                await client.wake_up(tags)
            elif action in ("start_profile", "stop_profile"):
                await getattr(client, action)()
                continue
            states.append(await (client.is_sleeping() if sleep_route else client.is_paused()))
        if action in ("start_profile", "stop_profile"):
            return Response(status_code=200)
        return JSONResponse({"is_sleeping" if sleep_route else "is_paused": all(states)})

    async def abort_request(self, rid: str, abort_all: bool) -> Response:
        """SGLang's ``/abort_request``: the ``/generate`` requests of ``rid`` (every request
        of this gateway with ``abort_all``) end now, each with what it has and finish reason
        abort; a rid not in flight here is no error (it may have finished)."""
        for request_id, sample in list(self._in_flight.items()):
            if abort_all or (sample.rid is not None and sample.rid == rid):
                sample.aborted = True
                if sample.client is not None:
                    await sample.client.abort(request_id)
        return Response(status_code=200)

    async def health_generate(self) -> Response:
        """SGLang's ``/health_generate``: each replica generates a token (a pooling model
        answers a health check) within ``HEALTH_GENERATE_TIMEOUT``; 503 names those that
        did not. It needs no key (a probe's, as SGLang's): callers share the check in
        flight, so however many ask, the engines run one such request at a time."""
        check = self._generation_check
        if check is None or check.done():
            check = self._generation_check = asyncio.ensure_future(self._generate_everywhere())
        failed = await asyncio.shield(check)  # a caller that leaves cancels only itself
        if failed:
            message = f"no token generated within {HEALTH_GENERATE_TIMEOUT:g} s by " + ", ".join(
                failed
            )
            raise APIError(503, message, "service_unavailable_error", SERVER_UNAVAILABLE)
        return Response(status_code=200)

    async def _generate_everywhere(self) -> list[str]:
        """The replicas (with why) that did not generate a token in time, asked at once."""
        info = await self.model()
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

        async def check(replica: Replica) -> str | None:
            try:
                async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT):
                    if info["runner"] != "generate":
                        await replica.client.health()
                        return None
                    request_id = f"health-generate-{uuid.uuid4().hex}"
                    stream = replica.client.generate_batches("Hi", params, request_id=request_id)
                    async with aclosing(stream):
                        async for _ in stream:
                            pass
            except Exception as exc:
                return f"{replica.address} ({type(exc).__name__}: {exc})"
            return None

        results = await asyncio.gather(*(check(r) for r in self.router.replicas))
        return [failure for failure in results if failure is not None]

    async def update_weights(self, path: str) -> Response:
        """SGLang's ``/update_weights_from_disk``, on every replica in turn, each answering (a
        failure stops there: the replicas before it serve the new weights)."""
        for replica in await self.router.every_replica():
            await replica.client.update_weights_from_disk(path)
        return JSONResponse({"success": True, "message": f"serving the weights of {path}"})

    async def reasoning_end_is_a_token(self) -> bool:
        """Whether the model's reasoning ends on one token, which a structured output can
        hold after (asked of a replica once)."""
        if self._reasoning_end_token is None:
            end = markers_of(self.parsers.reasoning).one_end
            ids = (
                []
                if end is None
                else await self._on_replica(
                    "", None, lambda c: c.tokenize(end, add_special_tokens=False)
                )
            )
            self._reasoning_end_token = len(ids) == 1
        return self._reasoning_end_token

    async def check_model(self, name: str | None) -> _Model:
        """The model a request names (None: the served one): the served model or one of its
        LoRA adapters (vLLM's: an adapter is asked for as the model); else a 404."""
        info = await self.model()
        if name is None:
            return _Model(info, info["model_name"], None)
        if name in _served_names(info):  # answered under the name asked for, as vLLM
            return _Model(info, name, None)
        if name not in info["lora_names"]:  # perhaps loaded since (here or elsewhere)
            info = await self.model(fresh=True)
        if name in info["lora_names"]:
            return _Model(info, name, name)
        adapters = ", ".join(f"`{a}`" for a in info["lora_names"])
        raise APIError(
            404,
            f"The model `{name}` does not exist; this server serves "
            + ", ".join(f"`{n}`" for n in _served_names(info))
            + (f" and the LoRA adapters {adapters}." if adapters else "."),
            "not_found_error",
            "model_not_found",
        )

    # ------------------------------------------------------------------ sample streams

    def _outputs(
        self,
        request_id: str,
        samples: list[_Sample],
        body: CompletionRequest | ChatCompletionRequest,
    ) -> Batches:
        """The samples' outputs: generated, or a beam search's best beams."""
        if body.use_beam_search:
            return self._beam_searches(request_id, samples, body.n, body.length_penalty)
        return self.run(request_id, samples)

    async def _beam_searches(
        self, request_id: str, samples: list[_Sample], width: int, length_penalty: float
    ) -> Batches:
        """Each prompt's beam search (with its first sample's parameters): its ``width``
        best beams are its choices, each one finished output, sent when its search ends."""

        async def search(sample: _Sample) -> list[tuple[int, list[StreamOutput]]]:
            params = BeamSearchParams(
                width,
                sample.params.max_tokens,
                sample.params.ignore_eos,
                sample.params.temperature,
                length_penalty,
            )
            found = await self._on_replica(
                sample.prompt,
                sample.lora_name,
                lambda client: client.beam_search(
                    sample.prompt,
                    params,
                    priority=sample.priority,
                    cache_salt=sample.cache_salt,
                    lora_name=sample.lora_name,
                    truncate_prompt_tokens=sample.params.truncate_prompt_tokens,
                    **sample.chat,
                ),
            )
            prompt_ids = found.prompt_token_ids
            return [
                (
                    sample.index + i,
                    [
                        StreamOutput(
                            f"{request_id}-{sample.index + i}",
                            beam.output_token_ids,
                            beam.text,
                            True,
                            beam.finish_reason,
                            len(prompt_ids),
                            len(beam.output_token_ids),
                            prompt_ids,
                        )
                    ],
                )
                for i, beam in enumerate(found.sequences)
            ]

        tasks = [asyncio.ensure_future(search(s)) for s in samples if s.number == 0]
        try:
            for done in asyncio.as_completed(tasks):
                yield await done
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self, request_id: str, samples: list[_Sample]) -> Batches:
        """Every sample's outputs, merged as they come: each batch holds, per choice index,
        all that arrived since the last batch (at least one output); the first failure is
        raised. Closing this iterator cancels the samples, which aborts their requests."""
        in_flight = {f"{request_id}-{s.index}": _InFlight(s.rid) for s in samples}
        self._in_flight.update(in_flight)
        try:
            if len(samples) == 1:  # nothing to merge: read the stream here, no task in between
                only = samples[0]
                async with self._sample_stream(f"{request_id}-{only.index}", only) as (first, rest):
                    yield [(only.index, first)]
                    async for outs in rest:
                        yield [(only.index, outs)]
                return
            queue: asyncio.Queue[tuple[int, list[StreamOutput] | Exception | None]] = (
                asyncio.Queue()
            )
            first_token = {sample.group: asyncio.Event() for sample in samples}
            firsts = {s.group: f"{request_id}-{s.index}" for s in samples if s.number == 0}
            tasks = [
                asyncio.create_task(
                    self._sample(
                        f"{request_id}-{s.index}", s, queue, first_token[s.group], firsts[s.group]
                    )
                )
                for s in samples
            ]
            try:
                remaining = len(tasks)
                while remaining:
                    batch: list[tuple[int, list[StreamOutput]]] = []
                    index, item = await queue.get()
                    while True:
                        if item is None:
                            remaining -= 1
                        elif isinstance(item, Exception):
                            raise item
                        else:
                            batch.append((index, item))
                        if queue.empty():
                            break
                        index, item = queue.get_nowait()
                    if batch:
                        yield batch
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for key in in_flight:
                del self._in_flight[key]

    async def _sample(
        self,
        request_id: str,
        sample: _Sample,
        queue: asyncio.Queue[tuple[int, list[StreamOutput] | Exception | None]],
        first_token: asyncio.Event,
        first_id: str,
    ) -> None:
        try:
            queued_with = None
            if sample.number:  # the first sample of a prompt fills the prefix cache
                await first_token.wait()
                queued_with = first_id  # and this one queues with it
            async with self._sample_stream(request_id, sample, queued_with) as (first, rest):
                first_token.set()
                queue.put_nowait((sample.index, first))
                async for outs in rest:
                    queue.put_nowait((sample.index, outs))
        except Exception as exc:
            if isinstance(exc, InvalidRequestError) and sample.prompt_field is not None:
                exc = InvalidRequestError(f"{sample.prompt_field}: {exc}", exc.code)
            first_token.set()
            queue.put_nowait((sample.index, exc))
            return
        first_token.set()
        queue.put_nowait((sample.index, None))

    @asynccontextmanager
    async def _sample_stream(
        self, request_id: str, sample: _Sample, queued_with: str | None = None
    ) -> AsyncIterator[tuple[list[StreamOutput], AsyncGenerator[list[StreamOutput], None]]]:
        """One sample's first batch of outputs and the stream of the rest, from the replica
        the router picks, reserved there while it is open (closing it aborts the request).
        A replica that fails the sample as unavailable leaves the rotation; if that happens
        before its first output (the replica is gone, drains or lost its executor), another
        replica gets the request: no token has to be taken back. The rest is the SDK's
        own stream, so no generator sits between it and the response."""
        # Without max_tokens a request may run to max_model_len: count it so.
        budget = sample.params.max_tokens or int((await self.model())["max_model_len"])
        _log_request(
            request_id, sample.prompt, sample.params, sample.lora_name, self.options.max_log_len
        )
        in_flight = self._in_flight[request_id]
        if in_flight.aborted:  # by /abort_request before it was sent: it ends with nothing
            yield [StreamOutput(request_id, [], "", finished=True, finish_reason="abort")], _none()
            return
        tried: frozenset[str] = frozenset()
        while True:
            async with self.router.reserve(
                sample.prompt, budget, tried, sample.cache_salt, sample.lora_name
            ) as replica:
                self.metrics.routed.labels(replica.address).inc()
                stream = replica.client.generate_batches(
                    sample.prompt,
                    sample.params,
                    request_id=request_id,
                    priority=sample.priority,
                    cache_salt=sample.cache_salt,
                    lora_name=sample.lora_name,
                    queued_with=queued_with,
                    trace_headers=sample.trace_headers,
                    cap_max_tokens=sample.cap_max_tokens,
                    **sample.chat,
                )
                in_flight.client = replica.client
                async with aclosing(stream):
                    try:
                        first = await self.router.unless_stalled(anext(stream), replica, tried)
                        if in_flight.aborted:  # the abort may have gone before the request did
                            await replica.client.abort(request_id)
                    except ServerUnavailableError as exc:
                        self.router.request_failed(replica, exc)
                        tried |= {replica.address}
                        if not self.router.candidates(tried):
                            raise
                        self.metrics.rerouted.inc()
                        continue
                    try:
                        yield first, stream
                    except ServerUnavailableError as exc:  # after the first output
                        self.router.request_failed(replica, exc)
                        raise
                    return

    # ------------------------------------------------------------------ endpoints

    async def sglang_generate(
        self, body: NativeGenerateRequest, caller: Caller = NO_CALLER
    ) -> Response:
        """SGLang's ``POST /generate`` (``sglang_generate.py``): its prompts as completions."""
        served = await self.check_model(body.lora_path)
        try:
            prompts = body.prompts()
            if isinstance(body.sampling_params, list) and len(body.sampling_params) != len(prompts):
                raise ValueError("sampling_params: give one, or one per prompt")
            if isinstance(body.rid, list) and len(body.rid) != len(prompts):
                raise ValueError("rid: give one per prompt")
            completions = [body.completion_body(i, p) for i, p in enumerate(prompts)]
            # A completion's bound, over the whole batch: each prompt is sampled on its own.
            if (outcomes := sum(c.n for c in completions)) > MAX_CHOICES:
                raise ValueError(
                    f"{len(prompts)} prompt(s) with their n make {outcomes} results, more than "
                    f"{MAX_CHOICES} per request"
                )
        except ValidationError as exc:
            raise APIError(400, _sglang_problems(exc), "invalid_request_error") from None
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_request_error") from None
        defaults = served.info.get("default_sampling_params", {})
        samples: list[_Sample] = []
        rids: list[str] = []
        for group, (prompt, completion) in enumerate(zip(prompts, completions)):
            rid = body.rid_of(group) or uuid.uuid4().hex
            for sample in _samples(
                [prompt],
                completion.n,
                _params_of(completion, defaults),
                completion.priority,
                None,
                served.lora_name,
                caller.trace_headers,
            ):
                rids.append(rid if completion.n == 1 else f"{rid}-{sample.number}")
                sample.rid = rid
                sample.index, sample.group = len(samples), group
                samples.append(sample)
        _, engine_id = _request_ids("generate", caller.request_id)
        started = time.monotonic()
        outputs = self.run(engine_id, samples)
        if body.stream:
            token_ids: list[list[int]] = [[] for _ in samples]

            def chunk(out: StreamOutput, choice: fmt.Choice) -> str:
                ids = token_ids[choice.index]
                ids += out.new_token_ids
                latency = time.monotonic() - started
                done = sglang_result(choice, ids, rids[choice.index], latency, body)
                return fmt.sse({**done, "index": choice.index} if body.is_batch else done).decode()

            return await self._sse(outputs, chunk, len(samples), lambda _: fmt.sse("[DONE]"))
        choices = await self._collect(outputs, len(samples), token_ids=True)
        latency = time.monotonic() - started
        results = [
            sglang_result(c, c.token_ids or [], rids[c.index], latency, body) for c in choices
        ]
        return JSONResponse(results if body.is_batch or len(results) > 1 else results[0])

    async def completions(self, body: CompletionRequest, caller: Caller = NO_CALLER) -> Response:
        served = await self.check_model(body.model)
        try:
            prompts = body.prompts()
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_request_error") from None
        defaults = served.info.get("default_sampling_params", {})
        max_tokens = 1 if body.echo_only else body.max_tokens
        samples = _samples(
            prompts,
            body.n,
            lambda i: body.sampling_params(max_tokens, body.logprobs, i, defaults),
            body.priority,
            body.cache_salt,
            served.lora_name,
            caller.trace_headers,
        )
        for sample in samples:
            sample.params = body.prompt_params(sample.params, prompts[sample.group])
        response_id, engine_id = _request_ids("cmpl", caller.request_id or body.request_id)
        base = {
            "id": response_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": served.name,
        }
        outputs = self._outputs(engine_id, samples, body)
        if body.echo_only:
            outputs = _without_completion(outputs)
        if body.echo:
            outputs = _echoed(
                outputs,
                samples,
                lambda ids: self._on_replica("", None, lambda c: c.detokenize(ids)),
                with_logprobs=body.logprobs is not None,
            )
        if body.return_tokens_as_token_ids:
            outputs = _tokens_as_ids(outputs)
        if body.stream:
            include_usage, every_chunk = self._stream_usage(body.stream_options)
            return await self._sse(
                outputs,
                fmt.ChunkEvents(
                    base, token_ids=body.return_token_ids, usage=every_chunk
                ).completion,
                len(samples),
                self._chunks_ending(base, include_usage, body.n),
            )
        choices = await self._collect(outputs, len(samples), body.return_token_ids)
        return JSONResponse(
            {
                **base,
                "choices": [
                    {
                        "index": c.index,
                        "text": c.text,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                        "logprobs": None
                        if body.logprobs is None
                        else fmt.completion_logprobs(c.merged_logprobs(), 0),
                        **_token_ids(c, prompt_key="prompt_token_ids"),
                        **(
                            {}
                            if body.prompt_logprobs is None
                            else {"prompt_logprobs": c.vllm_prompt_logprobs()}
                        ),
                    }
                    for c in choices
                ],
                "usage": self._usage(choices, body.n),
            }
        )

    async def chat_completions(
        self, body: ChatCompletionRequest, caller: Caller = NO_CALLER
    ) -> Response:
        return await self._chat(body, self._chat_completion, caller)

    async def responses(self, body: ResponsesRequest, caller: Caller = NO_CALLER) -> Response:
        """OpenAI's Responses API: the chat its input makes (after its previous response's
        conversation), answered as output items, and stored unless it says not to."""
        previous = body.previous_response_id
        store = (
            functools.partial(
                self.stored_responses.put, inputs=body.input_items(), previous=previous
            )
            if body.store
            else None
        )
        if previous is not None:
            conversation = self.stored_responses.conversation(previous)
            if conversation is None:
                raise APIError(
                    404,
                    f"previous_response_id {previous[:256]!r}: no such conversation is stored "
                    f"here (a gateway keeps its last {MAX_STORED_RESPONSES} responses in "
                    "memory, of requests that did not set store: false)",
                    "invalid_request_error",
                    param="previous_response_id",
                )
            body = body.continued(conversation)
        try:
            chat = body.chat_request()
        except BodyFieldError as exc:
            raise APIError(400, str(exc), "invalid_request_error", param=exc.field) from None
        try:
            return await self._chat(chat, functools.partial(self._response, body, store), caller)
        except (APIError, InvalidRequestError) as exc:
            raise _in_fields_of(exc, _RESPONSES_FIELDS) from None

    async def stored_response(self, response_id: str, delete: bool = False) -> Response:
        """``GET`` (or ``DELETE``) ``/v1/responses/{id}``: a stored response."""
        stored = self.stored_responses.get(response_id)
        if stored is None or (delete and not self.stored_responses.delete(response_id)):
            raise APIError(
                404,
                f"response {response_id[:256]!r} is not stored here",
                "invalid_request_error",
                param="response_id",
            )
        if delete:
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        return ascii_json(stored.body)

    async def messages(
        self, body: anthropic.MessagesRequest, caller: Caller = NO_CALLER
    ) -> Response:
        """Anthropic's Messages API: the chat its body makes, answered as a message."""
        chat = self._anthropic_chat(body)
        # Anthropic's max_tokens is a bound: an output that reaches the model's context ends
        # there (stop_reason "model_context_window_exceeded").
        respond = functools.partial(self._message, body)
        try:
            return await self._chat(chat, respond, caller, cap_max_tokens=True)
        except (APIError, InvalidRequestError) as exc:
            raise _in_fields_of(exc, _ANTHROPIC_FIELDS) from None

    async def count_message_tokens(self, body: anthropic.CountTokensRequest) -> Response:
        """Anthropic's ``/v1/messages/count_tokens``: the tokens of the prompt its chat makes
        (system prompt, turns and tools, as the model's template renders them)."""
        chat = self._anthropic_chat(body)
        await self.check_model(chat.model)
        ids = await self._on_replica(
            "", None, lambda c: c.tokenize(chat_prompt(chat.messages), **chat.template_args())
        )
        return JSONResponse({"input_tokens": len(ids)})

    def _anthropic_chat(self, body: anthropic.CountTokensRequest) -> ChatCompletionRequest:
        try:
            chat = body.chat_request()
        except BodyFieldError as exc:
            raise APIError(400, str(exc), "invalid_request_error", param=exc.field) from None
        auto = body.tool_choice is None or body.tool_choice.type == "auto"
        if body.tools and auto and self.parsers.tool_call is None:
            raise APIError(
                400,
                'tool_choice "auto" (the default with tools) needs a server started with '
                "--tool-call-parser, which reads the calls out of the model's text; send "
                'tool_choice {"type": "any"}, {"type": "none"} or {"type": "tool", "name": ...}',
                "invalid_request_error",
                param="tool_choice",
            )
        return chat

    async def _message(
        self,
        request: anthropic.MessagesRequest,
        body: ChatCompletionRequest,
        output: ChatOutput,
        model: str,
        response_id: str,
        outputs: Batches,
    ) -> Response:
        """A chat's outputs as Anthropic's message, whole or as events."""
        message_id = f"msg_{response_id[len('chatcmpl-') :]}"
        max_model_len = (await self.model())["max_model_len"]
        if request.stream:
            events = anthropic.MessageEvents(message_id, model, output, max_model_len)
            return await self._sse(
                outputs,
                events.chunk,
                1,
                events.ending,
                opening=events.opening,
                failure=lambda error: events.error(error.message, error.type),
            )
        [choice] = await self._collect(outputs, 1)
        return ascii_json(anthropic.whole_message(message_id, model, output, choice, max_model_len))

    async def _chat(
        self,
        body: ChatCompletionRequest,
        respond: _ChatResponder,
        caller: Caller = NO_CALLER,
        cap_max_tokens: bool = False,
    ) -> Response:
        """Run a chat and ``respond`` with its outputs (``_Sample.cap_max_tokens``)."""
        output = body.chat_output(
            self.parsers,
            self.parsers.reasoning is not None
            and body.asks_structured_output()
            and await self.reasoning_end_is_a_token(),
            self.options.response_role,
        )
        tool_choice = output.tool_choice
        try:
            served = await self.check_model(body.model)
            samples = self._chat_samples(
                body,
                output,
                served.lora_name,
                served.info.get("default_sampling_params", {}),
                caller.trace_headers,
            )
            for sample in samples:
                sample.cap_max_tokens = cap_max_tokens
            response_id, engine_id = _request_ids("chatcmpl", caller.request_id or body.request_id)
            outputs = self._outputs(engine_id, samples, body)
            if body.return_tokens_as_token_ids:
                outputs = _tokens_as_ids(outputs)
            return await respond(body, output, served.name, response_id, outputs)
        except (APIError, InvalidRequestError) as exc:
            # A tool's schema that cannot be held to is the tools' fault, not a
            # structured_output the client never sent.
            if tool_choice is None or tool_choice.kind == "auto":
                raise
            error = _api_error(exc)
            if not error.message.startswith(_TOOL_SCHEMA_FIELD):
                raise
            message = (
                "tool_choice: the schema of the tools' parameters"
                + error.message[len(_TOOL_SCHEMA_FIELD) :]
            )
            raise APIError(400, message, error.type, error.code, "tool_choice") from None

    def _chat_samples(
        self,
        body: ChatCompletionRequest,
        output: ChatOutput,
        lora_name: str | None,
        defaults: dict[str, Any],
        trace_headers: dict[str, str] | None,
    ) -> list[_Sample]:
        tool_choice = output.tool_choice
        if tool_choice is not None and tool_choice.kind == "auto" and tool_choice.parser is None:
            raise APIError(
                400,
                'tool_choice "auto" (the default with tools) needs a server started with '
                "--tool-call-parser, which reads the calls out of the model's text; send "
                'tool_choice "required", "none" or a named function',
                "invalid_request_error",
                param="tool_choice",
            )
        # A structured output of a thinking request holds after its reasoning.
        reasoning_end = (
            output.reasoning_markers.one_end
            if output.thinking and body.asks_structured_output()
            else None
        )
        max_tokens = body.requested_max_tokens()
        logprobs = body.requested_logprobs()
        samples = _samples(
            [chat_prompt(body.messages)],
            body.n,
            lambda i: body.sampling_params(max_tokens, logprobs, i, defaults, reasoning_end),
            body.priority,
            body.cache_salt,
            lora_name,
            trace_headers,
        )
        for sample in samples:
            sample.chat = body.template_args()
            if output.keeps_special_tokens:  # its markers are special tokens
                sample.params = dataclasses.replace(sample.params, skip_special_tokens=False)
        return samples

    async def _chat_completion(
        self,
        body: ChatCompletionRequest,
        output: ChatOutput,
        model: str,
        response_id: str,
        outputs: Batches,
    ) -> Response:
        """A chat's outputs as a chat completion, whole or as chunks."""
        logprobs = body.requested_logprobs()
        created = int(time.time())
        if body.stream:
            base = {
                "id": response_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
            }
            include_usage, every_chunk = self._stream_usage(body.stream_options)
            events = fmt.ChunkEvents(
                base,
                chat_logprobs=logprobs is not None,
                token_ids=body.return_token_ids,
                usage=every_chunk,
            )
            return await self._sse(
                outputs,
                events.chat if output.plain else ChatChunks(events, output).chat,
                body.n,
                self._chunks_ending(base, include_usage, body.n),
                opening=functools.partial(
                    self._chat_role_chunks,
                    base,
                    body.n,
                    output.role,
                    every_chunk,
                    body.return_token_ids,
                ),
            )
        choices = await self._collect(outputs, body.n, body.return_token_ids)
        return JSONResponse(
            {
                "id": response_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                **(
                    {"prompt_token_ids": choices[0].prompt_token_ids}
                    if body.return_token_ids
                    else {}
                ),
                **(
                    {"prompt_logprobs": choices[0].vllm_prompt_logprobs()}
                    if body.prompt_logprobs is not None
                    else {}
                ),
                "choices": [
                    {
                        "index": c.index,
                        **output.message(c),
                        "stop_reason": c.stop_reason,
                        "logprobs": None
                        if logprobs is None
                        else fmt.chat_logprobs(c.merged_logprobs()),
                        **_token_ids(c),
                    }
                    for c in choices
                ],
                "usage": self._usage(choices, body.n),
            }
        )

    async def _response(
        self,
        request: ResponsesRequest,
        store: Callable[[dict[str, Any]], None] | None,
        body: ChatCompletionRequest,
        output: ChatOutput,
        model: str,
        response_id: str,
        outputs: Batches,
    ) -> Response:
        """A chat's outputs as a response of the Responses API, whole or as events."""
        skeleton = response_body(request, f"resp_{response_id[len('chatcmpl-') :]}", model)
        if request.stream:
            events = ResponseEvents(skeleton, output)

            def ending(choices: list[fmt.Choice]) -> bytes:
                data = events.ending(choices)
                if store is not None and events.response is not None:
                    store(events.response)
                return data

            return await self._sse(
                outputs,
                events.chunk,
                1,
                ending,
                opening=events.opening(),
                failure=lambda error: events.error(error.message, error.code, error.param),
            )
        [choice] = await self._collect(outputs, 1)
        response = whole_response(skeleton, output, choice)
        if store is not None:
            store(response)
        return ascii_json(response)  # it echoes the request's tools and text format

    async def embeddings(self, body: EmbeddingRequest) -> Response:
        served = await self.check_model(body.model)
        prompts = _inputs(body)
        options = {
            "dimensions": body.dimensions,
            "normalize": body.normalize,
            "truncate_prompt_tokens": body.truncate_prompt_tokens,
            "priority": body.priority,
        }
        outputs = await self._pool_all(prompts, _input_fields(prompts), options, served.lora_name)
        return JSONResponse(embedding_response(served.name, outputs, body.encoding_format))

    async def classify(self, body: ClassificationRequest) -> Response:
        served = await self.check_model(body.model)
        prompts = _inputs(body)
        options = {
            "activation": body.activation,
            "truncate_prompt_tokens": body.truncate_prompt_tokens,
            "priority": body.priority,
        }
        outputs = await self._pool_all(
            prompts, _input_fields(prompts), options, served.lora_name, "classify"
        )
        labels = served.info.get("labels") or []
        return JSONResponse(classification_response(served.name, outputs, labels))

    async def pooling(self, body: PoolingRequest) -> Response:
        served = await self.check_model(body.model)
        prompts = _inputs(body)
        task = body.task or ("classify" if served.info.get("labels") else "embed")
        try:
            options = body.task_options(task)
        except ValueError as exc:
            param = str(exc).partition(":")[0]
            raise APIError(400, str(exc), "invalid_request_error", param=param) from None
        outputs = await self._pool_all(
            prompts, _input_fields(prompts), options, served.lora_name, task
        )
        return JSONResponse(pooling_response(served.name, outputs, body.encoding_format))

    async def score(self, body: ScoreRequest) -> Response:
        served = await self.check_model(body.model)
        try:
            pairs = body.pairs()
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_request_error", param="text_2") from None
        first, second = body.sides()
        fields = (
            [f"text_1[{i if len(first) > 1 else 0}]" for i in range(len(pairs))],
            [f"text_2[{i}]" for i in range(len(pairs))],
        )
        scores, num_tokens = await self._pair_scores(pairs, fields, body, served)
        return JSONResponse(score_response(served.name, scores, num_tokens))

    async def rerank(self, body: RerankRequest) -> Response:
        served = await self.check_model(body.model)
        pairs = [(body.query, document) for document in body.documents]
        fields = (["query"] * len(pairs), [f"documents[{i}]" for i in range(len(pairs))])
        scores, num_tokens = await self._pair_scores(pairs, fields, body, served)
        return JSONResponse(rerank_response(served.name, body, scores, num_tokens))

    async def _pair_scores(
        self,
        pairs: list[tuple[str, str]],
        fields: tuple[list[str], list[str]],
        body: ScoreRequest | RerankRequest,
        served: _Model,
    ) -> tuple[list[float], int]:
        """Each pair's score and the prompt tokens they took: a cross-encoder's (a
        classifier's, of one label) of the pair encoded together, else the cosine similarity
        of the two texts' embeddings (each distinct text embedded once). ``fields`` name each
        pair's two texts in the body, for an error."""
        options = {"truncate_prompt_tokens": body.truncate_prompt_tokens, "priority": body.priority}
        if served.info.get("labels"):
            names = [f"{a} and {b}" for a, b in zip(*fields, strict=True)]
            options["activation"] = body.activation
            scored = await self._pool_all(pairs, names, options, served.lora_name, "score")
            return [out.score for out in scored], sum(len(o.prompt_token_ids) for o in scored)
        if body.activation is not None:
            raise APIError(
                400,
                "activation: an embedding model scores a pair by the cosine similarity of its "
                "texts' embeddings, which has no activation; leave it out (a cross-encoder's)",
                "invalid_request_error",
                param="activation",
            )
        distinct: dict[str, str] = {}  # text -> the first field that holds it
        for pair, pair_fields in zip(pairs, zip(*fields, strict=True), strict=True):
            for text, field_name in zip(pair, pair_fields, strict=True):
                distinct.setdefault(text, field_name)
        outputs = await self._pool_all(
            list(distinct), list(distinct.values()), options, served.lora_name
        )
        embedded = dict(zip(distinct, outputs))
        scores = [cosine(embedded[a].data, embedded[b].data) for a, b in pairs]
        return scores, sum(len(out.prompt_token_ids) for out in outputs)

    async def _pool_all(
        self,
        prompts: Sequence[str | list[int] | tuple[str, str]],
        fields: list[str],
        options: dict[str, Any],
        lora_name: str | None,
        task: str = "embed",
    ) -> list[Any]:
        """Every prompt's embedding, classification or (of a pair of texts) score; a refusal
        names the field of the prompt refused."""
        request_id = f"{task}-{uuid.uuid4().hex}"

        async def one(i: int) -> Any:
            try:
                return await self._pool(f"{request_id}-{i}", prompts[i], options, lora_name, task)
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"{fields[i]}: {exc}", exc.code) from None

        return await gather_all([one(i) for i in range(len(prompts))])

    async def _pool(
        self,
        request_id: str,
        prompt: str | list[int] | tuple[str, str],
        options: dict[str, Any],
        lora_name: str | None,
        task: str,
    ) -> EmbeddingOutput | ClassificationOutput | ScoreOutput:
        """One input's embedding, classification or score."""
        _log_request(request_id, prompt, options, lora_name, self.options.max_log_len)
        # A pair is routed by its first text: a query's documents go where it is cached.
        routed = prompt[0] if isinstance(prompt, tuple) else prompt

        async def pool(
            client: AsyncWeirClient,
        ) -> EmbeddingOutput | ClassificationOutput | ScoreOutput:
            if isinstance(prompt, tuple):
                return await client.score(
                    *prompt, request_id=request_id, lora_name=lora_name, **options
                )
            call = client.classify if task == "classify" else client.embed
            return await call(prompt, request_id=request_id, lora_name=lora_name, **options)

        return await self._on_replica(routed, lora_name, pool)

    async def _on_replica(
        self,
        prompt: Prompt,
        lora_name: str | None,
        call: Callable[[AsyncWeirClient], Awaitable[T]],
    ) -> T:
        """``call`` on the replica the router picks for ``prompt`` (any, for ""); one that
        cannot take it leaves the rotation and another gets it (nothing was returned yet)."""
        tried: frozenset[str] = frozenset()
        while True:
            async with self.router.reserve(prompt, 0, tried, None, lora_name) as replica:
                self.metrics.routed.labels(replica.address).inc()
                try:
                    return await self.router.unless_stalled(call(replica.client), replica, tried)
                except ServerUnavailableError as exc:
                    self.router.request_failed(replica, exc)
                    tried |= {replica.address}
                    if not self.router.candidates(tried):
                        raise
                    self.metrics.rerouted.inc()

    async def tokenize(self, body: TokenizeBody) -> Response:
        info = (await self.check_model(body.model)).info

        async def tokenize(client: AsyncWeirClient) -> tuple[list[int], list[str] | None]:
            ids = await client.tokenize(
                chat_prompt(body.messages) if body.messages is not None else body.prompt or "",
                add_special_tokens=body.add_special_tokens,
                **body.template_args(),
            )
            strs = await client.convert_ids_to_tokens(ids) if body.return_token_strs else None
            return ids, strs

        ids, strs = await self._on_replica("", None, tokenize)
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": info["max_model_len"],
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, body: DetokenizeBody) -> Response:
        await self.check_model(body.model)
        try:
            text = await self._on_replica("", None, lambda c: c.detokenize(body.tokens))
        except InvalidRequestError as exc:  # an id outside the vocabulary
            message = str(exc).replace("token_ids:", "tokens:", 1)
            raise APIError(400, message, "invalid_request_error", exc.code, "tokens") from None
        return JSONResponse({"prompt": text})

    # ------------------------------------------------------------------ response bodies

    @staticmethod
    async def _collect(
        outputs: Batches,
        num_choices: int,
        token_ids: bool = False,
    ) -> list[fmt.Choice]:
        choices = [fmt.Choice(i, token_ids=[] if token_ids else None) for i in range(num_choices)]
        async with aclosing(outputs):
            async for batch in outputs:
                for index, outs in batch:
                    for out in outs:
                        choices[index].add(out)
        return choices

    @staticmethod
    def _usage(choices: list[fmt.Choice], n: int) -> dict[str, Any]:
        # The n samples of one prompt count its tokens once: the first sample's (the
        # others find the prompt it computed in the cache).
        firsts = choices[::n]
        cached = [c.num_cached_tokens for c in firsts if c.num_cached_tokens is not None]
        return fmt.usage(
            sum(c.prompt_tokens for c in firsts),
            sum(c.completion_tokens for c in choices),
            sum(cached) if len(cached) == len(firsts) else None,  # a beam search's: untold
        )

    async def _sse(
        self,
        outputs: Batches,
        chunk: Callable[[StreamOutput, fmt.Choice], str],
        num_choices: int,
        ending: Callable[[list[fmt.Choice]], bytes],
        *,
        opening: bytes | Callable[[list[tuple[int, list[StreamOutput]]] | None], bytes] = b"",
        failure: Callable[[APIError], bytes] | None = None,
    ) -> StreamingResponse:
        """A server-sent event stream: ``opening`` (or what it makes of the first batch of
        outputs), a ``chunk`` per output, and ``ending``
        of the finished choices; a failure before the first output is still an HTTP error
        status, one after it ``failure``'s events (by default an ``error`` body and
        ``[DONE]``, as vLLM ends a failed chat stream). The chunks of the outputs that
        arrived together go out in one write: a gateway that falls behind catches up
        with fewer, larger writes instead of falling further behind."""
        choices = [fmt.Choice(i) for i in range(num_choices)]

        def events_of(batch: list[tuple[int, list[StreamOutput]]]) -> bytes:
            text = []
            for index, outs in batch:
                choice = choices[index]
                for out in outs:
                    choice.add(out)
                    text.append(chunk(out, choice))
            return "".join(text).encode()

        try:
            first = await anext(outputs)
        except StopAsyncIteration:
            first = None
        except BaseException:
            await outputs.aclose()
            raise

        async def events() -> AsyncIterator[bytes]:
            async with aclosing(outputs):
                head = opening if isinstance(opening, bytes) else opening(first)
                try:
                    if first is not None:
                        head += events_of(first)
                    if head:
                        yield head
                    async for batch in outputs:
                        yield events_of(batch)
                except Exception as exc:
                    error = _api_error(exc)
                    if failure is not None:
                        yield failure(error)
                        return
                    yield fmt.sse(fmt.error_body(error.message, error.type, error.code))
                    yield fmt.sse("[DONE]")  # clients read to it, as after vLLM's errors
                    return
                yield ending(choices)

        return StreamingResponse(events(), media_type="text/event-stream")

    def _stream_usage(self, options: StreamOptions | None) -> tuple[bool, bool]:
        """Whether a stream ends with the usage chunk, and whether every chunk carries its
        choice's usage so far (vLLM's ``should_include_usage``: --enable-force-include-usage
        turns both on, whatever the request's stream_options say)."""
        if self.options.force_include_usage:
            return True, True
        if options is None:
            return False, False
        return options.include_usage, options.usage_in_every_chunk

    def _chunks_ending(
        self, base: dict[str, Any], include_usage: bool, prompts_of: int
    ) -> Callable[[list[fmt.Choice]], bytes]:
        """The end of a chunk stream: the usage chunk, if asked for, and ``[DONE]``."""

        def ending(choices: list[fmt.Choice]) -> bytes:
            usage = {**base, "choices": [], "usage": self._usage(choices, prompts_of)}
            return (fmt.sse(usage) if include_usage else b"") + fmt.sse("[DONE]")

        return ending

    @staticmethod
    def _chat_role_chunks(
        base: dict[str, Any],
        n: int,
        role: str,
        with_usage: bool,
        token_ids: bool,
        first: list[tuple[int, list[StreamOutput]]] | None,
    ) -> bytes:
        """Each choice's first chunk, its ``role``; ``with_usage`` (continuous usage stats), its
        usage too: the prompt (every choice's is the one chat's), nothing completed yet;
        ``token_ids`` (vLLM's return_token_ids), the prompt's token ids."""
        extra: dict[str, Any] = {}
        if token_ids and first:
            extra["prompt_token_ids"] = first[0][1][0].prompt_token_ids
        if with_usage:
            prompt_tokens = first[0][1][0].prompt_tokens if first else 0
            extra["usage"] = fmt.usage(prompt_tokens, 0)
        return b"".join(
            fmt.sse(
                {
                    **base,
                    "choices": [
                        {
                            "index": index,
                            "delta": {"role": role, "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    **extra,
                }
            )
            for index in range(n)
        )


def _body_path(body: Any, loc: Sequence[int | str]) -> list[int | str]:
    """The field at fault in ``body``, as the client wrote it: ``loc`` without the branch
    tags pydantic puts there when a union fails (``messages.1.content.list.0.text``), told
    by their leading nowhere in the body; a missing field, the last step, is kept."""
    path = []
    for step, part in enumerate(loc):
        if isinstance(body, dict) and part in body:
            body = body[part]
        elif isinstance(body, list) and isinstance(part, int) and 0 <= part < len(body):
            body = body[part]
        elif not isinstance(body, dict) or step < len(loc) - 1:
            continue
        path.append(part)
    return path


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Metered:
    """ASGI middleware: count every request by route and status, and time it to its last
    byte (a stream's too)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = _route_label(_route_path(scope))
        start = time.perf_counter()
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)


@dataclass(slots=True)
class _ServerLoad:
    """The requests of ``_LOAD_COUNTED`` routes the gateway is handling now (vLLM's
    server_load_metrics)."""

    in_flight: int = 0


class _LoadTracked:
    """ASGI middleware: vLLM's --enable-server-load-tracking, counting each request of a
    ``_LOAD_COUNTED`` route from when its body has been read until its response's last byte
    is sent (a stream's too) or its client leaves."""

    def __init__(self, app: ASGIApp, load: _ServerLoad) -> None:
        self.app, self.load = app, load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _route_label(_route_path(scope)) not in _LOAD_COUNTED:
            await self.app(scope, receive, send)
            return
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1


class _RequestIdHeader:
    """ASGI middleware: vLLM's --enable-request-id-headers, an X-Request-Id header on every
    response: the request's own, else a random one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = dict(scope["headers"]).get(b"x-request-id", uuid.uuid4().hex.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (b"x-request-id", request_id)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _route_path(scope: Scope) -> str:
    """The path the routes match: without ``--root-path``'s prefix where it has one (as
    Starlette's router takes it), so that both spellings meet the same checks."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


def _authorized(headers: dict[bytes, bytes], api_key: bytes) -> bool:
    """``Authorization: Bearer <key>`` (the scheme in any case, as HTTP has it), or
    Anthropic's ``x-api-key: <key>`` (its SDK's), compared in constant time."""
    scheme, _, credentials = headers.get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), api_key):
        return True
    return hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), api_key)


# Requests as the gateway sends them on, at INFO: `--enable-log-requests` (vLLM's) sets it so.
REQUESTS_LOGGER = "weir.requests"
_requests_log = logging.getLogger(REQUESTS_LOGGER)
# A prompt's repr cut short as it is built (a million token ids are not written out first).
_LOGGED_PROMPT = reprlib.Repr()
_LOGGED_PROMPT.maxstring, _LOGGED_PROMPT.maxlist, _LOGGED_PROMPT.maxdict = 500, 64, 16


def _log_request(
    request_id: str,
    prompt: object,
    params: object,
    lora_name: str | None,
    max_len: int | None = None,
) -> None:
    if not _requests_log.isEnabledFor(logging.INFO):
        return
    lora = f", LoRA adapter {lora_name}" if lora_name else ""
    shown = _LOGGED_PROMPT.repr(prompt) if max_len is None else repr(_cut(prompt, max_len))
    _requests_log.info("request %s: prompt %s, %s%s", request_id, shown, params, lora)


def _cut(value: object, max_len: int) -> object:
    """``value`` with every text cut to ``max_len`` characters and every list to ``max_len``
    items, as vLLM's --max-log-len cuts a logged prompt: a text's characters, a token-id
    prompt's ids (a chat's messages and a pair's texts each too: vLLM cuts the prompt its
    template rendered, which the gateway never sees)."""
    if isinstance(value, str):
        return value[:max_len]
    if isinstance(value, list):
        return [_cut(item, max_len) for item in value[:max_len]]
    if isinstance(value, tuple):
        return tuple(_cut(item, max_len) for item in value)
    if isinstance(value, dict):
        return {key: _cut(item, max_len) for key, item in value.items()}
    return value


_CLIENT_ID = re.compile(r"[\x21-\x7e]{1,200}")


def _params_of(
    body: CompletionRequest, defaults: dict[str, Any]
) -> Callable[[int], SamplingParams]:
    return lambda index: body.sampling_params(body.max_tokens, body.logprobs, index, defaults)


def _sglang_problems(exc: ValidationError) -> str:
    """A translated completion's errors in SGLang's field names."""
    names = dict(SGLANG_FIELD_NAMES)
    problems = []
    for error in exc.errors():
        where = ".".join(names.get(str(part), str(part)) for part in error["loc"])
        problems.append(f"{where}: {error['msg']}" if where else error["msg"])
    return "; ".join(problems)


def _request_ids(prefix: str, client_id: str | None) -> tuple[str, str]:
    """A response's id (``prefix-`` and the client's id, as vLLM's, or a random one) and its
    requests' base id in the engine: the client's id with a random part, since two clients
    may send one id at once, and the engine takes each id once at a time."""
    random_part = uuid.uuid4().hex
    if client_id is None:
        return f"{prefix}-{random_part}", f"{prefix}-{random_part}"
    if not _CLIENT_ID.fullmatch(client_id):
        raise APIError(
            400,
            f"request id {client_id[:100]!r} (X-Request-Id or request_id) must be 1-200 "
            "printable ASCII characters without spaces",
            "invalid_request_error",
        )
    return f"{prefix}-{client_id}", f"{prefix}-{client_id}-{random_part[:12]}"


# JSON arrays and objects one body may hold (its brackets and braces, in strings too): Python
# builds each as a collected object, so parsing 20M empty lists (60 MB) held the event loop
# 6.8 s and took gigabytes; 1M took 0.22 s. A request needs a few per prompt or message.
MAX_JSON_CONTAINERS = 1_000_000


class _Admission:
    """ASGI middleware: what a request must pass before its body is read. Without the API
    key (``/v1/`` routes, ``/tokenize``, ``/detokenize``) it is answered 401, and a body larger than ``max_bytes`` 413 (by
    its Content-Length, or while it streams in), or one of over ``MAX_JSON_CONTAINERS``
    arrays and objects: a client holding neither cannot make the gateway parse, or hold,
    an arbitrary amount of JSON. A body cut short by the client
    leaving is dropped, not run. A browser's CORS preflight, which carries no key, never
    gets here: the CORS middleware outside answers it."""

    def __init__(self, app: ASGIApp, max_bytes: int, api_key: str | None) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.api_key = None if api_key is None else api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        path = _route_path(scope)  # without --root-path's prefix
        if (
            self.api_key is not None
            and (path.startswith("/v1/") or path in _ENGINE_ROUTES)
            and not _authorized(headers, self.api_key)
        ):
            await _send_error(send, _UNAUTHORIZED, scope)
            return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _send_error(send, self._too_large(), scope)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await _send_client_closed(send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await _send_error(send, self._too_large(), scope)
                return
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        if body.count(b"[") + body.count(b"{") > MAX_JSON_CONTAINERS:
            await _send_error(send, _TOO_MANY_CONTAINERS, scope)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:  # after the body: disconnects, which a stream watches for
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"request body larger than this gateway's limit of {self.max_bytes} bytes",
            "invalid_request_error",
            "request_too_large",
        )


_TOO_MANY_CONTAINERS = APIError(
    413,
    f"request body holds over {MAX_JSON_CONTAINERS:,} JSON arrays and objects (its brackets "
    "and braces, in strings too): send fewer at a time",
    "invalid_request_error",
    "request_too_large",
)
_UNAUTHORIZED = APIError(
    401,
    "invalid or missing API key (Authorization: Bearer ..., or x-api-key)",
    "authentication_error",
    "invalid_api_key",
)


async def _send_error(send: Send, error: APIError, scope: Scope) -> None:
    response = error.response(_anthropic_shaped(scope))
    await send(
        {"type": "http.response.start", "status": error.status, "headers": response.raw_headers}
    )
    await send({"type": "http.response.body", "body": response.body})


async def _send_client_closed(send: Send) -> None:
    """Record nginx's 499 for a client that left before its response (no one reads it)."""
    await send({"type": "http.response.start", "status": CLIENT_CLOSED_REQUEST, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def create_app(
    gateway: Gateway,
    on_startup: Callable[[], Awaitable[None]] | None = None,
    root_path: str = "",
    docs: bool = True,
    request_id_headers: bool = False,
    load_tracking: bool = False,
) -> FastAPI:
    """The API's app; ``docs`` False serves no /docs, /redoc or /openapi.json (vLLM's
    --disable-fastapi-docs), ``request_id_headers`` answers every request with an
    X-Request-Id header (vLLM's --enable-request-id-headers), ``load_tracking`` counts the
    requests in flight that /load reports (vLLM's --enable-server-load-tracking; without
    it /load answers 0, as vLLM's)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.router.check_health()
        watcher = asyncio.create_task(gateway.router.watch_health())
        if on_startup is not None:
            await on_startup()
        try:
            yield
        finally:
            watcher.cancel()
            with suppress(asyncio.CancelledError):
                await watcher
            await gateway.router.close()

    # FastAPI's schema and its two pages (its defaults), or none of them.
    app = FastAPI(
        title="Weir",
        version=VERSION,
        lifespan=lifespan,
        openapi_url="/openapi.json" if docs else None,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
    )
    # vLLM's --root-path, as FastAPI's root_path: the routes answer with and without the
    # prefix (uvicorn's would take it only from a proxy that strips it). Set, not passed:
    # the parameter warns as deprecated on every start; the attribute is what it sets.
    app.root_path = root_path

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response(_anthropic_shaped(request.scope))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # A body that is not JSON, an unknown route or method: OpenAI's error shape too.
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = APIError(exc.status_code, str(exc.detail), type_)
        response = error.response(_anthropic_shaped(request.scope))
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> Response:
        anthropic_route = _anthropic_shaped(request.scope)
        if isinstance(exc.body, bytes) and exc.body:  # FastAPI reads only a JSON body
            return _not_json_content(request).response(anthropic_route)
        problems, fields = [], []
        for error in exc.errors():
            if error["type"] == "json_invalid":
                why = error.get("ctx", {}).get("error", error["msg"])
                problems.append(f"the body is not valid JSON: {why}")
                continue
            where = ".".join(str(part) for part in _body_path(exc.body, error["loc"][1:]))
            message = "unsupported field" if error["type"] == "extra_forbidden" else error["msg"]
            problems.append(f"{where}: {message}" if where else message)
            fields.append(where)
        param = fields[0] if fields and fields[0] else None
        error = APIError(400, "; ".join(problems), "invalid_request_error", param=param)
        return error.response(anthropic_route)

    async def answer(call: Awaitable[Response], anthropic_route: bool = False) -> Response:
        try:
            return await call
        except Exception as exc:
            return _api_error(exc).response(anthropic_route)

    async def answer_value(call: Awaitable[T]) -> T | Response:
        """``call``'s value, or the error response of its failure."""
        try:
            return await call
        except Exception as exc:
            return _api_error(exc).response()

    async def answer_connected(
        request: Request, call: Awaitable[Response], anthropic_route: bool = False
    ) -> Response:
        """``answer(call)``, cancelled if the client disconnects first: nothing else notices
        a client leaving before a response exists (a whole body being collected, or a stream
        waiting for its first output), and the cancellation closes the sample streams, which
        aborts their requests."""
        work = asyncio.ensure_future(answer(call, anthropic_route))
        left = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((work, left), return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if not work.done():
                work.cancel()
            await asyncio.gather(work, left, return_exceptions=True)
        if work.cancelled():
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return work.result()

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        caller = Caller.of(request.headers)
        return await answer_connected(request, gateway.completions(body, caller))

    @app.post("/generate")
    async def sglang_generate(request: Request, body: NativeGenerateRequest) -> Response:
        caller = Caller.of(request.headers)
        return await answer_connected(request, gateway.sglang_generate(body, caller))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        caller = Caller.of(request.headers)
        return await answer_connected(request, gateway.chat_completions(body, caller))

    @app.post("/v1/responses")
    async def responses(request: Request, body: ResponsesRequest) -> Response:
        return await answer_connected(request, gateway.responses(body, Caller.of(request.headers)))

    @app.post("/v1/messages")
    async def messages(request: Request, body: anthropic.MessagesRequest) -> Response:
        caller = Caller.of(request.headers)
        return await answer_connected(request, gateway.messages(body, caller), True)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: anthropic.CountTokensRequest) -> Response:
        return await answer(gateway.count_message_tokens(body), True)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> Response:
        return await answer(gateway.stored_response(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return await answer(gateway.stored_response(response_id, delete=True))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request, body: EmbeddingRequest) -> Response:
        return await answer_connected(request, gateway.embeddings(body))

    @app.post("/classify")
    async def classify(request: Request, body: ClassificationRequest) -> Response:
        return await answer_connected(request, gateway.classify(body))

    @app.post("/pooling")
    async def pooling(request: Request, body: PoolingRequest) -> Response:
        return await answer_connected(request, gateway.pooling(body))

    # vLLM's routes for scores and ranks, with and without a version.
    for route in ("/score", "/v1/score"):

        @app.post(route)
        async def score(request: Request, body: ScoreRequest) -> Response:
            return await answer_connected(request, gateway.score(body))

    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):

        @app.post(route)
        async def rerank(request: Request, body: RerankRequest) -> Response:
            return await answer_connected(request, gateway.rerank(body))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterBody) -> Response:
        return await answer(gateway.update_lora(body.lora_name, body.lora_path))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterBody) -> Response:
        return await answer(gateway.update_lora(body.lora_name, None))

    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True) -> Response:
        return await answer(gateway.control("pause", mode, clear_cache))

    @app.post("/resume")
    async def resume() -> Response:
        return await answer(gateway.control("resume"))

    @app.get("/is_paused")
    async def is_paused() -> Response:
        return await answer(gateway.control("is_paused"))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        return await answer(gateway.control("reset_prefix_cache"))

    # SGLang's names of these: what RL frameworks that roll out with SGLang call between
    # rollouts (its pause keeps requests by default: "in_place"; its "abort" is ours).
    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        return await answer(gateway.control("reset_prefix_cache"))

    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        info = await answer_value(gateway.model())
        if isinstance(info, Response):
            return info
        return JSONResponse(
            {
                # SGLang's path is the model's; Weir names it as the API does.
                "model_path": info["model_name"],
                "tokenizer_path": info["model_name"],
                "is_generation": info["runner"] == "generate",
                "preferred_sampling_params": info.get("default_sampling_params") or None,
            }
        )

    @app.post("/abort_request")
    async def abort_request(body: SglangAbortBody) -> Response:
        return await answer(gateway.abort_request(body.rid, body.abort_all))

    @app.get("/health_generate")
    async def health_generate() -> Response:
        return await answer(gateway.health_generate())

    @app.post("/pause_generation")
    async def pause_generation(body: SglangPauseBody | None = None) -> Response:
        # in_place keeps the requests and their KV; retract keeps them, their KV recomputed.
        mode = "in_place" if body is None else body.mode
        keep = mode != "abort"
        return await answer(
            gateway.control("pause", "keep" if keep else "abort", mode != "in_place")
        )

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        return await answer(gateway.control("resume"))

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(body: SglangMemoryBody | None = None) -> Response:
        if body is not None and body.tags is not None and set(body.tags) != set(WAKE_TAGS):
            raise APIError(
                400,
                "tags: Weir releases the weights and the KV cache together (vLLM's sleep "
                "level 1); send no tags, then resume the weights and the cache apart if need be",
                "invalid_request_error",
                param="tags",
            )
        return await answer(gateway.control("sleep", level=1))

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(body: SglangMemoryBody | None = None) -> Response:
        tags: list[str] | None = None if body is None or body.tags is None else [*body.tags]
        return await answer(gateway.control("wake_up", tags=tags))

    @app.post("/start_profile")
    async def start_profile() -> Response:
        return await answer(gateway.control("start_profile"))

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        return await answer(gateway.control("stop_profile"))

    @app.post("/sleep")
    async def sleep(level: int = 1) -> Response:
        return await answer(gateway.control("sleep", level=level))

    @app.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> Response:
        if tags is not None and not set(tags) <= set(WAKE_TAGS):
            raise APIError(
                400,
                f"tags must be some of {WAKE_TAGS}, got {tags!r}",
                "invalid_request_error",
                param="tags",
            )
        return await answer(gateway.control("wake_up", tags=tags))

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        return await answer(gateway.control("is_sleeping"))

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsBody) -> Response:
        return await answer(gateway.update_weights(body.model_path))

    @app.post("/tokenize")
    async def tokenize(request: Request, body: TokenizeBody) -> Response:
        return await answer_connected(request, gateway.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(request: Request, body: DetokenizeBody) -> Response:
        return await answer_connected(request, gateway.detokenize(body))

    # HEAD too, as load balancers probe (uvicorn sends HEAD's answer without its body).
    get = functools.partial(app.api_route, methods=["GET", "HEAD"])

    def model_card(served: _Model) -> dict[str, Any]:
        # vLLM's cards: an adapter's parent is the served model.
        parent = None if served.lora_name is None else served.info["model_name"]
        return {
            "id": served.name,
            "object": "model",
            "created": 0,
            "owned_by": "weir",
            "max_model_len": served.info["max_model_len"],
            "parent": parent,
        }

    @get("/v1/models")
    async def models(request: Request) -> Response:
        shaped = _anthropic_shaped(request.scope)

        async def listing() -> Response:
            info = await gateway.model(fresh=True)  # adapters come and go
            names = [*_served_names(info), *info["lora_names"]]
            if shaped:
                return JSONResponse(anthropic.model_list(names))
            cards = [model_card(await gateway.check_model(name)) for name in names]
            return JSONResponse({"object": "list", "data": cards})

        return await answer(listing(), shaped)

    @get("/v1/models/{name:path}")  # a path: served names may hold slashes (org/model)
    async def model(request: Request, name: str) -> Response:
        if not name:  # /v1/models/: the list, as the other routes take a trailing slash
            return await models(request)
        shaped = _anthropic_shaped(request.scope)

        async def card() -> Response:
            served = await gateway.check_model(name)
            return JSONResponse(anthropic.model_info(name) if shaped else model_card(served))

        return await answer(card(), shaped)

    @get("/health")
    async def health() -> Response:
        # Ready while requests have somewhere to go: a replica replacing its executor, or
        # stalled, queues them (a pause), so it keeps the gateway in its Service.
        candidates = gateway.router.candidates()
        status = "unavailable" if not candidates else candidates[0].status or "stalled"
        replicas = {r.address: r.healthy for r in gateway.router.replicas}
        return JSONResponse({"status": status, "replicas": replicas}, 200 if candidates else 503)

    # SageMaker's container contract, as vLLM serves it: /ping is the health check and
    # /invocations takes a chat, completion, embeddings or classification body, told apart by
    # its fields (messages, prompt, input: a classifier's classified, else embedded).
    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json" and not (
            media.startswith("application/") and media.endswith("+json")
        ):  # FastAPI's rule for the other routes' bodies
            return _not_json_content(request).response()
        try:
            body = await request.json()
        except (ValueError, RecursionError):  # RecursionError: arrays nested too deep
            return APIError(400, "the body is not valid JSON", "invalid_request_error").response()
        if not isinstance(body, dict) or not {"messages", "prompt", "input"} & body.keys():
            message = "an invocation is a chat (messages), a completion (prompt) or an input"
            return APIError(400, message, "invalid_request_error").response()
        kind: type[Any]
        route: Callable[[Request, Any], Awaitable[Response]]
        if "messages" in body:
            kind, route = ChatCompletionRequest, chat_completions
        elif "prompt" in body:
            kind, route = CompletionRequest, completions
        else:
            info = await answer_value(gateway.model())
            if isinstance(info, Response):
                return info
            labels = info.get("labels")
            kind, route = (
                (ClassificationRequest, classify) if labels else (EmbeddingRequest, embeddings)
            )
        try:
            parsed: Any = kind.model_validate(body)
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
            return await invalid_body(request, RequestValidationError(errors, body=body))
        return await route(request, parsed)

    @get("/version")
    async def version() -> Response:
        return JSONResponse({"version": VERSION})

    load = _ServerLoad()

    @get("/load")
    async def server_load() -> Response:
        return JSONResponse({"server_load": load.in_flight})

    @get("/metrics")
    async def metrics(request: Request) -> Response:
        # Text or OpenMetrics, as the scraper asks (as every Weir metrics endpoint does).
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        registry = await gateway.engine_metrics.registry(gateway.metrics.registry)
        return Response(encode(registry), media_type=content_type)

    if load_tracking:  # inside the key and size checks: a refused request is never counted
        app.add_middleware(_LoadTracked, load=load)
    app.add_middleware(_Admission, max_bytes=gateway.max_request_bytes, api_key=gateway.api_key)
    # Outside the key check: a browser's preflight carries no key, and a page reads a 401 or
    # a 413 only with the CORS headers on it. No credentials, as vLLM: the key is a header.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=gateway.allowed_origins,
        allow_methods=["*"],
        allow_headers=["*"],
    )
    app.add_middleware(_Metered, metrics=gateway.metrics)
    if request_id_headers:  # outermost: a 401, a 413 and a preflight carry it too
        app.add_middleware(_RequestIdHeader)
    return app
