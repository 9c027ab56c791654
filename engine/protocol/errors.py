"""OpenAI's error vocabulary, one table for the engine and the guard: the ``type`` of a status, the error
body, and the ``param`` and message of a request that failed validation."""

from __future__ import annotations

import re

from pydantic import BaseModel, ValidationError


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for an answer with ``status``: the one table of the engine and the guard.

    As OpenAI's API answers: a 4xx is ``invalid_request_error`` (a refused key and an unknown model too; their
    ``code``, ``invalid_api_key`` or ``model_not_found``, tells them apart), except 429 ``rate_limit_error``;
    a 5xx is ``server_error``, except 503 ``service_unavailable_error``. OpenAI's SDKs choose their exception
    class by status alone, so ``type`` is for people and ``code`` for programs.
    """
    if status == 429:
        return "rate_limit_error"
    if status == 503:
        return "service_unavailable_error"
    return "invalid_request_error" if status < 500 else "server_error"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail

    @classmethod
    def of(cls, status: int, message: str, *, param: str | None = None, code: str | None = None) -> ErrorResponse:
        return cls(error=ErrorDetail(message=message, type=error_type(status), param=param, code=code))


# Tags pydantic puts in an error location for the union member (or constrained type) that was tried.
_TYPE_TAGS = {"str", "int", "float", "bool", "none"}
_FIELD = re.compile(r"[a-z_][a-z0-9_]*")


def validation_error_param(exc: ValidationError) -> tuple[str | None, str]:
    """The ``param`` (a path such as ``messages[0].content``, None for a body that is no JSON object) and
    the message of a request's first validation error, for the OpenAI error shape.

    A value that fails every member of a union has one error per member; the deepest is the most specific
    (``content[0].type`` rather than "content is not a string").
    """
    errors = exc.errors(include_url=False)
    field = errors[0]["loc"][:1]
    error = max((e for e in errors if e["loc"][:1] == field), key=lambda e: len(e["loc"]))
    if error["type"] in ("json_invalid", "json_type", "model_type", "model_attributes_type"):
        return None, f"must be a JSON object: {error['msg']}"
    param = ""
    for part in error["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif _FIELD.fullmatch(part) and part not in _TYPE_TAGS:
            param += f".{part}" if param else part
    return param or None, str(error["msg"]).removeprefix("Value error, ")
