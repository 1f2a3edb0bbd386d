"""The tensor-parallel Kubernetes overlays agree with the CLI and with the base stack: every
rank's command parses, ranks and group size line up and split the default model, the
rendezvous address is stable, every rank's metrics are scraped."""

import copy
import json
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from weir.services.cli import build_parser
from weir.services.launcher import resolve_num_executors
from weir.shared.config import EngineArgs
from weir.shared.model_config import ModelConfig
from weir.shared.shard_layout import ShardLayout

K8S = Path(__file__).resolve().parent.parent / "k8s-overlays"
OVERLAYS = ("tensor-parallel", "tensor-parallel-multinode")
BASE = "../../k8s"  # kustomize refuses an overlay inside its base's directory


def _kustomization(overlay: str) -> dict:
    return yaml.safe_load((K8S / overlay / "kustomization.yaml").read_text())


def _resources(overlay: str) -> list[dict]:
    docs = []
    for resource in _kustomization(overlay)["resources"]:
        path = K8S / overlay / resource
        if resource == BASE:
            base = yaml.safe_load((path / "kustomization.yaml").read_text())["resources"]
            paths = [path / r for r in base]
        else:
            paths = [path]
        for p in paths:
            docs += [d for d in yaml.safe_load_all(p.read_text()) if d]
    return docs


def _patches(overlay: str) -> list[tuple[dict | None, object]]:
    return [
        (p.get("target"), yaml.safe_load(p["patch"])) for p in _kustomization(overlay)["patches"]
    ]


def _base_container(name: str) -> dict:
    doc = next(d for d in _resources(OVERLAYS[0]) if d["metadata"]["name"] == name)
    return doc["spec"]["template"]["spec"]["containers"][0]


def _scheduler_args(overlay: str) -> list[str]:
    [ops] = [
        ops
        for target, ops in _patches(overlay)
        if target == {"kind": "Deployment", "name": "weir-scheduler"}
    ]
    [op] = ops
    assert op["path"] == "/spec/template/spec/containers/0/args"
    return op["value"]


def _added(overlay: str, kind: str) -> dict:
    added = [
        d
        for r in _kustomization(overlay)["resources"]
        if r != "../../k8s"
        for d in yaml.safe_load_all((K8S / overlay / r).read_text())
    ]
    return next(d for d in added if d["kind"] == kind)


def _json_patch(doc: dict, op: dict) -> None:
    """Apply one RFC 6902 ``add`` or ``replace`` operation, as kustomize does."""
    *parents, last = [k.replace("~1", "/").replace("~0", "~") for k in op["path"].split("/")[1:]]
    node = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        if op["op"] == "add":
            node.insert(len(node) if last == "-" else int(last), op["value"])
        else:
            assert op["op"] == "replace", op
            node[int(last)] = op["value"]
    else:
        assert op["op"] in ("add", "replace") and (op["op"] == "add" or last in node), op
        node[last] = op["value"]


def _built(overlay: str) -> list[dict]:
    """The overlay's objects: the base and its own resources, with its patches applied
    (deletions and JSON patches, the only kinds the overlays use)."""
    docs = copy.deepcopy(_resources(overlay))
    for target, patch in _patches(overlay):
        if isinstance(patch, dict) and patch.get("$patch") == "delete":
            gone = (patch["kind"], patch["metadata"]["name"])
            docs = [d for d in docs if (d["kind"], d["metadata"]["name"]) != gone]
            continue
        assert target is not None and isinstance(patch, list), (target, patch)
        [doc] = [
            d
            for d in docs
            if (d["kind"], d["metadata"]["name"]) == (target["kind"], target["name"])
        ]
        for op in patch:
            _json_patch(doc, op)
    return docs


