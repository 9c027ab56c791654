"""A forced tool call's text read as it grows: which call it is writing, and what of its arguments is new.

The grammar of engine/structured/tool_calls.py makes a completion either one function's arguments (a named
``tool_choice``), or a JSON array of calls, ``[{"name": ..., "arguments": {...}}, ...]`` (``"required"``).
``CallScanner`` reads that text character by character, once each, as the stream delivers it, so that a
client can be sent each call's arguments as deltas (OpenAI's streamed tool calls): a call opens when its
name is complete, and its arguments are the exact characters the model wrote for them. Concatenated, a
call's deltas are its arguments; once the completion is whole JSON, each is valid JSON. A completion cut
short (``max_tokens``) leaves the arguments written so far.

Call ids derive from the answer's id (``id_seed``) and the call's place, so that a resumed answer (one
replica's stream continued on another) names its calls as the interrupted one did.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass

from engine.protocol import FunctionCall, ToolCall


@dataclass(slots=True)
class CallText:
    """One call as far as it is written: ``start``/``end`` delimit its arguments in the scanned text
    (``start`` None until they begin, ``end`` None until they end); ``sent`` counts characters handed out."""

    id: str
    name: str | None = None
    start: int | None = None
    end: int | None = None
    sent: int = 0
    announced: bool = False  # its first delta (id and name) went out
    nested: bool = False  # the arguments are an object or an array: they end with its closing bracket


@dataclass(frozen=True, slots=True)
class CallDelta:
    """What call ``index`` gained: ``opened`` on its first delta (which carries its id and name)."""

    index: int
    call: CallText
    arguments: str
    opened: bool


class CallScanner:
    """Scans the completion of one forced tool call (``named``: the function a named choice forces, whose
    arguments are the whole text; None: an array of calls) as its text grows."""

    def __init__(self, named: str | None, id_seed: str | None = None) -> None:
        self.named = named
        self.id_seed = id_seed
        self.text = ""
        self.calls: list[CallText] = [CallText(self._call_id(0), name=named, start=0)] if named is not None else []
        self._pos = 0
        self._depth = 0
        self._in_string = self._escaped = False
        self._string_start = 0
        self._string_role: str | None = None  # "key" or "name": a string whose value the scanner needs
        self._key: str | None = None  # the last key read in the current call object
        self._expect: str | None = None  # in a call object: "key" or "value" comes next
        self._flushed = 0  # calls before this one have handed out all their arguments

    def feed(self, more: str) -> list[CallDelta]:
        """Take ``more`` text; returns what each call gained (arguments new since the last feed)."""
        self.text += more
        if self.named is None:
            for i in range(self._pos, len(self.text)):
                self._step(i, self.text[i])
        self._pos = len(self.text)
        return self._deltas()

    def _call_id(self, index: int) -> str:
        if self.id_seed is None:
            return f"call_{uuid.uuid4().hex[:24]}"
        return "call_" + hashlib.blake2b(f"{self.id_seed}/{index}".encode(), digest_size=12).hexdigest()

    def complete(self) -> bool:
        """The text is whole JSON: every call ended (what the grammar allows is then a valid call)."""
        try:
            json.loads(self.text)
        except ValueError:
            return False
        return True

    def tool_calls(self) -> list[ToolCall]:
        """The calls begun so far, each with its arguments as far as written."""
        return [ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=self.arguments(call)))
                for call in self.calls if call.name is not None]

    def arguments(self, call: CallText) -> str:
        return self.text[call.start:call.end] if call.start is not None else ""

    def _deltas(self) -> list[CallDelta]:
        deltas = []
        for index in range(self._flushed, len(self.calls)):
            call = self.calls[index]
            if call.name is None:
                break  # named once its name string ends; nothing of it goes out before that
            arguments = self.arguments(call)
            if len(arguments) > call.sent or not call.announced:
                deltas.append(CallDelta(index, call, arguments[call.sent:], opened=not call.announced))
                call.announced, call.sent = True, len(arguments)
            if call.end is not None and index == self._flushed:
                self._flushed += 1
        return deltas

    def _step(self, i: int, c: str) -> None:
        """One character of an array of calls: strings (keys, names), nesting, and where arguments start/end."""
        if self._in_string:
            self._string_char(i, c)
            return
        current = self.calls[-1] if self.calls and self._depth >= 2 else None
        if current is not None and self._depth == 2 and self._expect == "value" and not c.isspace():
            self._expect = None
            if self._key == "arguments":
                current.start, current.nested = i, c in "{["
        if c == '"':
            self._in_string, self._string_start = True, i
            self._string_role = ("key" if self._depth == 2 and self._expect == "key" else
                                 "name" if self._depth == 2 and self._key == "name" and self._expect is None
                                 else None)
        elif c in "{[":
            self._depth += 1
            if self._depth == 2 and c == "{":
                self.calls.append(CallText(self._call_id(len(self.calls))))
                self._expect, self._key = "key", None
        elif c in "}]":
            if current is not None and current.start is not None and current.end is None:
                if current.nested and self._depth == 3:
                    current.end = i + 1
                elif not current.nested and self._depth == 2:
                    current.end = i
            self._depth -= 1
        elif self._depth == 2 and c in ":,":
            if c == "," and current is not None and current.start is not None and current.end is None:
                current.end = i  # a scalar's arguments end where the next member begins
            self._expect = "value" if c == ":" else "key"

    def _string_char(self, i: int, c: str) -> None:
        if self._escaped:
            self._escaped = False
        elif c == "\\":
            self._escaped = True
        elif c == '"':
            self._in_string = False
            if self._string_role is not None:
                value = json.loads(self.text[self._string_start:i + 1])
                if self._string_role == "key":
                    self._key = value
                else:
                    self.calls[-1].name = value
                self._string_role = None
