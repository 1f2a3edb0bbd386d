"""The executor process: load the model, handshake with the scheduler, run every step it sends.

Loop: receive a plan -> decode -> ``ModelRunner.launch`` -> ``ModelRunner.finish`` ->
(rank 0) send the encoded result. On a GPU without tensor parallelism a plan that is
already waiting is launched before the step in flight is finished (see ``serve``). A step
that raises is answered with ``step_error``; the executor then drops every request (the
scheduler sends them all again and isolates the one that made the step raise) and keeps
serving, except in a tensor-parallel group (the other ranks may be waiting in a collective
this rank never joins): there the rank exits and the group fails. A heartbeat thread proves liveness (see
``weir.shared.protocol.control``). The process exits
when told to (SIGTERM; once serving, when its scheduler no longer needs it: see
``_Stopping``), when its supervisor dies, or when the scheduler it handshook with is
replaced.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from weir.services.executor.metrics import ExecutorMetrics
from weir.services.metrics_endpoint import start_metrics_server
from weir.services.startup_heap import freeze_startup_heap
from weir.services.supervised import StatusReporter, parent_gone
from weir.shared.config import EAGLE_METHODS, EngineArgs
from weir.shared.keys import (
    CLUSTER,
    HandshakeMonitor,
    KeyPair,
    connect_curve,
    keys_dir,
    load_pair,
)
from weir.shared.protocol import control
from weir.shared.protocol.step_codec import decode_step_plan, encode_step_result

if TYPE_CHECKING:
    from weir.services.executor.model_runner import LaunchedStep, ModelRunner
    from weir.services.executor.profiler import StepProfiler

_log = logging.getLogger(__name__)

_POLL_MS = 1000
_HELLO_RETRY_MS = 2000
_SILENT_SCHEDULER_S = 30.0
# Handshakes dropped in a row that suggest our cluster key is not the scheduler's.
_DROPPED_HANDSHAKES_WARNING = 5
# How long an executor sent SIGTERM serves on, to hear whether its scheduler drains:
# Kubernetes signals both pods of a node drain or a deletion at about the same time.
_DRAIN_NOTICE_S = 2.0
# A draining scheduler says so every second (control.DRAINING_INTERVAL_S): silent this
# long, with no step to run, it is gone (killed without its goodbye).
_DRAIN_SILENCE_S = 5.0


@dataclass(slots=True)
class ExecutorOptions:
    """Where the executor connects and reports; engine options are in ``engine_args``."""

    scheduler: str
    engine_args: EngineArgs
    rank: int = 0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no metrics endpoint


class _Heartbeat(threading.Thread):
    """Sends heartbeats on its own socket; sets ``reset`` when the scheduler does not know us."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        address: str,
        cluster_key: KeyPair | None,
        session: str,
        rank: int,
    ) -> None:
        super().__init__(name="weir-heartbeat", daemon=True)
        self._sock = _dealer(ctx, cluster_key)
        self._sock.connect(address)
        self._beat = control.pack(control.Heartbeat(session, rank))
        self.stop_event = threading.Event()
        self.reset = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                try:
                    self._sock.send_multipart([control.HEARTBEAT, self._beat], zmq.NOBLOCK)
                except zmq.Again:  # scheduler unreachable: never block, keep checking stop
                    pass
                if self._sock.poll(int(control.HEARTBEAT_INTERVAL_S * 1000)):
                    kind, *_ = self._sock.recv_multipart()
                    if kind == control.RESET:
                        self.reset.set()
                        return
        finally:
            self._sock.close()


class _Stopping:
    """SIGTERM while serving: the executor stops once its scheduler no longer needs it. Told
    that the scheduler drains, it serves until the scheduler's goodbye (or silence); else it
    waits ``_DRAIN_NOTICE_S`` to be told, serving meanwhile."""

    def __init__(self) -> None:
        self.requested_at: float | None = None
        self.draining_heard_at: float | None = None
        self.scheduler_gone = False

    def request(self, signum: int, frame: object) -> None:
        if self.scheduler_gone:
            raise SystemExit(0)  # nothing to wait for: at once (the loop may be in a long poll)
        if self.requested_at is None:
            self.requested_at = time.monotonic()

    def due(self, idle: bool) -> bool:
        """Whether to stop now; ``idle``: no step in flight and no frame waiting."""
        if self.requested_at is None:
            return False
        if self.scheduler_gone:
            return True
        now = time.monotonic()
        if self.draining_heard_at is not None:
            return idle and now - self.draining_heard_at > _DRAIN_SILENCE_S
        return now - self.requested_at >= _DRAIN_NOTICE_S


