"""OpenAI-compatible API subsets: the bodies of ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/tokenize`` and ``/tokenizer``, and their answers.

Requests are strict about types ("12" is not a number) and ignore fields they do not know, as OpenAI does;
fields OpenAI defines but this engine cannot honour are rejected when set, rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)


def _unsupported(value: Any) -> Any:
    if value not in (None, False, 0, "", [], {}):
        raise ValueError("is not supported by this engine; leave it unset")
    return value


Unsupported = Annotated[Any, AfterValidator(_unsupported)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


MAX_PROMPTS = 128  # prompts in one /v1/completions batch: each becomes an engine request of its own


def _one_prompt(prompt: str | list[Any]) -> str | list[Any]:
    if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], (str, list))) and len(prompt) != 1:
        raise ValueError("must be one prompt (a non-empty string or list of token ids)")
    return prompt


def _at_most_max_prompts(prompt: str | list[Any]) -> str | list[Any]:
    # Checked on the parsed prompt, not as the batch type's bound: a union's failure reports its deepest
    # member's error, which for a long batch of texts would be "prompt[0]: Input should be a valid integer".
    if len(_batch(prompt)) > MAX_PROMPTS:
        raise ValueError(f"a batch holds at most {MAX_PROMPTS} prompts, got {len(prompt)}")
    return prompt


def _batch(prompt: str | list[Any]) -> list[str | list[int]]:
    """A prompt field as its list of prompts: a batch as it is, a single text or token list as a batch of one."""
    return prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]


# What OpenAI accepts as ``prompt``: a text, token ids, or a batch (a list) of either.
Prompt = Annotated[NonEmptyStr | TokenIds | Annotated[list[NonEmptyStr | TokenIds], Field(min_length=1)],
                   AfterValidator(_at_most_max_prompts)]
# ``/tokenize`` counts one prompt: the same shapes, with a batch of exactly one.
OnePrompt = Annotated[Prompt, AfterValidator(_one_prompt)]


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(OpenAIRequest):
    include_usage: bool = False


# An answer's id without its prefix (``chatcmpl-``, ``cmpl-``, ``resp_``), as vLLM's ``request_id``.
RequestId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]

# A name OpenAI accepts for a response schema or a function.
Name = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
JsonSchema = dict[str, Any]


class JsonSchemaSpec(OpenAIRequest):
    """``response_format.json_schema``. The output is always held to ``schema`` by constrained decoding, so
    ``strict`` is accepted but changes nothing; no ``schema`` means any JSON value, as OpenAI reads it."""

    name: Name
    description: str | None = None
    schema_: JsonSchema = Field(default_factory=dict, alias="schema")  # ``schema`` is a BaseModel method
    strict: bool | None = None


class TextFormat(OpenAIRequest):
    type: Literal["text"]


class JsonObjectFormat(OpenAIRequest):
    type: Literal["json_object"]


class JsonSchemaFormat(OpenAIRequest):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class SamplingRequest(OpenAIRequest):
    """Fields common to both endpoints, with the engine's extensions ``top_k``, ``ignore_eos``,
    ``cache_salt`` (prefix-cache scope) and ``priority`` (lower runs first). ``response_format`` holds the
    output to JSON on both (on ``/v1/completions`` an extension, as in vLLM)."""

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)  # 0 keeps only the likeliest token: greedy, as OpenAI reads it
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    ignore_eos: bool = False
    cache_salt: NonEmptyStr | None = None
    priority: int = 0
    user: str | None = None
    presence_penalty: Unsupported = None
    frequency_penalty: Unsupported = None
    logit_bias: Unsupported = None
    logprobs: Unsupported = None
    # Resuming (engine/resume.py): the tokens an earlier replica already generated for this answer, the id
    # that answer had (every id in it derives from this one), and whether stream events carry their token
    # ids (as ``: token_ids`` comments), which is what a guard needs to resume a stream it relays.
    resume_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    request_id: RequestId | None = None
    return_token_ids: bool = False

    @field_validator("resume_token_ids")
    @classmethod
    def _one_choice(cls, tokens: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if tokens is not None and info.data.get("n", 1) != 1:
            raise ValueError("needs n == 1: the tokens are one choice's")
        return tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)
    echo: Unsupported = None
    suffix: Unsupported = None
    best_of: int | None = Field(None, ge=1, le=1)

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts in order; choice ``i`` of prompt ``p`` is the answer's choice ``p * n + i``, as OpenAI
        numbers a batch's choices."""
        return _batch(self.prompt)

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_output_tokens_field(self) -> str:
        return "max_tokens"


