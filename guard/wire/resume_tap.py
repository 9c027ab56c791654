"""What a resumable stream has relayed, so that another replica can take it over (guard/http/migrate.py).

A kvguard engine asked for ``return_token_ids`` precedes each stream event with the comment line
``: token_ids <choice index> <id>,<id>,...``: the tokens the event's choice gained (engine/server/openai_api.py).
The tap sits in front of the stream's observer and lets through whole events only (up to the last blank
line; the rest waits for its end), without those comment lines, which the client did not ask for (a comment
is a line of its own: the same bytes inside a data line's text are text). So at every moment the token ids
it holds for each choice are exactly those of the events the client was sent, and a replica resumed with
them (``resume_token_ids``) sends exactly what the client has not seen yet. A stream of several choices
(``choices``) also notes which of them ended (their finish reason was relayed): only the others resume.

It also keeps the answer's id key (``request_id``: every id of the answer derives from it), the count of
``data:`` events relayed (a Responses stream's next ``sequence_number``), when the stream last sent a byte
(the silence watch), and withholds an engine ``error`` event that asks for the request to be resumed
elsewhere (``RESUMABLE_CODES``), which then ends the stream here with ``interrupted`` set.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

COMMENT = b": token_ids "
_COMMENT_LENGTH = len(COMMENT)
_LINE_COMMENT = b"\n" + COMMENT  # a comment after the first line
# A comment line less its own newline, after the newline that ends the line before (which it takes instead).
_COMMENT_LINES = re.compile(rb"\n: token_ids ([^\n]*)")
ERROR_EVENT = b"event: error\n"
# An engine error that says the request did not fail, its replica did: drained past its deadline
# (``resume_elsewhere``), stopping (``engine_unavailable``) or a failed step (``engine_step_failed``).
RESUMABLE_CODES = {b"resume_elsewhere": "drain", b"engine_unavailable": "stream_error",
                   b"engine_step_failed": "stream_error"}
# A choice's last event: its finish reason is a string (null before). One choice per event; a quote inside a
# text is escaped, so this unescaped key only stands for the choice's own.
_CHOICE_ENDS = re.compile(rb'"choices":\[\{"index":(\d+),[^\n]*?"finish_reason":"')
_ANSWER_ID = re.compile(rb'"id":\s*"(?:chatcmpl-|cmpl-|resp_)([A-Za-z0-9_-]{1,64})"')


@dataclass(slots=True)
class ResumeTap:
    count_events: bool = False  # count the data events relayed (a Responses stream's sequence numbers)
    choices: int = 1  # the stream's choices (``n``): with several, which of them ended is noted (``ended``)
    ended: set[int] = field(default_factory=set)  # of several choices, those whose last event was relayed
    events: int = 0  # data events relayed, when counted
    answer_key: str | None = None  # the answer id's key, from the first event (None: not a kvguard engine's)
    interrupted: str | None = None  # why the answer broke off, when its request is to move (None: it did not)
    moves: int = 0  # replicas the request has moved to
    last_byte: float = field(default_factory=time.monotonic)
    response: Any = None  # the client's stream once it started (a web.StreamResponse or the front's stream)
    # ``notice`` has nothing to do for events of tokens only (no error, no finish reason to note): the answer's
    # id is known, the events are not counted and there is one choice (set once the id was looked for).
    plain: bool = False
    # A ``plain`` stream whose first events carried token id comments (a kvguard engine's: its first event has
    # its first token's): its usual chunk is one token event after its comment (``token_event``).
    ids: bool = False
    # The answer may carry token id comments: until its first events showed none in a ``plain`` stream (an
    # engine that does not write them: its later events have none either, since a kvguard engine's first
    # token event carries its ids); a move sets it again (guard/http/migrate.py), the next replica may write them.
    comments: bool = True
    _held: bytes = b""  # the last event so far, its blank line not yet come
    _looked: bool = False  # for the answer's id
    _ids: list[bytes] = field(default_factory=list)  # the comments' runs ("<choice> <id>,...", some with the
    # comment's prefix still on: whole_events keeps the line), parsed when resumed

    def take(self, chunk: bytes) -> bytes:
        """The whole events ``chunk`` completes, without their token id comments (b"": none yet)."""
        events = self.whole_events(chunk, time.monotonic())
        return self.notice(events) if events else events

    def token_event(self, chunk: bytes, now: float) -> bytes | None:
        """A kvguard engine's usual chunk, one token event after its id comment: the event without the comment
        (its ids kept), or None for any other chunk (``whole_events`` reads it). Only where ``ids`` says
        so: in a stream of one choice, a token id comment followed by one line and the blank line is a token
        chunk of that choice, never its usage, an error or its end (engine/server/openai_api.py), so the
        observer need not search it for them. Two partitions (one argument each, where ``find`` and
        ``startswith`` parse a tuple of arguments first) see the whole event: a comment, one line, a blank."""
        if self._held:
            return None
        comment, _, event = chunk.partition(b"\n")
        line, _, end = event.partition(b"\n")
        if end != b"\n" or not line or comment[:_COMMENT_LENGTH] != COMMENT:
            return None
        self.last_byte = now
        self._ids.append(comment)
        return event

    def whole_events(self, chunk: bytes, now: float) -> bytes:
        """``take``'s first half, which every chunk needs: the whole events ``chunk`` (arrived at ``now``)
        completes, their comments taken out and their ids kept (b"": none yet). Unless ``plain`` says so,
        they must then go through ``notice``; a stream's observer does both in its one pass over the chunk
        (guard/wire/relay.py), where ``notice`` is needed only for events that say more than tokens."""
        self.last_byte = now
        if self._held:
            chunk, self._held = self._held + chunk, b""
        if not chunk.endswith(b"\n\n"):  # a paced stream's every chunk ends an event: no search, no copy
            end = chunk.rfind(b"\n\n") + 2
            if end < 2:
                self._held = chunk
                return b""
            self._held, chunk = chunk[end:], chunk[:end]
        if not self.comments:
            return chunk
        if chunk.startswith(COMMENT):
            # A kvguard engine's one event: its comment first, and no other. One partition finds the comment's
            # end and copies what follows (what the client gets), where a find and two slices cost 20 % more;
            # one search from the comment's own newline on finds any other comment line, the next one included.
            comment, _, rest = chunk.partition(b"\n")
            if chunk.find(_LINE_COMMENT, len(comment)) < 0:
                self._ids.append(comment)  # the whole line: token_ids skips its prefix when resumed
                return rest
            return self._strip(chunk)
        return self._strip(chunk) if chunk.find(_LINE_COMMENT) >= 0 else chunk

    def notice(self, events: bytes) -> bytes:
        """``take``'s second half: ``events`` (whole, from ``whole_events``) less an engine error that asks
        for a resume, which it withholds; the answer's id, the events counted, the choices that ended."""
        if not self._looked:  # the first events relayed carry the answer's id
            self._looked, self.plain = True, not self.count_events and self.choices == 1
            self.ids = self.plain and bool(self._ids)
            self.comments = self.ids or not self.plain
            if found := _ANSWER_ID.search(events):
                self.answer_key = found.group(1).decode()
        if events.find(ERROR_EVENT) >= 0:
            events = self._withhold_error(events)
        if self.count_events:
            self.events += events.count(b"\ndata:") + events.startswith(b"data:")
        if self.choices > 1:
            self.ended.update(int(index) for index in _CHOICE_ENDS.findall(events))
        return events

    def token_ids(self, choice: int = 0) -> list[int]:
        """The token ids of choice ``choice`` in every event relayed so far, in order."""
        ids: list[int] = []
        for run in self._ids:
            index, _, tokens = run.removeprefix(COMMENT).partition(b" ")
            if int(index) == choice:
                ids += map(int, tokens.split(b","))
        return ids

    def flush(self) -> bytes:
        """The stream ended normally: what came after its last blank line (an upstream that does not end its
        last event with one), as it came, less any token id comment."""
        held, self._held = self._held, b""
        return self._strip(held)

    def reset_held(self) -> None:
        """The stream broke off: what came of an unfinished event was never relayed, and never will be."""
        self._held = b""

    def _strip(self, events: bytes) -> bytes:
        """``events`` without their comment lines, whose id runs are kept. A comment begins a line: the same
        bytes inside a data line are its text (a JSON string holds no raw newline, so a line begins only
        where one does). One split in C, where a loop over the comments cost 0.7 us each (timeit)."""
        parts = _COMMENT_LINES.split(b"\n" + events)  # a newline first: the first line is a line too
        self._ids += parts[1::2]
        return b"".join(parts[::2])[1:]

    def _withhold_error(self, events: bytes) -> bytes:
        start = events.find(ERROR_EVENT)
        if start > 0 and events[start - 1:start] != b"\n":
            return events  # "event: error" inside another line (a text): no event of its own
        error = events[start:]
        for code, reason in RESUMABLE_CODES.items():
            if b'"' + code + b'"' in error:
                self.interrupted = reason
                return events[:start]
        return events
