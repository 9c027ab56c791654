"""One response as its completion grows: its output items, and (streamed) OpenAI's typed events saying what
changed, each with the next ``sequence_number``.

    response.created, response.in_progress                              (start)
    text:   response.output_item.added (message), response.content_part.added,
            response.output_text.delta ...                              (grow)
            response.output_text.done, response.content_part.done, response.output_item.done
    calls:  per call: response.output_item.added (function_call) at its name,
            response.function_call_arguments.delta ...                  (grow)
            per call: response.function_call_arguments.done, response.output_item.done
    response.completed, or response.incomplete when max_output_tokens cut it     (finish)

A forced tool call's completion is read by engine/structured/call_stream.py, so each call's arguments go
out as the model writes them; one in which no call had begun by its end (cut short) is answered as text.
The final object's items are exactly what the events built: the arguments are the characters the deltas
carried, and a cut item is ``incomplete``.

Item ids derive from the response's id, so that a resumed response (``resume``: the text an interrupted
stream of it had sent, and the sequence number its events had reached) continues the same items; the
final object and the usage are the whole response's.
"""

from __future__ import annotations

import json
import time
from typing import Any

from engine.outputs import RequestOutput
from engine.protocol import ChatMessage, ResponseObject, sse_event
from engine.protocol.responses import (
    FunctionToolCall,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseUsage,
    Status,
    call_message,
)
from engine.structured.call_stream import CallScanner
from engine.structured.tool_calls import ToolCalling


