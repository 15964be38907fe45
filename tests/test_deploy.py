"""deploy/: the Kubernetes base and overlays render (a small kustomize for the features they use)
and validate strictly against bundled Kubernetes schemas, offline; their cross-references hold;
every command in Kubernetes, compose and systemd parses with the real daemon/router parsers."""

from __future__ import annotations

import configparser
import copy
import json
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvtransfer.router.__main__ import _parser as router_parser
from kvtransfer.serve.settings import build_parser

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
K8S_VERSION = "1.37.0"
LEASE_FIELD = "kv_lease_s"


# -- a small kustomize: resources, replicas, images, JSON 6902 patches ----------------------


def render(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for replicas in kustomization.get("replicas", []):
        (obj,) = [
            o
            for o in objects
            if o["metadata"]["name"] == replicas["name"] and "spec" in o and "replicas" in o["spec"]
        ]
        obj["spec"]["replicas"] = replicas["count"]
    for image in kustomization.get("images", []):
        for obj in objects:
            for container in _containers(obj):
                name, _, _ = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{name}:{image['newTag']}"
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        matches = [
            o
            for o in objects
            if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]
        ]
        assert len(matches) == 1, f"patch target {target} matches {len(matches)} objects"
        for op in yaml.safe_load(patch["patch"]):
            _apply(matches[0], op)
    return objects


def _containers(obj: dict) -> list[dict]:
    return obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])


def _apply(obj: dict, op: dict) -> None:
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    node = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    value = copy.deepcopy(op.get("value"))
    if op["op"] == "add" and isinstance(node, list):
        node.insert(len(node) if last == "-" else int(last), value)
    elif op["op"] in ("add", "replace"):
        if op["op"] == "replace":
            assert (int(last) < len(node)) if isinstance(node, list) else last in node, op
        node[int(last) if isinstance(node, list) else last] = value
    else:
        raise AssertionError(f"unsupported patch op {op['op']}")


KUSTOMIZATIONS = ["base", "overlays/xpyd", "overlays/gpu"]


@pytest.fixture(params=KUSTOMIZATIONS)
def rendered(request) -> list[dict]:
    return render(DEPLOY / "k8s" / request.param)


def test_every_object_validates_strictly(rendered):
    for obj in rendered:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _by(rendered, kind):
    return {o["metadata"]["name"]: o for o in rendered if o["kind"] == kind}


def _workloads(rendered):
    return [o for o in rendered if o["kind"] in ("StatefulSet", "Deployment")]


def test_services_select_pods_and_ports_exist(rendered):
    for service in _by(rendered, "Service").values():
        selector = service["spec"]["selector"]
        targets = [
            w
            for w in _workloads(rendered)
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert targets, f"service {service['metadata']['name']} selects no pod"
        ports = {p["name"] for w in targets for c in _containers(w) for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    for workload in _workloads(rendered):
        assert workload["spec"]["selector"]["matchLabels"].items() <= (
            workload["spec"]["template"]["metadata"]["labels"].items()
        )


def _daemon_flags(container: dict) -> list[str]:
    """The daemon's argv after its command, with the shell substitutions given sample values."""
    script = container["args"][0]
    script = script.replace('"$POD_NAME"', "pod-0")
    script = script.replace('"$(sed "s/__POD_IP__/$POD_IP/" /etc/kvtransfer/prefill.json)"', "{}")
    script = script.replace('"$(sed "s/__POD_IP__/$POD_IP/" /etc/kvtransfer/decode.json)"', "{}")
    words = shlex.split(script)
    assert words[0] == "exec"
    return words[2:]


def test_daemon_commands_parse_and_probes_metrics_and_grace_agree(rendered):
    config = _by(rendered, "ConfigMap")["kvtransfer-config"]["data"]
    secrets = _by(rendered, "Secret")
    for role in ("prefill", "decode"):
        workload = _by(rendered, "StatefulSet")[f"kvtransfer-{role}"]
        pod = workload["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        args = build_parser(role).parse_args(_daemon_flags(container))
        assert f"/etc/kvtransfer/{role}.json" in container["args"][0]
        grpc_port = {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"]
        assert args.port == grpc_port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == grpc_port
        annotations = pod["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == args.metrics_port
        kv = json.loads(config[f"{role}.json"])
        assert kv["kv_connector"] == "UcxConnector"
        assert kv["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        lease = kv.get("kv_connector_extra_config", {}).get(LEASE_FIELD, 30)
        assert pod["spec"]["terminationGracePeriodSeconds"] > lease
        if role == "prefill":
            assert kv["kv_ip"] == "__POD_IP__"
            assert kv["kv_port"] in [p["containerPort"] for p in container["ports"]]
        for env in container["env"]:
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secrets[ref["name"]]["stringData"]


def test_router_lists_existing_daemon_pods(rendered):
    (router,) = _containers(_by(rendered, "Deployment")["kvtransfer-router"])
    args = router_parser().parse_args(router["args"])
    sets = _by(rendered, "StatefulSet")
    for role, addresses in (("prefill", args.prefill), ("decode", args.decode)):
        workload = sets[f"kvtransfer-{role}"]
        service = workload["spec"]["serviceName"]
        port = _by(rendered, "Service")[service]["spec"]["ports"][0]["port"]
        expected = {
            f"kvtransfer-{role}-{i}.{service}:{port}" for i in range(workload["spec"]["replicas"])
        }
        assert set(addresses) == expected
        assert (
            _by(rendered, "Service")[workload["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
        )


def test_gpu_overlay_asks_for_gpus():
    sets = _by(render(DEPLOY / "k8s" / "overlays" / "gpu"), "StatefulSet")
    for workload in sets.values():
        (container,) = _containers(workload)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["KVTRANSFER_DEVICE"] == "cuda" and "cuda_ipc" in env["UCX_TLS"]
        assert container["image"] == "kvtransfer:cuda"


def test_compose_commands_parse():
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yaml").read_text())
    services = compose["services"]
    for role in ("prefill", "decode"):
        command = services[role]["command"]
        assert command[0] == f"kvtransfer-{role}"
        build_parser(role).parse_args(command[1:])
    router = services["router"]["command"]
    args = router_parser().parse_args(router[1:])
    ports = {
        build_parser(r).parse_args(services[r]["command"][1:]).port for r in ("prefill", "decode")
    }
    assert {int(a.rsplit(":", 1)[1]) for a in args.prefill + args.decode} == ports


def test_systemd_units_parse():
    for role in ("prefill", "decode", "router"):
        unit = configparser.ConfigParser(strict=False, interpolation=None)
        unit.read(DEPLOY / "systemd" / f"kvtransfer-{role}.service")
        service = unit["Service"]
        assert service["KillSignal"] == "SIGTERM"
        assert int(service["TimeoutStopSec"]) > 30
        assert service["EnvironmentFile"] == "/etc/kvtransfer/kvtransfer.env"
        words = shlex.split(service["ExecStart"])
        assert words[0].endswith(f"kvtransfer-{role}")
        if role == "router":
            router_parser().parse_args(words[1:])
        else:
            build_parser(role).parse_args(words[1:])
    env = (DEPLOY / "systemd" / "kvtransfer.env").read_text()
    line = next(x for x in env.splitlines() if x.startswith("KVTRANSFER_KV_TRANSFER_CONFIG="))
    assert json.loads(shlex.split(line.split("=", 1)[1])[0])["kv_port"] == 50052


def test_dockerfile_pins_the_cpu_torch_and_drops_root():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert 'ARG TORCH_SPEC="torch==2.13.0' in text
    assert "USER 10001" in text
