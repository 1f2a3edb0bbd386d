"""The scheduler process: clients in, step plans out, sampled tokens back, outputs streamed.

One asyncio loop runs four tasks:

* ``_client_loop`` reads the client ROUTER: validates every message, tokenizes
  prompts (text, ids or chat messages), adds requests to the ``Scheduler``,
  answers aborts, health and model-info queries;
* ``_executor_loop`` reads the executor ROUTER: handshakes, heartbeats, step
  results and step errors;
* ``_step_loop``: ``schedule()`` -> encode the plan -> send it to every rank ->
  await rank 0's result -> ``update_from_output()`` -> detokenize, apply stop
  strings, stream outputs; it sleeps on an event while there is no work;
* ``_watchdog`` fails the in-flight requests when an executor's heartbeats stop,
  and exits when a supervising parent is gone.

The KV manager is sized from the executors' handshake (the smallest
``num_blocks`` over ranks), so the scheduler has no ``Scheduler`` until a full
group of executors has said hello; requests arriving before that, or after the
group is lost, get a ``server_unavailable`` error instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from weir.services.executor import link
from weir.services.launcher import StatusReporter, parent_gone
from weir.services.scheduler.metrics import SchedulerMetrics, start_metrics_server
from weir.services.scheduler.request import Request, RequestStatus
from weir.services.scheduler.scheduler import Scheduler
from weir.shared import client_protocol as cp
from weir.shared.config import CacheConfig, SchedulerConfig
from weir.shared.model_store import load_model_config
from weir.shared.protocol import ProtocolError, RequestOutput, StepPlan, StepResult
from weir.shared.protocol import decode_step_result, encode_step_plan
from weir.shared.sampling import SamplingParams
from weir.shared.tokenizer import IncrementalDetokenizer, Tokenizer
from weir.shared.zmq_send import send_now

_log = logging.getLogger(__name__)

_WATCHDOG_INTERVAL_S = 0.5
# Outputs wait in ZeroMQ's queue for a slow client; past this many the client is
# treated as gone rather than letting memory grow without bound.
_CLIENT_SNDHWM = 100_000


@dataclass(slots=True)
class SchedulerServerOptions:
    model_dir: str
    scheduler_config: SchedulerConfig
    block_size: int = 16
    enable_prefix_caching: bool = True
    host: str = "127.0.0.1"
    port: int = 8100
    metrics_port: int | None = 8101  # None: no metrics endpoint
    executor_address: str = "tcp://127.0.0.1:8102"
    num_executors: int = 1
    executor_timeout: float = link.DEFAULT_HEARTBEAT_TIMEOUT_S


@dataclass(slots=True)
class _Rank:
    hello: link.ExecutorHello
    identity: bytes  # routing id of the rank's step socket
    last_seen: float


class ExecutorLost(RuntimeError):
    """The executor group can no longer run steps."""


@dataclass(slots=True)
class _Stream:
    """Client-facing state of one request."""

    request_id: str
    identity: bytes
    params: SamplingParams
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    arrival_time: float
    text: str = ""
    num_sent_chars: int = 0
    num_output_tokens: int = 0
    sent_prompt_ids: bool = False
    scheduled_time: float | None = None
    last_token_time: float | None = None
    # Characters withheld while the text could still end in a stop string.
    holdback: int = 0


@dataclass(slots=True)
class _Counters:
    """Last seen values of the scheduler's cumulative stats (Prometheus counters need deltas)."""

    values: dict[str, int] = field(default_factory=dict)

    def delta(self, name: str, value: int) -> int:
        previous = self.values.get(name, 0)
        self.values[name] = value
        return max(0, value - previous)


