"""Nothing lost: a request whose replica lets it down mid-answer continues on another, and its client sees one
unbroken answer (guard/http/forward.py drives it; guard/wire/relay.py and resume_tap.py do the bytes).

- **Which**: every pool request. A unary one, whatever its ``n`` and prompts, is sent again whole (its
  client has seen nothing). A stream is relayed through a ``ResumeTap`` (``tap_for``) and asks its engine
  for the token ids of each event (``return_token_ids``), which the tap takes out of what the client gets.
- **When** (``guard_migrations_total{reason}``): the answer broke off (``reset``, ``closed``), the engine
  ended it with an error that asks for it (``stream_error``: stopping, a failed step; ``drain``: its drain
  timeout ran out, or it refused the request because it drains), or its replica went ``silent``:
  neither the replica's telemetry nor any of its answers in flight said anything for
  ``max(migration.silence_floor_s, migration.silence_steps x its step time)`` (``watch_silence``; a busy
  engine in a long step sends busy heartbeats, so it is never taken for a silent one).
- **How** (``move``): the old replica's circuit opens and its reservation goes back; the request is admitted
  again like any other (fair queue, gate) on the replicas left and sent with what its client already has:
  the token ids of the events relayed (``resume_token_ids``), the answer's id (``request_id``: every id in
  it derives from it) and, for a Responses stream, the count of its events (``resume_sequence_number``).
  The engine continues after those tokens and sends only what the client has not seen; its ``usage`` is
  the whole answer's. A unary request, of which the client has seen nothing, is simply sent again.
- **Several choices** (a stream with ``n > 1``, or of several prompts: choice ``i`` of prompt ``p`` is
  choice ``p * n + i``): ``resume_token_ids`` continues one choice, so each choice that had not ended
  resumes as a request of its own (``choice_bodies``: its prompt, ``n`` 1, its tokens, and its own seed,
  ``seed + i``, the one the engine gave it), all on the replica the request was admitted to again; the
  relay merges their events into the client's stream under each choice's index, and ends it with one
  ``usage`` for every choice (guard/http/forward.py). One of them failing in turn ends the stream with
  its error event: such a stream moves once.
- **Bounds**: at most ``migration.max_migrations`` moves per request; one more failure ends it with an
  explicit error (a stream's ``error`` event, or a 502), as does a pool with no other usable replica (a
  request never moved then fails as it always did: its replica's failure is its answer).

Greedy answers continue exactly. A request with a ``seed`` (and temperature > 0) is resumed with the same
seed, and the engine skips the draws of the resumed tokens, so on engines of the same model and kind it
continues as it would have uninterrupted; without a seed it continues with fresh draws, a different but
equally valid sample.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import pydantic_core

from engine.protocol import ChatCompletionRequest, CompletionRequest, TelemetrySnapshot
from guard.admission.ticket import TicketState
from guard.config import Migration
from guard.http.exchange import Exchange
from guard.http.validate import RESPONSES, ParsedRequest
from guard.instance import GuardState
from guard.pool.replica import Replica
from guard.wire.relay import Relay
from guard.wire.resume_tap import ResumeTap

log = logging.getLogger("guard.migrate")

# What a stream asks its engine for, so that it can be resumed: the body's closing brace replaced.
_TOKEN_IDS = b',"return_token_ids":true}'


def tap_for(parsed: ParsedRequest) -> ResumeTap:
    """The tap every pool request is relayed through; a Responses stream's counts its events. A unary
    answer's reads none of its events (it is sent again whole), so it needs neither count."""
    if not parsed.stream:
        return ResumeTap()
    return ResumeTap(count_events=parsed.path == RESPONSES, choices=choices_of(parsed))


def choices_of(parsed: ParsedRequest) -> int:
    """The answer's choices: ``n`` for each prompt (a completion may send several: choice ``i`` of prompt
    ``p`` is choice ``p * n + i``)."""
    model = parsed.model
    return parsed.n * (len(model.prompts) if isinstance(model, CompletionRequest) else 1)