class ExecutorWorker:
    def __init__(
        self, options: ExecutorOptions, status: StatusReporter, parent_pid: int | None = None
    ) -> None:
        self.options = options
        self.status = status
        self.parent_pid = parent_pid
        self.session = uuid.uuid4().hex
        self.joined = threading.Event()  # welcomed by the scheduler: /health answers 200
        self.stopping = _Stopping()

    def run(
        self,
        on_loaded: Callable[[], object] = lambda: None,
        on_joined: Callable[[], object] = lambda: None,
    ) -> int:
        """Load, handshake and serve until stopped; returns the process exit code."""
        opts = self.options
        try:
            directory = keys_dir(opts.engine_args.keys_dir)
            cluster_key = None if directory is None else load_pair(directory, CLUSTER)
            runner = load_runner(opts.engine_args, opts.rank)
        except Exception as exc:
            # A bad option or missing model needs its message, not a traceback.
            _log.error(
                "executor %d failed to start: %s",
                opts.rank,
                exc,
                exc_info=not isinstance(exc, ValueError),
            )
            self.status.error(f"{type(exc).__name__}: {exc}")
            return 1
        on_loaded()
        # The supervisor shows what this rank runs on (before the handshake, so it has it
        # by the time the scheduler reports ready).
        self.status.report(
            "loaded",
            rank=opts.rank,
            threads=runner.num_threads,
            cores=sorted(os.sched_getaffinity(0)),
        )
        model_name = runner.model_dir.name  # the scheduler checks it against its own model's
        metrics = ExecutorMetrics(
            opts.engine_args.model_names(model_name)[0], opts.rank, str(runner.device)
        )
        metrics.num_kv_blocks.set(runner.num_blocks)
        if runner.attention.name == "triton":
            self._watch_compiles(metrics)
        metrics_address = None
        if opts.metrics_port is not None:
            try:
                metrics_address = start_metrics_server(
                    metrics.registry,
                    opts.metrics_host,
                    opts.metrics_port,
                    ready=self.joined.is_set,
                )
            except OSError as exc:
                message = (
                    f"{exc.strerror} (--metrics-port; under `weir serve`: --executor-metrics-port)"
                )
                _log.error("executor %d failed to start: %s", opts.rank, message)
                self.status.error(message)
                return 1
        hello = control.ExecutorHello(
            session=self.session,
            rank=opts.rank,
            pid=os.getpid(),
            model_name=model_name,
            vocab_size=runner.config.vocab_size,
            num_blocks=runner.num_blocks,
            block_size=runner.block_size,
            max_num_batched_tokens=runner.max_num_batched_tokens,
            max_num_seqs=runner.max_num_seqs,
            max_model_len=runner.max_model_len,
            eos_token_ids=list(runner.eos_token_ids),
            dtype=str(runner.weight_dtype).removeprefix("torch."),
            device=str(runner.device),
            attention_backend=runner.attention.name,
            metrics_address=metrics_address,
            tensor_parallel_size=self.options.engine_args.tensor_parallel_size,
            lora_adapters=runner.loras.fingerprints,
        )

        ctx = zmq.Context()
        sock = _dealer(ctx, cluster_key)
        handshakes = HandshakeMonitor(sock, opts.scheduler, "executor")
        sock.connect(opts.scheduler)
        heartbeat: _Heartbeat | None = None
        try:
            try:
                rejection = self._handshake(sock, handshakes, hello)
            finally:
                handshakes.close()
            if rejection is not None:
                self.status.error(rejection)
                _log.error("scheduler rejected executor %d: %s", opts.rank, rejection)
                return 1
            self.joined.set()
            on_joined()
            heartbeat = _Heartbeat(ctx, opts.scheduler, cluster_key, self.session, opts.rank)
            heartbeat.start()
            freeze_startup_heap()
            self.status.ready(
                rank=opts.rank, num_blocks=runner.num_blocks, metrics_address=metrics_address
            )
            _log.info(
                "executor %d ready: %d KV blocks, scheduler %s",
                opts.rank,
                runner.num_blocks,
                opts.scheduler,
            )
            # A CPU computes a step inside launch: finishing it after the next would delay it.
            overlap = runner.device.type == "cuda" and runner.tp is None
            return self.serve(sock, runner, metrics, heartbeat, overlap=overlap)
        finally:
            if heartbeat is not None:
                heartbeat.stop_event.set()
                heartbeat.join(timeout=2)
            sock.close()
            ctx.term()

    def _watch_compiles(self, metrics: ExecutorMetrics) -> None:
        """Count and log the Triton compilations from now on: none is expected once loaded."""
        # Imported here: this module starts before torch is imported (see _executor in cli).
        from weir.services.executor.kernel_compiles import KernelCompiles

        def compiled(kernel: str, seconds: float) -> None:
            metrics.kernel_compiles.inc()
            metrics.kernel_compile_seconds.inc(seconds)
            _log.warning(
                "executor %d compiled a Triton kernel variant while serving in %.2fs (the "
                "running requests waited): %s; the startup warm-up missed it, please report it",
                self.options.rank,
                seconds,
                kernel,
            )

        KernelCompiles(compiled).watch()

    def _handshake(
        self, sock: zmq.Socket[Any], handshakes: HandshakeMonitor, hello: control.ExecutorHello
    ) -> str | None:
        """Send hello until the scheduler answers; None when welcomed, else the rejection
        (the scheduler's, or its socket's refusal of our key)."""
        payload = control.pack(hello)
        unanswered_since = time.monotonic()
        warned_dropped = False
        while True:
            if unanswered_since and time.monotonic() - unanswered_since > _SILENT_SCHEDULER_S:
                unanswered_since = 0.0
                _log.warning(
                    "executor %d: no answer from the scheduler at %s yet; check the address, "
                    "and that the scheduler and this executor use the same keys (--keys-dir)",
                    hello.rank,
                    self.options.scheduler,
                )
            try:
                sock.send_multipart([control.HELLO, payload], zmq.NOBLOCK)
            except zmq.Again:
                pass  # no connection: the scheduler is not up yet, or it refused us (below)
            if sock.poll(_HELLO_RETRY_MS):
                kind, body = sock.recv_multipart()
                if kind == control.WELCOME:
                    return None
                if kind == control.REJECT:
                    return control.unpack(control.Rejection, body).message
                _log.warning("ignoring %r frame before the handshake", kind)
            refusal = handshakes.pending()
            if refusal is not None:  # retrying cannot help
                return refusal
            if handshakes.dropped >= _DROPPED_HANDSHAKES_WARNING and not warned_dropped:
                warned_dropped = True
                _log.error(
                    "executor %d: the scheduler at %s dropped %d handshakes in a row: this "
                    "executor's cluster key is probably not the scheduler's (check --keys-dir); "
                    "retrying",
                    hello.rank,
                    self.options.scheduler,
                    handshakes.dropped,
                )
            if parent_gone(self.parent_pid):
                return "supervisor exited before the handshake"

    def serve(
        self,
        sock: zmq.Socket[Any],
        runner: ModelRunner,
        metrics: ExecutorMetrics,
        heartbeat: _Heartbeat,
        *,
        overlap: bool,
    ) -> int:
        """Run the plans ``sock`` brings until told to stop; returns the exit code. With
        ``overlap``, a plan that arrives while a step runs on the device (async scheduling
        sends it ahead) is launched before that step's tokens are waited for: the device never
        idles while the host collects and sends them."""
        # Imported here: this module starts before torch is imported (see _executor in cli).
        from weir.services.executor.profiler import StepProfiler

        rank = self.options.rank
        profiler = StepProfiler(self.options.engine_args.profiler_dir, rank, runner.device)
        pending: _Pending | None = None  # launched, its result not sent
        while True:
            if self.stopping.requested_at is not None and self.stopping.due(
                idle=pending is None and not sock.poll(0)
            ):
                _log.info("executor %d stopping (SIGTERM)", rank)
                return 0  # a step in flight is lost: the scheduler sends its requests again
            if pending is not None and not (
                # A step with drafts (reserved None) must finish first: the next depends on it.
                overlap
                and pending.step.reserved is not None
                and _frame_before_done(sock, pending.step)
            ):
                failed = self._finish(sock, runner, metrics, pending, profiler)
                pending = None
                if failed and runner.tp is not None:
                    return 1
                continue
            if not sock.poll(_POLL_MS if self.stopping.requested_at is None else 100):
                if heartbeat.reset.is_set():
                    _log.error(
                        "executor %d: the scheduler does not know this executor (it restarted, "
                        "or gave this executor up as lost); exiting to restart clean",
                        rank,
                    )
                    return 3
                if parent_gone(self.parent_pid):
                    return 0
                continue
            kind, payload = sock.recv_multipart()
            if kind == control.DRAINING:
                self.stopping.draining_heard_at = time.monotonic()
                continue
            if kind == control.GOODBYE:
                self.stopping.scheduler_gone = True
                continue
            if kind != control.PLAN:
                if kind != control.WELCOME:  # welcomes answer hellos resent while connecting
                    _log.warning("executor %d ignoring unexpected %r frame", rank, kind)
                continue
            start = time.perf_counter()
            step_id = -1
            try:
                plan = decode_step_plan(payload)
                step_id = plan.step_id
                if plan.profile is not None:  # sent between steps: none is pending
                    profiler.apply(plan.profile)
                with profiler.span("weir::launch"):
                    launched = runner.launch(plan)
            except Exception as exc:  # a bad plan or a failed forward pass: report, keep serving
                if pending is not None:  # launched before this one: its result goes first
                    self._finish(sock, runner, metrics, pending, profiler)
                    pending = None
                self._fail(sock, runner, step_id, exc)
                if runner.tp is not None:
                    return 1
                continue
            if pending is not None and self._finish(sock, runner, metrics, pending, profiler):
                # The runner dropped its requests: the step launched after means nothing.
                self._fail(sock, runner, step_id, RuntimeError("the step before it failed"))
                pending = None
                continue
            pending = _Pending(launched, start)

    def _finish(
        self,
        sock: zmq.Socket[Any],
        runner: ModelRunner,
        metrics: ExecutorMetrics,
        pending: _Pending,
        profiler: StepProfiler,
    ) -> bool:
        """Wait for a launched step and send its result; True if that failed (reported)."""
        step = pending.step
        try:
            with profiler.span("weir::finish"):
                result = runner.finish(step)
            encoded = encode_step_result(result) if self.options.rank == 0 else None
        except Exception as exc:
            self._fail(sock, runner, step.plan.step_id, exc)
            return True
        seconds = time.perf_counter() - pending.started
        if encoded is not None:
            sock.send_multipart([control.RESULT, encoded])
        # After the send: the scheduler plans the next step meanwhile.
        metrics.observe_step(
            seconds,
            step.plan.total_num_scheduled_tokens,
            step.timings,
            runner.device_busy_seconds(),
        )
        return False

    def _fail(
        self, sock: zmq.Socket[Any], runner: ModelRunner, step_id: int, exc: Exception
    ) -> None:
        """Report a failed step; the runner drops every request (the scheduler sends them again).
        A broken tensor-parallel group is not reported as the step's failure: the scheduler
        would look for a request to blame. The rank exits, and the group is lost instead."""
        if _group_broken(exc):
            _log.error("executor %d: step %d: %s; exiting", self.options.rank, step_id, exc)
            return
        _log.error("executor %d: step %d failed", self.options.rank, step_id, exc_info=exc)
        runner.reset()
        failure = control.StepFailure(step_id, self.options.rank, f"{type(exc).__name__}: {exc}")
        sock.send_multipart([control.STEP_ERROR, control.pack(failure)])


