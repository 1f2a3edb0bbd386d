"""Prometheus series of the HTTP gateway (served at its own ``GET /metrics``)."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from weir.services.gateway.router import Replica, Router
from weir.services.metrics_endpoint import drop_created_series

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    def __init__(self, router: Router) -> None:
        drop_created_series()
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter(
            "weir_gateway_requests_total",
            "HTTP requests by route and status code",
            ["route", "status"],
            registry=reg,
        )
        self.latency = Histogram(
            "weir_gateway_request_duration_seconds",
            "HTTP request duration (to the last byte of a stream)",
            ["route"],
            registry=reg,
            buckets=_LATENCY_BUCKETS,
        )
        up = Gauge(
            "weir_gateway_replica_up",
            "1 while the replica is in rotation",
            ["replica"],
            registry=reg,
        )
        outstanding = Gauge(
            "weir_gateway_replica_outstanding_tokens",
            "Estimated tokens of the replica's unfinished requests",
            ["replica"],
            registry=reg,
        )
        self.routed = Counter(
            "weir_gateway_replica_requests_total",
            "Sample streams routed to the replica",
            ["replica"],
            registry=reg,
        )
        self.rerouted = Counter(
            "weir_gateway_rerouted_requests_total",
            "Sample streams sent to another replica after theirs failed before any output",
            registry=reg,
        )
        for replica in router.replicas:
            up.labels(replica.address).set_function(partial(_healthy, replica))
            outstanding.labels(replica.address).set_function(partial(_outstanding, replica))
            self.routed.labels(replica.address)


def _healthy(replica: Replica) -> float:
    return float(replica.healthy)


def _outstanding(replica: Replica) -> float:
    return float(replica.outstanding_tokens)