class ResponseBuilder:
    """Builds ``base`` (the response as created: ``in_progress``, no output) from its one completion's text.
    With ``streamed`` False the events are not written (``start``, ``grow`` and ``finish`` return b"")."""

    def __init__(self, base: ResponseObject, tools: ToolCalling | None, streamed: bool) -> None:
        self.base = base
        self.streamed = streamed
        self._scanner: CallScanner | None = tools.scanner(base.id) if tools is not None else None
        self._key = base.id.removeprefix("resp_")
        self._prefix = ""  # resumed: the text before the completion's own (see ``resume``)
        self._seen = 0  # characters of the completion's text taken so far
        self._message: OutputMessage | None = None  # the text answer's item, once opened
        self._calls: list[FunctionToolCall] = []  # the call items, as their names came
        self._sequence = 0

    def start(self) -> bytes:
        response = self._dump(self.base)
        return self._event("response.created", response=response) + self._event("response.in_progress",
                                                                               response=response)

    def resume(self, sent: str, sequence_number: int) -> None:
        """Continue an interrupted stream that had sent ``sent`` in events up to ``sequence_number``: its
        items are rebuilt without events, and the next event takes that number."""
        streamed, self.streamed = self.streamed, False
        self.grow(sent)
        self.streamed, self._prefix, self._sequence = streamed, sent, sequence_number

    def grow(self, text: str) -> bytes:
        """The events for what ``text`` (the completion's whole text so far) adds."""
        if self._prefix:
            text = self._prefix + text
        delta, self._seen = text[self._seen:], len(text)
        if not delta:
            return b""
        if self._scanner is None:
            return self._open_message() + self._text_delta(delta)
        events = b""
        for call in self._scanner.feed(delta):
            if call.opened:
                item = FunctionToolCall(id=f"fc_{self._key}_{call.index}", call_id=call.call.id,
                                        name=call.call.name or "", arguments="", status="in_progress")
                self._calls.append(item)
                events += self._event("response.output_item.added", output_index=call.index, item=self._dump(item))
            if call.arguments:
                self._calls[call.index].arguments += call.arguments
                events += self._event("response.function_call_arguments.delta", item_id=self._calls[call.index].id,
                                      output_index=call.index, delta=call.arguments)
        return events

    def finish(self, output: RequestOutput) -> tuple[bytes, ResponseObject]:
        """The closing events and the finished response (``incomplete`` when cut by its length)."""
        [completion] = output.outputs
        events = self.grow(completion.text)
        cut = completion.finish_reason == "length"
        status: Status = "incomplete" if cut else "completed"
        if self._scanner is not None and not self._calls:  # not one call begun: the text is the answer
            events += self._open_message() + self._text_delta(self._scanner.text)
        items: list[OutputItem] = []
        if self._message is not None:
            events += self._close_message(status)
            items.append(self._message)
        for index, call in enumerate(self._calls):
            call.status = status
            events += self._event("response.function_call_arguments.done", item_id=call.id, output_index=index,
                                  arguments=call.arguments)
            events += self._event("response.output_item.done", output_index=index, item=self._dump(call))
            items.append(call)
        prompt, generated = len(output.prompt_token_ids), len(completion.token_ids) + output.num_resumed_tokens
        usage = ResponseUsage(input_tokens=prompt, output_tokens=generated, total_tokens=prompt + generated,
                              input_tokens_details=InputTokensDetails(cached_tokens=output.num_cached_tokens))
        response = self.base.model_copy(update={
            "status": status, "output": items, "usage": usage,
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None})
        kind = "response.incomplete" if cut else "response.completed"
        return events + self._event(kind, response=self._dump(response)), response

    def _open_message(self) -> bytes:
        if self._message is not None:
            return b""
        self._message = OutputMessage(id=f"msg_{self._key}", status="in_progress", content=[])
        return (self._event("response.output_item.added", output_index=0, item=self._dump(self._message))
                + self._event("response.content_part.added", item_id=self._message.id, output_index=0,
                              content_index=0, part=self._dump(OutputText(text=""))))

    def _text_delta(self, delta: str) -> bytes:
        assert self._message is not None
        if not self._message.content:
            self._message.content.append(OutputText(text=""))
        self._message.content[0].text += delta
        return self._event("response.output_text.delta", item_id=self._message.id, output_index=0,
                           content_index=0, delta=delta, logprobs=[])

    def _close_message(self, status: Status) -> bytes:
        message = self._message
        assert message is not None
        if not message.content:
            message.content.append(OutputText(text=""))
        message.status = status
        part = message.content[0]
        return (self._event("response.output_text.done", item_id=message.id, output_index=0, content_index=0,
                            text=part.text, logprobs=[])
                + self._event("response.content_part.done", item_id=message.id, output_index=0, content_index=0,
                              part=self._dump(part))
                + self._event("response.output_item.done", output_index=0, item=self._dump(message)))

    def _event(self, kind: str, **fields: Any) -> bytes:
        if not self.streamed:
            return b""
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse_event(kind, json.dumps(payload, ensure_ascii=False))

    def _dump(self, model: Any) -> Any:
        return model.model_dump(mode="json") if self.streamed else None


def base_response(response_id: str, model: str, body: Any, tools: list[dict[str, Any]]) -> ResponseObject:
    """The response as created, echoing the request's settings (``body``: a ``ResponsesRequest``)."""
    choice = body.tool_choice
    text_format = (body.text.format.model_dump(by_alias=True, exclude_none=True)
                   if body.text is not None and body.text.format is not None else {"type": "text"})
    return ResponseObject(
        id=response_id, created_at=int(time.time()), status="in_progress", instructions=body.instructions,
        max_output_tokens=body.max_output_tokens, model=model, parallel_tool_calls=body.parallel_tool_calls,
        previous_response_id=body.previous_response_id, store=body.store, temperature=body.temperature,
        top_p=body.top_p, tools=tools, text={"format": text_format}, metadata=body.metadata or {}, user=body.user,
        tool_choice=(choice.model_dump() if choice is not None and not isinstance(choice, str)
                     else choice or ("auto" if tools else "none")))


def output_messages(response: ResponseObject) -> list[ChatMessage]:
    """A finished response's output as the chat messages a continuation shows the model."""
    messages = []
    for item in response.output:
        if isinstance(item, OutputMessage):
            messages.append(ChatMessage(role="assistant", content="".join(part.text for part in item.content)))
        else:
            messages.append(call_message(item.name, item.arguments))
    return messages
