"""``python -m guard --workers N``: N guard processes on one port (SO_REUSEPORT) sharing state through a real
Redis, in front of a real tiny engine; each worker's own metrics on its private port; refused without
``shared_state``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from support.guard_server import guard_config
from support.net import free_port, free_ports_in_a_row, health, request
from support.processes import Processes, run_bench, run_command
from support.redis_server import RedisServer
from support.wait import wait_for

STREAMS = 40


def series(url: str, name: str) -> dict[str, float]:
    """Every sample of ``name`` in the Prometheus text at ``url``, by its label string."""
    status, body = request(url, timeout=5)
    assert status == 200, body
    found = {}
    for line in body.decode().splitlines():
        if match := re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line):
            found[match[1] or ""] = float(match[2])
    return found


def link(url: str) -> tuple[float | None, float | None]:
    """A worker's ``guard_shared_state_up`` and ``guard_shared_state_guards`` (None before it listens)."""
    try:
        return series(url, "guard_shared_state_up").get(""), series(url, "guard_shared_state_guards").get("")
    except OSError:
        return None, None


def completed(url: str) -> float:
    return sum(v for labels, v in series(url, "guard_requests_total").items() if 'outcome="completed"' in labels)


async def stream(session: aiohttp.ClientSession, url: str, i: int) -> list[bytes]:
    """One streamed completion on a connection of its own, read to its end: its SSE data lines."""
    async with session.post(url + "/v1/completions", headers={"Authorization": "Bearer sk-acme"}, json={
            "model": "tiny", "prompt": f"stream {i}", "max_tokens": 12, "ignore_eos": True,
            "stream": True}) as answer:
        assert answer.status == 200, await answer.text()
        return [line.strip() async for line in answer.content if line.startswith(b"data: ")]


async def many_streams(url: str) -> list[list[bytes]]:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # one connection per stream
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        return await asyncio.gather(*(stream(session, url, i) for i in range(STREAMS)))


def test_two_workers_share_the_port_and_serve_every_stream(tmp_path: Path, processes: Processes) -> None:
    redis = processes.add(RedisServer(tmp_path))
    engine = processes.engine("--num-blocks", "512")
    metrics = free_ports_in_a_row(3)  # worker 0's and worker 1's metrics, then the console: none can collide
    admin = metrics + 2
    guard_config(engine.url, tmp_path, listen={"host": "127.0.0.1", "port": free_port()},
                 shared_state={"redis_url": redis.url}, admin={"host": "127.0.0.1", "port": admin})
    guard = processes.guard(tmp_path / "guard.yaml", "--workers", "2", "--metrics-port", str(metrics))
    workers = [f"http://127.0.0.1:{metrics + i}/metrics" for i in range(2)]
    for url in workers:  # each worker up, its link to Redis up, and each sees both
        wait_for(lambda u=url: link(u), lambda seen: seen == (1.0, 2.0), 30,
                 message=lambda u=url: f"{u}: {link(u)}\n{guard.log_tail()}")

    answers = asyncio.run(many_streams(guard.url))
    assert all(lines[-1] == b"data: [DONE]" and len(lines) > 2 for lines in answers), answers
    served = [completed(url) for url in workers]
    assert sum(served) == STREAMS and all(served), f"completed per worker: {served}"
    for url in workers:  # every admission went through the shared ledger
        admits = series(url, "guard_shared_state_round_trip_seconds_count")
        assert admits.get('{op="admit"}', 0) > 0, admits
    assert request(f"http://127.0.0.1:{admin}/state")[0] == 200, "worker 0 runs the console"
    assert guard.log_text().count("guard.console: operator console on") == 1, guard.log_tail()

    guard.send_signal(signal.SIGHUP)  # forwarded: each worker re-reads the file (unchanged: accepted)
    for url in workers:
        wait_for(lambda u=url: series(u, "guard_config_reloads_total").get('{result="ok"}'), bool, 10)
    assert len({tuple(series(url, "guard_config_info")) for url in workers}) == 1, "one config hash"
    assert guard.stop() == 0, guard.log_tail()
    assert "exited" not in guard.log_text() and "killed" not in guard.log_text(), guard.log_tail()


def test_a_worker_that_dies_is_reported_and_the_others_stopped(tmp_path: Path, processes: Processes) -> None:
    redis = processes.add(RedisServer(tmp_path))
    metrics = free_ports_in_a_row(2)
    guard_config("http://127.0.0.1:9", tmp_path, listen={"host": "127.0.0.1", "port": free_port()},
                 shared_state={"redis_url": redis.url})
    guard = processes.guard(tmp_path / "guard.yaml", "--workers", "2", "--metrics-port", str(metrics))
    said = wait_for(lambda: dict(re.findall(r"guard worker (\d) \(pid (\d+)\)", guard.log_text())),
                    lambda found: "1" in found, 20, message=lambda: guard.log_tail())
    worker = int(said["1"])
    os.kill(worker, signal.SIGKILL)
    assert guard.wait(20) == 1, guard.log_tail()
    assert f"worker 1 (pid {worker}) was killed by SIGKILL; stopping the other workers" in guard.log_text()


