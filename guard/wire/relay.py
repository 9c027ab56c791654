"""Relays one admitted request to a backend and its answer, byte for byte, to the client.

Streams are copied chunk by chunk as they arrive (never buffered whole), less only the usage event that the
guard asked for and the client did not (``StreamObserver``); reading the upstream waits for each write to
the client, so a slow reader holds at most one chunk plus the socket buffers, and one that takes nothing
for ``client_stall_timeout`` is reset (its stream ends, its blocks go back). Time limits: the first byte
of a stream must come within ``first_token_timeout`` (else 504), each later read within ``idle_timeout``;
there is no total timeout, so a legitimate long stream is never cut. A non-streamed answer
comes whole when its generation ends, so ``unary_timeout`` bounds it instead. A stream that fails
after its first byte ends with an SSE ``error`` event and no ``[DONE]``; a client that leaves closes the
upstream connection at once (the engine then aborts the request and frees its blocks). Once ``closing`` is
set (shutdown), the failures that follow are the guard's own: 503 ``shutting_down``, not the engine's fault.
So are those of an answer the guard revokes (a confirmed attacker's): the client is told the reason.

A resumable request (its observer has a ``ResumeTap``, guard/wire/resume_tap.py) is relayed event by event,
and a failure of its replica is not the client's: the answer broke off (reset, closed, an engine error
event asking for it, a read past its deadline, or ``interrupt``: the replica went silent) sets the tap's
``interrupted`` to the reason and leaves the client's stream open (``tap.response``) or, before anything was
sent, the failure unsent. The caller (guard/http/forward.py) then ``carry_on``s with another replica's
answer, or ends the stream (``end_stream``). Answers are tracked by the backend they came from, so that a
silent replica's can all be interrupted at once (``answers_of``).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pydantic_core
from aiohttp import web

from guard.config import Upstream
from guard.errors import GuardError
from guard.wire import choices
from guard.wire.choices import ChoiceFailed
from guard.wire.errors import error_response, sse_error_event
from guard.wire.front_request import FrontRequest, FrontStream
from guard.wire.resume_tap import RESUMABLE_CODES, ResumeTap
from guard.wire.upstream import Answer, ConnectFailed, Disconnected, Reset, UpstreamClient, UpstreamError

SHUTTING_DOWN = "the guard is shutting down; retry shortly"
# A client transport pauses its writers once it buffers more than its high-water mark (64 KiB by default),
# and resumes them below its low-water mark (16 KiB): a chunk that leaves the buffer below this cannot make
# a write wait, so it needs no stall timer.
WRITE_NEVER_WAITS_BYTES = 16 * 1024


Client = web.Request | FrontRequest  # aiohttp's request, or the front's (guard/wire/front.py)
Stream = web.StreamResponse | FrontStream  # the stream written to either


class ClientGone(Exception):
    """The client left, or stalled and was dropped: nobody reads the stream any more."""


class UpstreamUnavailable(Exception):
    """Nothing was sent: the backend refused or did not accept the connection (safe to try another)."""


@dataclass(slots=True)
class StreamObserver:
    """Reads an SSE answer as it is relayed: its token events, first-token time, the gaps between tokens and
    the usage figure, and decides which bytes the client gets.

    ``output_tokens`` is the engine's ``usage.completion_tokens`` whenever the stream carried usage, which a
    kvguard engine always does, since the guard asks for it on every stream (guard/http/validate.py); one
    per token event is only the fallback for a backend that sends none (a fallback that ignores
    ``stream_options``), and undercounts where an event carries several tokens (a forced tool call, sent
    whole; tokens that decode to no text).

    Without ``strip_usage`` each chunk goes to the client as it came. With it (the guard asked for usage the
    client did not), the client gets the upstream bytes less the usage-only event (its ``data:`` line, whose
    ``choices`` is empty, and the blank line that ends it): exactly what it would have got without the guard.
    Lines are then relayed whole: a complete line goes out with the chunk that completes it, a trailing
    line without its newline is held back until that comes, and ``flush`` hands back what is still held
    when the stream ends. Only a line that carries ``"usage":{`` is ever parsed as JSON.
    """

    on_first_token: Callable[[float], None]
    on_gap: Callable[[float], None]
    strip_usage: bool = False  # drop the usage-only event: the client did not ask for it
    events: int = 0
    finished: bool = False  # ``[DONE]`` went to the client: whatever happens next, it got its answer
    failed: bool = False  # the stream ended with an error event instead of its natural end
    client_gone: bool = False  # the client left or was dropped before the end: nobody got the rest
    completion_tokens: int | None = None  # from a usage chunk (or a non-streamed answer's usage)
    tap: ResumeTap | None = None  # a resumable request's (see the module docstring); None: not resumable
    cached_tokens: int | None = None  # the usage's prompt_tokens_details.cached_tokens: the engine's prefix hit
    first_at: float = 0.0  # time.monotonic() of the first token event (0.0: none yet)
    _partial: bytes = b""  # the last line so far, its newline not yet come
    _dropped: bool = False  # the previous line was a dropped usage line: a blank line after it goes too
    _last: float = field(default=0.0)

    def feed(self, chunk: bytes) -> bytes:
        """Observe ``chunk``; returns what the client gets of it now. With a tap, that is whole events only,
        less what the tap takes out (see ``ResumeTap``); the relay then reads ``tap.interrupted``."""
        tap = self.tap
        if tap is None:
            return self.feed_events(chunk)
        # One pass for the tap and the observer: a kvguard engine's usual chunk (one token event) is one
        # token; other events with tokens only (whole, their comments out) are counted here; the tap's
        # ``notice`` and the line-by-line reading are for the others.
        now = time.monotonic()
        if tap.ids and (event := tap.token_event(chunk, now)) is not None:
            self._token(now)
            return event
        events = tap.whole_events(chunk, now)
        if not events:
            return b""
        if tap.plain and not self._dropped and _tokens_only(events):
            self._tokens(events, now)
            return events
        events = tap.notice(events)
        return self.feed_events(events) if events else b""

    def feed_events(self, chunk: bytes) -> bytes:
        """``feed`` without the tap: for a stream without one, and for events a tap already took (each choice
        of a moved stream has its own, guard/wire/relay.py ``merge``)."""
        data = self._partial + chunk if self._partial else chunk
        if not self._dropped and _tokens_only(data):
            end = data.rfind(b"\n") + 1  # past the last complete line
            self._partial, lines = data[end:], data[:end]
            if end:
                self._tokens(lines, time.monotonic())  # the events of one chunk arrived together
            return lines if self.strip_usage else chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        kept: list[bytes] | None = None  # the lines relayed, once one was dropped (None: all of them)
        for i, line in enumerate(lines):
            if self._dropped and not line.strip():  # the blank line that ends the dropped usage event
                drop, self._dropped = True, False
            else:
                drop = self._dropped = self._observe(line)
            if drop and kept is None:
                kept = lines[:i]
            elif not drop and kept is not None:
                kept.append(line)
        if not self.strip_usage:
            return chunk
        if kept is None:
            return data[:len(data) - len(self._partial)]
        return b"".join(line + b"\n" for line in kept)

    def _tokens(self, lines: bytes, now: float) -> None:
        """Complete ``lines`` where none is usage, an error or the end: each ``data:`` line is a token."""
        for _ in range(lines.count(b"\ndata:") + lines.startswith(b"data:")):
            self._token(now)

    def flush(self) -> bytes:
        """The stream ended: what is still held back, as it came (the tap's unfinished last event too). A
        last line without its newline is no SSE event (a client drops an event its stream ends in), so it is
        relayed but not observed."""
        rest = self._unfinished()
        held, self._partial = self._partial, b""
        return rest + held if self.strip_usage else rest

    def _unfinished(self) -> bytes:
        """At the stream's end, what the tap held of an event without its blank line, observed (b"": none)."""
        unfinished = self.tap.flush() if self.tap is not None else b""
        return self.feed_events(unfinished) if unfinished else b""

    def _observe(self, line: bytes) -> bool:
        """Take one complete line into account; True when it is the usage-only line to drop."""
        if not line.startswith(b"data:"):
            return False
        if len(line) < 32 and line[5:].strip() == b"[DONE]":
            self.finished = True
            return False
        # Spaces are taken out (a copy of the line) only where the plain test says the line may match.
        if b'"error"' in line and line.replace(b" ", b"").startswith(b'data:{"error":{'):
            return False  # the engine's error event ends the stream: no token, no gap between tokens
        now = time.monotonic()
        if b'"usage"' in line and b'"usage":{' in line.replace(b" ", b""):
            try:
                chunk = json.loads(line[5:])
            except ValueError:
                chunk = None
            if isinstance(chunk, dict) and isinstance(usage := chunk.get("usage"), dict):
                self.read_usage(usage)
                if chunk.get("choices") == []:  # the usage-only chunk carries no token
                    return self.strip_usage
        self._token(now)
        return False

    def read_usage(self, usage: dict) -> None:
        """Take an answer's ``usage`` (a usage chunk's, or a non-streamed answer's)."""
        self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        self.cached_tokens = cached_tokens(usage)

    def _token(self, now: float) -> None:
        if self.events == 0:
            self.first_at = now
            self.on_first_token(now)
        else:
            self.on_gap(now - self._last)
        self._last = now
        self.events += 1

    @property
    def last_at(self) -> float:
        """time.monotonic() of the last token event so far (0.0: none yet)."""
        return self._last

    @property
    def output_tokens(self) -> int:
        """Tokens the client received: the usage figure when there is one, else one per token event."""
        return self.completion_tokens if self.completion_tokens is not None else self.events


def _tokens_only(data: bytes) -> bool:
    """No line of ``data`` can be usage, an error or the end (``find``: cheaper than ``in`` on bytes). A
    ``"usage"`` key that is null is no usage: a kvguard engine's token chunks carry ``"usage":null`` once
    usage was asked for, as OpenAI's do (a quote inside a text is escaped, so ``"usage"`` is only ever a key;
    one spelled otherwise, as with a space, is read line by line)."""
    at = data.find(b'"usage"')
    while at >= 0:
        if not data.startswith(b'"usage":null', at):
            return False
        at = data.find(b'"usage"', at + 12)
    return data.find(b'"error"') < 0 and data.find(b"[DONE]") < 0


class Relay:
    def __init__(self, client: UpstreamClient, config: Upstream) -> None:
        self.client = client
        self.config = config
        self.closing = False  # the guard is shutting down and drops its upstream connections itself
        self._open: set[Answer] = set()  # answers being relayed, for close_all
        self._revoked: dict[Answer, GuardError] = {}  # ended by the guard, and why
        self._interrupted: dict[Answer, str] = {}  # ended by the guard to be resumed elsewhere, and why
        self._by_backend: dict[str, dict[Answer, ResumeTap | None]] = {}  # resumable answers in flight

    async def open(self, url: str, body: bytes, headers: dict[str, str], stream: bool,
                   backend: str | None = None, tap: ResumeTap | None = None) -> Answer:
        """Send the request and wait for the answer's headers: within the first-token timeout for a stream
        (each later read within the idle timeout), within the unary timeout for an answer that comes whole
        once generated (and each read of its body too). A resumable one (``tap``) is tracked under
        ``backend`` from the moment it is sent, headers or not."""
        config = self.config
        first_byte, read = ((config.first_token_timeout, config.idle_timeout) if stream
                            else (config.unary_timeout, config.unary_timeout))
        try:
            upstream = await self.client.send(url, body, headers, read)
        except ConnectFailed as exc:
            # Refused, or not accepted within connect_timeout: no byte of the request left, so another
            # backend may take it (a hung host must not cost the client more than the connect budget).
            raise UpstreamUnavailable(str(exc)) from exc
        if tap is not None and backend is not None:
            tracked = self._by_backend.get(backend) or self._by_backend.setdefault(backend, {})
            tracked[upstream] = tap
        try:
            await upstream.start(first_byte)
        except BaseException as exc:  # failed, or cancelled (the client left): closed, and no longer tracked
            # At shutdown the guard cut it, and a cancelled request has nobody to move for.
            if isinstance(exc, UpstreamError | TimeoutError) and tap is not None and not self.closing:
                tap.interrupted = self._reason_of(exc, upstream)
            self._forget(upstream)
            raise
        self._open.add(upstream)  # until unary() or stream() is done with it
        return upstream

    def answers_of(self, backend: str) -> dict[Answer, ResumeTap | None]:
        """The resumable answers in flight from ``backend`` (sent, their headers come or not), with their taps."""
        return self._by_backend.get(backend, {})

    def interrupt(self, upstream: Answer, reason: str) -> None:
        """End a resumable answer so that its request moves to another replica (its replica went silent)."""
        self._interrupted[upstream] = reason
        upstream.close()

    def _forget(self, upstream: Answer) -> None:
        self._open.discard(upstream)
        self._revoked.pop(upstream, None)
        self._interrupted.pop(upstream, None)
        for tracked in self._by_backend.values():
            tracked.pop(upstream, None)

    def _reason_of(self, exc: BaseException | None, upstream: Answer | None) -> str:
        """Why a resumable answer broke off, as ``guard_migrations_total`` counts it."""
        if upstream is not None and (reason := self._interrupted.get(upstream)) is not None:
            return reason
        if isinstance(exc, Reset):
            return "reset"
        if isinstance(exc, TimeoutError):
            return "silent"
        return "closed" if exc is None or isinstance(exc, Disconnected) else "stream_error"  # garbage: stream_error

    def resumable(self, upstream: Answer, tap: ResumeTap | None) -> bool:
        """A broken answer the request may move on from: resumable, neither revoked nor cut by shutdown."""
        return tap is not None and not self.closing and upstream not in self._revoked

    def close_all(self) -> None:
        """Shutdown: end every answer being relayed now (each stream with its error event), and every request
        still waiting for its answer's headers."""
        self.closing = True
        for upstream in list(self._open):
            upstream.close()
        self.client.close()

    def revoke(self, upstream: Answer, reason: GuardError) -> None:
        """End an answer being relayed: the engine sees the disconnect and aborts, the client gets ``reason``
        (a stream as its error event)."""
        if upstream in self._open:
            self._revoked[upstream] = reason
            upstream.close()

    async def unary(self, upstream: Answer, headers: dict[str, str], tap: ResumeTap | None = None
                    ) -> tuple[web.Response, dict | None]:
        """A non-streaming answer: forwarded as is when it is JSON, else a 502. Returns the parsed body too.
        With ``tap``, an answer that broke off, or a 503 asking to be resumed elsewhere, sets its reason."""
        try:
            async with upstream:
                raw = await upstream.read()
        except (UpstreamError, TimeoutError) as exc:  # the engine died or went quiet mid-body
            if self.resumable(upstream, tap):
                tap.interrupted = self._reason_of(exc, upstream)  # type: ignore[union-attr]
            return self.failure(502, f"the engine's answer broke off: {type(exc).__name__}", "upstream_error",
                                headers, upstream), None
        finally:
            self._forget(upstream)
        try:
            parsed = pydantic_core.from_json(raw)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):  # garbage, or JSON that is not an answer object
            message = f"the engine answered {upstream.status} with a body that is not a JSON object"
            return error_response(502, message, code="bad_upstream_response", headers=headers), None
        if upstream.status in (429, 503):  # the guard's contract: every 429 and 503 says when to come back
            headers = {**headers, "Retry-After": upstream.headers.get("retry-after", "1")}
            if tap is not None:
                tap.interrupted = _resumable_error(parsed)
        return web.Response(body=raw, status=upstream.status, content_type="application/json",
                            headers=headers), parsed

    async def stream(
        self, client: Client, upstream: Answer, headers: dict[str, str],
        observer: StreamObserver,
    ) -> Stream:
        """Copy an SSE answer to the client as ``observer`` passes it on (whatever it held back is written
        before the stream ends, its error event included). Returns the prepared response; never raises for
        upstream faults. A resumable stream that breaks off is left open (see the module docstring)."""
        completed = False
        tap = observer.tap
        try:
            first = await self._first_chunk(upstream, headers, tap)
            if isinstance(first, web.StreamResponse):
                return first
            headers = {**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            try:
                response = await _start_stream(client, headers)
            except ConnectionError:  # the client left while the first token was on its way
                observer.client_gone = True
                return web.StreamResponse(status=200, headers=headers)
            if tap is not None:
                tap.response = response
            completed = await self._copy(client, response, upstream, first, observer)
            return response
        finally:
            self._forget(upstream)
            if not completed:
                upstream.close()  # drop the connection: the engine sees the disconnect and aborts
            else:
                upstream.release()

    async def carry_on(self, client: Client, upstream: Answer, observer: StreamObserver) -> bool:
        """Continue a resumable stream that broke off (``tap.response``, still open) with another replica's
        answer; True when it reached its natural end. A replica that refuses to resume ends the stream with
        its error; one that drains (or breaks off in turn) sets ``tap.interrupted`` again."""
        tap = observer.tap
        assert tap is not None and tap.response is not None
        tap.interrupted = None
        completed = False
        try:
            if upstream.status != 200 or not upstream.content_type.startswith("text/event-stream"):
                refusal, _ = await self.unary(upstream, {}, tap)
                if tap.interrupted is None:
                    await self.end_stream(tap.response, observer, f"the engine refused to resume the stream "
                                          f"({refusal.status}): {refusal.text}")
                return False
            completed = await self._copy(client, tap.response, upstream, None, observer)
            return completed
        finally:
            self._forget(upstream)
            if not completed:
                upstream.close()
            else:
                upstream.release()

    async def merge(self, client: Client, parts: list[tuple[int, Answer, ResumeTap]], observer: StreamObserver
                    ) -> list[dict] | None:
        """Continue a stream of several choices that broke off (``observer.tap.response``, still open) with one
        answer per choice that had not ended (``parts``: the choice's index, its answer, a tap of its own):
        their events go to the client as they come, under their choice's index, without their usage and
        ``[DONE]`` (guard/wire/choices.py). Returns their usage events; None when one failed (the client's
        stream then ended with its error event) or the client left (``observer.client_gone``)."""
        assert observer.tap is not None and observer.tap.response is not None
        response, usages = observer.tap.response, []

        async def relay_one(index: int, upstream: Answer, tap: ResumeTap) -> None:
            if upstream.status != 200 or not upstream.content_type.startswith("text/event-stream"):
                refusal, _ = await self.unary(upstream, {})
                raise ChoiceFailed(f"the engine refused to resume choice {index} ({refusal.status}): {refusal.text}")
            chunk = await upstream.readany()
            while chunk:
                events = tap.take(chunk)
                if tap.interrupted is not None:
                    raise ChoiceFailed(f"choice {index}'s engine failed ({tap.interrupted})")
                if events and (kept := choices.renumbered(events, index, usages)) \
                        and (relayed := observer.feed_events(kept)):
                    await self._write(client, response, relayed)
                chunk = await upstream.readany()
            if not upstream.is_eof():
                raise ChoiceFailed(f"choice {index}'s engine stream ended early")

        try:
            async with asyncio.TaskGroup() as group:  # one failing cancels the others
                for part in parts:
                    group.create_task(relay_one(*part))
        except* ClientGone:
            observer.client_gone = True
        except* (ChoiceFailed, UpstreamError, TimeoutError) as failed:
            await self.end_stream(response, observer, f"the request's stream of {observer.tap.choices} "
                                  f"choices failed after it was moved: {_first_reason(failed)}")
        finally:
            for _, upstream, _ in parts:
                self.abandon(upstream)
        return None if observer.client_gone or observer.failed else usages

    async def end_merged(self, client: Client, observer: StreamObserver, last: bytes) -> None:
        """End a merged stream (``merge``) with ``last`` (its usage event) and ``[DONE]``."""
        assert observer.tap is not None and observer.tap.response is not None
        response = observer.tap.response
        try:
            if relayed := observer.feed_events(last + b"data: [DONE]\n\n"):
                await self._write(client, response, relayed)
            await response.write_eof()
        except (ClientGone, ConnectionError):
            observer.client_gone = True

    def abandon(self, upstream: Answer) -> None:
        """Stop relaying ``upstream``: forgotten, its connection dropped if its answer was not read to the end."""
        self._forget(upstream)
        upstream.release()

    async def end_stream(self, response: Stream, observer: StreamObserver, message: str) -> None:
        """End a stream that cannot go on (a resumable one that may not move again) with its error event."""
        observer.failed = True
        await _try_write(response, self.failure_event(message))

    async def _first_chunk(self, upstream: Answer, headers: dict[str, str], tap: ResumeTap | None
                           ) -> bytes | web.StreamResponse:
        """The stream's first bytes, or the whole answer when it is no stream or fails before them."""
        if upstream.status != 200 or not upstream.content_type.startswith("text/event-stream"):
            response, _ = await self.unary(upstream, headers, tap)
            if 200 <= response.status < 300:  # a 200 that is not a stream is still not what we asked for
                return error_response(502, "the engine did not answer with an event stream",
                                      code="bad_upstream_response", headers=headers)
            return response
        try:
            async with asyncio.timeout(self.config.first_token_timeout):
                return await upstream.readany()
        except TimeoutError as exc:
            if self.resumable(upstream, tap):
                tap.interrupted = self._reason_of(exc, upstream)  # type: ignore[union-attr]
            return error_response(504, "the engine sent no token within the first-token timeout",
                                  code="upstream_timeout", headers=headers)
        except UpstreamError as exc:  # nothing reached the client yet: a plain 502 says it best
            if self.resumable(upstream, tap):
                tap.interrupted = self._reason_of(exc, upstream)  # type: ignore[union-attr]
            return self.failure(502, f"the engine failed before its first token: {type(exc).__name__}",
                                "upstream_error", headers, upstream)

    async def _copy(self, client: Client, response: Stream, upstream: Answer,
                    chunk: bytes | None, observer: StreamObserver) -> bool:
        """Relay the stream from ``chunk`` on (None: from the next read); True when it reached its natural
        end. A failure mid-stream ends the client's stream with an error event, unless the request is
        resumable: then the tap says why, and the stream stays open."""
        tap = observer.tap
        try:
            if chunk is None:
                chunk = await upstream.readany()
            while chunk:
                if relayed := observer.feed(chunk):  # nothing when the chunk only began a line (or an event)
                    await self._write(client, response, relayed)
                if tap is not None and tap.interrupted is not None:  # an engine error event asks to move
                    return False
                chunk = await upstream.readany()
            completed = upstream.is_eof()
            if completed and (held := observer.flush()):
                await self._write(client, response, held)
        except ClientGone:
            observer.client_gone = True
            return False
        except (UpstreamError, TimeoutError) as exc:  # the engine failed or went quiet mid-stream
            if tap is not None:
                tap.reset_held()  # an unfinished event never goes out
            if self.resumable(upstream, tap):
                tap.interrupted = self._reason_of(exc, upstream)  # type: ignore[union-attr]
                return False
            observer.failed = True
            await _try_write(response, observer.flush() + self.failure_event(
                f"the engine stream failed: {type(exc).__name__}", upstream))
            return False
        if not completed:
            if tap is not None:
                tap.reset_held()
            if self.resumable(upstream, tap):
                tap.interrupted = "closed"  # type: ignore[union-attr]
                return False
            observer.failed = True
            await _try_write(response, observer.flush() + self.failure_event("the engine stream ended early",
                                                                             upstream))
            return False
        try:
            await response.write_eof()
        except ConnectionError:  # the client left after the last chunk was handed to the transport
            observer.client_gone = True
        return True

    def failure(self, status: int, message: str, code: str, headers: dict[str, str] | None = None,
                upstream: Answer | None = None) -> web.Response:
        """The answer to a request whose upstream failed before its first byte reached the client."""
        if (revoked := self._revoked.get(upstream)) is not None:
            return error_response(revoked.status, revoked.message, code=revoked.code,
                                  retry_after=revoked.retry_after, headers=headers)
        if self.closing:
            return error_response(503, SHUTTING_DOWN, code="shutting_down", retry_after=1, headers=headers)
        return error_response(status, message, code=code, headers=headers)

    def failure_event(self, message: str, upstream: Answer | None = None) -> bytes:
        """The event that ends a stream whose upstream failed after it started."""
        if (revoked := self._revoked.get(upstream)) is not None:
            return sse_error_event(revoked.status, revoked.message, revoked.code)
        if self.closing:
            return sse_error_event(503, SHUTTING_DOWN, "shutting_down")
        return sse_error_event(502, message, "upstream_stream_error")

    async def _write(self, client: Client, response: Stream, chunk: bytes) -> None:
        """Write one chunk; raises ``ClientGone`` if the client left or read nothing for the stall timeout."""
        transport = client.transport
        try:
            if transport is not None and transport.get_write_buffer_size() + len(chunk) < WRITE_NEVER_WAITS_BYTES:
                await response.write(chunk)
            else:
                async with asyncio.timeout(self.config.client_stall_timeout):
                    await response.write(chunk)
        except ConnectionError:
            raise ClientGone("the client left") from None
        except TimeoutError:
            if client.transport is not None:
                _reset(client.transport)
            raise ClientGone(f"the client read nothing for {self.config.client_stall_timeout:g} s") from None


async def _start_stream(client: Client, headers: dict[str, str]) -> Stream:
    """A 200 event stream's head sent to the client; its events follow through what is returned."""
    if isinstance(client, FrontRequest):  # guard/wire/front.py's: written straight to its transport
        return client.start_stream(200, headers)
    response = web.StreamResponse(status=200, headers=headers)
    await response.prepare(client)
    return response


def _reset(transport: asyncio.BaseTransport) -> None:
    """Drop a connection at once with a TCP reset. A plain close would wait for the unread buffer to drain
    and then queue a FIN behind megabytes the stalled reader never takes, so the kernel would keep them."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def _try_write(response: Stream, data: bytes) -> None:
    try:
        await response.write(data)
        await response.write_eof()
    except (ConnectionError, RuntimeError):
        pass  # the client is gone too


def _resumable_error(answer: dict) -> str | None:
    """Why an engine's error answer asks for the request to go to another replica (None: it does not)."""
    error = answer.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    if not isinstance(code, str):
        return None
    return "drain" if code == "engine_draining" else RESUMABLE_CODES.get(code.encode())


def _first_reason(failed: BaseExceptionGroup) -> str:
    first = failed.exceptions[0]
    return str(first) or type(first).__name__


def cached_tokens(usage: dict) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` when the answer reports it."""
    details = usage.get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) else None
