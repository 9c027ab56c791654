"""What a completion must match, before and after compilation.

Every constraint is a JSON schema: ``response_format`` ``json_object`` is ``{"type": "object"}``,
``json_schema`` its ``schema``, and a tool call the schema of tool_calls.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.protocol import JsonObjectFormat, JsonSchemaFormat, ResponseFormat

if TYPE_CHECKING:
    import xgrammar


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A completion must be JSON matching ``schema``; a schema that cannot be compiled is a 400 naming ``param``.

    ``schema`` is JSON text in the order the client wrote it, not with sorted keys: the output's properties
    come in the schema's order, so the order is part of what is asked. Equal texts compile once.
    """

    schema: str
    param: str

    @classmethod
    def of(cls, schema: dict[str, Any], param: str) -> GrammarSpec:
        return cls(json.dumps(schema, ensure_ascii=False), param)


@dataclass(frozen=True, slots=True, eq=False)
class Grammar:
    """A ``GrammarSpec`` compiled for one engine's vocabulary (``EngineCore.compile_grammar``); immutable and
    shared by every request that asks for the same schema."""

    spec: GrammarSpec
    compiled: xgrammar.CompiledGrammar


def response_format_grammar(response_format: ResponseFormat | None) -> GrammarSpec | None:
    """The grammar ``response_format`` asks for; None for plain text."""
    if isinstance(response_format, JsonObjectFormat):
        return GrammarSpec.of({"type": "object"}, "response_format")
    if isinstance(response_format, JsonSchemaFormat):
        return GrammarSpec.of(response_format.json_schema.schema_, "response_format")
    return None
