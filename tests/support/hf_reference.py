"""`transformers` as the reference our engine is compared with: greedy tokens and last-position logits.

``hf_greedy`` never stops at an end-of-sequence token (the engine side runs with ``ignore_eos``), so both
produce exactly ``max_tokens`` tokens whichever ids a model treats as end-of-generation.
"""

from __future__ import annotations

import torch
import transformers


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
