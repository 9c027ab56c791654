"""Results returned by ``LLM.generate`` (and streamed by the server): shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running


@dataclass(slots=True)
class RequestOutput:
    """One prompt's completions. ``text``, ``token_ids`` and ``finish_reason`` are those of the first."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    finished: bool
    num_resumed_tokens: int = 0  # output tokens of a resumed request that came before ``token_ids``

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
