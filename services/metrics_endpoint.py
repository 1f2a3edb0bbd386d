"""The HTTP endpoint every Weir process serves beside its work: ``/metrics`` and ``/health``.

``GET /metrics`` is the process's Prometheus registry (text or OpenMetrics, as the
scraper asks); ``GET /health`` answers 200 once the process can do its work (the
scheduler: every executor joined; an executor: welcomed by its scheduler) and 503
before, which is what Kubernetes' readiness probes read. Any other path is a 404, so
a misconfigured probe or scrape fails loudly instead of reading metrics as "healthy".
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, disable_created_metrics, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes and probes every few seconds would drown the process's own log."""


def _endpoint_app(registry: CollectorRegistry, ready: Callable[[], bool]) -> Callable[..., Any]:
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            # make_wsgi_app's app is a bare Callable; what it returns is a WSGI body.
            metrics: Iterable[bytes] = metrics_app(environ, start_response)
            return metrics
        if path == "/health":
            status, body = (
                ("200 OK", b"ok\n") if ready() else ("503 Service Unavailable", b"not ready\n")
            )
        else:
            status, body = (
                "404 Not Found",
                b"not found: this endpoint serves /metrics and /health\n",
            )
        # wsgiref adds Content-Length to the list it is given: a fresh one per response.
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [body]

    return app


def drop_created_series() -> None:
    """Export no ``_created`` timestamp series: they double every counter and histogram,
    and no dashboard reads them (prometheus_client's switch is process-wide)."""
    disable_created_metrics()


def start_metrics_server(
    registry: CollectorRegistry,
    host: str,
    port: int,
    ready: Callable[[], bool] = lambda: True,
) -> str:
    """Serve ``registry`` at /metrics and ``ready()`` at /health on a daemon thread.

    Returns the /metrics URL (port 0 = any free port); OSError names the address it could
    not bind."""
    drop_created_series()

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    try:
        server = make_server(
            host, port, _endpoint_app(registry, ready), Server, handler_class=_QuietHandler
        )
    except OSError as exc:
        raise OSError(
            exc.errno, f"cannot serve /metrics on {host}:{port}: {exc.strerror or exc}"
        ) from None
    thread = threading.Thread(target=server.serve_forever, name="weir-metrics", daemon=True)
    thread.start()
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{server.server_port}/metrics"
