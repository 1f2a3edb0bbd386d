"""Start, supervise and stop a scheduler and its executor processes (``weir serve``, ``LLM``).

Each child is the same ``weir scheduler`` / ``weir executor`` command Kubernetes
runs, plus two hidden flags: ``--status-fd`` (a pipe on which the child writes
one JSON line: ``{"event": "ready", ...}`` once it is serving, or
``{"event": "error", "message": ...}`` when start-up fails) and
``--parent-pid`` (the child exits when its parent is gone, so a killed
supervisor leaves no orphans). The scheduler only reports ready once every
executor has completed its handshake, so "ready" means the whole server is.
Children run in their own session, so a terminal's Ctrl-C reaches only the
supervisor, which then stops them in order: SIGTERM, a grace period, SIGKILL.
"""

from __future__ import annotations

import json
import logging
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from weir.shared.config import (
    DEFAULT_EXECUTOR_METRICS_PORT,
    DEFAULT_METRICS_PORT,
    DEFAULT_PORT,
    EXECUTOR,
    SCHEDULER,
    EngineArgs,
)

_log = logging.getLogger(__name__)

GATEWAY = "gateway"


# ------------------------------------------------------------------ supervisor side


class ChildFailedError(RuntimeError):
    """A child process exited during start-up or while serving."""


@dataclass(slots=True)
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    status_fd: int
    pidfd: int
    buffer: bytes = b""
    events: list[dict[str, Any]] = field(default_factory=list)

    def read_status(self) -> None:
        while True:
            try:
                chunk = os.read(self.status_fd, 65536)
            except BlockingIOError:
                return
            if not chunk:
                return
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

    ``start()`` returns the scheduler's ready record (``client_address``,
    ``metrics_address``, ``executors`` with each rank's ``metrics_address``...), plus the
    gateway's ``http_address``. Use as a context manager, or call ``shutdown()``.
    """

    def __init__(
        self,
        engine_args: EngineArgs | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        metrics_port: int = DEFAULT_METRICS_PORT,
        executor_metrics_port: int = DEFAULT_EXECUTOR_METRICS_PORT,
        num_executors: int | None = None,
        http_port: int | None = None,
        api_key: str | None = None,
        startup_timeout: float = 600.0,
        stop_timeout: float = 5.0,
    ) -> None:
        self.engine_args = engine_args or EngineArgs()
        self.http_port, self.api_key = http_port, api_key
        self.host, self.port = host, port
        self.metrics_port, self.executor_metrics_port = metrics_port, executor_metrics_port
        self.num_executors = resolve_num_executors(num_executors, self.engine_args)
        self.startup_timeout, self.stop_timeout = startup_timeout, stop_timeout
        self.info: dict[str, Any] = {}
        self._children: list[_Child] = []
        self._tmpdir: str | None = None

    def __enter__(self) -> ServerProcesses:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def client_address(self) -> str:
        return self.info["client_address"]

    def start(self) -> dict[str, Any]:
        self._tmpdir = tempfile.mkdtemp(prefix="weir-")
        executor_address = f"ipc://{self._tmpdir}/executor.sock"
        # A tensor-parallel group's rendezvous (torch.distributed's env://), on this machine.
        group_env = (
            {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
            if self.engine_args.tensor_parallel_size > 1
            else None
        )
        try:
            self._spawn(
                SCHEDULER,
                [
                    SCHEDULER,
                    "--host",
                    self.host,
                    "--port",
                    str(self.port),
                    "--metrics-port",
                    str(self.metrics_port),
                    "--executor-address",
                    executor_address,
                    "--num-executors",
                    str(self.num_executors),
                    *self.engine_args.to_argv(SCHEDULER),
                ],
            )
            for rank in range(self.num_executors):
                metrics_port = (
                    self.executor_metrics_port + rank if self.executor_metrics_port else 0
                )
                self._spawn(
                    f"executor {rank}",
                    [
                        EXECUTOR,
                        "--scheduler",
                        executor_address,
                        "--rank",
                        str(rank),
                        "--metrics-host",
                        self.host,
                        "--metrics-port",
                        str(metrics_port),
                        *self.engine_args.to_argv(EXECUTOR),
                    ],
                    group_env,
                )
            self.info = self._wait_ready(self._children[0])
            if self.http_port is not None:
                self.info["http_address"] = self._start_gateway([self.info["client_address"]])
        except BaseException:
            self.shutdown()
            raise
        return self.info

    def wait(self) -> tuple[str, int]:
        """Block until a child exits; return its name and exit code."""
        with selectors.DefaultSelector() as sel:
            for child in self._children:
                sel.register(child.pidfd, selectors.EVENT_READ, child)
            while True:
                for key, _ in sel.select():
                    child = key.data
                    rc = child.proc.wait()
                    child.read_status()
                    return child.name, rc

    def shutdown(self) -> None:
        """SIGTERM every child's process group; SIGKILL what is left after the grace period."""
        for child in self._children:
            if child.proc.returncode is None:
                _signal_group(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for child in self._children:
            if child.proc.returncode is None:
                # Wait without reaping: the zombie keeps the pid (and so the process
                # group id) from being reused until the group is killed below.
                readable, _, _ = select.select(
                    [child.pidfd], [], [], max(0.0, deadline - time.monotonic())
                )
                if not readable:
                    _log.warning(
                        "%s did not stop within %.1fs; killing it", child.name, self.stop_timeout
                    )
                _signal_group(child.proc.pid, signal.SIGKILL)
                child.proc.wait()
            os.close(child.status_fd)
            os.close(child.pidfd)
        self._children.clear()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _start_gateway(self, schedulers: list[str], *extra: str) -> str:
        """Start `weir gateway` in front of ``schedulers``; returns its HTTP address."""
        # The key travels in the environment: a command line is world-readable.
        env = None if self.api_key is None else {**os.environ, "WEIR_API_KEY": self.api_key}
        argv = [GATEWAY, *[a for address in schedulers for a in ("--scheduler", address)]]
        argv += ["--host", self.host, "--port", str(self.http_port), *extra]
        self._spawn(GATEWAY, [*argv, "--log-level", self.engine_args.log_level], env)
        return str(self._wait_ready(self._children[-1])["http_address"])

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
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
        self._children.append(_Child(name, proc, read_fd, os.pidfd_open(proc.pid)))

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
                    raise ChildFailedError(f"server not ready within {self.startup_timeout:g}s")
                for key, _ in sel.select(remaining):
                    child: _Child = key.data
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
        startup_timeout: float = 120.0,
    ) -> None:
        super().__init__(http_port=http_port, api_key=api_key, startup_timeout=startup_timeout)
        self.schedulers = schedulers
        self.timeout = timeout

    def start(self) -> dict[str, Any]:
        extra = () if self.timeout is None else ("--timeout", str(self.timeout))
        try:
            self.info = {"http_address": self._start_gateway(self.schedulers, *extra)}
        except BaseException:
            self.shutdown()
            raise
        return self.info


def resolve_num_executors(num_executors: int | None, engine_args: EngineArgs) -> int:
    """The executor ranks a scheduler waits for: the tensor-parallel group's size by default;
    without tensor parallelism, ``num_executors`` replicas of the whole model."""
    tp = engine_args.tensor_parallel_size
    if type(tp) is not int or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
    if num_executors is None:
        return tp
    if tp > 1 and num_executors != tp:
        raise ValueError(
            f"num_executors {num_executors} != tensor_parallel_size {tp}: a tensor-parallel "
            "group has one executor per rank"
        )
    return num_executors


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
