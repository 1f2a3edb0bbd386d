"""The scheduler process's side of its clients: requests in, text streamed out.

``run`` reads the client ROUTER: every message is validated
(``weir.shared.protocol.client``; a frame that cannot be decoded, for whatever reason,
is a ``malformed_message`` error to its sender), prompts are tokenized (text, token ids
or chat messages) and checked against the model, and added to the engine core's
scheduler; aborts, health and model-info queries are answered. Whatever could make a
step raise is refused here, so one bad request never fails the others in its batch.
Long prompts are tokenized on worker threads (the tokenizer releases the GIL) while
the loop keeps streaming; such a request is in flight from its arrival, so an abort
reaches it and its id cannot be reused. ``publish`` turns each step's
``EngineOutput``s into the clients' ``StreamOutput``s: it detokenizes, applies stop
strings (ending the request in the scheduler when one matches) and sends one frame
per client.

The front end never waits on a client: a client that is gone or not reading
loses its requests, nobody else's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from tokenizers.decoders import ByteLevel

from weir.services.engine.core import EngineCore, EngineStep, ExecutorLostError, StepFailedError
from weir.services.engine.image_prompts import ImagePrompts
from weir.services.engine.lora_registry import AdapterNotFound, LoraRegistry
from weir.services.engine.metrics import RequestTimes, SchedulerMetrics
from weir.services.engine.structured_output import GrammarCompiler
from weir.services.engine.tracing import RequestTracer
from weir.services.scheduler.output import EngineOutput, coalesce
from weir.services.scheduler.request import Grammar, Request, RequestStatus
from weir.shared.pooling import PoolerConfig, PoolingParams
from weir.shared.protocol import client as client_protocol
from weir.shared.protocol.step import WAKE_TAGS, SampleLogprobs
from weir.shared.sampling import DEFAULT_MAX_LOGPROBS, MAX_BAD_WORD_TOKENS, SamplingParams
from weir.shared.tokenizer import IncrementalDetokenizer, NoText, Tokenizer
from weir.shared.zmq_send import send_now

_log = logging.getLogger(__name__)
# How long an unload waits for the adapter's requests in flight to end.
LORA_UNLOAD_WAIT_S = 20.0

# Prompts up to this many characters are tokenized on the loop (well under a millisecond);
# longer ones on a worker thread.
_INLINE_TOKENIZE_CHARS = 4096
# What the chat template adds around each message (role markers, separators), counted in a
# chat's size: a million empty messages are not a short prompt (rendering them took 45 s).
_CHAT_MESSAGE_CHARS = 16
_TOKENIZER_THREADS = 2
# The longest text a request to be truncated may send: tokenizing it holds one of the
# tokenizer threads every long prompt waits for (11.4 M characters took 7.8 s).
MAX_TRUNCATED_PROMPT_CHARS = 1 << 20
# Replies wait in ZeroMQ's queue for a slow client; past this many it is treated as not
# reading (its requests end) rather than letting memory grow without bound.
CLIENT_SNDHWM = 100_000
_CATCH_UP_INTERVAL_S = 0.5
_PAUSE_POLL_S = 0.01  # how often a pause looks whether the requests or steps it waits for ended
# The tokens before a part of a character that its logprob text is decoded after (vLLM's):
# a UTF-8 character's bytes span at most 4 tokens.
_LOGPROB_CONTEXT = 4
# A byte-fallback vocabulary's entry for one byte (SentencePiece's).
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte table reversed: the byte each character of a byte-level vocabulary's
    entries stands for (printable bytes stand for themselves, the others are shifted past
    U+00FF in order)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = sorted(set(range(256)) - set(kept))
    return {chr(b): b for b in kept} | {chr(256 + n): b for n, b in enumerate(shifted)}


class _TokenBytes(dict[int, bytes]):
    """Token id -> the bytes it adds to the text, as OpenAI's logprob ``bytes`` give them
    (a part of a character's too, so that the tokens' bytes laid end to end are the text's
    UTF-8): a byte-level vocabulary's entry read through GPT-2's byte table, a byte-fallback
    entry's (``<0xE3>``) byte, else (an added token, another vocabulary) its text's UTF-8.
    Filled as ids are first seen."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__()
        backend = self._backend = tokenizer.backend
        self._table = _byte_level_table() if isinstance(backend.decoder, ByteLevel) else {}
        self._byte_fallback = bool(getattr(backend.model, "byte_fallback", False))
        self._added_ids = frozenset(backend.get_added_tokens_decoder())

    def __missing__(self, token_id: int) -> bytes:
        entry = None if token_id in self._added_ids else self._backend.id_to_token(token_id)
        table = self._table
        if entry and table and all(c in table for c in entry):
            raw = bytes(table[c] for c in entry)
        elif entry and self._byte_fallback and (piece := _BYTE_PIECE.fullmatch(entry)):
            raw = bytes([int(piece[1], 16)])
        else:
            raw = self._backend.decode([token_id], skip_special_tokens=False).encode()
        self[token_id] = raw
        return raw


@dataclass(slots=True)
class _Stream:
    """Client-facing state of one request."""

    request_id: str
    identity: bytes
    params: SamplingParams
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer | NoText
    arrival_time: float
    # Text not yet sent: what is withheld while it could still begin a stop string. The
    # text sent before is not kept (appending to the whole text copied it every token).
    unsent: str = ""
    num_output_tokens: int = 0
    sent_prompt_ids: bool = False
    admitted_step: int | None = None  # the step it was first scheduled in, once published
    scheduled_time: float | None = None  # when that step was planned
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Characters withheld while the text could still end in a stop string.
    holdback: int = 0
    # No stop string may end within unsent[:stop_after]: the first min_tokens tokens' text.
    stop_after: int = 0
    pooling: PoolingParams | None = None  # an embedding request's options
    # Set only for logprobs: the last sampled ids (at most _LOGPROB_CONTEXT), which a token
    # that ends inside a character is decoded after; and whether each token's own bytes go
    # with its text (a chat's, OpenAI's ``bytes``).
    recent_ids: tuple[int, ...] = ()
    token_bytes: bool = False
    trace_headers: dict[str, str] | None = None  # kept only where requests are traced


@dataclass(slots=True)
class _Tokenizing:
    """A request whose prompt a worker thread is tokenizing. An aborted one leaves
    ``ClientFrontend._tokenizing`` at once (its id is free again) and is dropped when its
    tokens come back."""

    identity: bytes
    aborted: bool = False


