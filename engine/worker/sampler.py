"""Token sampling from a step's logits: greedy, temperature, top-k, top-p, per-request seeds.

Sampling uses the exponential race (argmax of ``p / E`` with ``E ~ Exp(1)``), which draws from ``p``
exactly and lets each seeded row use its own generator without a Python-level multinomial per row.
A seeded request's draws depend only on its own generator, never on the rest of the batch.

Rows under a grammar (engine/structured) draw only the tokens it allows: their disallowed logits become
-inf before anything else, so greedy, temperature, top-k and top-p all choose among the allowed tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured.bitmask import GrammarBitmask


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    grammar: GrammarBitmask | None = None,
) -> torch.Tensor:
    """Sample one token per row of ``logits`` ([rows, vocab], float32), masked in place by ``grammar``:
    ``[rows]`` int64 on the logits' device (reading them back is the caller's choice of when)."""
    if grammar is not None:
        grammar.apply(logits)
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        chosen = [params[i] for i in random_rows]
        probs = _filtered_probs(logits[random_rows], chosen)
        noise = torch.empty_like(probs).exponential_()
        for j, i in enumerate(random_rows):
            if generators[i] is not None:
                noise[j].exponential_(generator=generators[i])
        tokens[random_rows] = (probs / noise).argmax(dim=-1)
    return tokens


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    logits = logits / temperature.unsqueeze(1)
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device).unsqueeze(0)
        drop = rank >= top_k.unsqueeze(1)
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest head whose mass reaches top_p: drop a token when the mass before it already does.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(dim=-1)
