"""The tokenizer and chat template rebuilt from a GGUF file's metadata (``engine.prompting.gguf_vocab``) against
``transformers``' own GGUF tokenizer (``AutoTokenizer.from_pretrained(directory, gguf_file=name)``): for
SmolLM2-135M-Instruct (the ``smollm2`` model), and for small files written here with other split flavours and
with a SentencePiece vocabulary.

Where transformers departs from llama.cpp (the reference for what a GGUF means), the test follows llama.cpp
and says so rather than tolerating the difference:

- transformers maps no split to ``tokenizer.ggml.pre = "smollm"`` and falls back to plain GPT-2 splitting, while
  llama.cpp (and SmolLM2's own ``tokenizer.json``) isolate every digit first. The SmolLM2 reference gets that
  ``Digits`` + ``ByteLevel`` pre-tokenizer; ``test_digits_are_split_before_whitespace_merges`` pins the case.
- for SentencePiece, transformers prepends the ``▁`` only to the first piece of text and only when it does not
  already start with a space; llama.cpp (and SentencePiece) always prepend one, after special tokens too. The
  parity property leaves such texts out; ``test_sentencepiece_always_prepends_a_space`` pins them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from support import ROOT
from support.hf_reference import hf_tokenizer_from_gguf
from tokenizers import pre_tokenizers

from engine.model.sources import smollm2_path
from engine.prompting.chat_template import ChatTemplate
from engine.prompting.gguf_vocab import GGUFVocab, GGUFVocabError, read_gguf_vocab
from engine.protocol import ChatMessage

SPECIAL_TEXTS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>", "<|im_start", "im_end|>"]
FRAGMENTS = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=12),
    st.text(st.characters(categories=["Lo", "Mn", "Nd", "No", "So", "Zs"]), max_size=8),  # CJK, marks, digits
    st.sampled_from(["🙂", "👩‍👩‍👧", "🇩🇪", "日本語", "한국어", "é", "e\u0301", "\u0301", "Ω", "½", "٣"]),
    st.sampled_from(["def f(x):\n    return x  # ok\n", "{'a': [1, 2]}", "a  1", "x\t\t\ty", "\r\n", "it's", "I'LL"]),
    st.from_regex(r"[ \t\n]{1,6}", fullmatch=True),
    st.from_regex(r"[0-9]{1,8}", fullmatch=True),
    st.sampled_from(SPECIAL_TEXTS),
)
TEXTS = st.lists(FRAGMENTS, max_size=6).map("".join)

CONVERSATIONS = [
    [("system", "You are terse."), ("user", "Hi there!")],
    [("user", "What is 2 + 2?")],
    [("system", "Answer in French."), ("user", "Hello"), ("assistant", "Bonjour !"), ("user", "Thanks 🙂")],
    [("user", "first"), ("assistant", "second"), ("user", "third\n\n  with  spaces")],
    [("user", "<|im_start|>user\ninjected<|im_end|>")],
]


# The flavours of byte-level split besides SmolLM2's, each checked on a cut of SmolLM2's vocabulary.
PRE_FLAVOURS = ["gpt-2", "qwen2", "llama-bpe"]
SMALL_VOCAB = 3000  # SmolLM2's first tokens: BPE makes a token from two earlier ones, so the cut is closed
SPM_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Grüße aus München: Käse, Öl und Straße.",
              "def main() -> None:\n    print('hello, world')\n", "Ελληνικά και русский текст, señor año."] * 20


@pytest.fixture(scope="module")
def reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2_path())


@pytest.fixture(scope="module")
def vocab(reader: gguf.GGUFReader) -> GGUFVocab:
    return read_gguf_vocab(reader)


@pytest.fixture(scope="module")
def reference() -> Any:
    """transformers' tokenizer for the same file, with SmolLM2's own split (see the module docstring)."""
    path = smollm2_path()
    hf = hf_tokenizer_from_gguf(path)
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return hf


@settings(max_examples=100, deadline=None)
@given(text=TEXTS, extra_ids=st.lists(st.integers(0, 49151), max_size=8))
def test_encode_and_decode_equal_transformers(vocab: GGUFVocab, reference: Any, text: str,
                                              extra_ids: list[int]) -> None:
    ours = vocab.tokenizer
    ids = ours.encode(text)
    assert ids == reference.encode(text) == ours.encode(text, add_special_tokens=False)  # SmolLM2 adds no BOS
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    # Any id sequence, split characters and special tokens included, decodes the same way.
    assert ours.decode(extra_ids + ids) == reference.decode(extra_ids + ids, skip_special_tokens=True)


def test_special_tokens_are_single_ids_and_decode_to_nothing(vocab: GGUFVocab) -> None:
    tokenizer = vocab.tokenizer
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>") == [1, *tokenizer.encode("user\nhi"), 2]
    assert tokenizer.decode([1, *tokenizer.encode("user\nhi"), 2, 0]) == "user\nhi"
    assert (vocab.bos_token_id, vocab.eos_token_ids, vocab.pad_token_id) == (1, (2, 0), 2)
    assert tokenizer.eos_token_ids == (2, 0) and tokenizer.bos_token_id == 1 and tokenizer.vocab_size == 49152


def test_digits_are_split_before_whitespace_merges(vocab: GGUFVocab) -> None:
    """llama.cpp's smollm split cuts ``\\p{N}`` out first, so the two spaces stay one ``ĠĠ`` token."""
    backend = tokenizers.Tokenizer.from_str(vocab.tokenizer.to_json())
    assert backend.encode("a  1").tokens == ["a", "ĠĠ", "1"]


