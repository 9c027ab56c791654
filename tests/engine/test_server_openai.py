"""The engine server end to end through the real ``openai`` SDK: every answer must equal what the offline
``LLM`` generates for the same request, and the usage numbers must equal the tokenizer's counts."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from support.engine_server import ServerThread
from support.invariants import assert_all_blocks_back
from support.net import request

from engine import LLM, SamplingParams
from engine.prompting.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from engine.prompting.tokenizer import ByteTokenizer
from engine.protocol import ChatMessage

PROMPT = "The engine serves this prompt"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(num_blocks=512, block_size=16) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(autouse=True)
def every_block_comes_back(server: ServerThread) -> Iterator[None]:
    yield
    server.wait_idle()
    assert_all_blocks_back(server.core)


def offline(llm: LLM, prompt: str | list[int], **params: object) -> list[str]:
    output = llm.generate(prompt, SamplingParams(**params))[0]
    return [c.text for c in output.outputs]


def chat_prompt_ids() -> list[int]:
    text = ChatTemplate(DEFAULT_TEMPLATE).render([ChatMessage(**m) for m in MESSAGES])
    return ByteTokenizer().encode(text, add_special_tokens=False)


def test_completion_matches_the_offline_engine(client: openai.OpenAI, llm: LLM) -> None:
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, **GREEDY)
    expected = llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    assert result.object == "text_completion" and result.model == "tiny"
    assert [c.text for c in result.choices] == [expected.text]
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == len(ByteTokenizer().encode(PROMPT)) == len(PROMPT.encode())
    assert result.usage.completion_tokens == len(expected.token_ids) == 20
    assert result.usage.total_tokens == result.usage.prompt_tokens + 20


def test_streamed_completion_concatenates_to_the_whole(client: openai.OpenAI, llm: LLM) -> None:
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 5, "text arrives token by token, not at the end"
    assert "".join(c.choices[0].text for c in text_chunks) == offline(llm, PROMPT, max_tokens=24, temperature=0.0,
                                                                        ignore_eos=True)[0]
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT), 24)


def test_chat_uses_the_template_streamed_or_not(client: openai.OpenAI, llm: LLM) -> None:
    ids = chat_prompt_ids()
    expected = offline(llm, ids, max_tokens=16, temperature=0.0, ignore_eos=True)[0]
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=16, **GREEDY)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
    assert "".join(d.content or "" for d in deltas) == expected
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_n_choices_follow_their_seeds(client: openai.OpenAI, llm: LLM) -> None:
    params = {"max_tokens": 12, "temperature": 1.0, "seed": 11, "n": 2, "extra_body": {"ignore_eos": True}}
    expected = offline(llm, PROMPT, max_tokens=12, temperature=1.0, seed=11, n=2, ignore_eos=True)
    whole = client.completions.create(model="tiny", prompt=PROMPT, **params)
    assert [c.index for c in whole.choices] == [0, 1]
    assert [c.text for c in whole.choices] == expected and expected[0] != expected[1]
    assert whole.usage.completion_tokens == 24
    streamed = ["", ""]
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, stream=True, **params):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == expected


def test_requests_in_flight_with_one_request_id_each_get_their_own_answer(client: openai.OpenAI, llm: LLM) -> None:
    """``request_id`` names the answer, not the engine request: two streams with one id at once (as a guard
    resumes the choices of one stream apart) each get all of theirs, under the id (the engine, which keeps
    requests by their own id, refused the second: 400 "must be unique among running requests")."""
    seeds = (3, 4)
    expected = [offline(llm, PROMPT, max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True)[0] for seed in seeds]
    streams = [client.completions.create(model="tiny", prompt=PROMPT, stream=True, max_tokens=40, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True, "request_id": "shared"})
               for seed in seeds]  # both sent before either is read
    texts, ids = ["", ""], set()
    for n, stream in enumerate(streams):
        for chunk in stream:
            ids.add(chunk.id)
            texts[n] += "".join(choice.text for choice in chunk.choices)
    assert texts == expected and expected[0] != expected[1]
    assert ids == {"cmpl-shared"}


def test_stop_strings_are_cut_and_never_streamed(client: openai.OpenAI, llm: LLM) -> None:
    full = offline(llm, PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True)[0]
    # A stop string from the middle of the output, at its first occurrence.
    start = next(i for i in range(6, len(full) - 4)
                 if full.find(full[i : i + 4]) == i and full[i : i + 4].isprintable())
    stop = full[start : start + 4]
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, stop=["never-seen", stop],
                                      **GREEDY)
    assert whole.choices[0].text == full[:start] and whole.choices[0].finish_reason == "stop"
    pieces = [c.choices[0] for c in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, stop=stop,
                                                              stream=True, **GREEDY)]
    assert "".join(p.text for p in pieces) == full[:start]
    assert pieces[-1].finish_reason == "stop"


def test_prefix_cache_hits_are_reported_per_salt(client: openai.OpenAI) -> None:
    prompt = "A long shared system prompt that spans several KV blocks of sixteen tokens. " * 2

    def cached(salt: str) -> int:
        result = client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                           extra_body={"cache_salt": salt})
        return result.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    hits = cached("tenant-a")
    assert hits > 0 and hits % 16 == 0
    assert cached("tenant-b") == 0, "another salt never reuses KV"


def test_tenant_header_accounts_usage(client: openai.OpenAI, server: ServerThread) -> None:
    for _ in range(2):
        client.completions.create(model="tiny", prompt="hi", max_tokens=3, extra_headers={"X-Tenant-Id": "acme"},
                                  **GREEDY)
    tenant = server.telemetry()["tenants"]["acme"]
    assert tenant["prompt_tokens_total"] == 4 and tenant["generation_tokens_total"] == 6


def test_models_lists_the_served_model(client: openai.OpenAI, server: ServerThread) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    card = client.models.retrieve("tiny")
    assert (card.id, card.object, card.model_extra["max_model_len"]) == ("tiny", "model", 2048)
    assert card.model_dump() == client.models.list().data[0].model_dump()
    for other in ("gpt-4", "org/tiny"):
        with pytest.raises(openai.NotFoundError) as info:
            client.models.retrieve(other)
        assert (info.value.body["code"], info.value.body["param"]) == ("model_not_found", "model")


def test_context_overflow_is_worded_as_openai_words_it(client: openai.OpenAI) -> None:
    """Clients recognise the overflow by OpenAI's message (litellm maps it to ContextWindowExceededError)."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[1] * 2000, max_tokens=100)
    assert info.value.body == {
        "message": "This model's maximum context length is 2048 tokens. However, you requested 2100 tokens (2000 in "
                   "the messages, 100 in the completion). Please reduce the length of the messages or completion.",
        "type": "invalid_request_error", "param": "max_tokens", "code": "context_length_exceeded"}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 2100}])
    assert info.value.body["message"].startswith("This model's maximum context length is 2048 tokens. However, "
                                                 "your messages resulted in ")
    assert (info.value.body["param"], info.value.body["code"]) == ("messages", "context_length_exceeded")