def load_runner(args: EngineArgs, rank: int = 0) -> ModelRunner:
    """The model runner executor ``rank`` serves ``args`` with (benchmarks build the same one
    in their own process)."""
    # torch is imported here, not at module level: `weir --help` stays fast.
    from weir.services.executor.model_runner import ModelRunner
    from weir.shared.model_store import resolve_model

    return ModelRunner(
        resolve_model(args.model, load_format=args.load_format, tokenizer=args.tokenizer),
        device=args.device or _default_device(),
        dtype=args.dtype,
        kv_cache_memory_bytes=args.kv_cache_memory,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        max_num_batched_tokens=args.step_limits[0],
        max_num_seqs=args.step_limits[1],
        max_model_len=args.max_model_len,
        num_threads=args.threads,
        seed=args.seed,
        load_format=args.load_format,
        tensor_parallel_size=args.tensor_parallel_size,
        # Without tensor parallelism the group's ranks are replicas of the whole model.
        rank=rank if args.tensor_parallel_size > 1 else 0,
        enforce_eager=args.enforce_eager,
        max_mixed_graph_tokens=args.max_mixed_graph_tokens,
        num_speculative_tokens=args.num_speculative_tokens if args.speculative_method else 0,
        quantization=args.quantization,
        loras=args.loras,
        max_lora_rank=args.max_lora_rank,
        runner=args.runner,
        hf_overrides=args.hf_overrides,
        speculative_model=(
            None
            if args.speculative_model is None
            # An EAGLE head's directory: weights and config.json, never a tokenizer.
            else Path(args.speculative_model).expanduser()
            if args.speculative_method in EAGLE_METHODS
            # Served with --tokenizer too, as the target: it needs no tokenizer of its own.
            else resolve_model(
                args.speculative_model, load_format=args.load_format, tokenizer=args.tokenizer
            )
        ),
        speculative_model_quantization=args.speculative_model_quantization,
        speculative_method=args.speculative_method or "draft_model",
        tokenizer=args.tokenizer,
    )


