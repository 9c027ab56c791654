"""Reliability, hostile and broken input (issue 7, cases 9 to 12), against the real engine: oversized and
malformed requests are refused before anything reaches the engine, no client-sent header or field chooses
the tenant or its cache salt, and the prefix cache never serves one tenant's prompt to another. Every
case ends with nothing lost."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from multidict import CIMultiDict
from support.engine_server import ServerThread
from support.guard_server import GuardThread, guard_config
from support.nothing_lost import Answer, Client, Tally, assert_nothing_lost, assert_openai_error, ready_guard

MAX_BODY = 4096


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerThread]:
    with ServerThread(num_blocks=256) as server:
        yield server


@pytest.fixture
async def guard(engine: ServerThread) -> AsyncIterator[GuardThread]:
    async with ready_guard(guard_config(engine.url, limits={"max_body_bytes": MAX_BODY})) as g:
        yield g


def engine_work(engine: ServerThread) -> tuple[int, int]:
    """Prompt and generated tokens the engine has processed: unchanged means nothing reached it."""
    snapshot = engine.telemetry()
    return snapshot["prompt_tokens_total"], snapshot["generation_tokens_total"]


def upstream_calls(guard: GuardThread) -> float:
    return guard.call(lambda: sum(sample.value for metric in guard.state.metrics.upstream_requests.collect()
                                  for sample in metric.samples if sample.name.endswith("_total")))


async def raw_exchange(url: str, head: bytes) -> Answer:
    """Send only ``head`` (request line and headers, no body) and read the answer that comes back."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head)
        status_line, *header_lines = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        headers = CIMultiDict(line.split(": ", 1) for line in header_lines if line)
        body = await reader.readexactly(int(headers["Content-Length"]))
        return Answer(int(status_line.split()[1]), headers, body)
    finally:
        writer.close()


async def test_09_body_over_the_limit_is_a_413_before_the_body_is_read(guard: GuardThread,
                                                                      engine: ServerThread) -> None:
    tally = Tally()
    client = Client(guard.url, tally)
    work = engine_work(engine)
    # The declared length alone is enough: the answer comes although not one byte of the body was sent.
    tally.sent += 1
    answer = await asyncio.wait_for(raw_exchange(guard.url, (
        "POST /v1/completions HTTP/1.1\r\nHost: guard\r\nAuthorization: Bearer sk-acme\r\n"
        f"Content-Type: application/json\r\nContent-Length: {10 * MAX_BODY}\r\n\r\n").encode()), 5)
    tally.answered += 1
    assert_openai_error(answer, 413, "request_too_large")

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the limit applies while reading
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(2 * MAX_BODY // 1024):
            yield b"x" * 1024
        yield b'"}'

    answer = await client.call(data=chunked(), headers={"Content-Type": "application/json"})
    assert_openai_error(answer, 413, "request_too_large")
    assert engine_work(engine) == work and upstream_calls(guard) == 0, "the engine was never contacted"
    await assert_nothing_lost(guard, tally, [engine])


INVALID: list[tuple[str, bytes | dict[str, Any], str]] = [
    ("malformed JSON", b'{"model": "tiny", "prompt": "x",', "body"),
    ("not an object", b'["tiny", "x"]', "body"),
    ("prompt of the wrong type", {"prompt": 42}, "prompt"),
    ("temperature of the wrong type", {"temperature": "hot"}, "temperature"),
    ("stream of the wrong type", {"stream": "yes"}, "stream"),
    ("max_tokens negative", {"max_tokens": -5}, "max_tokens"),
    ("max_tokens zero", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens huge", {"max_tokens": 10**12}, "max_tokens"),
    ("max_tokens beyond 64 bits", {"max_tokens": 2**70}, "max_tokens"),
    ("max_tokens a string", {"max_tokens": "12"}, "max_tokens"),
    ("max_tokens a float", {"max_tokens": 1.5}, "max_tokens"),
    ("max_tokens a boolean", {"max_tokens": True}, "max_tokens"),
    ("prompt over the context window", {"prompt": "x" * 2100, "max_tokens": 1}, "prompt"),
    ("prompt plus max_tokens over the window", {"prompt": "x" * 1000, "max_tokens": 1100}, "max_tokens"),
]


async def test_10_malformed_or_mistyped_requests_get_400_with_param_and_reach_nothing(
        guard: GuardThread, engine: ServerThread) -> None:
    tally = Tally()
    client = Client(guard.url, tally)
    work = engine_work(engine)
    for name, body, param in INVALID:
        data = body if isinstance(body, bytes) else json.dumps({"model": "tiny", "prompt": "x", **body}).encode()
        answer = await client.call(data=data, headers={"Content-Type": "application/json"})
        assert answer.status == 400, (name, answer.body)
        assert_openai_error(answer, 400, param=param)
    answer = await client.call(data=b"prompt=x", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert_openai_error(answer, 400, "invalid_content_type", param="Content-Type")
    chat_over_window = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 2100}]}
    answer = await client.call(chat_over_window, path="/v1/chat/completions")
    assert_openai_error(answer, 400, "context_length_exceeded", param="messages")
    assert engine_work(engine) == work, "nothing reached the engine's scheduler"
    await assert_nothing_lost(guard, tally, [engine])


