"""Structured outputs (issue 14): ``response_format`` and forced tool calls by constrained decoding.

SmolLM2 (one engine for the module, greedy) answers through the real openai SDK, straight and through the
guard: ``json_object`` parses, ``json_schema`` validates (jsonschema) for 20 prompts and schemas sent at
once, so that the engine batches them; tool calls come back as ``tool_calls`` whose arguments match their
function's schema, streamed too. The schemas bound their strings and arrays: the grammar guarantees the
shape, not that a small model stops talking, and the module must stay fast.

The built-in tiny model (random weights, byte tokenizer) checks the engine's mechanics offline, where a
bounded schema makes even random weights finish: masks do not leak into unconstrained rows of the same
batch, preemption (recompute and swap) leaves constrained outputs unchanged, and each of ``n`` completions
follows its own matcher.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from support.engine_server import ServerThread
from support.guard_server import GuardThread, guard_config
from support.invariants import assert_all_blocks_back

from engine import LLM, SamplingParams
from engine.structured.spec import GrammarSpec

MODEL = "smollm2"
WORD = {"type": "string", "maxLength": 12}


def _object(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


# Twenty prompts, each with its schema: nested objects, arrays, enums, integers and numbers with ranges,
# booleans, a const and a nullable field.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("Describe Alice, a 30-year-old engineer.", _object(name=WORD, age={"type": "integer", "minimum": 0,
                                                                         "maximum": 120})),
    ("What is the capital of France?", _object(country=WORD, capital=WORD)),
    ("Is the sky blue?", _object(answer={"type": "boolean"})),
    ("Name three primary colors.", _object(colors={"type": "array", "minItems": 3, "maxItems": 3,
                                                   "items": {"enum": ["red", "yellow", "blue", "green"]}})),
    ("Rate the movie Inception from 1 to 5.", _object(stars={"type": "integer", "minimum": 1, "maximum": 5})),
    ("What is 12 times 7?", _object(result={"type": "integer", "minimum": 0, "maximum": 1000})),
    ("Classify the sentiment of: I love this phone!", _object(sentiment={"enum": ["positive", "negative",
                                                                                  "neutral"]})),
    ("Give me a book with its author.", _object(book=_object(title=WORD, author=WORD))),
    ("List two fruits and their colors.", _object(fruits={"type": "array", "minItems": 2, "maxItems": 2,
                                                          "items": _object(name=WORD, color=WORD)})),
    ("Where is the Eiffel Tower?", _object(city=WORD, country=WORD)),
    ("What day comes after Monday?", _object(day={"enum": ["Monday", "Tuesday", "Wednesday", "Thursday",
                                                           "Friday", "Saturday", "Sunday"]})),
    ("Convert 100 degrees Celsius to Fahrenheit.", _object(celsius={"type": "integer", "minimum": -100,
                                                                    "maximum": 1000},
                                                           fahrenheit={"type": "integer", "minimum": -200,
                                                                       "maximum": 2000})),
    ("Suggest a name for a pet turtle.", _object(name=WORD, species={"const": "turtle"})),
    ("Translate 'good morning' into Spanish.", _object(spanish=WORD)),
    ("Give the coordinates of a point on a grid.", _object(point={"type": "array", "minItems": 2, "maxItems": 2,
                                                                  "items": {"type": "integer", "minimum": -9,
                                                                            "maximum": 9}})),
    ("Describe the weather today.", _object(condition={"enum": ["sunny", "cloudy", "rainy", "snowy"]},
                                            temperature={"type": "integer", "minimum": -50, "maximum": 50},
                                            windy={"type": "boolean"})),
    ("Who wrote Romeo and Juliet?", _object(author=WORD, year={"type": "integer", "minimum": 1000,
                                                               "maximum": 2100})),
    ("Plan a short to-do list for the morning.", _object(tasks={"type": "array", "items": WORD, "minItems": 1,
                                                                "maxItems": 2})),
    ("Tell me about a dog named Rex.", _object(pet=_object(name=WORD, kind={"enum": ["dog", "cat", "bird"]}),
                                               owner={"anyOf": [WORD, {"type": "null"}]})),
    ("Is water wet? Answer with a confidence.", _object(answer={"enum": ["yes", "no"]},
                                                        confidence={"type": "number", "minimum": 0,
                                                                    "maximum": 1})),
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": _object(city=WORD, unit={"enum": ["celsius", "fahrenheit"]})}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": _object(a={"type": "integer", "minimum": -99, "maximum": 99},
                          b={"type": "integer", "minimum": -99, "maximum": 99})}}
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, ADD)}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerThread]:
    with ServerThread(model=MODEL, num_blocks=256) as server:
        yield server


@pytest.fixture(scope="module")
def client(engine: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def guard_client(engine: ServerThread) -> Iterator[openai.OpenAI]:
    with GuardThread(guard_config(engine.url)) as guard:
        yield openai.OpenAI(base_url=guard.url + "/v1", api_key="sk-acme", max_retries=0)


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], **fields: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40, **fields)


def assert_valid_calls(message: Any, names: set[str]) -> None:
    assert message.content is None and message.tool_calls, message
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_json_object_output_parses(client: openai.OpenAI) -> None:
    answer = chat(client, [{"role": "user", "content": "Give the name and the age of a person as JSON."}],
                  response_format={"type": "json_object"})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(json.loads(choice.message.content), dict)


def test_json_schema_outputs_validate_for_twenty_schemas_batched(client: openai.OpenAI) -> None:
    def ask(case: tuple[str, dict[str, Any]]) -> Any:
        prompt, schema = case
        return chat(client, [{"role": "user", "content": prompt}], response_format=json_schema(schema))

    with ThreadPoolExecutor(len(CASES)) as pool:
        answers = list(pool.map(ask, CASES))
    for (prompt, schema), answer in zip(CASES, answers, strict=True):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (prompt, choice)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_response_format_on_completions(client: openai.OpenAI) -> None:
    """An extension, as in vLLM: the completions endpoint honours ``response_format`` too."""
    schema = _object(city=WORD)
    answer = client.completions.create(model=MODEL, prompt="The capital of Italy is", max_tokens=24,
                                       temperature=0, extra_body={"response_format": json_schema(schema)})
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].text), schema)


def test_a_named_tool_call_returns_valid_arguments(client: openai.OpenAI) -> None:
    answer = chat(client, ASK_WEATHER, tools=[WEATHER, ADD],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message, {"get_weather"})
    assert len(choice.message.tool_calls) == 1


def test_required_lets_the_model_pick_among_two_tools(client: openai.OpenAI) -> None:
    """OpenAI's default ``parallel_tool_calls``: one call or more, each to one of the tools."""
    answer = chat(client, ASK_WEATHER, tools=[WEATHER, ADD], tool_choice="required")
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message, {"get_weather", "add"})