def test_a_worker_that_does_not_stop_is_killed_and_the_supervisor_ends(tmp_path: Path, processes: Processes) -> None:
    """Worker 0 stopped (SIGSTOP: it cannot act on SIGTERM), worker 1 killed: the supervisor tells worker 0 to
    stop, and kills it shutdown_timeout + 5 s later."""
    redis = processes.add(RedisServer(tmp_path))
    guard_config("http://127.0.0.1:9", tmp_path, listen={"host": "127.0.0.1", "port": free_port()},
                 shared_state={"redis_url": redis.url}, limits={"shutdown_timeout": 0.5})
    guard = processes.guard(tmp_path / "guard.yaml", "--workers", "2", "--metrics-port", "0")
    said = wait_for(lambda: dict(re.findall(r"guard worker (\d) \(pid (\d+)\)", guard.log_text())),
                    lambda found: len(found) == 2, 20, message=lambda: guard.log_tail())
    os.kill(int(said["0"]), signal.SIGSTOP)
    os.kill(int(said["1"]), signal.SIGKILL)
    try:
        code = guard.wait(20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the supervisor did not end:\n{guard.log_tail()}")
    assert code == 1
    assert "workers [0] still running 5.5 s after being told to stop; killing them" in guard.log_text()
    assert f"worker 0 (pid {said['0']}) was killed by SIGKILL" in guard.log_text()


def test_workers_drain_on_sigterm_with_the_supervisors_drain_delay(tmp_path: Path, processes: Processes) -> None:
    """``--drain-delay`` reaches every worker: SIGTERM to the supervisor turns each worker's /health 503
    draining while the shared port still serves, and the supervisor exits 0 once they have."""
    redis = processes.add(RedisServer(tmp_path))
    metrics = free_ports_in_a_row(2)
    guard_config("http://127.0.0.1:9", tmp_path, listen={"host": "127.0.0.1", "port": free_port()},
                 shared_state={"redis_url": redis.url})
    guard = processes.guard(tmp_path / "guard.yaml", "--workers", "2", "--metrics-port", str(metrics),
                            "--drain-delay", "4")
    for i in range(2):
        wait_for(lambda i=i: health(f"http://127.0.0.1:{metrics + i}"), lambda status: status == 200, 30,
                 message=lambda: guard.log_tail())
    guard.send_signal(signal.SIGTERM)
    for i in range(2):
        _, body = wait_for(lambda i=i: request(f"http://127.0.0.1:{metrics + i}/health", timeout=5),
                           lambda answer: answer[0] == 503, 5, message=lambda: guard.log_tail())
        assert json.loads(body)["status"] == "draining", body
    assert health(guard.url) == 503, "the shared port serves (draining) until the delay ends"
    assert guard.wait(20) == 0, guard.log_tail()


def test_several_workers_need_shared_state(tmp_path: Path) -> None:
    guard_config("http://127.0.0.1:9", tmp_path, listen={"host": "127.0.0.1", "port": free_port()})
    done = run_command(sys.executable, "-m", "guard", "--config", tmp_path / "guard.yaml", "--workers", "2",
                       timeout=30)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--workers 2: several workers need shared_state" in done.stderr


@pytest.mark.slow  # 16 s of a suite that must stay under 15 minutes; make test-slow runs it
def test_guard_scale_benchmark_quick(tmp_path: Path) -> None:
    """bench/guard_scale.py --quick (about 20 s) still measures every target, the side-by-side cost and the
    Redis round trips; no figure is asserted (a shared machine's figures say nothing about the code)."""
    _, report = run_bench("guard_scale.py", tmp_path, timeout=120)
    assert set(report["summary"]) == {"direct", "alone", "redis1", "redis2"}
    for name, row in report["summary"].items():
        assert row["requests_per_s"] > 0 and row["errors"] == 0, (name, row)
        assert ("redis" in row) == (name in ("redis1", "redis2")), name
    redis = report["summary"]["redis1"]["redis"]
    assert redis["calls_per_request"] > 0 and redis["ops_per_trip"] >= 2, "admit and release at least, batched"
    assert len(report["side_by_side_cpu_ratios"]) == 1
    assert set(report["verdicts"]) >= {"shared_state_cost", "two_workers_over_one", "two_workers_with_a_core_each"}
