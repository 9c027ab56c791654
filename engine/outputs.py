"""Results returned by ``LLM.generate`` (and streamed by the server): shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass


class CompletionOutput:
    """One completion so far: ``index``, ``text``, ``token_ids``, ``finish_reason`` ("stop" | "length" |
    "abort" | None while running).

    With ``start``, its tokens are ``token_ids[start:]`` as the list is now, held as a window, not a copy: the
    entries of the window must never change (a sequence's list only grows past them). They are copied out
    the first time ``token_ids`` is read, so a server that reads each step's new tokens (``num_tokens``,
    ``token_ids_from``) never copies the whole output every step, and a caller that keeps only the last
    output copies it once."""

    __slots__ = ("_end", "_source", "_start", "finish_reason", "index", "text")

    def __init__(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
                 start: int = 0) -> None:
        self.index, self.text, self.finish_reason = index, text, finish_reason
        self._source, self._start, self._end = token_ids, start, len(token_ids)

    @property
    def token_ids(self) -> list[int]:
        if self._start or self._end != len(self._source):  # a window: copy it out once
            self._source = self._source[self._start:self._end]
            self._start, self._end = 0, len(self._source)
        return self._source

    @property
    def num_tokens(self) -> int:
        """``len(token_ids)``, without copying them."""
        return self._end - self._start

    def token_ids_from(self, first: int) -> list[int]:
        """``token_ids[first:]``, without copying the others."""
        return self._source[self._start + first:self._end]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return (self.index, self.text, self.token_ids, self.finish_reason) == (
            other.index, other.text, other.token_ids, other.finish_reason)

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index!r}, text={self.text!r}, token_ids={self.token_ids!r}, "
                f"finish_reason={self.finish_reason!r})")


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
