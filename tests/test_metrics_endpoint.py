"""The /metrics endpoint every process serves: metrics, a readiness /health, 404 elsewhere."""

import threading

import httpx
from prometheus_client import CollectorRegistry, Gauge

from weir.services.metrics_endpoint import start_metrics_server


def test_metrics_health_and_unknown_paths() -> None:
    registry = CollectorRegistry()
    Gauge("weir_test_value", "a value", registry=registry).set(7)
    ready = threading.Event()
    url = start_metrics_server(registry, "127.0.0.1", 0, ready=ready.is_set)
    base = url.removesuffix("/metrics")

    metrics = httpx.get(url, timeout=10)
    assert metrics.status_code == 200
    assert "weir_test_value 7.0" in metrics.text

    assert httpx.get(f"{base}/health", timeout=10).status_code == 503
    ready.set()
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200

    for path in ("/", "/metricsx", "/metrics/", "/healthz", "/favicon.ico"):
        assert httpx.get(base + path, timeout=10).status_code == 404, path