def choice_bodies(body: bytes, parsed: ParsedRequest, tap: ResumeTap) -> list[tuple[int, bytes]]:
    """A stream of several choices resumed: for each choice that had not ended, its index and the body that
    continues it alone (see the module docstring)."""
    base = {**pydantic_core.from_json(body), "n": 1, "return_token_ids": True, "request_id": tap.answer_key}
    model, n = parsed.model, parsed.n
    prompts = model.prompts if isinstance(model, CompletionRequest) else None
    bodies = []
    for index in range(tap.choices):
        if index not in tap.ended:
            one = dict(base)
            if prompts is not None:
                one["prompt"] = prompts[index // n]
            if token_ids := tap.token_ids(index):  # none yet: it starts over (its first event not sent)
                one["resume_token_ids"] = token_ids
            if model.seed is not None:
                one["seed"] = model.seed + index % n  # the engine seeds choice i of each prompt with seed + i
            bodies.append((index, pydantic_core.to_json(one)))
    return bodies


def resume_body(body: bytes, parsed: ParsedRequest, tap: ResumeTap) -> bytes:
    """A stream's ``body`` (a JSON object) with what resuming needs: its token ids, and once its client's
    stream has begun, what it has seen. (A unary answer's client has seen nothing: its body goes as it is.)"""
    if tap.response is None:
        return body[:-1] + _TOKEN_IDS
    extra: dict[str, object] = {"return_token_ids": True}
    if token_ids := tap.token_ids():
        extra["resume_token_ids"] = token_ids
    if tap.answer_key is not None:
        extra["request_id"] = tap.answer_key
    if parsed.path == RESPONSES:
        extra["resume_sequence_number"] = tap.events
    return body[:-1] + b"," + pydantic_core.to_json(extra)[1:]


async def move(ex: Exchange, tap: ResumeTap) -> str | None:
    """Admit ``ex`` again elsewhere after its replica let it down (``tap.interrupted`` says how); None once
    admitted, else why it may not move. Raises ``GuardError`` when admission refuses it."""
    state, entry, reason = ex.state, ex.entry, tap.interrupted
    assert reason is not None
    ticket = entry.ticket
    replica = ticket.replica
    limit = state.config.migration.max_migrations
    if tap.moves >= limit:
        return f"the request's replica failed ({reason}) after it was moved {tap.moves} times (the most " \
               f"migration.max_migrations allows)"
    if not any(other is not replica and _may_take(other) for other in state.pool):
        return f"the request's replica failed ({reason}) and no other engine replica is available"
    if replica is not None:
        replica.breaker.trip()  # failed, silent or draining: no request should go there until it is healthy
        log.warning("moving request %s off replica %s (%s)", ex.request_id, replica.name, reason)
    state.dispatcher.finish(ticket)
    state.metrics.child(state.metrics.migrations, reason).inc()
    tap.moves, tap.interrupted, tap.comments = tap.moves + 1, None, True  # the next replica may write ids
    entry.ticket = dataclasses.replace(ticket, state=TicketState.NEW, admitted=None, replica=None)
    if entry.growth is not None:
        entry.growth.ticket = entry.ticket
    await state.dispatcher.submit(entry.ticket)
    return None


def _may_take(replica: Replica) -> bool:
    """A replica a moved request may be admitted to, now or once its next snapshot comes: its circuit closed,
    not draining. Not ``usable()``: an idle engine's telemetry comes once a second, so where
    ``telemetry_stale_s`` is about that, a healthy idle replica is unusable for moments, and a request moved
    then gave up (a flake of the silent-replica test under load); the dispatcher waits for it instead."""
    snapshot = replica.gate.snapshot
    return replica.breaker.closed and snapshot is not None and not snapshot.draining


def merged_usage(ex: Exchange, usages: list[dict]) -> bytes:
    """The usage event that ends a merged stream of several choices: each prompt once (as the engine counts
    them, guard/http/tokens.py), and every choice's tokens (an ended one's as its events carried them, the
    others' as their own streams counted them: what was resumed and what followed). ``usages``: those
    streams' usage events, whose shape it takes."""
    tap = ex.entry.observer.tap
    assert tap is not None
    done = sum(len(tap.token_ids(index)) for index in tap.ended)
    if usages:
        event = usages[0]
    else:  # every choice had ended before the break: no stream to take the event's shape from
        chat = isinstance(ex.parsed.model, ChatCompletionRequest)
        event = {"id": ("chatcmpl-" if chat else "cmpl-") + (tap.answer_key or ex.request_id),
                 "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
                 "model": ex.parsed.model.model, "choices": [], "usage": {}}
    prompt, completion = ex.limits.prompt_tokens, done + sum(u["usage"]["completion_tokens"] for u in usages)
    usage = {**event["usage"], "prompt_tokens": prompt, "completion_tokens": completion,
             "total_tokens": prompt + completion}
    return b"data: " + pydantic_core.to_json({**event, "usage": usage}) + b"\n\n"


def silence_deadline(config: Migration, snapshot: TelemetrySnapshot | None) -> float:
    """How long a replica may say nothing before it counts as silent: scaled by its own step time."""
    step = snapshot.step_time_s if snapshot is not None else 0.0
    return max(config.silence_floor_s, config.silence_steps * step)


async def watch_silence(state: GuardState, relay: Relay) -> None:
    """Interrupt every resumable answer of a replica gone silent, so that its requests move (runs until
    cancelled, with the guard's other background tasks)."""
    while True:
        config = state.config.migration
        await asyncio.sleep(config.silence_floor_s / 4)
        now = time.monotonic()
        for replica in state.pool:
            answers = relay.answers_of(replica.name)
            if not answers:
                continue
            heard = max([replica.gate.heard_at, *(tap.last_byte for tap in answers.values() if tap is not None)])
            deadline = silence_deadline(config, replica.gate.snapshot)
            if now - heard > deadline:
                log.warning("replica %s said nothing for %.1f s (deadline %.1f s): moving its %d requests",
                            replica.name, now - heard, deadline, len(answers))
                for answer in list(answers):
                    relay.interrupt(answer, "silent")
