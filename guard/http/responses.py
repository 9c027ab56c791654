"""The Responses API through the guard: what ``/v1/responses`` needs beside the completion pipeline.

``POST /v1/responses`` takes the pipeline of chat (guard/http/pipeline.py): the same authentication,
admission in KV blocks, fairness, limits and decision records. Its body is counted as the chat it runs as
(``ResponsesRequest.to_chat``, guard/http/validate.py); here are the parts that differ:

- ``ResponsesObserver``: a Responses stream is typed events (``event:`` and ``data:`` lines, no
  ``[DONE]``); only the ``*.delta`` events carry tokens (``response.created`` comes before the prefill, so
  counting it would make every first token instant), and the usage is the ``response`` of
  ``response.completed`` (or ``response.incomplete``), which also ends the stream.
- ``load_conversation``: a continuation (``previous_response_id``) runs after a stored conversation that
  one replica keeps. The guard reads it from that replica first (as the tenant: another tenant's id is a
  404 before anything is queued) and sends it upstream with the request (``history``), so the request
  is counted and sized whole, its prefix hashes are the real prompt's, and any replica can run it.
- ``static_answer``: the static fallback's message as a completed response (and its events, streamed).
- ``ask_replicas``: each replica keeps the responses it answered (engine/server/response_store.py), so a
  stored response is looked for on the replicas in turn (guard/http/stored.py serves ``GET`` and
  ``DELETE /v1/responses/{id}`` with it).
"""

from __future__ import annotations

import json
import time
import uuid

import aiohttp
import yarl
from aiohttp import web

from engine.protocol import ChatMessage, ResponseObject, ResponsesRequest, sse_event
from engine.protocol.responses import InputTokensDetails, OutputMessage, OutputText, ResponseUsage
from guard.errors import GuardError
from guard.http.clients import Clients
from guard.http.validate import RESPONSES, ParsedRequest
from guard.instance import GuardState
from guard.wire.relay import StreamObserver, cached_tokens

# The type of a Responses stream's last event, each as it stands in a data line (a quote inside a text is
# escaped, so these bytes only ever stand for the type itself).
_ENDS = (b'"response.completed"', b'"response.incomplete"')


class ResponsesObserver(StreamObserver):
    """A ``StreamObserver`` for a Responses stream: a token is a ``.delta"`` event (``*.output_text.delta``,
    ``*.function_call_arguments.delta``); the stream's end carries the usage. Nothing is stripped: the
    guard asks a Responses stream for nothing it would not send anyway."""

    __slots__ = ()

    def feed(self, chunk: bytes) -> bytes:
        if self.tap is not None:
            chunk = self.tap.take(chunk)
        return self.feed_events(chunk) if chunk else b""

    def feed_events(self, chunk: bytes) -> bytes:
        data = self._partial + chunk
        end = data.rfind(b"\n") + 1  # past the last complete line: a line is taken whole
        self._partial, lines = data[end:], data[:end]
        if tokens := lines.count(b'.delta"'):  # only a delta event's type ends so (a quote in a text is escaped)
            now = time.monotonic()  # the events of one chunk arrived together
            for _ in range(tokens):
                self._token(now)
        if any(kind in lines for kind in _ENDS):
            for line in lines.split(b"\n"):
                if line.startswith(b"data:") and any(kind in line for kind in _ENDS):
                    self._usage(line)
        return chunk

    def flush(self) -> bytes:
        rest = self._unfinished()
        self._partial = b""
        return rest

    def _usage(self, line: bytes) -> None:
        try:
            event = json.loads(line[5:])
            usage = event["response"]["usage"]
        except (ValueError, KeyError, TypeError):
            return
        if isinstance(usage, dict):
            self.read_usage(usage)
            self.finished = True

    def read_usage(self, usage: dict) -> None:
        """A response's usage: ``output_tokens``, and ``input_tokens_details.cached_tokens``."""
        self.completion_tokens = usage.get("output_tokens", self.completion_tokens)
        self.cached_tokens = cached_tokens({"prompt_tokens_details": usage.get("input_tokens_details")})


def observer_class(parsed: ParsedRequest) -> type[StreamObserver]:
    return ResponsesObserver if parsed.path == RESPONSES else StreamObserver


