"""``POST /v1/responses``, ``GET /v1/responses/{id}`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses
API over the chat path.

A request becomes the chat that answers it (``ResponsesRequest.to_chat``, after the stored conversation its
``previous_response_id`` names) and runs exactly as ``/v1/chat/completions`` would
(``OpenAIHandlers.chat_request``: chat template, context check, forced tool calls and ``text.format`` by
the grammar path); its errors name the Responses fields (``input``, ``max_output_tokens``, ``text.format``).
The answer is the response object, or its typed event stream (engine/server/response_events.py); a stream
that fails after it started ends with the ``error`` event as every stream of this server does. Responses
streams carry no ``[DONE]``: ``response.completed`` (or ``response.incomplete``) ends them.

Stored responses (engine/server/response_store.py) belong to the tenant of the trusted ``X-Tenant-Id``
header: another tenant's id, like an unknown or expired one, is a 404, for reading, deleting and continuing
alike. A response is stored once it has finished (a stream whose client left is not). A request that
carries ``history`` (the guard's, read with ``GET /v1/responses/{id}/conversation`` from the replica
that stores it) runs after that instead of looking ``previous_response_id`` up, so that in a pool any
replica can continue any stored response.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web
from pydantic import ValidationError

from engine.prompting.prompts import PromptError
from engine.protocol import ChatMessage, DeletedResponse, ResponseObject, ResponsesRequest
from engine.protocol.responses import RENAME
from engine.request_stream import EngineUnavailable, RequestFailed
from engine.sched.request import Request
from engine.server import tracing
from engine.server.errors import ApiError
from engine.server.openai_api import OpenAIHandlers, parse_body, tenant_of
from engine.server.response_events import ResponseBuilder, base_response, output_messages
from engine.server.response_store import ResponseStore
from engine.server.sse import open_stream, send_error


class ResponsesHandlers:
    def __init__(self, openai: OpenAIHandlers, store: ResponseStore) -> None:
        self.openai = openai
        self.store = store

    async def create(self, http: web.Request) -> web.StreamResponse:
        body = await parse_body(http, ResponsesRequest)
        tenant, response_id = tenant_of(http), f"resp_{body.request_id or uuid.uuid4().hex}"
        history = body.history or []
        if body.previous_response_id is not None and body.history is None:
            entry = self.store.get(body.previous_response_id, tenant)
            if entry is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            history = list(entry.conversation)
        with _responses_fields():
            chat = body.to_chat(history)
            request, tools = await self.openai.chat_request(chat, tenant, response_id)
        builder = ResponseBuilder(base_response(response_id, body.model, body,
                                                [tool.model_dump(exclude_none=True) for tool in body.tools or []]),
                                  tools, streamed=body.stream)
        resumed = bool(request.resume_token_ids or body.resume_sequence_number)
        if resumed:  # a stream that had begun, tokens or not
            builder.resume(request.resume_text, body.resume_sequence_number)
        conversation = [*history, *body.input_messages()]
        timelines = tracing.timelines_for(http, [request])
        if body.stream:
            return await self._stream(http, request, timelines, builder, tenant, conversation,
                                      body.return_token_ids, resumed)
        async with self.openai.generate([request], timelines) as [stream]:
            output = await stream.final()
        _, response = builder.finish(output)
        self._keep(tenant, response, conversation)
        return web.Response(text=response.model_dump_json(), content_type="application/json")

    async def _stream(self, http: web.Request, request: Request, timelines: list[tracing.Timeline | None],
                      builder: ResponseBuilder, tenant: str | None, conversation: list[ChatMessage],
                      return_token_ids: bool, resumed: bool) -> web.StreamResponse:
        """The event stream; with ``return_token_ids``, each write carries the token ids the completion gained
        since the previous one, as /v1/chat/completions sends them (engine/server/openai_api.py)."""
        response = await open_stream(http)
        tokens_sent = 0
        try:
            if not resumed:  # a resumed stream continues one that has begun
                await response.write(builder.start())
            async with self.openai.generate([request], timelines) as [stream]:
                async for output in stream:
                    if output.finished:
                        events, answer = builder.finish(output)
                        self._keep(tenant, answer, conversation)  # before its last event: a client that
                    else:  # asks for it as soon as that arrives must find it
                        events = builder.grow(output.outputs[0].text)
                    completion = output.outputs[0]
                    if return_token_ids and completion.num_tokens > tokens_sent:
                        events = b": token_ids 0 %s\n" % ",".join(map(str, completion.token_ids_from(tokens_sent))
                                                                 ).encode() + events
                        tokens_sent = completion.num_tokens
                    if events:
                        await response.write(events)
        except (RequestFailed, EngineUnavailable) as exc:
            await send_error(response, ApiError.from_engine(exc))
            return response
        except ConnectionResetError:
            return response  # the client left; leaving ``generate`` has aborted the request
        await response.write_eof()
        return response

    def _keep(self, tenant: str | None, response: ResponseObject, conversation: list[ChatMessage]) -> None:
        """A finished response, with ``store``, kept with the conversation a continuation runs after."""
        if response.store:
            self.store.put(tenant, response, [*conversation, *output_messages(response)])

    async def retrieve(self, http: web.Request) -> web.Response:
        entry = self.store.get(http.match_info["id"], tenant_of(http))
        if entry is None:
            raise _not_found(http.match_info["id"], "response_id")
        return web.Response(text=entry.response.model_dump_json(), content_type="application/json")

    async def conversation(self, http: web.Request) -> web.Response:
        """``GET /v1/responses/{id}/conversation`` (kvguard's): the stored conversation a continuation runs
        after, ``{"messages": [...]}``, which the guard sends on as ``history`` to whichever replica."""
        entry = self.store.get(http.match_info["id"], tenant_of(http))
        if entry is None:
            raise _not_found(http.match_info["id"], "response_id")
        messages = [message.model_dump(exclude_none=True) for message in entry.conversation]
        return web.json_response({"messages": messages})

    async def delete(self, http: web.Request) -> web.Response:
        response_id = http.match_info["id"]
        if not self.store.delete(response_id, tenant_of(http)):
            raise _not_found(response_id, "response_id")
        return web.Response(text=DeletedResponse(id=response_id).model_dump_json(), content_type="application/json")


def _not_found(response_id: str, param: str) -> ApiError:
    # Unknown, expired and another tenant's read alike: nothing tells a tenant that someone else's id exists.
    return ApiError(404, f"Response with id {response_id!r} not found.", param=param, code="response_not_found")


@contextmanager
def _responses_fields() -> Iterator[None]:
    """Errors of the chat a request runs as, naming the Responses request's fields instead."""
    try:
        yield
    except ValidationError as exc:
        raise _renamed(ApiError.from_validation(exc)) from None
    except PromptError as exc:
        raise _renamed(ApiError.from_prompt(exc)) from None
    except ApiError as exc:
        raise _renamed(exc) from None


def _renamed(error: ApiError) -> ApiError:
    detail = error.body.error
    if detail.param is None:
        return error
    field = detail.param.partition("[")[0].partition(".")[0]
    if field not in RENAME:
        return error
    param = RENAME[field]  # a chat message's index is not the input item's: the field alone
    message = detail.message
    if message.startswith(detail.param + ":"):
        message = param + message[len(detail.param):]
    elif message.startswith(field + ":"):
        message = param + message[len(field):]
    return ApiError(error.status, message, param=param, code=detail.code)
