"""A request's prompt as token ids, and the check against the context window: the one definition that the
engine's endpoints and the guard share, so that the guard's count and refusal of a prompt always equal the
engine's.

The engine builds a ``PromptCounter`` from its loaded model and counts every ``/v1/completions``,
``/v1/chat/completions`` and ``/tokenize`` request with it; ``GET /tokenizer`` hands out ``describe()``, from
which the guard rebuilds the same counter (``from_info``). Both then call ``check_context`` with the count.

Every refusal is a ``PromptError``: a message that starts with the field it names (``param``), and OpenAI's
``code`` where OpenAI has one; a context overflow is worded as OpenAI words it (clients match on it) and
names its field in ``param`` only. The engine's own ``EngineCore.make_request`` still validates what its Python
API receives; a request these checks pass can only fail there on limits the guard cannot see (the KV pool's
size, the model's vocabulary).
"""

from __future__ import annotations

from collections.abc import Collection

import tokenizers

from engine.prompting.chat_template import ChatTemplate, ChatTemplateError
from engine.prompting.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from engine.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    TokenizeRequest,
    TokenizerInfo,
)

PromptRequest = CompletionRequest | ChatCompletionRequest | TokenizeRequest


class PromptError(ValueError):
    """A prompt refused before it reaches a scheduler, with the HTTP status both the engine and the guard
    answer it with: 404 for a model not served here, 400 for the rest."""

    def __init__(self, message: str, *, param: str, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def model_not_found(model: str, served: str) -> PromptError:
    """The refusal of a model not served here: one wording wherever it is refused (the engine, the guard for
    a model a tenant may not use), so that a refusal never tells whether the model exists."""
    return PromptError(f"model: {model!r} is not served here; this engine serves {served!r}", param="model",
                       code="model_not_found", status=404)


class PromptCounter:
    """Turns a completion prompt or chat messages into the token ids the model will see."""

    def __init__(self, model: str, max_model_len: int, tokenizer: Tokenizer | None, template: ChatTemplate,
                 adapters: Collection[str] = ()) -> None:
        self.model = model
        # LoRA adapter names a request may send as its model (the engine's live registry): same tokenizer.
        self.adapters = adapters
        self.max_model_len = max_model_len  # the context window: prompt plus output tokens
        self.tokenizer = tokenizer  # None: the model takes token ids only, and no chat
        self.template = template

    @classmethod
    def from_info(cls, info: TokenizerInfo) -> PromptCounter:
        """The counter an engine's ``GET /tokenizer`` answer describes; raises ``ValueError`` if unusable."""
        tokenizer: Tokenizer | None = None
        if info.kind == "bytes":
            tokenizer = ByteTokenizer()
        elif info.kind == "hf":
            if info.tokenizer_json is None:
                raise ValueError("GET /tokenizer: kind 'hf' without tokenizer_json")
            # Counting only encodes, so the special ids (which only decoding needs) stay empty.
            tokenizer = HFTokenizer(tokenizers.Tokenizer.from_str(info.tokenizer_json), (), None)
        template = ChatTemplate(info.chat_template, info.bos_token, info.eos_token)
        return cls(info.model, info.max_model_len, tokenizer, template)

    def describe(self) -> TokenizerInfo:
        """What ``from_info`` rebuilds this counter from."""
        info = TokenizerInfo(model=self.model, max_model_len=self.max_model_len, kind="none",
                             chat_template=self.template.source, bos_token=self.template.bos_token,
                             eos_token=self.template.eos_token)
        if isinstance(self.tokenizer, ByteTokenizer):
            info.kind = "bytes"
        elif isinstance(self.tokenizer, HFTokenizer):
            info.kind, info.tokenizer_json = "hf", self.tokenizer.to_json()
        return info

    def request_ids(self, request: PromptRequest) -> list[int]:
        """The prompt's ids exactly as the request's endpoint sees them (``/tokenize`` as either endpoint),
        for a request of one prompt; a completion batch is counted prompt by prompt with ``batch_ids``."""
        if isinstance(request, TokenizeRequest):
            self.check_model(request.model)
            if request.messages is not None:
                return self.chat_ids(request.messages)
            prompt = request.single_prompt
            assert prompt is not None  # a TokenizeRequest holds exactly one of prompt and messages
            return self.prompt_ids(prompt)
        batch = self.batch_ids(request)
        if len(batch) != 1:
            raise PromptError(f"prompt: one prompt expected, got a batch of {len(batch)}", param="prompt")
        return batch[0]

    def batch_ids(self, request: CompletionRequest | ChatCompletionRequest) -> list[list[int]]:
        """Each prompt's ids, in order: a completion's prompts (OpenAI accepts a batch), or the one
        conversation of a chat. Each is its own engine request, checked against the window on its own."""
        self.check_model(request.model)
        if isinstance(request, ChatCompletionRequest):
            return [self.chat_ids(request.messages)]
        return [self.prompt_ids(prompt) for prompt in request.prompts]

    def check_model(self, model: str) -> None:
        if model != self.model and model not in self.adapters:
            raise model_not_found(model, self.model)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt: token ids as given, text encoded as the tokenizer does (with its BOS)."""
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise PromptError("prompt: this model has no tokenizer; send token ids", param="prompt")
        return _not_empty(self.tokenizer.encode(prompt), "prompt", prompt)

    def chat_ids(self, messages: list[ChatMessage]) -> list[int]:
        """A conversation rendered by the chat template, whose text spells out its own special tokens."""
        if self.tokenizer is None:
            raise PromptError("messages: this model has no tokenizer; send token ids to /v1/completions",
                              param="messages")
        try:
            text = self.template.render(messages)
        except ChatTemplateError as exc:
            raise PromptError(str(exc), param="messages") from None
        return _not_empty(self.tokenizer.encode(text, add_special_tokens=False), "messages", text)


def check_context(request: CompletionRequest | ChatCompletionRequest, prompt_tokens: int, window: int) -> int:
    """The output tokens ``request`` may have: its output bound, or all the window leaves when it sets none.

    Refuses (``context_length_exceeded``) a prompt that leaves no room for one output token, naming the
    prompt's field, and an output bound that does not fit beside the prompt, naming the field that set it.
    The messages are OpenAI's own, word for word (``context_overflow_message``), because clients recognise
    the overflow by them (litellm's ``ContextWindowExceededError`` looks for "maximum context length").
    """
    prompt_field = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    max_tokens, max_tokens_field = request.max_output_tokens, request.max_output_tokens_field
    if prompt_tokens >= window:
        raise PromptError(context_overflow_message(window, prompt_tokens), param=prompt_field,
                          code="context_length_exceeded")
    room = window - prompt_tokens
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise PromptError(context_overflow_message(window, prompt_tokens, max_tokens), param=max_tokens_field,
                          code="context_length_exceeded")
    return max_tokens


def context_overflow_message(window: int, prompt_tokens: int, max_tokens: int | None = None) -> str:
    """OpenAI's words for a request that does not fit its model's context window: the prompt alone (no
    ``max_tokens``), or the prompt plus the output bound. OpenAI says "messages" on both endpoints."""
    head = f"This model's maximum context length is {window} tokens. "
    if max_tokens is None:
        return head + (f"However, your messages resulted in {prompt_tokens} tokens. "
                       "Please reduce the length of the messages.")
    return head + (f"However, you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                   f"{max_tokens} in the completion). Please reduce the length of the messages or completion.")


def _not_empty(ids: list[int], field: str, text: str) -> list[int]:
    if not ids:
        raise PromptError(f"{field}: must be text that encodes to at least one token, got {text!r}", param=field)
    return ids