class ClientFrontend:
    """``core`` is None until an executor group first serves; while it is, or while
    ``unavailable`` holds a reason (the server drains), new requests get
    ``server_unavailable``. ``wake()`` says a request arrived; ``requests_ended()`` that requests ended outside a
    step (the gauges show it at once, the executors learn it in the next plan); ``health(stream_ids)`` and ``model_info()`` build the replies of those queries."""

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        metrics: SchedulerMetrics,
        wake: Callable[[], None],
        requests_ended: Callable[[], None],
        health: Callable[[list[str]], dict[str, Any]],
        model_info: Callable[[], dict[str, Any]],
        max_prompt_chars: int | None = None,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        loras: LoraRegistry | None = None,
        pooler: PoolerConfig | None = None,
        check_weights: Callable[[str], None] | None = None,
        served_weights: str | None = None,
        profiler_dir: str | None = None,
        tracer: RequestTracer | None = None,
        image_prompts: ImagePrompts | None = None,
        max_images: int = client_protocol.MAX_IMAGES,
    ) -> None:
        self._sock = sock
        self.image_prompts = image_prompts  # None: the model takes no images
        self.max_images = max_images  # a prompt's, at most (--limit-mm-per-prompt)
        self._tracer = tracer
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # No text longer than this tokenizes into max_model_len tokens.
        self.max_prompt_chars = max_prompt_chars or max_model_len * tokenizer.max_token_chars
        self._prompt_chars_given = max_prompt_chars is not None
        self.max_logprobs = max_logprobs  # what a request's logprobs may ask for at most
        self.metrics = metrics
        self._wake = wake
        self._requests_ended = requests_ended
        self._health = health
        self._model_info = model_info
        self.loras = loras or LoraRegistry({}, ())  # the LoRA adapters requests may name
        self.pooler = pooler  # a pooling runner's (embeddings only); None: it generates
        # ValueError unless a directory's weights fit the served model (update_weights), and
        # the directory of the weights executors start with (None: random ones).
        self._check_weights = check_weights
        self._served_weights = served_weights
        # Where the executors write their profiles (None: profiling refused), and whether
        # they are recording one.
        self.profiler_dir = profiler_dir
        self.profiling = False
        self.core: EngineCore | None = None
        self.unavailable: str | None = None
        self.streams: dict[str, _Stream] = {}
        self._token_text: dict[int, str] = {}  # id -> its text alone, at most the vocabulary
        self._partial_ids: set[int] = set()  # of those, the ids whose text ends in U+FFFD
        self._token_bytes = _TokenBytes(tokenizer)
        self._tokenizing: dict[str, _Tokenizing] = {}
        self._tokenize_tasks: set[asyncio.Task[None]] = set()
        self._tokenizer_pool = ThreadPoolExecutor(_TOKENIZER_THREADS, "weir-tokenize")
        end_ids = {*tokenizer.stop_token_ids}
        if tokenizer.eos_token_id is not None:
            end_ids.add(tokenizer.eos_token_id)
        self.grammars = GrammarCompiler(tokenizer, vocab_size, sorted(end_ids))
        self._grammar_end_ids = frozenset(end_ids)
        # Clients whose send queue filled (not reading) -> the requests that ended for it,
        # which they are told of once their queue has room again.
        self._behind: dict[bytes, list[str]] = {}
        self._catching_up: asyncio.TimerHandle | None = None
        # Generate requests that arrived while a pause waits for those in flight: they are
        # taken once it is paused (and run once it resumes).
        self._held: list[tuple[bytes, client_protocol.GenerateRequest]] | None = None
        # vLLM's sleep mode: 0 awake, else the level its KV cache sleeps at; the weights may
        # wake alone (to load new ones before the cache returns).
        self.sleep_level = 0
        self.weights_asleep = False
        self._resume_on_waking = False  # the sleep paused it

    def close(self) -> None:
        if self._catching_up is not None:
            self._catching_up.cancel()
        for task in self._tokenize_tasks:
            task.cancel()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def num_in_flight(self) -> int:
        """Requests streaming or being tokenized: what a drain waits for."""
        return len(self.streams) + len(self._tokenizing)

    def in_flight_ids(self) -> list[str]:
        """Requests streaming, being tokenized or held until a pause's wait ends."""
        return [*self.streams, *self._tokenizing, *(m.request_id for _, m in self._held or ())]

    def in_flight(self, request_id: str) -> bool:
        """Whether the request is known: streaming, its prompt still being tokenized, or
        held while a pause waits for the requests before it (it is no lost request)."""
        return (
            request_id in self.streams
            or request_id in self._tokenizing
            or any(m.request_id == request_id for _, m in self._held or ())
        )

    # ------------------------------------------------------------------ messages in

    async def run(self) -> None:
        while True:
            identity, *frames = await self._sock.recv_multipart()
            try:
                self._handle(identity, frames)
            except Exception:  # a bug must cost one message, never the server
                _log.exception("client %s: failed to handle a message", identity.hex())
            # A receive that finds a frame waiting returns without yielding: a client sending
            # without pause would otherwise hold the loop, and every step, for itself.
            await asyncio.sleep(0)

    def _handle(self, identity: bytes, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self.send_error(
                identity,
                None,
                client_protocol.MALFORMED_MESSAGE,
                f"expected one frame per message, got {len(frames)}",
            )
            return
        try:
            msg = client_protocol.decode_client_message(frames[0])
        except client_protocol.ClientProtocolError as exc:
            self.send_error(identity, exc.request_id, exc.code, exc.message)
            return
        except Exception as exc:  # a frame the decoder did not foresee: still only an error
            _log.warning(
                "client %s: undecodable message (%s: %.200s)",
                identity.hex(),
                type(exc).__name__,
                exc,
            )
            self.send_error(
                identity,
                None,
                client_protocol.MALFORMED_MESSAGE,
                f"message could not be decoded ({type(exc).__name__})",
            )
            return
        try:
            self._dispatch(identity, msg)
        except Exception as exc:  # a bug must cost one request, not the server
            _log.exception("failed to handle %s", type(msg).__name__)
            self.send_error(
                identity,
                msg.request_id,
                client_protocol.ENGINE_ERROR,
                f"internal error: {type(exc).__name__}: {exc}",
            )

    def _dispatch(self, identity: bytes, msg: client_protocol.ClientMessage) -> None:
        if isinstance(msg, client_protocol.GenerateRequest):
            self._add_request(identity, msg)
        elif isinstance(msg, client_protocol.AbortRequest):
            self._abort(msg.request_id, identity)
        elif isinstance(msg, client_protocol.HealthRequest):
            self._send(
                identity,
                client_protocol.encode_server_message(
                    client_protocol.HealthReply(msg.request_id, self._health(msg.stream_ids))
                ),
            )
        elif isinstance(msg, client_protocol.ModelInfoRequest):
            self._send_model_info(identity, msg.request_id)
        elif isinstance(
            msg, client_protocol.LoraAdapterRequest | client_protocol.EngineControlRequest
        ):
            if self.core is None or self.unavailable:
                self._send_unavailable(identity, msg.request_id)
                return
            handle = (
                self._update_loras
                if isinstance(msg, client_protocol.LoraAdapterRequest)
                else self._control
            )
            task = asyncio.get_running_loop().create_task(handle(identity, msg))  # type: ignore[arg-type]
            self._tokenize_tasks.add(task)
            task.add_done_callback(self._tokenize_tasks.discard)
        else:
            self._answer_tokens(identity, msg)

    def _send_model_info(self, identity: bytes, request_id: str) -> None:
        reply = client_protocol.ModelInfoReply(request_id, self._model_info())
        self._send(identity, client_protocol.encode_server_message(reply))

    async def _update_loras(self, identity: bytes, msg: client_protocol.LoraAdapterRequest) -> None:
        """Load or unload an adapter; answered with the model info that lists the adapters
        after it. A loaded adapter reaches the executors in the next plan, before any
        request that names it can."""
        loras = self.loras
        try:
            if msg.lora_path is None:
                await self._unload_lora(msg.lora_name)
            else:
                loras.check_load(msg.lora_name)
                fingerprint = await asyncio.get_running_loop().run_in_executor(
                    self._tokenizer_pool, loras.read, msg.lora_path
                )
                loras.add(msg.lora_name, msg.lora_path, fingerprint)
        except AdapterNotFound as exc:
            self.send_error(identity, msg.request_id, client_protocol.NOT_FOUND, str(exc))
            return
        except ValueError as exc:
            self.send_error(identity, msg.request_id, client_protocol.INVALID_REQUEST, str(exc))
            return
        assert self.core is not None
        self.core.scheduler.set_lora_adapters(loras.adapters)
        _log.warning(
            "LoRA adapter %s %s", msg.lora_name, "unloaded" if msg.lora_path is None else "loaded"
        )
        self._send_model_info(identity, msg.request_id)

    async def _unload_lora(self, name: str) -> None:
        """New requests of the adapter are refused at once; it is unloaded when those in
        flight end (they never lose it mid-way), or, if they run past
        ``LORA_UNLOAD_WAIT_S``, it serves again and the unload is refused."""
        adapter_id = self.loras.start_unload(name)
        try:
            deadline = time.monotonic() + LORA_UNLOAD_WAIT_S
            while self._adapter_in_use(adapter_id):
                if time.monotonic() > deadline:
                    raise ValueError(
                        f"requests of the LoRA adapter {name!r} ran for {LORA_UNLOAD_WAIT_S:g} s "
                        "more: it takes requests again; unload it once they end (or abort them)"
                    )
                await asyncio.sleep(0.05)
        except BaseException:
            self.loras.cancel_unload(name)
            raise
        self.loras.finish_unload(name)

    def _adapter_in_use(self, adapter_id: str) -> bool:
        assert self.core is not None
        return any(r.lora_name == adapter_id for r in self.core.scheduler.requests.values())

    # ------------------------------------------------------------------ pausing

    @property
    def paused(self) -> bool:
        return self.core is not None and self.core.paused

    async def _control(self, identity: bytes, msg: client_protocol.EngineControlRequest) -> None:
        """vLLM's pause/resume/is_paused/reset_prefix_cache and SGLang's
        update_weights_from_disk; answered once done, or with the error that stopped it."""
        assert self.core is not None
        try:
            if msg.action == "pause":
                await self.pause(msg.mode, msg.clear_cache)
            elif msg.action == "resume":
                self.resume()
            elif msg.action == "reset_prefix_cache":
                self.core.scheduler.reset_prefix_cache()
            elif msg.action == "update_weights":
                assert msg.path is not None
                await self.update_weights(msg.path)
            elif msg.action == "sleep":
                await self.sleep(msg.level)
            elif msg.action == "wake_up":
                await self.wake_up(msg.tags)
            elif msg.action in ("start_profile", "stop_profile"):
                await self.profile(msg.action.removesuffix("_profile"))
        except ValueError as exc:
            self.send_error(identity, msg.request_id, client_protocol.INVALID_REQUEST, str(exc))
            return
        except ExecutorLostError:
            # Lost during the action, or before it (a group being replaced): a retry's case.
            self.send_error(
                identity,
                msg.request_id,
                client_protocol.SERVER_UNAVAILABLE,
                f"{msg.action}: the executors were lost; the group that replaces them "
                "serves the weights last asked for, awake: ask again once the server is healthy",
            )
            return
        except Exception as exc:  # a bug must cost this call its answer, never its caller a wait
            _log.exception("engine_control %s failed", msg.action)
            self.send_error(
                identity,
                msg.request_id,
                client_protocol.ENGINE_ERROR,
                f"{msg.action} failed: {exc}",
            )
            return
        info = {"is_paused": self.paused, "is_sleeping": bool(self.sleep_level)}
        reply = client_protocol.ControlReply(msg.request_id, info)
        self._send(identity, client_protocol.encode_server_message(reply))

    async def pause(self, mode: str, clear_cache: bool) -> None:
        """Stop planning steps (``client_protocol.PAUSE_MODES`` say what becomes of the
        requests in flight) and return once none runs. ``clear_cache``: the KV cache is
        dropped, the prefix cache with it, and the requests kept are computed again from
        their tokens when the engine resumes (as after new weights)."""
        core = self.core
        assert core is not None
        if mode == "abort":
            for rid, tokenizing in list(self._tokenizing.items()):
                self._abort(rid, tokenizing.identity)
            for stream in list(self.streams.values()):
                self._abort(stream.request_id, stream.identity)
        elif mode == "wait" and not core.paused:
            if self._held is None:
                self._held = []
            while self.num_in_flight or core.scheduler.has_unfinished_requests():
                await asyncio.sleep(_PAUSE_POLL_S)
        core.paused = True
        self._wake()  # the step loop runs out the steps already planned
        while not core.settled:
            await asyncio.sleep(_PAUSE_POLL_S)
        if clear_cache:
            core.scheduler.reset_executor_state(core.scheduler.cache_config)
        held, self._held = self._held or [], None
        for identity, msg in held:
            self._add_request(identity, msg)
        self._requests_ended()  # the gauges say paused (and show what the pause ended)
        _log.info("paused (%s; cache %s)", mode, "cleared" if clear_cache else "kept")

    async def update_weights(self, path: str) -> None:
        """Serve the weights of model directory ``path`` (SGLang's update_weights_from_disk):
        the engine pauses keeping its requests, drops its cache, has the executors load them
        and resumes (unless it was paused before); the requests kept are computed again with
        them. ValueError where ``path`` does not fit the model or an executor could not load
        it; the executors then serve the weights they served before."""
        core = self.core
        assert core is not None
        if self._check_weights is None:
            raise ValueError("this server does not load new weights")
        if self.weights_asleep:
            raise ValueError(
                "the engine sleeps: wake it up (wake_up; tags weights wakes the weights alone) "
                "before loading weights"
            )
        self._check_weights(path)
        was_paused = core.paused
        await self.pause("keep", clear_cache=True)
        served = core.scheduler.weights_path or self._served_weights
        try:
            await core.control(load_weights=path)
        except StepFailedError as exc:
            # The ranks that loaded them (under tensor parallelism) go back to those served.
            core.scheduler.weights_path = None
            if served is not None:
                try:
                    await core.control(load_weights=served)
                except StepFailedError as again:
                    _log.error(
                        "the executors could not load the weights of %s again: %s", served, again
                    )
            raise ValueError(f"the executors could not load the weights of {path}: {exc}") from None
        finally:
            if not was_paused:
                self.resume()
        self.metrics.weight_updates.inc()
        _log.info("serving the weights of %s", path)

    async def profile(self, action: str) -> None:
        """vLLM's start_profile ("start") and stop_profile ("stop"): between two steps, the
        executors start torch.profiler, or stop it and write what it recorded under
        ``profiler_dir``; the steps in flight finish first and the requests keep their
        place (a pause, "keep", cache kept)."""
        core = self.core
        assert core is not None
        if self.profiler_dir is None:
            raise ValueError(
                "this server was started without --profiler-dir: start it with one to profile"
            )
        if (action == "start") == self.profiling:
            raise ValueError(
                "a profile is already running: stop_profile first"
                if self.profiling
                else "no profile is running: start_profile first"
            )
        was_paused = core.paused
        await self.pause("keep", clear_cache=False)
        try:
            await core.control(profile=action)
        except StepFailedError as exc:
            raise ValueError(f"the executors could not {action} profiling: {exc}") from None
        finally:
            if action == "stop":
                # Even where it failed: an executor that lost its profile (one started again
                # after a crash) has nothing to stop, and the others have stopped.
                self.profiling = False
            if not was_paused:
                self.resume()
        self.profiling = action == "start"
        _log.info(
            "profiling %s (%s)", "started" if self.profiling else "stopped", self.profiler_dir
        )

    async def sleep(self, level: int) -> None:
        """vLLM's sleep mode, to lend the device to a trainer between rollouts: the engine
        pauses keeping its requests (``pause("keep")``: computed again once awake) and the
        executors free the KV cache and, at level 1, move the weights to host memory (a
        GPU's; on a CPU they stay), at level 2 free them too (read again from disk on
        waking). Requests sent meanwhile wait for ``wake_up``."""
        core = self.core
        assert core is not None
        if self.weights_asleep:
            if level == self.sleep_level:
                return
            raise ValueError(
                f"the engine sleeps at level {self.sleep_level}: wake it up (wake_up) before "
                f"it sleeps at level {level}"
            )
        # Weights woken alone go back to sleep; the engine resumes as the first sleep said.
        was_paused = not self._resume_on_waking if self.sleep_level else core.paused
        await self.pause("keep", clear_cache=True)
        try:
            await core.control(sleep_level=level)
        except ExecutorLostError:
            # The group that replaces them starts awake, and so does the engine.
            if not was_paused:
                self.resume()
            raise
        except StepFailedError as exc:
            try:
                await core.control(sleep_level=0)  # those that slept: the engine stays awake
            except StepFailedError as again:
                # Some may hold nothing to step with: asleep it stays, until a wake_up works.
                self.sleep_level, self._resume_on_waking = level, not was_paused
                self.weights_asleep = True
                raise ValueError(
                    f"the executors could not sleep ({exc}) nor wake up again ({again}): "
                    "call wake_up"
                ) from None
            if not was_paused:
                self.resume()
            raise ValueError(f"the executors could not sleep: {exc}") from None
        self.sleep_level, self._resume_on_waking = level, not was_paused
        self.weights_asleep = True
        _log.info("sleeping (level %d)", level)

    async def wake_up(self, tags: list[str] | None = None, resume: bool = False) -> None:
        """The executors take back what ``tags`` names (vLLM's: ``weights``, ``kv_cache``;
        None for both; the weights first, so that new ones load before the KV cache returns),
        and once both are back the engine resumes if ``sleep`` paused it (or ``resume``: a
        draining server must finish its requests)."""
        core = self.core
        assert core is not None
        wanted = set(WAKE_TAGS if tags is None else tags)
        waking = []
        if "weights" in wanted and self.weights_asleep:
            waking.append("weights")
        if "kv_cache" in wanted and self.sleep_level:
            if self.weights_asleep and not waking:
                raise ValueError(
                    "the KV cache wakes after the weights (its CUDA graphs run them): wake "
                    "the weights first (tags weights), or both"
                )
            waking.append("kv_cache")
        if waking:
            try:
                await core.control(sleep_level=0, wake_tags=waking)
            except StepFailedError as exc:
                raise ValueError(f"the executors could not wake up: {exc}") from None
            self.weights_asleep = False  # the cache never wakes before them
            if "kv_cache" in waking:
                self.sleep_level = 0
                resume = resume or self._resume_on_waking
            _log.info("awake" if not self.sleep_level else "weights awake; the KV cache sleeps")
        if resume and not self.sleep_level:
            self.resume()

    def group_replaced(self) -> None:
        """A new executor group took the lost one's place: it starts awake, and so does
        the engine, resuming as a wake_up would (it says so rather than sleep while the
        executors hold their memory)."""
        if self.sleep_level:
            self.sleep_level, self.weights_asleep = 0, False
            _log.warning("the executors were replaced while the engine slept: it is awake")
            if self._resume_on_waking:
                self.resume()

    def resume(self) -> None:
        if self.sleep_level:
            raise ValueError("the engine sleeps: wake it up (wake_up), which resumes it")
        if self.core is not None and self.core.paused:
            self.core.paused = False
            self._requests_ended()  # the gauges say so, and the step loop wakes
            _log.info("resumed")

    def _add_request(self, identity: bytes, msg: client_protocol.GenerateRequest) -> None:
        rid = msg.request_id
        if self._held is not None:  # a pause waits for the requests before this one
            self._held.append((identity, msg))
            return
        if self.core is None or self.unavailable:
            self._send_unavailable(identity, rid)
            return
        if self.in_flight(rid):
            self.send_error(
                identity,
                rid,
                client_protocol.DUPLICATE_REQUEST_ID,
                f"request_id {rid!r} is already in flight",
            )
            return
        try:
            num_chars = self._check_before_tokenizing(msg)
        except AdapterNotFound as exc:
            self.send_error(identity, rid, client_protocol.NOT_FOUND, str(exc))
            return
        except ValueError as exc:
            self.send_error(identity, rid, client_protocol.INVALID_REQUEST, str(exc))
            return
        # A structured output compiles in the pool too (xgrammar's first import takes
        # seconds), and images are decoded there.
        if (
            num_chars <= _INLINE_TOKENIZE_CHARS
            and msg.sampling_params.structured_output is None
            and not msg.images
        ):
            try:
                prompt_ids = self._tokenize(msg)
            except ValueError as exc:
                self.send_error(identity, rid, client_protocol.INVALID_REQUEST, str(exc))
                return
            self._admit(identity, msg, prompt_ids)
            return
        entry = self._tokenizing[rid] = _Tokenizing(identity)
        task = asyncio.get_running_loop().create_task(
            self._tokenize_then_admit(identity, msg, entry)
        )
        self._tokenize_tasks.add(task)
        task.add_done_callback(self._tokenize_tasks.discard)

    async def _tokenize_then_admit(
        self, identity: bytes, msg: client_protocol.GenerateRequest, entry: _Tokenizing
    ) -> None:
        rid = msg.request_id
        loop = asyncio.get_running_loop()
        try:
            prompt_ids, grammar = await loop.run_in_executor(
                self._tokenizer_pool, self._prepare, msg
            )
        except Exception as exc:
            if entry.aborted:
                return
            del self._tokenizing[rid]
            if isinstance(exc, ValueError):
                self.send_error(identity, rid, client_protocol.INVALID_REQUEST, str(exc))
            else:
                _log.exception("request %s: tokenization failed", rid)
                self.send_error(
                    identity,
                    rid,
                    client_protocol.ENGINE_ERROR,
                    f"internal error: {type(exc).__name__}: {exc}",
                )
            return
        if not entry.aborted:
            del self._tokenizing[rid]
            self._admit(identity, msg, prompt_ids, grammar)

    def _prepare(self, msg: client_protocol.GenerateRequest) -> tuple[list[int], Grammar | None]:
        """The prompt's token ids and the request's structured-output state (in the pool)."""
        prompt_ids = self._tokenize(msg)
        params = msg.sampling_params
        if params.structured_output is None:
            return prompt_ids, None
        grammar = self.grammars.matcher(params.structured_output)
        allowed = params.allowed_token_ids
        if allowed is not None and not grammar.allows_any(allowed):
            # The two masks together would leave no token to sample.
            raise ValueError(
                "allowed_token_ids: none of them can begin the structured output; allow "
                "one that can, or drop one of the two"
            )
        return prompt_ids, grammar

    def _admit(
        self,
        identity: bytes,
        msg: client_protocol.GenerateRequest,
        prompt_ids: list[int],
        grammar: Grammar | None = None,
    ) -> None:
        """Check a tokenized request against the model and queue it."""
        rid = msg.request_id
        if self.core is None or self.unavailable:  # it changed while the prompt was tokenized
            self._send_unavailable(identity, rid)
            self._requests_ended()  # a drain may be waiting for this one
            return
        try:
            if msg.pooling_params is None:  # an embedding generates nothing
                params = self._check_fits(len(prompt_ids), msg.sampling_params, msg.cap_max_tokens)
                if params is not msg.sampling_params:
                    msg = dataclasses.replace(msg, sampling_params=params)
        except ValueError as exc:
            self.send_error(identity, rid, client_protocol.INVALID_REQUEST, str(exc))
            return
        arrival = time.monotonic()
        # A choice of n > 1 sent after its first arrived with it; only a request of the same
        # client in flight is taken (a claim of any other arrival would jump the queue).
        first = None if msg.queued_with is None else self.streams.get(msg.queued_with)
        if first is not None and first.identity == identity:
            arrival = first.arrival_time
        stream = _Stream(
            rid,
            identity,
            msg.sampling_params,
            prompt_ids,
            IncrementalDetokenizer(
                self.tokenizer, prompt_ids, msg.sampling_params.skip_special_tokens
            )
            if msg.sampling_params.detokenize
            else NoText(),
            arrival,
        )
        if msg.sampling_params.stop:
            stream.holdback = max(map(len, msg.sampling_params.stop)) - 1
        stream.pooling = msg.pooling_params
        if self._tracer is not None:
            stream.trace_headers = msg.trace_headers
        prompt = msg.prompt
        stream.token_bytes = (
            msg.sampling_params.logprobs is not None
            and not isinstance(prompt, str)
            and isinstance(prompt[0], dict)
        )
        try:
            request = self._new_request(rid, prompt_ids, msg, arrival)
            if grammar is not None:
                request.grammar = grammar
                # Its format allows them only where it is complete, and nothing after: they
                # end it under ignore_eos too (the scheduler asked a finished matcher for a
                # mask and stopped).
                request.stop_ids |= self._grammar_end_ids
            self.core.scheduler.add_request(request)
        except AdapterNotFound as exc:
            self.send_error(identity, rid, client_protocol.NOT_FOUND, str(exc))
            return
        except ValueError as exc:  # e.g. prompt + max_tokens can never fit the KV cache
            self.send_error(identity, rid, client_protocol.INVALID_REQUEST, str(exc))
            return
        self.streams[rid] = stream
        self._wake()  # nothing else: a burst of arrivals must not also refresh the gauges

    def _send_unavailable(self, identity: bytes, request_id: str) -> None:
        self.send_error(
            identity,
            request_id,
            client_protocol.SERVER_UNAVAILABLE,
            self.unavailable or "no executor is connected; try again once the server is healthy",
        )

    def _check_before_tokenizing(self, msg: client_protocol.GenerateRequest) -> int:
        """What needs the model but not the prompt's tokens; returns the prompt's size in
        characters (or token ids). ValueError names the problem."""
        params = msg.sampling_params
        self._check_runner(msg)
        policy = self.core.scheduler.scheduler_config.policy if self.core else "fcfs"
        if msg.priority and policy != "priority":
            raise ValueError(
                f"priority {msg.priority}: this server schedules {policy}, so requests have "
                "no priority (start it with --policy priority), or send priority 0"
            )
        if msg.lora_name is not None and msg.lora_name in self.loras.unloading:
            raise AdapterNotFound(
                f"lora_name {msg.lora_name!r}: the LoRA adapter is being unloaded"
            )
        if msg.lora_name is not None and msg.lora_name not in self.loras.ids:
            names = list(self.loras.ids)
            served = f"it serves {names}" if names else "it serves none"
            how = "load it first" if self.loras.runtime_updates else "--lora-modules NAME=PATH"
            raise AdapterNotFound(
                f"lora_name {msg.lora_name[:256]!r}: this server has no such LoRA adapter; "
                f"{served} ({how})"
            )
        if msg.images:
            self._check_images(msg)
        if (params.truncate_prompt_tokens or 0) > self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens {params.truncate_prompt_tokens} is more than "
                f"max_model_len {self.max_model_len}: ask for at most that many (or -1)"
            )
        for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            asked = getattr(params, name)
            if asked is not None and asked > self.max_logprobs:
                # vLLM's words, which clients match.
                raise ValueError(
                    f"Requested {kind} logprobs of {asked}, which is greater than max allowed: "
                    f"{self.max_logprobs} (this server's --max-logprobs)"
                )
        self._check_vocabulary("stop_token_ids", params.stop_token_ids)
        self._check_vocabulary("logit_bias", (t for t, _ in params.logit_bias))
        self._check_vocabulary("allowed_token_ids", params.allowed_token_ids or ())
        self._check_vocabulary(
            "bad_words_token_ids", (t for seq in params.bad_words_token_ids for t in seq)
        )
        stop_chars = sum(map(len, params.stop)) + sum(map(len, params.bad_words))
        if stop_chars > self.max_prompt_chars:
            derived = f"(no output of max_model_len={self.max_model_len} tokens is that long)"
            raise ValueError(
                f"stop strings and bad words of {stop_chars} characters in all: more than this "
                f"server's limit of {self.max_prompt_chars} {self._limit_reason(derived)}"
            )
        if not isinstance(msg.prompt, str) and not isinstance(msg.prompt[0], dict):
            return len(msg.prompt)  # token ids: their count is checked against max_model_len
        pair = None if msg.pooling_params is None else msg.pooling_params.text_pair
        truncated = msg.sampling_params.truncate_prompt_tokens is not None
        return self._check_prompt_chars(msg.prompt, msg.chat, len(pair or ""), truncated)

    def _check_images(self, msg: client_protocol.GenerateRequest) -> None:
        if self.image_prompts is None:
            raise ValueError(
                "this model takes no images: send text only, or serve a model that reads "
                "images (SmolVLM, Idefics3, InternVL)"
            )
        if msg.pooling_params is not None:
            raise ValueError("a pooling request takes no images")
        if len(msg.images) > self.max_images:
            raise ValueError(
                f"a prompt may send at most {self.max_images} images to this server (its "
                f"--limit-mm-per-prompt), got {len(msg.images)}"
            )
        if msg.sampling_params.truncate_prompt_tokens is not None:
            raise ValueError(
                "truncate_prompt_tokens would cut the tokens of an image: a prompt with "
                "images is not truncated"
            )

    def _check_runner(self, msg: client_protocol.GenerateRequest) -> None:
        """A pooling server takes pooling requests only (embeddings, or a classifier's
        classifications), a generating one none."""
        if self.pooler is None:
            if msg.pooling_params is not None:
                raise ValueError(
                    "this server generates text and serves no embeddings or classifications: "
                    "start one with --runner pooling (an embedding model or a sequence "
                    "classifier is found by itself)"
                )
            return
        if msg.pooling_params is None:
            kind, route = (
                ("classifications", "/classify, the SDK's classify")
                if self.pooler.labels
                else ("embeddings", "/v1/embeddings, the SDK's embed")
            )
            raise ValueError(
                f"this server serves {kind} only (--runner pooling): send such requests "
                f"({route}), or start another for generation"
            )
        truncate = msg.sampling_params.truncate_prompt_tokens
        if msg.sampling_params != SamplingParams(truncate_prompt_tokens=truncate):
            raise ValueError(
                "a pooling request takes no sampling parameters but truncate_prompt_tokens"
            )
        self.pooler.check(msg.pooling_params)
        if msg.pooling_params.text_pair is not None and not isinstance(msg.prompt, str):
            raise ValueError("a score's prompt is a text, paired with its text_pair")

    def _check_vocabulary(self, name: str, ids: Iterable[int]) -> None:
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"{name}: token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )

    def _check_prompt_chars(
        self,
        prompt: client_protocol.TextOrChat,
        chat: client_protocol.ChatTemplateArgs,
        pair_chars: int = 0,
        truncated: bool = False,
    ) -> int:
        """A text's (and the text it is paired with) or chat's size in characters;
        ValueError if no such prompt can fit. A prompt to be truncated may be longer than
        any that fits (vLLM tokenizes it whole), up to ``MAX_TRUNCATED_PROMPT_CHARS`` unless
        --max-prompt-chars was given."""
        limit = self.max_prompt_chars
        if truncated and not self._prompt_chars_given:
            limit = max(limit, MAX_TRUNCATED_PROMPT_CHARS)
        if isinstance(prompt, str):
            num_chars = len(prompt) + pair_chars
        else:
            if len(prompt) > self.max_model_len:
                raise ValueError(
                    f"a chat of {len(prompt)} messages cannot fit max_model_len="
                    f"{self.max_model_len} tokens (each message takes at least one)"
                )
            num_chars = (
                sum(map(_message_chars, prompt)) + len(chat.tools or "") + len(chat.kwargs or "")
            )
        if num_chars > limit:
            why = (
                "to tokenize for truncate_prompt_tokens"
                if limit > self.max_prompt_chars
                else self._limit_reason(
                    f"(such a text cannot fit max_model_len={self.max_model_len} tokens)"
                )
            )
            raise ValueError(
                f"prompt is too long: {num_chars} characters, more than this server's limit "
                f"of {limit} {why}; shorten the prompt"
            )
        return num_chars

    def _limit_reason(self, derived: str) -> str:
        """Why the characters limit is what it is: the operator's, or ``derived``."""
        return "(its --max-prompt-chars)" if self._prompt_chars_given else derived

    def _check_fits(
        self, num_prompt_tokens: int, params: SamplingParams, cap_max_tokens: bool = False
    ) -> SamplingParams:
        """The prompt and the tokens asked for fit max_model_len (as vLLM's API refuses);
        returns ``params``, with ``cap_max_tokens`` a max_tokens past it cut to the room left
        (as vLLM's offline LLM: the output ends at max_model_len, "length")."""
        room = self.max_model_len - num_prompt_tokens
        capped = cap_max_tokens and params.max_tokens is not None and params.max_tokens > room
        max_tokens = None if capped else params.max_tokens
        for name, wanted in (("max_tokens", max_tokens), ("min_tokens", params.min_tokens)):
            if wanted is not None and wanted > room:
                raise ValueError(
                    f"{name} is too large: this model's maximum context length is "
                    f"{self.max_model_len} tokens and the prompt has {num_prompt_tokens}, so at "
                    f"most {room} can be generated, but {name} is {wanted}; ask for at most "
                    f"{room} (a null max_tokens asks for as many as fit)"
                )
        return dataclasses.replace(params, max_tokens=room) if capped else params

    def _new_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        msg: client_protocol.GenerateRequest,
        arrival_time: float,
    ) -> Request:
        params = msg.sampling_params
        eos = self.tokenizer.eos_token_id
        # Models with several end tokens stop on all of them: the executor bans the same set
        # (model_config.eos_token_ids) before min_tokens.
        extra = tuple(
            t for t in self.tokenizer.stop_token_ids if t != eos and t not in params.stop_token_ids
        )
        if extra and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)
        if params.bad_words:
            params = dataclasses.replace(
                params,
                bad_words_token_ids=params.bad_words_token_ids
                + bad_word_sequences(self.tokenizer, params.bad_words, self.vocab_size),
            )
        if self.pooler is not None:  # the stream reports the prompt as it came
            prompt_ids = self.pooler.prompt_to_pool(prompt_ids)
        return Request(
            request_id,
            prompt_ids,
            params,
            eos_token_id=eos,
            arrival_time=arrival_time,
            priority=msg.priority,
            cache_salt=msg.cache_salt,
            lora_name=self._adapter_id(msg.lora_name),
            pooling=None if self.pooler is None else self.pooler.pooling_type,
            images=msg.images,
            image_starts=self.image_prompts.starts(prompt_ids, msg.images)
            if self.image_prompts is not None and msg.images
            else (),
        )

    def _adapter_id(self, lora_name: str | None) -> str | None:
        if lora_name is None:
            return None
        adapter_id = self.loras.ids.get(lora_name)
        if adapter_id is None or lora_name in self.loras.unloading:  # since tokenizing began
            raise AdapterNotFound(f"lora_name {lora_name!r}: the LoRA adapter was unloaded")
        return adapter_id

    def _tokenize(self, msg: client_protocol.GenerateRequest) -> list[int]:
        """Token ids of a request's prompt (a chat's rendered with its template arguments),
        truncated as it asks; ValueError names what is wrong with it. A prompt leaves room
        for one output token; an embedding's may fill max_model_len."""
        prompt, keep = msg.prompt, msg.sampling_params.truncate_prompt_tokens
        longest = self.max_model_len - (msg.pooling_params is None)
        if keep == -1:
            keep = longest
        pair = None if msg.pooling_params is None else msg.pooling_params.text_pair
        if isinstance(prompt, str) and pair is not None:  # a cross-encoder's, cut longest first
            ids = self.tokenizer.encode_pair(prompt, pair, keep)
        elif isinstance(prompt, str) or isinstance(prompt[0], dict):
            # A text gets the model's special tokens (BOS); a chat's template writes them.
            ids = self._prompt_ids(
                prompt, msg.chat, add_special_tokens=isinstance(prompt, str), images=msg.images
            )
            if keep is not None:
                ids = ids[-keep:]
        else:
            start = 0 if keep is None else max(0, len(prompt) - keep)
            ids = prompt[start:]
            if len(ids) > longest:  # before the scan over every id
                raise ValueError(
                    f"prompt is too long: {len(ids)} tokens, but max_model_len is "
                    f"{self.max_model_len}"
                )
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"prompt[{start + bad}]: token id {ids[bad]} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
            if self.image_prompts is not None:
                self.image_prompts.check(ids, [], None)
        if not ids:
            raise ValueError("prompt must not be empty (it tokenized to no tokens)")
        if len(ids) > longest:
            raise ValueError(
                f"prompt is too long: {len(ids)} tokens, but max_model_len is {self.max_model_len}"
            )
        return ids

    def _prompt_ids(
        self,
        prompt: client_protocol.TextOrChat,
        chat: client_protocol.ChatTemplateArgs,
        add_special_tokens: bool,
        images: list[bytes] | None = None,
    ) -> list[int]:
        """A text's token ids, or a chat's as its template renders it; a model that takes
        images has each placeholder of ``images`` expanded into its image's tokens."""
        text = prompt if isinstance(prompt, str) else self._render(prompt, chat)
        expanded = None
        if self.image_prompts is not None:
            expanded = text = self.image_prompts.expand(text, images or [])
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if self.image_prompts is not None:
            self.image_prompts.check(ids, images or [], expanded)
        return ids

    def _render(self, prompt: list[dict[str, Any]], chat: client_protocol.ChatTemplateArgs) -> str:
        """A chat's text as its template renders it with ``chat``'s arguments."""
        if self.image_prompts is not None:
            prompt = self.image_prompts.chat(prompt)
        tools = _json_of("tools", chat.tools, list, _TOOLS)
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise ValueError(f"tools must be {_TOOLS}")
        kwargs = _json_of("chat_template_kwargs", chat.kwargs, dict, "a JSON map of variables")
        try:
            return self.tokenizer.apply_chat_template(
                prompt,
                add_generation_prompt=chat.add_generation_prompt,
                tools=tools,
                continue_final_message=chat.continue_final_message,
                template_kwargs=kwargs,
            )
        except Exception as exc:  # no template, or a jinja2 error raised by the model's template
            raise ValueError(f"chat template failed: {exc}") from None

    def _answer_tokens(
        self,
        identity: bytes,
        msg: client_protocol.TokenizeRequest | client_protocol.DetokenizeRequest,
    ) -> None:
        """A tokenize or detokenize request: checked here, answered from the tokenizer
        threads (a long prompt must not hold the loop every stream's step waits on)."""
        try:
            if isinstance(msg, client_protocol.TokenizeRequest):
                self._check_prompt_chars(msg.prompt, msg.chat)
            else:
                self._check_vocabulary("token_ids", msg.token_ids)
        except ValueError as exc:
            self.send_error(identity, msg.request_id, client_protocol.INVALID_REQUEST, str(exc))
            return
        task = asyncio.get_running_loop().create_task(self._send_tokens(identity, msg))
        self._tokenize_tasks.add(task)
        task.add_done_callback(self._tokenize_tasks.discard)

    async def _send_tokens(
        self,
        identity: bytes,
        msg: client_protocol.TokenizeRequest | client_protocol.DetokenizeRequest,
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            info = await loop.run_in_executor(self._tokenizer_pool, self._tokens_info, msg)
        except ValueError as exc:
            self.send_error(identity, msg.request_id, client_protocol.INVALID_REQUEST, str(exc))
            return
        except Exception as exc:
            _log.exception("request %s: %s failed", msg.request_id, type(msg).__name__)
            self.send_error(
                identity,
                msg.request_id,
                client_protocol.ENGINE_ERROR,
                f"internal error: {type(exc).__name__}: {exc}",
            )
            return
        reply = client_protocol.TokensReply(msg.request_id, info)
        self._send(identity, client_protocol.encode_server_message(reply))

    def _tokens_info(
        self, msg: client_protocol.TokenizeRequest | client_protocol.DetokenizeRequest
    ) -> dict[str, Any]:
        if isinstance(msg, client_protocol.DetokenizeRequest) and msg.as_tokens:
            return {"tokens": [self.tokenizer.backend.id_to_token(i) for i in msg.token_ids]}
        if isinstance(msg, client_protocol.DetokenizeRequest):
            return {"text": self.tokenizer.decode(msg.token_ids, skip_special_tokens=False)}
        ids = self._prompt_ids(msg.prompt, msg.chat, msg.add_special_tokens)
        return {"token_ids": ids, "max_model_len": self.max_model_len}

    def _abort(self, request_id: str, identity: bytes) -> None:
        if self._held is not None:
            kept = [(i, m) for i, m in self._held if (i, m.request_id) != (identity, request_id)]
            if len(kept) < len(self._held):
                self._held = kept
                self._send_aborted(identity, request_id)
                return
        tokenizing = self._tokenizing.get(request_id)
        if tokenizing is not None and tokenizing.identity == identity:
            tokenizing.aborted = True
            del self._tokenizing[request_id]
            self._send_aborted(identity, request_id)
            self._requests_ended()  # a drain may be waiting for this one
            return
        stream = self.streams.get(request_id)
        if stream is None or stream.identity != identity:
            return  # already finished, or not this client's request
        self._end_in_scheduler([request_id], RequestStatus.FINISHED_ABORTED)
        self._finish_stream(stream, "abort")
        self._send(
            stream.identity, client_protocol.encode_outputs([self._final_output(stream, "abort")])
        )
        self._requests_ended()

    # ------------------------------------------------------------------ messages out

    def _send_aborted(self, identity: bytes, request_id: str) -> None:
        """The last word on a request aborted before it reached the scheduler."""
        self._send(
            identity,
            client_protocol.encode_outputs(
                [client_protocol.StreamOutput(request_id, [], "", True, "abort")]
            ),
        )

    def _send(self, identity: bytes, frame: bytes) -> None:
        """Send without waiting. A client that is gone loses its requests; so does one so
        far behind that its queue is full (it stopped reading), and it is told which once
        its queue has room again; what it was sent meanwhile is dropped."""
        behind = identity in self._behind
        if behind and not self._catch_up(identity):
            self._cut_off(identity, behind=True)
            return
        try:
            send_now(self._sock, [identity, frame])
        except zmq.ZMQError as exc:
            if exc.errno not in (errno.EHOSTUNREACH, errno.EAGAIN):
                raise
            self._cut_off(identity, behind=exc.errno == errno.EAGAIN)
            return
        if behind:
            del self._behind[identity]  # caught up

    def _cut_off(self, identity: bytes, behind: bool) -> None:
        gone = [s for s in self.streams.values() if s.identity == identity]
        if behind:
            if identity not in self._behind:
                _log.warning(
                    "client %s stopped reading (%d replies queued): aborting its %d request(s)",
                    identity.hex(),
                    int(self._sock.getsockopt(zmq.SNDHWM)),
                    len(gone),
                )
                self._behind[identity] = []
            self._behind[identity] += [s.request_id for s in gone]
            if self._catching_up is None:
                self._catching_up = asyncio.get_running_loop().call_later(
                    _CATCH_UP_INTERVAL_S, self._catch_up_all
                )
        elif gone:
            _log.info("client %s is gone; aborting its %d request(s)", identity.hex(), len(gone))
        if not gone:
            return
        self._end_in_scheduler([s.request_id for s in gone], RequestStatus.FINISHED_ABORTED)
        for stream in gone:
            self._finish_stream(stream, "abort")
        self._requests_ended()

    def _catch_up(self, identity: bytes) -> bool:
        """Tell a client that fell behind which of its requests ended; False while its
        queue is still full (it stays behind, so one warning says so, until a frame
        goes through)."""
        ended = self._behind[identity]
        while ended:
            error = client_protocol.ErrorReply(
                ended[-1],
                f"request {ended[-1]!r} was aborted: this client fell "
                f"{int(self._sock.getsockopt(zmq.SNDHWM))} "
                "replies behind (it stopped reading them); read replies as they come",
                client_protocol.CLIENT_TOO_SLOW,
            )
            try:
                send_now(self._sock, [identity, client_protocol.encode_server_message(error)])
            except zmq.ZMQError as exc:
                if exc.errno == errno.EAGAIN:
                    return False
                if exc.errno != errno.EHOSTUNREACH:
                    raise
                break  # gone: nobody to tell
            ended.pop()
        return True

    def _catch_up_all(self) -> None:
        self._catching_up = None
        for identity in list(self._behind):
            if self._catch_up(identity):
                del self._behind[identity]
        if self._behind:
            self._catching_up = asyncio.get_running_loop().call_later(
                _CATCH_UP_INTERVAL_S, self._catch_up_all
            )

    def send_error(self, identity: bytes, request_id: str | None, code: str, message: str) -> None:
        self._send(
            identity,
            client_protocol.encode_server_message(
                client_protocol.ErrorReply(request_id, message, code)
            ),
        )

    def fail(self, request_ids: list[str], code: str, message: str) -> None:
        """End these streams with an error (the scheduler has already ended the requests)."""
        for rid in request_ids:
            stream = self.streams.get(rid)
            if stream is not None:
                self._finish_stream(stream, "error")
                self.send_error(stream.identity, rid, code, message)

    def fail_all(self, code: str, message: str) -> None:
        self._end_in_scheduler(list(self.streams), RequestStatus.FINISHED_ABORTED)
        self.fail(list(self.streams), code, message)
        for rid, tokenizing in self._tokenizing.items():
            tokenizing.aborted = True
            self.send_error(tokenizing.identity, rid, code, message)
        self._tokenizing.clear()
        if self._held is not None:  # the pause that holds them ends with nothing to release
            for identity, msg in self._held:
                self.send_error(identity, msg.request_id, code, message)
            self._held = []

    def publish(
        self, steps: Sequence[EngineStep], before_send: Callable[[], None] = lambda: None
    ) -> None:
        """Stream the outputs of consecutive steps, one frame per client (several steps'
        tokens of a request in one output: see ``output.coalesce``). Metrics are updated
        first, and ``before_send`` runs once the scheduler holds what the outputs say (stop
        strings ended there): a client that has its outputs finds them counted in /metrics,
        whose endpoint answers from its own thread."""
        streams = self.streams
        current: list[list[EngineOutput]] = []
        for step in steps:
            step_id = step.plan.step_id
            for new in step.plan.new_requests:
                stream = streams.get(new.request_id)
                if stream is not None and stream.admitted_step is None:
                    stream.admitted_step = step_id
                    stream.scheduled_time = step.scheduled_at
                    queued = step.scheduled_at - stream.arrival_time
                    self.metrics.request_queue_time.observe(queued)
                    self.metrics.prompt_tokens.inc(len(stream.prompt_token_ids))
            # A stream takes the outputs of steps from its admission on: the steps applied
            # before and sent now (the loop read clients in between) may hold the outputs of
            # an aborted request whose id a new stream took.
            current.append(
                [
                    out
                    for out in step.outputs
                    if (stream := streams.get(out.request_id)) is not None
                    and stream.admitted_step is not None
                    and stream.admitted_step <= step_id
                ]
            )
        now = time.monotonic()
        by_client: dict[bytes, list[client_protocol.StreamOutput]] = {}
        stopped: list[str] = []
        inter_token: list[float] = []
        num_generated = 0
        failed: list[EngineOutput] = []
        for out in coalesce(current):
            if out.error is not None:
                failed.append(out)
                continue
            stream = streams[out.request_id]
            if out.new_token_ids:
                if stream.last_token_time is None:
                    self.metrics.time_to_first_token.observe(now - stream.arrival_time)
                    stream.first_token_time = now
                else:
                    inter_token.append(now - stream.last_token_time)
                stream.last_token_time = now
            item = self._stream_output(stream, out)
            num_generated += len(item.new_token_ids)
            if item.finished and not out.finished:  # a stop string, seen only here
                stopped.append(out.request_id)
            by_client.setdefault(stream.identity, []).append(item)
        self._end_in_scheduler(stopped, RequestStatus.FINISHED_STOPPED)
        self.metrics.inter_token_latency.observe_many(inter_token)
        self.metrics.generation_tokens.inc(num_generated)
        before_send()
        for identity, items in by_client.items():
            self._send(identity, client_protocol.encode_outputs(items))
        for out in failed:
            self.fail([out.request_id], client_protocol.INVALID_REQUEST, str(out.error))

    def _stream_output(self, stream: _Stream, out: EngineOutput) -> client_protocol.StreamOutput:
        """Detokenize, apply stop strings, and build the client's output for one request."""
        new_ids = out.new_token_ids
        if (
            stream.sent_prompt_ids
            and not out.finished
            and out.logprobs is None
            and out.prompt_logprobs is None
            and not stream.params.stop
        ):
            # Most outputs of a decode step: no stop string, so nothing to hold back, look for
            # or add, and the text is the tokens' (publishing costs per request on the loop
            # between steps).
            stream.num_output_tokens += len(new_ids)
            return client_protocol.StreamOutput(
                stream.request_id,
                new_ids,
                stream.detokenizer.add(new_ids),
                False,
                None,
                len(stream.prompt_token_ids),
                stream.num_output_tokens,
            )
        finished, reason = out.finished, out.finish_reason
        logprobs = out.logprobs
        stop_reason: str | int | None = None
        unsent = stream.unsent
        if new_ids:
            text_ids = new_ids
            if reason == "stop":
                # The token that stopped the request (EOS or a stop_token_ids entry: the
                # scheduler stops on nothing else) is counted, but its text is not returned
                # unless asked for, as in vLLM.
                if not stream.params.include_stop_str_in_output:
                    text_ids = new_ids[:-1]
                # Under ignore_eos only stop_token_ids stop it, the end token among them.
                if new_ids[-1] != self.tokenizer.eos_token_id or stream.params.ignore_eos:
                    stop_reason = new_ids[-1]
            if stream.params.stop:
                unsent, kept, stop = self._add_until_stop(stream, unsent, text_ids)
                if stop is not None:
                    # The tokens after the one that completed the stop string (a
                    # speculative step's later ones) are dropped: not counted, not sent.
                    new_ids = new_ids[:kept]
                    logprobs = None if logprobs is None else logprobs.head(kept)
                    finished, reason, stop_reason = True, "stop", stop
            else:
                unsent += stream.detokenizer.add(text_ids)
            stream.num_output_tokens += len(new_ids)
        end = len(unsent)
        if not finished and stream.holdback:
            end = max(0, end - stream.holdback)
        text, stream.unsent = unsent[:end], unsent[end:]
        if stream.stop_after:
            stream.stop_after = max(0, stream.stop_after - end)
        item = client_protocol.StreamOutput(
            stream.request_id,
            new_ids,
            text,
            finished,
            reason,
            len(stream.prompt_token_ids),
            stream.num_output_tokens,
            None if stream.sent_prompt_ids else stream.prompt_token_ids,
            None if logprobs is None else self._logprobs(stream, logprobs),
            stop_reason,
            None
            if out.prompt_logprobs is None
            else self._prompt_logprobs(stream.prompt_token_ids[0], out.prompt_logprobs),
            num_cached_tokens=None if stream.sent_prompt_ids else out.num_cached_tokens,
        )
        if out.pooled is not None:
            assert self.pooler is not None and stream.pooling is not None
            item.embedding = self.pooler.finish(out.pooled, stream.pooling)
        stream.sent_prompt_ids = True
        if finished:
            self._finish_stream(stream, reason or "stop")
        return item

    @staticmethod
    def _add_until_stop(
        stream: _Stream, unsent: str, token_ids: list[int]
    ) -> tuple[str, int, str | None]:
        """Append the tokens' text one token at a time until a stop string ends in it (so
        the text and the token count are the same however many tokens a step brought);
        returns the text cut where that stop string begins, the number of tokens kept and
        the stop string (None: no stop, all kept). As in vLLM, no stop string ends in the
        text of the first ``min_tokens`` tokens."""
        params = stream.params
        for i, token_id in enumerate(token_ids):
            # A stop string in the text before this token would have ended the request,
            # so only one ending in the new text is looked for (the held-back text can be
            # the whole output: searching it all made each token cost its length).
            searched = len(unsent)
            unsent += stream.detokenizer.add((token_id,))
            if stream.num_output_tokens + i < params.min_tokens:
                stream.stop_after = len(unsent)
                continue
            found = _find_stop(unsent, params.stop, max(searched, stream.stop_after))
            if found is not None:
                end = found[0] + (len(found[1]) if params.include_stop_str_in_output else 0)
                return unsent[:end], i + 1, found[1]
        return unsent, len(token_ids), None

    def _logprobs(self, stream: _Stream, logprobs: SampleLogprobs) -> dict[str, list[list[Any]]]:
        """The client's logprob rows, with each token's text (see ``_texts``: after the
        tokens sampled before it) and, for a chat, each token's own bytes."""
        rows = logprobs.token_ids
        context = stream.recent_ids
        stream.recent_ids = (*context, *(row[0] for row in rows))[-_LOGPROB_CONTEXT:]
        result: dict[str, list[list[Any]]] = {
            "token_ids": rows,
            "logprobs": logprobs.logprobs,
            "tokens": self._texts(rows, context),
        }
        if stream.token_bytes:
            token_bytes = self._token_bytes
            result["bytes"] = [[token_bytes[t] for t in row] for row in rows]
        return result

    def _prompt_logprobs(self, first: int, rows: SampleLogprobs) -> dict[str, list[list[Any]]]:
        """The client's prompt logprob rows: the first prompt token's, with a logprob of None
        (nothing predicts it, as vLLM and OpenAI's echo report it), then one per token."""
        token_ids = [[first], *rows.token_ids]
        # Each prompt token's rank in the distribution that predicts it (vLLM's), a row of
        # one per token.
        ranks: list[int | None] = [None]
        ranks += [None] * len(rows) if rows.ranks is None else rows.ranks
        return {
            "token_ids": token_ids,
            "logprobs": [[None], *rows.logprobs],
            "tokens": self._texts(token_ids, ()),
            "ranks": [[rank] for rank in ranks],
        }

    def _texts(self, rows: list[list[int]], context: tuple[int, ...]) -> list[list[str]]:
        """Each token's text, decoded alone, but where that ends inside a character (U+FFFD),
        as vLLM corrects it: decoded after the tokens before its row (``context``, then
        each row's first: the sampled or prompt token), less their text. A part of a
        character so has none, and the token that completes it has the whole character."""
        text, partial = self._token_text, self._partial_ids
        for token_id in {t for row in rows for t in row} - text.keys():
            # Each id is decoded once per process: top-20 rows of a big batch would
            # otherwise decode thousands of tokens between two steps.
            text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if text[token_id].endswith("\ufffd"):
                partial.add(token_id)
        texts = []
        for i, row in enumerate(rows):
            if partial.isdisjoint(row):
                texts.append([text[t] for t in row])
                continue
            before = [*context, *(r[0] for r in rows[max(0, i - _LOGPROB_CONTEXT) : i])]
            before = before[-_LOGPROB_CONTEXT:]
            texts.append([self._text_after(t, before) if t in partial else text[t] for t in row])
        return texts

    def _text_after(self, token_id: int, context: list[int]) -> str:
        """vLLM's text of a token that decodes alone to a part of a character: decoded after
        the fewest tokens of ``context`` that complete the character, less the text of those
        before the context's own parts of it (which have none of their own); "" where none do."""
        decode = self.tokenizer.backend.decode
        for start in range(len(context) - 1, -1, -1):
            before = context[start:]
            whole = decode([*before, token_id], skip_special_tokens=False)
            if whole.endswith("\ufffd"):
                continue
            clean = len(before)
            while clean and before[clean - 1] in self._partial_ids:
                clean -= 1
            prefix = decode(before[:clean], skip_special_tokens=False) if clean else ""
            # A normalizing decoder may change the prefix's text in the longer one.
            return whole[len(os.path.commonprefix([prefix, whole])) :]
        return ""

    def _final_output(self, stream: _Stream, reason: str) -> client_protocol.StreamOutput:
        return client_protocol.StreamOutput(
            request_id=stream.request_id,
            new_token_ids=[],
            text=stream.unsent,
            finished=True,
            finish_reason=reason,
            prompt_tokens=len(stream.prompt_token_ids),
            completion_tokens=stream.num_output_tokens,
            prompt_token_ids=None if stream.sent_prompt_ids else stream.prompt_token_ids,
        )

    def _finish_stream(self, stream: _Stream, reason: str) -> None:
        if self.streams.pop(stream.request_id, None) is None:
            return
        times = RequestTimes(
            stream.arrival_time, stream.scheduled_time, stream.first_token_time, time.monotonic()
        )
        prompt_tokens = len(stream.prompt_token_ids)
        self.metrics.request_finished(
            reason, times, prompt_tokens, stream.num_output_tokens, stream.params.max_tokens
        )
        if self._tracer is not None:
            self._tracer.request_finished(
                stream.request_id,
                stream.trace_headers,
                times,
                prompt_tokens,
                stream.num_output_tokens,
                stream.params,
            )

    def _end_in_scheduler(self, request_ids: list[str], status: RequestStatus) -> None:
        if request_ids and self.core is not None:
            self.core.scheduler.finish_requests(request_ids, status)


def _message_chars(message: dict[str, Any]) -> int:
    """A chat message's size in characters, its tool calls' and template's markers too."""
    chars = _CHAT_MESSAGE_CHARS + sum(
        len(value) for key, value in message.items() if key != "role" and type(value) is str
    )
    if type(message["content"]) is list:
        chars += sum(_CHAT_MESSAGE_CHARS + len(part.get("text", "")) for part in message["content"])
    for call in message.get("tool_calls", ()):
        chars += _CHAT_MESSAGE_CHARS + sum(map(len, call["function"].values()))
    return chars


_TOOLS = "a JSON list of maps (OpenAI's tools)"


def _json_of(name: str, text: str | None, kind: type, what: str) -> Any:
    """A chat field's value from its JSON text; ValueError if that is not JSON of ``kind``."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{name}: not JSON, or nested too deeply ({exc})") from None
    if not isinstance(value, kind):
        raise ValueError(f"{name} must be {what}")
    return value


def _find_stop(text: str, stops: tuple[str, ...], end_after: int) -> tuple[int, str] | None:
    """Where the earliest stop string that ends after ``text[:end_after]`` begins in
    ``text``, and which it is."""
    hits = [
        (i, stop)
        for stop in stops
        if (i := text.find(stop, max(0, end_after - len(stop) + 1))) != -1
    ]
    return min(hits, key=lambda hit: hit[0]) if hits else None


def bad_word_sequences(
    tokenizer: Tokenizer, words: tuple[str, ...], vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    """The token sequences of vLLM's ``bad_words``: each word as it tokenizes alone (its
    leading spaces dropped), and after a space where that gives other tokens of the same
    count (a word mid-text). A sequence the model cannot write (a token past its vocabulary,
    or none at all) is left out; ValueError names a word of more than MAX_BAD_WORD_TOKENS."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip()))
        spaced = tuple(tokenizer.encode(" " + word.lstrip()))
        if max(len(alone), len(spaced)) > MAX_BAD_WORD_TOKENS:
            raise ValueError(
                f"bad_words: {word[:40]!r} is {max(len(alone), len(spaced))} tokens; a bad word "
                f"may be at most {MAX_BAD_WORD_TOKENS}"
            )
        found = [alone]
        if alone and spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            found.append(spaced)
        sequences += [seq for seq in found if seq and max(seq) < vocab_size]
    return tuple(sequences)
