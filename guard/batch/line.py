"""One batch line through the guard's own request path: the same stages as a client's request (limits,
fairness, the KV budget, routing, failover, records), in the sheddable class at the lowest priority.

The line is served by guard/http/pipeline.py's ``completion`` with an ``InternalRequest``: the part of a
request the pipeline reads, with its tenant and lane under ``INTERNAL`` (no API key: the batch's tenant is
who created it), through ``INTERNAL_REQUEST``, whose auth stage reads them (a client's request runs
``REQUEST``, which never looks for them). Its request id is ``<batch id>:<line number>``, so its decision record names the batch and
the line. A line never streams (validate.py), so the answer is a whole ``web.Response`` and no byte goes to
any connection.

``settle`` sorts the answer: an engine's 200 is the line's output; a refusal for capacity or time (429, 503,
a queue timeout, the guard shutting down), an answer from a fallback rather than the pool, or an engine that
failed (502, 504) is not the line's answer, and the line runs again later (a failing engine at most
``ENGINE_TRIES`` times); any other answer (the line's own fault: 400, 404, 413...) is its error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from guard.config import GuardConfig, Lane, Tenant
from guard.http.pipeline import INTERNAL, INTERNAL_REQUEST, completion
from guard.wire.front_request import RequestItems
from guard.wire.stamp import REQUEST_ID

QUEUE_S = 600.0  # a line's queueing timeout: the pacer (pace.py) keeps at most one of a guard's lines waiting
RETRY_STATUSES = frozenset((408, 429, 503))
ENGINE_STATUSES = frozenset((500, 502, 504))
ENGINE_TRIES = 3


def batch_lane(config: GuardConfig) -> Lane:
    """The lane every batch line runs in: sheddable (its blocks are lent, and critical work takes them
    back), after every lane of the config, and never sent to a fallback."""
    lowest = max(lane.priority for lane in config.lanes.values()) + 1
    return Lane(priority=lowest, timeout=QUEUE_S, sheddable=True, on_degraded="reject", priority_class="sheddable")


class InternalRequest(RequestItems):
    """What guard/http/pipeline.py reads of a request, for a request the guard makes itself."""

    method = "POST"
    content_type = "application/json"
    transport = None

    def __init__(self, app: web.Application, path: str, body: bytes, request_id: str, tenant: Tenant,
                 lane: Lane) -> None:
        self.app = app
        self.path = self.raw_path = path
        self.body = body
        self.content_length = len(body)
        self.headers = CIMultiDict({"Content-Type": "application/json", "X-Request-Id": request_id})
        self.items: dict[Any, Any] = {INTERNAL: (tenant, lane), REQUEST_ID: request_id}

    @property
    def content(self) -> InternalRequest:
        return self

    def is_eof(self) -> bool:
        return True

    def read_nowait(self) -> bytes:
        return self.body

    async def read(self) -> bytes:
        return self.body


@dataclass(slots=True)
class Answer:
    kind: str  # "ok", "failed" (the line's error) or "retry" (not the line's answer: run it again)
    status: int
    body: bytes
    retry_after: float = 0.0


async def run_line(app: web.Application, path: str, body: bytes, request_id: str, tenant: Tenant,
                   lane: Lane) -> web.Response:
    """The line's answer from the pipeline, as a client's request would get it."""
    response = await completion(InternalRequest(app, path, body, request_id, tenant, lane),  # type: ignore[arg-type]
                                INTERNAL_REQUEST)
    assert isinstance(response, web.Response), "a batch line never streams"
    return response


def settle(response: web.Response, engine_tries: int) -> Answer:
    """Sort the answer (see the module); ``engine_tries``: the times an engine has failed this line so far,
    this one included."""
    body = response.body if isinstance(response.body, bytes) else b""
    status = response.status
    if status == 200 and "X-Guard-Route" not in response.headers:
        return Answer("ok", status, body)
    retry_after = float(response.headers.get("Retry-After", "1") or 1)
    if status == 200 or status in RETRY_STATUSES or (status in ENGINE_STATUSES and engine_tries < ENGINE_TRIES):
        return Answer("retry", status, body, retry_after)
    return Answer("failed", status, body)
