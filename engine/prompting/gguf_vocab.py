"""A GGUF file's tokenizer and chat template, rebuilt from its metadata as a `tokenizers` tokenizer.

A GGUF carries no ``tokenizer.json``: llama.cpp's converter stores the vocabulary, the merges, each token's
type, the special token ids and the chat template as metadata. ``read_gguf_vocab`` turns those back into an
``HFTokenizer`` (so ``GET /tokenizer`` hands the guard a ``tokenizer.json`` like any other checkpoint's) and a
``ChatTemplate``.

Supported ``tokenizer.ggml.model`` values:

- ``gpt2``: byte-level BPE (SmolLM2, Qwen2, Llama 3, GPT-2). How text is cut into words before BPE is named by
  ``tokenizer.ggml.pre``; each name is mapped to the splits llama.cpp applies for it (``src/llama-vocab.cpp``),
  written in the regex of the model's own ``tokenizer.json`` where that differs only in spelling.
- ``llama``: SentencePiece-style BPE with byte fallback (Llama 2, Mistral). Its merges are recovered from the
  token scores when the file stores none, as Hugging Face's SentencePiece converter does.

Anything else raises ``GGUFVocabError`` naming the value, rather than tokenizing a prompt wrongly.

Token types (llama.cpp's ``llama_token_type``): CONTROL tokens (``<|im_start|>``) become special added tokens:
matched whole in text, dropped by ``decode``. USER_DEFINED tokens (``<think>``) become plain added tokens:
matched whole but kept by ``decode``, which is what both llama.cpp and the models' own tokenizers do.

Torch-free (``gguf`` needs only numpy): the guard's side of ``engine.prompting`` may import this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from engine.prompting.chat_template import ChatTemplate
from engine.prompting.tokenizer import HFTokenizer

# llama.cpp's ``llama_token_type`` values that this module treats specially.
_UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 2, 3, 4, 6

# llama.cpp's STARCODER/SMOLLM group: every number character alone first, then GPT-2's split.
_DIGITS = r"\p{N}"
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _Split:
    """How one ``tokenizer.ggml.pre`` flavour cuts text before BPE, and llama.cpp's defaults that go with it."""

    regex: str | None  # a Split applied first; None: none
    gpt2_regex: bool  # then GPT-2's own split (``ByteLevel(use_regex=True)``), as llama.cpp chains the two
    ignore_merges: bool = False  # a word that is a whole vocabulary entry is taken as is
    add_bos: bool = False  # llama.cpp's default when the file has no ``tokenizer.ggml.add_bos_token``


# ``tokenizer.ggml.pre`` -> split, for the byte-level families llama.cpp defines (names as its converter writes
# them). A name missing here is refused: a wrong split silently changes every count.
_PRE_TOKENIZERS: dict[str, _Split] = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais"), _Split(None, gpt2_regex=True)),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone"), _Split(_DIGITS, gpt2_regex=True)
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _Split(_QWEN2, gpt2_regex=False)),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral"),
        _Split(_LLAMA3, gpt2_regex=False, ignore_merges=True, add_bos=True),
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), _Split(_LLAMA3, gpt2_regex=False)),
}


class GGUFVocabError(ValueError):
    """The file's tokenizer metadata is missing, malformed, or of a kind this module cannot rebuild."""


class _Field(Protocol):
    """What ``gguf.ReaderField`` offers that this module reads (so it needs no ``gguf`` import itself)."""

    def contents(self) -> Any: ...


class _Reader(Protocol):
    @property
    def fields(self) -> Mapping[str, _Field]: ...


@dataclass(frozen=True)
class GGUFVocab:
    """What a GGUF file says about text: its tokenizer, chat template and special token ids.

    ``eos_token_ids`` holds every id that ends a generation (``eos_token_id`` first, then end-of-turn ids);
    ``tokenizer.eos_token_ids`` is the same tuple. ``chat_template`` is None when the file ships none.
    """

    tokenizer: HFTokenizer
    chat_template: ChatTemplate | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None


