"""`transformers` as the reference our engine is compared with: greedy tokens and last-position logits.

``hf_greedy`` never stops at an end-of-sequence token (the engine side runs with ``ignore_eos``), so both
produce exactly ``max_tokens`` tokens whichever ids a model treats as end-of-generation.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import gguf
import torch
import transformers

from engine.prompting.gguf_reader import PlainArrayReader

# A Llama/Qwen2 config small enough to build in a test, with GQA and more than one layer.
SMALL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


@contextlib.contextmanager
def _quick_gguf_parsing() -> Iterator[None]:
    """transformers' GGUF loading with two of gguf-py's costs taken off, not its results.

    transformers parses the file with ``gguf.GGUFReader``, whose ``np.memmap`` runs Python's
    ``__array_finalize__`` on every one of ~500,000 slices for SmolLM2's vocabulary; the engine's
    ``PlainArrayReader`` is the same reader over a plain view of the same map. It also rebuilds
    ``get_tensor_name_map(arch, layers)`` (a pure function) once per module of the model, ~400 times.
    Together ~35 s of the ~45 s SmolLM2 took to load on the 2-core VM.
    """
    with mock.patch.object(gguf, "GGUFReader", PlainArrayReader), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        yield


def hf_model_from_gguf(path: Path) -> transformers.PreTrainedModel:
    """transformers' own fp32 model from a GGUF file (its dequantization and Q/K un-permutation), in eval mode."""
    with _quick_gguf_parsing():
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def hf_tokenizer_from_gguf(path: Path) -> Any:
    """transformers' own tokenizer built from a GGUF file's vocabulary."""
    with _quick_gguf_parsing():
        return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """``max_tokens`` argmax tokens after ``prompt``, one forward per token over HF's own KV cache."""
    tokens: list[int] = []
    past = None
    step = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_tokens):
            out = model(input_ids=step, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
            step = torch.tensor([tokens[-1:]])
    return tokens


def hf_last_logits(model: transformers.PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    """fp32 logits ``[vocab]`` of the token after ``prompt``."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].float()


def save_hf_model(config_class: type, kwargs: dict, directory: Path) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = config_class(**kwargs, attn_implementation="eager")
    hf_model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    # HF's default init gives near-zero biases and unit norms; randomise them so the test sees them.
    with torch.no_grad():
        for name, parameter in hf_model.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                parameter.copy_(torch.randn_like(parameter) * 0.1 + (1.0 if "norm" in name else 0.0))
    hf_model.save_pretrained(directory)
    return hf_model