def _group_broken(exc: BaseException | None) -> bool:
    # Imported here: this module starts before torch is imported (see _executor in cli).
    from weir.services.executor.parallel import GroupBrokenError

    while exc is not None:
        if isinstance(exc, GroupBrokenError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@dataclass(slots=True)
class _Pending:
    step: LaunchedStep
    started: float  # when its plan was received


def _frame_before_done(sock: zmq.Socket[Any], step: LaunchedStep) -> bool:
    """Whether a frame (the next plan, normally) arrives before ``step`` is done on the device.
    Spins: a step is a few milliseconds, and the next launch should not wait for a wakeup."""
    while not step.is_ready():
        if sock.poll(0):
            return True
    return bool(sock.poll(0))


def _dealer(ctx: zmq.Context[Any], cluster_key: KeyPair | None) -> zmq.Socket[Any]:
    """A DEALER for the scheduler; with a cluster key, a CURVE client proving it holds the
    key (the scheduler's executor socket serves with the same key pair)."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, 1)  # a scheduler at an IPv6 address (IPv4 ones too)
    if cluster_key is not None:
        connect_curve(sock, cluster_key, cluster_key.public)
    return sock


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_executor(
    options: ExecutorOptions, status_fd: int | None = None, parent_pid: int | None = None
) -> int:
    """``weir executor``: serve until SIGTERM/SIGINT; returns the exit code."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    status = StatusReporter(status_fd)
    worker = ExecutorWorker(options, status, parent_pid)
    try:
        # Until loaded SIGTERM kills outright: a rank waiting for its group waits in C
        # (init_process_group), where a Python handler would not run for minutes.
        return worker.run(
            on_loaded=lambda: signal.signal(signal.SIGTERM, stop),
            on_joined=lambda: signal.signal(signal.SIGTERM, worker.stopping.request),
        )
    except KeyboardInterrupt:
        return 0
    finally:
        # Exiting anyway: a SIGTERM from here on (a supervisor abandoning a failed start)
        # would raise SystemExit inside the interpreter's exit handlers, which print it.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