def read_gguf_vocab(source: _Reader | Mapping[str, _Field]) -> GGUFVocab:
    """The tokenizer and chat template of an open ``gguf.GGUFReader`` (or its ``fields``).

    Raises ``GGUFVocabError`` when the metadata cannot be turned into a tokenizer that tokenizes as the model's.
    """
    fields: Mapping[str, _Field] = source if isinstance(source, Mapping) else source.fields
    meta = _Metadata(fields)
    tokens = meta.strings("tokenizer.ggml.tokens")
    token_types = meta.ints("tokenizer.ggml.token_type", default=[1] * len(tokens))
    if len(token_types) != len(tokens):
        raise GGUFVocabError(
            f"tokenizer.ggml.token_type: {len(token_types)} entries for {len(tokens)} tokens"
        )
    model = meta.string("tokenizer.ggml.model")
    bos_id = meta.token_id("tokenizer.ggml.bos_token_id", len(tokens))
    eos_ids = _end_of_generation_ids(meta, tokens, token_types)
    if model == "gpt2":
        split = _split(meta)
        backend = _byte_level_bpe(meta, tokens, token_types, split)
        add_bos = meta.flag("tokenizer.ggml.add_bos_token", default=split.add_bos)
    elif model == "llama":
        backend = _sentencepiece_bpe(meta, tokens, token_types)
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        add_bos = meta.flag("tokenizer.ggml.add_bos_token", default=True)
    else:
        raise GGUFVocabError(
            f"tokenizer.ggml.model: {model!r} is not supported (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece BPE)"
        )
    _add_special_tokens(backend, tokens, token_types)
    add_eos = meta.flag("tokenizer.ggml.add_eos_token", default=False)
    backend.post_processor = _post_processor(tokens, bos_id if add_bos else None, eos_ids[0] if add_eos else None)
    tokenizer = HFTokenizer(backend, eos_ids, bos_id)
    return GGUFVocab(
        tokenizer=tokenizer,
        chat_template=_chat_template(meta, tokens, bos_id, eos_ids),
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        pad_token_id=meta.token_id("tokenizer.ggml.padding_token_id", len(tokens)),
    )


class _Metadata:
    """Typed access to GGUF fields; every malformed value becomes a ``GGUFVocabError`` naming its key."""

    def __init__(self, fields: Mapping[str, _Field]) -> None:
        self._fields = fields

    def has(self, key: str) -> bool:
        return key in self._fields

    def _get(self, key: str) -> Any:
        field = self._fields.get(key)
        return None if field is None else field.contents()

    def string(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str):
            raise GGUFVocabError(f"{key}: expected a string, found {_describe(value)}")
        return value

    def optional_string(self, key: str) -> str | None:
        return None if self._get(key) is None else self.string(key)

    def strings(self, key: str) -> list[str]:
        value = self._get(key)
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise GGUFVocabError(f"{key}: expected an array of strings, found {_describe(value)}")
        return value

    def ints(self, key: str, default: list[int]) -> list[int]:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, list) or not all(isinstance(item, int) for item in value):
            raise GGUFVocabError(f"{key}: expected an array of integers, found {_describe(value)}")
        return value

    def floats(self, key: str) -> list[float] | None:
        value = self._get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(item, (int, float)) for item in value):
            raise GGUFVocabError(f"{key}: expected an array of numbers, found {_describe(value)}")
        return [float(item) for item in value]

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise GGUFVocabError(f"{key}: expected a boolean, found {_describe(value)}")
        return value

    def token_id(self, key: str, vocab_size: int) -> int | None:
        """A token id, or None when absent. Converters write -1 (as uint32: 2**32 - 1) for "none"."""
        value = self._get(key)
        if value is None or value in (-1, 2**32 - 1):
            return None
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab_size:
            raise GGUFVocabError(f"{key}: expected a token id below {vocab_size}, found {_describe(value)}")
        return value


def _describe(value: object) -> str:
    return "nothing" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"


def _split(meta: _Metadata) -> _Split:
    pre = meta.optional_string("tokenizer.ggml.pre")
    split = _PRE_TOKENIZERS.get(pre or "")
    if split is None:
        raise GGUFVocabError(
            f"tokenizer.ggml.pre: {pre!r} names no pre-tokenizer this engine knows "
            f"(known: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    return split


def _byte_level_bpe(
    meta: _Metadata, tokens: Sequence[str], token_types: Sequence[int], split: _Split
) -> tokenizers.Tokenizer:
    """Byte-level BPE: text is cut into words (``split``), each word's UTF-8 bytes are spelled in GPT-2's
    printable byte alphabet, and the merges join them. No Unicode normalization: llama.cpp applies none (Qwen2's
    own ``tokenizer.json`` applies NFC, which changes only text not already in NFC)."""
    alphabet = frozenset(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for index, (token, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        if token_type not in (_CONTROL, _USER_DEFINED) and not set(token) <= alphabet:
            # A token outside the byte alphabet can only be an added token stored as raw text; BPE must see it in
            # its byte spelling to ever produce it. Added tokens keep their raw text: it is what matches them whole.
            token = _byte_spelling(token)
        vocab[token] = index  # a repeated text keeps its last id, as llama.cpp's text-to-id map does
    merges = [_merge_pair(merge) for merge in meta.strings("tokenizer.ggml.merges")]
    backend = tokenizers.Tokenizer(BPE(vocab, merges, ignore_merges=split.ignore_merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split.gpt2_regex)
    backend.pre_tokenizer = (
        byte_level
        if split.regex is None
        else pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split.regex), behavior="isolated"), byte_level])
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_spelling(text: str) -> str:
    """``text`` in GPT-2's byte alphabet, by the same table the tokenizer itself uses."""
    return "".join(piece for piece, _ in _SPELL_BYTES.pre_tokenize_str(text))


_SPELL_BYTES = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)


def _merge_pair(merge: str) -> tuple[str, str]:
    left, space, right = merge.partition(" ")
    if not space or not left or not right:
        raise GGUFVocabError(f"tokenizer.ggml.merges: {merge!r} is not two tokens separated by one space")
    return left, right


