"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.validation import is_int, is_number, require


@dataclass(slots=True)
class SamplingParams:
    """How to sample a completion. Invalid values raise ``ValueError`` naming the field.

    ``temperature == 0`` is greedy. ``top_k`` of 0 (or -1) and ``top_p`` of 1 disable those filters.
    ``max_tokens=None`` generates until EOS, a stop string or the model's context length.
    ``stop`` strings are removed from the returned text; ``seed`` makes a sampled request reproducible.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        require(is_int(self.n) and 1 <= self.n <= 128, "n", "an integer in [1, 128]", self.n)
        require(
            self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens", "an integer >= 1 (or None)", self.max_tokens,
        )
        require(is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
               "temperature", "a number in [0, 100]", self.temperature)
        require(is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "a number in (0, 1]", self.top_p)
        require(is_int(self.top_k) and self.top_k >= -1, "top_k", "an integer >= -1", self.top_k)
        require(self.seed is None or is_int(self.seed), "seed", "an integer or None", self.seed)
        require(self.stop is None or (isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop)),
               "stop", "a non-empty string or a list of them", self.stop)
        require(isinstance(self.stop_token_ids, list) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "a list of token ids", self.stop_token_ids)
        require(isinstance(self.ignore_eos, bool), "ignore_eos", "a boolean", self.ignore_eos)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
