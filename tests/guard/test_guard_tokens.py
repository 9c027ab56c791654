"""The guard counts prompts itself with the ``PromptCounter`` rebuilt from the engine's ``GET /tokenizer``:
its counts must equal the engine's own ``POST /tokenize``, and its refusals the engine's, for the built-in
byte tokenizer, for a checkpoint with a ``tokenizer.json`` and a chat template of its own, and for ``smollm2``,
whose tokenizer and template the engine rebuilds from GGUF metadata."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import gguf
import pytest
import tokenizers
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.engine_server import ServerThread
from support.hf_reference import SMALL, save_hf_model
from support.net import request
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine.model.sources import SMOLLM2, smollm2_path
from engine.prompting.gguf_vocab import read_gguf_vocab
from engine.prompting.prompts import PromptCounter, PromptError
from engine.protocol import CompletionRequest, TokenizerInfo
from guard.errors import GuardError
from guard.http.tokens import TokenCounter
from guard.http.validate import MODELS, ParsedRequest

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Grüße aus München 🙂", "def f(x):\n    return x\n"] * 30
# A template unlike the default: special tokens, a system prefix and a role check that can refuse.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}<|assistant|>"
)
ROLES = st.sampled_from(["system", "user", "assistant"])
TEXT = st.text(st.characters(codec="utf-8"), max_size=60)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bpe-model")
    save_hf_model(transformers.Qwen2Config, dict(SMALL, vocab_size=512), directory)
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    return directory


@pytest.fixture(scope="module", params=["tiny", "bpe", SMOLLM2])
def engine(request: pytest.FixtureRequest, checkpoint: Path):
    model = str(checkpoint) if request.param == "bpe" else request.param
    with ServerThread(model=model, num_blocks=64) as server:
        yield server


def tokenizer_info(engine: ServerThread) -> TokenizerInfo:
    status, body = request(engine.url + "/tokenizer")
    assert status == 200
    return TokenizerInfo.model_validate_json(body)


@pytest.fixture(scope="module")
def local(engine: ServerThread) -> PromptCounter:
    """The guard's counter for ``engine``, rebuilt once: SmolLM2's tokenizer.json is megabytes to parse."""
    return PromptCounter.from_info(tokenizer_info(engine))


def parsed(path: str, body: dict) -> ParsedRequest:
    return ParsedRequest(path, body, MODELS[path].model_validate(body))


def engine_count(engine: ServerThread, body: dict) -> tuple[int, dict]:
    query = {key: body[key] for key in ("model", "prompt", "messages") if key in body}
    status, answer = request(engine.url + "/tokenize", json.dumps(query).encode())
    return status, json.loads(answer)


def test_the_engine_hands_out_its_tokenizer(engine: ServerThread, checkpoint: Path) -> None:
    info = tokenizer_info(engine)
    assert info.max_model_len == engine.core.max_model_len and info.model == engine.core.model_name
    if info.model == "tiny":
        assert info.kind == "bytes" and info.tokenizer_json is None
    elif info.model == SMOLLM2:
        reader = gguf.GGUFReader(smollm2_path())
        assert info.kind == "hf" and info.tokenizer_json == read_gguf_vocab(reader).tokenizer.to_json()
        assert (info.chat_template, info.bos_token, info.eos_token) == (
            reader.fields["tokenizer.chat_template"].contents(), "<|im_start|>", "<|im_end|>")
    else:
        assert info.kind == "hf" and json.loads(info.tokenizer_json) == json.loads(
            (checkpoint / "tokenizer.json").read_text())
        assert (info.chat_template, info.bos_token, info.eos_token) == (CHAT_TEMPLATE, "<s>", "</s>")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=TEXT.filter(bool), messages=st.lists(st.tuples(ROLES, TEXT), min_size=1, max_size=4))
def test_local_counts_equal_the_engines(engine: ServerThread, local: PromptCounter, prompt: str,
                                        messages: list) -> None:
    model = local.model
    completion = {"model": model, "prompt": prompt}
    chat = {"model": model, "messages": [{"role": role, "content": text} for role, text in messages]}
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        status, answer = engine_count(engine, body)
        if status != 200:  # text that encodes to no token (SmolLM2 drops some control characters): refused
            assert_same_refusal(local, path, body, status, answer)
            continue
        ids = local.request_ids(parsed(path, body).model)
        assert ids == answer["tokens"] and len(ids) == answer["count"]


def test_refusals_match_the_engines(engine: ServerThread, local: PromptCounter) -> None:
    wrong_model = {"model": "another-model", "prompt": "hi"}
    refused = {"model": local.model, "messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}
    cases = [("/v1/completions", wrong_model)]
    if local.template.source == CHAT_TEMPLATE:  # only the BPE checkpoint's template refuses a role
        cases.append(("/v1/chat/completions", refused))
    for path, body in cases:
        status, answer = engine_count(engine, body)
        assert_same_refusal(local, path, body, status, answer)


def assert_same_refusal(local: PromptCounter, path: str, body: dict, status: int, answer: dict) -> None:
    """The local counter refuses ``body`` exactly as the engine's ``/tokenize`` did (``status``, ``answer``)."""
    with pytest.raises(PromptError) as info:
        local.request_ids(parsed(path, body).model)
    error = answer["error"]
    assert (info.value.status, str(info.value), info.value.param, info.value.code) == (
        status, error["message"], error["param"], error["code"])


