"""deploy/ against the daemons' contract, offline.

Kubernetes: the Kustomize base and overlays are rendered without a kustomize binary
(deploy_helpers.kustomize), every object is validated against the bundled Kubernetes schemas in
strict mode, and the objects are cross-checked (selectors, ports, probes, references, the
kv_transfer_config each daemon really receives). Compose, systemd and the Dockerfile are checked
against the same flag contract. Where the real daemon and router parsers can be imported, the
rendered command lines are also fed to them, and the router's view of the fleet is checked
against the daemons': its dns:NAME:PORT targets name headless Services (compose services) that
reach every daemon of the role on the port it serves, its cache_aware role's KV event ports,
block size and tokenizer are what those daemons publish and load, its tokens come from the
Secret. deploy/k8s/vllm (vLLM servers behind the router's --engine vllm) is checked the same
way against the servers' vLLM flags, with the router's and our adapter's parsers.
"""

from __future__ import annotations

import configparser
import json
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_helpers.kustomize import pod_containers, pod_spec, render, resource_id, split_image

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILE = DEPLOY / "compose" / "docker-compose.yaml"
SYSTEMD = DEPLOY / "systemd"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"

# The newest Kubernetes version whose schemas kubernetes-validate bundles (1.37.0 ships with
# kubernetes-validate 1.37.0, the floor tests rely on).
K8S_VERSION = "1.37.0"
KUSTOMIZATIONS = ["base", "overlays/xpyd", "overlays/gpu"]
# vLLM servers behind the router (`--engine vllm`): a base of its own, checked by its own tests
# below and by the generic ones (schemas, kubectl, Services, references).
VLLM = "vllm"
ALL_KUSTOMIZATIONS = [*KUSTOMIZATIONS, VLLM]

# The daemons' and the router's flags, per the deployment contract.
DAEMON_FLAGS = {
    "--model",
    "--host",
    "--port",
    "--tp",
    "--pp",
    "--speculative",
    "--kv-transfer-config",
    "--engine-id",
    "--metrics-port",
    "--config",
    "--tls-cert",
    "--tls-key",
    "--tls-ca",
    "--admin-token",
    "--block-size",
    "--kv-events-endpoint",
    "--kv-events-replay-endpoint",
}
ROUTER_FLAGS = {
    "--prefill",
    "--decode",
    "--host",
    "--port",
    "--model-name",
    "--request-timeout-s",
    "--tls-ca",
    "--tls-cert",
    "--tls-key",
    "--policy",
    "--prefill-policy",
    "--decode-policy",
    "--dns-interval-s",
    "--tokenizer",
    "--kv-block-size",
    "--kv-events-port",
    "--kv-events-replay-port",
    "--engine",
}
REPEATABLE_FLAGS = {"--prefill", "--decode"}
# KVTRANSFER_<SETTING> variables the manifests may set: every flag, plus `device` (cpu|cuda,
# kvtransfer/serve/settings.py) for the GPU overlay.
DAEMON_ENV_SETTINGS = {flag[2:].replace("-", "_") for flag in DAEMON_FLAGS} | {"device"}
# The router's only variables (kvtransfer/router/__main__.py): its admin API's token and the
# daemons' token it reads their load with.
ROUTER_ADMIN_TOKEN_ENV = "KVTRANSFER_ROUTER_ADMIN_TOKEN"
ROUTER_ENV = {ROUTER_ADMIN_TOKEN_ENV, "KVTRANSFER_ADMIN_TOKEN"}
ROLES = ("prefill", "decode")
BINARIES = {
    "kvtransfer-prefill": "prefill",
    "kvtransfer-decode": "decode",
    "kvtransfer-router": "router",
}
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
DEFAULT_LEASE_S = 30
FAKE_POD_IP = "10.244.7.9"
# A compose container: its hostname (the container id) and the address /etc/hosts gives it.
FAKE_CONTAINER_HOSTNAME = "c0ffee5eed01"
FAKE_CONTAINER_IP = "172.18.0.7"
# What the operator's shell gives compose's ${VAR} interpolations.
COMPOSE_SHELL_ENV = {
    "KVTRANSFER_ADMIN_TOKEN": "sample-admin-token",
    "KVTRANSFER_ROUTER_ADMIN_TOKEN": "sample-router-token",
}


# ---------------------------------------------------------------------- shared helpers


@dataclass
class Invocation:
    """What a daemon or the router is started with: binary role, argv after it, environment."""

    where: str
    role: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def flags(self) -> dict[str, list[str]]:
        allowed = ROUTER_FLAGS if self.role == "router" else DAEMON_FLAGS
        return parse_flags(self.argv, allowed, self.where)

    def flag(self, name: str) -> str | None:
        values = self.flags.get(name)
        return values[-1] if values else None

    def kv_transfer_config(self) -> dict[str, Any]:
        """The JSON the daemon ends up with: --kv-transfer-config, or its KVTRANSFER_ variable
        (exactly one of them, so there is no precedence to get wrong)."""
        flag = self.flag("--kv-transfer-config")
        env = self.env.get("KVTRANSFER_KV_TRANSFER_CONFIG")
        assert (flag is None) != (env is None), f"{self.where}: kv_transfer_config set 0 or 2 ways"
        config = json.loads(flag if flag is not None else env)
        assert isinstance(config, dict), self.where
        return config


def parse_flags(argv: list[str], allowed: set[str], where: str) -> dict[str, list[str]]:
    flags: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        assert token.startswith("--"), f"{where}: unexpected argument {token!r} in {argv}"
        name, eq, value = token.partition("=")
        if eq:
            i += 1
        else:
            assert i + 1 < len(argv) and not argv[i + 1].startswith("--"), (
                f"{where}: {name} has no value"
            )
            value = argv[i + 1]
            i += 2
        assert name in allowed, f"{where}: {name} is not a flag the contract accepts"
        flags.setdefault(name, []).append(value)
    for name, values in flags.items():
        assert len(values) == 1 or name in REPEATABLE_FLAGS, f"{where}: {name} given twice"
    return flags


def check_env_names(inv: Invocation, *, shared: bool = False) -> None:
    """KVTRANSFER_* variables must mean something to the program they are given to (``shared``:
    one environment file for the daemons and the router, so either's names)."""
    for name in inv.env:
        if not name.startswith("KVTRANSFER_"):
            continue
        setting = name.removeprefix("KVTRANSFER_").lower()
        if shared:
            assert name in ROUTER_ENV or setting in DAEMON_ENV_SETTINGS, f"{inv.where}: {name}"
        elif inv.role == "router":
            assert name in ROUTER_ENV, f"{inv.where}: the router does not read {name}"
        else:
            assert setting in DAEMON_ENV_SETTINGS, f"{inv.where}: {name} is no daemon setting"


def lease_s(config: dict[str, Any]) -> float:
    return config.get("kv_connector_extra_config", {}).get("kv_lease_s", DEFAULT_LEASE_S)


def check_kv_config(inv: Invocation) -> dict[str, Any]:
    config = inv.kv_transfer_config()
    assert config["kv_connector"] == "UcxConnector", inv.where
    assert config["kv_role"] == KV_ROLES[inv.role], inv.where
    extra = config.get("kv_connector_extra_config", {})
    assert lease_s(config) > 0, inv.where
    assert set(extra) <= {
        "kv_lease_s",
        "transfer_timeout_s",
        "handshake_timeout_s",
        "max_concurrent_loads",
        # TLS on kv_port (newer UcxConnector versions).
        "tls_cert_file",
        "tls_key_file",
        "tls_ca_file",
        "tls_server_name",
    }, inv.where
    if inv.role == "prefill":
        assert config.get("kv_ip"), f"{inv.where}: a producer must say where it serves"
        assert config.get("kv_ip") not in ("0.0.0.0", "::"), (
            f"{inv.where}: kv_ip is also the address decode daemons dial"
        )
        assert isinstance(config.get("kv_port"), int) and config["kv_port"] > 0, inv.where
    return config


def router_config(inv: Invocation):
    """The `RouterConfig` the real router builds from this command line and environment."""
    from kvtransfer.router.__main__ import _parser, config_from_args

    assert inv.role == "router", inv.where
    try:
        return config_from_args(_parser().parse_args(inv.argv), environ=inv.env)
    except ValueError as exc:
        pytest.fail(f"{inv.where}: the router refuses its configuration: {exc}")


