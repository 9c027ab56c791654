"""Tokenizers: the protocol the engine uses, a byte tokenizer for the built-in model, and an HF wrapper.

No torch here: the guard builds the same tokenizers from the engine's ``GET /tokenizer`` to count prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import tokenizers


class Tokenizer(Protocol):
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens=False`` leaves out what the tokenizer adds on its own
        (a BOS), for text such as a rendered chat template that already spells its special tokens out."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens; invalid or incomplete UTF-8 becomes U+FFFD."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then ``<|bos|>`` = 256 and ``<|eos|>`` = 257.

    ``encode`` adds no BOS. ``decode`` drops the specials and any id past them (the built-in model's
    vocabulary is padded beyond the tokenizer's, and a random model may well sample the padding).
    """

    BOS = 256
    EOS = 257

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    @property
    def bos_token_id(self) -> int | None:
        return self.BOS

    @property
    def vocab_size(self) -> int:
        return self.EOS + 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` tokenizer (``tokenizer.json``); special token ids come from the model config, because
    ``tokenizer.json`` does not say which of its special tokens ends a generation."""

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, eos_token_ids: tuple[int, ...], bos_token_id: int | None
    ) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids
        self._bos_token_id = bos_token_id

    @classmethod
    def from_file(
        cls, path: str | Path, eos_token_ids: tuple[int, ...], bos_token_id: int | None
    ) -> HFTokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(path)), eos_token_ids, bos_token_id)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def to_json(self) -> str:
        """The whole tokenizer as ``tokenizer.json`` text: ``tokenizers.Tokenizer.from_str`` rebuilds it exactly."""
        return self._tokenizer.to_str()
