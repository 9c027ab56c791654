"""Two guards on one real Redis share a batch: the guard running it is killed (SIGKILL) mid-batch and the
other takes it over once the lease lapses. Every line is answered exactly once: the output file has each
``custom_id`` once, and Redis holds one result per line."""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path

import openai
import redis
from support.engine_server import ServerThread
from support.guard_server import guard_config
from support.net import free_port, request
from support.processes import Processes
from support.redis_server import RedisServer
from support.wait import wait_for

LINES = 60


def guard_yaml(root: Path, name: str, engine_url: str, redis_url: str) -> Path:
    folder = root / name
    folder.mkdir()
    guard_config(engine_url, folder, listen={"host": "127.0.0.1", "port": free_port()},
                 shared_state={"redis_url": redis_url},
                 batch={"store": str(folder / "store"), "lease_ttl_s": 2, "max_in_flight": 2})
    return folder / "guard.yaml"


def lines_run(url: str) -> float:
    """guard_batch_requests_total{status="completed"} on one guard."""
    text = request(url + "/metrics")[1].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("guard_batch_requests_total{") and 'status="completed"' in line)


def test_a_killed_guards_batch_is_finished_by_the_other(tmp_path: Path, processes: Processes) -> None:
    with RedisServer(tmp_path) as server, ServerThread(num_blocks=256) as engine:
        guards = [processes.guard(guard_yaml(tmp_path, name, engine.url, server.url), name=name)
                  for name in ("g1", "g2")]
        sdk = openai.OpenAI(base_url=guards[0].url + "/v1", api_key="sk-acme", max_retries=0)
        body = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": {
            "model": "tiny", "prompt": f"count {i}", "max_tokens": 24, "temperature": 0, "ignore_eos": True}}) + "\n"
            for i in range(LINES))
        file = sdk.files.create(file=("in.jsonl", io.BytesIO(body.encode())), purpose="batch")
        batch = sdk.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
        wait_for(lambda: sdk.batches.retrieve(batch.id).request_counts.completed, lambda n: n >= 6, 60, interval=0.05)
        running = [g for g in guards if lines_run(g.url) > 0]
        assert len(running) == 1, "one guard at a time runs a batch"
        victim = running[0]
        survivor = guards[1] if victim is guards[0] else guards[0]
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        results = redis.Redis.from_url(server.url)
        assert 6 <= results.hlen(f"kvguard:batch:r:{batch.id}") < LINES, "killed mid-batch"

        sdk = openai.OpenAI(base_url=survivor.url + "/v1", api_key="sk-acme", max_retries=0)
        done = wait_for(lambda: sdk.batches.retrieve(batch.id), lambda b: b.status == "completed", 90, interval=0.2,
                        message=lambda: survivor.log_tail())
        assert (done.request_counts.completed, done.request_counts.failed) == (LINES, 0)
        assert lines_run(survivor.url) > 0, "the survivor ran the rest"
        out = [json.loads(line) for line in sdk.files.content(done.output_file_id).read().splitlines()]
        assert sorted(o["custom_id"] for o in out) == sorted(f"line-{i}" for i in range(LINES)), \
            "every custom_id exactly once"
        assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["usage"]["completion_tokens"] == 24
                   for o in out)
        assert results.hlen(f"kvguard:batch:r:{batch.id}") == LINES