def daemon_settings(inv: Invocation):
    """The `DaemonSettings` the real daemon builds from its flags and KVTRANSFER_* variables."""
    from kvtransfer.serve.settings import load_settings

    assert inv.role in ROLES, inv.where
    environ = {k: v for k, v in inv.env.items() if k.startswith("KVTRANSFER_")}
    return load_settings(inv.role, inv.argv, environ=environ)


def zmq_tcp_port(endpoint: str, where: str) -> int:
    """The port of a ``tcp://HOST:PORT`` endpoint a daemon binds; HOST must take every
    interface, since the router dials the instance's own address (a pod or container IP)."""
    match = re.fullmatch(r"tcp://(?P<host>[^:/]+):(?P<port>[0-9]+)", endpoint)
    assert match, f"{where}: {endpoint} is not tcp://HOST:PORT"
    assert match["host"] in ("*", "0.0.0.0"), (
        f"{where}: {endpoint} is not reachable from the router"
    )
    return int(match["port"])


def check_router_follows_daemons(
    router: Invocation, daemons: list[Invocation], declared_ports=None
) -> Any:
    """What the router needs from the daemons it routes to, read with the real parsers.

    A cache_aware role's instances publish KV events on the port the router subscribes to (and
    replay on its replay port), in blocks of the router's --kv-block-size, and the router
    tokenizes with the daemons' model. The router reads their load with their admin token.
    ``declared_ports(inv) -> {name: port}``: where a daemon's ports must also be declared
    (Kubernetes containerPorts, named ``kv-events`` and ``kv-replay``). Returns the router's
    `RouterConfig`."""
    from kvtransfer.connectors.ucx.config import UcxConfig

    config = router_config(router)
    settings = {id(inv): daemon_settings(inv) for inv in daemons}
    models = {s.model for s in settings.values()}
    assert len(models) == 1, f"{router.where}: the daemons load different models {models}"
    if config.tokenizer is not None:
        assert config.tokenizer == models.pop(), f"{router.where}: --tokenizer != --model"
    admin_tokens = {s.admin_token for s in settings.values()}
    if admin_tokens - {None}:
        # Otherwise GetStatus is refused: the policies see this router's own count only.
        assert admin_tokens == {config.daemon_admin_token}, f"{router.where}: daemons' token"
    for inv in daemons:
        daemon = settings[id(inv)]
        binds = [daemon.port, daemon.metrics_port]
        if inv.role == "prefill":
            binds.append(UcxConfig.from_transfer_config(daemon.transfer_config()).port)
        if config.policy_for(inv.role) == "cache_aware":
            # Without token ids (a text prompt, no tokenizer) cache_aware has nothing to look up.
            assert config.tokenizer is not None, f"{router.where}: cache_aware needs --tokenizer"
            assert daemon.block_size == config.kv_block_size, f"{inv.where}: block size"
            assert config.kv_events_port is not None, f"{router.where}: no --kv-events-port"
            assert daemon.kv_events_endpoint, f"{inv.where}: publishes no KV events"
            events = zmq_tcp_port(daemon.kv_events_endpoint, inv.where)
            assert events == config.kv_events_port, f"{inv.where}: KV events port"
            binds.append(events)
            wanted = {"kv-events": events}
            replay = daemon.kv_events_replay_endpoint
            assert (replay is None) == (config.kv_events_replay_port is None), (
                f"{inv.where}: the router's --kv-events-replay-port and the daemon's replay "
                "endpoint go together (gaps are filled from it)"
            )
            if replay is not None:
                replay_port = zmq_tcp_port(replay, inv.where)
                assert replay_port == config.kv_events_replay_port, f"{inv.where}: replay port"
                binds.append(replay_port)
                wanted["kv-replay"] = replay_port
            if declared_ports is not None:
                declared = declared_ports(inv)
                for name, port in wanted.items():
                    assert declared.get(name) == port, f"{inv.where}: port {name} != {port}"
        bound = [port for port in binds if port]
        assert len(bound) == len(set(bound)), f"{inv.where}: two sockets on one port {bound}"
    return config


# ---------------------------------------------------------------------- Kubernetes


@pytest.fixture(scope="module")
def renders() -> dict[str, list[dict[str, Any]]]:
    return {name: render(K8S / name) for name in ALL_KUSTOMIZATIONS}


@pytest.fixture(scope="module")
def fake_bin(tmp_path_factory) -> Path:
    """Stand-ins for the three binaries: print the argv they were given as JSON."""
    directory = tmp_path_factory.mktemp("bin")
    for binary in BINARIES:
        path = directory / binary
        path.write_text(
            f"#!{sys.executable}\nimport json, os, sys\n"
            "print(json.dumps({'binary': os.path.basename(sys.argv[0]), 'argv': sys.argv[1:]}))\n"
        )
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return directory


def find(objects: list[dict], kind: str, name: str) -> dict | None:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    return None


def workloads(objects: list[dict]) -> list[dict]:
    return [obj for obj in objects if pod_spec(obj) is not None]


def container_ports(container: dict) -> dict[str, int]:
    """name (or str(number)) -> containerPort."""
    ports = {}
    for port in container.get("ports", []):
        ports[str(port["containerPort"])] = port["containerPort"]
        if "name" in port:
            ports[port["name"]] = port["containerPort"]
    return ports


