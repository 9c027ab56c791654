"""Just enough PromQL reading to check our own queries: which metrics they name, whether every counter is
read through ``rate``/``increase``, and whether every division is guarded against a zero denominator.

This is a tokenizer with a bracket stack, not a parser: it understands selectors, range brackets, function
calls, aggregation and vector-matching modifiers, which is all the dashboards and rules use. Grafana
variables (``$job``, ``${datasource}``, ``$__rate_interval``) are accepted wherever a value may stand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<var>\$\{?[A-Za-z_][A-Za-z0-9_]*\}?)
  | (?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?(?:ms|[smhdwy])*)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|==|!=|>=|<=|[-+*/%^<>=(){}\[\],:@])
""", re.VERBOSE)

# Words that are never metric names where they stand (PromQL's keywords and binary set operators).
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan", "Inf", "NaN"}
# Modifiers that may be followed by a parenthesized list of label names.
LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
COMPARISONS = {">", ">=", "<", "<=", "==", "!="}
COUNTER_READERS = {"rate", "increase"}
CLAMPS = {"clamp_min", "clamp"}


@dataclass(slots=True, frozen=True)
class Token:
    kind: str  # string, var, number, ident, op
    text: str


def tokenize(expr: str) -> list[Token]:
    tokens, pos = [], 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if match is None:
            raise ValueError(f"cannot read PromQL at {expr[pos:pos + 20]!r} in {expr!r}")
        pos = match.end()
        if match.lastgroup != "space":
            tokens.append(Token(match.lastgroup, match.group()))
    return tokens


@dataclass(slots=True, frozen=True)
class MetricUse:
    name: str
    ranged: bool  # followed by a range (or subquery) bracket
    reader: str | None  # the function whose parentheses directly enclose the selector


def metric_uses(expr: str) -> list[MetricUse]:
    """Every metric selector in ``expr``, with its range and its directly enclosing function."""
    tokens = tokenize(expr)
    uses: list[MetricUse] = []
    calls: list[str | None] = []  # one entry per open parenthesis: the function name, or None
    aggregation: str | None = None  # ``sum by (le) (...)``: the name waits for its parenthesis
    i = 0
    while i < len(tokens):
        token = tokens[i]
        following = tokens[i + 1].text if i + 1 < len(tokens) else ""
        if token.text in LABEL_LISTS and following == "(":
            i = _skip_group(tokens, i + 1, "(", ")")
            continue
        if token.text in ("{", "["):
            i = _skip_group(tokens, i, token.text, "}" if token.text == "{" else "]")
            continue
        if token.text == "(":
            calls.append(aggregation)
            aggregation = None
        elif token.text == ")":
            calls.pop()
        elif token.kind == "ident" and following == "(":
            calls.append(token.text)
            i += 1  # the parenthesis is this call's
        elif token.kind == "ident" and following in ("by", "without"):
            aggregation = token.text
        elif token.kind == "ident" and token.text not in KEYWORDS:
            after = _skip_group(tokens, i + 1, "{", "}") if following == "{" else i + 1
            ranged = after < len(tokens) and tokens[after].text == "["
            uses.append(MetricUse(token.text, ranged, calls[-1] if calls else None))
        i += 1
    return uses


def counters_outside_readers(expr: str, counters: set[str]) -> list[str]:
    """Counters read other than as ``rate(counter[range])`` or ``increase(counter[range])``."""
    return [use.name for use in metric_uses(expr)
            if use.name in counters and not (use.ranged and use.reader in COUNTER_READERS)]


def unguarded_divisions(expr: str) -> list[str]:
    """The text after each ``/`` whose denominator could be zero.

    A denominator is guarded when it is a constant (numbers and Grafana variables), a ``clamp_min``/``clamp``
    call, or a parenthesized expression filtered by a comparison with a constant at its top level
    (``(sum(rate(x[5m])) > 0)``): a zero then drops the series instead of producing NaN or Inf.
    """
    tokens = tokenize(expr)
    problems = []
    for i, token in enumerate(tokens):
        if token.text != "/":
            continue
        j = i + 1
        while j < len(tokens) and tokens[j].text in LABEL_LISTS | {"bool"}:
            j = _skip_group(tokens, j + 1, "(", ")") if j + 1 < len(tokens) and tokens[j + 1].text == "(" \
                else j + 1
        if not _guarded(tokens, j):
            problems.append(" ".join(t.text for t in tokens[j:j + 8]))
    return problems


def _guarded(tokens: list[Token], i: int) -> bool:
    if i >= len(tokens):
        return False
    first = tokens[i]
    if first.kind in ("number", "var"):
        return True
    if first.text in CLAMPS:
        return True
    if first.text != "(":
        return False
    end = _skip_group(tokens, i, "(", ")")
    inner = tokens[i + 1:end - 1]
    if all(t.kind in ("number", "var") or t.text in "+-*/()" for t in inner):
        return True
    depth = 0
    for k, t in enumerate(inner):
        if t.text in "([{":
            depth += 1
        elif t.text in ")]}":
            depth -= 1
        elif depth == 0 and t.text in COMPARISONS and k + 1 < len(inner) and inner[k + 1].kind == "number":
            return True
    return False


def _skip_group(tokens: list[Token], i: int, opening: str, closing: str) -> int:
    """The index just past the bracket that closes the one at ``i``."""
    depth = 0
    for j in range(i, len(tokens)):
        if tokens[j].text == opening:
            depth += 1
        elif tokens[j].text == closing:
            depth -= 1
            if depth == 0:
                return j + 1
    raise ValueError(f"unbalanced {opening!r} in {' '.join(t.text for t in tokens)!r}")
