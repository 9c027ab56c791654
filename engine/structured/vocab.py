"""The engine's tokenizer as xgrammar sees it: every token's bytes, and which tokens stop a completion.

Two rules keep what the grammar accepts equal to what the client receives:

- The vocabulary is as wide as the model's logits (``vocab_size``): ids past the tokenizer's (the padding of
  a padded embedding) are never allowed.
- Special tokens are given as empty strings, which xgrammar never lets a grammar match, because ``decode``
  drops them: a ``<|im_start|>`` allowed as text inside a JSON string would reach the client as nothing,
  and a string's ``minLength`` or ``pattern`` would hold for text the client never sees. The tokenizer's
  EOS ids are the stop tokens: once the grammar is complete, only they are allowed, and accepting one
  terminates the matcher.
"""

from __future__ import annotations

import tokenizers
import transformers
import xgrammar as xgr

from engine.prompting.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    stop = list(tokenizer.eos_token_ids)
    if isinstance(tokenizer, ByteTokenizer):
        specials = tokenizer.vocab_size - 256  # BOS and EOS, after the 256 byte ids
        return xgr.TokenizerInfo([bytes([byte]) for byte in range(256)] + [b""] * specials, xgr.VocabType.RAW,
                                 vocab_size=vocab_size, stop_token_ids=stop)
    if isinstance(tokenizer, HFTokenizer):
        return _hf_tokenizer_info(tokenizers.Tokenizer.from_str(tokenizer.to_json()), vocab_size, stop)
    raise TypeError(f"no xgrammar vocabulary for a {type(tokenizer).__name__}")


def _hf_tokenizer_info(backend: tokenizers.Tokenizer, vocab_size: int, stop: list[int]) -> xgr.TokenizerInfo:
    # xgrammar reads how the vocabulary spells bytes (byte-level, byte-fallback or raw) and whether a space
    # is prepended from a transformers tokenizer; its own reading, then, with the special tokens blanked.
    detected = xgr.TokenizerInfo.from_huggingface(transformers.PreTrainedTokenizerFast(tokenizer_object=backend),
                                                  vocab_size=vocab_size, stop_token_ids=stop)
    special = {token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special}
    vocab = [""] * vocab_size
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size and token_id not in special:
            vocab[token_id] = token
    return xgr.TokenizerInfo(vocab, detected.vocab_type, vocab_size=vocab_size, stop_token_ids=stop,
                             add_prefix_space=detected.add_prefix_space)
