"""What the owner of an engine request sees: its outputs as they come, or the error that ended it.

A stream holds only the newest output, not a queue: outputs are cumulative (all text and token ids so
far), so a slow reader skips intermediate ones instead of letting memory grow with the generation.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine.outputs import RequestOutput


class EngineUnavailable(RuntimeError):
    """The engine is loading, failed, or has stopped: it accepts no request."""


class EngineDraining(EngineUnavailable):
    """The engine drains (SIGTERM): it admits no new request; another replica should take it."""


class ResumeElsewhere(EngineUnavailable):
    """The engine's drain timeout ended this request before it finished: resume it on another replica with
    the tokens it had sent (``resume_token_ids``)."""


class RequestFailed(RuntimeError):
    """A step failed while this request was in the batch; its blocks have been released."""


@dataclass(slots=True, eq=False)
class RequestStream:
    """The outputs of one request, newest only, as an async iterator that ends after the final one (or
    raises the request's error). ``push`` and ``fail`` are the engine's side, on the event loop."""

    request_id: str
    _latest: RequestOutput | None = None
    _error: BaseException | None = None
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    # The reader waits for the final output alone (``final``): an earlier one is kept but wakes nobody, so a
    # unary request costs its event loop one wake-up, not one per engine step.
    _final_only: bool = False
    done: bool = False  # the final output or the error has been taken

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        while self._latest is None and self._error is None:
            self._wake.clear()
            await self._wake.wait()
        if self._latest is not None:
            output, self._latest = self._latest, None
            self.done = output.finished
            return output
        self.done = True
        raise self._error  # type: ignore[misc]

    async def final(self) -> RequestOutput:
        """Wait for the request to finish and return its last output."""
        self._final_only = True
        output = None
        async for output in self:
            pass
        assert output is not None and output.finished
        return output

    def push(self, output: RequestOutput) -> None:
        self._latest = output
        if output.finished or not self._final_only:
            self._wake.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._wake.set()
