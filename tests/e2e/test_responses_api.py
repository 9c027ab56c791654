"""The Responses API (issue 33) and streamed tool-call deltas, with the real ``openai`` SDK and the real
``openai-agents`` package, against the real tiny engine and the real guard in front of it.

Each SDK case runs twice, straight at the engine and through the guard (``client`` is parametrized): a
created response is retrieved as it was; a stream's events arrive in OpenAI's order with consecutive
sequence numbers and build the final response; ``text.format`` json_schema and forced function calls take
the grammar path (bounded schemas, so that the tiny model's random weights finish them); a function call's
arguments stream in several deltas that concatenate to the final arguments; ``previous_response_id``
continues a stored conversation, on any replica of a pool; the static fallback answers in the same shape. Stored responses are the tenant's own: another tenant's id is a 404 for
reading, continuing and deleting. An agent with a function tool (``tool_choice`` required) runs through
the guard. Chat completions stream a forced call's arguments as deltas, and a call cut by ``max_tokens``
ends with ``length`` and the arguments so far.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any, Literal

import agents
import jsonschema
import openai
import pytest
from support.engine_server import ServerThread
from support.guard_server import GuardThread, guard_config, usable_guard
from support.net import request
from support.wait import wait_for

from engine.protocol import ResponseObject
from engine.protocol.responses import OutputMessage
from engine.server.response_store import ResponseStore
from guard.admission.fairness import INPUT_COST, OUTPUT_COST
from guard.http.responses import ResponsesObserver

PICK_PARAMETERS = {"type": "object", "properties": {"kind": {"enum": ["x", "yy", "zzz"]}, "flag": {"type": "boolean"}},
                   "required": ["kind", "flag"], "additionalProperties": False}
PICK = {"type": "function", "name": "pick", "description": "Pick one", "parameters": PICK_PARAMETERS,
        "strict": True}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerThread]:
    with ServerThread(num_blocks=256) as server:
        yield server


@pytest.fixture(scope="module")
def guard(engine: ServerThread) -> Iterator[GuardThread]:
    with usable_guard(guard_config(engine.url)) as g:
        yield g


def sdk(url: str, key: str = "sk-acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module", params=["engine", "guard"])
def client(request: pytest.FixtureRequest, engine: ServerThread) -> openai.OpenAI:
    if request.param == "engine":
        return sdk(engine.url)
    return sdk(request.getfixturevalue("guard").url)


def collapsed(kinds: list[str]) -> list[str]:
    """Event types with each run of one type shown once (deltas come in runs of any length)."""
    return [kind for i, kind in enumerate(kinds) if i == 0 or kinds[i - 1] != kind]


def test_a_response_is_created_and_retrieved_as_it_was(client: openai.OpenAI) -> None:
    created = client.responses.create(model="tiny", input="hello", instructions="be terse", max_output_tokens=6,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert created.object == "response" and created.status == "incomplete", created
    assert created.incomplete_details.reason == "max_output_tokens"
    assert created.usage.output_tokens == 6 and created.usage.total_tokens == created.usage.input_tokens + 6
    [message] = created.output
    assert message.type == "message" and message.role == "assistant" and created.output_text
    retrieved = client.responses.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()


def test_a_stream_sends_openai_events_in_order_and_builds_the_response(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    with client.responses.stream(model="tiny", input="answer", temperature=0, max_output_tokens=64,
                                 text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                  "strict": True}}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert collapsed([event.type for event in events]) == [*TEXT_EVENTS, "response.completed"]
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert final.status == "completed" and final.output_text == deltas
    jsonschema.validate(json.loads(deltas), schema)


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(client: openai.OpenAI) -> None:
    with client.responses.create(model="tiny", input="go on", max_output_tokens=5, temperature=0, stream=True,
                                 extra_body={"ignore_eos": True}) as stream:
        events = list(stream)
    assert collapsed([event.type for event in events]) == [*TEXT_EVENTS, "response.incomplete"]
    last = events[-1].response
    assert last.status == "incomplete" and last.incomplete_details.reason == "max_output_tokens"
    assert last.usage.output_tokens == 5 and last.output[0].status == "incomplete"


def test_a_forced_function_call_streams_its_arguments_in_deltas(client: openai.OpenAI) -> None:
    with client.responses.stream(model="tiny", input="pick one", tools=[PICK], tool_choice="required",
                                 temperature=0, max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert collapsed([event.type for event in events]) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    deltas = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    [call] = final.output
    assert len(deltas) > 1 and "".join(deltas) == call.arguments, deltas
    assert call.type == "function_call" and call.name == "pick" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), PICK_PARAMETERS)


def test_a_named_function_call_unstreamed(client: openai.OpenAI) -> None:
    response = client.responses.create(model="tiny", input="pick", tools=[PICK], temperature=0,
                                       tool_choice={"type": "function", "name": "pick"}, max_output_tokens=64)
    [call] = response.output
    assert response.status == "completed" and call.status == "completed" and call.name == "pick"
    jsonschema.validate(json.loads(call.arguments), PICK_PARAMETERS)


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input="remember this", max_output_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    alone = client.responses.create(model="tiny", input="and then?", max_output_tokens=4, temperature=0,
                                    store=False, extra_body={"ignore_eos": True})
    then = client.responses.create(model="tiny", input="and then?", previous_response_id=first.id,
                                   max_output_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert then.previous_response_id == first.id
    # The conversation so far comes first: the first exchange's tokens, then this input's.
    assert then.usage.input_tokens >= first.usage.input_tokens + first.usage.output_tokens + 1
    assert then.usage.input_tokens > alone.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(alone.id)  # store: false keeps nothing


def test_errors_name_the_responses_fields(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="x", max_output_tokens=10 ** 6)
    assert refused.value.body["param"] == "max_output_tokens" and refused.value.body["code"] == \
        "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="x", tools=[PICK])  # tool_choice auto, the default
    assert refused.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input=[{"type": "reasoning", "summary": []}])
    assert refused.value.body["param"].startswith("input") and "not supported" in refused.value.body["message"]


def test_a_tenant_reads_and_continues_only_its_own_responses(guard: GuardThread, engine: ServerThread) -> None:
    acme, globex = sdk(guard.url, "sk-acme"), sdk(guard.url, "sk-globex")
    mine = acme.responses.create(model="tiny", input="secret", max_output_tokens=3, temperature=0)
    with pytest.raises(openai.NotFoundError):
        globex.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError) as refused:
        globex.responses.create(model="tiny", input="more", previous_response_id=mine.id, max_output_tokens=3)
    assert refused.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        globex.responses.delete(mine.id)
    # The engine scopes by the tenant the guard names, never by a client's own header.
    status, _ = request(engine.url + f"/v1/responses/{mine.id}", headers={"X-Tenant-Id": "globex"})
    assert status == 404
    assert acme.responses.retrieve(mine.id).id == mine.id
    acme.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        acme.responses.retrieve(mine.id)
    snap = engine.wait_idle()  # every block came back: free, or cached for the prefix cache
    assert snap["free_blocks"] + snap["cached_blocks"] == snap["num_blocks"], snap
    wait_for(lambda: guard.call(guard.state.pool.committed), lambda held: held == 0, 5)


def test_reading_stored_responses_counts_against_the_tenants_rpm(engine: ServerThread) -> None:
    tenants = [{"name": "acme", "api_keys": ["sk-acme"], "lane": "interactive", "rpm": 2}]
    with usable_guard(guard_config(engine.url, tenants=tenants)) as limited:
        client = sdk(limited.url)
        for _ in range(2):
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve("resp_unknown")
        with pytest.raises(openai.RateLimitError) as refused:
            client.responses.delete("resp_unknown")
        assert refused.value.response.headers["x-ratelimit-limit-requests"] == "2"


def test_a_continuation_runs_on_any_replica_of_a_pool(engine: ServerThread) -> None:
    """Round robin sends each turn to the other replica than the one that stored the turn before: the guard
    reads the stored conversation where it is and sends it along, so every turn continues."""
    with ServerThread(num_blocks=256) as other, \
            GuardThread(guard_config([engine.url, other.url], routing={"policy": "round_robin"})) as pool:
        wait_for(lambda: pool.call(lambda: all(r.up() for r in pool.state.pool)), bool, 5)
        client = sdk(pool.url)
        turn = client.responses.create(model="tiny", input="one", max_output_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
        for word in ("two", "three", "four"):
            before = turn
            turn = client.responses.create(model="tiny", input=word, previous_response_id=before.id,
                                           max_output_tokens=3, temperature=0, extra_body={"ignore_eos": True})
            assert turn.usage.input_tokens > before.usage.input_tokens + before.usage.output_tokens
            assert client.responses.retrieve(turn.id).previous_response_id == before.id
        # A client's own ``history`` is the guard's field: dropped, it changes nothing.
        plain = client.responses.create(model="tiny", input="one", max_output_tokens=3, temperature=0)
        forged = client.responses.create(model="tiny", input="one", max_output_tokens=3, temperature=0,
                                         extra_body={"history": [{"role": "user", "content": "x" * 50}]})
        assert forged.usage.input_tokens == plain.usage.input_tokens


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_the_guard_charges_a_response_its_usage(guard: GuardThread, stream: bool) -> None:
    def service() -> float:
        return guard.call(lambda: guard.state.dispatcher.fair.tenants["bulk"].service)

    before = service()
    answer = sdk(guard.url, "sk-bulk").responses.create(model="tiny", input="count me", max_output_tokens=7,
                                                        stream=stream, temperature=0, extra_body={"ignore_eos": True})
    usage = list(answer)[-1].response.usage if stream else answer.usage
    charged = INPUT_COST * usage.input_tokens + OUTPUT_COST * usage.output_tokens
    wait_for(lambda: service() - before, lambda got: got == charged, 5)


def test_the_static_fallback_answers_in_the_responses_shape() -> None:
    config = guard_config("http://127.0.0.1:9", fallbacks=[{"name": "static", "message": "busy"}],
                          admission={"telemetry_stale_s": 0.5})
    with GuardThread(config) as guard:
        client = sdk(guard.url)
        answer = client.responses.create(model="tiny", input="hi")
        with client.responses.stream(model="tiny", input="hi") as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
    assert answer.status == "completed" and answer.output_text == "busy" and answer.usage.output_tokens == 0
    assert kinds == [kind for kind in TEXT_EVENTS if kind != "response.in_progress"] + ["response.completed"]
    assert final.output_text == "busy"


def test_the_responses_observer_counts_deltas_and_reads_the_usage() -> None:
    """Only the ``.delta`` events are tokens (``response.created`` comes before the prefill); the usage is
    the end event's, cut anywhere across chunks."""
    stream = b"".join(
        f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode() for kind, fields in [
            ("response.created", {"response": {"usage": None}}),
            ("response.output_text.delta", {"delta": 'a "response.completed" b'}),
            ("response.output_text.delta", {"delta": "c"}),
            ("response.completed", {"response": {"usage": {"output_tokens": 9,
                                                           "input_tokens_details": {"cached_tokens": 16}}}})])
    for cut in range(1, len(stream)):
        observer = ResponsesObserver(on_first_token=lambda now: None, on_gap=lambda gap: None)
        relayed = observer.feed(stream[:cut]) + observer.feed(stream[cut:]) + observer.flush()
        assert relayed == stream
        assert (observer.events, observer.output_tokens, observer.cached_tokens, observer.finished) == \
            (2, 9, 16, True), cut


