"""engine/prompting/prompts.py on its own: the context window's edges, the fields refusals name, and the
``GET /tokenizer`` round trip that gives the guard the engine's counter (the end-to-end equality with a
running engine is tests/guard/test_guard_tokens.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.prompting.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from engine.prompting.prompts import PromptCounter, PromptError, check_context
from engine.prompting.tokenizer import ByteTokenizer
from engine.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest

WINDOW = 32


def completion(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "tiny", "prompt": "x", **fields})


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields})


def refusal(call: Callable[..., object], *args: object) -> tuple[int, str, str | None, str]:
    with pytest.raises(PromptError) as info:
        call(*args)
    return info.value.status, info.value.param, info.value.code, str(info.value)


def test_the_window_holds_the_prompt_and_at_least_one_output_token() -> None:
    assert check_context(completion(max_tokens=1), WINDOW - 1, WINDOW) == 1
    assert check_context(chat(), WINDOW - 5, WINDOW) == 5, "no bound: all the window leaves"
    status, param, code, message = refusal(check_context, completion(), WINDOW, WINDOW)
    assert (status, param, code) == (400, "prompt", "context_length_exceeded")
    # OpenAI's words, which clients (litellm's ContextWindowExceededError among them) recognise.
    assert message == (f"This model's maximum context length is {WINDOW} tokens. However, your messages resulted "
                       f"in {WINDOW} tokens. Please reduce the length of the messages.")
    assert refusal(check_context, chat(), WINDOW, WINDOW)[1] == "messages"
    status, param, code, message = refusal(check_context, completion(max_tokens=WINDOW - 9), 10, WINDOW)
    assert (status, param, code) == (400, "max_tokens", "context_length_exceeded")
    assert message == (f"This model's maximum context length is {WINDOW} tokens. However, you requested "
                       f"{WINDOW + 1} tokens (10 in the messages, {WINDOW - 9} in the completion). Please reduce the "
                       "length of the messages or completion.")
    assert refusal(check_context, chat(max_completion_tokens=WINDOW), 1, WINDOW)[1] == "max_completion_tokens"
    assert refusal(check_context, chat(max_tokens=WINDOW), 1, WINDOW)[1] == "max_tokens"


def test_counts_refusals_and_the_round_trip_through_tokenizer_info() -> None:
    counter = PromptCounter("tiny", WINDOW, ByteTokenizer(), ChatTemplate(DEFAULT_TEMPLATE))
    rebuilt = PromptCounter.from_info(counter.describe())
    assert rebuilt.describe() == counter.describe()
    for request in (completion(prompt="héllo"), completion(prompt=[5, 6, 7]), chat(),
                    TokenizeRequest(model="tiny", prompt="héllo")):
        assert rebuilt.request_ids(request) == counter.request_ids(request)
    assert counter.request_ids(completion(prompt="héllo")) == list("héllo".encode())
    assert counter.request_ids(chat()) == list(b"<|user|>\nhi\n<|assistant|>\n")
    assert refusal(counter.request_ids, completion(model="gpt-4"))[:3] == (404, "model", "model_not_found")
    bare = PromptCounter("tiny", WINDOW, None, ChatTemplate(DEFAULT_TEMPLATE))
    assert bare.request_ids(completion(prompt=[1, 2])) == [1, 2]
    assert refusal(bare.request_ids, completion())[:2] == (400, "prompt")
    assert refusal(bare.request_ids, chat())[:2] == (400, "messages")
    assert PromptCounter.from_info(bare.describe()).tokenizer is None


def test_a_completion_batch_is_counted_prompt_by_prompt() -> None:
    counter = PromptCounter("tiny", WINDOW, ByteTokenizer(), ChatTemplate(DEFAULT_TEMPLATE))
    for prompt, expected in (("ab", [[97, 98]]), ([5, 6], [[5, 6]]), (["ab", "c"], [[97, 98], [99]]),
                             ([[5], [6, 7]], [[5], [6, 7]]), (["ab", [6]], [[97, 98], [6]])):
        assert counter.batch_ids(completion(prompt=prompt)) == expected, prompt
    assert counter.batch_ids(chat()) == [counter.request_ids(chat())]
    assert refusal(counter.request_ids, completion(prompt=["a", "b"]))[:2] == (400, "prompt")
    with pytest.raises(ValueError, match="one prompt"):
        TokenizeRequest(model="tiny", prompt=["a", "b"])
    assert TokenizeRequest(model="tiny", prompt=["a"]).single_prompt == "a"
