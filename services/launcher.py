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

import argparse
import json
import logging
import os
import re
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

_log = logging.getLogger(__name__)

SCHEDULER = "scheduler"
EXECUTOR = "executor"
_BOTH = frozenset({SCHEDULER, EXECUTOR})

DEFAULT_PORT = 8100
DEFAULT_METRICS_PORT = 8101
DEFAULT_EXECUTOR_PORT = 8102
DEFAULT_EXECUTOR_METRICS_PORT = 8103


def parse_size(text: str) -> int:
    """'512MiB', '2GB', '1048576' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?)?B?\s*", str(text), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GB)")
    number, unit = float(match.group(1)), (match.group(2) or "").upper()
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(number * scale)


@dataclass(frozen=True, slots=True)
class EngineOption:
    """One command-line option of a role; ``serve`` and ``LLM`` forward it to that role."""

    flag: str
    roles: frozenset[str]
    argparse_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


def _opt(flag: str, roles: frozenset[str] | str, **kwargs: Any) -> EngineOption:
    return EngineOption(flag, frozenset({roles}) if isinstance(roles, str) else roles, kwargs)


ENGINE_OPTIONS: tuple[EngineOption, ...] = (
    _opt("--model", _BOTH, default=None,
         help="HF model dir or .gguf file (default: SmolLM2-135M-Instruct)"),
    _opt("--block-size", _BOTH, type=int, default=16, help="KV cache block size in tokens"),
    _opt("--max-num-batched-tokens", _BOTH, type=int, default=2048,
         help="token budget of one step"),
    _opt("--max-num-seqs", _BOTH, type=int, default=256, help="most requests in one step"),
    _opt("--max-model-len", _BOTH, type=int, default=None,
         help="longest prompt + output (default: the model's context length)"),
    _opt("--long-prefill-token-threshold", SCHEDULER, type=int, default=0,
         help="cap on one request's prefill chunk per step (0 = none)"),
    _opt("--enable-chunked-prefill", SCHEDULER, action=argparse.BooleanOptionalAction, default=True,
         help="split long prompts across steps"),
    _opt("--enable-prefix-caching", SCHEDULER, action=argparse.BooleanOptionalAction, default=True,
         help="reuse KV blocks of identical prompt prefixes"),
    _opt("--watermark", SCHEDULER, type=float, default=0.01,
         help="fraction of KV blocks kept free when admitting requests"),
    _opt("--policy", SCHEDULER, choices=("fcfs", "priority"), default="fcfs",
         help="waiting-queue order"),
    _opt("--executor-timeout", SCHEDULER, type=float, default=3.0,
         help="seconds without an executor heartbeat before its requests fail"),
    _opt("--device", EXECUTOR, default=None, help="cpu or cuda (default: cuda if available)"),
    _opt("--dtype", EXECUTOR, default=None, help="weight/activation dtype (default: per device)"),
    _opt("--kv-cache-memory", EXECUTOR, type=parse_size, default=None,
         help="KV cache size on CPU, e.g. 256MiB"),
    _opt("--gpu-memory-utilization", EXECUTOR, type=float, default=None,
         help="fraction of GPU memory for weights + KV cache"),
    _opt("--attention-backend", EXECUTOR, default=None, help="attention implementation"),
    _opt("--threads", EXECUTOR, type=int, default=1, help="torch threads of each executor"),
    _opt("--seed", EXECUTOR, type=int, default=None, help="sampler seed of requests without one"),
    _opt("--log-level", _BOTH, default="WARNING", help="logging level of the processes"),
)


def add_engine_options(parser: argparse.ArgumentParser, role: str) -> None:
    """Add the options of ``role`` (``scheduler``, ``executor``, or ``serve`` = both)."""
    for opt in ENGINE_OPTIONS:
        if role == "serve" or role in opt.roles:
            parser.add_argument(opt.flag, **opt.argparse_kwargs)


def engine_argv(values: dict[str, Any], role: str) -> list[str]:
    """Command-line arguments passing ``values`` (option dest -> value) on to ``role``."""
    argv: list[str] = []
    for opt in ENGINE_OPTIONS:
        value = values.get(opt.dest)
        if role not in opt.roles or value is None:
            continue
        if opt.argparse_kwargs.get("action") is argparse.BooleanOptionalAction:
            argv.append(opt.flag if value else "--no-" + opt.flag[2:])
        else:
            argv += [opt.flag, str(value)]
    return argv


def check_engine_options(values: dict[str, Any]) -> None:
    known = {opt.dest for opt in ENGINE_OPTIONS}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")


# ------------------------------------------------------------------ child side

class StatusReporter:
    """The child's end of the status pipe (a no-op when run by hand or by Kubernetes)."""

    def __init__(self, fd: int | None) -> None:
        self._file = os.fdopen(fd, "w", buffering=1) if fd is not None else None

    def report(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps({"event": event, **fields}) + "\n")
        except OSError:  # supervisor already gone; the parent watchdog handles that
            pass

    def ready(self, **fields: Any) -> None:
        self.report("ready", **fields)

    def error(self, message: str) -> None:
        self.report("error", message=message)


