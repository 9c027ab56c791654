"""``make stack``: the stack of docker-compose.yml for people without Docker: guard.example.yaml's pool of
two engine replicas (e0 on :8100, e1 on :8102), the fallback engine and the guard, as ``make run`` starts
them, plus Prometheus, Alertmanager and an alert printer.

Prometheus and Alertmanager run with the very files docker-compose.yml mounts (alerts/prometheus.yml,
alerts/alertmanager.yml) and on the same loopback ports, so what works here works in compose. Their data
lives in a temporary directory that goes away with the stack. Grafana is not packaged for Debian: use
``docker compose up grafana``, or point any Grafana at http://127.0.0.1:9090 and import dashboards/json.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from run_stack import POOL, ROOT, main, stack, up_message

ALERTS = ROOT / "alerts"


def binary(*names: str) -> str:
    """The first of ``names`` on PATH (Debian calls Alertmanager prometheus-alertmanager)."""
    for name in names:
        if path := shutil.which(name):
            return path
    sys.exit(f"monitoring_stack: none of {', '.join(names)} is installed "
             "(apt-get install prometheus prometheus-alertmanager)")


def monitoring(data: Path) -> list[tuple[str, list[str], str]]:
    return [
        ("alert-log", [sys.executable, str(ROOT / "scripts" / "alert_log.py"), "--port", "9095"],
         "http://127.0.0.1:9095/health"),
        ("alertmanager", [binary("prometheus-alertmanager", "alertmanager"),
                          f"--config.file={ALERTS / 'alertmanager.yml'}",
                          f"--storage.path={data / 'alertmanager'}",
                          "--web.listen-address=127.0.0.1:9093", "--cluster.listen-address="],
         "http://127.0.0.1:9093/-/ready"),
        ("prometheus", [binary("prometheus"), f"--config.file={ALERTS / 'prometheus.yml'}",
                        f"--storage.tsdb.path={data / 'prometheus'}", "--web.listen-address=127.0.0.1:9090"],
         "http://127.0.0.1:9090/-/ready"),
    ]


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="kvguard-stack-") as data:
        sys.exit(main(stack(POOL) + monitoring(Path(data)), up_message(POOL, more_urls=(
            "  prometheus   http://127.0.0.1:9090  (alerts: /alerts)\n"
            "  alertmanager http://127.0.0.1:9093  (alerts print here as on-call receives them)\n"))))