async def test_context_refusals_match_the_engines(engine: ServerThread) -> None:
    window = engine.core.max_model_len
    model = engine.core.model_name
    cases = [
        ("/v1/completions", {"model": model, "prompt": [1] * window}),
        ("/v1/completions", {"model": model, "prompt": [1] * 10, "max_tokens": window}),
        ("/v1/completions", {"model": model, "prompt": [[1] * 10, [1] * window]}),  # a batch: each prompt fits
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Grüße " * window}]}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                  "max_completion_tokens": window}),
    ]
    async with aiohttp.ClientSession() as session:
        counter = TokenCounter(session, lambda: engine.url, timeout_s=5)
        for path, body in cases:
            status, answer = request(engine.url + path, json.dumps(body).encode())
            with pytest.raises(GuardError) as info:
                await counter.count(parsed(path, body))
            error = json.loads(answer)["error"]
            assert error["code"] == "context_length_exceeded", error
            assert (info.value.status, info.value.message, info.value.param, info.value.code) == (
                status, error["message"], error["param"], error["code"])


async def test_a_model_change_fetches_the_tokenizer_again(engine: ServerThread) -> None:
    async with aiohttp.ClientSession() as session:
        counter = TokenCounter(session, lambda: engine.url, timeout_s=5)
        body = {"model": engine.core.model_name, "prompt": "count me", "max_tokens": 4}
        request_ = ParsedRequest("/v1/completions", body, CompletionRequest.model_validate(body))
        limits = await counter.count(request_)
        assert counter.local is not None and limits.max_tokens == 4
        assert limits.prompt_tokens == engine_count(engine, body)[1]["count"]
        counter.on_model(engine.core.model_name)
        assert counter.local is not None, "the same model keeps its tokenizer"
        counter.on_model("a-new-model")
        assert counter.local is None
        await counter.count(request_)
        assert counter.local is not None and counter.local.model == engine.core.model_name


async def test_the_first_snapshot_fetches_the_tokenizer_before_any_request(engine: ServerThread) -> None:
    async with aiohttp.ClientSession() as session:
        counter = TokenCounter(session, lambda: engine.url, timeout_s=5)
        counter.on_model(engine.core.model_name)  # what the guard does with each telemetry snapshot
        for _ in range(100):
            if counter.local is not None:
                break
            await asyncio.sleep(0.05)
        assert counter.local is not None and counter.local.model == engine.core.model_name


async def test_a_batch_is_counted_prompt_by_prompt_with_or_without_the_tokenizer(engine: ServerThread) -> None:
    """Locally, and through ``POST /tokenize`` (one call per prompt) for an engine without ``GET /tokenizer``:
    the same counts, and one output bound that fits beside every prompt."""
    model, window = engine.core.model_name, engine.core.max_model_len
    body = {"model": model, "prompt": ["one prompt", [5, 6, 7]], "max_tokens": None}
    expected = [engine_count(engine, {"model": model, "prompt": p})[1]["count"] for p in body["prompt"]]
    async with aiohttp.ClientSession() as session:
        for remote in (False, True):
            counter = TokenCounter(session, lambda: engine.url, timeout_s=5)
            counter.remote_only = remote
            limits = await counter.count(parsed("/v1/completions", body))
            assert (limits.prompts, limits.prompt_tokens) == (expected, sum(expected)), remote
            assert limits.max_tokens == window - max(expected), remote
