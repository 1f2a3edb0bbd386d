"""A real Prometheus scrapes a running server, and every Grafana dashboard query returns data.

The default model is served as `weir serve` runs it (scheduler, executor, gateway, with
n-gram speculation so the speculative-decoding panels have data). Debian's Prometheus
(2.42, which negotiates OpenMetrics the way that once hid every ``weir:`` series) scrapes
the three /metrics endpoints every second; the test sends a few requests through the
gateway, then evaluates each dashboard expression through Prometheus's HTTP API and runs
`promtool check metrics` on each endpoint's exposition.
"""

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from weir.services.launcher import ServerProcesses, free_port
from weir.shared.config import EngineArgs

PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None or PROMTOOL is None,
        reason="needs Prometheus and promtool: on Debian/Ubuntu "
        "`apt-get install --no-install-recommends prometheus`, elsewhere both binaries "
        "from prometheus.io/download on PATH",
    ),
]

DASHBOARD = Path(__file__).resolve().parents[2] / "k8s" / "grafana-dashboard.json"
# Long enough to reach back past the first scrape, so rates cover every request.
RATE_INTERVAL = "5m"
PROMPTS = [
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,",  # n-gram drafts get accepted
    "The capital of France is",
]


def _target(url: str) -> str:
    parsed = urlparse(url)
    return f"{parsed.hostname}:{parsed.port}"


def _start_prometheus(
    tmp_path: Path, targets: dict[str, str], log: object
) -> tuple[subprocess.Popen, str]:
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {
                "job_name": role,
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [_target(url)]}],
            }
            for role, url in targets.items()
        ],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    return proc, f"http://127.0.0.1:{port}"


def _api(base: str, path: str, **params: str) -> object:
    response = httpx.get(f"{base}/api/v1/{path}", params=params, timeout=10)
    response.raise_for_status()  # 503 while Prometheus starts
    body = response.json()
    assert body["status"] == "success", body
    return body["data"]


def _wait_for_targets(base: str, count: int, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            targets = _api(base, "targets")["activeTargets"]
            if len(targets) == count and all(t["health"] == "up" for t in targets):
                return
        except httpx.HTTPError:
            targets = "Prometheus is not answering"
        if time.monotonic() > deadline:
            pytest.fail(f"Prometheus did not scrape every endpoint: {targets}\n{log.read_text()}")
        time.sleep(0.5)


def _variable_queries() -> list[tuple[str, str]]:
    """(metric, label) of each ``label_values(metric, label)`` dashboard variable."""
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    found = [
        re.fullmatch(r"label_values\((\w+), *(\w+)\)", v["query"])
        for v in variables
        if v["type"] == "query"
    ]
    assert all(found), variables
    return [(m[1], m[2]) for m in found if m]


def _dashboard_expressions(model_name: str) -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        target["expr"].replace("$__rate_interval", RATE_INTERVAL).replace("$model_name", model_name)
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def _has_data(base: str, expr: str) -> bool:
    """The query returns at least one series with a finite value (not NaN: a histogram
    quantile over no observations is NaN, and would hide a panel with nothing to show)."""
    result = _api(base, "query", query=expr)["result"]
    return any(value not in ("NaN", "+Inf", "-Inf") for _, value in (r["value"] for r in result))


def _value(base: str, expr: str) -> float:
    [series] = _api(base, "query", query=expr)["result"]
    return float(series["value"][1])


def test_every_dashboard_query_returns_data_under_a_real_prometheus(tmp_path):
    engine = EngineArgs(
        model=None,
        kv_cache_memory="32MiB",
        max_num_batched_tokens=256,
        speculative_method="ngram",
        num_speculative_tokens=3,
    )
    with ServerProcesses(
        engine, port=0, metrics_port=0, executor_metrics_port=0, http_port=0
    ) as server:
        endpoints = {
            "scheduler": server.info["metrics_address"],
            "executor": server.info["executors"][0]["metrics_address"],
            "gateway": server.info["http_address"] + "/metrics",
        }
        log = tmp_path / "prometheus.log"
        with log.open("wb") as log_file:
            prometheus, base = _start_prometheus(tmp_path, endpoints, log_file)
        try:
            _wait_for_targets(base, len(endpoints), log)
            http = server.info["http_address"] + "/v1"
            model_name = server.info["model_name"]
            assert httpx.get(f"{http}/models", timeout=30).status_code == 200
            for prompt in PROMPTS:
                completion = httpx.post(
                    f"{http}/completions",
                    json={"model": model_name, "prompt": prompt, "max_tokens": 16},
                    timeout=120,
                )
                assert completion.status_code == 200, completion.text
            chat = httpx.post(
                f"{http}/chat/completions",
                json={
                    "model": model_name,
                    "messages": [{"role": "user", "content": "Say hello."}],
                    "max_tokens": 8,
                },
                timeout=120,
            )
            assert chat.status_code == 200, chat.text

            # The dashboard's model variable, as Grafana fills it.
            for metric, label in _variable_queries():
                values = _api(base, f"label/{label}/values", **{"match[]": metric})
                assert values == [model_name], (metric, label)
            expressions = _dashboard_expressions(model_name)
            assert len(expressions) >= 20
            # A few more scrapes carry the requests' counts into Prometheus. A rate needs
            # two samples around an increase, and on a loaded machine a scrape can time
            # out: traffic keeps flowing (as in a real deployment) until each has one.
            deadline = time.monotonic() + 60
            while missing := [e for e in expressions if not _has_data(base, e)]:
                assert time.monotonic() < deadline, f"dashboard queries without data: {missing}"
                httpx.post(
                    f"{http}/completions",
                    json={"model": model_name, "prompt": PROMPTS[0], "max_tokens": 16},
                    timeout=120,
                )
                time.sleep(1)
            # The API port serves the engine's series too (vLLM's one port), labelled with
            # its replica: what an endpoint picker scraping only that port reads.
            query = 'weir_cache_config_info{job="gateway"}'
            [config] = _api(base, "query", query=query)["result"]
            assert config["metric"]["num_gpu_blocks"] == str(server.info["num_blocks"])
            assert (config["metric"]["block_size"], config["metric"]["engine"]) == ("16", "0")
            tokens = 'weir_prompt_tokens_total{{job="{}"}}'
            deadline = time.monotonic() + 30  # the two jobs' last scrapes agree once idle
            while _value(base, tokens.format("gateway")) != _value(
                base, tokens.format("scheduler")
            ):
                assert time.monotonic() < deadline
                time.sleep(0.5)
        finally:
            prometheus.terminate()
            prometheus.wait(timeout=30)

        for role, url in endpoints.items():
            text = httpx.get(url, timeout=10).content
            check = subprocess.run(
                [PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=60
            )
            assert check.returncode == 0, (role, check.stdout.decode() + check.stderr.decode())
