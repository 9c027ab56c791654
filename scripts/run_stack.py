"""``make run``: the local stack: engine on :8100, fallback engine on :8101, guard on :8000.

Starts each process, waits until it answers ``/health``, prints the URLs and the demo API keys, and on
Ctrl-C (or when any process dies) stops them all, the guard first so that it drains its streams.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROCESSES = [  # (name, command, health URL); started in this order, stopped in reverse
    ("engine", [sys.executable, "-m", "engine", "--model", "tiny", "--port", "8100"], "http://127.0.0.1:8100/health"),
    ("fallback", [sys.executable, "-m", "engine", "--model", "tiny", "--port", "8101", "--num-blocks", "256"],
     "http://127.0.0.1:8101/health"),
    ("guard", [sys.executable, "-m", "guard", "--config", str(ROOT / "guard.example.yaml")],
     "http://127.0.0.1:8000/health"),
]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def main(processes: list[tuple[str, list[str], str]] = PROCESSES, more_urls: str = "") -> int:
    """Run ``processes`` until Ctrl-C; ``more_urls`` adds lines to the list of URLs printed when up."""
    running: list[tuple[str, subprocess.Popen]] = []
    stop = False

    def request_stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        for name, command, url in processes:
            process = subprocess.Popen(command, cwd=ROOT)
            running.append((name, process))
            deadline = time.monotonic() + 120
            while not healthy(url):
                if stop or process.poll() is not None or time.monotonic() > deadline:
                    print(f"run_stack: {name} did not become healthy", file=sys.stderr)
                    return 1
                time.sleep(0.2)
        print("\nkvguard is up:\n  guard     http://127.0.0.1:8000/v1  (OpenAI-compatible; /metrics, /health)\n"
              "  engine    http://127.0.0.1:8100       (/telemetry, /telemetry/stream, /metrics)\n"
              "  fallback  http://127.0.0.1:8101\n" + more_urls +
              "demo API keys: sk-acme-demo (acme, weight 2), sk-globex-demo (globex), sk-bulk-demo (bulk)\n"
              "try: curl -s http://127.0.0.1:8000/v1/completions -H 'Authorization: Bearer sk-acme-demo' "
              "-H 'Content-Type: application/json' -d '{\"model\": \"tiny\", \"prompt\": \"Hello\", \"max_tokens\": 16}'\n"
              "Ctrl-C stops everything.", flush=True)
        while not stop:
            for name, process in running:
                if process.poll() is not None:
                    print(f"run_stack: {name} exited with {process.returncode}; stopping", file=sys.stderr)
                    return 1
            time.sleep(0.5)
        return 0
    finally:
        for _, process in reversed(running):
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()


if __name__ == "__main__":
    sys.exit(main())
