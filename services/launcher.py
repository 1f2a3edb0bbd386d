"""Start, supervise and stop a scheduler and its executor processes (``weir serve``, ``LLM``).

Each child is the same ``weir scheduler`` / ``weir executor`` command Kubernetes
runs, plus two hidden flags: ``--status-fd`` (a pipe on which the child writes
one JSON line: ``{"event": "ready", ...}`` once it is serving, or
``{"event": "error", "message": ...}`` when start-up fails) and
``--parent-pid`` (the child exits when its parent is gone, so a killed
supervisor leaves no orphans). The scheduler only reports ready once every
executor has completed its handshake, so "ready" means the whole server is.
Children run in their own session, so a terminal's Ctrl-C reaches only the
supervisor, which then stops them front to back (gateway and scheduler, then the
executors): a signal, a grace period, SIGKILL. With ``drain`` the scheduler gets
SIGTERM and finishes its in-flight requests first. While serving, an executor that
dies is started again, with backoff; its requests wait in the scheduler meanwhile.

Threads: each executor gets ``--threads`` (default: its share of the cores available,
``cpu_cores.plan_cpus``), and where the plan pins cores, ``--cpu-affinity``; the scheduler
and the gateway run one OpenMP thread, on the core kept for them from 4 cores up.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from weir.services.cpu_cores import available_cpus, format_cores, plan_cpus
from weir.services.gateway.chat_output import NO_PARSERS, ChatParsers
from weir.services.sigterm import Terminated
from weir.shared.config import (
    DEFAULT_EXECUTOR_METRICS_PORT,
    DEFAULT_METRICS_PORT,
    DEFAULT_PORT,
    EXECUTOR,
    LOOPBACK_HOSTS,
    SCHEDULER,
    EngineArgs,
)
from weir.shared.gpu_info import probe_gpu

_log = logging.getLogger(__name__)

GATEWAY = "gateway"
# Replica i of a data-parallel server listens on --port and --metrics-port + this x i: past
# the executors' metrics ports that follow the defaults (8103 + each rank of every replica).
REPLICA_PORT_STRIDE = 100
# An executor that dies is started again after this many seconds, doubled while it
# keeps dying soon after starting.
_RESTART_DELAY_S = (1.0, 30.0)
_STABLE_RUN_S = 60.0


# ------------------------------------------------------------------ supervisor side


class ChildFailedError(RuntimeError):
    """A child process exited during start-up or while serving."""


@dataclass(slots=True)
class _Child:
    name: str
    role: str  # SCHEDULER, EXECUTOR or GATEWAY
    replica: int  # the engine it belongs to (data parallelism); 0 for the gateway
    argv: list[str]
    env: dict[str, str] | None
    proc: subprocess.Popen[bytes]
    status_fd: int
    pidfd: int
    started: float = field(default_factory=time.monotonic)
    buffer: bytes = b""
    events: list[dict[str, Any]] = field(default_factory=list)

    def close(self) -> None:
        os.close(self.status_fd)
        os.close(self.pidfd)

    def read_status(self) -> bool:
        """Take in what the child wrote; False once it closed its end."""
        while True:
            try:
                chunk = os.read(self.status_fd, 65536)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            self.buffer += chunk
            *lines, self.buffer = self.buffer.split(b"\n")
            for line in lines:
                try:
                    self.events.append(json.loads(line))
                except json.JSONDecodeError:
                    _log.warning("%s wrote a bad status line: %r", self.name, line)

    def error_message(self) -> str:
        errors = [e.get("message", "") for e in self.events if e.get("event") == "error"]
        return errors[-1] if errors else "no error reported (see its log above)"


class ServerProcesses:
    """A scheduler and ``num_executors`` executors, and with ``http_port`` the HTTP gateway
    in front of them, started together and stopped together.

    With ``data_parallel_size`` N > 1 (vLLM's ``--data-parallel-size``), N such engines,
    each its own scheduler and executors (replica i on ports ``port + 100 i`` and
    ``metrics_port + 100 i``, clear of the ports the defaults give executors; its executor
    ranks from ``executor_metrics_port + i * num_executors``, on its share of the cores,
    and on CUDA its own GPUs: those of ``CUDA_VISIBLE_DEVICES``, or 0, 1..., taken
    ``num_executors`` at a time), behind the one gateway, whose router sends each request
    to one of them.

    ``start()`` returns the (first) scheduler's ready record (``client_address``,
    ``metrics_address``, ``executors`` with each rank's ``metrics_address``...), plus the
    gateway's ``http_address`` and, with replicas, ``replicas``: each one's record. Every
    process's /metrics and /health bind to ``metrics_host``, the gateway to ``http_host``
    (both default: ``host``). Use as a context manager, or call ``shutdown()``.
    """

    def __init__(
        self,
        engine_args: EngineArgs | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        metrics_host: str | None = None,
        metrics_port: int = DEFAULT_METRICS_PORT,
        executor_metrics_port: int = DEFAULT_EXECUTOR_METRICS_PORT,
        num_executors: int | None = None,
        http_port: int | None = None,
        http_host: str | None = None,
        api_key: str | None = None,
        allowed_origins: Sequence[str] = ("*",),
        parsers: ChatParsers = NO_PARSERS,
        startup_timeout: float = 600.0,
        stop_timeout: float = 5.0,
        data_parallel_size: int = 1,
        offline: bool = False,
        gateway_argv: Sequence[str] = (),
    ) -> None:
        self.engine_args = with_device_step_limits(engine_args or EngineArgs(), offline)
        if self.engine_args.tokenizer is not None:
            _check_tokenizer(self.engine_args)
        if type(data_parallel_size) is not int or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an int >= 1, got {data_parallel_size!r}")
        self.data_parallel_size = data_parallel_size
        self.http_port, self.api_key = http_port, api_key
        self.allowed_origins = allowed_origins  # the gateway's CORS origins
        self.parsers = parsers  # the gateway's
        self.gateway_argv = gateway_argv  # its other flags (logging)
        self.host, self.port = host, port
        self.metrics_host = metrics_host or host
        self.http_host = http_host or host
        if api_key is not None and host not in LOOPBACK_HOSTS and self.engine_args.keys_dir is None:
            raise ValueError(
                f"host {host} opens the engine's client port (--port) to anyone who reaches it, "
                "and the API key (--api-key, $WEIR_API_KEY or $VLLM_API_KEY) guards only the "
                "HTTP API: bind the engine to 127.0.0.1 and the "
                "API to the network (--http-host 0.0.0.0), or give --keys-dir DIR (made by "
                "`weir keys DIR`) so that only holders of its keys reach the engine"
            )
        self.metrics_port, self.executor_metrics_port = metrics_port, executor_metrics_port
        self.num_executors = resolve_num_executors(num_executors, self.engine_args)
        replicas = range(data_parallel_size)
        _check_ports_apart(
            {
                "--port": [self._port(port, i) for i in replicas],
                "--metrics-port": [self._port(metrics_port, i) for i in replicas],
                "--executor-metrics-port": [
                    self._executor_metrics_port(r)
                    for r in range(self.num_executors * data_parallel_size)
                ],
                "--http-port": [http_port or 0],
            }
        )
        self.cpu_plan = plan_cpus(
            available_cpus(), self.num_executors * data_parallel_size, self.engine_args.threads
        )
        self.startup_timeout, self.stop_timeout = startup_timeout, stop_timeout
        self.info: dict[str, Any] = {}
        self._children: list[_Child] = []
        self._supervisor: threading.Thread | None = None
        self._stopping = threading.Event()
        self._exited: tuple[str, int] | None = None
        self._exit_event = threading.Event()
        self._wake: tuple[int, int] | None = None  # the supervisor's wake pipe (read, write)

    def __enter__(self) -> ServerProcesses:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def client_address(self) -> str:
        # The scheduler's ready record: JSON, whose client_address is its socket's endpoint.
        address: str = self.info["client_address"]
        return address

    def start(self) -> dict[str, Any]:
        plan = self.cpu_plan
        _log.info("CPU plan: %s", plan.describe())
        try:
            schedulers = [self._spawn_replica(i) for i in range(self.data_parallel_size)]
            records = []
            for i, scheduler in enumerate(schedulers):
                records.append(self._wait_ready(scheduler))
                self._add_executor_threads(records[-1], i)
            self.info = dict(records[0])
            if self.data_parallel_size > 1:
                self.info["replicas"] = records
            if self.http_port is not None:
                self.info["http_address"] = self._start_gateway(
                    [record["client_address"] for record in records],
                    *[a for r in records for a in ("--engine-metrics", r["metrics_address"])],
                )
        except Terminated:
            if not self.info:
                self._abandon_start()
            # Else the scheduler already takes requests: the caller drains them, as after a
            # start (``shutdown(drain=True)``; abandoning failed them with the executors gone).
            raise
        except BaseException:
            self._abandon_start()
            raise
        self._wake = os.pipe()
        self._supervisor = threading.Thread(
            target=self._supervise, args=(self._wake[0],), name="weir-supervisor", daemon=True
        )
        self._supervisor.start()
        return self.info

    def _spawn_replica(self, replica: int) -> _Child:
        """Start one engine's scheduler and executors; returns its scheduler."""
        # Linux's abstract namespace: no socket file to leave behind, whatever kills us.
        executor_address = f"ipc://@weir-{os.getpid()}-{secrets.token_hex(4)}"
        env = self._replica_env(replica)
        plan = self.cpu_plan
        executor_args = replace(self.engine_args, threads=plan.executor_threads)
        suffix = f" of replica {replica}" if self.data_parallel_size > 1 else ""
        tag = ("--replica", str(replica)) if self.data_parallel_size > 1 else ()
        self._spawn(
            SCHEDULER + suffix,
            [
                SCHEDULER,
                "--host",
                self.host,
                "--port",
                str(self._port(self.port, replica)),
                "--metrics-host",
                self.metrics_host,
                "--metrics-port",
                str(self._port(self.metrics_port, replica)),
                "--executor-address",
                executor_address,
                "--num-executors",
                str(self.num_executors),
                *self.engine_args.to_argv(SCHEDULER),
                *_affinity_flag(plan.service_cores),
                *tag,
            ],
            role=SCHEDULER,
            replica=replica,
        )
        scheduler = self._children[-1]
        for rank in range(self.num_executors):
            index = replica * self.num_executors + rank  # among all replicas' executors
            self._spawn(
                f"executor {rank}{suffix}",
                [
                    EXECUTOR,
                    "--scheduler",
                    executor_address,
                    "--rank",
                    str(rank),
                    "--metrics-host",
                    self.metrics_host,
                    "--metrics-port",
                    str(self._executor_metrics_port(index)),
                    *executor_args.to_argv(EXECUTOR),
                    *_affinity_flag(plan.executor_cores[index]),
                    *tag,
                ],
                env,
                role=EXECUTOR,
                replica=replica,
            )
        return scheduler

    def _replica_env(self, replica: int) -> dict[str, str] | None:
        """The environment of a replica's executors: a tensor-parallel group's rendezvous
        (torch.distributed's env://, on this machine) and, with several replicas, the GPUs
        that are theirs."""
        env: dict[str, str] = {}
        if self.engine_args.tensor_parallel_size > 1:
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        if self.data_parallel_size > 1:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            gpus = (
                visible.split(",")
                if visible
                else [str(i) for i in range(self.data_parallel_size * self.num_executors)]
            )
            mine = gpus[replica * self.num_executors : (replica + 1) * self.num_executors]
            if len(mine) == self.num_executors:  # else too few: the executors say so on CUDA
                env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
        return {**os.environ, **env} if env else None

    @staticmethod
    def _port(port: int, replica: int) -> int:
        """Replica i's port of a base port (0: any free port)."""
        return port + REPLICA_PORT_STRIDE * replica if port else 0

    def _executor_metrics_port(self, index: int) -> int:
        """Executor ``index`` (rank r of replica i: i * num_executors + r) serves its metrics
        on --executor-metrics-port + index (0: any free port)."""
        return self.executor_metrics_port + index if self.executor_metrics_port else 0

    def wait(self) -> tuple[str, int]:
        """Block until the scheduler or the gateway exits; return its name and exit code."""
        self._exit_event.wait()
        assert self._exited is not None
        return self._exited

    @property
    def exited(self) -> tuple[str, int] | None:
        """The scheduler or gateway that exited (its name and exit code), or None."""
        return self._exited

    def _supervise(self, wake_fd: int) -> None:
        """Until ``shutdown``: start a dead executor again (after 1 s, doubled up to 30 s
        while it keeps dying within a minute of its start; the scheduler resumes its
        requests once it is back), and kill one its scheduler gave up on first; note when
        the scheduler or the gateway exits."""
        delay: dict[str, float] = {}
        restarts: list[tuple[float, _Child]] = []
        with selectors.DefaultSelector() as sel:
            sel.register(wake_fd, selectors.EVENT_READ, None)
            for child in self._children:
                sel.register(child.pidfd, selectors.EVENT_READ, child)
                if child.role == SCHEDULER:
                    sel.register(child.status_fd, selectors.EVENT_READ, child)
            while not self._stopping.is_set():
                now = time.monotonic()
                for due, child in [r for r in restarts if r[0] <= now]:
                    restarts.remove((due, child))
                    new = self._respawn(child)
                    sel.register(new.pidfd, selectors.EVENT_READ, new)
                timeout = min(due for due, _ in restarts) - now if restarts else None
                for key, _ in sel.select(timeout):
                    child = key.data
                    if child is None:  # the wake pipe: shutdown
                        return
                    if key.fd == child.status_fd:
                        if not child.read_status():
                            sel.unregister(key.fd)
                        self._kill_lost_executors(child)
                        continue
                    sel.unregister(key.fd)
                    rc = child.proc.wait()
                    child.read_status()
                    if child.role in (SCHEDULER, GATEWAY):
                        self._exited = child.name, rc
                        self._exit_event.set()
                        continue
                    ran = time.monotonic() - child.started
                    wait = (
                        _RESTART_DELAY_S[0]
                        if ran > _STABLE_RUN_S or child.name not in delay
                        else min(2 * delay[child.name], _RESTART_DELAY_S[1])
                    )
                    delay[child.name] = wait
                    _log.error(
                        "%s exited with code %d after %.0fs; starting it again in %gs",
                        child.name,
                        rc,
                        ran,
                        wait,
                    )
                    restarts.append((time.monotonic() + wait, child))
                    if self.engine_args.tensor_parallel_size > 1:
                        # A group forms only whole: its other ranks start again with it.
                        for peer in self._children:
                            if (
                                peer.role == EXECUTOR
                                and peer.replica == child.replica
                                and peer.proc.poll() is None
                            ):
                                _signal_group(peer.proc.pid, signal.SIGKILL)

    def _kill_lost_executors(self, scheduler: _Child) -> None:
        """The executors ``scheduler`` gave up on: one that stopped answering without
        exiting (hung, or stopped) never comes back to be told; killed, it starts again."""
        pids = {
            pid
            for event in scheduler.events
            if event.get("event") == "executors_lost"
            for pid in event.get("pids", ())
        }
        scheduler.events = [e for e in scheduler.events if e.get("event") != "executors_lost"]
        for child in self._children:
            if (
                child.role == EXECUTOR
                and child.replica == scheduler.replica
                and child.proc.pid in pids
                and child.proc.poll() is None
            ):
                _log.error(
                    "%s (pid %d) stopped answering its scheduler; killing it to start it again",
                    child.name,
                    child.proc.pid,
                )
                _signal_group(child.proc.pid, signal.SIGKILL)

    def _respawn(self, child: _Child) -> _Child:
        child.close()
        self._children.remove(child)
        self._spawn(child.name, child.argv, child.env, role=child.role, replica=child.replica)
        return self._children[-1]

    def shutdown(self, drain: bool = False) -> None:
        """Stop the gateway and the scheduler, then the executors: SIGTERM (SIGINT for the
        scheduler unless ``drain``), and SIGKILL what is left after the grace period
        (``engine_args.drain_timeout`` longer with ``drain``)."""
        front = [c for c in self._children if c.role in (SCHEDULER, GATEWAY)]
        grace = self.stop_timeout + (self.engine_args.drain_timeout if drain else 0.0)
        deadline = time.monotonic() + grace
        if drain:
            # Executors are still restarted while the scheduler drains: a request being
            # finished must not fail because its executor died meanwhile.
            self._signal(front, signal.SIGTERM)
            pending = [c.pidfd for c in front]  # exited or not, none is reaped here
            while pending and (left := deadline - time.monotonic()) > 0:
                readable, _, _ = select.select(pending, [], [], left)
                pending = [fd for fd in pending if fd not in readable]
        if self._supervisor is not None and self._wake is not None:
            self._stopping.set()
            os.write(self._wake[1], b"x")
            self._supervisor.join()
            self._supervisor = None
            for fd in self._wake:
                os.close(fd)
        self._stop(front, signal.SIGTERM if drain else signal.SIGINT, deadline)
        self._stop(list(self._children), signal.SIGTERM, time.monotonic() + self.stop_timeout)

    def _abandon_start(self) -> None:
        """Stop what a failed start left, all with SIGTERM: a child still importing dies of
        it quietly (SIGINT would print a KeyboardInterrupt traceback over the error that
        matters), and one that runs has nothing to drain."""
        self._stop(list(self._children), signal.SIGTERM, time.monotonic() + self.stop_timeout)

    @staticmethod
    def _signal(children: list[_Child], scheduler_signal: signal.Signals) -> None:
        for child in children:
            if child.proc.returncode is None:
                sig = scheduler_signal if child.role == SCHEDULER else signal.SIGTERM
                _signal_group(child.proc.pid, sig)

    def _stop(
        self, children: list[_Child], scheduler_signal: signal.Signals, deadline: float
    ) -> None:
        self._signal(children, scheduler_signal)
        for child in children:
            if child.proc.returncode is None:
                # Wait without reaping: the zombie keeps the pid (and so the process
                # group id) from being reused until the group is killed below.
                readable, _, _ = select.select(
                    [child.pidfd], [], [], max(0.0, deadline - time.monotonic())
                )
                if not readable:
                    _log.warning("%s did not stop in time; killing it", child.name)
                _signal_group(child.proc.pid, signal.SIGKILL)
                child.proc.wait()
            child.close()
            self._children.remove(child)

    def _start_gateway(self, schedulers: list[str], *extra: str) -> str:
        """Start `weir gateway` in front of ``schedulers``; returns its HTTP address."""
        # The key travels in the environment: a command line is world-readable.
        env = None if self.api_key is None else {**os.environ, "WEIR_API_KEY": self.api_key}
        argv = [GATEWAY, *[a for address in schedulers for a in ("--scheduler", address)]]
        argv += ["--host", self.http_host, "--port", str(self.http_port), *extra]
        argv += _affinity_flag(self.cpu_plan.service_cores)
        if self.engine_args.keys_dir is not None:
            argv += ["--keys-dir", self.engine_args.keys_dir]
        argv += ["--allowed-origins", ",".join(self.allowed_origins)]
        argv += [*self.parsers.argv(), *self.gateway_argv]
        self._spawn(GATEWAY, [*argv, "--log-level", self.engine_args.log_level], env, role=GATEWAY)
        return str(self._wait_ready(self._children[-1])["http_address"])

    def _add_executor_threads(self, info: dict[str, Any], replica: int) -> None:
        """Each rank's torch threads and cores, as its executor reported them after loading
        (written before its handshake, so already in the pipe once the scheduler is ready)."""
        loaded = {}
        for child in self._children:
            if child.role == EXECUTOR and child.replica == replica:
                child.read_status()
                for event in child.events:
                    if event.get("event") == "loaded":
                        loaded[event["rank"]] = event
        for executor in info.get("executors", []):
            if executor.get("rank") in loaded:
                event = loaded[executor["rank"]]
                executor["threads"], executor["cores"] = event["threads"], event["cores"]

    def _spawn(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        *,
        role: str,
        replica: int = 0,
    ) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        cmd = [
            sys.executable,
            "-m",
            "weir.services.cli",
            *argv,
            "--status-fd",
            str(write_fd),
            "--parent-pid",
            str(os.getpid()),
        ]
        _log.info("starting %s: %s", name, " ".join(cmd))
        try:
            proc = subprocess.Popen(
                cmd,
                pass_fds=(write_fd,),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        finally:
            os.close(write_fd)
        self._children.append(
            _Child(name, role, replica, argv, env, proc, read_fd, os.pidfd_open(proc.pid))
        )

    def _wait_ready(self, target: _Child) -> dict[str, Any]:
        """``target``'s ready record, failing if any child exits or reports an error first."""
        deadline = time.monotonic() + self.startup_timeout
        with selectors.DefaultSelector() as sel:
            for child in self._children:
                sel.register(child.status_fd, selectors.EVENT_READ, child)
                sel.register(child.pidfd, selectors.EVENT_READ, child)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    waiting = [
                        c.name
                        for c in self._children
                        if not any(e.get("event") == "ready" for e in c.events)
                    ]
                    raise ChildFailedError(
                        f"server not ready within {self.startup_timeout:g}s (still starting: "
                        f"{', '.join(waiting)}); give it longer with --startup-timeout"
                    )
                for key, _ in sel.select(remaining):
                    child = key.data
                    child.read_status()
                    if key.fd == child.pidfd:
                        rc = child.proc.wait()
                        child.read_status()
                        raise ChildFailedError(
                            f"{child.name} exited with code {rc} during start-up: "
                            f"{child.error_message()}"
                        )
                    for event in child.events:
                        if event.get("event") == "error":
                            raise ChildFailedError(
                                f"{child.name} failed to start: {event.get('message')}"
                            )
                    ready = [e for e in target.events if e.get("event") == "ready"]
                    if ready:
                        return ready[0]


class GatewayProcess(ServerProcesses):
    """`weir gateway` alone, in front of schedulers that already run (tests, benchmarks).
    ``timeout``: seconds a replica may stay silent before its requests fail."""

    def __init__(
        self,
        schedulers: list[str],
        *,
        http_port: int = 0,
        api_key: str | None = None,
        timeout: float | None = None,
        parsers: ChatParsers = NO_PARSERS,
        startup_timeout: float = 120.0,
    ) -> None:
        super().__init__(
            http_port=http_port,
            api_key=api_key,
            parsers=parsers,
            startup_timeout=startup_timeout,
        )
        self.schedulers = schedulers
        self.timeout = timeout

    def start(self) -> dict[str, Any]:
        extra = () if self.timeout is None else ("--timeout", str(self.timeout))
        try:
            self.info = {"http_address": self._start_gateway(self.schedulers, *extra)}
        except BaseException:
            self._abandon_start()
            raise
        return self.info


def with_device_step_limits(engine_args: EngineArgs, offline: bool) -> EngineArgs:
    """``engine_args`` with the step limits it leaves out set for the GPU the executors will
    run on, as vLLM sets them (config.default_step_limits): what ``ServerProcesses`` starts
    every process with."""
    gpu = probe_gpu(engine_args.device)
    resolved = engine_args.with_step_limits(gpu, offline)
    if gpu is not None and resolved != engine_args:
        _log.info(
            "step limits for %s (%.0f GiB): %d tokens, %d requests",
            gpu.name,
            gpu.total_memory / 2**30,
            resolved.max_num_batched_tokens,
            resolved.max_num_seqs,
        )
    return resolved


def _check_tokenizer(engine_args: EngineArgs) -> None:
    """ValueError for a ``--tokenizer`` the scheduler would refuse (ids past the model's
    embeddings, an unreadable tokenizer or template), told before any process starts, not
    once the executors have loaded the model."""
    # Imported here: the tokenizer and the model store are no part of `weir --help`.
    from weir.shared.model_config import read_model_config
    from weir.shared.model_store import resolve_model
    from weir.shared.tokenizer import chat_template_of, served_tokenizer

    try:
        model_dir = resolve_model(
            engine_args.model, load_format=engine_args.load_format, tokenizer=engine_args.tokenizer
        )
        vocab_size = read_model_config(model_dir, engine_args.hf_overrides).vocab_size
    except (ValueError, OSError, RuntimeError):
        return  # the model's own problem: the scheduler reports it, as without --tokenizer
    served_tokenizer(
        model_dir, vocab_size, engine_args.tokenizer, chat_template_of(engine_args.chat_template)
    )


def resolve_num_executors(num_executors: int | None, engine_args: EngineArgs) -> int:
    """The executor ranks a scheduler waits for: the tensor-parallel group's size by default;
    without tensor parallelism, ``num_executors`` replicas of the whole model."""
    tp = engine_args.tensor_parallel_size  # an int >= 1: EngineArgs checked it
    if num_executors is None:
        return tp
    if num_executors < 1:  # a scheduler waiting for no executor is never ready
        raise ValueError(f"num_executors must be >= 1, got {num_executors}")
    if tp > 1 and num_executors != tp:
        raise ValueError(
            f"num_executors {num_executors} != tensor_parallel_size {tp}: a tensor-parallel "
            "group has one executor per rank"
        )
    return num_executors


def _check_ports_apart(ports: dict[str, list[int]]) -> None:
    """ValueError naming two options that ask for one port (0, any free port, never does;
    executor rank r takes --executor-metrics-port + r)."""
    owner: dict[int, str] = {}
    for option, numbers in ports.items():
        for number in numbers:
            if number and number in owner and owner[number] != option:
                raise ValueError(
                    f"ports overlap: {owner[number]} and {option} both take port {number} "
                    "(executor rank r uses --executor-metrics-port + r)"
                )
            owner[number] = option


def _affinity_flag(cores: tuple[int, ...] | None) -> list[str]:
    return [] if cores is None else ["--cpu-affinity", format_cores(cores)]


# Ports free_port draws from: below the kernel's range for the ports of outgoing connections.
_LISTEN_PORTS_FROM = 10_000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A port free on the loopback now, for a listener started next. Not one the OS picks
    (bind to 0): it draws that from the range any connect() takes its local port from, so
    under load a connection could take it before its listener binds it (seen: a
    tensor-parallel group's rendezvous port, EADDRINUSE). Drawn at random below that range,
    where only another listener can take it."""
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0  # not Linux
    if low > _LISTEN_PORTS_FROM + 1000:  # else no room below that range: the OS picks
        for _ in range(100):
            port = _LISTEN_PORTS_FROM + secrets.randbelow(low - _LISTEN_PORTS_FROM)
            if _bindable(port):
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
