"""Client SDK for a running Weir scheduler (ZeroMQ DEALER, msgpack messages).

    async with AsyncWeirClient("tcp://127.0.0.1:8100") as client:
        async for out in client.generate("Hello", SamplingParams(max_tokens=8)):
            print(out.text, end="")

``WeirClient`` offers the same methods synchronously. Leaving a stream early
(``break``, ``aclose()``, task cancellation, closing the client) aborts the
request on the server, which frees its KV blocks. ``keys_dir`` (default
``$WEIR_KEYS_DIR``) names the CurveZMQ keys of a server that requires them
(``weir keys``): the client then encrypts and proves it holds the client key.
Errors are typed:
``InvalidRequestError`` carries the server's message, ``EngineError`` reports an
executor failure, ``ServerUnavailableError`` says the server cannot take the request
now: it replaces what would otherwise be a hang when the server does not answer within
``timeout`` seconds, and comes at once when the server refuses the client's keys (or
their absence) or refuses requests (no executor yet, or draining).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import os
import threading
import uuid
import weakref
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import numpy as np
import zmq
import zmq.asyncio

from weir.shared.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    beam_search,
    first_token_logprobs,
)
from weir.shared.config import DEFAULT_ADDRESS, DEFAULT_MAX_MESSAGE_BYTES
from weir.shared.image_urls import chat_images
from weir.shared.keys import ClientKeys, HandshakeMonitor, connect_curve
from weir.shared.keys import keys_dir as resolve_keys_dir
from weir.shared.pooling import PoolingParams
from weir.shared.protocol.client import (
    ENGINE_ERROR,
    INVALID_REQUEST,
    MAX_ARRAY_LEN,
    MAX_HEALTH_STREAM_IDS,
    NO_CHAT_ARGS,
    SERVER_UNAVAILABLE,
    AbortRequest,
    ChatTemplateArgs,
    ClientMessage,
    ClientProtocolError,
    DetokenizeRequest,
    EngineControlRequest,
    ErrorReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    LoraAdapterRequest,
    ModelInfoReply,
    ModelInfoRequest,
    Prompt,
    StreamOutput,
    TextOrChat,
    TokenizeRequest,
    decode_server_message,
    encode_client_message,
    request_id_problem,
)
from weir.shared.protocol.envelope import ProtocolError, encoding_problem
from weir.shared.sampling import SamplingParams
from weir.shared.zmq_send import send_now

_log = logging.getLogger(__name__)
T = TypeVar("T")


# Loop turns a stream left with `break` may take to close (its finalizer task's first step).
_FINALIZER_TURNS = 3


class WeirError(Exception):
    """Base of every error the SDK raises."""


class InvalidRequestError(WeirError, ValueError):
    """The server rejected a request; ``code`` and the message come from the server. A
    ``ValueError`` too, as vLLM's ``LLM`` raises for a bad request."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class EngineError(WeirError):
    """The server accepted the request but could not finish it (e.g. an executor died)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class ServerUnavailableError(WeirError):
    """The server cannot take the request now; another replica, or a later try, may.

    No reply within the client's timeout, the connection lost, the client's keys refused,
    or the server's own refusal (no executor connected yet, or draining on SIGTERM)."""

    code = SERVER_UNAVAILABLE


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding (``embed``): ``data`` is its float32 little-endian bytes
    (what OpenAI's base64 encoding carries), ``embedding`` the same as floats."""

    request_id: str
    data: bytes
    prompt_token_ids: list[int]

    @property
    def outputs(self) -> EmbeddingOutput:
        """vLLM's ``EmbeddingRequestOutput.outputs`` (``out.outputs.embedding``): this output
        itself, so that code written for vLLM reads it too."""
        return self

    @property
    def embedding(self) -> list[float]:
        return list(np.frombuffer(self.data, dtype="<f4").tolist())


@dataclass(slots=True)
class ClassificationOutput:
    """One prompt's classification (``classify``): ``probs`` holds a score per label of the
    classifier (by index; its probabilities, or its logits where asked without
    activation), ``data`` the same as float32 little-endian bytes."""

    request_id: str
    data: bytes
    prompt_token_ids: list[int]

    @property
    def outputs(self) -> ClassificationOutput:
        """vLLM's ``ClassificationRequestOutput.outputs`` (``out.outputs.probs``): this output
        itself, so that code written for vLLM reads it too."""
        return self

    @property
    def probs(self) -> list[float]:
        return list(np.frombuffer(self.data, dtype="<f4").tolist())


@dataclass(slots=True)
class ScoreOutput:
    """A pair's score (``score``) by a cross-encoder: its one label's probability (its
    logit where asked without activation), or, from ``LLM.score`` with an embedding model,
    the cosine similarity of the two texts' embeddings."""

    request_id: str
    score: float
    prompt_token_ids: list[int]

    @property
    def outputs(self) -> ScoreOutput:
        """vLLM's ``ScoringRequestOutput.outputs`` (``out.outputs.score``): this output
        itself, so that code written for vLLM reads it too."""
        return self


@overload
def _chat_texts(prompt: TextOrChat) -> TextOrChat: ...


@overload
def _chat_texts(prompt: Prompt) -> Prompt: ...


def _chat_texts(prompt: Prompt) -> Prompt:
    """A chat's messages as the protocol takes them, from OpenAI's forms (as the gateway and
    vLLM's ``LLM.chat`` read them): a null content is empty (an assistant's tool-call turn),
    text parts are joined with newlines. Anything else is left to the server to refuse."""
    if not isinstance(prompt, list) or not prompt or not isinstance(prompt[0], dict):
        return prompt
    return [_message_text(message) for message in prompt]


def _message_text(message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if content is None:  # also left out, as OpenAI's assistant turn with tool_calls may
        return {**message, "content": ""}
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return {**message, "content": "\n".join(part["text"] for part in content)}
    return message


def _error_from_reply(reply: ErrorReply) -> WeirError:
    if reply.code == SERVER_UNAVAILABLE:
        return ServerUnavailableError(reply.message)
    if reply.code == ENGINE_ERROR:
        return EngineError(reply.message, reply.code)
    return InvalidRequestError(reply.message, reply.code)


class _Inbox:
    """One stream's outputs not yet taken, and the error that ended it. Cheaper than an
    ``asyncio.Queue`` per output (no getter bookkeeping), and its reader takes all that
    arrived at once. Outputs that arrive after the stream failed are dropped."""

    __slots__ = ("outputs", "error", "ended", "given_up", "_waiter")

    def __init__(self) -> None:
        self.outputs: list[StreamOutput] = []
        self.error: WeirError | None = None
        self.ended = False  # its last output was taken, or its error raised
        # Failed by this client (the server silent), not by the server: it may still run it.
        self.given_up = False
        self._waiter: asyncio.Future[None] | None = None

    def put(self, out: StreamOutput) -> None:
        if self.error is None:
            self.outputs.append(out)
            self._wake()

    def fail(self, error: WeirError) -> None:
        if self.error is None:
            self.error = error
            self._wake()

    def give_up(self, error: WeirError) -> None:
        if self.error is None:
            self.given_up = True
            self.fail(error)

    def answered(self) -> bool:
        """Whether the server had its last word: its finished output is here, or it failed
        (an error reply, or the server lost it or us), not given up on by this client."""
        if self.error is not None:
            return not self.given_up
        return bool(self.outputs and self.outputs[-1].finished)

    def idle(self) -> bool:
        return not self.outputs and self.error is None

    async def take(self) -> list[StreamOutput]:
        """Every output not yet taken (at least one), or the stream's error; the stream
        ends with a finished output."""
        while not self.outputs:
            if self.error is not None:
                self.ended = True
                raise self.error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        outputs, self.outputs = self.outputs, []
        self.ended = outputs[-1].finished
        return outputs

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class AsyncWeirClient:
    """asyncio client; create and use it inside one running event loop."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float = 30.0,
        keys_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if not (isinstance(timeout, int | float) and 0 < timeout < math.inf):
            raise ValueError(f"timeout must be a number of seconds > 0, not {timeout!r}")
        self.address = address
        self.timeout = timeout
        # The server's --max-message-size (model_info says it): a larger message would cost
        # the connection, and with it every stream of this client, so it is refused here.
        self.max_message_size = DEFAULT_MAX_MESSAGE_BYTES
        directory = resolve_keys_dir(keys_dir)
        try:
            keys = None if directory is None else ClientKeys.load(directory)
        except ValueError as exc:
            raise WeirError(str(exc)) from None
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IPV6, 1)  # a server at tcp://[::1]:PORT (IPv4 ones too)
        if keys is not None:
            connect_curve(self._sock, keys.own, keys.server_public)
            self._no_reply_hint = f"; or it does not accept the keys in {directory}"
        else:
            # A server with keys drops a client without them before any message: say so.
            self._no_reply_hint = (
                "; if it requires CurveZMQ keys, pass their folder (keys_dir, --keys-dir) or "
                "set $WEIR_KEYS_DIR"
            )
        self._handshakes = HandshakeMonitor(self._sock, address, "client", self._connection_lost)
        self._refusal: str | None = None  # why the server dropped us for good
        try:
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            self._handshakes.close()
            self._sock.close()
            self._ctx.term()
            raise WeirError(
                f"cannot connect to {address!r}: {zmq.strerror(exc.errno) if exc.errno else exc}"
                " (an address is tcp://HOST:PORT or ipc://PATH)"
            ) from None
        self._streams: dict[str, _Inbox] = {}
        # Streams that received an output (or started) since the stream watch last looked.
        self._heard: set[str] = set()
        self._replies: dict[str, asyncio.Future[Any]] = {}
        # Streams left before the server's last word on them: that word, when it comes,
        # resolves the future; until then their id is not sent again (``_wait_until_left``).
        self._leaving: dict[str, asyncio.Future[None]] = {}
        self._receiver: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._stream_watch: asyncio.Task[None] | None = None
        self._closed = False

    async def __aenter__(self) -> AsyncWeirClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        cap_max_tokens: bool = False,
        trace_headers: Mapping[str, str] | None = None,
        images: Sequence[bytes] = (),
    ) -> AsyncGenerator[StreamOutput, None]:
        """Stream one request's outputs; the request is sent on the first iteration.
        ``priority``: lower is served first by a server started with ``--policy priority``
        (any other refuses a priority other than 0). A chat's template renders ``tools``
        (OpenAI's), and ``chat_template_kwargs`` as more variables (``enable_thinking``...);
        ``add_generation_prompt`` false ends the prompt at the last message, and
        ``continue_final_message`` renders that message open for the model to go on with
        (vLLM's chat fields). ``cache_salt``: the prompt's cached KV blocks are shared only
        with requests of the same salt (vLLM's; one per tenant). ``lora_name``: the LoRA
        adapter (of the server's ``--lora-modules``) the request runs through.
        ``cap_max_tokens``: a ``max_tokens`` that does not fit ``max_model_len`` after the
        prompt is cut to what does (the output ends there, "length"), as vLLM's offline
        ``LLM``, instead of refused as its API refuses it. ``trace_headers``: the W3C trace
        context (``traceparent``, ``tracestate``) whose trace the request's span joins on a
        server that exports traces (``--otlp-traces-endpoint``). ``images``: encoded images
        (PNG, JPEG...) for a model that takes them, one for each ``{"type": "image"}`` part
        of a chat or ``<image>`` of a text, in order; a chat's OpenAI ``image_url`` parts
        (data URLs) bring their own."""
        chat = _chat_args(
            tools, chat_template_kwargs, add_generation_prompt, continue_final_message
        )
        await self._wait_until_left(request_id)
        with self._open_stream(
            prompt,
            sampling_params,
            request_id,
            priority,
            chat,
            cache_salt,
            lora_name,
            cap_max_tokens=cap_max_tokens,
            trace_headers=trace_headers,
            images=images,
        ) as inbox:
            while not inbox.ended:
                for out in await inbox.take():
                    yield out

    async def generate_batches(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        queued_with: str | None = None,
        cap_max_tokens: bool = False,
        trace_headers: Mapping[str, str] | None = None,
        images: Sequence[bytes] = (),
    ) -> AsyncGenerator[list[StreamOutput], None]:
        """``generate``, but each iteration yields every output that has arrived since the
        last (at least one): a caller that writes each output somewhere (a socket) can
        write them together when it falls behind. ``queued_with``: the id of a request of
        this client in flight whose arrival it takes (the protocol's)."""
        chat = _chat_args(
            tools, chat_template_kwargs, add_generation_prompt, continue_final_message
        )
        await self._wait_until_left(request_id)
        with self._open_stream(
            prompt,
            sampling_params,
            request_id,
            priority,
            chat,
            cache_salt,
            lora_name,
            queued_with=queued_with,
            cap_max_tokens=cap_max_tokens,
            trace_headers=trace_headers,
            images=images,
        ) as inbox:
            while not inbox.ended:
                yield await inbox.take()

    async def embed(
        self,
        prompt: str | list[int],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> EmbeddingOutput:
        """The embedding of a text or of token ids, from a server with the pooling runner
        (``--runner pooling``; vLLM's pooling parameters): ``dimensions`` keeps the first n
        of a Matryoshka model's, ``normalize`` overrides the server's choice,
        ``truncate_prompt_tokens`` keeps the prompt's last k tokens (-1: as many as fit)."""
        pooled = await self._pool(
            prompt,
            lambda: PoolingParams(dimensions, normalize),
            truncate_prompt_tokens,
            request_id,
            priority,
            cache_salt,
            lora_name,
        )
        return EmbeddingOutput(*pooled)

    async def classify(
        self,
        prompt: str | list[int],
        *,
        activation: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> ClassificationOutput:
        """The classification of a text or of token ids by a server's sequence classifier
        (vLLM's ``classify``): a score per label, the probabilities unless ``activation``
        is False (then the logits)."""
        pooled = await self._pool(
            prompt,
            lambda: PoolingParams(task="classify", activation=activation),
            truncate_prompt_tokens,
            request_id,
            priority,
            cache_salt,
            lora_name,
        )
        return ClassificationOutput(*pooled)

    async def score(
        self,
        text_1: str,
        text_2: str,
        *,
        activation: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> ScoreOutput:
        """The score of a pair of texts by a server's cross-encoder (a sequence classifier of
        one label, as rerankers are): the two encoded together as the tokenizer encodes a
        pair, then classified; its probability unless ``activation`` is False."""
        request_id_, data, prompt_ids = await self._pool(
            text_1,
            lambda: PoolingParams(task="score", activation=activation, text_pair=text_2),
            truncate_prompt_tokens,
            request_id,
            priority,
            cache_salt,
            lora_name,
        )
        return ScoreOutput(request_id_, float(np.frombuffer(data, dtype="<f4")[0]), prompt_ids)

    async def beam_search(
        self,
        prompt: Prompt,
        params: BeamSearchParams,
        *,
        priority: int = 0,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> BeamSearchOutput:
        """vLLM's beam search (``weir.shared.beam_search``) of a text, token ids or a chat
        (its template arguments as ``generate``'s; ``truncate_prompt_tokens``: its last k
        tokens, -1 as many as leave room for one more): the best ``params.beam_width``
        beams, best first. Each step is one one-token request per live beam."""
        info = await self.model_info()
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            prompt_ids = list(prompt)
        else:
            prompt_ids = await self.tokenize(
                prompt,  # type: ignore[arg-type]
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                continue_final_message=continue_final_message,
            )
        if truncate_prompt_tokens is not None:
            keep = truncate_prompt_tokens
            if type(keep) is not int or not (keep == -1 or 1 <= keep <= info["max_model_len"]):
                raise InvalidRequestError(
                    f"truncate_prompt_tokens must be -1 or in [1, max_model_len], got {keep!r}",
                    INVALID_REQUEST,
                )
            prompt_ids = prompt_ids[-(int(info["max_model_len"]) - 1 if keep == -1 else keep) :]
        room = int(info["max_model_len"]) - len(prompt_ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if not 1 <= max_tokens <= room:
            raise InvalidRequestError(
                f"the prompt's {len(prompt_ids)} tokens and max_tokens {max_tokens} are more "
                f"than max_model_len {info['max_model_len']}",
                INVALID_REQUEST,
            )

        async def next_tokens(ids: list[int], n: int) -> list[tuple[int, float]]:
            one = SamplingParams(
                max_tokens=1, temperature=params.temperature, logprobs=n, ignore_eos=True
            )
            stream = self.generate(
                ids, one, priority=priority, cache_salt=cache_salt, lora_name=lora_name
            )
            return await first_token_logprobs(stream)

        return await beam_search(
            prompt_ids,
            params,
            max_tokens,
            info["eos_token_id"],
            next_tokens,
            gather_all,
            self.detokenize,
        )

    async def _pool(
        self,
        prompt: str | list[int],
        pooling_params: Callable[[], PoolingParams],
        truncate_prompt_tokens: int | None,
        request_id: str | None,
        priority: int,
        cache_salt: str | None,
        lora_name: str | None,
    ) -> tuple[str, bytes, list[int]]:
        """A pooling request's (request id, vector's bytes, prompt's token ids)."""
        try:
            pooling = pooling_params()
            params = SamplingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), INVALID_REQUEST) from None
        await self._wait_until_left(request_id)
        with self._open_stream(
            prompt, params, request_id, priority, NO_CHAT_ARGS, cache_salt, lora_name, pooling
        ) as inbox:
            while True:
                for out in await inbox.take():
                    if not out.finished:
                        continue
                    if out.embedding is None:
                        raise EngineError(
                            f"request {out.request_id!r} ended ({out.finish_reason}) without "
                            f"its {pooling.task} vector",
                            ENGINE_ERROR,
                        )
                    return out.request_id, out.embedding, out.prompt_token_ids or []

    async def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    async def health(self) -> dict[str, Any]:
        """Server status (``status``, running/waiting counts, KV usage); raises on timeout."""
        reply: HealthReply = await self._request(HealthRequest(uuid.uuid4().hex))
        return reply.info

    async def model_info(self) -> dict[str, Any]:
        reply: ModelInfoReply = await self._request(ModelInfoRequest(uuid.uuid4().hex))
        self.max_message_size = reply.info.get("max_message_size", self.max_message_size)
        return reply.info

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Serve the PEFT adapter in directory ``lora_path`` (on the server's machines) as
        ``lora_name``, on a server started with ``--allow-runtime-lora-updating``; returns
        the model info, which lists the adapters."""
        # Answered with the model info, which lists the adapters.
        reply: ModelInfoReply = await self._request(
            LoraAdapterRequest(uuid.uuid4().hex, lora_name, lora_path)
        )
        return reply.info

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Stop serving ``lora_name`` (refused while requests of it are in flight; an
        unknown name raises ``InvalidRequestError`` with code ``not_found``)."""
        reply: ModelInfoReply = await self._request(LoraAdapterRequest(uuid.uuid4().hex, lora_name))
        return reply.info

    async def pause(
        self, mode: str = "abort", clear_cache: bool = True, timeout: float = 600.0
    ) -> None:
        """Stop the engine's steps until ``resume`` (vLLM's ``pause_generation``, for weight
        updates): ``mode`` "abort" ends the requests in flight (each gets what it has, with
        finish reason "abort"), "wait" lets them finish first (requests that arrive meanwhile
        wait), "keep" holds them where they are. Returns once no step runs. ``clear_cache``
        drops every cached block: requests held are computed again on resuming. Requests
        sent while paused wait. ``timeout``: how long to wait for it (with "wait", the
        requests in flight may take long)."""
        request = EngineControlRequest(uuid.uuid4().hex, "pause", mode, clear_cache)
        await self._request(request, max(timeout, self.timeout))

    async def resume(self) -> None:
        await self._request(EngineControlRequest(uuid.uuid4().hex, "resume"))

    async def is_paused(self) -> bool:
        reply = await self._request(EngineControlRequest(uuid.uuid4().hex, "is_paused"))
        return bool(reply.info["is_paused"])

    async def reset_prefix_cache(self) -> None:
        """vLLM's: no later request reads a block cached before."""
        await self._request(EngineControlRequest(uuid.uuid4().hex, "reset_prefix_cache"))

    async def update_weights_from_disk(self, model_path: str, timeout: float = 600.0) -> None:
        """Serve the weights of model directory ``model_path`` (on the server's machines,
        its config.json the served model's) from now on, as SGLang's update_weights_from_disk:
        the engine pauses keeping its requests, drops its cache, the executors load the
        weights, and it resumes (the requests in flight computed again with them; an engine
        paused before stays paused). ``InvalidRequestError`` where they do not fit the model or
        cannot be loaded: the server then serves the weights it served before."""
        request = EngineControlRequest(uuid.uuid4().hex, "update_weights", path=model_path)
        await self._request(request, max(timeout, self.timeout))

    async def sleep(self, level: int = 1, timeout: float = 600.0) -> None:
        """vLLM's sleep mode, to lend the device to a trainer: the engine pauses keeping its
        requests, and its executors free the KV cache and, at ``level`` 1, move the weights
        to host memory (on a GPU), at level 2 free them too (read again from disk on
        waking). Requests sent meanwhile wait for ``wake_up``."""
        request = EngineControlRequest(uuid.uuid4().hex, "sleep", level=level)
        await self._request(request, max(timeout, self.timeout))

    async def wake_up(self, tags: list[str] | None = None, timeout: float = 600.0) -> None:
        """The executors take their weights and KV cache back (vLLM's ``tags``: "weights" or
        "kv_cache" alone, the weights first, so that new weights load before the cache
        returns); once both are back the engine resumes (unless it was paused before
        ``sleep``)."""
        request = EngineControlRequest(uuid.uuid4().hex, "wake_up", tags=tags)
        await self._request(request, max(timeout, self.timeout))

    async def is_sleeping(self) -> bool:
        reply = await self._request(EngineControlRequest(uuid.uuid4().hex, "is_sleeping"))
        return bool(reply.info["is_sleeping"])

    async def start_profile(self) -> None:
        """vLLM's: from the next step on, the executors record torch.profiler traces (a
        server started with --profiler-dir; else ``InvalidRequestError``)."""
        await self._request(EngineControlRequest(uuid.uuid4().hex, "start_profile"))

    async def stop_profile(self) -> None:
        """vLLM's: the executors stop recording and write their traces and tables under the
        server's --profiler-dir (on the executors' machines), then this returns."""
        await self._request(EngineControlRequest(uuid.uuid4().hex, "stop_profile"))

    async def tokenize(
        self,
        prompt: str | list[dict[str, Any]],
        *,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """The token ids of a text or a chat (rendered by the model's template as
        ``generate`` renders it). ``add_special_tokens`` (the model's BOS...): by default as
        a generate request's prompt has them, a text's yes, a chat's no (its template writes
        them)."""
        if add_special_tokens is None:
            add_special_tokens = isinstance(prompt, str)
        chat = _chat_args(
            tools, chat_template_kwargs, add_generation_prompt, continue_final_message
        )
        request = TokenizeRequest(uuid.uuid4().hex, _chat_texts(prompt), add_special_tokens, chat)
        return list((await self._request(request)).info["token_ids"])

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids, special tokens included."""
        reply = await self._request(DetokenizeRequest(uuid.uuid4().hex, list(token_ids)))
        return str(reply.info["text"])

    async def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's entry in the vocabulary (transformers' ``convert_ids_to_tokens``: byte
        level pieces as written there, e.g. ``"Ġworld"``)."""
        request = DetokenizeRequest(uuid.uuid4().hex, list(token_ids), as_tokens=True)
        return list((await self._request(request)).info["tokens"])

    async def close(self) -> None:
        """Abort every open stream and close the socket; a stream or reply waited on
        meanwhile raises ``WeirError``."""
        if self._closed:
            return
        for request_id in list(self._streams):
            self._send(AbortRequest(request_id))
        self._closed = True
        closed = WeirError("client is closed")
        for inbox in self._streams.values():
            inbox.fail(closed)
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(closed)
        for request_id in list(self._leaving):
            self._left(request_id)
        tasks = [t for t in (self._receiver, self._watcher, self._stream_watch) if t is not None]
        for task in tasks:
            task.cancel()
        try:
            if tasks:
                # Waited for, not awaited: their CancelledError is not this caller's, which
                # (a cancelled close) still comes through.
                await asyncio.wait(tasks)
        finally:
            self._handshakes.close()
            # LINGER 0 would drop the aborts just queued; give them a moment to leave.
            self._sock.close(linger=200)
            self._ctx.term()

    # ------------------------------------------------------------ internals

    @contextmanager
    def _open_stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None,
        request_id: str | None,
        priority: int,
        chat: ChatTemplateArgs,
        cache_salt: str | None,
        lora_name: str | None,
        pooling_params: PoolingParams | None = None,
        queued_with: str | None = None,
        cap_max_tokens: bool = False,
        trace_headers: Mapping[str, str] | None = None,
        images: Sequence[bytes] = (),
    ) -> Iterator[_Inbox]:
        """Send a request and hold its inbox; leaving before its last output aborts it."""
        request_id = request_id or uuid.uuid4().hex
        # The server cannot address its refusal of an unusable id to this stream.
        if (problem := request_id_problem(request_id)) is not None:
            raise InvalidRequestError(problem, INVALID_REQUEST)
        # Nor its refusal of a message it cannot decode (the stream would wait for its timeout).
        if isinstance(prompt, list) and len(prompt) > MAX_ARRAY_LEN:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} items; requests carry at most {MAX_ARRAY_LEN}",
                INVALID_REQUEST,
            )
        if request_id in self._streams:
            raise InvalidRequestError(
                f"request_id {request_id!r} is already streaming", "duplicate_request_id"
            )
        try:
            prompt, found = chat_images(_chat_texts(prompt))
        except ValueError as exc:
            raise InvalidRequestError(str(exc), INVALID_REQUEST) from None
        if found and images:
            raise InvalidRequestError(
                "a chat's image_url parts bring their images: send no images beside them",
                INVALID_REQUEST,
            )
        # Sent before the stream exists: a request that cannot be sent leaves nothing to abort.
        self._send(
            GenerateRequest(
                request_id,
                prompt,
                sampling_params or SamplingParams(),
                priority,
                chat,
                cache_salt,
                lora_name,
                pooling_params,
                queued_with,
                cap_max_tokens,
                None if trace_headers is None else dict(trace_headers),
                found or list(images),
            )
        )
        inbox = _Inbox()
        self._streams[request_id] = inbox
        self._heard.add(request_id)
        try:
            yield inbox
        finally:
            del self._streams[request_id]
            # A stream given up on after the server fell silent may still run there: a server
            # that comes back frees it, and its id waits for that (or the timeout) as a left
            # stream's does.
            if (not inbox.ended or inbox.given_up) and not self._closed:
                self._send(AbortRequest(request_id))
                if not inbox.answered():
                    self._leaving[request_id] = asyncio.get_running_loop().create_future()

    async def _wait_until_left(self, request_id: str | None) -> None:
        """An id sent again right after its stream was left: wait (at most ``timeout``) for
        the server's last word on the old request, which is sent before anything of a new
        one, so none of the old request's outputs or its abort reach the new stream."""
        for _ in range(_FINALIZER_TURNS):
            if request_id not in self._streams:
                break
            # A stream left with `break` is closed by the loop's async-generator finalizer,
            # a task queued when the loop dropped it: let it run before calling the id taken.
            await asyncio.sleep(0)
        if not request_id:
            return
        future = self._leaving.get(request_id)
        if future is not None:
            try:
                await asyncio.wait_for(asyncio.shield(future), self.timeout)
            except TimeoutError:  # no word came: none will (the server lost the request)
                self._left(request_id)

    def _left(self, request_id: str) -> None:
        future = self._leaving.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(None)

    def _send(self, msg: ClientMessage) -> None:
        if self._closed:
            raise WeirError("client is closed")
        if self._refusal is None:
            self._refuse(self._handshakes.pending())  # in case the watcher has not run yet
        if self._refusal is not None:
            if isinstance(msg, AbortRequest):
                return  # none of our requests ever reached the server
            raise ServerUnavailableError(self._refusal)
        if self._receiver is None:
            loop = asyncio.get_running_loop()
            self._receiver = loop.create_task(self._receive_loop())
            self._watcher = loop.create_task(self._watch_handshake())
            self._stream_watch = loop.create_task(self._watch_streams())
        try:
            frame = encode_client_message(msg)
        except ProtocolError as exc:
            raise InvalidRequestError(
                f"request {msg.request_id!r}: {exc}", INVALID_REQUEST
            ) from None
        if len(frame) > self.max_message_size:
            raise InvalidRequestError(
                f"request {msg.request_id!r} takes {len(frame)} bytes encoded; the server takes "
                f"messages of at most {self.max_message_size} (its --max-message-size)",
                INVALID_REQUEST,
            )
        try:
            # Aborts are sent from generator finalizers, where awaiting is not always possible.
            send_now(self._sock, [frame])
        except zmq.Again:
            raise ServerUnavailableError(
                f"cannot send to {self.address}: not connected, or the send queue is full"
                f"{self._keys_hint()}"
            ) from None

    def _keys_hint(self) -> str:
        # Only while no handshake has succeeded: a server that shook hands and then went
        # quiet or away is not refusing our keys.
        seen = self._handshakes.connected or self._handshakes.connection_lost
        return "" if seen else self._no_reply_hint

    async def _request(
        self,
        msg: HealthRequest
        | ModelInfoRequest
        | TokenizeRequest
        | DetokenizeRequest
        | LoraAdapterRequest
        | EngineControlRequest,
        timeout: float | None = None,
    ) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[msg.request_id] = future
        timeout = timeout or self.timeout
        try:
            self._send(msg)
            reply = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise ServerUnavailableError(
                f"no reply from {self.address} within {timeout:g}s{self._keys_hint()}"
            ) from None
        finally:
            self._replies.pop(msg.request_id, None)
        if isinstance(reply, ErrorReply):
            raise _error_from_reply(reply)
        return reply

    async def _watch_streams(self) -> None:
        """A long queue on the server is not a failure: streams quiet for a quarter of
        ``timeout`` or more (and with nothing left to read) are checked in one health
        request given half of it, which says whether the server is alive and still knows
        them. A dead server, or one that restarted, is so noticed within ``timeout``. One
        watch per client, rather than a timed wait per output: that cost 15-25 us of
        every token."""
        while True:
            await asyncio.sleep(self.timeout / 4)
            quiet = [
                rid
                for rid, inbox in self._streams.items()
                if rid not in self._heard and inbox.idle()
            ]
            self._heard.clear()
            size = MAX_HEALTH_STREAM_IDS
            await asyncio.gather(
                *(self._check_streams(quiet[i : i + size]) for i in range(0, len(quiet), size))
            )

    async def _check_streams(self, quiet: list[str]) -> None:
        try:
            reply = await self._request(HealthRequest(uuid.uuid4().hex, quiet), self.timeout / 2)
        except Exception as exc:  # the watch must outlive whatever one check meets
            for rid in quiet:
                inbox = self._streams.get(rid)
                if inbox is not None:
                    inbox.give_up(
                        ServerUnavailableError(
                            f"request {rid}: no answer from the server ({exc}); an abort "
                            "frees it there if the server still runs it: send it again"
                        )
                    )
            return
        for rid in reply.info.get("lost_request_ids", ()):
            # Outputs sent before the reply are already queued: only an empty inbox is lost.
            inbox = self._streams.get(rid)
            if inbox is not None and inbox.idle():
                inbox.fail(
                    EngineError(
                        f"request {rid} was lost: the server no longer knows it "
                        "(it restarted); send it again",
                        ENGINE_ERROR,
                    )
                )

    async def _watch_handshake(self) -> None:
        """A server that refuses our keys (or their absence) drops the connection for good:
        what waits, and every later request, fails with the reason instead of a timeout."""
        while self._refusal is None:
            # The monitor of an asyncio socket is an asyncio socket (typed as a plain one).
            frames = await self._handshakes.socket.recv_multipart()  # type: ignore[misc]
            self._refuse(self._handshakes.reason(frames))

    @property
    def connection_lost(self) -> bool:
        """The connection to the server closed and has not been made again (as far as the
        events read so far tell)."""
        return self._handshakes.connection_lost

    def _connection_lost(self) -> None:
        """The server's end of the connection closed: it exited or restarted (or the network
        failed, and then it aborts what it cannot send). Nothing more comes for what is
        open, so it fails now, not after the timeout; libzmq reconnects for what follows."""
        error = ServerUnavailableError(
            f"the connection to {self.address} was lost (the server exited or restarted); "
            "send the request again"
        )
        _log.debug("%s", error)  # raised to whatever was waiting: the caller reports it
        for future in self._replies.values():
            if not future.done():
                future.set_exception(error)
        for request_id, inbox in self._streams.items():
            if not inbox.answered():
                inbox.fail(error)
                # Queued for the next connection: a server that is still there frees it.
                with suppress(zmq.ZMQError):
                    send_now(self._sock, [encode_client_message(AbortRequest(request_id))])
        for request_id in list(self._leaving):
            self._left(request_id)

    def _refuse(self, reason: str | None) -> None:
        if reason is None or self._refusal is not None:
            return
        self._refusal = reason
        _log.debug("%s", reason)  # raised to every request, now and later
        for future in self._replies.values():
            if not future.done():
                future.set_exception(ServerUnavailableError(reason))
        for inbox in self._streams.values():
            inbox.fail(ServerUnavailableError(reason))

    async def _receive_loop(self) -> None:
        while True:
            frame = await self._sock.recv()
            try:
                msg = decode_server_message(frame)
            except ClientProtocolError as exc:
                _log.warning("dropping a server message: %s", exc)
                continue
            if isinstance(msg, list):
                streams, heard = self._streams, self._heard
                for out in msg:
                    inbox = streams.get(out.request_id)
                    if inbox is not None:
                        inbox.put(out)
                        heard.add(out.request_id)
                    elif out.finished and out.request_id in self._leaving:
                        self._left(out.request_id)
                continue
            future = self._replies.get(msg.request_id) if msg.request_id else None
            if future is not None and not future.done():
                future.set_result(msg)
            elif isinstance(msg, ErrorReply) and msg.request_id:
                inbox = self._streams.get(msg.request_id)
                if inbox is not None:
                    inbox.fail(_error_from_reply(msg))
                elif msg.request_id in self._leaving:
                    self._left(msg.request_id)


class EventLoopThread:
    """An asyncio loop on a daemon thread, for synchronous callers in the process that made
    it (a fork's copy has no thread to run it). ``owner`` names what it serves in errors."""

    def __init__(self, owner: str = "client") -> None:
        self.owner = owner
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name="weir-client-loop", daemon=True)
        self._scheduled: set[asyncio.Task[Any]] = set()  # the loop holds its tasks weakly
        self.thread.start()

    def _serve(self) -> None:
        self.loop.run_forever()
        # Here, not in stop(): a loop stopped from its own thread has no caller to close it.
        self.loop.close()

    def check_process(self) -> None:
        """Raise ``WeirError`` in a fork: its copy of the loop has no thread to run it."""
        if os.getpid() != self.pid:
            raise WeirError(
                f"this {self.owner} was created in process {self.pid}; create a new one after fork"
            )

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait; an interrupt (Ctrl-C) cancels it there."""
        if os.getpid() != self.pid or threading.current_thread() is self.thread:
            coro.close()  # it will not run: no warning that it was never awaited
            self.check_process()
            raise RuntimeError("a call on the loop's own thread would wait for itself forever")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            if future.cancel():
                try:
                    future.result(timeout=5)
                except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError):
                    pass
            raise

    def run_or_schedule(self, coro: Coroutine[Any, Any, Any]) -> None:
        """``run``, for a cleanup that may run anywhere: on the loop's own thread (where the
        cyclic GC finalizes what it collects there) ``coro`` runs as a task instead, and in a
        fork (whose loop has no thread) not at all."""
        if os.getpid() != self.pid:
            coro.close()
        elif threading.current_thread() is self.thread:
            task = self.loop.create_task(coro)
            self._scheduled.add(task)
            task.add_done_callback(self._scheduled.discard)
        else:
            self.run(coro)

    def finalize(self, close: Callable[[], None]) -> None:
        """Call a finalizer's ``close``, which waits on the loop: on a helper thread where the
        cyclic GC runs the finalizer on the loop's own thread, and not at all in a fork (the
        loop, and whatever it serves, belong to the parent: closing them is its business)."""
        if os.getpid() != self.pid:
            return
        if threading.current_thread() is self.thread:
            # Not a daemon: an exit waits for it (an LLM's processes stopped).
            threading.Thread(target=close, name="weir-close").start()
        else:
            close()

    def call(self, fn: Callable[[], T]) -> T:
        """Call ``fn`` on the loop's thread (to create objects bound to the loop)."""

        async def call() -> T:
            return fn()

        return self.run(call())

    def stop(self) -> None:
        """Stop the loop once the calls waiting on it ended (those a closed client failed
        raise its error in their threads; any other is cancelled)."""
        self.run(_end_tasks())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


async def _end_tasks(grace: float = 1.0) -> None:
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if not others:
        return
    _, pending = await asyncio.wait(others, timeout=grace)
    for task in pending:
        task.cancel()
    await asyncio.wait(pending, timeout=grace)


class WeirClient:
    """Synchronous client with the same methods as ``AsyncWeirClient``."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float = 30.0,
        keys_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self._loop = EventLoopThread()
        try:
            self._client = self._loop.call(
                lambda: AsyncWeirClient(address, timeout=timeout, keys_dir=keys_dir)
            )
        except BaseException:
            self._loop.stop()
            raise
        self.address = address
        # A client dropped without close() still aborts its streams and ends its thread.
        self._finalizer = weakref.finalize(self, _close_client, self._loop, self._client)

    def __enter__(self) -> WeirClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        cap_max_tokens: bool = False,
        trace_headers: Mapping[str, str] | None = None,
        images: Sequence[bytes] = (),
    ) -> Iterator[StreamOutput]:
        # In batches: one round trip to the loop thread per batch, not per output.
        for batch in self.generate_batches(
            prompt,
            sampling_params,
            request_id=request_id,
            priority=priority,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            cache_salt=cache_salt,
            lora_name=lora_name,
            cap_max_tokens=cap_max_tokens,
            trace_headers=trace_headers,
            images=images,
        ):
            yield from batch

    def generate_batches(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        cap_max_tokens: bool = False,
        trace_headers: Mapping[str, str] | None = None,
        images: Sequence[bytes] = (),
    ) -> Iterator[list[StreamOutput]]:
        self._check_open()
        stream = self._client.generate_batches(
            prompt,
            sampling_params,
            request_id=request_id,
            priority=priority,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            cache_salt=cache_salt,
            lora_name=lora_name,
            cap_max_tokens=cap_max_tokens,
            trace_headers=trace_headers,
            images=images,
        )
        try:
            while True:
                self._check_open()  # a stream read after close(): the loop is gone
                try:
                    item = self._loop.run(anext(stream))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if self._finalizer.alive:  # closing the client closed its streams
                self._loop.run_or_schedule(stream.aclose())

    def embed(
        self,
        prompt: str | list[int],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> EmbeddingOutput:
        self._check_open()
        return self._loop.run(
            self._client.embed(
                prompt,
                dimensions=dimensions,
                normalize=normalize,
                truncate_prompt_tokens=truncate_prompt_tokens,
                request_id=request_id,
                priority=priority,
                cache_salt=cache_salt,
                lora_name=lora_name,
            )
        )

    def classify(
        self,
        prompt: str | list[int],
        *,
        activation: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> ClassificationOutput:
        self._check_open()
        return self._loop.run(
            self._client.classify(
                prompt,
                activation=activation,
                truncate_prompt_tokens=truncate_prompt_tokens,
                request_id=request_id,
                priority=priority,
                cache_salt=cache_salt,
                lora_name=lora_name,
            )
        )

    def score(
        self,
        text_1: str,
        text_2: str,
        *,
        activation: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> ScoreOutput:
        self._check_open()
        return self._loop.run(
            self._client.score(
                text_1,
                text_2,
                activation=activation,
                truncate_prompt_tokens=truncate_prompt_tokens,
                request_id=request_id,
                priority=priority,
                cache_salt=cache_salt,
                lora_name=lora_name,
            )
        )

    def beam_search(
        self,
        prompt: Prompt,
        params: BeamSearchParams,
        *,
        priority: int = 0,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> BeamSearchOutput:
        self._check_open()
        return self._loop.run(
            self._client.beam_search(
                prompt,
                params,
                priority=priority,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                cache_salt=cache_salt,
                lora_name=lora_name,
                truncate_prompt_tokens=truncate_prompt_tokens,
            )
        )

    def abort(self, request_id: str) -> None:
        self._check_open()
        self._loop.run(self._client.abort(request_id))

    def health(self) -> dict[str, Any]:
        self._check_open()
        return self._loop.run(self._client.health())

    def model_info(self) -> dict[str, Any]:
        self._check_open()
        return self._loop.run(self._client.model_info())

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        self._check_open()
        return self._loop.run(self._client.load_lora_adapter(lora_name, lora_path))

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        self._check_open()
        return self._loop.run(self._client.unload_lora_adapter(lora_name))

    def pause(self, mode: str = "abort", clear_cache: bool = True, timeout: float = 600.0) -> None:
        self._check_open()
        self._loop.run(self._client.pause(mode, clear_cache, timeout))

    def resume(self) -> None:
        self._check_open()
        self._loop.run(self._client.resume())

    def is_paused(self) -> bool:
        self._check_open()
        return self._loop.run(self._client.is_paused())

    def reset_prefix_cache(self) -> None:
        self._check_open()
        self._loop.run(self._client.reset_prefix_cache())

    def update_weights_from_disk(self, model_path: str, timeout: float = 600.0) -> None:
        self._check_open()
        self._loop.run(self._client.update_weights_from_disk(model_path, timeout))

    def sleep(self, level: int = 1, timeout: float = 600.0) -> None:
        self._check_open()
        self._loop.run(self._client.sleep(level, timeout))

    def wake_up(self, tags: list[str] | None = None, timeout: float = 600.0) -> None:
        self._check_open()
        self._loop.run(self._client.wake_up(tags, timeout))

    def is_sleeping(self) -> bool:
        self._check_open()
        return self._loop.run(self._client.is_sleeping())

    def start_profile(self) -> None:
        self._check_open()
        self._loop.run(self._client.start_profile())

    def stop_profile(self) -> None:
        self._check_open()
        self._loop.run(self._client.stop_profile())

    def tokenize(
        self,
        prompt: str | list[dict[str, Any]],
        *,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        self._check_open()
        return self._loop.run(
            self._client.tokenize(
                prompt,
                add_special_tokens=add_special_tokens,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                continue_final_message=continue_final_message,
            )
        )

    def detokenize(self, token_ids: Sequence[int]) -> str:
        self._check_open()
        return self._loop.run(self._client.detokenize(token_ids))

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        self._check_open()
        return self._loop.run(self._client.convert_ids_to_tokens(token_ids))

    def close(self) -> None:
        self._finalizer()

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise WeirError("client is closed")


async def gather_all(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """Every result, in order; the first failure is raised and cancels the others (their
    streams close, which aborts their requests)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _close_client(loop: EventLoopThread, client: AsyncWeirClient) -> None:
    """Close ``client`` and stop its loop thread: ``WeirClient.close()``, or the finalizer of
    a client dropped without it."""

    def close() -> None:
        loop.run(client.close())
        loop.stop()

    loop.finalize(close)


def _chat_args(
    tools: Sequence[dict[str, Any]] | None,
    template_kwargs: Mapping[str, Any] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> ChatTemplateArgs:
    """A chat's template arguments as the protocol carries them (JSON text)."""
    if tools is not None and (
        not isinstance(tools, list | tuple) or not all(isinstance(t, dict) for t in tools)
    ):
        raise InvalidRequestError("tools must be a list of maps (OpenAI's tools)", INVALID_REQUEST)
    if template_kwargs is not None and not isinstance(template_kwargs, Mapping):
        raise InvalidRequestError("chat_template_kwargs must be a map", INVALID_REQUEST)
    return ChatTemplateArgs(
        _json_text("tools", None if tools is None else list(tools)),
        _json_text(
            "chat_template_kwargs", None if template_kwargs is None else dict(template_kwargs)
        ),
        add_generation_prompt,
        continue_final_message,
    )


def _json_text(name: str, value: Any) -> str | None:
    if value is None:
        return None
    try:
        # Compact, and non-ASCII text as itself (ASCII escapes made an emoji 12 bytes).
        text = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{name} must be JSON: {exc}", INVALID_REQUEST) from None
    if not text.isascii():
        try:
            text.encode()  # the message's encoding would fail too, naming no field
        except UnicodeEncodeError as exc:
            raise InvalidRequestError(f"{name}: {encoding_problem(exc)}", INVALID_REQUEST) from None
    return text