def test_a_streamed_tool_call_reaches_the_sdk_stream_helper(client: openai.OpenAI) -> None:
    """``"required"`` without parallel calls: exactly one, its arguments streamed as deltas (OpenAI's way):
    the first names the call, the rest concatenate to arguments that validate."""
    fields = {"tools": [WEATHER, ADD], "tool_choice": "required", "parallel_tool_calls": False}
    with client.chat.completions.stream(model=MODEL, messages=ASK_WEATHER, temperature=0, max_tokens=40,
                                        **fields) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    # The first chunk opens the choice (at its first token, unless the reader only woke at its end).
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert len(deltas) > 1 and deltas[0].id and deltas[0].function.name, deltas
    assert all(call.index == 0 and call.id is None for call in deltas[1:]), deltas
    arguments = "".join(call.function.arguments or "" for call in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert final.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(final.choices[0].message, {"get_weather", "add"})
    assert len(final.choices[0].message.tool_calls) == 1
    assert final.choices[0].message.tool_calls[0].function.arguments == arguments


@pytest.mark.parametrize("fields", [{"tool_choice": "auto"}, {}], ids=["auto", "absent"])
def test_auto_tool_choice_is_a_400_naming_tool_choice(client: openai.OpenAI, fields: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, ASK_WEATHER, tools=[WEATHER], **fields)
    error = refused.value.body
    assert error["param"] == "tool_choice" and "'required'" in error["message"], error


def test_an_uncompilable_schema_is_a_400_naming_response_format(engine: ServerThread,
                                                                  client: openai.OpenAI) -> None:
    before = engine.telemetry()["prompt_tokens_total"]
    lookbehind = {"type": "string", "pattern": "(?<=a)b"}
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, ASK_WEATHER, response_format=json_schema(lookbehind))
    error = refused.value.body
    assert error["param"] == "response_format" and "Lookbehind" in error["message"], error
    assert engine.telemetry()["prompt_tokens_total"] == before, "nothing was queued"


