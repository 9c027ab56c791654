"""The Batch API's files and batches as the guard keeps them, and as OpenAI's API shows them.

A file or batch belongs to the tenant that created it: every store lookup takes the tenant, so another
tenant's id is not found (404), never forbidden. A batch's ``request_counts`` are not kept on it: they are
counted from its recorded results whenever it is shown, so they are live and can never disagree with them.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
OPEN = ("validating", "in_progress", "finalizing")  # a runner still has work to do on the batch
TERMINAL = ("completed", "failed", "expired", "cancelled")
WINDOW = re.compile(r"^([1-9][0-9]*)([smh])$")
MAX_WINDOW_S = 24 * 3600


def new_id(prefix: str) -> str:
    """``file-...`` or ``batch_...``, as OpenAI's: 24 random hex digits after the prefix."""
    return prefix + secrets.token_hex(12)


def window_seconds(window: str) -> int | None:
    """A ``completion_window`` in seconds: OpenAI's ``24h``, or a shorter ``<n>s|m|h``; None if it is not one."""
    match = WINDOW.match(window)
    if match is None:
        return None
    seconds = int(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[match.group(2)]
    return seconds if seconds <= MAX_WINDOW_S else None


@dataclass(slots=True)
class FileObject:
    id: str
    tenant: str
    filename: str
    purpose: str  # "batch" (uploaded) or "batch_output" (a batch's output or error file)
    bytes: int
    created_at: int
    lines: int = 0  # the lines of a batch input file

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


@dataclass(slots=True)
class BatchObject:
    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    total: int  # lines in the input file
    model: str  # the one model of its lines
    status: str = "validating"
    metadata: dict[str, str] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: dict[str, Any] | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelled_at: int | None = None
    cancelling_at: int | None = field(default=None)  # kept apart by the stores: a cancel never races a save

    def shown_status(self) -> str:
        """``cancelling`` once a cancel came for a batch still open, else its own status."""
        return "cancelling" if self.cancelling_at is not None and self.status in OPEN else self.status

    def public(self, completed: int, failed: int) -> dict[str, Any]:
        shown = {name: getattr(self, name) for name in (
            "id", "endpoint", "errors", "input_file_id", "completion_window", "output_file_id", "error_file_id",
            "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
            "expired_at", "cancelling_at", "cancelled_at", "metadata")}
        return {**shown, "object": "batch", "status": self.shown_status(), "model": self.model,
                "request_counts": {"total": self.total, "completed": completed, "failed": failed}}

    def to_json(self) -> dict[str, Any]:
        kept = dataclasses.asdict(self)
        kept.pop("cancelling_at")
        return kept

    @classmethod
    def from_json(cls, data: dict[str, Any], cancelling_at: int | None = None) -> BatchObject:
        return cls(**data, cancelling_at=cancelling_at)


def now() -> int:
    return int(time.time())


def page(items: list[Any], after: str | None, limit: int) -> tuple[list[Any], bool]:
    """OpenAI's cursor paging over ``items`` (newest first, each with an ``id``): those after the one named
    ``after`` (all when it is None, none when it is unknown), at most ``limit``, and whether more follow."""
    start = 0
    if after is not None:
        start = next((i + 1 for i, item in enumerate(items) if item.id == after), len(items))
    chosen = items[start:start + limit]
    return chosen, start + limit < len(items)


def listing(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
