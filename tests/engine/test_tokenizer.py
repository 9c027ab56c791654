"""Tokenizers, streaming detokenization, and the built-in tiny model's weights."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import tokenizers
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.single_sequence import SingleSequence
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine.kernels import TorchAttentionBackend
from engine.model.loader import load_model
from engine.model.tiny import tiny_state_dict
from engine.prompting.detokenizer import IncrementalDetokenizer
from engine.prompting.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus München: Käse, Öl und Straße.",
    "日本語のテキストと絵文字 🙂🚀 を含む文。",
    "def main() -> None:\n    print('hello, world')\n",
    "Ελληνικά και русский текст, señor año.",
] * 20


def stream(
    tokenizer: Tokenizer, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> tuple[str, IncrementalDetokenizer]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = [detokenizer.step(token) for token in output_ids]
    pieces.append(detokenizer.flush())
    return "".join(pieces), detokenizer


# Output bytes mixing whole UTF-8 characters, arbitrary (often invalid) bytes, the specials and the tiny
# model's padding ids, which decode to nothing.
byte_outputs = st.lists(
    st.one_of(
        st.text(min_size=1, max_size=3).map(lambda s: list(s.encode("utf-8"))),
        st.lists(st.integers(0, 255), min_size=1, max_size=3),
        st.sampled_from([[ByteTokenizer.BOS], [ByteTokenizer.EOS], [300]]),
    ),
    max_size=40,
).map(lambda chunks: [token for chunk in chunks for token in chunk])


@settings(max_examples=300, deadline=None)
@given(prompt=st.text(max_size=12), output_ids=byte_outputs)
def test_byte_increments_concatenate_to_the_full_decode(prompt: str, output_ids: list[int]) -> None:
    tokenizer = ByteTokenizer()
    text, detokenizer = stream(tokenizer, tokenizer.encode(prompt), output_ids)
    assert text == tokenizer.decode(output_ids)
    assert detokenizer.text == text


def test_multibyte_characters_are_emitted_once_complete() -> None:
    tokenizer = ByteTokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    assert [detokenizer.step(b) for b in "é🙂".encode()] == ["", "é", "", "", "", "🙂"]
    # A special token decodes to nothing, so it settles nothing: the euro sign still completes across it.
    assert [detokenizer.step(t) for t in [0xE2, ByteTokenizer.EOS, 0x82, 0xAC]] == ["", "", "", "€"]


class CountingTokenizer(ByteTokenizer):
    """Records the longest id sequence it was asked to decode."""

    def __init__(self) -> None:
        self.longest = 0

    def decode(self, ids: Sequence[int]) -> str:
        self.longest = max(self.longest, len(ids))
        return super().decode(ids)


def test_cost_per_token_is_bounded_even_for_invalid_utf8() -> None:
    tokenizer = CountingTokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("a prompt of some length"))
    generator = torch.Generator().manual_seed(0)
    garbage = [0x80] * 500 + [0xE2, 0x82] * 200 + torch.randint(0, 256, (2000,), generator=generator).tolist()
    emitted = "".join(detokenizer.step(b) for b in garbage)

    assert tokenizer.longest <= 12
    assert len(emitted) >= len(tokenizer.decode(garbage)) - 4  # nothing is held back for long
    assert emitted + detokenizer.flush() == tokenizer.decode(garbage)


@pytest.fixture(scope="module")
def byte_level_bpe(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tokenizer.save(str(path))
    return HFTokenizer.from_file(path, eos_token_ids=(1,), bos_token_id=0)


@pytest.fixture(scope="module")
def metaspace_bpe() -> HFTokenizer:
    """SentencePiece-style: a word's leading space is part of its token and dropped at the start of a text."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"]))
    return HFTokenizer(tokenizer, eos_token_ids=(1,), bos_token_id=0)


def test_hf_tokenizer_round_trip_and_specials(byte_level_bpe: HFTokenizer) -> None:
    text = "Grüße 🙂 from the lazy dog"
    ids = byte_level_bpe.encode(text)
    assert byte_level_bpe.decode(ids) == text
    assert byte_level_bpe.decode([0, *ids, 1]) == text  # specials are skipped
    assert byte_level_bpe.vocab_size == 400
    assert byte_level_bpe.eos_token_ids == (1,) and byte_level_bpe.bos_token_id == 0


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_hf_increments_concatenate_to_the_full_decode(
    byte_level_bpe: HFTokenizer, data: st.DataObject
) -> None:
    vocab = byte_level_bpe.vocab_size
    prompt = byte_level_bpe.encode(data.draw(st.sampled_from(CORPUS[:5]), label="prompt"))
    # Random ids: real output, or garbage that splits characters across tokens.
    output_ids = data.draw(
        st.one_of(
            st.text(max_size=20).map(byte_level_bpe.encode),
            st.lists(st.integers(0, vocab - 1), max_size=30),
        ),
        label="output_ids",
    )
    text, _ = stream(byte_level_bpe, prompt, output_ids)
    assert text == byte_level_bpe.decode(output_ids)


def test_prompt_context_keeps_the_first_output_space(metaspace_bpe: HFTokenizer) -> None:
    prompt = metaspace_bpe.encode("The quick brown")
    output = metaspace_bpe.encode("The quick brown fox jumps over")[len(prompt) :]
    text, _ = stream(metaspace_bpe, prompt, output)
    assert text == " fox jumps over"
    assert metaspace_bpe.decode(prompt) + text == metaspace_bpe.decode(prompt + output)


def test_tiny_model_is_deterministic() -> None:
    first, second = tiny_state_dict(), tiny_state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)

    loaded = load_model("tiny", torch.device("cpu"), torch.float32, TorchAttentionBackend())
    assert loaded.name == "tiny" and isinstance(loaded.tokenizer, ByteTokenizer)
    assert all(torch.equal(p, first[name]) for name, p in loaded.model.named_parameters())


def test_tiny_model_is_not_degenerate() -> None:
    loaded = load_model("tiny", torch.device("cpu"), torch.float32, TorchAttentionBackend())
    prompts = ["Hello", "Hello!", "The quick brown fox", "1 2 3"]
    outputs = [
        SingleSequence(loaded.model).greedy(loaded.tokenizer.encode(p), max_tokens=16) for p in prompts
    ]
    assert len({tuple(o) for o in outputs}) == len(prompts)
    assert all(len(set(o)) > 4 for o in outputs)  # not one byte repeated
