"""OpenAI's Responses API subset: the body of ``POST /v1/responses``, the response object and its output items.

A Responses request is a chat in other words, and runs as one: ``to_chat`` turns it (with the conversation
its ``previous_response_id`` names, if any) into the ``ChatCompletionRequest`` the engine answers, so the
chat template, forced tool calls and ``json_schema`` all take the chat's one path, and the guard counts and
sizes a Responses body as that chat. ``RENAME`` maps the chat's fields back to the Responses ones in errors.

- ``input``: a string (one user message) or items: messages (``role`` and a string or ``input_text`` parts),
  ``function_call`` items (a call the model made, replayed) and ``function_call_output`` items (its result,
  a ``tool`` message). A replayed call is shown to the model as the JSON the grammar makes it write.
- ``instructions``: a system message before everything else; as OpenAI does, not carried into a
  continuation (``previous_response_id``).
- ``tools`` (functions only, flat as the Responses API writes them) and ``tool_choice`` as for chat:
  ``required`` or a named function forces a call, ``none`` answers in text, ``auto`` is refused.
- ``text.format``: ``text``, ``json_object`` or ``json_schema``, through the grammar path.
- ``store`` (default true) keeps the response and its conversation for ``GET /v1/responses/{id}`` and for
  continuations, for a while (engine/server/response_store.py).

Requests ignore fields they do not know and reject fields they cannot honour when set, as the chat does.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator

from engine.protocol.openai import (
    ChatCompletionRequest,
    ChatMessage,
    JsonObjectFormat,
    JsonSchema,
    Name,
    NonEmptyStr,
    OpenAIRequest,
    RequestId,
    TextFormat,
    Unsupported,
)

# The chat's field names in an error, as the Responses request calls them.
RENAME = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
          "response_format": "text.format"}


class InputText(OpenAIRequest):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(OpenAIRequest):
    """A message: the ``type`` may be left out (OpenAI's "easy" input message)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(OpenAIRequest):
    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: Name
    arguments: str


class FunctionCallOutputItem(OpenAIRequest):
    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str | list[InputText]

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


def _item_type(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if kind in ("message", "function_call", "function_call_output") else "unsupported"


class UnsupportedItem(OpenAIRequest):
    type: str

    @field_validator("type")
    @classmethod
    def _refuse(cls, kind: str) -> str:
        raise ValueError(f"{kind!r} items are not supported; send message, function_call or "
                         "function_call_output items")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[UnsupportedItem, Tag("unsupported")],
    Discriminator(_item_type)]


class FunctionTool(OpenAIRequest):
    type: Literal["function"]
    name: Name
    description: str | None = None
    parameters: JsonSchema | None = None  # None: a function without parameters, as OpenAI reads it
    strict: bool | None = None  # accepted: the arguments always match ``parameters`` (constrained decoding)


class NamedFunction(OpenAIRequest):
    type: Literal["function"]
    name: Name


class ResponsesJsonSchemaFormat(OpenAIRequest):
    type: Literal["json_schema"]
    name: Name
    description: str | None = None
    schema_: JsonSchema = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIRequest):
    format: Annotated[TextFormat | JsonObjectFormat | ResponsesJsonSchemaFormat,
                      Field(discriminator="type")] | None = None


class ResponsesRequest(OpenAIRequest):
    """``POST /v1/responses``, with the engine's extensions ``top_k``, ``ignore_eos``, ``cache_salt`` and
    ``priority`` (which the guard sets from the tenant), and ``history`` (which the guard sets for a
    continuation)."""

    model: str
    input: NonEmptyStr | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    stream: bool = False
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool = True
    previous_response_id: NonEmptyStr | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    ignore_eos: bool = False
    cache_salt: NonEmptyStr | None = None
    priority: int = 0
    # The guard's: the stored conversation ``previous_response_id`` names, read from the replica that keeps it
    # (``GET /v1/responses/{id}/conversation``), so that any replica can continue it. (OpenAI's own
    # ``conversation``, its Conversations API, is not supported.)
    history: list[ChatMessage] | None = None
    # Resuming, as on chat (engine/resume.py), and the ``sequence_number`` of the resumed stream's first event:
    # the events already sent count on, so that the client sees one stream.
    resume_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    request_id: RequestId | None = None
    return_token_ids: bool = False
    resume_sequence_number: int = Field(0, ge=0)
    background: Unsupported = None
    include: Unsupported = None
    top_logprobs: Unsupported = None
    max_tool_calls: Unsupported = None
    conversation: Unsupported = None

    @property
    def n(self) -> int:
        return 1

    @property
    def include_usage(self) -> bool:
        """A Responses stream always ends with its usage (in ``response.completed``)."""
        return True

    @property
    def max_output_tokens_field(self) -> str:
        return "max_output_tokens"

    def input_messages(self) -> list[ChatMessage]:
        """This request's own input as chat messages (its instructions apart)."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        messages = []
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append(ChatMessage(role=item.role, content=item.text))
            elif isinstance(item, FunctionCallItem):
                messages.append(call_message(item.name, item.arguments))
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(ChatMessage(role="tool", content=item.text))
        return messages

    def to_chat(self, history: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat that answers this request after ``history`` (the stored conversation it continues);
        raises pydantic's ``ValidationError`` naming the chat's field (``RENAME`` maps it back)."""
        system = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        fields: dict[str, Any] = {
            "model": self.model, "messages": [*system, *history, *self.input_messages()],
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "stream": self.stream, "parallel_tool_calls": self.parallel_tool_calls,
            "ignore_eos": self.ignore_eos, "cache_salt": self.cache_salt, "priority": self.priority,
            "user": self.user, "resume_token_ids": self.resume_token_ids, "request_id": self.request_id,
            "return_token_ids": self.return_token_ids}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                               for tool in self.tools]
        if self.tool_choice is not None:
            choice = self.tool_choice
            fields["tool_choice"] = (choice if isinstance(choice, str)
                                     else {"type": "function", "function": {"name": choice.name}})
        if self.text is not None and self.text.format is not None:
            fields["response_format"] = _response_format(self.text.format)
        return ChatCompletionRequest.model_validate(fields, strict=False)


def _response_format(text_format: TextFormat | JsonObjectFormat | ResponsesJsonSchemaFormat) -> dict[str, Any]:
    if isinstance(text_format, ResponsesJsonSchemaFormat):
        spec = text_format.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
        return {"type": "json_schema", "json_schema": spec}
    return {"type": text_format.type}


def call_message(name: str, arguments: str) -> ChatMessage:
    """A call the model made, as the conversation shows it to the model: the JSON its grammar wrote."""
    try:
        value: Any = json.loads(arguments)
    except ValueError:
        value = arguments  # a call cut short: its arguments as far as they went
    return ChatMessage(role="assistant", content=json.dumps({"name": name, "arguments": value}, ensure_ascii=False))


# -- the answer ----------------------------------------------------------------------------------------------

Status = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Status
    content: list[OutputText]


class FunctionToolCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Status


OutputItem = OutputMessage | FunctionToolCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """The response: in ``response.created`` (``in_progress``, no output yet), at its end, and stored."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    usage: ResponseUsage | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None

    @property
    def output_text(self) -> str:
        return "".join(part.text for item in self.output if isinstance(item, OutputMessage) for part in item.content)


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
