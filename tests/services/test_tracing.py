"""OpenTelemetry traces (`--otlp-traces-endpoint`, vLLM's): a served engine exports a span
per request over OTLP to a receiver speaking the real wire (gRPC's TraceService, and HTTP's
/v1/traces with OTLP_TRACES_PROTOCOL=http/protobuf), decoded with OpenTelemetry's own
protobuf types; a request sent with a W3C traceparent joins the caller's trace."""

from __future__ import annotations

import http.server
import secrets
import socket
import threading
import time
from concurrent import futures

import grpc
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from serving_helpers import small_server

from weir.shared.protocol.client import ClientProtocolError, decode_client_message
from weir.shared.protocol.envelope import PROTOCOL_VERSION, pack_map


class Received:
    """The spans a receiver got, as (resource attributes, span) pairs."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict, object]] = []
        self._lock = threading.Lock()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = _attributes(resource_spans.resource.attributes)
                for scope in resource_spans.scope_spans:
                    self.spans.extend((resource, span) for span in scope.spans)

    def wait_for(self, trace_id: bytes | None = None, timeout: float = 20.0) -> tuple[dict, object]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                for resource, span in self.spans:
                    if trace_id is None or span.trace_id == trace_id:
                        return resource, span
            time.sleep(0.05)
        raise AssertionError(f"no span of trace {trace_id!r} arrived")


def _attributes(pairs) -> dict:
    out = {}
    for pair in pairs:
        kind = pair.value.WhichOneof("value")
        out[pair.key] = getattr(pair.value, kind)
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(self, request, context):  # noqa: N802 (the service's name)
        self.received.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def _grpc_receiver(received: Received) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(received), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"http://127.0.0.1:{port}"


def _http_receiver(received: Received) -> tuple[http.server.HTTPServer, str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            assert self.path == "/v1/traces"
            assert self.headers["Content-Type"] == "application/x-protobuf"
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            received.add(request)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1/traces"


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_each_request_is_a_span_in_its_callers_trace(tiny_model_dir, monkeypatch, protocol):
    """A completion sent with a traceparent is a SERVER span "llm_request" in that trace,
    child of the caller's span, from its arrival to its end (within the client's wait), with
    vLLM's attributes agreeing with the reply's usage; one sent without is a trace's root."""
    received = Received()
    if protocol == "grpc":
        receiver, endpoint = _grpc_receiver(received)
    else:
        receiver, endpoint = _http_receiver(received)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s, not 5 s
    try:
        with small_server(tiny_model_dir, "tiny", otlp_traces_endpoint=endpoint) as server:
            client = openai.OpenAI(base_url=server.info["http_address"] + "/v1", api_key="x")
            trace_id, parent_id = secrets.token_bytes(16), secrets.token_bytes(8)
            headers = {
                "traceparent": f"00-{trace_id.hex()}-{parent_id.hex()}-01",
                "tracestate": "vendor=opaque",
                "x-request-id": "traced-1",
            }
            sent = time.time_ns()
            reply = client.completions.create(
                model="tiny",
                prompt=[5, 6, 7, 8, 9, 10, 11],
                max_tokens=6,
                temperature=0.5,
                top_p=0.9,
                extra_headers=headers,
                extra_body={"ignore_eos": True},
            )
            answered = time.time_ns()
            resource, span = received.wait_for(trace_id)
            assert resource["service.name"] == "weir"
            assert span.name == "llm_request" and span.kind == span.SPAN_KIND_SERVER
            assert span.parent_span_id == parent_id
            assert span.trace_state == "vendor=opaque"
            assert sent <= span.start_time_unix_nano <= span.end_time_unix_nano <= answered
            attributes = _attributes(span.attributes)
            assert "traced-1" in attributes["gen_ai.request.id"]
            assert attributes["gen_ai.response.model"] == "tiny"
            assert attributes["gen_ai.usage.prompt_tokens"] == reply.usage.prompt_tokens == 7
            assert attributes["gen_ai.usage.completion_tokens"] == reply.usage.completion_tokens
            assert attributes["gen_ai.request.max_tokens"] == 6
            assert attributes["gen_ai.request.temperature"] == pytest.approx(0.5)
            assert attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
            e2e = attributes["gen_ai.latency.e2e"]
            duration = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
            assert e2e == pytest.approx(duration, abs=1e-3)
            assert attributes["gen_ai.latency.time_in_model_prefill"] + attributes[
                "gen_ai.latency.time_in_model_decode"
            ] == pytest.approx(attributes["gen_ai.latency.time_in_model_inference"])
            assert (
                attributes["gen_ai.latency.time_in_queue"]
                <= attributes["gen_ai.latency.time_to_first_token"]
                <= e2e
            )
            # Without a trace context: a root span of a trace of its own.
            received.spans.clear()
            client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2)
            _, root = received.wait_for()
            assert root.parent_span_id == b"" and root.trace_id not in (trace_id, bytes(16))
    finally:
        if protocol == "grpc":
            receiver.stop(None)
        else:
            receiver.shutdown()


def test_trace_headers_from_a_raw_client_are_checked():
    """What the protocol takes: traceparent and tracestate, text of at most 512 characters."""
    base = {
        "v": PROTOCOL_VERSION,
        "type": "generate",
        "request_id": "r",
        "prompt": [1, 2],
        "sampling_params": {},
    }
    good = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    assert decode_client_message(pack_map({**base, "trace_headers": good})).trace_headers == good
    for bad in ({"baggage": "a=b"}, {"traceparent": 5}, {"tracestate": "x" * 513}, ["x"]):
        with pytest.raises(ClientProtocolError, match="trace_headers must map traceparent"):
            decode_client_message(pack_map({**base, "trace_headers": bad}))