def test_top_p_zero_is_greedy(client: openai.OpenAI) -> None:
    """OpenAI accepts ``top_p=0`` and reads it as "only the likeliest token": the same tokens as temperature 0."""
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, **GREEDY)
    for seed in (1, 2):
        nucleus = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0,
                                            seed=seed, extra_body={"ignore_eos": True})
        assert nucleus.choices[0].text == greedy.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, top_p=0, temperature=1.5)
    assert chat.choices[0].message.content == client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0).choices[0].message.content


def test_a_batch_of_prompts_gets_n_choices_each(client: openai.OpenAI, llm: LLM) -> None:
    """OpenAI's batch: ``prompt`` a list of texts or of token-id lists; choice ``i`` of prompt ``p`` is index
    ``p * n + i``; usage sums over the prompts; streamed chunks carry the same indices."""
    prompts = ["first prompt", "the second, longer prompt"]
    params = {"max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 2, "extra_body": {"ignore_eos": True}}
    expected = [text for prompt in prompts
                for text in offline(llm, prompt, max_tokens=6, temperature=1.0, seed=5, n=2, ignore_eos=True)]
    whole = client.completions.create(model="tiny", prompt=prompts, **params)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [c.text for c in whole.choices] == expected
    assert whole.usage.prompt_tokens == sum(len(p) for p in prompts) and whole.usage.completion_tokens == 24
    as_ids = client.completions.create(model="tiny", prompt=[list(p.encode()) for p in prompts], **params)
    assert [c.text for c in as_ids.choices] == expected
    streamed = [""] * 4
    chunks = list(client.completions.create(model="tiny", prompt=prompts, stream=True,
                                            stream_options={"include_usage": True}, **params))
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == expected
    assert len({c.id for c in chunks}) == 1 and chunks[-1].usage.completion_tokens == 24
    single = client.completions.create(model="tiny", prompt=[prompts[1]], max_tokens=6, **GREEDY)
    assert single.choices[0].text == offline(llm, prompts[1], max_tokens=6, temperature=0.0, ignore_eos=True)[0]


def test_sdk_sees_validation_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, n=0)
    assert info.value.body["param"] == "n"


def test_tokenize_counts_prompts_as_the_endpoints_do(client: openai.OpenAI, server: ServerThread) -> None:
    def tokenize(body: dict) -> dict:
        status, answer = request(server.url + "/tokenize", json.dumps({"model": "tiny", **body}).encode())
        assert status == 200, answer
        return json.loads(answer)

    counted = tokenize({"prompt": PROMPT})
    assert counted == {"count": len(PROMPT), "max_model_len": 2048, "tokens": list(PROMPT.encode())}
    assert tokenize({"prompt": [[5, 6, 7]]})["count"] == 3
    chat = tokenize({"messages": MESSAGES})
    assert chat["tokens"] == chat_prompt_ids()
    used = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    assert chat["count"] == used
    status, answer = request(server.url + "/tokenize", json.dumps({"model": "tiny"}).encode())
    assert status == 400 and "exactly one of prompt and messages" in json.loads(answer)["error"]["message"]
