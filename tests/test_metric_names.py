"""Metric names survive every exposition format and pass `promtool check metrics`.

prometheus_client rewrites a name it cannot send unescaped (a colon became ``_`` on
sample lines, but not in HELP/TYPE) when the scraper negotiates OpenMetrics the way
Prometheus 2.x does; plain ``weir_`` names are the same in every format.
"""

import asyncio
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, exposition
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from weir.services.engine.metrics import (
    CacheConfigInfo,
    LoraRequestGauges,
    RequestTimes,
    SchedulerMetrics,
    StepHistogram,
)
from weir.services.executor.metrics import ExecutorMetrics
from weir.services.gateway.engine_metrics import EngineMetrics
from weir.services.gateway.metrics import GatewayMetrics
from weir.services.gateway.router import Router
from weir.services.launcher import free_port
from weir.services.metrics_endpoint import start_metrics_server
from weir.services.scheduler.scheduler import Scheduler
from weir.shared.config import CacheConfig, SchedulerConfig

REPO = Path(__file__).resolve().parent.parent
NAME = re.compile(r"weir_[a-z][a-z0-9_]*")
ACCEPT = {
    "text 0.0.4": "text/plain;version=0.0.4",
    "Prometheus 2.x": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "OpenMetrics, underscore escaping": "application/openmetrics-text;version=1.0.0;"
    "escaping=underscores",
}


async def gateway_registry() -> CollectorRegistry:
    # The router's clients belong to an event loop: made, and closed, inside one.
    router = Router(["tcp://127.0.0.1:9"])
    try:
        return GatewayMetrics(router).registry
    finally:
        await router.close()


def _registries() -> dict[str, CollectorRegistry]:
    disable_created_metrics()  # as every Weir metrics endpoint does
    scheduler = SchedulerMetrics("m")
    # Label children exist only once used.
    scheduler.request_finished("stop", RequestTimes(0.0, 0.5, 1.0, 2.0), 5, 3, 3)
    LoraRequestGauges(
        "m", 2, lambda: {"sql": "sql"}, lambda: None, scheduler.registry
    )  # served with adapters
    cache = Scheduler(SchedulerConfig(), CacheConfig(num_blocks=64))
    CacheConfigInfo("m", lambda: cache, scheduler.registry)
    return {
        "scheduler": scheduler.registry,
        "executor": ExecutorMetrics("m", 0, "cpu").registry,
        "gateway": asyncio.run(gateway_registry()),
    }


def _names(text: str) -> tuple[set[str], set[str]]:
    """(names in HELP/TYPE lines, names on sample lines) of one exposition."""
    declared, sampled = set(), set()
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            declared.add(line.split()[2])
        elif line and not line.startswith("#"):
            sampled.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return declared, sampled


@pytest.mark.parametrize("process", ["scheduler", "executor", "gateway"])
def test_names_are_the_same_in_every_exposition_format(process: str) -> None:
    registry = _registries()[process]
    seen = {}
    for fmt, accept in ACCEPT.items():
        encoder, _ = exposition.choose_encoder(accept)
        declared, sampled = _names(encoder(registry).decode())
        assert declared and all(NAME.fullmatch(n) for n in declared), (fmt, declared)
        # Every sample belongs to a declared family (a counter's `_total`, a histogram's parts).
        suffixes = ("", "_total", "_bucket", "_sum", "_count")
        for name in sampled:
            assert any(name.removesuffix(s) in declared for s in suffixes if name.endswith(s)), (
                fmt,
                name,
            )
        seen[fmt] = sampled
    assert len({frozenset(s) for s in seen.values()}) == 1, seen


@pytest.mark.parametrize("process", ["scheduler", "executor", "gateway"])
def test_promtool_accepts_the_exposition(process: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed: apt-get install prometheus (Debian/Ubuntu)")
    text = exposition.generate_latest(_registries()[process])
    done = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()


def test_the_gateway_serves_each_engines_series_under_one_family() -> None:
    """Two schedulers' /metrics endpoints, and one where nobody listens, behind the gateway's
    /metrics: each family declared once, each engine's samples labelled with its index, the
    silent one left out, and promtool accepts the whole."""
    disable_created_metrics()
    engines = [SchedulerMetrics("m") for _ in range(2)]
    engines[1].num_requests_waiting.set(3)
    urls = [start_metrics_server(e.registry, "127.0.0.1", 0) for e in engines]
    urls.append(f"http://127.0.0.1:{free_port()}/metrics")
    own = asyncio.run(gateway_registry())
    text = exposition.generate_latest(asyncio.run(EngineMetrics(urls, 1.0).registry(own)))
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    waiting = families["weir_num_requests_waiting"].samples
    assert {s.labels["engine"]: s.value for s in waiting} == {"0": 0.0, "1": 3.0}
    declared = [line.split()[2] for line in text.decode().splitlines() if line.startswith("# TYPE")]
    assert len(declared) == len(set(declared)) and "weir_gateway_requests_total" in declared
    promtool = shutil.which("promtool")
    if promtool is not None:
        done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True)
        assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()


