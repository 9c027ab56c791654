"""deploy/kubernetes/, checked offline (no cluster runs here): every overlay renders with kustomize and
validates strictly against the Kubernetes schemas and the CRDs it uses (tests/support/kubernetes.py); the
objects the deployment needs are there with the properties that make them safe; and the manifests agree with
the code: every flag they pass parses with the engine's and the guard's own command lines, the guard's
config in the ConfigMap loads with the guard's own pydantic models, every port, path, env var and name they
refer to exists. What a cluster would add (scheduling, probes timing, KEDA acting) is never run here;
docs/kubernetes.md says so."""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import importlib.util
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from support import ROOT
from support.kubernetes import MANIFESTS, OVERLAYS, problems, render

from engine.__main__ import build_parser as engine_parser
from engine.config import EngineConfig
from guard.__main__ import main as guard_main
from guard.config import GuardConfig, load_config

AUTOSCALED = ("ha", "ha-hpa")
DRAIN_TIMEOUT_S = 30.0  # --drain-timeout's default by the contract (docs/contract.md, "Nothing lost")
THIRD_PARTY_ENV = {"TRITON_CACHE_DIR": "triton/knobs.py"}  # env vars read by a dependency, and where


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(MANIFESTS / overlay) for overlay in OVERLAYS}


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def port_of(box: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in box["ports"] if p["name"] == name)


def selects(selector: dict[str, str], workload: dict[str, Any]) -> bool:
    return selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()


def guard_config_text(objects: list[dict[str, Any]]) -> str:
    """The guard's YAML config: the file of the ConfigMap that the guard Deployment mounts."""
    volume = next(v for v in one(objects, "Deployment", "guard")["spec"]["template"]["spec"]["volumes"]
                  if "configMap" in v)
    return one(objects, "ConfigMap", volume["configMap"]["name"])["data"]["guard.yaml"]


def guard_config_of(objects: list[dict[str, Any]], tmp_path: Path, monkeypatch) -> GuardConfig:
    """The guard's config as the guard loads it: the ConfigMap's file through ``load_config``, with the
    secret the pod gets from the Secret through the environment (a stand-in: the Secret's is a placeholder
    the guard refuses, see test_secrets_hold_the_keys_and_no_configmap_does)."""
    path = tmp_path / "guard.yaml"
    path.write_text(guard_config_text(objects))
    monkeypatch.setenv("KVGUARD_SECRET", "a-test-secret")
    return load_config(path)


class _Parsed(Exception):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args_ = args


def guard_args(argv: list[str], monkeypatch) -> argparse.Namespace:
    """``argv`` parsed by the guard's own command line (``python -m guard``), which stops right after."""
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(_Parsed) as parsed:
        guard_main(argv)
    return parsed.value.args_


def module_argv(box: dict[str, Any], module: str) -> list[str]:
    command = box["command"] + box.get("args", [])
    assert command[:3] == ["python", "-m", module], command
    return command[3:]


# -- renders and validates ---------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_overlay_renders_and_validates_with_no_error(rendered, overlay):
    objects = rendered[overlay]
    assert len(objects) > 10
    assert [error for obj in objects for error in problems(obj)] == []


def test_the_validation_finds_planted_errors(rendered):
    rendered = copy.deepcopy(rendered)  # the fixture's objects are shared by the module's tests
    guard = one(rendered["single"], "Deployment", "guard")
    container(guard)["readinessProbe"]["httpGet"]["paht"] = "/health"
    assert any("paht" in error for error in problems(guard))
    service = one(rendered["single"], "Service", "guard")
    service["spec"]["ports"][0]["port"] = "eight thousand"
    assert any("port" in error for error in problems(service))
    scaled = one(rendered["ha"], "ScaledObject", "engine")
    scaled["spec"]["maxReplicas"] = 4  # HPA's spelling; KEDA's is maxReplicaCount
    assert any("maxReplicas" in error for error in problems(scaled))
    rule = one(rendered["single"], "PrometheusRule", "kvguard")
    del rule["spec"]["groups"][0]["rules"][0]["expr"]
    assert any("expr" in error for error in problems(rule))


