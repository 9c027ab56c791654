"""Memory arithmetic: the KV pool, each class's p95 sequence, the demand at peak, the safe envelope, the verdict.

::

    GPU memory (decimal GB x 10^9 bytes)
    +-----------------+------------------+------------------------------------------+
    | weights         | runtime reserve  | KV pool                                  |
    +-----------------+------------------+------------------------------+-----------+
                                         | safe envelope = pool x (1-m) | margin m  |
                                         +------------------------------+-----------+

Demand is the expected KV of the peak ``streams``: each class takes ``share x streams`` of them, each holding
its p95 context (input + output) of ``2 x layers x kv_heads x head_dim x kv_bytes`` bytes per token, whole
blocks of it when the pool is an engine's (the engine allocates, and the guard reserves, in blocks).

GPUs needed counts replicas, each with the whole model and its own pool (no tensor parallelism): streams
spread over them, so ``ceil(demand / safe envelope)``, provided one p95 sequence of every class fits one
replica's envelope and fits the model's context window (else no number of replicas helps: ``blocker`` says
why). The streams are treated as a fluid: a replica's share of the mix is assumed to pack into its envelope.

A replica's stream slots (queueing.py's servers) are its envelope over the mean p95 sequence of the mix.

Figures are exact bytes; the GiB figures reported are those bytes / 2^30, except ``demand_gib``, which sums
each class's per-sequence demand *as quoted* to 0.001 GiB, the convention of reference 000's worked example
and of the contract's figures (docs/contract.md: 46.16 GiB; the exact sum is 46.17). The verdicts use exact bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from guard.plan.workload import MixEntry

GIB = 2**30
GB = 10**9
QUOTED_GIB_DIGITS = 3  # per-sequence demand as reference 000 quotes it; see the module docstring
# Bytes are integers but the envelope is a float product; a ratio within this of an integer is that integer,
# so that a demand of exactly two envelopes needs two replicas, not three.
RATIO_SLACK = 1e-9


@dataclass(slots=True, frozen=True)
class ClassDemand:
    """One mix entry at peak: ``streams`` (fractional: ``share x`` peak streams) of ``sequence_bytes`` each."""

    name: str
    share: float
    context_tokens: int  # p95 input + output, rounded up to whole blocks in an engine's pool
    sequence_bytes: int
    streams: float

    @property
    def quoted_gib(self) -> float:
        return round(self.sequence_bytes / GIB, QUOTED_GIB_DIGITS)

    @property
    def aggregate_bytes(self) -> float:
        return self.streams * self.sequence_bytes


@dataclass(slots=True, frozen=True)
class Sizing:
    """Invariants: ``safe_bytes <= pool_bytes`` (a pool <= 0 leaves both <= 0 and sets ``blocker``);
    ``gpus_needed`` and ``slots_per_replica`` are None exactly when ``blocker`` is set."""

    pool_bytes: int
    margin: float
    streams: int
    classes: tuple[ClassDemand, ...]
    blocker: str | None
    gpus_needed: int | None
    slots_per_replica: int | None

    @property
    def safe_bytes(self) -> float:
        return self.pool_bytes * (1.0 - self.margin)

    @property
    def demand_bytes(self) -> float:
        return math.fsum(c.aggregate_bytes for c in self.classes)

    @property
    def demand_gib(self) -> float:
        """The reference's figure: quoted per-sequence GiB x streams, summed (module docstring)."""
        return math.fsum(c.streams * c.quoted_gib for c in self.classes)

    @property
    def mean_sequence_bytes(self) -> float:
        return math.fsum(c.share * c.sequence_bytes for c in self.classes)

    @property
    def fits_raw_pool(self) -> bool:
        return self.pool_bytes > 0 and self.demand_bytes <= self.pool_bytes

    @property
    def fits_one_gpu(self) -> bool:
        """The peak demand fits one replica's safe envelope (the raw pool is not enough: see the margin)."""
        return self.pool_bytes > 0 and self.demand_bytes <= self.safe_bytes


def gpu_pool_bytes(memory_gb: float, weight_bytes: int, runtime_reserve_bytes: int) -> int:
    """What a GPU of ``memory_gb`` advertised (decimal) GB leaves for KV; negative when the weights do not fit."""
    return round(memory_gb * GB) - weight_bytes - runtime_reserve_bytes


def size(mix: list[MixEntry], streams: int, margin: float, pool_bytes: int, bytes_per_token: int,
         block_size: int | None = None, context_window: int | None = None) -> Sizing:
    """The memory plan of ``streams`` peak streams of ``mix`` on replicas of ``pool_bytes`` KV each, for a
    model that holds ``context_window`` tokens per request (None: not checked)."""
    classes = tuple(
        ClassDemand(e.name, e.share, tokens, tokens * bytes_per_token, e.share * streams)
        for e in mix
        for tokens in [_in_blocks(e.context_tokens, block_size)]
    )
    probe = Sizing(pool_bytes, margin, streams, classes, None, None, None)
    largest = max(classes, key=lambda c: c.sequence_bytes)
    too_long = [e for e in mix if context_window is not None and e.context_tokens > context_window]
    if too_long:
        blocker = "; ".join(f"a p95 {e.name!r} request holds {e.context_tokens:,} tokens (input + output)"
                            for e in too_long)
        blocker += (f", past the model's context window of {context_window:,} tokens: the engine refuses such "
                    "requests whatever the fleet; shorten them, or choose a model with a longer window")
    elif pool_bytes <= 0:
        blocker = (f"no room for KV: weights and runtime reserve exceed the memory by {-pool_bytes / GIB:.2f} GiB "
                   "(more memory per GPU, or tensor parallelism, which this planner does not model)")
    elif largest.sequence_bytes > probe.safe_bytes + RATIO_SLACK:
        blocker = (f"one p95 {largest.name!r} sequence ({largest.sequence_bytes / GIB:.3f} GiB) exceeds one "
                   f"replica's safe envelope ({probe.safe_bytes / GIB:.2f} GiB): replicas cannot help; shorten "
                   "its contexts, or shard the model (tensor parallelism)")
    else:
        gpus = max(1, math.ceil(probe.demand_bytes / probe.safe_bytes - RATIO_SLACK))
        slots = math.floor(probe.safe_bytes / probe.mean_sequence_bytes + RATIO_SLACK)
        return Sizing(pool_bytes, margin, streams, classes, None, gpus, slots)
    return Sizing(pool_bytes, margin, streams, classes, blocker, None, None)


def _in_blocks(tokens: int, block_size: int | None) -> int:
    return tokens if block_size is None else -(-tokens // block_size) * block_size
