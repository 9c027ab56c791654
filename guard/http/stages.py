"""The one runner of a request's stages: a ``Stage`` is a name (the one its lap and the decision record
show), what it runs, the field of the ``Exchange`` its result is kept in, and what gives back what it took.

``run`` drives an ``Exchange`` through a declared tuple of stages in order (guard/http/pipeline.py declares
them). It owns:

- laps: each stage's code and start are one entry of ``ex.stage_codes`` and ``ex.stage_starts`` (one
  clock read), so the record's stage timings and the stage a refusal is charged to (``ex.stage``) are the
  names declared here (a name's code: guard/records/record.py ``STAGE_NAMES``);
- results: a stage's result is set on the exchange once the stage has returned (``keeps``); a later stage
  reads it there. A field no stage has set yet does not exist (reading it is an ``AttributeError``, a bug),
  so nothing is None "until its stage has run";
- release: a stage with ``release`` that returned is released when the list ends, however it ends (an
  answer, a refusal, an upstream failure, a client that left), in the reverse order of the stages, each
  exactly once. A stage that raised took nothing (it gives back what it took itself before raising).

``run`` returns the last stage's result: the pipeline's lists end with the stage that answers.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from guard.records.record import stage_code

if TYPE_CHECKING:
    from guard.http.exchange import Exchange


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    run: Callable[[Exchange], Any]  # a function or a coroutine function of the exchange
    keeps: str | None = None  # the exchange's field its result goes in (None: it has none)
    release: Callable[[Exchange], None] | None = None  # gives back what the stage took, once it returned
    awaits: bool = field(init=False)
    code: int = field(init=False)  # the name's, as the record keeps it

    def __post_init__(self) -> None:
        object.__setattr__(self, "awaits", inspect.iscoroutinefunction(self.run))
        object.__setattr__(self, "code", stage_code(self.name))


async def run(ex: Exchange, stages: tuple[Stage, ...]) -> Any:
    """Drive ``ex`` through ``stages``; the last one's result."""
    taken: list[Stage] = []
    codes, starts = ex.stage_codes, ex.stage_starts
    result = None
    try:
        for stage in stages:
            codes.append(stage.code)
            starts.append(time.monotonic())
            result = await stage.run(ex) if stage.awaits else stage.run(ex)
            if stage.keeps is not None:
                setattr(ex, stage.keeps, result)
            if stage.release is not None:
                taken.append(stage)
        return result
    finally:
        for stage in reversed(taken):
            stage.release(ex)  # type: ignore[misc]