class TextContentPart(OpenAIRequest):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(OpenAIRequest):
    name: Name
    description: str | None = None
    # OpenAI: "Omitting parameters defines a function with an empty parameter list."
    parameters: JsonSchema = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # accepted: the arguments always match ``parameters`` (constrained decoding)


class ToolDefinition(OpenAIRequest):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIRequest):
    name: Name


class NamedToolChoice(OpenAIRequest):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice

_AUTO_TOOL_CHOICE = (
    "'auto' (the default when tools are given) is not supported: this model has no tool-call format of its own, "
    "so it cannot choose between answering and calling; set 'required' or "
    '{"type": "function", "function": {"name": ...}} to call a tool, or \'none\' to answer in text')


class ChatCompletionRequest(SamplingRequest):
    """A chat. With ``tools``, ``tool_choice`` ``"required"`` or a named function makes the answer tool calls
    (engine/structured/tool_calls.py); ``"none"`` answers in text; ``"auto"``, OpenAI's default when tools are
    given, is refused (400 naming ``tool_choice``)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of max_completion_tokens
    top_logprobs: Unsupported = None
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    # Validated even when absent: its default depends on ``tools`` (declared before it, so checked first).
    tool_choice: ToolChoice | None = Field(None, validate_default=True)
    parallel_tool_calls: bool = True  # with "required": several calls may come back; false: exactly one
    functions: Unsupported = None
    function_call: Unsupported = None

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        names = [tool.function.name for tool in tools or []]
        if len(set(names)) < len(names):
            raise ValueError(f"function names must be distinct, got {names}")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice: str | NamedToolChoice | None, info: ValidationInfo) -> str | NamedToolChoice:
        tools: list[ToolDefinition] = info.data.get("tools") or []
        if choice is None:
            choice = "auto" if tools else "none"  # OpenAI's defaults
        if choice == "none":
            return choice
        if not tools:
            raise ValueError("needs tools: there is no function to call")
        if choice == "auto":
            raise ValueError(_AUTO_TOOL_CHOICE)
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"names the function {choice.function.name!r}, which is not among tools")
        response_format = info.data.get("response_format")
        if response_format is not None and response_format.type != "text":
            raise ValueError("cannot call a tool together with a JSON response_format: a call is the whole answer")
        return choice

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_output_tokens_field(self) -> str:
        """The field an out-of-range output length is reported against."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class TokenizeRequest(OpenAIRequest):
    """``POST /tokenize``: count a prompt, or a conversation rendered by the chat template, as the engine would."""

    model: str
    prompt: OnePrompt | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self

    @property
    def single_prompt(self) -> str | list[int] | None:
        return None if self.prompt is None else _batch(self.prompt)[0]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int  # the context window: prompt plus output tokens
    tokens: list[int]


class TokenizerInfo(BaseModel):
    """``GET /tokenizer``: all a client needs to count prompts exactly as ``/tokenize`` does, without asking.

    ``kind`` is ``bytes`` (UTF-8 bytes are the ids), ``hf`` (``tokenizer_json`` is a whole ``tokenizer.json``)
    or ``none`` (the model has no tokenizer: prompts must be token ids, and chat is refused).
    """

    model: str
    max_model_len: int
    kind: Literal["bytes", "hf", "none"]
    tokenizer_json: str | None = None
    chat_template: str
    bos_token: str = ""
    eos_token: str = ""


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served by the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int  # summed over the n choices
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


FinishReason = Literal["stop", "length", "tool_calls"]  # tool_calls: the message is tool calls, complete


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    """A whole completion, and (with ``usage`` unset until the last) each chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """Either text (``content``) or tool calls (``content`` null, as OpenAI sends it, and ``tool_calls``)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data["tool_calls"] is None:
            del data["tool_calls"]
        return data


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None  # in a call's first delta only
    arguments: str = ""  # what the call's arguments gained: a call's deltas concatenate to its arguments


class ToolCallDelta(BaseModel):
    """A tool call in a stream, as OpenAI streams one: its first delta carries its place among the message's
    calls (``index``), ``id``, ``type`` and the function's name; each later one only more of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = {key: value for key, value in handler(self).items() if value is not None}
        data["function"] = {key: value for key, value in data["function"].items() if value is not None}
        return data


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None  # set in a choice's first chunk only
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvguard"
    max_model_len: int
    parent: str | None = None  # a LoRA adapter's base model, as vLLM lists adapters; None for the base


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