def test_an_agent_calls_its_function_tool_through_the_guard(guard: GuardThread) -> None:
    agents.set_tracing_disabled(True)  # no exporter: nothing leaves the machine
    calls: list[tuple[str, bool]] = []

    @agents.function_tool
    def pick(kind: Literal["x", "yy", "zzz"], flag: bool) -> str:
        """Pick a kind."""
        calls.append((kind, flag))
        return f"picked {kind}"

    model = agents.OpenAIResponsesModel(model="tiny", openai_client=openai.AsyncOpenAI(
        base_url=guard.url + "/v1", api_key="sk-acme", max_retries=0))
    agent = agents.Agent(name="picker", instructions="Pick one.", model=model, tools=[pick],
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                             max_tokens=64),
                         tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(agents.Runner.run(agent, "pick something"))
    [(kind, flag)] = calls
    assert result.final_output == f"picked {kind}" and kind in ("x", "yy", "zzz") and isinstance(flag, bool)


# -- chat completions: a forced call's arguments as deltas ----------------------------------------------------

CHAT_PICK = {"type": "function", "function": {"name": "pick", "parameters": PICK_PARAMETERS}}


def chat_call_stream(url: str, **fields: Any) -> tuple[list[Any], str | None]:
    """A streamed forced call through the SDK: its tool-call deltas and the finish reason."""
    stream = sdk(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "pick"}], tools=[CHAT_PICK], stream=True,
        tool_choice={"type": "function", "function": {"name": "pick"}}, temperature=0, **fields)
    chunks = [chunk for chunk in stream if chunk.choices]
    deltas = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    return deltas, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("where", ["engine", "guard"])
