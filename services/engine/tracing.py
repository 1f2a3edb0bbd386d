"""OpenTelemetry traces of requests (vLLM's ``--otlp-traces-endpoint``).

Each finished request is one span, ``llm_request`` (kind SERVER), from its arrival to its
end, with vLLM's attributes: its id, model and sampling parameters, its prompt and output
token counts, and its latencies (queue, first token, prefill, decode, inference,
end-to-end). A request whose client sent a W3C trace context (the gateway passes an HTTP
request's ``traceparent`` and ``tracestate``) is a child of the client's span, so the
engine's time shows inside the caller's trace. The span is built when the request ends, from
the times the scheduler keeps anyway; the OpenTelemetry SDK's batch processor exports spans
from its own thread, over OTLP/gRPC (vLLM's default) or OTLP/HTTP
(``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``), to a collector (Jaeger, Tempo, the
OpenTelemetry Collector).
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Mapping
from typing import Any

from weir.services.engine.metrics import RequestTimes
from weir.shared.sampling import SamplingParams

PROTOCOLS = ("grpc", "http/protobuf")
_PROTOCOL_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


class RequestTracer:
    def __init__(self, endpoint: str, model_name: str) -> None:
        """ValueError where the OpenTelemetry packages are missing or the protocol is not
        one of ``PROTOCOLS``."""
        protocol = os.environ.get(_PROTOCOL_VARIABLE, "grpc")
        if protocol not in PROTOCOLS:
            raise ValueError(f"{_PROTOCOL_VARIABLE}={protocol!r}: traces go over {PROTOCOLS}")
        package = "grpc" if protocol == "grpc" else "http"
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            exporter = importlib.import_module(
                f"opentelemetry.exporter.otlp.proto.{package}.trace_exporter"
            ).OTLPSpanExporter
        except ImportError as exc:
            raise ValueError(
                f"--otlp-traces-endpoint needs OpenTelemetry ({exc}): pip install "
                f"opentelemetry-sdk opentelemetry-exporter-otlp-proto-{package}"
            ) from None
        # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES name it otherwise.
        resource = Resource.create({"service.name": "weir"})
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(exporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("weir.engine")
        self._kind = SpanKind.SERVER
        self._propagator = TraceContextTextMapPropagator()
        self.model_name = model_name

    def request_finished(
        self,
        request_id: str,
        trace_headers: Mapping[str, str] | None,
        times: RequestTimes,
        prompt_tokens: int,
        completion_tokens: int,
        params: SamplingParams,
    ) -> None:
        wall = time.time() - time.monotonic()  # monotonic times to the epoch's nanoseconds
        attributes: dict[str, Any] = {
            "gen_ai.request.id": request_id,
            "gen_ai.response.model": self.model_name,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.n": 1,
            "gen_ai.usage.prompt_tokens": prompt_tokens,
            "gen_ai.usage.completion_tokens": completion_tokens,
            "gen_ai.latency.e2e": times.finished - times.arrival,
        }
        if params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if times.scheduled is not None:
            attributes["gen_ai.latency.time_in_queue"] = times.scheduled - times.arrival
            attributes["gen_ai.latency.time_in_model_inference"] = times.finished - times.scheduled
        if times.first_token is not None:
            attributes["gen_ai.latency.time_to_first_token"] = times.first_token - times.arrival
            attributes["gen_ai.latency.time_in_model_decode"] = times.finished - times.first_token
            if times.scheduled is not None:
                attributes["gen_ai.latency.time_in_model_prefill"] = (
                    times.first_token - times.scheduled
                )
        span = self._tracer.start_span(
            "llm_request",
            context=self._propagator.extract(dict(trace_headers or {})),
            kind=self._kind,
            attributes=attributes,
            start_time=int((times.arrival + wall) * 1e9),
        )
        span.end(end_time=int((times.finished + wall) * 1e9))

    def close(self) -> None:
        """Export what is left (at most the processor's timeout, 30 s)."""
        self._provider.shutdown()