def parent_gone(parent_pid: int | None) -> bool:
    """True when this process was started by a supervisor that has since died."""
    return parent_pid is not None and os.getppid() != parent_pid


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
    """A scheduler and ``num_executors`` executors, started together and stopped together.

    ``start()`` returns the scheduler's ready record (``client_address``,
    ``metrics_address``, ``executors`` with each rank's ``metrics_address``...).
    Use as a context manager, or call ``shutdown()``.
    """

    def __init__(self, options: dict[str, Any] | None = None, *, host: str = "127.0.0.1",
                 port: int = DEFAULT_PORT, metrics_port: int = DEFAULT_METRICS_PORT,
                 executor_metrics_port: int = DEFAULT_EXECUTOR_METRICS_PORT,
                 num_executors: int = 1, startup_timeout: float = 600.0,
                 stop_timeout: float = 5.0) -> None:
        self.options = dict(options or {})
        check_engine_options(self.options)
        self.host, self.port = host, port
        self.metrics_port, self.executor_metrics_port = metrics_port, executor_metrics_port
        self.num_executors = num_executors
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
        try:
            self._spawn(SCHEDULER, [
                SCHEDULER, "--host", self.host, "--port", str(self.port),
                "--metrics-port", str(self.metrics_port), "--executor-address", executor_address,
                "--num-executors", str(self.num_executors),
                *engine_argv(self.options, SCHEDULER)])
            for rank in range(self.num_executors):
                metrics_port = self.executor_metrics_port + rank if self.executor_metrics_port else 0
                self._spawn(f"executor {rank}", [
                    EXECUTOR, "--scheduler", executor_address, "--rank", str(rank),
                    "--metrics-host", self.host, "--metrics-port", str(metrics_port),
                    *engine_argv(self.options, EXECUTOR)])
            self.info = self._wait_ready()
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
                readable, _, _ = select.select([child.pidfd], [], [],
                                               max(0.0, deadline - time.monotonic()))
                if not readable:
                    _log.warning("%s did not stop within %.1fs; killing it",
                                 child.name, self.stop_timeout)
                _signal_group(child.proc.pid, signal.SIGKILL)
                child.proc.wait()
            os.close(child.status_fd)
            os.close(child.pidfd)
        self._children.clear()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _spawn(self, name: str, argv: list[str]) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        cmd = [sys.executable, "-m", "weir.services.cli", *argv,
               "--status-fd", str(write_fd), "--parent-pid", str(os.getpid())]
        _log.info("starting %s: %s", name, " ".join(cmd))
        try:
            proc = subprocess.Popen(cmd, pass_fds=(write_fd,), stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        finally:
            os.close(write_fd)
        self._children.append(_Child(name, proc, read_fd, os.pidfd_open(proc.pid)))

    def _wait_ready(self) -> dict[str, Any]:
        scheduler = self._children[0]
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
                        raise ChildFailedError(f"{child.name} exited with code {rc} during start-up: "
                                               f"{child.error_message()}")
                    for event in child.events:
                        if event.get("event") == "error":
                            raise ChildFailedError(f"{child.name} failed to start: {event.get('message')}")
                    ready = [e for e in scheduler.events if e.get("event") == "ready"]
                    if ready:
                        return ready[0]


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
