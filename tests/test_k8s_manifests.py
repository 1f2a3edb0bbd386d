"""The Kubernetes manifests and the Grafana dashboard agree with the code they deploy."""

import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import psutil
import pytest
import yaml
from prometheus_client import CollectorRegistry
from test_metric_names import gateway_registry

from weir.services.cli import build_parser
from weir.services.engine.metrics import SchedulerMetrics
from weir.services.executor.metrics import ExecutorMetrics
from weir.services.gateway.app import Gateway, create_app
from weir.services.gateway.router import Router
from weir.services.launcher import free_port
from weir.services.metrics_endpoint import start_metrics_server
from weir.shared.config import DEFAULT_EXECUTOR_METRICS_PORT
from weir.shared.keys import FILES_NEEDED

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"


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


def test_dashboard_queries_only_metrics_the_processes_export() -> None:
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    exported = set()
    for registry in (
        SchedulerMetrics("m").registry,
        ExecutorMetrics("m", 0, "cpu").registry,
        asyncio.run(gateway_registry()),
    ):
        for family in registry.collect():
            exported |= {family.name + suffix for suffix in suffixes[family.type]}
    dashboard = json.loads((K8S / "grafana-dashboard.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"weir_[a-z0-9_]+", target["expr"])
    }
    assert queried, "the dashboard has no Weir queries"
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"


def test_dashboard_selects_every_engine_series_by_the_model_variable() -> None:
    """The scheduler's and executors' series carry ``model_name``: a query that does not
    select it mixes the models of one Prometheus. The gateway's (no such label) leave out
    the scrapes of its own /metrics, which are not API traffic."""
    engine = {
        family.name
        for registry in (SchedulerMetrics("m").registry, ExecutorMetrics("m", 0, "cpu").registry)
        for family in registry.collect()
    }
    dashboard = json.loads((K8S / "grafana-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name, selector in re.findall(r"(weir_[a-z0-9_]+)(\{[^}]*\})?", target["expr"]):
                family = re.sub(r"_(total|bucket|sum|count)$", "", name)
                if family in engine:
                    assert 'model_name=~"$model_name"' in selector, (panel["title"], name)
                elif name.startswith("weir_gateway_request"):
                    assert 'route!="/metrics"' in selector, (panel["title"], name)


def _shown_unit(panel: dict, ref_id: str) -> str:
    """The unit Grafana shows a target's series in: an override for its query, else the
    panel's."""
    unit = panel["fieldConfig"]["defaults"].get("unit")
    for override in panel["fieldConfig"].get("overrides", []):
        if override["matcher"] == {"id": "byFrameRefID", "options": ref_id}:
            unit = next((p["value"] for p in override["properties"] if p["id"] == "unit"), unit)
    return unit


def test_dashboard_shows_durations_in_seconds_and_ratios_unclamped() -> None:
    """A quantile or mean of a ``_seconds`` histogram is a duration, whatever else shares its
    panel; a ratio of rates is not clamped (clamping the denominator to 1/s understated the
    prefix-cache hit rate of any server below one query token per second)."""
    dashboard = json.loads((K8S / "grafana-dashboard.json").read_text())
    durations = 0
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            assert "clamp_min" not in expr, (panel["title"], expr)
            if re.search(r"histogram_quantile\(.*_seconds_bucket|_seconds_sum.*/.*_count", expr):
                durations += 1
                assert _shown_unit(panel, target["refId"]) == "s", (panel["title"], expr)
    assert durations >= 5


def test_a_stopping_gateway_leaves_its_service_before_it_refuses_connections() -> None:
    """SIGTERM closes uvicorn's listener at once: a preStop pause lets the endpoint's removal
    reach every node first, and the grace period is the scheduler's (its drain bounds the
    streams the gateway still relays)."""
    gateway = _by_kind_name("Deployment", "weir-gateway")["spec"]["template"]["spec"]
    scheduler = _by_kind_name("Deployment", "weir-scheduler")["spec"]["template"]["spec"]
    pause = int(_container("weir-gateway")["lifecycle"]["preStop"]["exec"]["command"][1])
    assert 0 < pause < gateway["terminationGracePeriodSeconds"]
    assert gateway["terminationGracePeriodSeconds"] >= scheduler["terminationGracePeriodSeconds"]


def test_gateway_routes_to_the_scheduler_service_client_port() -> None:
    args = build_parser().parse_args(_container("weir-gateway")["args"])
    target = urlparse(args.scheduler[0])
    service = _by_kind_name("Service", target.hostname)
    assert target.port in {p["port"] for p in service["spec"]["ports"] if p["name"] == "clients"}
    probe = _container("weir-gateway")["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health" and probe["port"] == "http"


# ------------------------------------------------------------------ start order


ROLES = ("weir-scheduler", "weir-executor", "weir-gateway")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def _served(deployment: str) -> dict[str, tuple[str, int]]:
    """The (bind address, port) the process serves each of its HTTP endpoints on, from the
    same command line the container runs: "metrics" (/metrics, /health) or "gateway"."""
    args = build_parser().parse_args(_container(deployment)["args"])
    if args.command == "scheduler":
        return {"metrics": (args.metrics_host or args.host, args.metrics_port)}
    if args.command == "executor":
        port = args.metrics_port
        return {"metrics": (args.metrics_host, port or DEFAULT_EXECUTOR_METRICS_PORT + args.rank)}
    return {"gateway": (args.host, args.port)}


async def _gateway_paths() -> set[str]:
    router = Router(["tcp://127.0.0.1:9"])
    try:
        return {route.path for route in create_app(Gateway(router, None)).routes}
    finally:
        await router.close()


def _metrics_endpoint_answers(path: str) -> bool:
    """A real metrics endpoint, ready, answers ``path`` (anything else is a 404)."""
    url = start_metrics_server(CollectorRegistry(), "127.0.0.1", 0, ready=lambda: True)
    try:
        with urllib.request.urlopen(url.removesuffix("/metrics") + path, timeout=10) as reply:
            return reply.status == 200
    except urllib.error.HTTPError:
        return False


@pytest.mark.parametrize("deployment", ROLES)
def test_every_probe_reaches_a_path_the_process_serves(deployment: str) -> None:
    container = _container(deployment)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    served = _served(deployment)
    gateway_paths = asyncio.run(_gateway_paths()) if "gateway" in served else set()
    for kind in PROBES:
        if kind not in container:
            continue
        assert "httpGet" in container[kind], f"{deployment} {kind}: probe an HTTP endpoint"
        probe = container[kind]["httpGet"]
        port = ports[probe["port"]]
        endpoint = next((e for e, (_, p) in served.items() if p == port), None)
        assert endpoint is not None, f"{deployment} {kind}: nothing serves HTTP on {port}"
        host = served[endpoint][0]
        assert host not in ("127.0.0.1", "localhost", "::1"), (
            f"{deployment} binds {endpoint} to {host}: the kubelet cannot reach it"
        )
        if endpoint == "gateway":
            assert probe["path"] in gateway_paths, (deployment, kind, probe)
        else:
            assert _metrics_endpoint_answers(probe["path"]), (deployment, kind, probe)


@pytest.mark.parametrize("deployment", ["weir-scheduler", "weir-executor"])
def test_engine_roles_have_startup_and_readiness_probes(deployment: str) -> None:
    container = _container(deployment)
    # Started: the process's own endpoint is up, which waits on no other pod.
    assert container["startupProbe"]["httpGet"]["path"] == "/metrics"
    # Ready: /health, 200 once the scheduler has its executors / the executor is welcomed.
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _pod_labels(deployment: str) -> dict:
    return _by_kind_name("Deployment", deployment)["spec"]["template"]["metadata"]["labels"]


def _upstreams(deployment: str) -> list[dict]:
    """The Services the process connects to, from its --scheduler addresses."""
    args = build_parser().parse_args(_container(deployment)["args"])
    addresses = args.scheduler if isinstance(args.scheduler, list) else [args.scheduler]
    return [_by_kind_name("Service", urlparse(a).hostname) for a in addresses or []]


def test_the_pods_become_ready_in_some_order() -> None:
    """Walk the start order: every pod starts on its own (startup probes wait on nothing
    else), then becomes ready once what it needs is reachable, until nothing changes.

    What readiness needs, from the code: an executor is ready once its scheduler has
    welcomed it; the scheduler once every executor has joined; a gateway once a
    scheduler answers with executors. A connection through a Service reaches a pod that
    is ready, or merely started when the Service publishes not-ready addresses."""
    scheduler_args = build_parser().parse_args(_container("weir-scheduler")["args"])
    executors = _by_kind_name("Deployment", "weir-executor")["spec"]["replicas"]
    # A Deployment gives each pod the same --rank, which a scheduler takes once.
    assert scheduler_args.num_executors == executors == 1

    def reachable(service: dict, ready: set[str]) -> bool:
        targets = [
            d
            for d in ROLES
            if _selects({"matchLabels": service["spec"]["selector"]}, _pod_labels(d))
        ]
        assert targets, f"Service {service['metadata']['name']} selects no pod"
        return service["spec"].get("publishNotReadyAddresses", False) or all(
            d in ready for d in targets
        )

    needs = {
        "weir-executor": lambda ready: all(
            reachable(s, ready) for s in _upstreams("weir-executor")
        ),
        "weir-scheduler": lambda ready: "weir-executor" in ready,
        "weir-gateway": lambda ready: any(
            reachable(s, ready) and "weir-scheduler" in ready for s in _upstreams("weir-gateway")
        ),
    }
    ready: set[str] = set()
    while True:
        now = {d for d in ROLES if needs[d](ready)}
        if now == ready:
            break
        ready = now
    assert ready == set(ROLES), f"never ready (waiting on each other): {set(ROLES) - ready}"


# ------------------------------------------------------------------ network policy


PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}
STRANGER = {"app.kubernetes.io/name": "something-else"}


def _admits(source: dict, same_namespace: bool, deployment: str, port_name: str) -> bool:
    """Whether the NetworkPolicies admit a pod labelled ``source`` to ``port_name``."""
    labels = _pod_labels(deployment)
    policies = [
        d
        for d in _documents()
        if d["kind"] == "NetworkPolicy" and _selects(d["spec"]["podSelector"], labels)
    ]
    if not policies:
        return True
    port = next(p for p in _container(deployment)["ports"] if p["name"] == port_name)

    def peer_matches(peer: dict) -> bool:
        if "ipBlock" in peer:
            return False
        if "namespaceSelector" not in peer and not same_namespace:
            return False
        return _selects(peer.get("podSelector", {}), source)

    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(p["port"] in (port_name, port["containerPort"]) for p in ports):
                continue
            if "from" not in rule or any(peer_matches(peer) for peer in rule["from"]):
                return True
    return False


def test_network_policy_admits_only_the_connections_the_roles_make() -> None:
    gateway, executor = _pod_labels("weir-gateway"), _pod_labels("weir-executor")
    # What the processes need.
    assert _admits(gateway, True, "weir-scheduler", "clients")
    assert _admits(executor, True, "weir-scheduler", "executors")
    for deployment, port in (
        ("weir-scheduler", "metrics"),
        ("weir-executor", "metrics"),
        ("weir-gateway", "http"),
    ):
        assert _admits(PROMETHEUS, False, deployment, port), (deployment, port)
    assert _admits(STRANGER, False, "weir-gateway", "http")  # the API, behind its key
    # Nobody else reaches the engine.
    for source, same in ((STRANGER, True), (STRANGER, False), (PROMETHEUS, False)):
        for port in ("clients", "executors"):
            assert not _admits(source, same, "weir-scheduler", port), (source, port)
    assert not _admits(gateway, True, "weir-scheduler", "executors")
    assert not _admits(executor, True, "weir-scheduler", "clients")
    assert not _admits(STRANGER, True, "weir-executor", "metrics")


def test_the_scheduler_pod_is_given_time_to_drain() -> None:
    pod = _by_kind_name("Deployment", "weir-scheduler")["spec"]["template"]["spec"]
    args = build_parser().parse_args(_container("weir-scheduler")["args"])
    # Kubernetes SIGKILLs after the grace period: the drain must end well inside it.
    assert pod["terminationGracePeriodSeconds"] >= args.drain_timeout + 10
    # An executor stopped with it (a node drain) serves until the drain ends.
    executor = _by_kind_name("Deployment", "weir-executor")["spec"]["template"]["spec"]
    assert executor["terminationGracePeriodSeconds"] >= pod["terminationGracePeriodSeconds"]


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
    assert {item["path"] for item in volume["secret"]["items"]} == set(FILES_NEEDED[role])
    assert build_parser().parse_args(container["args"]).keys_dir == mount["mountPath"]


# ------------------------------------------------------------------ image


def _requirement_name(requirement: str) -> str:
    """PEP 503 normalized project name of a requirement such as ``"jinja2>=3.1"``."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group()).lower()


def _dockerfile_pip_installs() -> list[str]:
    """Every argument of every ``pip install`` the Dockerfile's RUN lines run, as the shell
    passes it (quotes removed, options dropped)."""
    text = re.sub(r"\\\n", " ", (K8S / "Dockerfile").read_text())
    installed = []
    for line in text.splitlines():
        if not line.startswith("RUN "):
            continue
        for command in re.split(r"&&|;", line.removeprefix("RUN ")):
            words = shlex.split(command)
            pip = [i for i, w in enumerate(words[:-1]) if re.fullmatch(r"(.*/)?pip3?", w)]
            if pip and words[pip[0] + 1] == "install":
                installed += [w for w in words[pip[0] + 2 :] if not w.startswith("-")]
    return installed


def test_the_image_installs_every_runtime_dependency_as_pinned() -> None:
    """The image installs the package with --no-deps (pip must not replace the base image's
    CUDA torch), so every other runtime dependency must be named, with pyproject's own
    version, in the Dockerfile: a missing one (uvicorn) killed the gateway at import."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {
        _requirement_name(r): r.replace(" ", "")
        for r in project["dependencies"]
        if _requirement_name(r) != "torch"
    }
    installed = _dockerfile_pip_installs()
    assert "." in installed, "the image must install Weir itself"
    named = {_requirement_name(r): r for r in installed if r != "."}
    missing = sorted(set(wanted) - set(named))
    assert not missing, f"k8s/Dockerfile does not install {missing}"
    drifted = {n: (named[n], r) for n, r in wanted.items() if named[n] != r}
    assert not drifted, f"k8s/Dockerfile pins differ from pyproject.toml: {drifted}"
    assert "torch" not in named, "the base image provides torch (a CUDA build)"


def test_the_pod_monitor_carries_the_label_kube_prometheus_stack_selects() -> None:
    """kube-prometheus-stack's Prometheus (podMonitorSelectorNilUsesHelmValues: true, the
    default) selects only PodMonitors labelled ``release: <its Helm release>``."""
    monitor = _by_kind_name("PodMonitor", "weir")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def _unshare_pid_namespace() -> list[str] | None:
    """The command that runs a command as PID 1 of a new PID namespace (as a container
    runtime does), or None where this machine cannot."""
    command = ["unshare", "--pid", "--fork", "--mount-proc"]
    try:
        ok = subprocess.run([*command, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return command if ok else None


def test_sigterm_stops_a_starting_pod_under_the_image_entrypoint(tmp_path) -> None:
    """The image's entrypoint as its pod's PID 1: an executor waiting for its
    tensor-parallel group (SIGTERM left to its default action there, the wait being in C)
    must stop on SIGTERM at once, not hold the pod's deletion for its grace period. The
    kernel ignores such a signal for a namespace's PID 1, hence the image's init."""
    unshare = _unshare_pid_namespace()
    if unshare is None:
        pytest.skip("no PID namespace can be made here (unshare)")
    entrypoint = json.loads(
        re.search(r"^ENTRYPOINT (\[.*\])$", (K8S / "Dockerfile").read_text(), re.M).group(1)
    )
    bin_dir = Path(sys.executable).parent
    argv = [str(bin_dir / w) if (bin_dir / w).exists() else w for w in entrypoint]
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    executor = [
        *("executor", "--scheduler", "tcp://127.0.0.1:9", "--tensor-parallel-size", "3"),
        *("--rank", "0", "--device", "cpu", "--threads", "1", "--kv-cache-memory", "8MiB"),
        *("--metrics-port", "0"),
    ]
    log = open(tmp_path / "pod.log", "wb")
    pod = subprocess.Popen([*unshare, *argv, *executor], env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 120
        while True:  # rank 0 listens for the group's other rank: it waits in C now
            assert pod.poll() is None, (tmp_path / "pod.log").read_text()
            assert time.monotonic() < deadline, "the executor never began to wait for its group"
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        [pid1] = psutil.Process(pod.pid).children()
        os.kill(pid1.pid, signal.SIGTERM)
        try:
            pod.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{entrypoint} as PID 1 was still running 15 s after SIGTERM")
    finally:
        for process in (
            psutil.Process(pod.pid).children(recursive=True) if pod.poll() is None else []
        ):
            process.kill()
        pod.kill()
        pod.wait()
        log.close()