def test_json_schema_and_a_tool_call_through_the_guard(guard_client: openai.OpenAI) -> None:
    prompt, schema = CASES[0]
    with ThreadPoolExecutor(2) as pool:
        structured = pool.submit(chat, guard_client, [{"role": "user", "content": prompt}],
                                 response_format=json_schema(schema))
        called = pool.submit(chat, guard_client, ASK_WEATHER, tools=[WEATHER, ADD],
                             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    jsonschema.validate(json.loads(structured.result().choices[0].message.content), schema)
    assert called.result().choices[0].finish_reason == "tool_calls"
    assert_valid_calls(called.result().choices[0].message, {"get_weather"})


# --- the engine's mechanics, offline, on the tiny model ------------------------------------------------

# Bounded in every part, so that random weights finish it: at most ~40 bytes (tokens) of output.
TINY_SCHEMA = _object(kind={"enum": ["x", "yy", "zzz"]}, flag={"type": "boolean"},
                      picks={"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3})
TINY_GRAMMAR = GrammarSpec.of(TINY_SCHEMA, "grammar")
PROMPTS = [f"Request {i}: " + "abcdefghij"[: i + 1] * (i % 3 + 1) for i in range(10)]


def test_a_grammar_does_not_leak_into_unconstrained_rows_of_its_batch(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPTS[:4], greedy)
    mixed = llm.generate(PROMPTS[:4] + PROMPTS[:2], [greedy] * 4 + [SamplingParams(max_tokens=64)] * 2,
                         grammar=[None] * 4 + [TINY_GRAMMAR] * 2)
    assert [o.token_ids for o in mixed[:4]] == [o.token_ids for o in alone]
    for output in mixed[4:]:
        assert output.finish_reason == "stop"
        jsonschema.validate(json.loads(output.text), TINY_SCHEMA)


def run_constrained(**options: Any) -> tuple[list[list[list[int]]], LLM]:
    """Every prompt constrained; odd ones sample three seeded completions, each with its own matcher."""
    llm = LLM("tiny", device="cpu", block_size=8, max_num_batched_tokens=64, **options)
    params = [SamplingParams(max_tokens=64, temperature=0.0),
              SamplingParams(max_tokens=64, temperature=1.0, seed=3, n=3)]
    outputs = llm.generate(PROMPTS, [params[i % 2] for i in range(len(PROMPTS))], grammar=TINY_GRAMMAR)
    for output in outputs:
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion
            jsonschema.validate(json.loads(completion.text), TINY_SCHEMA)
    assert len({c.text for c in outputs[1].outputs}) > 1, "the forks draw apart: one matcher each"
    return [[c.token_ids for c in output.outputs] for output in outputs], llm


@pytest.fixture(scope="module")
def reference() -> list[list[list[int]]]:
    tokens, roomy = run_constrained(num_blocks=1024)
    assert roomy.telemetry().preemptions_total == 0
    return tokens


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_leaves_constrained_outputs_unchanged(reference: list[list[list[int]]], mode: str) -> None:
    tokens, tight = run_constrained(num_blocks=14, preemption_mode=mode, swap_blocks=64 if mode == "swap" else 0)
    snapshot = tight.telemetry()
    assert getattr(snapshot, f"preemptions_{mode}_total") >= 5, snapshot
    assert tokens == reference
    assert_all_blocks_back(tight.core)
