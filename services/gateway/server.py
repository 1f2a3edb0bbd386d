"""The gateway process (``weir gateway``): uvicorn serving the OpenAI API over the router."""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import socket
from dataclasses import dataclass, field

import uvicorn

from weir.services.gateway.app import ApiOptions, Gateway, create_app
from weir.services.gateway.chat_output import NO_PARSERS, ChatParsers
from weir.services.gateway.http_limits import BoundedHttpProtocol
from weir.services.gateway.router import Router
from weir.services.gateway.tls import Tls
from weir.services.sigterm import Terminated, raise_terminated
from weir.services.startup_heap import freeze_startup_heap
from weir.services.supervised import StatusReporter, parent_gone
from weir.shared.client import WeirError
from weir.shared.config import DEFAULT_MAX_MESSAGE_BYTES
from weir.shared.log_limit import limited_logger

_log = logging.getLogger(__name__)

_PARENT_CHECK_INTERVAL_S = 0.5
# File descriptors kept for what is not a client connection (sockets to replicas, logs).
_RESERVED_FDS = 128


def _connection_limit() -> int:
    """Connections (and requests) served at once: beyond it uvicorn answers 503 and closes,
    where it would otherwise run out of file descriptors and fail every request."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(soft - _RESERVED_FDS, 64) if soft != resource.RLIM_INFINITY else 65536


@dataclass(slots=True)
class GatewayOptions:
    schedulers: list[str]  # client addresses of the engine replicas
    host: str
    port: int  # 0: any free port
    api_key: str | None
    timeout: float  # seconds a replica may stay silent before its requests fail
    allowed_origins: list[str]  # CORS: the web origins whose pages may call the API
    keys_dir: str | None = None  # CurveZMQ client keys (None: $WEIR_KEYS_DIR, else none)
    max_request_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # larger HTTP bodies get 413
    parsers: ChatParsers = NO_PARSERS  # what it reads out of chats' text
    uvicorn_log_level: str = "warning"  # the HTTP server's own lines
    root_path: str = ""  # the path prefix a proxy serves the API under (vLLM's --root-path)
    tls: Tls | None = None  # None: plain HTTP
    api: ApiOptions = ApiOptions()  # what the API answers and logs
    docs: bool = True  # /docs, /redoc, /openapi.json (off: vLLM's --disable-fastapi-docs)
    request_id_headers: bool = False  # vLLM's --enable-request-id-headers
    load_tracking: bool = False  # vLLM's --enable-server-load-tracking: /load counts requests
    engine_metrics: list[str] = field(default_factory=list)  # scheduler /metrics URLs


async def serve(options: GatewayOptions, status: StatusReporter, parent_pid: int | None) -> int:
    try:
        router = Router(options.schedulers, timeout=options.timeout, keys_dir=options.keys_dir)
    except WeirError as exc:  # unusable keys
        status.error(str(exc))
        _log.error("gateway cannot start: %s", exc)
        return 2
    gateway = Gateway(
        router,
        options.api_key,
        options.max_request_bytes,
        options.allowed_origins,
        options.parsers,
        options.api,
        options.engine_metrics,
    )
    server: uvicorn.Server | None = None

    async def report_ready() -> None:
        # Runs at the end of the app's start-up, before uvicorn binds: report once bound.
        async def when_bound() -> None:
            while server is None or not server.started:
                await asyncio.sleep(0.01)
            if not server.servers or not server.servers[0].sockets:  # stopped before it bound
                return
            port = server.servers[0].sockets[0].getsockname()[1]
            host = f"[{options.host}]" if ":" in options.host else options.host
            scheme = "http" if options.tls is None else "https"
            address = f"{scheme}://{host}:{port}"
            _log.info("gateway at %s for %s", address, ", ".join(options.schedulers))
            freeze_startup_heap()
            status.ready(http_address=address, pid=os.getpid())

        asyncio.get_running_loop().create_task(when_bound())

    # Bound here, not by uvicorn: a port in use is then an error that says which.
    listener = socket.socket(socket.AF_INET6 if ":" in options.host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((options.host, options.port))
    except OSError as exc:
        listener.close()
        message = f"cannot serve HTTP on {options.host}:{options.port}: {exc.strerror}"
        status.error(f"{message} (--port; under `weir serve`: --http-port)")
        _log.error("gateway cannot start: %s", message)
        return 1
    app = create_app(
        gateway,
        on_startup=report_ready,
        root_path=options.root_path,
        docs=options.docs,
        request_id_headers=options.request_id_headers,
        load_tracking=options.load_tracking,
    )
    # uvicorn's lines in this process's format (no log_config of its own), and its line per
    # malformed request (any client can send them without pause) at most once a second.
    limited_logger("uvicorn.error")
    config = uvicorn.Config(
        app,
        http=BoundedHttpProtocol,
        log_config=None,
        log_level=options.uvicorn_log_level,
        access_log=False,
        limit_concurrency=_connection_limit(),
        **({} if options.tls is None else options.tls.uvicorn_settings()),
    )
    server = uvicorn.Server(config)

    async def watch_parent() -> None:
        while not parent_gone(parent_pid):
            await asyncio.sleep(_PARENT_CHECK_INTERVAL_S)
        _log.error("supervisor exited; stopping")
        server.should_exit = True

    watcher = asyncio.get_running_loop().create_task(watch_parent())
    # uvicorn stops gracefully on SIGTERM, then raises the signal again under the handler it
    # found: this one makes that an exit 0, as the scheduler's and executor's (the default
    # made it 143). Only around serving: elsewhere a SIGTERM (a failed start abandoned)
    # raised inside whatever ran, a log line, and printed a traceback.
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        await server.serve(sockets=[listener])
    except Terminated:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        watcher.cancel()
        listener.close()
    return 0