def cached_tokens(answer: Answer) -> int:
    assert answer.status == 200, answer.body
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def tenant_prompt_tokens(engine: ServerThread, tenant: str) -> int:
    return engine.telemetry()["tenants"].get(tenant, {}).get("prompt_tokens_total", 0)


def long_prompt() -> str:
    """A prompt no other test sends (a fresh prefix), long enough to fill many cache blocks."""
    return f"{uuid.uuid4().hex} " + "the same long shared document " * 20


async def test_11_spoofed_tenant_headers_salt_and_user_change_nothing(guard: GuardThread,
                                                                     engine: ServerThread) -> None:
    """globex presents every claim to be acme a client could make, acme's real cache salt included (as if
    it had leaked): the answer is globex's, accounted to globex, and acme's cached prefix stays out of reach."""
    tally = Tally()
    client = Client(guard.url, tally)
    prompt = long_prompt()
    assert cached_tokens(await client.call({"model": "tiny", "prompt": prompt, "max_tokens": 1})) == 0
    acme_salt = hmac.new(b"test-secret", b"acme", hashlib.sha256).hexdigest()
    acme_before, globex_before = tenant_prompt_tokens(engine, "acme"), tenant_prompt_tokens(engine, "globex")
    spoofed = await client.call(
        {"model": "tiny", "prompt": prompt, "max_tokens": 1, "cache_salt": acme_salt, "user": "acme",
         "tenant": "acme", "tenant_id": "acme", "x_tenant_id": "acme", "priority": -100},
        key="sk-globex",
        headers={"X-Tenant-Id": "acme", "X_Tenant_Id": "acme", "X-Tenant_Id": "acme", "x_tenant_id": "acme",
                 "X-Guard-Tenant": "acme", "X_Guard_Tenant": "acme", "X-Forwarded-User": "acme"})
    assert spoofed.headers["X-Guard-Tenant"] == "globex"
    assert cached_tokens(spoofed) == 0, "globex reached acme's prefix cache: the salt was the client's"
    prompt_tokens = spoofed.json()["usage"]["prompt_tokens"]
    assert tenant_prompt_tokens(engine, "globex") == globex_before + prompt_tokens
    assert tenant_prompt_tokens(engine, "acme") == acme_before, "nothing was accounted to acme"
    await assert_nothing_lost(guard, tally, [engine])


async def test_12_prefix_cache_is_shared_within_a_tenant_and_never_across(guard: GuardThread,
                                                                         engine: ServerThread) -> None:
    tally = Tally()
    client = Client(guard.url, tally)
    prompt = long_prompt()
    same = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    for key in ("sk-acme", "sk-globex", "sk-bulk"):
        assert cached_tokens(await client.call(same, key=key)) == 0, f"{key} saw another tenant's cached prefix"
    for key in ("sk-acme", "sk-globex", "sk-bulk"):
        assert cached_tokens(await client.call(same, key=key)) > 0, f"{key} did not reuse its own prefix"
    await assert_nothing_lost(guard, tally, [engine])
