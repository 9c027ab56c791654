"""An uploaded batch input file, checked whole before it is kept: a file the guard accepts is one it can run.

Each non-blank line is ``{"custom_id": str, "method": "POST", "url": ENDPOINT, "body": {...}}`` and nothing
else; the body is checked as the endpoint itself would check it (guard/http/validate.py's models), and may not
stream (a batch line's answer is a whole response). One endpoint and one model per file (so per batch), and
each ``custom_id`` once. The first fault refuses the file with a 400 naming its line (1-based, blank lines
counted), as OpenAI's validation does; beyond ``max_lines`` lines the file is refused too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pydantic_core
from pydantic import ValidationError

from engine import protocol
from guard.batch.objects import ENDPOINTS
from guard.errors import GuardError
from guard.http.validate import MODELS

KEYS = {"custom_id", "method", "url", "body"}


@dataclass(slots=True)
class Line:
    index: int  # its place among the file's lines (0-based; blank lines not counted)
    custom_id: str
    body: dict[str, Any]


@dataclass(slots=True)
class Lines:
    endpoint: str
    model: str
    items: list[Line]


def refuse(number: int, message: str) -> GuardError:
    return GuardError(400, f"line {number}: {message}", param="file", code="invalid_batch_file")


def parse_lines(content: bytes, max_lines: int) -> Lines:
    """The file's lines, checked (see the module); ``GuardError`` 400 at the first fault."""
    items: list[Line] = []
    seen: set[str] = set()
    endpoint = model = None
    for number, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(items) == max_lines:
            raise GuardError(400, f"the file has more than {max_lines} lines", param="file", code="too_many_lines")
        line = check_line(number, raw)
        if line.custom_id in seen:
            raise refuse(number, f"custom_id {line.custom_id!r} is used by an earlier line")
        endpoint = endpoint or line.url
        model = model or line.model
        if line.url != endpoint:
            raise refuse(number, f"url {line.url!r} differs from the first line's {endpoint!r}: one endpoint per batch")
        if line.model != model:
            raise refuse(number, f"model {line.model!r} differs from the first line's {model!r}: one model per batch")
        seen.add(line.custom_id)
        items.append(Line(len(items), line.custom_id, line.body))
    if endpoint is None or model is None:
        raise GuardError(400, "the file has no lines", param="file", code="invalid_batch_file")
    return Lines(endpoint, model, items)


@dataclass(slots=True)
class Checked:
    custom_id: str
    url: str
    model: str
    body: dict[str, Any]


def check_line(number: int, raw: bytes) -> Checked:
    """One line's fields and body, or the 400 that names what is wrong with it."""
    try:
        data = pydantic_core.from_json(raw)
    except ValueError as exc:
        raise refuse(number, f"not valid JSON: {exc}") from None
    if not isinstance(data, dict) or set(data) != KEYS:
        raise refuse(number, "each line must be an object with exactly custom_id, method, url and body")
    custom_id, url, body = data["custom_id"], data["url"], data["body"]
    if not isinstance(custom_id, str) or not custom_id:
        raise refuse(number, "custom_id must be a non-empty string")
    if data["method"] != "POST":
        raise refuse(number, "method must be POST")
    if url not in ENDPOINTS:
        raise refuse(number, f"url must be one of {', '.join(ENDPOINTS)}")
    if not isinstance(body, dict):
        raise refuse(number, "body must be an object")
    if body.get("stream"):
        raise refuse(number, "a batch line cannot stream (body.stream must be false or absent)")
    try:
        MODELS[url].model_validate(body)
    except ValidationError as exc:
        param, message = protocol.validation_error_param(exc)
        raise refuse(number, f"body{'.' + param if param else ''}: {message}") from None
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise refuse(number, "body.model is required: one model per batch")
    return Checked(custom_id, url, model, body)
