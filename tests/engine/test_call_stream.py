"""A forced tool call's text read as it grows (engine/structured/call_stream.py, issue 33): however the text
is cut into deltas, each call opens once, named, before any of its arguments, and its argument deltas
concatenate to exactly the characters the model wrote for them, which parse as the call's arguments once
the text is whole; a text cut short leaves the arguments so far."""

from __future__ import annotations

import json
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.structured.call_stream import CallScanner

# What the "required" grammar makes a model write: several calls, nested and scalar arguments, escapes,
# whitespace where JSON allows it, and a name that looks like a key.
CALLS = ('[ {"name": "get_weather", "arguments": {"city": "Pa\\"ris [x]", "days": [1, {"n": "}"}]}},'
         '{"name":"arguments","arguments":{}} , {"name": "echo", "arguments": "a, b"},'
         '{"name": "count", "arguments": 3}]')
EXPECTED = [(call["name"], call["arguments"]) for call in json.loads(CALLS)]


def scan(text: str, cuts: list[int], named: str | None = None) -> tuple[CallScanner, dict[int, str], list[str]]:
    """Feed ``text`` in the pieces ``cuts`` make; each call's concatenated deltas, and the names as opened."""
    scanner, arguments, names = CallScanner(named), {}, []
    bounds = [0, *sorted(set(cuts)), len(text)]
    for start, end in pairwise(bounds):
        for delta in scanner.feed(text[start:end]):
            if delta.opened:
                assert delta.index == len(names) and delta.index not in arguments
                names.append(delta.call.name)
                arguments[delta.index] = ""
            arguments[delta.index] += delta.arguments
    return scanner, arguments, names


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(CALLS) - 1), max_size=40))
def test_any_cuts_give_each_call_its_exact_arguments(cuts: list[int]) -> None:
    scanner, arguments, names = scan(CALLS, cuts)
    assert names == [name for name, _ in EXPECTED]
    assert [json.loads(arguments[i]) for i in range(len(names))] == [args for _, args in EXPECTED]
    assert scanner.complete()
    assert [(call.function.name, call.function.arguments) for call in scanner.tool_calls()] == \
        [(names[i], arguments[i]) for i in range(len(names))]


def test_every_prefix_is_what_a_cut_short_completion_leaves() -> None:
    """A completion cut after any character: the calls named so far, each with a prefix of its arguments."""
    _, whole, _ = scan(CALLS, [])
    for end in range(len(CALLS)):
        scanner, arguments, names = scan(CALLS[:end], list(range(1, end)))
        assert names == [name for name, _ in EXPECTED[:len(names)]]
        assert all(whole[i].startswith(arguments[i]) for i in arguments), end
        assert not scanner.complete()


def test_a_named_call_is_its_whole_text() -> None:
    scanner, arguments, names = scan('{"a": [1, "]"]}', [1, 5, 9], named="f")
    assert names == ["f"] and arguments == {0: '{"a": [1, "]"]}'} and scanner.complete()
