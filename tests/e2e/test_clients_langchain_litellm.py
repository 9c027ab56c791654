"""Real clients through the guard (issue 14): LangChain's ``ChatOpenAI`` and ``OpenAI``, and litellm.

What these check is the wire: the shapes these libraries send (a prompt list, ``response_format`` built from
a pydantic model, a named tool with ``parallel_tool_calls: false``, ``stream_options``) and the shapes and
error texts they parse (``tool_calls``, ``This model's maximum context length is ...``, 404
``model_not_found``). So the engine is the built-in tiny model (random weights: the fast one); its answers
have the right shape whatever their words, and the structured ones are held to a schema whose every part is
bounded, which even random weights complete. Nothing here reaches the internet: the clients talk to
loopback only, and litellm reads its bundled model cost map instead of downloading one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import ModuleType
from typing import Literal

import openai
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_openai import ChatOpenAI, OpenAI
from pydantic import BaseModel, Field
from support.engine_server import ServerThread
from support.guard_server import GuardThread, guard_config

MODEL = "tiny"
KEY = "sk-acme"


class Verdict(BaseModel):
    """A schema bounded in every part (enum, boolean, small integer), so random weights complete it."""

    label: Literal["spam", "ham"]
    urgent: bool
    score: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def guard_url() -> Iterator[str]:
    with ServerThread(num_blocks=256) as engine, GuardThread(guard_config(engine.url)) as guard:
        yield guard.url


@pytest.fixture(scope="module")
def chat(guard_url: str) -> ChatOpenAI:
    # Room for a whole Verdict: 46 tokens of the byte tokenizer, EOS included.
    return ChatOpenAI(model=MODEL, base_url=guard_url + "/v1", api_key=KEY, max_tokens=48, temperature=0,
                      max_retries=0)


@pytest.fixture(scope="module")
def litellm() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read at import: no download of the cost map
        import litellm

        yield litellm


def test_chat_invoke_stream_and_batch(chat: ChatOpenAI) -> None:
    answer = chat.invoke("Say hello.")
    assert isinstance(answer, AIMessage) and isinstance(answer.content, str)
    assert answer.response_metadata["finish_reason"] in ("stop", "length")
    chunks = list(chat.stream("Say hello."))
    assert chunks and all(isinstance(chunk, AIMessageChunk) for chunk in chunks)
    assert isinstance(sum(chunks[1:], chunks[0]).content, str)
    answers = chat.batch(["One.", "Two."])
    assert len(answers) == 2 and all(isinstance(a, AIMessage) for a in answers)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_a_model_instance(chat: ChatOpenAI, method: str) -> None:
    """``json_schema`` is LangChain's default (``response_format``); ``function_calling`` binds the schema as
    the one tool and names it in ``tool_choice``."""
    verdict = chat.with_structured_output(Verdict, method=method).invoke("Is this spam?")
    assert isinstance(verdict, Verdict)


def test_a_streamed_tool_call_through_langchain(chat: ChatOpenAI) -> None:
    bound = chat.bind_tools([Verdict], tool_choice="Verdict", parallel_tool_calls=False)
    chunks = list(bound.stream("Is this spam?"))
    message = sum(chunks[1:], chunks[0])
    [call] = message.tool_calls
    assert call["name"] == "Verdict"
    Verdict.model_validate(call["args"])


def test_completions_batch_of_two_prompts(guard_url: str) -> None:
    """LangChain's ``OpenAI.batch`` sends one ``/v1/completions`` with a list of prompts."""
    llm = OpenAI(model=MODEL, base_url=guard_url + "/v1", api_key=KEY, max_tokens=6, temperature=0,
                 max_retries=0)
    answers = llm.batch(["First prompt", "Second prompt"])
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)


def test_completions_batch_from_the_static_fallback() -> None:
    """A guard whose engine is down answers from its static fallback: one choice per prompt, as many as n
    asks, numbered as an engine numbers them, streamed or not."""
    config = guard_config("http://127.0.0.1:9", fallbacks=[{"name": "static", "message": "busy"}],
                          admission={"telemetry_stale_s": 0.5})
    with GuardThread(config) as guard:
        llm = OpenAI(model=MODEL, base_url=guard.url + "/v1", api_key=KEY, max_tokens=6, max_retries=0)
        assert llm.batch(["First prompt", "Second prompt"]) == ["busy", "busy"]
        client = openai.OpenAI(base_url=guard.url + "/v1", api_key=KEY, max_retries=0)  # for the raw answers
        for stream in (False, True):
            answer = client.completions.with_raw_response.create(model=MODEL, prompt=["a", "b"], n=2,
                                                                stream=stream)
            assert answer.headers["X-Guard-Route"] == "static"
            parsed = answer.parse()
            choices = [c for chunk in parsed for c in chunk.choices] if stream else parsed.choices
            assert sorted(c.index for c in choices) == [0, 1, 2, 3]
            assert {(c.text, c.finish_reason) for c in choices} == {("busy", "stop")}


def test_litellm_raises_its_typed_errors(guard_url: str, litellm: ModuleType) -> None:
    base = {"api_base": guard_url + "/v1", "api_key": KEY, "max_tokens": 4, "num_retries": 0}
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model=f"openai/{MODEL}", messages=[{"role": "user", "content": "x" * 3000}], **base)
    with pytest.raises(litellm.NotFoundError):
        litellm.completion(model="openai/no-such-model", messages=[{"role": "user", "content": "hi"}], **base)
    answer = litellm.completion(model=f"openai/{MODEL}", messages=[{"role": "user", "content": "hi"}], **base)
    assert isinstance(answer.choices[0].message.content, str)
    json.dumps(answer.model_dump())  # the typed answer is plain data
