"""The events of one choice's own stream, renumbered into a stream of several choices (guard/http/migrate.py
resumes each choice of an interrupted ``n > 1`` stream as a request of its own; guard/wire/relay.py
``merge`` relays them to the one client stream).

A kvguard engine writes one choice per event, its index first: ``"choices":[{"index":0,``. A choice's own
stream has index 0 throughout; the client's stream gets the choice's index in its place. Its usage-only
event (``"choices":[]``) and its ``[DONE]`` are kept back: the merged stream ends with one usage for every
choice, and one ``[DONE]``.
"""

from __future__ import annotations

import pydantic_core

from guard.wire.resume_tap import ERROR_EVENT

_FIRST_CHOICE = b'"choices":[{"index":0,'
_NO_CHOICE = b'"choices":[]'


class ChoiceFailed(Exception):
    """A choice's own stream said it failed (an ``error`` event): the merged stream cannot go on."""


def renumbered(events: bytes, index: int, usages: list[dict]) -> bytes:
    """Whole ``events`` of choice ``index``'s own stream as the client's stream carries them; its usage
    event's JSON goes to ``usages``. Raises ``ChoiceFailed`` on an error event."""
    kept = []
    for event in events.split(b"\n\n"):
        if not event or event == b"data: [DONE]":
            continue
        if event.startswith(ERROR_EVENT):
            raise ChoiceFailed(event.split(b"data: ", 1)[-1].decode(errors="replace"))
        if _NO_CHOICE in event:
            usages.append(pydantic_core.from_json(event.split(b"data: ", 1)[1]))
            continue
        kept.append(event.replace(_FIRST_CHOICE, b'"choices":[{"index":%d,' % index, 1) + b"\n\n")
    return b"".join(kept)