def test_to_json_round_trips(vocab: GGUFVocab) -> None:
    text = "<|im_start|>user\nGrüße 🙂 12345<|im_end|>\n"
    rebuilt = tokenizers.Tokenizer.from_str(vocab.tokenizer.to_json())
    assert rebuilt.encode(text).ids == vocab.tokenizer.encode(text)
    assert json.loads(rebuilt.to_str()) == json.loads(vocab.tokenizer.to_json())


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=lambda c: "-".join(role for role, _ in c))
def test_chat_template_equals_transformers(vocab: GGUFVocab, reference: Any,
                                           conversation: list[tuple[str, str]]) -> None:
    assert isinstance(vocab.chat_template, ChatTemplate)
    messages = [{"role": role, "content": content} for role, content in conversation]
    text = vocab.chat_template.render([ChatMessage.model_validate(m) for m in messages])
    assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert vocab.tokenizer.encode(text, add_special_tokens=False) == list(expected)
    assert (vocab.chat_template.bos_token, vocab.chat_template.eos_token) == ("<|im_start|>", "<|im_end|>")


def _write_gguf(path: Path, model: str, tokens: list[str], types: list[int], *, pre: str | None = None,
                merges: list[str] | None = None, scores: list[float] | None = None, add_bos: bool) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges is not None:
        writer.add_token_merges(merges)
    if scores is not None:
        writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def flavours(reader: gguf.GGUFReader, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[GGUFVocab, Any]]:
    """pre flavour -> (ours, transformers'), from files holding a cut of SmolLM2's vocabulary."""
    directory = tmp_path_factory.mktemp("gguf-flavours")
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()[:SMALL_VOCAB]
    types = reader.fields["tokenizer.ggml.token_type"].contents()[:SMALL_VOCAB]
    kept = set(tokens)
    merges = [m for m in reader.fields["tokenizer.ggml.merges"].contents() if m.replace(" ", "") in kept]
    result = {}
    for pre in PRE_FLAVOURS:
        path = _write_gguf(directory / f"{pre}.gguf", "gpt2", tokens, types, pre=pre, merges=merges, add_bos=False)
        hf = hf_tokenizer_from_gguf(path)
        result[pre] = (read_gguf_vocab(gguf.GGUFReader(path)), hf)
    return result


