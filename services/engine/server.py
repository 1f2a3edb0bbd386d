"""The scheduler process (``weir scheduler``): sockets, the step loop, shutdown.

It binds two ROUTER sockets and runs, on one asyncio loop:

* ``ClientFrontend.run``: clients in (``frontend``);
* ``ExecutorGroup.run`` and ``.watchdog``: executor ranks in (``executor_group``);
* ``_step_loop``: while there is work, ``EngineCore.step()`` (``core``) and publish its
  outputs to the clients; it sleeps on an event while there is none;
* ``_watch_parent``: exit when a supervising ``weir serve`` is gone.

The KV cache is sized from the executors' handshake (the smallest ``num_blocks``
over ranks), so there is no ``EngineCore`` until a full group of executors has
said hello; requests arriving before that get a ``server_unavailable`` error
instead of waiting forever. When the group is lost (a rank died or went silent),
its requests stay: they wait, with any that arrive meanwhile, until a new group
forms (``weir serve`` restarts a dead executor), are then sent again and
recomputed, and stream on without a token lost or repeated; only if no group
forms within ``--recovery-timeout`` do they fail.

SIGTERM drains: new requests are refused, in-flight ones finish (up to
``--drain-timeout``), then the process stops. SIGINT stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from weir.services.engine.core import EngineCore, EngineStep, ExecutorLostError, StepFailedError
from weir.services.engine.executor_group import ExecutorGroup, ExpectedExecutor
from weir.services.engine.frontend import CLIENT_SNDHWM, ClientFrontend
from weir.services.engine.image_prompts import ImagePrompts
from weir.services.engine.kv_event_publisher import KVEventPublisher
from weir.services.engine.lora_registry import LoraRegistry
from weir.services.engine.metrics import CacheConfigInfo, LoraRequestGauges, SchedulerMetrics
from weir.services.engine.ngram import make_proposer
from weir.services.engine.tracing import RequestTracer
from weir.services.metrics_endpoint import start_metrics_server
from weir.services.scheduler.kv_events import KVEventLog
from weir.services.scheduler.scheduler import Scheduler, SpecDecodeStats
from weir.services.startup_heap import freeze_startup_heap
from weir.services.supervised import StatusReporter, parent_gone
from weir.shared.config import (
    DEFAULT_MAX_MESSAGE_BYTES,
    LOOPBACK_HOSTS,
    EngineArgs,
    make_profiler_dir,
    tcp_address,
)
from weir.shared.hub_cache import model_name_of
from weir.shared.image_processors import image_processor
from weir.shared.keys import (
    CLIENT_DOMAIN,
    EXECUTOR_DOMAIN,
    SchedulerKeys,
    keys_dir,
    serve_curve,
    start_authenticator,
)
from weir.shared.lora import check_adapter
from weir.shared.model_config import check_drafts, check_new_weights, read_model_config
from weir.shared.model_store import resolve_model
from weir.shared.pooling import read_pooler_config, resolve_runner
from weir.shared.protocol import client as client_protocol
from weir.shared.protocol import control
from weir.shared.sampling_defaults import read_sampling_defaults
from weir.shared.tokenizer import Tokenizer, chat_template_of, served_tokenizer

_log = logging.getLogger(__name__)

_PARENT_CHECK_INTERVAL_S = 0.5
# A step may take seconds (a long prefill on a CPU), and arrivals do not refresh the
# gauges (a burst would pay for it): the gauges catch up at this pace meanwhile.
_GAUGE_INTERVAL_S = 1.0
# Outputs wait for at most this many steps, and a step's outputs for its next result this long
# (a result in the executor socket takes a few event-loop turns to be read).
MAX_UNPUBLISHED_STEPS = 4
RESULT_WAIT_S = 100e-6


def _largest_executor_frame(args: EngineArgs, max_logprobs: int) -> int:
    """A bound on what an executor sends, so a peer cannot make this process buffer a
    400 MB frame: its largest is a step result, a row per running request's token or
    prompt token computed (prompt logprobs), each of up to ``max_logprobs`` + 2 (token,
    logprob) pairs (the sampled or prompt token's and its rank beside the top ones), well
    under 32 bytes a pair."""
    tokens, seqs = args.step_limits
    rows = max(tokens, seqs * (1 + args.num_speculative_tokens))
    return max(DEFAULT_MAX_MESSAGE_BYTES, 32 * rows * (max_logprobs + 2))


@dataclass(slots=True)
class SchedulerServerOptions:
    """Where the scheduler process listens; engine options are in ``engine_args``."""

    model_dir: str
    engine_args: EngineArgs
    max_model_len: int  # engine_args.max_model_len, or the model's context length
    host: str
    port: int  # 0: any free port
    metrics_port: int | None  # None: no metrics endpoint
    executor_address: str
    num_executors: int
    metrics_host: str | None = None  # None: the same address as the client socket
    replica: int = 0  # its index among `weir serve --data-parallel-size` engines


@dataclass(slots=True)
class _Counters:
    """Last seen values of the scheduler's cumulative stats (Prometheus counters need deltas)."""

    values: dict[str, int]

    def delta(self, name: str, value: int) -> int:
        previous = self.values.get(name, 0)
        self.values[name] = value
        return max(0, value - previous)


class SchedulerServer:
    def __init__(
        self,
        options: SchedulerServerOptions,
        status: StatusReporter | None = None,
        parent_pid: int | None = None,
    ) -> None:
        self.options = options
        self.status = status or StatusReporter(None)
        self.parent_pid = parent_pid
        model_dir = Path(options.model_dir)
        self.engine_args = options.engine_args
        self.model_config = read_model_config(model_dir, self.engine_args.hf_overrides)
        self.tokenizer = served_tokenizer(
            model_dir,
            self.model_config.vocab_size,
            self.engine_args.tokenizer,
            chat_template_of(self.engine_args.chat_template),
        )
        self.sampling_defaults = read_sampling_defaults(
            self.engine_args.generation_config,
            model_dir,
            self.engine_args.override_generation_config,
        )
        if self.sampling_defaults:
            _log.info(
                "requests that leave them out sample with %s (generation_config.json; "
                "--generation-config vllm turns this off)",
                self.sampling_defaults,
            )
        self.vocab_size = self.model_config.vocab_size
        # The most a request's logprobs and prompt_logprobs may ask for: no more than the
        # vocabulary holds (vLLM's --max-logprobs, -1 meaning all of it).
        limit = self.engine_args.max_logprobs
        self.max_logprobs = self.vocab_size if limit == -1 else min(limit, self.vocab_size)
        # What clients and metrics call the model; executors report the directory's name.
        self.model_names = self.engine_args.model_names(model_name_of(model_dir))
        self.model_name = self.model_names[0]
        if self.engine_args.profiler_dir is not None:  # before any trace is taken
            make_profiler_dir(self.engine_args.profiler_dir)
        if self.engine_args.max_prompt_chars is not None and self.engine_args.max_prompt_chars < 1:
            raise ValueError("max_prompt_chars must be at least 1")
        self.scheduler_config = self.engine_args.scheduler_config(options.max_model_len)
        self.runner = resolve_runner(
            self.engine_args.runner, model_dir, self.model_config.num_labels
        )
        if self.runner == "generate" and self.engine_args.pooler_config:
            raise ValueError("--pooler-config configures --runner pooling; this server generates")
        self.pooler = (
            None
            if self.runner == "generate"
            else read_pooler_config(
                model_dir,
                self.model_config.hidden_size,
                self.engine_args.pooler_config,
                self.model_config.num_labels,
                reads_last_token=bool(self.model_config.classifier_from_token),
                hf_overrides=self.engine_args.hf_overrides,
            )
        )
        make_proposer(self.engine_args)  # bad speculative options fail here, at start-up
        self._check_linear_attention()
        # An EAGLE head has no tokenizer: it reads the served model's embedding.
        if self.engine_args.speculative_method == "draft_model":
            assert self.engine_args.speculative_model is not None
            self._check_draft_model(self.engine_args.speculative_model)
        # Bad adapters fail here too, before executors load them.
        self._static_loras = {m: self._check_adapter(m.path) for m in self.engine_args.loras}
        self.loras = LoraRegistry(
            self._static_loras,
            self.model_names,
            self._check_adapter if self.engine_args.allow_runtime_lora_updating else None,
        )
        directory = keys_dir(self.engine_args.keys_dir)
        self.keys = None if directory is None else SchedulerKeys.load(directory)
        self.metrics = SchedulerMetrics(self.model_name)
        endpoint = self.engine_args.otlp_traces_endpoint
        self.tracer = None if endpoint is None else RequestTracer(endpoint, self.model_name)
        CacheConfigInfo(self.model_name, self._scheduler, self.metrics.registry)
        if self.engine_args.lora_enabled:
            LoraRequestGauges(
                self.model_name,
                self.engine_args.max_loras,
                lambda: self.loras.ids,
                self._scheduler,
                self.metrics.registry,
            )
        self.kv_events_config = self.engine_args.kv_events.for_replica(options.replica)
        self.kv_event_log = (
            KVEventLog(self.engine_args.block_size) if self.kv_events_config.publishes else None
        )
        if self.kv_event_log is not None and not self.engine_args.enable_prefix_caching:
            _log.warning("KV events report the prefix cache's blocks: none without prefix caching")
        self.kv_event_publisher: KVEventPublisher | None = None
        self.metrics_address: str | None = None
        self.client_address = ""
        self.executor_address = ""
        self._counters = _Counters({})
        self._spec_seen = SpecDecodeStats()
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._num_blocks = 0
        self._reported_ready = False
        self._recovery_deadline: asyncio.TimerHandle | None = None
        self._draining = False
        self._waking: asyncio.Task[None] | None = None  # a sleeping engine woken to drain
        self._telling_executors: asyncio.Task[None] | None = None  # the drain, each second

    def _check_linear_attention(self) -> None:
        """A model with linear-attention layers (Qwen 3.5's) keeps one state per request,
        which neither takes back rejected drafts nor is restored by a cached prefix: drafts
        are refused, and prefix caching is off."""
        if not self.model_config.linear_layers:
            return
        if self.engine_args.speculative_method is not None:
            check_drafts(self.model_config)
        if self.engine_args.enable_prefix_caching and not self.model_config.caches_prefixes:
            _log.info(
                "prefix caching is off: the linear-attention layers of %s keep a state per "
                "request that a cached prefix does not restore",
                self.model_config.model_type,
            )

    def _check_draft_model(self, model: str) -> None:
        """A draft model whose tokenizer is not the served model's is refused at start-up:
        its drafts would name other tokens and be rejected, at the cost of every step. With
        ``--tokenizer`` the draft is served with that tokenizer too (vLLM's draft model
        config takes the target's tokenizer): it needs none of its own (a .gguf draft's is
        not converted), only an embedding row for each of that tokenizer's ids; one it has
        (a directory's tokenizer.json) must still number tokens as the served one does."""
        tokenizer_dir = self.engine_args.tokenizer
        draft_dir = resolve_model(
            model, load_format=self.engine_args.load_format, tokenizer=tokenizer_dir
        )
        if tokenizer_dir is not None:
            draft_vocab = read_model_config(draft_dir, None).vocab_size
            try:
                served_tokenizer(draft_dir, draft_vocab, tokenizer_dir)
            except ValueError as exc:
                raise ValueError(f"speculative_model {model!r}: {exc}") from None
            if not (draft_dir / "tokenizer.json").is_file():
                return
        draft = Tokenizer.from_model_dir(draft_dir)
        if draft.backend.get_vocab(with_added_tokens=True) != self.tokenizer.backend.get_vocab(
            with_added_tokens=True
        ):
            raise ValueError(
                f"speculative_model {model!r}: its tokenizer is not the served model's (a "
                "draft must number tokens as the served model does); choose a smaller model of "
                "the same family"
            )

    def _check_adapter(self, path: str) -> str:
        return check_adapter(path, self.model_config, self.engine_args.max_lora_rank).fingerprint

    def _check_weights(self, path: str) -> None:
        check_new_weights(path, self.model_config, self.engine_args.hf_overrides)

    @property
    def core(self) -> EngineCore | None:
        return self.frontend.core

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        opts = self.options
        ctx = zmq.asyncio.Context()
        client_sock = ctx.socket(zmq.ROUTER)
        client_sock.setsockopt(zmq.LINGER, 0)
        if ":" in opts.host:  # an IPv6 --host (an IPv4 one's address is then shown mapped)
            client_sock.setsockopt(zmq.IPV6, 1)
        client_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        client_sock.setsockopt(zmq.SNDHWM, CLIENT_SNDHWM)
        # A client sending more is disconnected by ZeroMQ before the frame is buffered.
        client_sock.setsockopt(zmq.MAXMSGSIZE, self.engine_args.max_message_size)
        executor_sock = ctx.socket(zmq.ROUTER)
        executor_sock.setsockopt(zmq.LINGER, 0)
        if "[" in opts.executor_address:
            executor_sock.setsockopt(zmq.IPV6, 1)
        executor_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        executor_sock.setsockopt(
            zmq.MAXMSGSIZE, _largest_executor_frame(self.engine_args, self.max_logprobs)
        )
        auth = None
        if self.keys is not None:
            auth = start_authenticator(ctx, self.keys)
            serve_curve(client_sock, self.keys.server, CLIENT_DOMAIN)
            serve_curve(executor_sock, self.keys.cluster, EXECUTOR_DOMAIN)
        elif opts.host not in LOOPBACK_HOSTS:
            _log.warning(
                "binding %s without keys: anyone who reaches these ports can send requests "
                "or join as an executor (make keys with `weir keys DIR`, pass --keys-dir)",
                opts.host,
            )
        # Made before anything is bound: the metrics endpoint's /health reads them at once.
        self.frontend = ClientFrontend(
            client_sock,
            self.tokenizer,
            self.vocab_size,
            self.scheduler_config.max_model_len,
            self.metrics,
            self._wake.set,
            self._requests_ended,
            self._health,
            self._model_info,
            self.engine_args.max_prompt_chars,
            self.max_logprobs,
            self.loras,
            self.pooler,
            self._check_weights,
            None if self.engine_args.load_format == "dummy" else str(self.options.model_dir),
            self.engine_args.profiler_dir,
            self.tracer,
            self._image_prompts(),
            self.engine_args.max_images_per_prompt,
        )
        self.group = ExecutorGroup(
            executor_sock,
            ExpectedExecutor(
                opts.num_executors,
                Path(opts.model_dir).name,
                self.vocab_size,
                self.scheduler_config.max_model_len,
                self.engine_args,
                {module.name: fingerprint for module, fingerprint in self._static_loras.items()},
            ),
            self.engine_args.executor_timeout,
            self._on_group_formed,
            self._on_group_lost,
            self._observe_phase,
        )

        try:
            for sock, endpoint, option in (
                (client_sock, tcp_address(opts.host, opts.port or "*"), "--port"),
                (executor_sock, opts.executor_address, "--executor-address"),
            ):
                try:
                    sock.bind(endpoint)
                except zmq.ZMQError as exc:
                    reason = zmq.strerror(exc.errno) if exc.errno else str(exc)
                    raise OSError(
                        exc.errno, f"cannot bind {endpoint}: {reason} ({option})"
                    ) from None
            if opts.metrics_port is not None:
                try:
                    self.metrics_address = start_metrics_server(
                        self.metrics.registry,
                        opts.metrics_host or opts.host,
                        opts.metrics_port,
                        ready=self._serving,
                    )
                except OSError as exc:
                    raise OSError(exc.errno, f"{exc.strerror} (--metrics-port)") from None
            if self.kv_event_log is not None:
                self.kv_event_publisher = KVEventPublisher(ctx, self.kv_events_config, opts.replica)
        except OSError as exc:
            message = exc.strerror or str(exc)
            self.status.error(message)
            _log.error("scheduler cannot start: %s", message)
            if auth is not None:
                auth.stop()
            ctx.destroy(linger=0)
            return 1
        self.client_address = client_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.executor_address = executor_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        _log.info(
            "scheduler for %s: clients %s, executors %s, metrics %s",
            self.model_name,
            self.client_address,
            self.executor_address,
            self.metrics_address,
        )
        publisher = self.kv_event_publisher
        if publisher is not None:
            _log.info("KV events on %s (replays: %s)", publisher.address, publisher.replay_address)

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._drain)
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        tasks = [
            loop.create_task(coro)
            for coro in (
                self.frontend.run(),
                self.group.run(),
                self.group.watchdog(),
                self._step_loop(),
                self._watch_parent(),
                self._refresh_gauges_meanwhile(),
                *(() if publisher is None else (publisher.serve_replays(),)),
            )
        ]
        stop = loop.create_task(self._stop.wait())
        try:
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            crashed = [t for t in done if t is not stop and t.exception() is not None]
            for task in crashed:
                _log.error("scheduler task failed", exc_info=task.exception())
            return 1 if crashed else 0
        finally:
            if ids := self.frontend.in_flight_ids():
                _log.warning(
                    "stopping with %d request(s) unfinished (%s%s); each gets a "
                    "server_unavailable error",
                    len(ids),
                    ", ".join(ids[:20]),
                    ", ..." if len(ids) > 20 else "",
                )
            self.frontend.fail_all(
                client_protocol.SERVER_UNAVAILABLE, "the server is shutting down"
            )
            self.frontend.close()
            for task in [stop, *tasks]:
                task.cancel()
            if self._telling_executors is not None:
                self._telling_executors.cancel()
            await asyncio.gather(stop, *tasks, return_exceptions=True)
            self.group.goodbye()
            # Give the shutdown errors and goodbyes just queued a moment to reach their peers.
            client_sock.close(linger=500)
            executor_sock.close(linger=500)
            if publisher is not None:
                publisher.close()
            if self.tracer is not None:
                self.tracer.close()
            if auth is not None:
                auth.stop()
            ctx.destroy(linger=0)

    async def _watch_parent(self) -> None:
        while not parent_gone(self.parent_pid):
            await asyncio.sleep(_PARENT_CHECK_INTERVAL_S)
        _log.error("supervisor exited; stopping")
        self._stop.set()

    async def _refresh_gauges_meanwhile(self) -> None:
        while True:
            await asyncio.sleep(_GAUGE_INTERVAL_S)
            self._refresh_gauges()
            self._send_kv_events()  # a prefix cache reset or a new executor group's cache

    def _drain(self) -> None:
        if self._draining or not self.frontend.num_in_flight:
            self._stop.set()
            return
        timeout = self.engine_args.drain_timeout
        _log.warning(
            "draining: refusing new requests, finishing %d in flight (up to %gs)",
            self.frontend.num_in_flight,
            timeout,
        )
        self._draining = True
        self._telling_executors = asyncio.get_running_loop().create_task(self._tell_draining())
        self.frontend.unavailable = "the server is shutting down; send the request elsewhere"
        # A paused (or sleeping) engine would finish nothing.
        self._waking = asyncio.get_running_loop().create_task(self._wake_to_drain())
        asyncio.get_running_loop().call_later(timeout, self._stop.set)

    async def _tell_draining(self) -> None:
        """Tell the executors the drain goes on, until the process stops: one sent SIGTERM
        serves while it hears it (and stops if the scheduler dies without its goodbye)."""
        while True:
            self.group.tell_draining()
            await asyncio.sleep(control.DRAINING_INTERVAL_S)

    async def _wake_to_drain(self) -> None:
        try:
            await self.frontend.wake_up(resume=True)
        except (ValueError, ExecutorLostError) as exc:
            _log.error("draining: the engine could not wake up to finish its requests: %s", exc)

    def _scheduler(self) -> Scheduler | None:
        """The scheduler, once the executors have sized the cache (the metrics' collectors)."""
        return None if self.core is None else self.core.scheduler

    def _serving(self) -> bool:
        """Serving and taking requests: the metrics endpoint's /health (readiness probe)."""
        return self.core is not None and self.group.formed and not self._draining

    def _image_prompts(self) -> ImagePrompts | None:
        """How the front end expands a prompt's images; None for a model of text only."""
        token, vision = self.model_config.image_token_id, self.model_config.vision
        if token is None or vision is None:
            return None
        return ImagePrompts(image_processor(self.options.model_dir, vision), token)

    def _on_group_formed(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        cache_config = self.engine_args.cache_config(
            num_blocks,
            self.model_config.rope.long_prompt_threshold,
            prefix_caching=self.model_config.caches_prefixes,
        )
        core = self.core
        if core is None:
            self._check_cache_holds_max_model_len(num_blocks)
            self.frontend.core = EngineCore(
                Scheduler(self.scheduler_config, cache_config, self.kv_event_log),
                self.group,
                self._observe_phase,
                make_proposer(self.engine_args),
            )
        else:
            if self._recovery_deadline is not None:
                self._recovery_deadline.cancel()
                self._recovery_deadline = None
            if not self._draining:
                self.frontend.unavailable = None
            self.frontend.group_replaced()
            too_big = core.scheduler.reset_executor_state(cache_config)
            for rid, problem in too_big.items():
                _log.error(
                    "request %s failed: the new executor group's cache is smaller: %s", rid, problem
                )
                self.frontend.fail(
                    [rid],
                    client_protocol.ENGINE_ERROR,
                    f"the executor group that replaced the lost one cannot finish this "
                    f"request: {problem}; send it again to a server with more KV cache",
                )
            _log.warning(
                "executor group back: resuming %d request(s)", len(core.scheduler.requests)
            )
        if not self._reported_ready:
            self._reported_ready = True
            freeze_startup_heap()
            publisher = self.kv_event_publisher
            self.status.ready(
                client_address=self.client_address,
                executor_address=self.executor_address,
                metrics_address=self.metrics_address,
                kv_events_address=None if publisher is None else publisher.address,
                kv_events_replay_address=None if publisher is None else publisher.replay_address,
                model_name=self.model_name,
                pid=os.getpid(),
                num_blocks=num_blocks,
                executors=self.group.describe(),
            )
        self._wake.set()

    def _check_cache_holds_max_model_len(self, num_blocks: int) -> None:
        """Say at start where the longest request (max_model_len - 1 tokens of KV) cannot
        fit: each request that could grow past the cache, one without max_tokens among
        them, is refused (vLLM refuses to start)."""
        tokens = num_blocks * self.engine_args.block_size
        max_len = self.scheduler_config.max_model_len
        if tokens < max_len - 1:
            _log.warning(
                "the KV cache holds %d tokens (%d blocks), fewer than a request of "
                "max_model_len %d may need: requests that could grow past it are refused, "
                "and those without max_tokens end there (length). "
                "Give the executors more --kv-cache-memory (or --gpu-memory-utilization), "
                "or --max-model-len %d or less",
                tokens,
                num_blocks,
                max_len,
                tokens + 1,
            )

    def _on_group_lost(self, message: str, pids: list[int]) -> None:
        # A rank given up on may still run, hung (it never comes back to be reset): its
        # supervisor kills it, and the executor started again takes its place.
        self.status.report("executors_lost", pids=pids)
        if self.core is not None:
            self.core.abandon_next()
        timeout = self.engine_args.recovery_timeout
        _log.error(
            "%s; %d request(s) wait for a new executor group (up to %gs)",
            message,
            len(self.frontend.streams),
            timeout,
        )
        self._recovery_deadline = asyncio.get_running_loop().call_later(
            timeout, self._recovery_failed, message
        )

    def _recovery_failed(self, message: str) -> None:
        self._recovery_deadline = None
        if not self._draining:
            self.frontend.unavailable = (
                "no executor is connected; try again once the server is healthy"
            )
        _log.error("no executor group formed again after: %s; failing every request", message)
        self.frontend.fail_all(
            client_protocol.ENGINE_ERROR,
            "the executor was lost and no executor group formed again within "
            f"{self.engine_args.recovery_timeout:g}s; send the request again later",
        )
        self._requests_ended()

    # ------------------------------------------------------------------ the loop

    async def _step_loop(self) -> None:
        # Steps applied whose outputs are not yet sent: while the next result is already in,
        # the loop applies it (and plans the step after) first, and sends both steps' outputs
        # at once; publishing costs per request, not per token, so a loop slower than the
        # executor catches up instead of leaving it idle.
        unpublished: list[EngineStep] = []
        while True:
            core = self.core
            step = None
            if core is not None and self.group.formed and core.has_work():
                try:
                    step = await core.step()
                except StepFailedError as exc:
                    self._publish(unpublished)
                    self._on_step_failed(exc)
                    continue
                except ExecutorLostError:
                    self._publish(unpublished)
                    continue  # its requests wait for the next group (``_on_group_formed``)
            elif self._draining and not self.frontend.num_in_flight:
                _log.warning("drained: stopping")
                self._stop.set()
            if step is None:
                if unpublished:
                    self._publish(unpublished)
                    continue  # a drain may be done now
                self._refresh_gauges()  # aborts may have changed them since the last step
                self._send_kv_events()
                self._wake.clear()
                await self._wake.wait()
                continue
            unpublished.append(step)
            assert core is not None
            if len(unpublished) < MAX_UNPUBLISHED_STEPS and await core.next_result_in(
                RESULT_WAIT_S
            ):
                continue
            self._publish(unpublished)

    def _publish(self, steps: list[EngineStep]) -> None:
        """Send the outputs of ``steps`` (then none are left)."""
        if not steps:
            return
        start = time.perf_counter()
        for step in steps:
            self.metrics.iteration_tokens.observe(step.plan.total_num_scheduled_tokens)
        self.frontend.publish(steps, before_send=self._refresh_gauges)
        self._send_kv_events()
        steps.clear()
        self._observe_phase("outputs", time.perf_counter() - start)

    def _on_step_failed(self, exc: StepFailedError) -> None:
        if not exc.request_ids:
            _log.error("%s; sending every request again to find the one that caused it", exc)
            return
        for rid in exc.request_ids:
            _log.error("request %s failed: it makes the executor's step raise: %s", rid, exc)
        self.frontend.fail(
            exc.request_ids,
            client_protocol.ENGINE_ERROR,
            f"the executor cannot run this request: {exc}",
        )
        self._requests_ended()

    def _requests_ended(self) -> None:
        """Requests ended outside a step: the gauges show it now, and the step loop wakes
        to tell the executors (``finished_req_ids``)."""
        self._refresh_gauges()
        self._wake.set()

    def _observe_phase(self, phase: str, seconds: float) -> None:
        self.metrics.step_phase[phase].observe(seconds)

    def _send_kv_events(self) -> None:
        log, publisher = self.kv_event_log, self.kv_event_publisher
        if log is not None and log.events and publisher is not None:
            publisher.publish(log.take())

    def _refresh_gauges(self) -> None:
        m = self.metrics
        if self.core is None:
            m.num_requests_running.set(0)
            m.num_requests_waiting.set(0)
            m.kv_cache_usage_perc.set(0)
            return
        m.engine_paused.set(1 if self.core.paused else 0)
        stats = self.core.scheduler.stats()
        m.num_requests_running.set(stats.num_running)
        m.num_requests_waiting.set(stats.num_waiting)
        m.kv_cache_usage_perc.set(stats.kv_cache_usage)
        m.num_preemptions.inc(self._counters.delta("preemptions", stats.num_preemptions))
        m.prefix_cache_queries.inc(self._counters.delta("queries", stats.prefix_cache_queries))
        m.prefix_cache_hits.inc(self._counters.delta("hits", stats.prefix_cache_hits))
        m.observe_spec_decode(stats.spec_decode, self._spec_seen)
        self._spec_seen = stats.spec_decode

    # ------------------------------------------------------------------ queries

    def _health(self, stream_ids: list[str]) -> dict[str, Any]:
        streams = self.frontend.streams
        if self.core is None:
            status = "waiting_for_executors"
        elif self._draining:
            status = "draining"
        else:
            status = "ok" if self.group.formed else "recovering"
        info: dict[str, Any] = {
            "status": status,
            "executors": sorted(self.group.ranks),
            "num_executors": self.options.num_executors,
            "num_streams": len(streams),
        }
        if stream_ids:
            info["lost_request_ids"] = [
                rid for rid in stream_ids if not self.frontend.in_flight(rid)
            ]
        if self.core is not None:
            stats = self.core.scheduler.stats()
            info.update(
                num_requests_running=stats.num_running,
                num_requests_waiting=stats.num_waiting,
                kv_cache_usage=stats.kv_cache_usage,
                num_blocks=stats.num_blocks,
                num_free_blocks=stats.num_free_blocks,
                num_preemptions=stats.num_preemptions,
            )
        return info

    def _model_info(self) -> dict[str, Any]:
        # What a client needs to form requests; no pids, addresses or engine configuration
        # (the operator finds those in the logs and the ready report).
        return {
            "model_name": self.model_name,
            # Every name a request may use for it (--served-model-name a b).
            "model_names": list(self.model_names),
            "max_model_len": self.scheduler_config.max_model_len,
            "max_message_size": self.engine_args.max_message_size,
            "vocab_size": self.vocab_size,
            "eos_token_id": self.tokenizer.eos_token_id,
            "block_size": self.engine_args.block_size,
            "num_blocks": self._num_blocks if self.core is not None else None,
            "lora_names": list(self.loras.ids),
            "runner": self.runner,
            # A sequence classifier's label names, by index (None for any other model).
            "labels": list(self.pooler.labels) if self.pooler and self.pooler.labels else None,
            # What a request leaving them out samples with (--generation-config).
            "default_sampling_params": self.sampling_defaults,
        }