def continues(parsed: ParsedRequest) -> bool:
    """A Responses request that continues a stored conversation (``previous_response_id``)."""
    return parsed.path == RESPONSES and getattr(parsed.model, "previous_response_id", None) is not None


async def load_conversation(state: GuardState, clients: Clients, parsed: ParsedRequest, tenant: str) -> None:
    """A continuation made self-contained: the stored conversation it runs after, read from the replica
    that keeps it, goes upstream as ``history`` (so any replica can run it) and is counted and sized
    with the request. ``GuardError`` 404 when its tenant has no such response."""
    model = parsed.model
    assert isinstance(model, ResponsesRequest) and model.previous_response_id is not None
    status, answer = await ask_replicas(state, clients, "GET", model.previous_response_id, tenant, "conversation")
    if status == 503:
        raise GuardError(503, "no engine replica is available", code="engine_unavailable", retry_after=1)
    messages = answer.get("messages") if status == 200 and isinstance(answer, dict) else None
    if not isinstance(messages, list):
        raise GuardError(404, f"Response with id {model.previous_response_id!r} not found.",
                         param="previous_response_id", code="response_not_found")
    history = [ChatMessage.model_validate(message) for message in messages]
    parsed.body["history"] = messages
    parsed.counted = model.to_chat(history)


async def ask_replicas(state: GuardState, clients: Clients, method: str, response_id: str, tenant: str,
                       part: str | None = None) -> tuple[int, object]:
    """``/v1/responses/{id}`` (or its ``part``) from the replicas that are up, asked in turn as ``tenant``:
    the first answer other than 404; 404 with the last 404's body when none has the response, 503 when none
    could be asked."""
    timeout = aiohttp.ClientTimeout(total=state.config.upstream.connect_timeout * 2)
    headers = {"X-Tenant-Id": tenant}
    found: tuple[int, object] = (503, None)
    for replica in state.pool:
        if not replica.up():
            continue
        url = yarl.URL(replica.url.rstrip("/")) / "v1" / "responses" / response_id  # the id escaped as a segment
        url = url / part if part is not None else url
        try:
            async with clients.session.request(method, url, headers=headers, timeout=timeout) as answer:
                found = (answer.status, await answer.json(content_type=None))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            continue
        if found[0] != 404:
            return found
    return found


def static_answer(parsed: ParsedRequest, message: str, headers: dict[str, str]) -> web.Response:
    """The static fallback's ``message`` as a completed response, usage zero (no model ran); streamed, as
    the events an engine would send for it."""
    item = OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="completed", content=[OutputText(text=message)])
    usage = ResponseUsage(input_tokens=0, output_tokens=0, total_tokens=0,
                          input_tokens_details=InputTokensDetails())
    done = ResponseObject(id=f"resp_{uuid.uuid4().hex}", created_at=int(time.time()), status="completed",
                          model="static", output=[item], usage=usage, store=False)
    if not parsed.stream:
        return web.Response(text=done.model_dump_json(), content_type="application/json", headers=headers)
    created = done.model_copy(update={"status": "in_progress", "output": [], "usage": None}).model_dump(mode="json")
    opened = item.model_copy(update={"status": "in_progress", "content": []}).model_dump(mode="json")
    part, where = {"type": "output_text", "text": "", "annotations": []}, {"item_id": item.id, "output_index": 0}
    events = [("response.created", {"response": created}),
              ("response.output_item.added", {"output_index": 0, "item": opened}),
              ("response.content_part.added", {**where, "content_index": 0, "part": part}),
              ("response.output_text.delta", {**where, "content_index": 0, "delta": message, "logprobs": []}),
              ("response.output_text.done", {**where, "content_index": 0, "text": message, "logprobs": []}),
              ("response.content_part.done", {**where, "content_index": 0, "part": {**part, "text": message}}),
              ("response.output_item.done", {"output_index": 0, "item": item.model_dump(mode="json")}),
              ("response.completed", {"response": done.model_dump(mode="json")})]
    body = b"".join(sse_event(kind, json.dumps({"type": kind, "sequence_number": n, **fields}))
                    for n, (kind, fields) in enumerate(events))
    return web.Response(body=body, headers={**headers, "Content-Type": "text/event-stream",
                                             "Cache-Control": "no-cache"})