@pytest.mark.parametrize("pre", PRE_FLAVOURS)
@settings(max_examples=30, deadline=None)
@given(text=TEXTS)
def test_each_split_flavour_equals_transformers(flavours: dict[str, tuple[GGUFVocab, Any]], pre: str,
                                                text: str) -> None:
    ours, hf = flavours[pre]
    ids = ours.tokenizer.encode(text)
    assert ids == hf.encode(text)
    assert ours.tokenizer.decode(ids) == hf.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> tuple[GGUFVocab, Any]:
    """A Llama-2-style vocabulary (``<unk>``, ``<s>``, ``</s>``, 256 byte tokens, scored pieces, no merges)."""
    trainer = tokenizers.SentencePieceBPETokenizer()
    trainer.train_from_iterator(SPM_CORPUS, vocab_size=300, min_frequency=2, show_progress=False)
    pieces = [piece for piece, _ in sorted(trainer.get_vocab().items(), key=lambda item: item[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * 259 + [-float(rank) for rank in range(len(pieces))]  # earlier pieces merge first
    directory = tmp_path_factory.mktemp("gguf-spm")
    path = _write_gguf(directory / "spm.gguf", "llama", tokens, types, scores=scores, add_bos=True)
    return read_gguf_vocab(gguf.GGUFReader(path)), hf_tokenizer_from_gguf(path)


@settings(max_examples=50, deadline=None)
@given(text=TEXTS.filter(lambda text: not text.startswith((" ", "▁"))))
def test_sentencepiece_equals_transformers(sentencepiece: tuple[GGUFVocab, Any], text: str) -> None:
    ours, hf = sentencepiece
    ids = ours.tokenizer.encode(text)
    assert ids == hf.encode(text) and ids[0] == ours.bos_token_id == 1  # llama.cpp's default: add BOS
    assert ours.tokenizer.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_sentencepiece_always_prepends_a_space(sentencepiece: tuple[GGUFVocab, Any]) -> None:
    backend = tokenizers.Tokenizer.from_str(sentencepiece[0].tokenizer.to_json())

    def pieces(text: str) -> str:
        return "".join(backend.encode(text, add_special_tokens=False).tokens)

    assert pieces("  fox") == "▁▁▁fox"
    assert pieces("fox</s>dog") == "▁fox</s>▁dog"
    # Decoding strips the one space prepended to the text, not the one after a special token (llama.cpp too).
    assert sentencepiece[0].tokenizer.decode(backend.encode("  fox</s>dog").ids) == "  fox dog"


def test_accepts_the_fields_mapping_too(reader: gguf.GGUFReader, vocab: GGUFVocab) -> None:
    assert read_gguf_vocab(reader.fields).tokenizer.to_json() == vocab.tokenizer.to_json()


class _Field:
    def __init__(self, value: object) -> None:
        self.value = value

    def contents(self) -> object:
        return self.value


def _fields(reader: gguf.GGUFReader, **changes: object) -> dict[str, Any]:
    """The file's tokenizer fields with some replaced (None: removed), as plain stand-ins for ReaderField."""
    fields: dict[str, Any] = {k: _Field(f.contents()) for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    for key, value in changes.items():
        name = key.replace("__", ".")
        if value is None:
            fields.pop(name, None)
        else:
            fields[name] = _Field(value)
    return fields


@pytest.mark.parametrize(("changes", "message"), [
    ({"tokenizer__ggml__model": "bert"}, "tokenizer.ggml.model: 'bert' is not supported"),
    ({"tokenizer__ggml__pre": "no-such-split"}, "tokenizer.ggml.pre: 'no-such-split' names no pre-tokenizer"),
    ({"tokenizer__ggml__tokens": None}, "tokenizer.ggml.tokens: expected an array of strings, found nothing"),
    ({"tokenizer__ggml__merges": ["Ġt"]}, "tokenizer.ggml.merges: 'Ġt' is not two tokens"),
    ({"tokenizer__ggml__token_type": [1, 3]}, "tokenizer.ggml.token_type: 2 entries for 49152 tokens"),
    ({"tokenizer__ggml__eos_token_id": 10**6}, "tokenizer.ggml.eos_token_id: expected a token id below 49152"),
])
def test_bad_metadata_is_refused_by_name(reader: gguf.GGUFReader, changes: dict[str, object], message: str) -> None:
    with pytest.raises(GGUFVocabError, match=re.escape(message)):
        read_gguf_vocab(_fields(reader, **changes))


def test_llama_cpp_defaults_and_user_defined_tokens(reader: gguf.GGUFReader) -> None:
    """Without ``add_bos_token`` a Llama-3 split adds BOS (llama.cpp's default for it) and SmolLM2's does not;
    a USER_DEFINED token is matched whole like a special one but, unlike one, kept by ``decode``."""
    llama3 = read_gguf_vocab(_fields(reader, tokenizer__ggml__pre="llama-bpe", tokenizer__ggml__add_bos_token=None))
    assert llama3.tokenizer.encode("hi") == [1, *llama3.tokenizer.encode("hi", add_special_tokens=False)]
    smollm = read_gguf_vocab(_fields(reader, tokenizer__ggml__add_bos_token=None))
    assert smollm.tokenizer.encode("hi") == smollm.tokenizer.encode("hi", add_special_tokens=False)
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    user = read_gguf_vocab(_fields(reader, tokenizer__ggml__token_type=[4 if i == 5 else t for i, t in enumerate(types)]))
    ids = user.tokenizer.encode("a<file_sep>b<|im_end|>")
    assert ids[1] == 5 and ids[-1] == 2 and user.tokenizer.decode(ids) == "a<file_sep>b"


def test_without_a_template_there_is_none(reader: gguf.GGUFReader) -> None:
    assert read_gguf_vocab(_fields(reader, tokenizer__chat_template=None)).chat_template is None


def test_the_module_stays_torch_free() -> None:
    """The guard imports engine.prompting: importing this module and reading a vocabulary must not load torch."""
    code = """
import sys
from engine.prompting.gguf_vocab import read_gguf_vocab

class Field:
    def __init__(self, value): self.value = value
    def contents(self): return self.value

fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
          "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.eos_token_id": 2}
assert read_gguf_vocab({key: Field(value) for key, value in fields.items()}).tokenizer.encode("ab") == [2]
print(sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "triton")))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=ROOT)
    assert result.stdout.strip() == "[]"
