"""Bad requests get a 400 in the OpenAI error shape naming the field, and never reach the scheduler."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from support.engine_server import ServerThread
from support.net import request

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_PROMPT = {"model": "tiny", "prompt": "hello"}
OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(num_blocks=128, block_size=16, max_num_seqs=8) as running:
        yield running


def engine_state(server: ServerThread) -> tuple:
    snap = server.telemetry()
    return (snap["step"], snap["prompt_tokens_total"], snap["num_waiting"], snap["num_running"],
            snap["free_blocks"], snap["prefix_cache_queries_total"])


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, b'{"model": "tiny", "prompt": ', "body"),
        (COMPLETIONS, b'["not", "an", "object"]', "body"),
        (COMPLETIONS, {"prompt": "hello"}, "model"),
        (COMPLETIONS, {**OK_PROMPT, "max_tokens": "12"}, "max_tokens"),
        (COMPLETIONS, {**OK_PROMPT, "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {**OK_PROMPT, "max_tokens": 1_000_000}, "max_tokens"),
        (COMPLETIONS, {**OK_PROMPT, "n": 0}, "n"),
        (COMPLETIONS, {**OK_PROMPT, "n": 129}, "n"),
        (COMPLETIONS, {**OK_PROMPT, "n": 9}, "n"),  # above max_num_seqs: the engine's own check
        (COMPLETIONS, {**OK_PROMPT, "temperature": 2.5}, "temperature"),
        (COMPLETIONS, {**OK_PROMPT, "temperature": True}, "temperature"),
        (COMPLETIONS, {**OK_PROMPT, "stream": "yes"}, "stream"),
        (COMPLETIONS, {**OK_PROMPT, "stop": ["ok", ""]}, "stop[1]"),
        (COMPLETIONS, {**OK_PROMPT, "echo": True}, "echo"),
        (COMPLETIONS, {**OK_PROMPT, "prompt": ""}, "prompt"),
        (COMPLETIONS, {**OK_PROMPT, "prompt": "x" * 2100}, "prompt"),
        (COMPLETIONS, {**OK_PROMPT, "prompt": [1, 99999]}, "prompt"),
        # A batch is refused whole when any prompt is: the good first one must not be queued either.
        (COMPLETIONS, {**OK_PROMPT, "prompt": ["a", [1, 99999]]}, "prompt"),
        (COMPLETIONS, {**OK_PROMPT, "prompt": ["a", "x" * 2100]}, "prompt"),
        (COMPLETIONS, {**OK_PROMPT, "prompt": ["a", ""]}, "prompt[1]"),
        (COMPLETIONS, {**OK_PROMPT, "prompt": ["a"] * 129}, "prompt"),
        (COMPLETIONS, {**OK_PROMPT, "prompt": []}, "prompt"),
        (COMPLETIONS, {**OK_PROMPT, "priority": 1.5}, "priority"),
        (CHAT, {**OK_CHAT, "messages": []}, "messages"),
        (CHAT, {**OK_CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0].type"),
        (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "x" * 2100}]}, "messages"),
        (CHAT, {**OK_CHAT, "max_completion_tokens": 5000}, "max_completion_tokens"),
        (CHAT, {**OK_CHAT, "max_tokens": 5000}, "max_tokens"),
        (CHAT, {**OK_CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    ],
)
def test_invalid_requests_are_400_naming_the_field(server: ServerThread, path: str, body: object,
                                                   param: str) -> None:
    before = engine_state(server)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, answer = request(server.url + path, raw)
    error = json.loads(answer)["error"]
    assert status == 400, answer
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    if error["code"] == "context_length_exceeded":  # in OpenAI's words, which clients match on
        assert error["message"].startswith("This model's maximum context length is 2048 tokens."), error
    else:
        assert error["message"].startswith(f"{param}:"), error
    assert engine_state(server) == before, "nothing entered the scheduler"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, "/tokenize"])
def test_a_model_not_served_here_is_404_model_not_found(server: ServerThread, path: str) -> None:
    before = engine_state(server)
    body = {**(OK_CHAT if path == CHAT else OK_PROMPT), "model": "gpt-4"}
    status, answer = request(server.url + path, json.dumps(body).encode())
    error = json.loads(answer)["error"]
    assert status == 404, answer
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
    assert error["message"].startswith("model:"), error
    assert engine_state(server) == before, "nothing entered the scheduler"


def test_unknown_fields_are_ignored_as_openai_does(server: ServerThread) -> None:
    body = {**OK_PROMPT, "max_tokens": 2, "some_future_field": {"x": 1}, "logprobs": None}
    status, answer = request(server.url + COMPLETIONS, json.dumps(body).encode())
    assert status == 200, answer


def test_bad_tenant_header(server: ServerThread) -> None:
    status, answer = request(server.url + COMPLETIONS, json.dumps(OK_PROMPT).encode(), {"X-Tenant-Id": "a" * 200})
    assert status == 400 and json.loads(answer)["error"]["param"] == "X-Tenant-Id"


@pytest.mark.parametrize(("path", "body", "status"), [("/v1/nothing", None, 404), (COMPLETIONS, None, 405)])
def test_http_errors_use_the_same_shape(server: ServerThread, path: str, body: bytes | None, status: int) -> None:
    code, answer = request(server.url + path, body)
    assert code == status
    assert set(json.loads(answer)["error"]) == {"message", "type", "param", "code"}


def test_oversized_body_is_413(server: ServerThread) -> None:
    code, answer = request(server.url + COMPLETIONS, b'{"prompt": "' + b"x" * (2 << 20) + b'"}')
    assert code == 413 and json.loads(answer)["error"]["type"] == "invalid_request_error"