def _sentencepiece_bpe(meta: _Metadata, tokens: Sequence[str], token_types: Sequence[int]) -> tokenizers.Tokenizer:
    """Llama-2-style SentencePiece as BPE: spaces are ``▁``, a leading one is added, unknown bytes fall back to
    ``<0xNN>`` tokens. Merges are the file's, or rebuilt from the scores: a pair merges with the score of the
    token it makes, so higher-scored tokens form first, as SentencePiece's own BPE does."""
    vocab = {token: index for index, token in enumerate(tokens)}
    if meta.has("tokenizer.ggml.merges"):
        merges = [_merge_pair(merge) for merge in meta.strings("tokenizer.ggml.merges")]
    else:
        scores = meta.floats("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise GGUFVocabError("tokenizer.ggml.scores: a SentencePiece vocabulary without merges needs one score "
                                 "per token")
        mergeable = [t for t, kind in zip(tokens, token_types, strict=True)
                     if kind not in (_UNKNOWN, _CONTROL, _BYTE)]
        merges = _merges_from_scores(mergeable, vocab, dict(zip(tokens, scores, strict=True)))
    unknown = next((t for t, kind in zip(tokens, token_types, strict=True) if kind == _UNKNOWN), None)
    backend = tokenizers.Tokenizer(BPE(vocab, merges, unk_token=unknown, fuse_unk=True, byte_fallback=True))
    # llama.cpp prepends the space to every run of text, after a special token too, and always (even to text
    # that starts with one), as SentencePiece does; decoding takes the first one back off.
    prefix = meta.flag("tokenizer.ggml.add_space_prefix", default=True)
    backend.normalizer = normalizers.Sequence(
        [*([normalizers.Prepend("▁")] if prefix else []), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(content=" ", left=1, right=0)] if prefix else []),
    ])
    return backend


def _merges_from_scores(
    pieces: Sequence[str], vocab: Mapping[str, int], scores: Mapping[str, float]
) -> list[tuple[str, str]]:
    """Every split of a piece into two vocabulary entries is a merge ranked by the piece's score (best first);
    ties go to the shorter left part, then vocabulary order, so the ranking is deterministic."""
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for piece in pieces:
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[piece], len(left), vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: Sequence[str], token_types: Sequence[int]) -> None:
    """Register CONTROL tokens as special and USER_DEFINED ones as plain added tokens. Each resolves to its own
    id, never a new one: the vocabulary holds every one of these texts verbatim (``_byte_level_bpe`` keeps them
    unrespelled for that reason)."""
    special = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, token_types, strict=True) if kind == _CONTROL and t]
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, token_types, strict=True) if kind == _USER_DEFINED and t]
    backend.add_special_tokens(special)
    backend.add_tokens(user)


def _post_processor(
    tokens: Sequence[str], bos_id: int | None, eos_id: int | None
) -> processors.PostProcessor | None:
    """What ``encode(add_special_tokens=True)`` adds: BOS before and/or EOS after, as the file's flags say."""
    if bos_id is None and eos_id is None:
        return None
    head = [] if bos_id is None else [tokens[bos_id]]
    tail = [] if eos_id is None else [tokens[eos_id]]
    specials = [(tokens[i], i) for i in {bos_id, eos_id} if i is not None]
    return processors.TemplateProcessing(
        single=[*head, "$A", *tail], pair=[*head, "$A", *tail, *head, "$B:1", *tail], special_tokens=specials
    )


# Control tokens that end a turn under the name llama.cpp also treats as end-of-generation; a chat model's
# ``eos_token_id`` is often just one of them (SmolLM2: <|im_end|>, while <|endoftext|> ends a document).
_END_OF_GENERATION_TEXTS = frozenset(
    {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>"}
)


def _end_of_generation_ids(meta: _Metadata, tokens: Sequence[str], token_types: Sequence[int]) -> tuple[int, ...]:
    """``eos_token_id`` first (the one ``add_eos_token`` appends), then the file's end-of-turn ids, then the
    control tokens named like end-of-generation markers; no id twice."""
    named = [meta.token_id(f"tokenizer.ggml.{key}_token_id", len(tokens)) for key in ("eos", "eot", "eom")]
    by_text = [i for i, (t, kind) in enumerate(zip(tokens, token_types, strict=True))
               if kind == _CONTROL and t in _END_OF_GENERATION_TEXTS]
    ids = tuple(dict.fromkeys(i for i in (*named, *by_text) if i is not None))
    if not ids:
        raise GGUFVocabError("tokenizer.ggml.eos_token_id: missing, and no control token ends a generation")
    return ids


def _chat_template(
    meta: _Metadata, tokens: Sequence[str], bos_id: int | None, eos_ids: Sequence[int]
) -> ChatTemplate | None:
    source = meta.optional_string("tokenizer.chat_template")
    if source is None:
        return None
    return ChatTemplate(source, "" if bos_id is None else tokens[bos_id], tokens[eos_ids[0]])