class SchedulerServer:
    def __init__(self, options: SchedulerServerOptions, status: StatusReporter | None = None,
                 parent_pid: int | None = None) -> None:
        self.options = options
        self.status = status or StatusReporter(None)
        self.parent_pid = parent_pid
        model_dir = Path(options.model_dir)
        self.model_name = model_dir.name
        self.tokenizer = Tokenizer.from_model_dir(model_dir)
        self.vocab_size = int(load_model_config(model_dir)["vocab_size"])
        self.config = options.scheduler_config
        self.metrics = SchedulerMetrics(self.model_name)
        self.metrics_address: str | None = None
        self.client_address = ""
        self.executor_address = ""

        self._scheduler: Scheduler | None = None
        self._ranks: dict[int, _Rank] = {}  # handshaken ranks, by rank
        self._streams: dict[str, _Stream] = {}
        self._counters = _Counters()
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._result: asyncio.Future[StepResult] | None = None
        self._step_id = 0
        self._num_blocks = 0
        self._reported_ready = False

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        opts = self.options
        ctx = zmq.asyncio.Context()
        self._client_sock = ctx.socket(zmq.ROUTER)
        self._client_sock.setsockopt(zmq.LINGER, 0)
        self._client_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._client_sock.setsockopt(zmq.SNDHWM, _CLIENT_SNDHWM)
        self._executor_sock = ctx.socket(zmq.ROUTER)
        self._executor_sock.setsockopt(zmq.LINGER, 0)
        self._executor_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self._client_sock.bind(f"tcp://{opts.host}:{opts.port}" if opts.port else
                                   f"tcp://{opts.host}:*")
            self._executor_sock.bind(opts.executor_address)
            if opts.metrics_port is not None:
                self.metrics_address = start_metrics_server(self.metrics.registry, opts.host,
                                                            opts.metrics_port)
        except (zmq.ZMQError, OSError) as exc:
            self.status.error(f"cannot bind: {exc}")
            _log.error("scheduler cannot bind: %s", exc)
            ctx.destroy(linger=0)
            return 1
        self.client_address = self._client_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.executor_address = self._executor_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        _log.info("scheduler for %s: clients %s, executors %s, metrics %s", self.model_name,
                  self.client_address, self.executor_address, self.metrics_address)

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        tasks = [loop.create_task(coro) for coro in (
            self._client_loop(), self._executor_loop(), self._step_loop(), self._watchdog())]
        stop = loop.create_task(self._stop.wait())
        try:
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            crashed = [t for t in done if t is not stop and t.exception() is not None]
            for task in crashed:
                _log.error("scheduler task failed", exc_info=task.exception())
            return 1 if crashed else 0
        finally:
            self._fail_all("the server is shutting down", cp.SERVER_UNAVAILABLE)
            for task in [stop, *tasks]:
                task.cancel()
            await asyncio.gather(stop, *tasks, return_exceptions=True)
            # Give the shutdown errors just queued a moment to reach their clients.
            self._client_sock.close(linger=500)
            ctx.destroy(linger=0)

    # ------------------------------------------------------------------ clients

    async def _client_loop(self) -> None:
        while True:
            identity, *frames = await self._client_sock.recv_multipart()
            if len(frames) != 1:
                self._send_error(identity, None, cp.MALFORMED_MESSAGE,
                                 f"expected one frame per message, got {len(frames)}")
                continue
            try:
                msg = cp.decode_client_message(frames[0])
            except cp.ClientProtocolError as exc:
                self._send_error(identity, exc.request_id, exc.code, exc.message)
                continue
            try:
                self._dispatch(identity, msg)
            except Exception as exc:  # a bug must cost one request, not the server
                _log.exception("failed to handle %s", type(msg).__name__)
                self._send_error(identity, msg.request_id, cp.ENGINE_ERROR,
                                 f"internal error: {type(exc).__name__}: {exc}")

    def _dispatch(self, identity: bytes, msg: cp.ClientMessage) -> None:
        if isinstance(msg, cp.GenerateRequest):
            self._add_request(identity, msg)
        elif isinstance(msg, cp.AbortRequest):
            self._abort(msg.request_id, identity)
        elif isinstance(msg, cp.HealthRequest):
            self._send_client(identity, cp.encode_server_message(
                cp.HealthReply(msg.request_id, self._health(msg.stream_ids))))
        else:
            self._send_client(identity, cp.encode_server_message(
                cp.ModelInfoReply(msg.request_id, self._model_info())))

    def _add_request(self, identity: bytes, msg: cp.GenerateRequest) -> None:
        rid = msg.request_id
        if self._scheduler is None:
            self._send_error(identity, rid, cp.SERVER_UNAVAILABLE,
                             "no executor is connected; try again once the server is healthy")
            return
        if rid in self._streams:
            self._send_error(identity, rid, cp.DUPLICATE_REQUEST_ID,
                             f"request_id {rid!r} is already in flight")
            return
        try:
            prompt_ids = self._tokenize(msg.prompt)
        except ValueError as exc:
            self._send_error(identity, rid, cp.INVALID_REQUEST, str(exc))
            return
        now = time.monotonic()
        stream = _Stream(rid, identity, msg.sampling_params, prompt_ids,
                         IncrementalDetokenizer(self.tokenizer, prompt_ids), now)
        if msg.sampling_params.stop:
            stream.holdback = max(map(len, msg.sampling_params.stop)) - 1
        try:
            self._scheduler.add_request(self._new_request(rid, prompt_ids, msg.sampling_params, now))
        except ValueError as exc:  # e.g. prompt + max_tokens can never fit the KV cache
            self._send_error(identity, rid, cp.INVALID_REQUEST, str(exc))
            return
        self._streams[rid] = stream
        self._wake.set()

    def _new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     arrival_time: float) -> Request:
        eos = self.tokenizer.eos_token_id
        # Models with several end tokens (generation_config.json) stop on all of them.
        extra = tuple(t for t in self.tokenizer.stop_token_ids
                      if t != eos and t not in params.stop_token_ids)
        if extra and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)
        return Request(request_id, prompt_ids, params, eos_token_id=eos, arrival_time=arrival_time)

    def _tokenize(self, prompt: cp.Prompt) -> list[int]:
        """Token ids of a prompt; ValueError names what is wrong with it."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt[0], dict):
            try:
                text = self.tokenizer.apply_chat_template(prompt)
            except Exception as exc:  # no template, or a jinja2 error raised by the model's template
                raise ValueError(f"chat template failed: {exc}") from None
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = prompt
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"prompt[{bad}]: token id {ids[bad]} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        if not ids:
            raise ValueError("prompt must not be empty (it tokenized to no tokens)")
        max_len = self.config.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"prompt is too long: {len(ids)} tokens, but max_model_len is {max_len}")
        return ids

    def _abort(self, request_id: str, identity: bytes | None) -> None:
        stream = self._streams.get(request_id)
        if stream is None or (identity is not None and stream.identity != identity):
            return  # already finished, or not this client's request
        if self._scheduler is not None:
            self._scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        self._finish_stream(stream, "abort")
        self._send_client(stream.identity, cp.encode_outputs([self._final_output(stream, "abort")]))
        self._requests_ended()

    def _send_client(self, identity: bytes, frame: bytes) -> None:
        """Send without waiting; a client that is gone or not reading loses its requests."""
        try:
            send_now(self._client_sock, [identity, frame])
            return
        except zmq.ZMQError as exc:
            if exc.errno not in (errno.EHOSTUNREACH, errno.EAGAIN):
                raise
        gone = [s for s in self._streams.values() if s.identity == identity]
        _log.info("client %s is gone; aborting its %d request(s)", identity.hex(), len(gone))
        for stream in gone:
            if self._scheduler is not None:
                self._scheduler.finish_requests([stream.request_id], RequestStatus.FINISHED_ABORTED)
            self._finish_stream(stream, "abort")
        self._requests_ended()

    def _requests_ended(self) -> None:
        """After ending requests outside a step: the gauges show it now, and the step loop
        wakes to tell the executors (``finished_req_ids``)."""
        self._refresh_gauges()
        self._wake.set()

    def _send_error(self, identity: bytes, request_id: str | None, code: str, message: str) -> None:
        self._send_client(identity, cp.encode_server_message(cp.ErrorReply(request_id, message, code)))

    def _health(self, stream_ids: list[str] = ()) -> dict[str, Any]:
        info: dict[str, Any] = {
            "status": "ok" if self._scheduler is not None else "waiting_for_executors",
            "executors": sorted(self._ranks),
            "num_executors": self.options.num_executors,
            "num_streams": len(self._streams),
        }
        if stream_ids:
            info["lost_request_ids"] = [rid for rid in stream_ids if rid not in self._streams]
        if self._scheduler is not None:
            stats = self._scheduler.stats()
            info.update(num_requests_running=stats.num_running, num_requests_waiting=stats.num_waiting,
                        kv_cache_usage=stats.kv_cache_usage, num_blocks=stats.num_blocks,
                        num_free_blocks=stats.num_free_blocks, num_preemptions=stats.num_preemptions)
        return info

    def _model_info(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "max_model_len": self.config.max_model_len,
            "vocab_size": self.vocab_size,
            "eos_token_id": self.tokenizer.eos_token_id,
            "block_size": self.options.block_size,
            "num_blocks": self._num_blocks if self._scheduler is not None else None,
            "scheduler_config": self.config.to_dict(),
            "metrics_address": self.metrics_address,
            "executors": [{"rank": r.hello.rank, "pid": r.hello.pid,
                           "metrics_address": r.hello.metrics_address, **r.hello.info}
                          for r in sorted(self._ranks.values(), key=lambda r: r.hello.rank)],
        }

    # ------------------------------------------------------------------ executors

    async def _executor_loop(self) -> None:
        while True:
            identity, *frames = await self._executor_sock.recv_multipart()
            if len(frames) != 2:
                _log.warning("ignoring an executor message of %d frame(s)", len(frames))
                continue
            kind, payload = frames
            try:
                if kind == link.HEARTBEAT:
                    self._on_heartbeat(identity, payload)
                elif kind == link.HELLO:
                    self._on_hello(identity, link.unpack_hello(payload))
                elif kind == link.RESULT:
                    self._on_result(identity, payload)
                elif kind == link.STEP_ERROR:
                    failure = link.unpack_step_failure(payload)
                    self._fail_step(f"executor rank {failure.rank} failed step {failure.step_id}: "
                                    f"{failure.message}")
                else:
                    _log.warning("ignoring executor frame of kind %r", kind)
            except link.LinkError as exc:
                _log.warning("bad executor frame %r: %s", kind, exc)

    def _send_executor(self, identity: bytes, kind: bytes, payload: bytes = b"") -> bool:
        """False when the peer is gone (its heartbeats stop too: the watchdog handles it)."""
        try:
            send_now(self._executor_sock, [identity, kind, payload])
            return True
        except zmq.ZMQError as exc:
            _log.warning("cannot send %r to executor %s: %s", kind, identity.hex(), exc)
            return False

    def _rank_of(self, identity: bytes) -> _Rank | None:
        return next((r for r in self._ranks.values() if r.identity == identity), None)

    def _on_heartbeat(self, identity: bytes, payload: bytes) -> None:
        session = link.unpack_map(payload).get("session")
        rank = next((r for r in self._ranks.values() if r.hello.session == session), None)
        if rank is None:
            # An executor of a previous scheduler (or group): it must restart clean.
            self._send_executor(identity, link.RESET)
            return
        rank.last_seen = time.monotonic()

    def _on_hello(self, identity: bytes, hello: link.ExecutorHello) -> None:
        current = self._ranks.get(hello.rank)
        if current is not None and current.hello.session == hello.session:
            current.identity = identity  # a resent hello: answer it again
            self._send_executor(identity, link.WELCOME)
            return
        problem = self._check_hello(hello)
        if problem is None and current is not None:
            problem = f"rank {hello.rank} is already served by executor pid {current.hello.pid}"
        if problem is not None:
            _log.error("rejecting executor rank %d: %s", hello.rank, problem)
            self._send_executor(identity, link.REJECT, link.pack({"message": problem}))
            return
        self._ranks[hello.rank] = _Rank(hello, identity, time.monotonic())
        self._send_executor(identity, link.WELCOME)
        _log.info("executor rank %d (pid %d) joined: %d KV blocks", hello.rank, hello.pid,
                  hello.num_blocks)
        if len(self._ranks) == self.options.num_executors:
            self._form_group()

    def _check_hello(self, hello: link.ExecutorHello) -> str | None:
        cfg = self.config
        if not 0 <= hello.rank < self.options.num_executors:
            return f"rank {hello.rank} is outside [0, {self.options.num_executors})"
        if hello.block_size != self.options.block_size:
            return (f"executor block_size {hello.block_size} != scheduler block_size "
                    f"{self.options.block_size}")
        if hello.model_name != self.model_name or hello.vocab_size != self.vocab_size:
            return (f"executor serves {hello.model_name} (vocab {hello.vocab_size}), scheduler "
                    f"serves {self.model_name} (vocab {self.vocab_size})")
        if hello.max_num_batched_tokens < cfg.max_num_batched_tokens:
            return (f"executor max_num_batched_tokens {hello.max_num_batched_tokens} < scheduler's "
                    f"{cfg.max_num_batched_tokens}")
        if hello.max_num_seqs < cfg.max_num_seqs:
            return f"executor max_num_seqs {hello.max_num_seqs} < scheduler's {cfg.max_num_seqs}"
        if hello.info.get("max_model_len", cfg.max_model_len) < cfg.max_model_len:
            return (f"executor max_model_len {hello.info['max_model_len']} < scheduler's "
                    f"{cfg.max_model_len}")
        return None

    def _form_group(self) -> None:
        self._num_blocks = min(r.hello.num_blocks for r in self._ranks.values())
        cache_config = CacheConfig(block_size=self.options.block_size, num_blocks=self._num_blocks,
                                   enable_prefix_caching=self.options.enable_prefix_caching)
        self._scheduler = Scheduler(self.config, cache_config)
        self._counters = _Counters()
        _log.info("executor group ready: %d rank(s), %d KV blocks", len(self._ranks), self._num_blocks)
        if not self._reported_ready:
            self._reported_ready = True
            self.status.ready(
                client_address=self.client_address, executor_address=self.executor_address,
                metrics_address=self.metrics_address, model_name=self.model_name, pid=os.getpid(),
                num_blocks=self._num_blocks,
                executors=[{"rank": r.hello.rank, "pid": r.hello.pid, "num_blocks": r.hello.num_blocks,
                            "metrics_address": r.hello.metrics_address}
                           for r in sorted(self._ranks.values(), key=lambda r: r.hello.rank)])
        self._wake.set()

    def _on_result(self, identity: bytes, payload: bytes) -> None:
        rank = self._rank_of(identity)
        future = self._result
        if rank is None or rank.hello.rank != 0 or future is None or future.done():
            return  # a late result of a failed step or a lost group
        try:
            result = decode_step_result(payload)
        except ProtocolError as exc:
            future.set_exception(ExecutorLost(f"executor sent an undecodable result: {exc}"))
            return
        if result.step_id != self._step_id:
            _log.warning("ignoring result of step %d while waiting for %d", result.step_id,
                         self._step_id)
            return
        future.set_result(result)

    def _fail_step(self, message: str) -> None:
        if self._result is not None and not self._result.done():
            self._result.set_exception(_StepFailed(message))

    def _lose_group(self, message: str) -> None:
        """Every rank is forgotten; in-flight requests fail; new requests wait for a new group."""
        _log.error("%s; failing %d in-flight request(s)", message, len(self._streams))
        if self._result is not None and not self._result.done():
            self._result.set_exception(ExecutorLost(message))
        self._fail_all(message, cp.ENGINE_ERROR)
        self._ranks.clear()
        self._scheduler = None

    async def _watchdog(self) -> None:
        timeout = self.options.executor_timeout
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(_WATCHDOG_INTERVAL_S)
            if parent_gone(self.parent_pid):
                _log.error("supervisor exited; stopping")
                self._stop.set()
                return
            now = time.monotonic()
            if now - last_tick > timeout / 2:
                # This loop itself was stalled: heartbeats may be waiting unread in
                # the socket, so silence proves nothing this time.
                for rank in self._ranks.values():
                    rank.last_seen = now
            last_tick = now
            for rank in list(self._ranks.values()):
                if now - rank.last_seen > timeout:
                    message = (f"executor rank {rank.hello.rank} (pid {rank.hello.pid}) stopped "
                               f"responding: no heartbeat for {timeout:g}s")
                    if self._scheduler is not None:
                        self._lose_group(message)
                    else:
                        _log.error("%s; it left before the group formed", message)
                        del self._ranks[rank.hello.rank]
                    break

    # ------------------------------------------------------------------ steps

    async def _step_loop(self) -> None:
        while True:
            scheduler = self._scheduler
            if scheduler is None or not scheduler.has_unfinished_requests():
                self._refresh_gauges()  # aborts may have changed them since the last step
                self._wake.clear()
                await self._wake.wait()
                continue
            start = time.perf_counter()
            plan = scheduler.schedule()
            phase = self.metrics.step_phase
            phase["schedule"].observe(time.perf_counter() - start)
            if not plan.num_scheduled_tokens and not plan.finished_req_ids \
                    and not plan.preempted_req_ids:
                # Nothing can run until a request arrives or is aborted.
                self._wake.clear()
                await self._wake.wait()
                continue
            self._step_id = plan.step_id
            try:
                result = await self._run_step(plan)
            except _StepFailed as exc:
                self._fail_scheduled(plan, str(exc))
                continue
            except ExecutorLost:
                continue  # _lose_group already failed the requests
            start = time.perf_counter()
            outputs = scheduler.update_from_output(plan, result)
            updated = time.perf_counter()
            self._on_step_done(plan, outputs)
            phase["update"].observe(updated - start)
            phase["outputs"].observe(time.perf_counter() - updated)

    async def _run_step(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        encoded = encode_step_plan(plan)
        sent = time.perf_counter()
        self.metrics.step_phase["plan_encode"].observe(sent - start)
        now = time.monotonic()
        for new in plan.new_requests:
            stream = self._streams.get(new.request_id)
            if stream is not None and stream.scheduled_time is None:
                stream.scheduled_time = now
                self.metrics.request_queue_time.observe(now - stream.arrival_time)
                self.metrics.prompt_tokens.inc(len(stream.prompt_token_ids))
        self._result = asyncio.get_running_loop().create_future()
        for rank in sorted(self._ranks.values(), key=lambda r: r.hello.rank):
            if not self._send_executor(rank.identity, link.PLAN, encoded):
                message = f"executor rank {rank.hello.rank} (pid {rank.hello.pid}) is unreachable"
                self._lose_group(message)
                raise ExecutorLost(message)
        try:
            result = await self._result
        finally:
            self._result = None
        self.metrics.step_phase["executor"].observe(time.perf_counter() - sent)
        return result

    def _fail_scheduled(self, plan: StepPlan, message: str) -> None:
        """A failed step: every request the executor holds state for is failed."""
        held = set(plan.num_scheduled_tokens) | set(plan.preempted_req_ids)
        held.update(r for r, s in self._streams.items() if s.scheduled_time is not None)
        _log.error("%s; failing %d request(s)", message, len(held))
        if self._scheduler is not None:
            self._scheduler.finish_requests(sorted(held), RequestStatus.FINISHED_ABORTED)
        for rid in held:
            stream = self._streams.get(rid)
            if stream is not None:
                self._finish_stream(stream, "error")
                self._send_error(stream.identity, rid, cp.ENGINE_ERROR, message)

    def _on_step_done(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        by_client: dict[bytes, list[cp.StreamOutput]] = {}
        stopped: list[str] = []
        num_generated = 0
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            num_generated += len(out.new_token_ids)
            item = self._stream_output(stream, out, now)
            if item.finished and not out.finished:  # a stop string, seen only here
                stopped.append(out.request_id)
            by_client.setdefault(stream.identity, []).append(item)
        if stopped and self._scheduler is not None:
            self._scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for identity, items in by_client.items():
            self._send_client(identity, cp.encode_outputs(items))
        self._update_step_metrics(plan, num_generated)

    def _stream_output(self, stream: _Stream, out: RequestOutput, now: float) -> cp.StreamOutput:
        """Detokenize, apply stop strings, and build the client's output for one request."""
        new_ids = out.new_token_ids
        finished, reason = out.finished, out.finish_reason
        if new_ids:
            if stream.last_token_time is None:
                self.metrics.time_to_first_token.observe(now - stream.arrival_time)
            else:
                self.metrics.inter_token_latency.observe(now - stream.last_token_time)
            stream.last_token_time = now
            stream.num_output_tokens += len(new_ids)
            searched_from = max(0, len(stream.text) - stream.holdback)
            stream.text += stream.detokenizer.add(new_ids)
            if stream.params.stop and stream.num_output_tokens >= stream.params.min_tokens:
                cut = _find_stop(stream.text, stream.params.stop, searched_from)
                if cut is not None:
                    stream.text = stream.text[:cut]
                    finished, reason = True, "stop"
        end = len(stream.text) if finished else max(stream.num_sent_chars,
                                                     len(stream.text) - stream.holdback)
        item = cp.StreamOutput(
            request_id=stream.request_id, new_token_ids=list(new_ids),
            text=stream.text[stream.num_sent_chars:end], finished=finished,
            finish_reason=reason, prompt_tokens=len(stream.prompt_token_ids),
            completion_tokens=stream.num_output_tokens,
            prompt_token_ids=None if stream.sent_prompt_ids else stream.prompt_token_ids,
            logprobs=_logprobs_to_dict(out))
        stream.num_sent_chars = end
        stream.sent_prompt_ids = True
        if finished:
            self._finish_stream(stream, reason or "stop")
        return item

    def _final_output(self, stream: _Stream, reason: str) -> cp.StreamOutput:
        return cp.StreamOutput(
            request_id=stream.request_id, new_token_ids=[], text=stream.text[stream.num_sent_chars:],
            finished=True, finish_reason=reason, prompt_tokens=len(stream.prompt_token_ids),
            completion_tokens=stream.num_output_tokens,
            prompt_token_ids=None if stream.sent_prompt_ids else stream.prompt_token_ids)

    def _finish_stream(self, stream: _Stream, reason: str) -> None:
        if self._streams.pop(stream.request_id, None) is None:
            return
        self.metrics.request_success(reason)
        self.metrics.e2e_request_latency.observe(time.monotonic() - stream.arrival_time)

    def _fail_all(self, message: str, code: str) -> None:
        for stream in list(self._streams.values()):
            self._finish_stream(stream, "error")
            self._send_error(stream.identity, stream.request_id, code, message)
        if self._scheduler is not None:
            self._scheduler.finish_requests(list(self._scheduler.requests),
                                            RequestStatus.FINISHED_ABORTED)

    def _update_step_metrics(self, plan: StepPlan, num_generated: int) -> None:
        self.metrics.iteration_tokens.observe(plan.total_num_scheduled_tokens)
        self.metrics.generation_tokens.inc(num_generated)
        self._refresh_gauges()

    def _refresh_gauges(self) -> None:
        m = self.metrics
        if self._scheduler is None:
            m.num_requests_running.set(0)
            m.num_requests_waiting.set(0)
            m.kv_cache_usage_perc.set(0)
            return
        stats = self._scheduler.stats()
        m.num_requests_running.set(stats.num_running)
        m.num_requests_waiting.set(stats.num_waiting)
        m.kv_cache_usage_perc.set(stats.kv_cache_usage)
        m.num_preemptions.inc(self._counters.delta("preemptions", stats.num_preemptions))
        m.prefix_cache_queries.inc(self._counters.delta("queries", stats.prefix_cache_queries))
        m.prefix_cache_hits.inc(self._counters.delta("hits", stats.prefix_cache_hits))


class _StepFailed(RuntimeError):
    """An executor reported that a step raised."""


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Index where the earliest stop string begins at or after ``start``."""
    hits = [i for stop in stops if (i := text.find(stop, start)) != -1]
    return min(hits) if hits else None


def _logprobs_to_dict(out: RequestOutput) -> dict[str, list[list[Any]]] | None:
    if out.logprobs is None:
        return None
    return {"token_ids": out.logprobs.token_ids, "logprobs": out.logprobs.logprobs}
