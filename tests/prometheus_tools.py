"""Locating the Prometheus binaries the observability tests run (Debian's ``prometheus`` and
``prometheus-alertmanager`` packages; ``make test`` installs them when missing)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "alerts"
# Debian names the Alertmanager binary prometheus-alertmanager; upstream tarballs call it alertmanager.
NAMES = {"alertmanager": ("prometheus-alertmanager", "alertmanager")}


def binary(name: str) -> str:
    for candidate in NAMES.get(name, (name,)):
        if path := shutil.which(candidate):
            return path
    pytest.fail(f"{name} is not installed: `make test` installs Debian's packages (apt-get install -y "
                "--no-install-recommends prometheus prometheus-alertmanager)")


def run(*command: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run a tool to completion; its output is in the assertion message when it fails."""
    return subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=120,
                          check=False)