def test_a_flood_of_scrapes_reads_the_engines_once_a_second() -> None:
    """The API port is open to every client: fifty scrapes at once cost the scheduler one
    render of its metrics, and scrapes within the next second none."""
    renders = []

    class Counted:
        def collect(self):
            renders.append(1)
            yield GaugeMetricFamily("weir_num_requests_waiting", "w", value=0)

    engine = CollectorRegistry(auto_describe=False)
    engine.register(Counted())
    engine_metrics = EngineMetrics([start_metrics_server(engine, "127.0.0.1", 0)], 1.0, 0.5)

    async def scrapes(n: int) -> None:
        own = CollectorRegistry()
        await asyncio.gather(*(engine_metrics.registry(own) for _ in range(n)))

    asyncio.run(scrapes(50))
    asyncio.run(scrapes(10))
    assert len(renders) == 1
    time.sleep(0.5)
    asyncio.run(scrapes(10))
    assert len(renders) == 2


def test_no_colon_metric_names_are_left_in_the_repository() -> None:
    """Queries, docs and tests name the metrics as they are exported."""
    folders = ("services", "shared", "kernels", "k8s", "docs", "tests", "benchmarks")
    files = [REPO / "README.md", *(p for f in folders for p in (REPO / f).rglob("*"))]
    stale = [
        f"{path.relative_to(REPO)}: {match}"
        for path in files
        if path.suffix in {".py", ".md", ".json", ".yaml"}
        for match in re.findall(r"weir:[a-z_]+", path.read_text(errors="replace"))
    ]
    assert not stale, stale


@pytest.mark.parametrize("fmt", list(ACCEPT))
def test_a_step_histogram_is_exposed_as_prometheus_client_exposes_a_histogram(fmt: str) -> None:
    """The scheduler observes inter-token latencies a step at a time (``StepHistogram``);
    prometheus_client's own ``Histogram`` fed the same values one by one is the reference."""
    disable_created_metrics()
    buckets = (0.001, 0.01, 0.1, 1.0, 10.0)
    rng = random.Random(0)
    steps = [
        [rng.choice([0.0, 0.001, 0.1, 10.0, 1e6, rng.expovariate(20)]) for _ in range(n)]
        for n in (0, 1, 7, 256)
    ]
    ours = CollectorRegistry()
    step_histogram = StepHistogram("weir_x_seconds", "doc", {"model_name": "m"}, buckets, ours)
    reference = CollectorRegistry()
    histogram = Histogram(
        "weir_x_seconds", "doc", ["model_name"], registry=reference, buckets=buckets
    ).labels(model_name="m")
    encoder, _ = exposition.choose_encoder(ACCEPT[fmt])
    for values in steps:
        step_histogram.observe_many(values)
        for value in values:
            histogram.observe(value)
        assert encoder(ours) == encoder(reference)


def test_every_route_the_api_serves_is_counted_under_a_label_of_its_own():
    """A route missing from the gateway's list is counted as "other" in
    weir_gateway_requests_total, mixed with whatever paths clients make up."""
    from fastapi.routing import APIRoute

    from weir.services.gateway.app import Gateway, _route_label, create_app
    from weir.services.gateway.router import Router

    app = create_app(Gateway(Router(["tcp://127.0.0.1:1"])))
    paths = {route.path for route in app.routes if isinstance(route, APIRoute)}
    assert {"/v1/messages", "/generate", "/abort_request"} <= paths
    # A path with a parameter (each value its own path) is counted under its template.
    concrete = {re.sub(r"\{[^}]*\}", "x", path) for path in paths}
    assert [path for path in sorted(concrete) if _route_label(path) == "other"] == []
