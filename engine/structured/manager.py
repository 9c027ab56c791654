"""Everything xgrammar does for one engine: compile grammars, start matchers, fill each step's bitmask.

Compilation is thread-safe (the server compiles off the event loop while the engine thread steps) and
cached by xgrammar per distinct schema text, up to ``CACHE_BYTES``: a repeated schema costs a lookup.
Matchers and bitmasks belong to the engine thread.

Schemas compile with a fixed layout (``any_whitespace=False``: ``{"a": 1, "b": [2]}``, spaces after ``:``
and ``,`` only). Free whitespace would let a model spend its whole budget on blanks between two tokens,
which small models do; and in strict mode (JSON Schema's ``unevaluatedProperties: false``), so an object
holds only the properties its schema names, as OpenAI's strict mode requires.
"""

from __future__ import annotations

import re

import xgrammar as xgr

from engine.prompting.tokenizer import Tokenizer
from engine.structured.bitmask import GrammarBitmask
from engine.structured.spec import Grammar, GrammarSpec
from engine.structured.vocab import tokenizer_info

CACHE_BYTES = 256 << 20  # compiled grammars kept: far more than any service's distinct schemas need
# xgrammar's errors start with a timestamp and its C++ source line: "[12:00:00] /project/x.cc:12: msg".
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")


class StructuredOutputManager:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        info = tokenizer_info(tokenizer, vocab_size)
        self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=CACHE_BYTES)

    def compile(self, spec: GrammarSpec) -> Grammar:
        """Raises ``ValueError("<spec.param>: ...")`` for a schema xgrammar cannot compile."""
        try:
            compiled = self._compiler.compile_json_schema(spec.schema, any_whitespace=False, strict_mode=True)
        except (RuntimeError, ValueError) as exc:
            reason = _XGRAMMAR_PREFIX.sub("", str(exc).strip())
            raise ValueError(f"{spec.param}: must be a JSON schema this engine can follow: {reason}") from None
        return Grammar(spec, compiled)

    @staticmethod
    def matchers(grammar: Grammar, n: int) -> list[xgr.GrammarMatcher]:
        """One matcher per completion, each at the grammar's start."""
        return [xgr.GrammarMatcher(grammar.compiled) for _ in range(n)]

    def bitmask(self, num_draws: int, constrained: list[tuple[int, xgr.GrammarMatcher]]) -> GrammarBitmask | None:
        """A step's bitmask from its draws (``SchedulerOutput.grammar_draws``); None when none is constrained."""
        return GrammarBitmask.for_draws(num_draws, constrained, self.vocab_size)