def resolve_env(container: dict, objects: list[dict], where: str) -> dict[str, str]:
    env = {}
    for entry in container.get("env", []):
        name = entry["name"]
        if "value" in entry:
            env[name] = entry["value"]
            continue
        source = entry["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            config_map = find(objects, "ConfigMap", ref["name"])
            assert config_map is not None, f"{where}: no ConfigMap {ref['name']}"
            assert ref["key"] in config_map.get("data", {}), f"{where}: no key {ref['key']}"
            env[name] = config_map["data"][ref["key"]]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            secret = find(objects, "Secret", ref["name"])
            assert secret is not None, f"{where}: no Secret {ref['name']}"
            data = {**secret.get("data", {}), **secret.get("stringData", {})}
            assert ref["key"] in data, f"{where}: Secret {ref['name']} has no key {ref['key']}"
            env[name] = data[ref["key"]]
        elif "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "status.podIP", where
            env[name] = FAKE_POD_IP
        else:
            raise AssertionError(f"{where}: unsupported env source {source}")
    return env


def materialize_mounts(obj: dict, container: dict, objects: list[dict], tmp: Path) -> dict:
    """Write the ConfigMap volumes a container mounts under tmp; mountPath -> local dir."""
    volumes = {volume["name"]: volume for volume in pod_spec(obj).get("volumes", [])}
    mounts = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "configMap" not in volume:
            continue
        config_map = find(objects, "ConfigMap", volume["configMap"]["name"])
        assert config_map is not None, volume
        items = volume["configMap"].get("items") or [
            {"key": key, "path": key} for key in config_map["data"]
        ]
        local = tmp / mount["name"]
        local.mkdir(parents=True, exist_ok=True)
        for item in items:
            assert item["key"] in config_map["data"], f"ConfigMap has no key {item['key']}"
            (local / item["path"]).write_text(config_map["data"][item["key"]])
        mounts[mount["mountPath"]] = local
    return mounts


def k8s_invocation(
    obj: dict, container: dict, objects: list[dict], fake_bin: Path, tmp: Path
) -> Invocation:
    """Run the container's command the way the kubelet would (a `sh -c` script through a real
    shell with fake binaries) and return what the daemon receives."""
    where = f"{obj['kind']}/{obj['metadata']['name']}/{container['name']}"
    env = resolve_env(container, objects, where)
    command = list(container.get("command", []))
    args = list(container.get("args", []))
    for token in (*command, *args):
        # Kubernetes would expand $(VAR) in command/args; only the shell's $(...) may appear.
        for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", token):
            raise AssertionError(f"{where}: Kubernetes would expand $({ref})")
    if command[:2] == ["sh", "-c"]:
        script = command[2]
        assert script.startswith("exec "), f"{where}: the daemon must replace the shell (PID 1)"
        for mount_path, local in materialize_mounts(obj, container, objects, tmp).items():
            script = script.replace(mount_path, str(local))
        run_env = {"PATH": f"{fake_bin}:/usr/bin:/bin", **env}
        result = subprocess.run(
            ["sh", "-c", script, *command[3:], *args],
            env=run_env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        started = json.loads(result.stdout)
        binary, argv = started["binary"], started["argv"]
    else:
        binary, argv = command[0], command[1:] + args
    assert binary in BINARIES, f"{where}: unknown binary {binary}"
    return Invocation(where, BINARIES[binary], argv, env)


def k8s_invocations(objects, fake_bin, tmp) -> list[tuple[dict, dict, Invocation]]:
    found = []
    for index, obj in enumerate(workloads(objects)):
        for container in pod_containers(obj):
            sub = tmp / f"{index}-{container['name']}"
            inv = k8s_invocation(obj, container, objects, fake_bin, sub)
            found.append((obj, container, inv))
    return found


def pod_template_labels(obj: dict) -> dict[str, str]:
    return obj["spec"]["template"]["metadata"].get("labels", {})


def selected_workloads(objects: list[dict], selector: dict[str, str]) -> list[dict]:
    return [
        obj
        for obj in workloads(objects)
        if selector and selector.items() <= pod_template_labels(obj).items()
    ]


@pytest.mark.parametrize("name", ALL_KUSTOMIZATIONS)
def test_k8s_objects_validate_strictly(renders, name):
    objects = renders[name]
    kinds = {"Secret", "Service", "Deployment"} | (
        {"ConfigMap", "StatefulSet"} if name != VLLM else set()
    )
    assert {obj["kind"] for obj in objects} >= kinds
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(part) for part in exc.path)
            pytest.fail(f"{name}: {resource_id(obj)}: {path}: {exc.message}")


def test_k8s_version_is_bundled():
    versions = kubernetes_validate.utils.all_versions()
    assert any(v.startswith(K8S_VERSION.rsplit(".", 1)[0]) for v in versions), versions


def test_emulation_rejects_what_it_does_not_implement(tmp_path):
    from deploy_helpers.kustomize import UnsupportedKustomization

    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamespace: x\n")
    with pytest.raises(UnsupportedKustomization):
        render(tmp_path)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl to compare with")
@pytest.mark.parametrize("name", ALL_KUSTOMIZATIONS)
def test_emulation_matches_kubectl_kustomize(renders, name):
    result = subprocess.run(
        ["kubectl", "kustomize", str(K8S / name)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    expected = {resource_id(o): o for o in yaml.safe_load_all(result.stdout) if o}
    assert {resource_id(o): o for o in renders[name]} == expected


@pytest.mark.parametrize("name", ALL_KUSTOMIZATIONS)
def test_k8s_services_select_pods_and_ports_exist(renders, name):
    objects = renders[name]
    for svc in (obj for obj in objects if obj["kind"] == "Service"):
        where = f"{name}: Service/{svc['metadata']['name']}"
        selected = selected_workloads(objects, svc["spec"].get("selector", {}))
        assert selected, f"{where}: selects no pod template"
        for port in svc["spec"]["ports"]:
            target = str(port.get("targetPort", port["port"]))
            for obj in selected:
                known = {}
                for container in pod_containers(obj):
                    known.update(container_ports(container))
                assert target in known, f"{where}: targetPort {target} not in {obj['kind']}"
    for obj in workloads(objects):
        where = f"{name}: {obj['kind']}/{obj['metadata']['name']}"
        match = obj["spec"]["selector"]["matchLabels"]
        assert match.items() <= pod_template_labels(obj).items(), where
        if obj["kind"] == "StatefulSet":
            svc = find(objects, "Service", obj["spec"]["serviceName"])
            assert svc is not None, f"{where}: its serviceName does not exist"
            assert svc["spec"].get("clusterIP") == "None", f"{where}: needs a headless Service"
            assert obj in selected_workloads(objects, svc["spec"]["selector"]), where


@pytest.mark.parametrize("name", ALL_KUSTOMIZATIONS)
def test_k8s_references_exist(renders, name):
    objects = renders[name]
    for obj in workloads(objects):
        where = f"{name}: {obj['kind']}/{obj['metadata']['name']}"
        for container in pod_containers(obj):
            resolve_env(container, objects, where)  # asserts every *KeyRef resolves
            volumes = {v["name"] for v in pod_spec(obj).get("volumes", [])}
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{where}: mounts unknown volume {mount}"
        for volume in pod_spec(obj).get("volumes", []):
            for kind, key in (("ConfigMap", "configMap"), ("Secret", "secret")):
                if key not in volume:
                    continue
                ref_name = volume[key].get("name") or volume[key].get("secretName")
                target = find(objects, kind, ref_name)
                assert target is not None, f"{where}: no {kind} {ref_name}"
                data = {**target.get("data", {}), **target.get("stringData", {})}
                for item in volume[key].get("items", []):
                    assert item["key"] in data, f"{where}: {kind} {ref_name} lacks {item['key']}"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_k8s_probes_point_at_declared_ports(renders, name, fake_bin, tmp_path):
    for _, container, inv in k8s_invocations(renders[name], fake_bin, tmp_path):
        ports = container_ports(container)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            if probe is None:
                assert inv.role == "router" and kind == "startupProbe", f"{inv.where}: no {kind}"
                continue
            handler = probe.get("grpc") or probe.get("httpGet") or probe.get("tcpSocket")
            assert str(handler["port"]) in ports, f"{inv.where}: {kind} port {handler['port']}"
            if inv.role == "router":
                assert "httpGet" in probe, inv.where
            else:
                assert probe.get("grpc") == {"port": int(inv.flag("--port"))}, (
                    f"{inv.where}: {kind} must be a gRPC probe on the daemon's --port"
                )
        if inv.role == "router":
            assert container["readinessProbe"]["httpGet"]["path"] == "/health", inv.where


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_k8s_daemons_get_a_coherent_configuration(renders, name, fake_bin, tmp_path):
    objects = renders[name]
    roles_seen = set()
    for obj, container, inv in k8s_invocations(objects, fake_bin, tmp_path):
        roles_seen.add(inv.role)
        check_env_names(inv)
        spec = pod_spec(obj)
        ports = container_ports(container)
        annotations = obj["spec"]["template"]["metadata"].get("annotations", {})
        # Service links could inject KVTRANSFER_*-named variables (a Service `kvtransfer`
        # would set KVTRANSFER_PORT=tcp://...), which the daemons read as settings.
        assert spec.get("enableServiceLinks") is False, inv.where
        assert inv.flag("--host") == "0.0.0.0", inv.where
        assert annotations.get("prometheus.io/scrape") == "true", inv.where
        assert annotations.get("prometheus.io/path") == "/metrics", inv.where
        if inv.role == "router":
            assert annotations["prometheus.io/port"] == inv.flag("--port"), inv.where
            assert ports.get("http") == int(inv.flag("--port")), inv.where
            continue
        # Stable pod names (kvtransfer-decode-0.kvtransfer-decode) for `kvtransfer admin`.
        assert obj["kind"] == "StatefulSet", inv.where
        assert ports.get("grpc") == int(inv.flag("--port")), inv.where
        assert ports.get("metrics") == int(inv.flag("--metrics-port")), inv.where
        assert annotations["prometheus.io/port"] == inv.flag("--metrics-port"), inv.where
        config = check_kv_config(inv)
        grace = spec["terminationGracePeriodSeconds"]
        assert grace > lease_s(config), f"{inv.where}: grace period must exceed kv_lease_s"
        assert grace >= 60, inv.where
        liveness = container["livenessProbe"]
        window = liveness.get("periodSeconds", 10) * liveness.get("failureThreshold", 3)
        assert window >= grace, f"{inv.where}: liveness would restart a draining daemon"
        for name_ in ("UCX_TLS", "UCX_NET_DEVICES"):
            assert inv.env.get(name_), f"{inv.where}: {name_} unset"
        token = next(e for e in container["env"] if e["name"] == "KVTRANSFER_ADMIN_TOKEN")
        assert "secretKeyRef" in token.get("valueFrom", {}), f"{inv.where}: token in clear"
        if inv.role == "prefill":
            # The pod IP reached kv_ip through the downward API and the container's command.
            assert config["kv_ip"] == FAKE_POD_IP, inv.where
            assert ports.get("kv") == config["kv_port"], inv.where
            svc = find(objects, "Service", obj["spec"]["serviceName"])
            kv_ports = {p["port"] for p in svc["spec"]["ports"] if p["name"] == "kv"}
            assert kv_ports == {config["kv_port"]}, inv.where
    assert roles_seen == {"prefill", "decode", "router"}, name


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_k8s_router_reaches_every_daemon_pod_through_dns(renders, name, fake_bin, tmp_path):
    """The router's targets are dns:SERVICE:PORT of headless Services that select exactly the
    daemons of that role, on the port each daemon serves: every pod is an instance, whatever the
    replica count, and pods that come and go need no router change."""
    objects = renders[name]
    found = k8s_invocations(objects, fake_bin, tmp_path)
    daemons = {obj["metadata"]["name"]: inv for obj, _, inv in found if inv.role != "router"}
    routers = [inv for _, _, inv in found if inv.role == "router"]
    assert routers, name
    for router in routers:
        config = router_config(router)
        for role in ROLES:
            # A static HOST:PORT would be one pod (or one virtual IP): not a fleet.
            assert config.addresses(role) == (), f"{router.where}: --{role} must be dns:NAME:PORT"
            reached = set()
            for host, port in config.dns_names(role):
                where = f"{router.where}: dns:{host}:{port}"
                # The base is namespace-less: a short name resolves in the router's namespace.
                assert "." not in host, f"{where}: names a namespace"
                svc = find(objects, "Service", host)
                assert svc is not None, f"{where}: no such Service"
                # A ClusterIP Service resolves to one virtual IP, i.e. one instance.
                assert svc["spec"].get("clusterIP") == "None", f"{where}: not headless"
                # Loading and draining pods stay instances; the router's health checks decide.
                assert svc["spec"].get("publishNotReadyAddresses") is True, where
                selected = selected_workloads(objects, svc["spec"]["selector"])
                assert selected, f"{where}: selects no pod"
                for obj in selected:
                    inv = daemons.get(obj["metadata"]["name"])
                    assert inv is not None and inv.role == role, (
                        f"{where}: selects {obj['kind']}/{obj['metadata']['name']}, "
                        f"not a {role} daemon"
                    )
                    # DNS gives pod IPs: the router dials PORT on the pod itself, no targetPort.
                    assert int(inv.flag("--port")) == port, f"{where}: {inv.where} serves elsewhere"
                    reached.add(obj["metadata"]["name"])
            expected = {wname for wname, inv in daemons.items() if inv.role == role}
            assert reached == expected, f"{router.where}: --{role} misses {expected - reached}"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_k8s_router_policies_match_what_the_daemons_publish(renders, name, fake_bin, tmp_path):
    found = k8s_invocations(renders[name], fake_bin, tmp_path)
    containers = {id(inv): container for _, container, inv in found}
    daemons = [inv for _, _, inv in found if inv.role != "router"]
    for router in (inv for _, _, inv in found if inv.role == "router"):
        config = check_router_follows_daemons(
            router, daemons, lambda inv: container_ports(containers[id(inv)])
        )
        # docs/router.md: the prefill's cost is its uncached prompt, the decode's its batch.
        assert config.policy_for("prefill") == "cache_aware", router.where
        assert config.policy_for("decode") == "least_load", router.where


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_k8s_router_tokens_come_from_the_secret(renders, name, fake_bin, tmp_path):
    objects = renders[name]
    found = k8s_invocations(objects, fake_bin, tmp_path)

    def secret_ref(container: dict, variable: str) -> tuple[str, str]:
        entry = next((e for e in container.get("env", []) if e["name"] == variable), None)
        assert entry is not None, f"{container['name']}: no {variable}"
        ref = entry.get("valueFrom", {}).get("secretKeyRef")
        assert ref, f"{container['name']}: {variable} must come from a Secret, not a literal"
        return ref["name"], ref["key"]

    daemon_refs = {
        secret_ref(container, "KVTRANSFER_ADMIN_TOKEN")
        for _, container, inv in found
        if inv.role != "router"
    }
    assert len(daemon_refs) == 1, daemon_refs
    for _, container, router in ((o, c, i) for o, c, i in found if i.role == "router"):
        config = router_config(router)
        assert config.admin_token is not None, f"{router.where}: the admin API is off"
        admin_ref = secret_ref(container, ROUTER_ADMIN_TOKEN_ENV)
        # Managing the router's fleet is not the power to drain daemons: another key.
        assert admin_ref not in daemon_refs, f"{router.where}: admin token = daemons' token"
        assert {secret_ref(container, "KVTRANSFER_ADMIN_TOKEN")} == daemon_refs, router.where


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_k8s_security_and_resources(renders, name):
    for obj in workloads(renders[name]):
        spec = pod_spec(obj)
        where = f"{name}: {obj['kind']}/{obj['metadata']['name']}"
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"].get("runAsUser", 1) != 0, where
        assert spec.get("automountServiceAccountToken") is False, where
        for container in pod_containers(obj):
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            resources = container["resources"]
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources[part]), f"{where}: {part}"
            gpus = [resources[p].get("nvidia.com/gpu") for p in ("requests", "limits")]
            assert gpus[0] == gpus[1], f"{where}: extended resources need requests == limits"
            name_, tag, _ = split_image(container["image"])
            assert name_ == "kvtransfer" and tag, where


def test_k8s_secret_is_a_visible_placeholder(renders):
    secret = find(renders["base"], "Secret", "kvtransfer-admin")
    assert set(secret["stringData"]) == {"token", "router-token"}
    for value in secret["stringData"].values():
        assert "CHANGE-ME" in value


def test_k8s_xpyd_overlay_scales_without_touching_the_router(renders):
    base, xpyd = renders["base"], renders["overlays/xpyd"]
    for role in ROLES:
        name = f"kvtransfer-{role}"
        assert find(base, "StatefulSet", name)["spec"]["replicas"] == 1
        assert find(xpyd, "StatefulSet", name)["spec"]["replicas"] == 2
    router = find(base, "Deployment", "kvtransfer-router")
    assert find(xpyd, "Deployment", "kvtransfer-router") == router


def test_k8s_gpu_overlay(renders, fake_bin, tmp_path):
    objects = renders["overlays/gpu"]
    for obj, container, inv in k8s_invocations(objects, fake_bin, tmp_path):
        if inv.role == "router":
            continue
        assert container["image"].endswith("-cuda"), inv.where
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1", inv.where
        tls = inv.env["UCX_TLS"].split(",")
        assert "cuda_copy" in tls and "tcp" in tls, inv.where
        assert inv.env["KVTRANSFER_DEVICE"] == "cuda", inv.where
        assert any(t.get("key") == "nvidia.com/gpu" for t in pod_spec(obj)["tolerations"])
    base = k8s_invocations(renders["base"], fake_bin, tmp_path / "base")
    assert all("nvidia.com/gpu" not in c["resources"]["limits"] for _, c, _ in base)


# ---------------------------------------------------------------------- vLLM servers (k8s)

# deploy/k8s/vllm: vLLM OpenAI servers with our UcxConnector, behind the router (--engine vllm).
VLLM_COMMAND = ["vllm", "serve"]
# vLLM 0.32 `serve` flags the contract knows (its parser takes many more); switches take no
# value. The model is `serve`'s first argument (or the deprecated --model).
VLLM_FLAGS = {
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--block-size",
    "--kv-transfer-config",
    "--kv-events-config",
    "--gpu-memory-utilization",
    "--max-model-len",
    "--tensor-parallel-size",
    "--pipeline-parallel-size",
    "--dtype",
}
VLLM_SWITCHES = {"--enable-prefix-caching", "--no-enable-prefix-caching", "--enforce-eager"}
# The fields of vLLM 0.32's KVTransferConfig and KVEventsConfig (vllm/config/kv_transfer.py,
# kv_events.py), with KVTransferConfig's defaults our adapter reads; vLLM refuses other keys,
# a top-level kv_ip among them (ours goes in kv_connector_extra_config).
VLLM_KV_TRANSFER_DEFAULTS = {
    "kv_connector": None,
    "engine_id": None,
    "kv_buffer_device": "cuda",
    "kv_role": None,
    "kv_port": 14579,
    "kv_connector_extra_config": {},
    "kv_connector_module_path": None,
    "enable_permute_local_kv": False,
    "kv_load_failure_policy": "fail",
}
VLLM_KV_EVENTS_KEYS = {
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
}
VLLM_MODULE = "kvtransfer.integrations.vllm"
VLLM_API_KEY_ENV = "KVTRANSFER_VLLM_API_KEY"
# The router's variables with --engine vllm: its admin API's token and the servers' API key.
VLLM_ROUTER_ENV = {ROUTER_ADMIN_TOKEN_ENV, VLLM_API_KEY_ENV}


def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a container's command and args: ``$(VAR)`` becomes VAR's value
    when the container's env defines VAR (else it stays as written), ``$$`` is a ``$``."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
            continue
        if text.startswith("$(", i) and ")" in text[i:]:
            end = text.index(")", i)
            name = text[i + 2 : end]
            out.append(env.get(name, text[i : end + 1]))
            i = end + 1
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


@dataclass
class VllmServer:
    """A vLLM server container: the model it serves, its flags (after Kubernetes' expansion),
    its raw args (before) and its environment."""

    where: str
    obj: dict
    container: dict
    model: str
    flags: dict[str, str]
    switches: set[str]
    raw_args: list[str]
    env: dict[str, str]

    @property
    def port(self) -> int:
        return int(self.flags["--port"])

    @property
    def served_name(self) -> str:
        """The model name clients send (one --served-model-name here, else the model)."""
        return self.flags.get("--served-model-name", self.model)

    def json_flag(self, name: str) -> dict[str, Any] | None:
        text = self.flags.get(name)
        if text is None:
            return None
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            pytest.fail(f"{self.where}: {name} is not JSON: {exc}")
        assert isinstance(value, dict), f"{self.where}: {name} is not a JSON object"
        return value

    def raw_json_flag(self, name: str) -> dict[str, Any]:
        """The flag's JSON as written in the manifest (``$(VAR)`` references unexpanded)."""
        index = next(i for i, arg in enumerate(self.raw_args) if arg == name)
        return json.loads(self.raw_args[index + 1])


def parse_vllm_argv(argv: list[str], where: str) -> tuple[str, dict[str, str], set[str]]:
    model = None
    if argv and not argv[0].startswith("-"):
        model, argv = argv[0], argv[1:]
    flags: dict[str, str] = {}
    switches: set[str] = set()
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        assert name.startswith("--"), f"{where}: unexpected argument {argv[i]!r}"
        if name in VLLM_SWITCHES:
            assert not eq, f"{where}: {name} takes no value"
            switches.add(name)
            i += 1
            continue
        assert name in VLLM_FLAGS, f"{where}: {name} is not a vLLM flag the contract knows"
        if eq:
            i += 1
        else:
            assert i + 1 < len(argv), f"{where}: {name} has no value"
            value = argv[i + 1]
            i += 2
        assert name not in flags, f"{where}: {name} given twice"
        flags[name] = value
    if "--model" in flags:
        assert model is None, f"{where}: the model is given twice"
        model = flags.pop("--model")
    assert model, f"{where}: no model"
    assert not {"--enable-prefix-caching", "--no-enable-prefix-caching"} <= switches, where
    return model, flags, switches


@dataclass
class VllmFleet:
    servers: dict[str, VllmServer]  # workload name -> its server
    router: Invocation
    router_obj: dict
    router_container: dict
    objects: list[dict]

    def role_servers(self, config) -> dict[str, list[VllmServer]]:
        """Each role's servers: the pods its dns:NAME:PORT targets select."""
        found: dict[str, list[VllmServer]] = {}
        for role in ROLES:
            for host, _ in config.dns_names(role):
                svc = find(self.objects, "Service", host)
                assert svc is not None, f"{self.router.where}: no Service {host}"
                for obj in selected_workloads(self.objects, svc["spec"]["selector"]):
                    server = self.servers.get(obj["metadata"]["name"])
                    assert server is not None, f"{host} selects {resource_id(obj)}, no vLLM"
                    found.setdefault(role, []).append(server)
        return found


def vllm_fleet(objects: list[dict]) -> VllmFleet:
    servers, routers = {}, []
    for obj in workloads(objects):
        for container in pod_containers(obj):
            where = f"{obj['kind']}/{obj['metadata']['name']}/{container['name']}"
            env = resolve_env(container, objects, where)
            raw = [*container.get("command", []), *container.get("args", [])]
            expanded = [kubelet_expand(token, env) for token in raw]
            for token in expanded:
                # Kubernetes passes an unknown $(VAR) on as written: a typo'd reference.
                assert not re.search(r"\$\([A-Za-z_][A-Za-z0-9_]*\)", token), (
                    f"{where}: {token!r} refers to a variable the container does not define"
                )
            if expanded[:2] == VLLM_COMMAND:
                model, flags, switches = parse_vllm_argv(expanded[2:], where)
                servers[obj["metadata"]["name"]] = VllmServer(
                    where, obj, container, model, flags, switches, container.get("args", []), env
                )
            else:
                assert expanded[0] == "kvtransfer-router", f"{where}: runs {expanded[0]}"
                routers.append((obj, container, Invocation(where, "router", expanded[1:], env)))
    assert len(routers) == 1, routers
    obj, container, router = routers[0]
    return VllmFleet(servers, router, obj, container, objects)


@pytest.fixture(scope="module")
def vllm(renders) -> VllmFleet:
    return vllm_fleet(renders[VLLM])


def secret_key_ref(container: dict, variable: str) -> tuple[str, str]:
    entry = next((e for e in container.get("env", []) if e["name"] == variable), None)
    assert entry is not None, f"{container['name']}: no {variable}"
    ref = entry.get("valueFrom", {}).get("secretKeyRef")
    assert ref, f"{container['name']}: {variable} must come from a Secret, not a literal"
    return ref["name"], ref["key"]


def port_number(container: dict, port: int | str) -> int | None:
    """A probe's or Service's port (a number or a container port's name) as a number."""
    return container_ports(container).get(str(port))


def test_vllm_router_parses_with_engine_vllm(vllm):
    config = router_config(vllm.router)
    assert config.engine == "vllm", vllm.router.where
    assert config.policy_for("prefill") == "cache_aware"
    assert config.policy_for("decode") == "least_load"
    assert not config.uses_tls, "the router calls vLLM over plain HTTP"
    assert vllm.router.env.keys() <= VLLM_ROUTER_ENV, vllm.router.env.keys() - VLLM_ROUTER_ENV
    # The admin API is on, from the Secret, as in the base.
    assert config.admin_token is not None, f"{vllm.router.where}: the admin API is off"
    admin_ref = secret_key_ref(vllm.router_container, ROUTER_ADMIN_TOKEN_ENV)
    # The router sends the key the servers check: the same Secret key, another than the admin's.
    key_ref = secret_key_ref(vllm.router_container, VLLM_API_KEY_ENV)
    assert admin_ref != key_ref, "the admin token must not be the servers' API key"
    for server in vllm.servers.values():
        assert secret_key_ref(server.container, "VLLM_API_KEY") == key_ref, server.where
        assert server.env["VLLM_API_KEY"] == config.vllm_api_key, server.where
        # Clients name the model the router lists; vLLM checks that name again.
        assert config.model_name == server.served_name, f"{server.where}: --model-name"


def test_vllm_router_reaches_every_server_through_dns(vllm):
    """Each dns:NAME:PORT is a headless Service selecting exactly the servers of that role, on
    the port each serves HTTP (vLLM's --port): DNS gives pod IPs, dialled on PORT."""
    config = router_config(vllm.router)
    reached: dict[str, str] = {}
    for role in ROLES:
        assert config.addresses(role) == (), f"--{role} must be dns:NAME:PORT"
        assert config.dns_names(role), f"no --{role}"
        for host, port in config.dns_names(role):
            where = f"{vllm.router.where}: dns:{host}:{port}"
            assert "." not in host, f"{where}: names a namespace"
            svc = find(vllm.objects, "Service", host)
            assert svc is not None, f"{where}: no such Service"
            assert svc["spec"].get("clusterIP") == "None", f"{where}: not headless"
            assert svc["spec"].get("publishNotReadyAddresses") is True, where
            selected = selected_workloads(vllm.objects, svc["spec"]["selector"])
            assert selected, f"{where}: selects no pod"
            for obj in selected:
                name = obj["metadata"]["name"]
                server = vllm.servers.get(name)
                assert server is not None, f"{where}: selects {resource_id(obj)}, no vLLM server"
                assert server.port == port, f"{where}: {server.where} listens on {server.port}"
                assert server.flags.get("--host") == "0.0.0.0", server.where
                assert port_number(server.container, "http") == port, server.where
                assert reached.setdefault(name, role) == role, f"{name}: both roles"
    assert set(reached) == set(vllm.servers), set(vllm.servers) - set(reached)
    assert set(reached.values()) == set(ROLES)


def test_vllm_kv_transfer_config_per_role(vllm):
    """--kv-transfer-config: vLLM's keys only, our connector by a module path that defines it,
    the role's kv_role, kv_ip the pod IP (downward API), read by our own adapter's parsers."""
    import ast
    import importlib.util
    from types import SimpleNamespace

    from kvtransfer.connector.config import KVTransferConfig
    from kvtransfer.connectors.ucx.config import UcxConfig

    config = router_config(vllm.router)
    for role, servers in vllm.role_servers(config).items():
        for server in servers:
            where = server.where
            kv = server.json_flag("--kv-transfer-config")
            assert kv is not None, f"{where}: no --kv-transfer-config"
            assert set(kv) <= set(VLLM_KV_TRANSFER_DEFAULTS), f"{where}: vLLM refuses {kv}"
            assert kv["kv_connector"] == "UcxConnector", where
            assert kv["kv_connector_module_path"] == VLLM_MODULE, where
            # vLLM imports the module and takes the class named kv_connector from it.
            spec = importlib.util.find_spec(VLLM_MODULE)
            tree = ast.parse(Path(spec.origin).read_text())
            classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
            assert kv["kv_connector"] in classes, f"{where}: {VLLM_MODULE} lacks it"
            assert kv["kv_role"] == KV_ROLES[role], f"{where}: a {role} server"
            # kv_ip: a $(VAR) reference, in the manifest, to the pod IP from the downward API.
            raw_ip = server.raw_json_flag("--kv-transfer-config")["kv_connector_extra_config"]
            ref = re.fullmatch(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", raw_ip.get("kv_ip", ""))
            assert ref, f"{where}: kv_ip must be $(VAR) of the pod IP"
            source = next(e for e in server.container["env"] if e["name"] == ref[1])
            assert source["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", where
            assert kv["kv_connector_extra_config"]["kv_ip"] == FAKE_POD_IP, where
            # What our adapter builds inside vLLM (KVTransferConfig.from_vllm).
            vllm_kv = SimpleNamespace(**{**VLLM_KV_TRANSFER_DEFAULTS, "engine_id": "e", **kv})
            ours = KVTransferConfig.from_vllm(vllm_kv, kv["kv_connector"])
            ucx = UcxConfig.from_transfer_config(ours)
            assert ucx.host == FAKE_POD_IP, where
            assert ours.kv_role == KV_ROLES[role], where
            if role == "prefill":
                # Decode pods dial kv_ip:kv_port: a declared port, not vLLM's HTTP port.
                assert ours.is_kv_producer and ucx.port > 0, where
                assert port_number(server.container, "kv") == ucx.port, f"{where}: kv port"
                assert ucx.port != server.port, where
            else:
                assert ours.is_kv_consumer and not ours.is_kv_producer, where


def test_vllm_kv_events_match_the_router(vllm):
    """The cache_aware role's servers publish vLLM's KV events where the router subscribes,
    in blocks of the router's size; the router tokenizes with the model they serve."""
    from kvtransfer.router.fleet.cache_wiring import event_source

    config = router_config(vllm.router)
    assert config.kv_events_port is not None, "cache_aware without events: approximate only"
    assert config.tokenizer is not None, "cache_aware needs the prompts' token ids"
    cache_aware = [role for role in ROLES if config.policy_for(role) == "cache_aware"]
    assert cache_aware == ["prefill"]
    for role, servers in vllm.role_servers(config).items():
        for server in servers:
            where = server.where
            assert config.tokenizer == server.model, f"{where}: --tokenizer != its model"
            if role not in cache_aware:
                continue
            assert "--block-size" in server.flags, f"{where}: set --block-size explicitly"
            assert int(server.flags["--block-size"]) == config.kv_block_size, f"{where}: block"
            assert "--no-enable-prefix-caching" not in server.switches, f"{where}: no events"
            events = server.json_flag("--kv-events-config")
            assert events is not None, f"{where}: publishes no KV events"
            assert set(events) <= VLLM_KV_EVENTS_KEYS, f"{where}: vLLM refuses {events}"
            assert events.get("enable_kv_cache_events") is True, where
            assert events.get("publisher", "zmq") == "zmq", where
            # vLLM binds its PUB only for a wildcard host (else it connects).
            bound = re.fullmatch(r"tcp://\*:([0-9]+)", events.get("endpoint", "tcp://*:5557"))
            assert bound, f"{where}: vLLM would connect to {events['endpoint']}, not bind"
            assert int(bound[1]) == config.kv_events_port, f"{where}: events port"
            replay = events.get("replay_endpoint")
            assert (replay is None) == (config.kv_events_replay_port is None), where
            ports = container_ports(server.container)
            assert ports.get("kv-events") == config.kv_events_port, f"{where}: kv-events port"
            if replay is not None:
                replay_port = zmq_tcp_port(replay, where)
                assert replay_port == config.kv_events_replay_port, f"{where}: replay port"
                assert ports.get("kv-replay") == replay_port, f"{where}: kv-replay port"
            # What the router dials for this pod, and the topic prefix it subscribes to.
            source = event_source(f"{FAKE_POD_IP}:{server.port}", config)
            assert source.endpoint == f"tcp://{FAKE_POD_IP}:{bound[1]}", where
            assert events.get("topic", "").startswith(source.topic), f"{where}: topic"
            bound_ports = [server.port, config.kv_events_port, config.kv_events_replay_port]
            kv_port = (server.json_flag("--kv-transfer-config") or {}).get("kv_port")
            bound_ports.append(kv_port)
            bound_ports = [p for p in bound_ports if p]
            assert len(bound_ports) == len(set(bound_ports)), f"{where}: {bound_ports}"


def mounted_source(obj: dict, container: dict, path: str) -> tuple[str, str]:
    """Where ``path`` in the container comes from: (its volume's source, path in it)."""
    volumes = {v["name"]: v for v in pod_spec(obj).get("volumes", [])}
    mounts = [
        m
        for m in container.get("volumeMounts", [])
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert mounts, f"{container['name']}: nothing mounted at {path}"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volume = {k: v for k, v in volumes[mount["name"]].items() if k != "name"}
    assert "emptyDir" not in volume, f"{container['name']}: {path} is an empty directory"
    inside = Path(mount.get("subPath", "")) / Path(path).relative_to(mount["mountPath"])
    return json.dumps(volume, sort_keys=True), str(inside)


def test_vllm_router_reads_the_servers_model(vllm):
    """--tokenizer is the servers' model path, on the same volume in the router's pod."""
    config = router_config(vllm.router)
    wanted = mounted_source(vllm.router_obj, vllm.router_container, config.tokenizer)
    for server in vllm.servers.values():
        assert server.model == config.tokenizer, server.where
        assert mounted_source(server.obj, server.container, server.model) == wanted, server.where


def test_vllm_server_pods(vllm, renders):
    """Probes on vLLM's /health at its --port, one GPU each, no service links, hardened."""
    for server in vllm.servers.values():
        where, container, spec = server.where, server.container, pod_spec(server.obj)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            handler = container.get(kind, {}).get("httpGet")
            assert handler, f"{where}: {kind} must GET vLLM's /health"
            assert handler["path"] == "/health", f"{where}: {kind}"
            assert port_number(container, handler["port"]) == server.port, f"{where}: {kind}"
        # VLLM_* variables configure vLLM: a Service link (VLLM_PORT=tcp://...) would break it.
        assert spec.get("enableServiceLinks") is False, where
        resources = container["resources"]
        assert resources["requests"].get("nvidia.com/gpu") == "1", where
        assert resources["limits"].get("nvidia.com/gpu") == "1", where
        assert any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", []))
        assert "cuda_copy" in server.env["UCX_TLS"].split(","), where
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec.get("automountServiceAccountToken") is False, where
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False, where
        assert security["capabilities"]["drop"] == ["ALL"], where
        name, tag, _ = split_image(container["image"])
        assert name == "kvtransfer-vllm" and tag, f"{where}: the vLLM image"
        annotations = server.obj["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(server.port), where
    router = vllm.router_container
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    assert split_image(router["image"])[0] == "kvtransfer"
    assert "nvidia.com/gpu" not in router["resources"]["limits"]
    secret = find(renders[VLLM], "Secret", "kvtransfer-vllm")
    assert set(secret["stringData"]) == {"router-token", "vllm-api-key"}
    assert all("CHANGE-ME" in value for value in secret["stringData"].values())


def test_vllm_fleet_shares_a_namespace_with_the_base(renders):
    """Both may be applied to one namespace: no object replaces another, and no Service or
    workload selector of one takes pods of the other."""
    base, ours = renders["base"], renders[VLLM]
    assert not {resource_id(o) for o in base} & {resource_id(o) for o in ours}
    for mine, theirs in ((base, ours), (ours, base)):
        for obj in mine:
            selector = obj.get("spec", {}).get("selector")
            if obj["kind"] == "Service":
                assert not selected_workloads(theirs, selector), resource_id(obj)
            elif pod_spec(obj) is not None:
                assert not selected_workloads(theirs, selector["matchLabels"]), resource_id(obj)


# ---------------------------------------------------------------------- docker compose


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


_COMPOSE_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|(?P<named>[A-Za-z_][A-Za-z0-9_]*)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<invalid>))"
)


def interpolate(value: str, environ: dict[str, str], where: str) -> str:
    """Compose's interpolation: $$ is a literal $, $VAR / ${VAR} / ${VAR:-default} /
    ${VAR:?error} come from the operator's shell; anything else after a $ (a shell's $(...),
    say) is an error, as compose makes it."""

    def substitute(match: re.Match) -> str:
        if match["escaped"]:
            return "$"
        if match["invalid"] is not None:
            raise AssertionError(f"{where}: compose refuses {value!r} (write $$ for a $)")
        name = match["named"] or match["braced"]
        current = environ.get(name)
        op = match["op"]
        unset = current is None or (current == "" and op and op.startswith(":"))
        if op and op.endswith("?") and unset:
            raise AssertionError(f"{where}: compose stops: {name} {match['arg']}")
        if op and op.endswith("-") and unset:
            return match["arg"]
        return current or ""

    return _COMPOSE_VARIABLE.sub(substitute, value)


@pytest.fixture(scope="module")
def compose_bin(fake_bin, tmp_path_factory) -> Path:
    """The fake binaries plus a `python` that runs its -c code inside a compose container: the
    hostname is the container id, which /etc/hosts maps to the container's IP."""
    directory = tmp_path_factory.mktemp("compose-bin")
    for binary in BINARIES:
        (directory / binary).symlink_to(fake_bin / binary)
    python = directory / "python"
    python.write_text(
        f"#!{sys.executable}\nimport socket, sys\n"
        "assert sys.argv[1] == '-c', sys.argv\n"
        f"hosts = {{{FAKE_CONTAINER_HOSTNAME!r}: {FAKE_CONTAINER_IP!r}}}\n"
        f"socket.gethostname = lambda: {FAKE_CONTAINER_HOSTNAME!r}\n"
        "def gethostbyname(name):\n"
        "    if name not in hosts:\n"
        "        raise socket.gaierror(socket.EAI_NONAME, name)\n"
        "    return hosts[name]\n"
        "socket.gethostbyname = gethostbyname\n"
        "code, sys.argv = sys.argv[2], ['-c', *sys.argv[3:]]\n"
        "exec(compile(code, '<string>', 'exec'), {'__name__': '__main__'})\n"
    )
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return directory


def compose_invocations(
    compose: dict, compose_bin: Path, environ: dict[str, str] | None = None
) -> dict[str, Invocation]:
    """What each service's container runs: compose's interpolation with the operator's
    ``environ``, then a `sh -c` command through a real shell with fake binaries."""
    environ = COMPOSE_SHELL_ENV if environ is None else environ
    found = {}
    for name, service in compose["services"].items():
        where = f"compose {name}"
        command = service["command"]
        assert isinstance(command, list), f"{where}: use the exec (list) form"
        command = [interpolate(token, environ, where) for token in command]
        env = {
            k: interpolate(str(v), environ, where)
            for k, v in (service.get("environment") or {}).items()
        }
        if command[:2] == ["sh", "-c"]:
            script = command[2]
            # The daemon must replace the shell: SIGTERM goes to the shell's PID.
            assert re.search(r"(^|&& )exec kvtransfer-", script), f"{where}: no exec"
            result = subprocess.run(
                ["sh", "-c", script, *command[3:]],
                env={"PATH": f"{compose_bin}:/usr/bin:/bin", **env},
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            assert result.returncode == 0, f"{where}: {result.stderr}"
            started = json.loads(result.stdout)
            command = [started["binary"], *started["argv"]]
        binary = command[0]
        assert binary in BINARIES, f"{where}: unknown binary {binary}"
        found[name] = Invocation(where, BINARIES[binary], command[1:], env)
    return found


def seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+)(s|m)", str(text))
    assert match, text
    return int(match[1]) * (60 if match[2] == "m" else 1)


def published(port: str) -> tuple[str, str, int]:
    """Compose's short port syntax -> (host IP, host port or "", container port)."""
    parts = str(port).split(":")
    assert 1 <= len(parts) <= 3, port
    parts = [""] * (3 - len(parts)) + parts
    return parts[0], parts[1], int(parts[2])


def test_compose_services_follow_the_contract(compose, compose_bin):
    invocations = compose_invocations(compose, compose_bin)
    roles = sorted(inv.role for inv in invocations.values())
    assert roles == ["decode", "prefill", "router"]
    networks = set(compose["networks"])
    for name, inv in invocations.items():
        service = compose["services"][name]
        check_env_names(inv)
        assert set(service["networks"]) <= networks, name
        assert service.get("healthcheck", {}).get("test"), f"compose {name}: no healthcheck"
        assert inv.flag("--host") == "0.0.0.0", name
        if inv.role == "router":
            assert seconds(service["stop_grace_period"]) >= 30, name
            for dependency in service["depends_on"].values():
                assert dependency["condition"] == "service_healthy", name
            continue
        config = check_kv_config(inv)
        assert seconds(service["stop_grace_period"]) > lease_s(config), name
        assert service["environment"].get("UCX_TLS"), name
        # The healthcheck asks the daemon's own gRPC port.
        assert f"127.0.0.1:{inv.flag('--port')}" in " ".join(service["healthcheck"]["test"])
        if inv.role == "prefill":
            # kv_ip is bound and advertised: this container's own address, not the service
            # name, which resolves to every replica.
            assert config["kv_ip"] == FAKE_CONTAINER_IP, name


def test_compose_daemons_scale(compose, compose_bin):
    """A daemon service can run several containers (deploy.replicas, --scale): nothing in it
    may be one per host or the same in every replica."""
    for name, inv in compose_invocations(compose, compose_bin).items():
        if inv.role == "router":
            continue
        service = compose["services"][name]
        where = f"compose {name}"
        assert service.get("deploy", {}).get("replicas", 1) >= 1, where
        # A container name is unique; a shared hostname gives every replica one engine id
        # (the default is "<role>-<hostname>-<pid>"); so would a fixed --engine-id.
        for key in ("container_name", "hostname"):
            assert key not in service, f"{where}: {key} is the same in every replica"
        assert inv.flag("--engine-id") is None, where
        assert "engine_id" not in inv.kv_transfer_config(), where
        bound = {int(inv.flag("--port")), int(inv.flag("--metrics-port"))}
        for port in service.get("ports", []):
            host_ip, host_port, container_port = published(port)
            # A fixed host port is free for one replica only.
            assert host_port == "", f"{where}: {port} pins a host port"
            assert host_ip == "127.0.0.1", f"{where}: {port} is not loopback only"
            assert container_port in bound, f"{where}: {port}: nothing listens there"


def test_compose_router_reaches_every_daemon_through_dns(compose, compose_bin):
    invocations = compose_invocations(compose, compose_bin)
    router = next(inv for inv in invocations.values() if inv.role == "router")
    config = router_config(router)
    for role in ROLES:
        assert config.addresses(role) == (), f"compose router: --{role} must be dns:NAME:PORT"
        reached = set()
        for host, port in config.dns_names(role):
            # Docker's DNS resolves a service name to every container of the service.
            target = invocations.get(host)
            assert target is not None, f"compose router: no service {host}"
            assert target.role == role, f"compose router: {host} is a {target.role} daemon"
            assert int(target.flag("--port")) == port, f"compose router: {host}:{port}"
            reached.add(host)
        expected = {name for name, inv in invocations.items() if inv.role == role}
        assert reached == expected, f"compose router: --{role} misses {expected - reached}"
    daemons = [inv for inv in invocations.values() if inv.role != "router"]
    config = check_router_follows_daemons(router, daemons)
    assert config.policy_for("prefill") == "cache_aware"
    assert config.policy_for("decode") == "least_load"


def test_compose_router_admin_api_follows_its_variable(compose, compose_bin):
    on = router_config(
        next(i for i in compose_invocations(compose, compose_bin).values() if i.role == "router")
    )
    assert on.admin_token == COMPOSE_SHELL_ENV[ROUTER_ADMIN_TOKEN_ENV]
    assert on.daemon_admin_token == COMPOSE_SHELL_ENV["KVTRANSFER_ADMIN_TOKEN"]
    without = {k: v for k, v in COMPOSE_SHELL_ENV.items() if k != ROUTER_ADMIN_TOKEN_ENV}
    off = router_config(
        next(
            i
            for i in compose_invocations(compose, compose_bin, without).values()
            if i.role == "router"
        )
    )
    assert off.admin_token is None
    with pytest.raises(AssertionError, match="compose stops: KVTRANSFER_ADMIN_TOKEN"):
        compose_invocations(compose, compose_bin, {})


# ---------------------------------------------------------------------- systemd


def read_unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(path.read_text())
    return parser


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, eq, value = line.partition("=")
        assert eq and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), line
        # systemd would strip quotes and backslashes; keep the example free of them so that
        # this literal reading equals systemd's.
        assert not set(value) & set("\"'\\"), line
        env[key] = value
    return env


def systemd_invocation(unit_name: str) -> tuple[configparser.ConfigParser, Invocation]:
    unit = read_unit(SYSTEMD / unit_name)
    service = unit["Service"]
    env_file = SYSTEMD / Path(service["EnvironmentFile"].lstrip("-")).name
    env = read_env_file(env_file)
    argv = []
    for token in shlex.split(service["ExecStart"]):
        # $NAME splits the variable on whitespace, ${NAME} keeps it one argument.
        if token.startswith("${"):
            argv.append(env[token[2:-1]])
        elif token.startswith("$"):
            argv.extend(env[token[1:]].split())
        else:
            argv.append(token)
    binary = Path(argv[0]).name
    assert binary in BINARIES, f"{unit_name}: unknown binary {binary}"
    return unit, Invocation(unit_name, BINARIES[binary], argv[1:], env)


def systemd_config(inv: Invocation) -> dict[str, Any]:
    path = SYSTEMD / Path(inv.flag("--config")).name
    with path.open("rb") as handle:
        return tomllib.load(handle)


UNITS = ["kvtransfer-prefill.service", "kvtransfer-decode.service", "kvtransfer-router.service"]


@pytest.mark.parametrize("unit_name", UNITS)
def test_systemd_units(unit_name):
    unit, inv = systemd_invocation(unit_name)
    service = unit["Service"]
    assert unit_name == f"kvtransfer-{inv.role}.service"
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    assert service["User"] not in ("root", "0") and service["Group"]
    assert service["KillSignal"] == "SIGTERM"
    assert service["KillMode"] == "mixed", "SIGTERM to the daemon, not its workers at once"
    assert service["Restart"] == "on-failure"
    assert service["EnvironmentFile"].lstrip("-") == "/etc/kvtransfer/kvtransfer.env"
    assert service["TimeoutStopSec"].isdigit()
    check_env_names(inv, shared=True)
    assert inv.flags, f"{unit_name}: no flags"  # parsing asserts each is in the contract
    if inv.role == "router":
        return
    # What would break UCX shared memory between the two daemons, or the GPU.
    for key in ("PrivateIPC", "PrivateDevices", "RemoveIPC", "DynamicUser"):
        assert service.get(key, "no") == "no", f"{unit_name}: {key}"
    assert service.get("MemoryDenyWriteExecute", "no") == "no", unit_name
    config = systemd_config(inv)
    assert set(config) <= DAEMON_ENV_SETTINGS - {"config"}, unit_name
    from_file = {"KVTRANSFER_KV_TRANSFER_CONFIG": json.dumps(config["kv_transfer_config"])}
    kv = check_kv_config(Invocation(f"{unit_name} config", inv.role, [], from_file))
    assert int(service["TimeoutStopSec"]) > lease_s(kv), unit_name
    assert int(service["TimeoutStopSec"]) >= 60, unit_name


def test_systemd_router_reaches_the_daemons():
    daemons = {}
    for unit_name in UNITS[:2]:
        _, inv = systemd_invocation(unit_name)
        daemons[inv.role] = systemd_config(inv)
    _, router = systemd_invocation("kvtransfer-router.service")
    assert router.role == "router"
    for role, config in daemons.items():
        addresses = router.flags[f"--{role}"]
        assert f"127.0.0.1:{config['port']}" in addresses, (role, addresses)
    assert daemons["prefill"]["port"] != daemons["decode"]["port"]
    assert daemons["prefill"]["metrics_port"] != daemons["decode"]["metrics_port"]
    assert daemons["prefill"]["kv_transfer_config"]["kv_port"] not in (
        daemons["prefill"]["port"],
        daemons["decode"]["port"],
    )


# ---------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def test_dockerfile():
    instructions = dockerfile_instructions()
    args = dict(
        rest.partition("=")[::2]
        for keyword, rest in instructions
        if keyword == "ARG" and "=" in rest
    )
    assert args["TORCH_VERSION"] == "2.13.0"
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    runs = [rest for keyword, rest in instructions if keyword == "RUN"]
    assert any('"torch==${TORCH_VERSION}"' in run and "${TORCH_INDEX_URL}" in run for run in runs)
    assert any(re.search(r"pip install \.(\s|$)", run) for run in runs)
    final_stage = instructions[max(i for i, (k, _) in enumerate(instructions) if k == "FROM") :]
    users = [rest for keyword, rest in final_stage if keyword == "USER"]
    assert users, "the runtime stage must switch to a non-root USER"
    uid = users[-1].partition(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric, so runAsNonRoot can verify it"
    assert not any(keyword == "ENTRYPOINT" for keyword, _ in instructions)
    exposed = {
        int(p) for keyword, rest in instructions if keyword == "EXPOSE" for p in rest.split()
    }
    assert {50051, 50052, 50061, 8000, 9100} <= exposed


def test_docker_build_context_has_every_package():
    """pyproject's packages and readme are copied in and not excluded by the .dockerignore."""
    with (ROOT / "pyproject.toml").open("rb") as handle:
        pyproject = tomllib.load(handle)
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {
        path.name
        for path in ROOT.iterdir()
        if (path / "__init__.py").is_file()
        and any(re.fullmatch(p.replace("*", ".*"), path.name) for p in patterns)
    }
    copied = {
        source
        for keyword, rest in dockerfile_instructions()
        if keyword == "COPY" and not rest.startswith("--")
        for source in rest.split()[:-1]
    }
    wanted = packages | {pyproject["project"]["readme"], "pyproject.toml"}
    assert wanted <= copied, wanted - copied
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().split()
    assert wanted <= {line[1:] for line in ignore if line.startswith("!")}


# ---------------------------------------------------------------------- the real parsers


def all_invocations(renders, compose, fake_bin, compose_bin, tmp_path) -> list[Invocation]:
    found = []
    for name in KUSTOMIZATIONS:
        found += [inv for _, _, inv in k8s_invocations(renders[name], fake_bin, tmp_path / name)]
    found += compose_invocations(compose, compose_bin).values()
    for unit_name in UNITS:
        _, inv = systemd_invocation(unit_name)
        if inv.flag("--config"):
            local = str(SYSTEMD / Path(inv.flag("--config")).name)
            inv.argv = [local if a == inv.flag("--config") else a for a in inv.argv]
        found.append(inv)
    return found


def test_real_parsers_accept_every_command_line(renders, compose, fake_bin, compose_bin, tmp_path):
    """The contract above, checked against the daemons' and router's own parsers."""
    from kvtransfer.connectors.ucx.config import UcxConfig

    for inv in all_invocations(renders, compose, fake_bin, compose_bin, tmp_path):
        if inv.role == "router":
            config = router_config(inv)
            assert config.prefill and config.decode, inv.where
            continue
        config = daemon_settings(inv).transfer_config()
        assert config.kv_role == KV_ROLES[inv.role], inv.where
        ucx = UcxConfig.from_transfer_config(config)
        if inv.role == "prefill":
            assert ucx.port == 50052, inv.where


def test_contract_names_exist_in_the_real_programs():
    """Every flag and variable the contract allows is one the programs define under exactly
    that name (argparse would also take an abbreviation, which the contract does not)."""
    from kvtransfer.router import __main__ as router_main
    from kvtransfer.serve.settings import DaemonSettings, build_parser

    def options(parser) -> set[str]:
        return {o for action in parser._actions for o in action.option_strings}

    assert options(router_main._parser()) >= ROUTER_FLAGS
    for role in ROLES:
        assert options(build_parser(role)) >= DAEMON_FLAGS, role
    assert set(DaemonSettings.model_fields) >= DAEMON_ENV_SETTINGS - {"config"}
    assert {router_main.ADMIN_TOKEN_ENV, router_main.DAEMON_ADMIN_TOKEN_ENV} == ROUTER_ENV
    assert router_main.VLLM_API_KEY_ENV == VLLM_API_KEY_ENV
