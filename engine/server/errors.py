"""Errors in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``, as responses and SSE events.

Every failure the server reports goes through ``ApiError``: validation (pydantic, a refused prompt from
engine/prompting/prompts.py, or the engine's own ``ValueError("<field>: ...")``), an unavailable engine, a
failed step, and aiohttp's own HTTP errors (404, 405, 413), which the middleware rewrites so a client never
has to parse two error formats. The ``type`` follows from the status (``engine.protocol.error_type``, which
the guard uses too).
"""

from __future__ import annotations

import logging
import re

from aiohttp import web
from aiohttp.typedefs import Handler
from pydantic import ValidationError

from engine.prompting.prompts import PromptError
from engine.protocol import ErrorResponse, validation_error_param
from engine.request_stream import EngineDraining, EngineUnavailable, RequestFailed, ResumeElsewhere

log = logging.getLogger("engine.server.app")

_FIELD = re.compile(r"[a-z_][a-z0-9_]*")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse.of(status, message, param=param, code=code)
        self.retry_after = retry_after

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return web.Response(status=self.status, text=self.body.model_dump_json(), content_type="application/json",
                            headers=headers)

    @classmethod
    def invalid(cls, exc: ValueError, rename: dict[str, str] | None = None) -> ApiError:
        """A 400 from the engine's ``ValueError("<field>: ...")``; ``rename`` maps engine fields to API ones."""
        message = str(exc)
        field, sep, rest = message.partition(":")
        if not sep or not _FIELD.fullmatch(field):
            return cls(400, message)
        param = (rename or {}).get(field, field)
        return cls(400, f"{param}:{rest}", param=param)

    @classmethod
    def from_validation(cls, exc: ValidationError) -> ApiError:
        """A 400 naming the offending field; a body that is not a JSON object is reported as ``body``."""
        param, message = validation_error_param(exc)
        return cls(400, f"{param or 'body'}: {message}", param=param or "body")

    @classmethod
    def from_prompt(cls, exc: PromptError) -> ApiError:
        return cls(exc.status, str(exc), param=exc.param, code=exc.code)

    @classmethod
    def from_engine(cls, exc: EngineUnavailable | RequestFailed) -> ApiError:
        """``engine_draining``: a new request while the engine drains (another replica should take it);
        ``resume_elsewhere``: one the drain timeout ended, to be resumed on another replica."""
        if isinstance(exc, RequestFailed):
            return cls(500, str(exc), code="engine_step_failed")
        if isinstance(exc, EngineDraining):
            return cls(503, str(exc), code="engine_draining", retry_after=1)
        if isinstance(exc, ResumeElsewhere):
            return cls(503, str(exc), code="resume_elsewhere", retry_after=0)
        return cls(503, str(exc), code="engine_unavailable")


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except PromptError as exc:
        return ApiError.from_prompt(exc).response()
    except (EngineUnavailable, RequestFailed) as exc:
        return ApiError.from_engine(exc).response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return ApiError(exc.status, exc.reason if exc.text is None else exc.text).response()
    except Exception as exc:  # a bug must still answer in the documented shape
        log.exception("unhandled error in %s %s", request.method, request.path)
        return ApiError(500, f"internal error: {exc!r}").response()
