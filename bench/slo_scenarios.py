"""bench/slo.py's scenarios and configurations: who sends what at which share of the capacity, and the guard
configuration each configuration runs.

A scenario is a set of tenants, each in the interactive or the batch lane, and one or more engines. Its
offered load is set against a capacity C (generated tokens per second, bench/slo.py's calibration): the
interactive tenants together offer ``interactive_share`` x C, the batch tenants together the rest of
``load`` x C, in generated tokens, split evenly among the tenants of a lane.

- ``S1``: 2 interactive and 6 batch tenants, all of weight 1 (classes spread across tenants).
- ``S2``: today's mix, one interactive tenant (``web``) and one batch tenant (``batch``).
- ``S3``: S2's tenants on two engines, one about half the other's capacity (the same model in bfloat16,
  slower on this CPU), the load set against the two together.

Configurations (the same tenants and lanes; only what is named differs):

- ``a``: kvguard with SLOs: interactive ``{slo: {ttft_ms: 1500}, priority_class: critical}``, batch
  ``{slo: {ttft_ms: batch_ttft_ms}, priority_class: sheddable}``; lane timeouts 10 s and 300 s.
- ``a_nofilter``: ``a`` with the kvguard preset's profile less its ``slo`` filter (S3's comparison).
- ``b1``: today's guard without SLOs (the lanes' default classes, timeouts 10 s and 300 s).
- ``b2``: ``b1`` with each lane's timeout set to its objective (1.5 s, ``batch_ttft_ms``): the guard then
  refuses at arrival what it expects to wait past them, and drops what waits longer.
- ``b3``: ``b1`` with the interactive tenants weighted so that together they are guaranteed half the pool.
- ``fifo``: straight to the (first) engine, no guard (one engine only).

Invariant: every configuration of a scenario gets the same tenants, prompts, token counts and arrival
seeds; the objectives that judge a request are its lane's, whether or not the configuration knows them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

INTERACTIVE, BATCH = "interactive", "batch"
INTERACTIVE_TTFT_S = 1.5
CONFIGS = ("a", "a_nofilter", "b1", "b2", "b3", "fifo")
LABELS = {"a": "(a) SLOs", "a_nofilter": "(a) SLOs, no slo filter", "b1": "B1 without SLOs",
          "b2": "B2 timeouts = objectives", "b3": "B3 interactive 50% guarantee", "fifo": "FIFO to the engine"}
# The kvguard preset (guard/pool/scheduling/presets.py) less its slo filter.
PRESET_SCORERS = [{"name": "prefix", "weight": 2}, {"name": "free_blocks", "weight": 1}, {"name": "idle", "weight": 1}]
PROMPTS = {INTERACTIVE: "{index:07d} where is my order? " * 2,
           BATCH: "{index:07d} summarize this quarterly report section by section. " * 4}


@dataclass(frozen=True, slots=True)
class TenantSpec:
    name: str
    lane: str
    max_tokens: int

    @property
    def key(self) -> str:
        return f"sk-bench-{self.name}"


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    load: float  # offered generated tokens over C
    interactive_share: float  # of C, offered by the interactive tenants together
    tenants: tuple[TenantSpec, ...]
    engines: tuple[tuple[str, ...], ...]  # each engine's flags
    configs: tuple[str, ...]  # those run unless --configs says otherwise
    # (on, off) seconds: the interactive lane offers its load in bursts (None: Poisson throughout)
    interactive_on_off: tuple[float, float] | None = None

    @property
    def cell(self) -> str:
        """``S1_L2``; another interactive share than the issue's 0.5 is named (``S1_L2_i0.8``), and so are
        interactive bursts (``S1_L2_b2-2``: on 2 s, off 2 s)."""
        share = "" if self.interactive_share == 0.5 else f"_i{self.interactive_share:g}"
        bursts = "" if self.interactive_on_off is None else "_b{:g}-{:g}".format(*self.interactive_on_off)
        return f"{self.name}_L{self.load:g}{share}{bursts}"

    def lane_share(self, lane: str) -> float:
        return self.interactive_share if lane == INTERACTIVE else self.load - self.interactive_share

    def rate(self, tenant: TenantSpec, capacity: float) -> float:
        """Requests per second ``tenant`` offers against ``capacity`` generated tokens per second."""
        peers = sum(t.lane == tenant.lane for t in self.tenants)
        return self.lane_share(tenant.lane) * capacity / tenant.max_tokens / peers


def engine_flags(num_blocks: int, small: bool = False) -> tuple[str, ...]:
    flags = ("--model", "tiny", "--device", "cpu", "--num-blocks", str(num_blocks))
    # bfloat16 on a CPU without bf16 instructions: 0.55x the other engine's tokens/s with both saturated at
    # once (1051 / 1922; narrower steps, --max-num-seqs 4-16, or pinning it to one core moved nothing past
    # this machine's noise: two engines share its 2 cores), with the same KV pool, so the replicas look
    # alike to every block-counting scorer and differ in speed only.
    return flags + (("--dtype", "bfloat16") if small else ())


def scenario(name: str, load: float, interactive_share: float = 0.5, num_blocks: int = 256,
             interactive_tokens: int = 32, batch_tokens: int = 256) -> Scenario:
    def group(prefix: str, lane: str, count: int, tokens: int) -> tuple[TenantSpec, ...]:
        return tuple(TenantSpec(f"{prefix}{i}" if count > 1 else prefix, lane, tokens) for i in range(count))

    if name == "S1":
        tenants = group("web", INTERACTIVE, 2, interactive_tokens) + group("batch", BATCH, 6, batch_tokens)
        return Scenario(name, load, interactive_share, tenants, (engine_flags(num_blocks),),
                        ("a", "b1", "b2", "b3", "fifo"))
    tenants = group("web", INTERACTIVE, 1, interactive_tokens) + group("batch", BATCH, 1, batch_tokens)
    if name == "S2":  # b3 is b1 here: one tenant of each lane, of equal weight, is already a 50% guarantee
        return Scenario(name, load, interactive_share, tenants, (engine_flags(num_blocks),), ("a", "b1", "b2", "fifo"))
    if name == "S3":
        engines = (engine_flags(num_blocks), engine_flags(num_blocks, small=True))
        return Scenario(name, load, interactive_share, tenants, engines, ("a", "a_nofilter", "b1"))
    raise ValueError(f"unknown scenario {name!r} (S1, S2, S3)")


def objective_s(lane: str, batch_ttft_s: float) -> float:
    return INTERACTIVE_TTFT_S if lane == INTERACTIVE else batch_ttft_s


def guard_config(sc: Scenario, config: str, engine_urls: list[str], batch_ttft_s: float, log: Path) -> dict:
    """The guard's configuration for ``config`` (see the module docstring), its decision log at ``log``."""
    lanes = {INTERACTIVE: {"priority": 1, "timeout": 10.0}, BATCH: {"priority": 4, "timeout": 300.0}}
    if config in ("a", "a_nofilter"):
        lanes[INTERACTIVE] |= {"slo": {"ttft_ms": 1e3 * INTERACTIVE_TTFT_S}, "priority_class": "critical"}
        lanes[BATCH] |= {"slo": {"ttft_ms": 1e3 * batch_ttft_s}, "priority_class": "sheddable"}
    if config == "b2":
        lanes[INTERACTIVE]["timeout"], lanes[BATCH]["timeout"] = INTERACTIVE_TTFT_S, batch_ttft_s
    interactive = [t for t in sc.tenants if t.lane == INTERACTIVE]
    batch_weight = sum(t.lane == BATCH for t in sc.tenants)
    tenants = [{"name": t.name, "api_keys": [t.key], "lane": t.lane, "max_queue": 256,
                "weight": batch_weight / len(interactive) if config == "b3" and t.lane == INTERACTIVE else 1}
               for t in sc.tenants]
    engines = [{"name": f"engine{i}", "url": url} for i, url in enumerate(engine_urls)]
    out = {"engines": engines, "secret": "bench-slo", "lanes": lanes, "tenants": tenants, "decision_log": str(log)}
    if config == "a_nofilter":
        out["routing"] = {"profile": {"filters": ["saturation", "overload"], "scorers": PRESET_SCORERS}}
    return out
