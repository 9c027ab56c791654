"""The Batch API's handlers, in OpenAI's shapes: ``/v1/files`` (upload as multipart with ``purpose=batch``,
list, retrieve, content, delete) and ``/v1/batches`` (create, list, retrieve, cancel).

Every handler authenticates first (guard/http/pipeline.py ``authenticate``) and looks everything up under the
caller's tenant: another tenant's id answers 404 exactly as an unknown one does. Refusals are OpenAI's error
body (guard/wire/errors.py). Uploads are read in chunks and refused (413) past ``batch.max_file_bytes``, then
checked whole (validate.py) off the event loop before anything is kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import BodyPartReader, web

from guard.batch.objects import (
    ENDPOINTS,
    OPEN,
    BatchObject,
    FileObject,
    listing,
    new_id,
    now,
    page,
    window_seconds,
)
from guard.batch.store import BatchStore
from guard.batch.validate import Lines, parse_lines
from guard.config import Batch, Tenant
from guard.errors import GuardError
from guard.http.pipeline import authenticate
from guard.wire.errors import error_response

CHUNK = 1 << 16


@dataclass(slots=True)
class BatchApi:
    config: Batch
    store: BatchStore | None = None  # opened when the guard starts (in each worker process)


API = web.AppKey("batch api", BatchApi)
Handler = Callable[[web.Request, BatchStore, Tenant], Awaitable[web.StreamResponse]]


def handler(serve: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """``serve`` for the request's tenant, with the store; a ``GuardError`` becomes its error answer."""

    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            tenant = authenticate(request)
            store = request.app[API].store
            if store is None:
                raise GuardError(503, "the batch store is not open yet", code="unavailable", retry_after=1)
            return await serve(request, store, tenant)
        except GuardError as exc:
            return error_response(exc.status, exc.message, param=exc.param, code=exc.code,
                                  retry_after=exc.retry_after)

    return answer


def not_found(kind: str, object_id: str) -> GuardError:
    return GuardError(404, f"No such {kind} object: {object_id}", param="id", code="not_found")


def limit_of(request: web.Request, default: int, most: int) -> int:
    raw = request.query.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise GuardError(400, f"limit must be an integer from 1 to {most}", param="limit", code="invalid_value")
    return int(raw)


def config_of(request: web.Request) -> Batch:
    return request.app[API].config


# -- files --------------------------------------------------------------------------------------------------
async def read_file_part(part: BodyPartReader, most: int) -> bytes:
    chunks, size = [], 0
    while chunk := await part.read_chunk(CHUNK):
        size += len(chunk)
        if size > most:
            raise GuardError(413, f"the file exceeds the {most}-byte limit", param="file", code="file_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_upload(request: web.Request, most: int) -> tuple[str | None, str, bytes | None]:
    """The upload's ``purpose``, file name and bytes (None where a part is missing)."""
    if not request.content_type.startswith("multipart/"):
        raise GuardError(400, "upload a file as multipart/form-data with a file and a purpose",
                         param="file", code="invalid_request")
    purpose, filename, content = None, "file.jsonl", None
    async for part in await request.multipart():
        if not isinstance(part, BodyPartReader):
            continue
        if part.name == "purpose":
            purpose = (await part.text()).strip()
        elif part.name == "file":
            filename, content = part.filename or filename, await read_file_part(part, most)
        else:
            await part.release()
    return purpose, filename, content


async def upload(request: web.Request, store: BatchStore, tenant: Tenant) -> web.StreamResponse:
    config = config_of(request)
    purpose, filename, content = await read_upload(request, config.max_file_bytes)
    if purpose != "batch":
        raise GuardError(400, "purpose must be 'batch' (the guard keeps batch input files only)",
                         param="purpose", code="invalid_value")
    if content is None:
        raise GuardError(400, "the upload has no file part", param="file", code="invalid_request")
    lines = await asyncio.to_thread(parse_lines, content, config.max_lines)
    file = FileObject(new_id("file-"), tenant.name, filename, "batch", len(content), now(), len(lines.items))
    await store.add_file(file, content)
    return web.json_response(file.public())


async def list_files(request: web.Request, store: BatchStore, tenant: Tenant) -> web.StreamResponse:
    files = await store.files(tenant.name)
    if purpose := request.query.get("purpose"):
        files = [f for f in files if f.purpose == purpose]
    if request.query.get("order") == "asc":
        files.reverse()
    chosen, more = page(files, request.query.get("after"), limit_of(request, 10_000, 10_000))
    return web.json_response(listing([f.public() for f in chosen], more))


async def owned_file(request: web.Request, store: BatchStore, tenant: Tenant) -> FileObject:
    file_id = request.match_info["id"]
    file = await store.file(tenant.name, file_id)
    if file is None:
        raise not_found("File", file_id)
    return file


async def retrieve_file(request: web.Request, store: BatchStore, tenant: Tenant) -> web.StreamResponse:
    return web.json_response((await owned_file(request, store, tenant)).public())


async def file_content(request: web.Request, store: BatchStore, tenant: Tenant) -> web.StreamResponse:
    file = await owned_file(request, store, tenant)
    content = await store.content(file.id)
    if content is None:
        raise not_found("File", file.id)
    return web.Response(body=content, content_type="application/octet-stream")


async def delete_file(request: web.Request, store: BatchStore, tenant: Tenant) -> web.StreamResponse:
    file_id = request.match_info["id"]
    if not await store.delete_file(tenant.name, file_id):
        raise not_found("File", file_id)
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


# -- batches ------------------------------------------------------------------------------------------------
async def create_request(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise GuardError(400, "the body is not valid JSON", param="body", code="invalid_json") from None
    if not isinstance(body, dict):
        raise GuardError(400, "the body must be a JSON object", param="body", code="invalid_json")
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(name), str):
            raise GuardError(400, f"{name} is required (a string)", param=name, code="invalid_value")
    if body["endpoint"] not in ENDPOINTS:
        raise GuardError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint",
                         code="invalid_value")
    if window_seconds(body["completion_window"]) is None:
        raise GuardError(400, "completion_window must be '24h' (or a shorter '<n>s|m|h')",
                         param="completion_window", code="invalid_value")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise GuardError(400, "metadata must map at most 16 keys to strings", param="metadata", code="invalid_value")
    return body


