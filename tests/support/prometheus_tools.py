"""Locating the Prometheus binaries the observability tests run (Debian's ``prometheus`` and
``prometheus-alertmanager`` packages; ``make test`` installs them when missing)."""

from __future__ import annotations

import shutil

import pytest

from . import ROOT

ALERTS = ROOT / "alerts"
# Debian names the Alertmanager binary prometheus-alertmanager; upstream tarballs call it alertmanager.
NAMES = {"alertmanager": ("prometheus-alertmanager", "alertmanager")}


def binary(name: str) -> str:
    for candidate in NAMES.get(name, (name,)):
        if path := shutil.which(candidate):
            return path
    pytest.fail(f"{name} is not installed: `make test` installs Debian's packages (apt-get install -y "
                "--no-install-recommends prometheus prometheus-alertmanager)")

