"""Streaming detokenization: the text each new token adds, at O(window) cost per token.

Decoding one token alone is wrong for two reasons: a UTF-8 character may span several tokens (byte-level
vocabularies), and some decoders render a token differently at the start of a text (SentencePiece drops the
leading space). So each step decodes a short window that starts a little before the new tokens and emits the
part past what the window's head already produced::

    ids:   ... | p0 p1 p2 | r0 r1 | n0 |
               ^prefix    ^read        ^end
    prefix_text = decode(ids[prefix:read])         (already emitted, or prompt context)
    new text    = decode(ids[prefix:end])[len(prefix_text):]

Text is held back while the window ends in U+FFFD, the mark of an incomplete character. Every emission ends
at a point where the UTF-8 decoder has no pending bytes, which is why the increments concatenate to exactly
``decode(all_output_ids)``. Only the window ``ids[prefix:]`` is kept, so memory and time stay bounded by it.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.prompting.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded along with the output, so the first output token renders as it does in context.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    __slots__ = ("_ids", "_pieces", "_prefix_text", "_read", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> None:
        context = list(prompt_ids[max(len(prompt_ids) - _CONTEXT_TOKENS, 0) :])
        context_text = tokenizer.decode(context)
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends mid-character: the output's bytes would complete it and shift every offset.
            context, context_text = [], ""
        self._tokenizer = tokenizer
        self._ids = context  # the window: ids from ``prefix`` on
        self._read = len(context)
        self._prefix_text = context_text
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def step(self, token_id: int) -> str:
        """Add one output token; return the text it completes (often "", e.g. mid-character)."""
        self._ids.append(token_id)
        window = self._tokenizer.decode(self._ids)
        if not window.endswith(_REPLACEMENT):
            return self._emit(window, len(self._ids))
        # An incomplete character, or invalid bytes that will never complete. Emit up to the newest token when
        # that cut is a decoder reset point: then garbage output cannot hold text back (and grow the window)
        # forever. It is one exactly when decoding across the cut equals decoding the halves apart and the
        # newest token has at least one byte: that byte settles whatever was pending before it.
        cut = len(self._ids) - 1
        if cut > self._read:
            head = self._tokenizer.decode(self._ids[:cut])
            tail = self._tokenizer.decode(self._ids[cut:])
            if tail and head + tail == window:
                return self._emit(head, cut)
        return ""

    def flush(self) -> str:
        """Emit whatever is held back; call once when the generation ends (a cut-off character becomes U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        return self._emit(self._tokenizer.decode(self._ids), len(self._ids))

    def _emit(self, window_text: str, end: int) -> str:
        delta = window_text[len(self._prefix_text) :]
        if delta:
            self._pieces.append(delta)
        del self._ids[: self._read]  # the old read offset is the new prefix
        self._read = end - self._read
        self._prefix_text = self._tokenizer.decode(self._ids[: self._read])
        return delta