async def input_lines(store: BatchStore, tenant: Tenant, file_id: str, config: Batch) -> Lines:
    file = await store.file(tenant.name, file_id)
    content = await store.content(file_id) if file is not None and file.purpose == "batch" else None
    if content is None:
        raise GuardError(404, f"No such File object: {file_id} (a file uploaded with purpose 'batch')",
                         param="input_file_id", code="not_found")
    return await asyncio.to_thread(parse_lines, content, config.max_lines)


async def create_batch(request: web.Request, store: BatchStore, tenant: Tenant) -> web.StreamResponse:
    body = await create_request(request)
    lines = await input_lines(store, tenant, body["input_file_id"], config_of(request))
    if lines.endpoint != body["endpoint"]:
        raise GuardError(400, f"the input file's lines are for {lines.endpoint}, not {body['endpoint']}: one "
                         "endpoint per batch", param="endpoint", code="invalid_value")
    created = now()
    batch = BatchObject(new_id("batch_"), tenant.name, lines.endpoint, body["input_file_id"],
                        body["completion_window"], created, created + (window_seconds(body["completion_window"]) or 0),
                        len(lines.items), lines.model, metadata=body.get("metadata"))
    await store.add_batch(batch)
    return web.json_response(batch.public(0, 0))


async def shown(store: BatchStore, batch: BatchObject) -> dict[str, Any]:
    return batch.public(*await store.counts(batch.id))


async def owned_batch(request: web.Request, store: BatchStore, tenant: Tenant) -> BatchObject:
    batch_id = request.match_info["id"]
    batch = await store.batch(tenant.name, batch_id)
    if batch is None:
        raise not_found("Batch", batch_id)
    return batch


async def retrieve_batch(request: web.Request, store: BatchStore, tenant: Tenant) -> web.StreamResponse:
    return web.json_response(await shown(store, await owned_batch(request, store, tenant)))


async def list_batches(request: web.Request, store: BatchStore, tenant: Tenant) -> web.StreamResponse:
    chosen, more = page(await store.batches(tenant.name), request.query.get("after"), limit_of(request, 20, 100))
    return web.json_response(listing([await shown(store, b) for b in chosen], more))


async def cancel_batch(request: web.Request, store: BatchStore, tenant: Tenant) -> web.StreamResponse:
    """An open batch turns ``cancelling`` at once; its runner starts no line after it, lets the running ones
    finish, and ends it ``cancelled``."""
    batch = await owned_batch(request, store, tenant)
    if batch.status not in OPEN:
        raise GuardError(409, f"cannot cancel a batch that is {batch.status}", code="invalid_batch_status")
    await store.cancel(batch.id, now())
    return web.json_response(await shown(store, await owned_batch(request, store, tenant)))


ROUTES = (("POST", "/v1/files", upload), ("GET", "/v1/files", list_files), ("GET", "/v1/files/{id}", retrieve_file),
          ("DELETE", "/v1/files/{id}", delete_file), ("GET", "/v1/files/{id}/content", file_content),
          ("POST", "/v1/batches", create_batch), ("GET", "/v1/batches", list_batches),
          ("GET", "/v1/batches/{id}", retrieve_batch), ("POST", "/v1/batches/{id}/cancel", cancel_batch))
