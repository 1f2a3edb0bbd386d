"""vLLM's flags for where the API is served: `--root-path` (behind a proxy's path prefix) and
`--ssl-*` (HTTPS, client certificates), checked with the official `openai` client over real
TLS (certificates from a test CA made by trustme)."""

import signal
import ssl
import subprocess
import sys
import time

import httpx
import openai
import pytest
import trustme

from weir.services.cli import _gateway_argv, build_parser
from weir.services.launcher import ServerProcesses, free_port
from weir.shared.config import EngineArgs

API_KEY = "sesame"


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def https_server(tiny_model_dir, ca, tmp_path_factory):
    """`weir serve --root-path /llm/ --ssl-* ... --ssl-cert-reqs 2`: the gateway's flags
    exactly as `weir serve` passes them on."""
    files = tmp_path_factory.mktemp("tls")
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    server_cert.private_key_pem.write_to_path(str(files / "key.pem"))
    server_cert.cert_chain_pems[0].write_to_path(str(files / "cert.pem"))
    ca.cert_pem.write_to_path(str(files / "ca.pem"))
    flags = ["--root-path", "/llm/", "--ssl-certfile", str(files / "cert.pem")]
    flags += ["--ssl-keyfile", str(files / "key.pem"), "--ssl-ca-certs", str(files / "ca.pem")]
    args = build_parser().parse_args(["serve", *flags, "--ssl-cert-reqs", "2"])
    server = ServerProcesses(
        EngineArgs(
            model=str(tiny_model_dir),
            served_model_name="tiny",
            max_model_len=256,
            block_size=16,
            max_num_batched_tokens=64,
            device="cpu",
        ),
        port=0,
        metrics_port=0,
        executor_metrics_port=0,
        http_port=0,
        api_key=API_KEY,
        gateway_argv=_gateway_argv(args),
    )
    info = server.start()
    try:
        yield info
    finally:
        server.shutdown()


def _client_context(ca: trustme.CA, with_certificate: bool) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    if with_certificate:
        ca.issue_cert("client@example.com").configure_cert(context)
    return context


@pytest.mark.parametrize("prefix", ["/llm", ""])
def test_the_api_over_https_with_and_without_the_root_path(https_server, ca, prefix):
    address = https_server["http_address"]
    assert address.startswith("https://")
    http = httpx.Client(verify=_client_context(ca, with_certificate=True))
    client = openai.OpenAI(
        base_url=f"{address}{prefix}/v1", api_key=API_KEY, http_client=http, max_retries=0
    )
    out = client.completions.create(model="tiny", prompt="The capital", max_tokens=4)
    assert out.usage.completion_tokens == 4
    # The key guards the prefixed routes too (their path no longer begins with /v1/).
    intruder = openai.OpenAI(
        base_url=f"{address}{prefix}/v1", api_key="wrong", http_client=http, max_retries=0
    )
    with pytest.raises(openai.AuthenticationError):
        intruder.models.list()
    assert http.post(f"{address}{prefix}/tokenize", json={"prompt": "a"}).status_code == 401
    # Counted under its route, not as "other".
    exposition = http.get(f"{address}{prefix}/metrics").text
    assert 'weir_gateway_requests_total{route="/v1/completions",status="200"}' in exposition
    assert 'route="other"' not in exposition


def test_https_refuses_plain_http_and_clients_without_a_certificate(https_server, ca):
    address = https_server["http_address"]
    with pytest.raises(httpx.HTTPError):
        httpx.get(address.replace("https://", "http://") + "/health", timeout=10)
    with pytest.raises(httpx.HTTPError):  # --ssl-cert-reqs 2: no certificate, no handshake
        httpx.get(f"{address}/health", verify=_client_context(ca, with_certificate=False))
    trusted = _client_context(ca, with_certificate=True)
    assert httpx.get(f"{address}/health", verify=trusted).status_code == 200


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--ssl-certfile", "/no/such/cert.pem"], "cannot serve HTTPS with --ssl-certfile"),
        (["--ssl-keyfile", "key.pem"], "need --ssl-certfile"),
        (["--root-path", "llm"], "not a URL path: 'llm'"),
    ],
)
@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_unusable_http_server_flags_stop_the_start_in_one_line(command, flags, words):
    done = subprocess.run(
        [sys.executable, "-m", "weir.services.cli", command, *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert words in done.stderr and "Traceback" not in done.stderr


def test_an_https_gateway_stops_at_once_beside_an_idle_pooled_connection(ca, tmp_path):
    """A TLS close waits (30 s) for the client's close_notify; a client's idle pooled
    connection sends none, and the gateway's SIGTERM waited that long for each."""
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "weir.services.cli", "gateway", "--port", str(port)]
        + ["--scheduler", f"tcp://127.0.0.1:{free_port()}", "--ssl-certfile"]
        + [str(tmp_path / "cert.pem"), "--ssl-keyfile", str(tmp_path / "key.pem")]
    )
    try:
        with httpx.Client(verify=_client_context(ca, with_certificate=False)) as pooled:
            deadline = time.monotonic() + 60
            while True:
                try:
                    pooled.get(f"https://127.0.0.1:{port}/version").raise_for_status()
                    break
                except httpx.ConnectError:
                    assert time.monotonic() < deadline, "the gateway did not start"
                    time.sleep(0.2)
            start = time.monotonic()
            gateway.send_signal(signal.SIGTERM)
            assert gateway.wait(timeout=30) == 0
            assert time.monotonic() - start < 5
    finally:
        gateway.kill()
        gateway.wait()
