"""The guard's one error family: every refusal the guard answers itself, whichever stage raised it.

A stage raises ``GuardError``; the pipeline turns it into the response (OpenAI's error shape, with
``Retry-After`` where the status asks for one, and the error's own ``headers``) and into the request's
outcome, in one place each (guard/http/pipeline.py). The outcome follows from the status unless the raiser
says otherwise.
"""

from __future__ import annotations

import enum


class Outcome(enum.StrEnum):
    """How a request that reached the guard ended: the ``outcome`` label of ``guard_requests_total``."""

    COMPLETED = "completed"
    REJECTED_QUOTA = "rejected_quota"
    REJECTED_OVERLOAD = "rejected_overload"
    REJECTED_INVALID = "rejected_invalid"
    UNAUTHORIZED = "unauthorized"
    FALLBACK = "fallback"
    UPSTREAM_ERROR = "upstream_error"
    CANCELLED = "cancelled"


class GuardError(Exception):
    """A request the guard answers itself: 4xx for the client's fault or limit, 503 for capacity."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None, outcome: Outcome | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after
        self.headers = headers  # more for the answer to carry (a rate limit's x-ratelimit-*)
        self.outcome = outcome if outcome is not None else outcome_of(status)


def outcome_of(status: int) -> Outcome:
    if status == 401:
        return Outcome.UNAUTHORIZED
    if status == 429:
        return Outcome.REJECTED_QUOTA
    if status >= 500:
        return Outcome.REJECTED_OVERLOAD
    return Outcome.REJECTED_INVALID