def test_the_generated_alerts_and_dashboards_do_not_drift():
    spec = importlib.util.spec_from_file_location("k8s_generate", MANIFESTS / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    assert generate.stale() == [], "run python deploy/kubernetes/generate.py"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_alerts_are_a_prometheus_rule_and_dashboards_configmaps_for_grafana(rendered, overlay):
    objects = rendered[overlay]
    groups = [group for path in sorted((ROOT / "alerts" / "rules").glob("*.yml"))
              for group in yaml.safe_load(path.read_text())["groups"]]
    assert one(objects, "PrometheusRule", "kvguard")["spec"]["groups"] == groups
    dashboards = {o["metadata"]["name"]: o for o in find(objects, "ConfigMap")
                  if o["metadata"].get("labels", {}).get("grafana_dashboard") == "1"}
    for path in sorted((ROOT / "dashboards" / "json").glob("*.json")):
        assert dashboards.pop(f"dashboard-{path.stem}")["data"] == {path.name: path.read_text()}
    assert dashboards == {}


# -- the objects and their properties ---------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_guard_is_probed_bounded_locked_down_and_budgeted(rendered, overlay, tmp_path, monkeypatch):
    objects = rendered[overlay]
    guard = one(objects, "Deployment", "guard")
    pod, box = guard["spec"]["template"]["spec"], container(guard)
    for probe in ("readinessProbe", "livenessProbe"):
        assert box[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"cpu", "memory"} <= box["resources"]["requests"].keys() & box["resources"]["limits"].keys()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert box["securityContext"]["readOnlyRootFilesystem"] is True
    assert box["securityContext"]["allowPrivilegeEscalation"] is False
    (budget,) = [p for p in find(objects, "PodDisruptionBudget") if selects(p["spec"]["selector"]["matchLabels"], guard)]
    assert budget["spec"]["maxUnavailable"] == 1
    config = guard_config_of(objects, tmp_path, monkeypatch)
    pre_stop = box["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + config.limits.shutdown_timeout + 5


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_hold_the_keys_and_no_configmap_does(rendered, overlay, tmp_path, monkeypatch):
    objects = rendered[overlay]
    (secret,) = find(objects, "Secret")
    values = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    env = {e["name"]: e for e in container(one(objects, "Deployment", "guard"))["env"]}
    assert env["KVGUARD_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"],
                                                                  "key": "KVGUARD_SECRET"}
    assert "KVGUARD_SECRET" in values
    for config_map in find(objects, "ConfigMap"):
        text = "\n".join(config_map.get("data", {}).values())
        assert not any(value in text for value in values.values()), config_map["metadata"]["name"]
    raw = yaml.safe_load(guard_config_text(objects))
    assert "secret" not in raw and all("api_keys" not in tenant for tenant in raw["tenants"])
    digests = {d for tenant in guard_config_of(objects, tmp_path, monkeypatch).tenants for d in tenant.api_key_sha256}
    keys = {value for key, value in values.items() if key.startswith("API_KEY_")}
    assert digests == {hashlib.sha256(key.encode()).hexdigest() for key in keys}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_engine_is_ready_once_loaded_and_drains_within_its_grace(rendered, overlay):
    objects = rendered[overlay]
    engine = one(objects, "StatefulSet", "engine")
    pod, box = engine["spec"]["template"]["spec"], container(engine)
    for probe in ("startupProbe", "readinessProbe"):  # /health is 503 until the model has loaded
        assert box[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert "httpGet" not in box["livenessProbe"]  # a draining engine answers /health 503 and is alive
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert box["securityContext"]["readOnlyRootFilesystem"] is True
    args = engine_parser().parse_args(module_argv(box, "engine"))
    drain_s = getattr(args, "drain_timeout", DRAIN_TIMEOUT_S)  # the flag's value once the engine has it
    pre_stop = box["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain_s + 5
    service = one(objects, "Service", engine["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert any(selects(p["spec"]["selector"]["matchLabels"], engine) for p in find(objects, "PodDisruptionBudget"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_guards_and_prometheus_reach_the_engine_port(rendered, overlay):
    objects = rendered[overlay]
    engine, guard = one(objects, "StatefulSet", "engine"), one(objects, "Deployment", "guard")
    (policy,) = [p for p in find(objects, "NetworkPolicy") if selects(p["spec"]["podSelector"]["matchLabels"], engine)]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": port_of(container(engine), "http")}]
    guards, prometheus = rule["from"]
    assert guards.keys() == {"podSelector"} and selects(guards["podSelector"]["matchLabels"], guard)
    assert prometheus["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    assert prometheus["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_service_monitor_scrapes_the_guard_and_engine_as_the_alerts_name_them(rendered, overlay):
    objects = rendered[overlay]
    monitor = one(objects, "ServiceMonitor", "kvguard")
    scraped = [s for s in find(objects, "Service")
               if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert sorted(s["metadata"]["labels"][monitor["spec"]["jobLabel"]] for s in scraped) == ["engine", "guard"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in scraped)
    rules = " ".join(path.read_text() for path in (ROOT / "alerts" / "rules").glob("*.yml"))
    assert set(re.findall(r'job="([a-z-]+)"', rules)) == {"engine", "guard"}


def test_ha_runs_two_guards_apart_with_redis(rendered, tmp_path, monkeypatch):
    for overlay in AUTOSCALED:
        objects = rendered[overlay]
        guard = one(objects, "Deployment", "guard")
        assert guard["spec"]["replicas"] >= 2
        affinity = guard["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        (term,) = affinity["preferredDuringSchedulingIgnoredDuringExecution"]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        assert selects(term["podAffinityTerm"]["labelSelector"]["matchLabels"], guard)
        redis_url = urlsplit(guard_config_of(objects, tmp_path, monkeypatch).shared_state.redis_url)
        service = one(objects, "Service", redis_url.hostname)
        redis = one(objects, "Deployment", "redis")
        assert selects(service["spec"]["selector"], redis)
        assert redis_url.port == service["spec"]["ports"][0]["port"] == port_of(container(redis), "redis")
    assert find(rendered["single"], "ScaledObject") == find(rendered["single"], "HorizontalPodAutoscaler") == []


def autoscaler(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], int, int, str]:
    """The one autoscaler of the overlay: (its target, min, max, the guard pool its metric names)."""
    keda, hpa = find(objects, "ScaledObject"), find(objects, "HorizontalPodAutoscaler")
    assert len(keda) + len(hpa) == 1, "one autoscaler per workload: KEDA makes its own HPA"
    if keda:
        spec = keda[0]["spec"]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert trigger["metadata"]["threshold"] == "1"
        query = re.fullmatch(r'max\(guard_desired_replicas\{namespace="([^"]+)", pool="([^"]+)"\}\)',
                             trigger["metadata"]["query"])
        assert query and query[1] == objects[0]["metadata"]["name"]  # the Namespace kustomize puts them in
        return spec["scaleTargetRef"], spec["minReplicaCount"], spec["maxReplicaCount"], query[2]
    spec = hpa[0]["spec"]
    (metric,) = spec["metrics"]
    assert metric["external"]["metric"]["name"] == "guard_desired_replicas"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    return (spec["scaleTargetRef"], spec["minReplicas"], spec["maxReplicas"],
            metric["external"]["metric"]["selector"]["matchLabels"]["pool"])


@pytest.mark.parametrize("overlay", AUTOSCALED)
def test_the_autoscaler_scales_the_engines_on_the_guards_signal_as_configured(rendered, overlay, tmp_path,
                                                                               monkeypatch):
    objects = rendered[overlay]
    assert objects[0]["kind"] == "Namespace"
    target, low, high, pool = autoscaler(objects)
    engine = one(objects, "StatefulSet", target["name"])
    assert target == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "engine"}
    assert "replicas" not in engine["spec"]  # the autoscaler owns the count
    config = guard_config_of(objects, tmp_path, monkeypatch)
    scaling = config.autoscaling
    assert (scaling.pool, scaling.min_replicas, scaling.max_replicas) == (pool, low, high)
    port = port_of(container(engine), "http")
    assert [b.url for b in config.pool] == [f"http://{target['name']}-{i}.{engine['spec']['serviceName']}:{port}"
                                            for i in range(high)]


# -- the manifests agree with the code ---------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_engine_command_parses_with_the_engines_own_cli(rendered, overlay):
    objects = rendered[overlay]
    box = container(one(objects, "StatefulSet", "engine"))
    args = engine_parser().parse_args(module_argv(box, "engine"))  # an unknown flag exits here
    config = EngineConfig(**{name: getattr(args, name) for name in EngineConfig.__dataclass_fields__})
    assert config.model == "smollm2"
    assert args.host == "0.0.0.0" and args.port == port_of(box, "http")
    pool = GuardConfig.model_validate({**yaml.safe_load(guard_config_text(objects)), "secret": "a-test-secret"}).pool
    assert {urlsplit(backend.url).port for backend in pool} == {args.port}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_guard_command_and_config_load_with_the_guards_own_parsers(rendered, overlay, tmp_path, monkeypatch):
    objects = rendered[overlay]
    guard = one(objects, "Deployment", "guard")
    box = container(guard)
    args = guard_args(module_argv(box, "guard"), monkeypatch)
    mounts = {m["name"]: m["mountPath"] for m in box["volumeMounts"]}
    (volume,) = [v for v in guard["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    (item,) = volume["configMap"]["items"]
    assert args.config == f"{mounts[volume['name']]}/{item['path']}"
    config = guard_config_of(objects, tmp_path, monkeypatch)  # unknown keys and bad values fail here
    assert config.listen.host == "0.0.0.0" and config.listen.port == port_of(box, "http")
    assert one(objects, "Service", "guard")["spec"]["ports"][0]["targetPort"] == "http"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_env_var_the_manifests_set_is_read_by_the_code(rendered, overlay):
    sources = " ".join(p.read_text() for package in ("engine", "guard") for p in (ROOT / package).rglob("*.py"))
    site = Path(yaml.__file__).parents[1]
    for workload in find(rendered[overlay], "Deployment") + find(rendered[overlay], "StatefulSet"):
        for entry in container(workload).get("env", []):
            name = entry["name"]
            if name in THIRD_PARTY_ENV:
                assert name in (site / THIRD_PARTY_ENV[name]).read_text(), name
            else:
                assert name.startswith("KVGUARD_") and f'"{name}"' in sources, name
