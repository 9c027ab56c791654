"""A batch's output and error files, line by line in OpenAI's format:

    {"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id", "body"}, "error": null}

An engine's 200 goes to the output file, any other answer that is the line's own to the error file, with
its status and body. Once a batch ends early, each line that never ran is written to the error file as
``{"response": null, "error": {"code": "batch_expired" | "batch_cancelled", "message"}}``. Both files list
the lines in the input file's order; a file with no line is not made (its id stays null, as OpenAI's).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from guard.batch.objects import FileObject, now
from guard.batch.validate import Line

NOT_RUN = {
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "cancelled": ("batch_cancelled", "This request was not executed: the batch was cancelled."),
}


def answer_line(line: Line, request_id: str, status: int, body: bytes) -> bytes:
    """A line's answer as its output (or error) line."""
    try:
        parsed: Any = json.loads(body) if body else None
    except ValueError:
        parsed = body.decode("utf-8", "replace")
    return json.dumps({"id": "batch_req_" + secrets.token_hex(12), "custom_id": line.custom_id,
                       "response": {"status_code": status, "request_id": request_id, "body": parsed},
                       "error": None}).encode()


def not_run_line(line: Line, ending: str) -> bytes:
    code, message = NOT_RUN[ending]
    return json.dumps({"id": "batch_req_" + secrets.token_hex(12), "custom_id": line.custom_id, "response": None,
                       "error": {"code": code, "message": message}}).encode()


def output_files(batch_id: str, tenant: str, lines: list[Line], results: dict[int, tuple[bool, bytes]],
                 ending: str) -> tuple[tuple[FileObject, bytes] | None, tuple[FileObject, bytes] | None]:
    """The output and error files of a batch that ended as ``ending`` (completed, expired or cancelled), each
    with its bytes, or None when it would be empty. Their ids come from the batch's, so a batch finalized
    twice (its guard died while finalizing) writes the same two files again, never a second pair."""
    out: list[bytes] = []
    errors: list[bytes] = []
    for line in lines:
        if line.index in results:
            ok, text = results[line.index]
            (out if ok else errors).append(text)
        elif ending in NOT_RUN:
            errors.append(not_run_line(line, ending))
    return (_file(batch_id, tenant, "output", out), _file(batch_id, tenant, "error", errors))


def _file(batch_id: str, tenant: str, kind: str, lines: list[bytes]) -> tuple[FileObject, bytes] | None:
    if not lines:
        return None
    content = b"\n".join(lines) + b"\n"
    suffix = batch_id.removeprefix("batch_")
    return FileObject(f"file-{suffix}{kind[0]}", tenant, f"{batch_id}_{kind}.jsonl", "batch_output", len(content),
                      now()), content
