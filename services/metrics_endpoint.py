"""The Prometheus HTTP endpoint every Weir process serves its own registry on."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> str:
    """Serve ``registry`` at /metrics on a daemon thread; returns the URL (port 0 = any free)."""
    # The `_created` timestamp series double every counter and no dashboard reads them.
    disable_created_metrics()
    server, _ = start_http_server(port, addr=host, registry=registry)
    return f"http://{host}:{server.server_port}/metrics"
