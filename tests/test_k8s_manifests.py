"""The Kubernetes manifests and the Grafana dashboard agree with the code they deploy."""

import asyncio
import json
import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from prometheus_client import CollectorRegistry

from weir.services.cli import build_parser
from weir.services.engine.metrics import SchedulerMetrics
from weir.services.executor.metrics import ExecutorMetrics
from weir.services.gateway.metrics import GatewayMetrics
from weir.services.gateway.router import Router
from weir.shared.keys import FILES_NEEDED

K8S = Path(__file__).resolve().parent.parent / "k8s"


def _documents() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _by_kind_name(kind: str, name: str) -> dict:
    return next(d for d in _documents() if d["kind"] == kind and d["metadata"]["name"] == name)


def _container(deployment: str) -> dict:
    return _by_kind_name("Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests
    for generator in kustomization["configMapGenerator"]:
        for file in generator["files"]:
            assert (K8S / file).is_file()


@pytest.mark.parametrize("deployment", ["weir-scheduler", "weir-executor", "weir-gateway"])
def test_container_args_are_accepted_by_the_cli(deployment: str) -> None:
    args = build_parser().parse_args(_container(deployment)["args"])
    assert args.command == deployment.removeprefix("weir-")


def test_scheduler_readiness_probe_is_a_weir_health_check() -> None:
    command = _container("weir-scheduler")["readinessProbe"]["exec"]["command"]
    assert command[0] == "weir"
    args = build_parser().parse_args(command[1:])
    assert args.command == "health"
    scheduler_args = build_parser().parse_args(_container("weir-scheduler")["args"])
    assert urlparse(args.address).port == scheduler_args.port


def test_executor_reaches_the_scheduler_service_port() -> None:
    executor_args = build_parser().parse_args(_container("weir-executor")["args"])
    target = urlparse(executor_args.scheduler)
    service = _by_kind_name("Service", target.hostname)
    scheduler_args = build_parser().parse_args(_container("weir-scheduler")["args"])
    bound = urlparse(scheduler_args.executor_address)
    ports = {p["port"]: p["targetPort"] for p in service["spec"]["ports"]}
    container_ports = {p["name"]: p["containerPort"] for p in _container("weir-scheduler")["ports"]}
    assert container_ports[ports[target.port]] == bound.port
    assert container_ports["clients"] == scheduler_args.port
    assert container_ports["metrics"] == scheduler_args.metrics_port
    executor_ports = {p["name"]: p["containerPort"] for p in _container("weir-executor")["ports"]}
    assert executor_ports["metrics"] == executor_args.metrics_port


async def _gateway_registry() -> CollectorRegistry:
    # The router's clients belong to an event loop: made, and closed, inside one.
    router = Router(["tcp://127.0.0.1:9"])
    try:
        return GatewayMetrics(router).registry
    finally:
        await router.close()


def test_dashboard_queries_only_metrics_the_processes_export() -> None:
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    exported = set()
    for registry in (
        SchedulerMetrics("m").registry,
        ExecutorMetrics("m", 0).registry,
        asyncio.run(_gateway_registry()),
    ):
        for family in registry.collect():
            exported |= {family.name + suffix for suffix in suffixes[family.type]}
    dashboard = json.loads((K8S / "grafana-dashboard.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"weir:[a-z0-9_]+", target["expr"])
    }
    assert queried, "the dashboard has no Weir queries"
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"


def test_gateway_routes_to_the_scheduler_service_client_port() -> None:
    args = build_parser().parse_args(_container("weir-gateway")["args"])
    target = urlparse(args.scheduler[0])
    service = _by_kind_name("Service", target.hostname)
    assert target.port in {p["port"] for p in service["spec"]["ports"] if p["name"] == "clients"}
    probe = _container("weir-gateway")["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health" and probe["port"] == "http"


@pytest.mark.parametrize(
    "deployment, role",
    [("weir-scheduler", "scheduler"), ("weir-executor", "executor"), ("weir-gateway", "client")],
)
def test_each_pod_mounts_the_keys_its_role_needs_where_its_keys_dir_points(
    deployment: str, role: str
) -> None:
    spec = _by_kind_name("Deployment", deployment)["spec"]["template"]["spec"]
    container = spec["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "keys")
    volume = next(v for v in spec["volumes"] if v["name"] == "keys")
    assert volume["secret"]["secretName"] == "weir-keys" and mount["readOnly"]
    assert volume["secret"]["defaultMode"] == 0o400
    files = {item["path"] for item in volume["secret"]["items"]}
    assert set(FILES_NEEDED[role]) <= files
    if role != "scheduler":  # only the scheduler holds secrets beyond its own
        assert files == set(FILES_NEEDED[role])
    commands = [container["args"]]
    if "exec" in container.get("readinessProbe", {}):
        commands.append(container["readinessProbe"]["exec"]["command"][1:])
    for argv in commands:
        assert build_parser().parse_args(argv).keys_dir == mount["mountPath"]