def _executor_commands(overlay: str) -> list[list[str]]:
    """Every rank's command line (without the leading ``weir``)."""
    if overlay == "tensor-parallel":
        [container] = _added(overlay, "Deployment")["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        return [argv[1:] for argv in _rank_commands(container["args"][0], env)]
    sts = _added(overlay, "StatefulSet")
    [container] = sts["spec"]["template"]["spec"]["containers"]
    return [container["args"]] * sts["spec"]["replicas"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_group_size_splits_the_default_model(overlay, default_model_dir):
    """The overlays name no model, so they serve the bundled default one; a group size its
    heads do not split makes every rank fail at start (SmolLM2-135M: 9 query and 3 KV
    heads, so 3 ranks and not 2)."""
    scheduler = build_parser().parse_args(_scheduler_args(overlay))
    executors = [build_parser().parse_args(argv) for argv in _executor_commands(overlay)]
    size = scheduler.tensor_parallel_size
    assert len(executors) == size
    assert {e.tensor_parallel_size for e in executors} == {size}
    assert scheduler.model is None and all(e.model is None for e in executors), (
        "an overlay naming a model must check its heads against that model"
    )
    hf = json.loads((default_model_dir / "config.json").read_text())
    heads, kv = (
        hf["num_attention_heads"],
        hf.get("num_key_value_heads") or hf["num_attention_heads"],
    )
    assert heads % size == 0, f"{overlay}: {size} ranks do not divide {heads} attention heads"
    assert (kv % size if kv >= size else size % kv) == 0, (
        f"{overlay}: {size} ranks do not split {kv} KV heads"
    )
    # The executor's own check (MLP columns included) passes for every rank.
    cfg = ModelConfig.from_hf(hf)
    for rank in range(size):
        ShardLayout.of(cfg, rank, size)


PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_metrics_port_is_scraped_and_admitted_to_prometheus(overlay):
    """Each rank serves its own /metrics: every port named metrics* must be a PodMonitor
    endpoint and open to Prometheus pods (any namespace) under the NetworkPolicies."""
    docs = _built(overlay)
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    checked = 0
    for workload in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        for container in workload["spec"]["template"]["spec"]["containers"]:
            for port in container.get("ports", []):
                if not port["name"].startswith("metrics"):
                    continue
                checked += 1
                where = (workload["metadata"]["name"], port["name"])
                scraped = {
                    e["port"]
                    for m in monitors
                    if _selects(m["spec"]["selector"], labels)
                    for e in m["spec"]["podMetricsEndpoints"]
                }
                assert port["name"] in scraped, f"{where}: not scraped"
                admitted = any(
                    any(
                        "namespaceSelector" in peer
                        and _selects(peer.get("podSelector", {}), PROMETHEUS)
                        for peer in rule.get("from", [{"namespaceSelector": {}}])
                    )
                    and (
                        "ports" not in rule
                        or any(
                            p["port"] in (port["name"], port["containerPort"])
                            for p in rule["ports"]
                        )
                    )
                    for policy in policies
                    if _selects(policy["spec"]["podSelector"], labels)
                    for rule in policy["spec"].get("ingress", [])
                )
                assert admitted, f"{where}: the NetworkPolicies keep Prometheus out"
    assert checked >= 2  # the scheduler's and at least one rank's


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_replaces_the_one_gpu_executor_and_sizes_the_scheduler_for_the_group(overlay):
    deletions = [
        p for _, p in _patches(overlay) if isinstance(p, dict) and p.get("$patch") == "delete"
    ]
    assert [(d["kind"], d["metadata"]["name"]) for d in deletions] == [
        ("Deployment", "weir-executor")
    ]
    args = _scheduler_args(overlay)
    parsed = build_parser().parse_args(args)
    assert parsed.command == "scheduler"
    # Everything else is the base scheduler's command.
    base = _base_container("weir-scheduler")["args"]
    i = base.index("--num-executors")
    assert base[:i] + base[i + 2 :] == [
        a for a in args if a not in ("--tensor-parallel-size", str(parsed.tensor_parallel_size))
    ]
    assert (
        resolve_num_executors(parsed.num_executors, EngineArgs.from_cli(parsed))
        == parsed.tensor_parallel_size
        > 1
    )


def _rank_commands(script: str, env: dict[str, str]) -> list[list[str]]:
    """The `weir executor` command lines the pod's script starts, expanded by bash for each rank."""
    [line] = [ln.strip() for ln in script.splitlines() if ln.strip().startswith("weir executor")]
    command = line.removesuffix("&").strip()
    commands = []
    for rank in range(int(env["TP"])):
        expand = f"rank={rank}; set -- {command}; printf '%s\\n' \"$@\""
        out = subprocess.run(
            ["bash", "-c", expand], env=env, capture_output=True, text=True, check=True
        )
        commands.append(out.stdout.split("\n")[:-1])
    return commands


def test_multi_gpu_pod_runs_one_rank_per_gpu_that_meet_on_loopback():
    deployment = _added("tensor-parallel", "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    size = int(env["TP"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == size
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"].isdigit()
    scheduler = build_parser().parse_args(_scheduler_args("tensor-parallel"))
    assert scheduler.tensor_parallel_size == size
    ports = {p["containerPort"] for p in container["ports"]}
    commands = _rank_commands(container["args"][0], env)
    for rank, argv in enumerate(commands):
        assert argv[0] == "weir"
        args = build_parser().parse_args(argv[1:])
        assert (args.command, args.rank, args.tensor_parallel_size) == ("executor", rank, size)
        assert urlparse(args.scheduler).port == urlparse(scheduler.executor_address).port
        assert args.metrics_port in ports
    assert "wait -n" in container["args"][0], "a rank that exits must end the pod"
    _check_shm(pod, container)


def test_multi_node_ranks_are_stateful_set_pods_meeting_at_pod_0():
    service = _added("tensor-parallel-multinode", "Service")
    sts = _added("tensor-parallel-multinode", "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "executor" and args.rank is None  # from $RANK
    scheduler = build_parser().parse_args(_scheduler_args("tensor-parallel-multinode"))
    assert sts["spec"]["replicas"] == args.tensor_parallel_size == scheduler.tensor_parallel_size
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e for e in container["env"]}
    assert env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    # Rank 0's stable DNS name: <statefulset>-0.<headless service>.
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert (
        env["MASTER_ADDR"]["value"] == f"{sts['metadata']['name']}-0.{service['metadata']['name']}"
    )
    assert (
        service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    )
    port = int(env["MASTER_PORT"]["value"])
    assert port in {p["port"] for p in service["spec"]["ports"]}
    assert port in {p["containerPort"] for p in container["ports"]}
    _check_shm(pod, container)


def _check_shm(pod: dict, container: dict) -> None:
    """/dev/shm is a memory volume large enough for NCCL (the container default is 64 MiB)."""
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    size = volume["emptyDir"]["sizeLimit"]
    assert size.endswith("Gi") and int(size[:-2]) >= 1
    # A memory volume counts against the container's memory limit.
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(limit[:-2]) > int(size[:-2])


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds_into_one_namespace_without_the_base_executor(overlay):
    built = subprocess.run(
        ["kubectl", "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60
    )
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Deployment", "weir-executor") not in names
    assert ("Deployment", "weir-scheduler") in names
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"weir"}
    # kustomize builds what the tests above read from the sources (but for its image names).
    ours = {(d["kind"], d["metadata"]["name"]): d for d in _built(overlay)}
    assert set(ours) <= names
    for doc in docs:
        key = (doc["kind"], doc["metadata"]["name"])
        if key in ours:
            assert _without_images(doc) == _without_images(ours[key]), key


def _without_images(doc: dict) -> dict | None:
    spec = copy.deepcopy(doc.get("spec"))
    for container in (spec or {}).get("template", {}).get("spec", {}).get("containers", []):
        container.pop("image", None)
    return spec


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_executor_pod_serves_through_the_schedulers_drain(overlay):
    """A node drain stops the executors' pods with the scheduler's: each serves until the
    scheduler has drained, which its grace period (Kubernetes' default: 30 s) must allow."""
    grace: dict[str, list[int]] = {}
    for d in _built(overlay):
        if d["kind"] in ("Deployment", "StatefulSet"):
            component = d["metadata"]["labels"]["app.kubernetes.io/component"]
            seconds = d["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
            grace.setdefault(component, []).append(seconds)
    assert grace["executor"] and min(grace["executor"]) >= max(grace["scheduler"])
