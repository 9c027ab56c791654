"""Tool calls by constrained decoding: the JSON a completion must be when a chat request forces a call, and
the ``tool_calls`` read back from it.

Our models have no tool-call format of their own, so the grammar is the format:

- a named function (``tool_choice: {"type": "function", "function": {"name": N}}``): the completion is N's
  arguments, an object matching its ``parameters``; the answer is one call to N.
- ``"required"``: the completion is a JSON array of calls, ``[{"name": ..., "arguments": {...}}, ...]``, each
  one of the tools with arguments matching that tool's ``parameters``: at least one call (OpenAI's parallel
  calls), exactly one with ``parallel_tool_calls: false``. The model picks the tool; the name comes first,
  so the arguments are written knowing which schema they follow.

The model sees the conversation only (the chat templates render messages, not tool definitions); the
grammar alone makes the output a valid call. engine/structured/call_stream.py reads the calls back from the
text, as it grows or whole, so a streamed call's arguments go out as deltas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.protocol import ChatCompletionRequest, FunctionDefinition, NamedToolChoice, ToolCall
from engine.structured.call_stream import CallScanner
from engine.structured.spec import GrammarSpec


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """How one request's completions become tool calls: ``named`` is the forced function, or None when the
    model picks (``"required"``) among ``functions``."""

    functions: tuple[FunctionDefinition, ...]
    named: str | None
    parallel: bool

    @classmethod
    def of(cls, body: ChatCompletionRequest) -> ToolCalling | None:
        """None when the request answers in text (``tool_choice`` ``"none"``, or no tools): the protocol
        has already refused ``"auto"`` and any choice that names no tool."""
        choice = body.tool_choice
        if choice == "none" or not body.tools:
            return None
        functions = tuple(tool.function for tool in body.tools)
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        return cls(functions, named, body.parallel_tool_calls)

    def grammar(self) -> GrammarSpec:
        if self.named is not None:
            [function] = [f for f in self.functions if f.name == self.named]
            return GrammarSpec.of(function.parameters, "tools")
        calls: dict[str, Any] = {
            "type": "array",
            "items": {"anyOf": [_call_schema(f) for f in self.functions]},
            "minItems": 1,
        }
        if not self.parallel:
            calls["maxItems"] = 1
        return GrammarSpec.of(calls, "tools")

    def scanner(self, id_seed: str | None = None) -> CallScanner:
        """A reader of this request's completion text, as it grows (streamed calls) or whole; its call ids
        derive from ``id_seed`` (the answer's id) when given."""
        return CallScanner(self.named, id_seed)

    def tool_calls(self, text: str) -> list[ToolCall]:
        """The calls a completion's text makes, each with its arguments as the model wrote them (as far as
        it wrote them: a completion cut by ``max_tokens`` leaves partial arguments); empty when not one call
        had begun."""
        scanner = self.scanner()
        scanner.feed(text)
        return scanner.tool_calls()


def _call_schema(function: FunctionDefinition) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": function.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