def test_chat_streams_a_tool_calls_arguments_as_deltas(where: str, engine: ServerThread,
                                                       request: pytest.FixtureRequest) -> None:
    url = engine.url if where == "engine" else request.getfixturevalue("guard").url
    deltas, finish = chat_call_stream(url, max_tokens=64)
    assert finish == "tool_calls" and len(deltas) > 1, deltas
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "pick"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    jsonschema.validate(json.loads("".join(d.function.arguments for d in deltas)), PICK_PARAMETERS)


def test_a_chat_call_cut_by_max_tokens_ends_with_length_and_the_arguments_so_far(engine: ServerThread) -> None:
    whole, _ = chat_call_stream(engine.url, max_tokens=64)
    arguments = "".join(d.function.arguments for d in whole)
    deltas, finish = chat_call_stream(engine.url, max_tokens=4)
    cut = "".join(d.function.arguments for d in deltas)
    assert finish == "length" and deltas[0].function.name == "pick"
    assert cut and arguments.startswith(cut) and cut != arguments  # greedy: the same call, cut short
    answer = sdk(engine.url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "pick"}], tools=[CHAT_PICK], max_tokens=4,
        tool_choice={"type": "function", "function": {"name": "pick"}}, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls[0].function.arguments == cut


# -- the store ------------------------------------------------------------------------------------------------

def stored(response_id: str) -> ResponseObject:
    return ResponseObject(id=response_id, created_at=0, status="completed", model="tiny",
                          output=[OutputMessage(id="msg", status="completed", content=[])])


def test_the_store_expires_entries_and_keeps_at_most_its_capacity() -> None:
    now = [0.0]
    store = ResponseStore(ttl_s=10.0, capacity=2, clock=lambda: now[0])
    store.put("acme", stored("a"), [])
    now[0] = 5.0
    store.put("acme", stored("b"), [])
    assert store.get("a", "acme") is not None and store.get("a", "globex") is None and store.get("a", None) is None
    now[0] = 8.0
    store.put("globex", stored("c"), [])  # over capacity: the oldest goes
    assert store.get("a", "acme") is None and len(store) == 2
    now[0] = 15.0  # b was stored at 5: its ten seconds are over, c's (stored at 8) are not
    assert store.get("b", "acme") is None and store.get("c", "globex") is not None
    assert not store.delete("c", "acme") and store.delete("c", "globex") and len(store) == 0
