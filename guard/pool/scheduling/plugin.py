"""What a scheduling plugin is, and the registries a profile's names are looked up in.

A plugin is a small class registered by name with one of the decorators below. It sees one ``Context``
per request: the ``Request`` being placed, the candidates (usable replicas) and what was computed about them
once for all plugins.

- a filter's ``holds_back(replica, ctx) -> bool``: True ranks the replica behind every one it does not hold
  back. When a profile's filters hold back every candidate, none is held (fail open).
- a scorer's ``score(replica, ctx) -> float`` in [0, 1], higher is better; ``reads_prefix`` says it reads
  ``ctx.hits`` (the guard then hashes prompts and follows each replica's KV events).
- a picker's ``order(candidates, ctx) -> list[Candidate]``: the order the dispatcher tries, from the
  candidates with their ``filtered_by``, ``scores`` and ``total`` filled in.

Plugins are stateless apart from what a picker keeps between requests (its own instance per profile).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

if TYPE_CHECKING:
    from guard.pool.latency import Prediction
    from guard.pool.replica import Replica
    from guard.records.record import KeptCandidate


@dataclass(slots=True)
class Candidate:
    """A usable replica as one request's ranking sees it: what the decision record shows of the choice."""

    replica: Replica
    hit_blocks: int  # cached leading blocks of the request's prompts on it (0 when not read)
    filtered_by: str | None = None  # the filter that held it back
    scores: dict[str, float] = field(default_factory=dict)  # scorer name -> its value (unweighted)
    total: float = 0.0  # the weighted sum

    def kept(self) -> KeptCandidate:
        """As the decision record keeps it."""
        return self.replica.name, self.filtered_by, self.scores, self.total


@dataclass(slots=True)
class Request:
    """What a profile ranks the replicas for: one request as admission is about to place it (built anew for
    each placement: its TTFT budget shrinks as it waits, and its priority depends on what it borrows)."""

    blocks: int  # its reservation
    hashes: Sequence[Sequence[bytes]] = ()  # each prompt's full-block hashes (empty: not computed)
    prompt_tokens: int = 0  # all prompts together
    ttft_left_s: float | None = None  # what its TTFT objective leaves after its wait so far (None: none)
    tpot_s: float | None = None  # its TPOT objective (None: none)
    priority: int = 0  # the engine priority it would run at (guard/pool/gate.py engine_priority)
    lora: str | None = None  # the LoRA adapter it names (None: the base model)
    tenant: str = ""
    model: str = ""  # the model id the client asked for
    objective: str | None = None  # its named objective, if it chose one
    sheddable: bool = False  # its class is sheddable: its objectives are held to the median, not the p90


@dataclass(slots=True)
class Context:
    """One request's ranking: the request, its prompts' cached leading blocks per replica, and the load (each
    read once per ranking, however many plugins read it)."""

    request: Request
    candidates: Sequence[Replica]
    hits: dict[Replica, int]  # cached leading blocks of the request's prompts, per candidate (0: not read)
    prompt_blocks: int  # full blocks of the request's prompts
    busiest: int  # the most requests in flight on any candidate (at least 1)
    least: int  # the fewest
    free: dict[Replica, float]  # per candidate, the share of its budget left after this reservation (free_share)

    # The request's own, for the plugins that read them (shorter to write in a plugin).
    @property
    def blocks(self) -> int:
        return self.request.blocks

    @property
    def prompt_tokens(self) -> int:
        return self.request.prompt_tokens

    @property
    def ttft_left_s(self) -> float | None:
        return self.request.ttft_left_s

    @property
    def tpot_s(self) -> float | None:
        return self.request.tpot_s

    @property
    def lora(self) -> str | None:
        return self.request.lora

    @property
    def priority(self) -> int:
        return self.request.priority


class Filter(Protocol):
    name: ClassVar[str]

    def holds_back(self, replica: Replica, ctx: Context) -> bool: ...


class Scorer(Protocol):
    name: ClassVar[str]
    reads_prefix: ClassVar[bool]

    def score(self, replica: Replica, ctx: Context) -> float: ...


class Picker(Protocol):
    name: ClassVar[str]

    def order(self, candidates: list[Candidate], ctx: Context) -> list[Candidate]: ...


FILTERS: dict[str, type[Filter]] = {}
SCORERS: dict[str, type[Scorer]] = {}
PICKERS: dict[str, type[Picker]] = {}

T = TypeVar("T")


def _register(registry: dict[str, type], name: str) -> Callable[[type[T]], type[T]]:
    def register(cls: type[T]) -> type[T]:
        if name in registry:
            raise ValueError(f"a scheduling plugin named {name!r} is already registered")
        cls.name = name  # type: ignore[attr-defined]
        registry[name] = cls
        return cls
    return register


def register_filter(name: str) -> Callable[[type[T]], type[T]]:
    return _register(FILTERS, name)


def register_scorer(name: str) -> Callable[[type[T]], type[T]]:
    return _register(SCORERS, name)


def register_picker(name: str) -> Callable[[type[T]], type[T]]:
    return _register(PICKERS, name)


def free_share(replica: Replica, blocks: int) -> float:
    """The share of the replica's budget left after reserving ``blocks`` there (0 when it would not fit)."""
    budget = replica.gate.budget
    return max(0.0, (budget - replica.gate.committed() - blocks) / budget) if budget else 0.0


def predicted_ttft(replica: Replica, ctx: Context) -> Prediction:
    """Seconds from admission on the replica to the request's first token (guard/pool/latency.py), its
    prompts' blocks cached there not counted."""
    snapshot = replica.gate.snapshot
    cached = ctx.hits.get(replica, 0) * snapshot.block_size if snapshot is not None else 0
    return replica.latency.predict_ttft(ctx.priority, max(0, ctx.prompt_tokens - cached), replica.in_flight)
