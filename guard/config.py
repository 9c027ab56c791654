"""The guard's configuration: a YAML file validated by pydantic; unknown or duplicate keys are errors.

Every model forbids extra keys, so a typo (``safe_utilisation``) is reported by name instead of being
silently ignored. ``KVGUARD_SECRET`` in the environment overrides ``secret`` (keep it out of the file); the
placeholder ``change-me`` is refused, so no guard runs with cache salts anyone can compute.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PositiveSeconds = Annotated[float, Field(gt=0)]
PLACEHOLDER_SECRET = "change-me"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Listen(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)


def is_loopback(host: str) -> bool:
    """``host`` names only this machine: ``localhost`` or a loopback address (a wildcard such as ``0.0.0.0``
    or any other name may reach other machines' clients)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Admin(Strict):
    """The admin listener (guard/console): the live operator console at ``/`` and the state endpoints. On a
    loopback host it needs no key; bound anywhere else it needs ``api_keys``, which every request must then
    present (``Authorization: Bearer <key>``, or HTTP Basic with the key as password, as a browser sends it).
    Read at start-up only."""

    host: str = "127.0.0.1"
    port: int = Field(8001, ge=0, le=65535)
    api_keys: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _keyed_off_loopback(self) -> Admin:
        if not self.api_keys and not is_loopback(self.host):
            raise ValueError(f"admin.host {self.host!r} is not a loopback address, so the console needs a key: "
                             "set admin.api_keys (or bind admin.host to 127.0.0.1)")
        return self


class Backend(Strict):
    name: str = "primary"
    url: str = Field(pattern=r"^https?://")


class StaticFallback(Strict):
    name: str = "static"
    message: str


class Slo(Strict):
    """A lane's latency objective (guard/admission/slo.py): first token within ``ttft_ms`` of arrival, and
    ``tpot_ms`` per output token after it; either may be left out. Requests may tighten it, never loosen it."""

    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)


PriorityClass = Literal["critical", "standard", "sheddable"]


class Lane(Strict):
    """A class of work inside a tenant: lower ``priority`` is served first; ``timeout`` bounds queueing.
    ``priority_class`` orders lanes across tenants (critical first, then by fairness) and says what a lane
    may lose: a sheddable request that cannot meet its ``slo`` is refused at once, and its blocks are lent,
    so critical work reclaims them."""

    priority: int = 0
    timeout: PositiveSeconds = 30.0
    sheddable: bool = False  # in pressure mode, served by a fallback first
    on_degraded: Literal["fallback", "reject"] = "fallback"
    slo: Slo | None = None
    priority_class: PriorityClass = "standard"


class NamedObjective(Strict):
    """A tenant's named objective, selected per request by ``x-gateway-inference-objective: NAME``
    (guard/admission/classes.py): its class and its latency objective, in place of the lane's. Set by the
    operator, so its class need not be in the tenant's ``priority_classes``."""

    priority_class: PriorityClass
    slo: Slo | None = None


DEFAULT_LANES = {
    "realtime": Lane(priority=0, timeout=2.0),
    "interactive": Lane(priority=1, timeout=10.0),
    "agent": Lane(priority=2, timeout=30.0),
    "document": Lane(priority=3, timeout=60.0, sheddable=True),
    "batch": Lane(priority=4, timeout=300.0, sheddable=True),
}


class Tenant(Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    api_keys: list[str] = Field(default_factory=list)
    api_key_sha256: list[str] = Field(default_factory=list)  # hex digests, so keys need not be stored
    weight: float = Field(1.0, gt=0)
    lane: str = "interactive"
    max_queue: int = Field(64, ge=0)
    max_blocks_share: float = Field(1.0, gt=0, le=1.0)  # cap on the tenant's share of the admission budget
    # Requests and tokens (prompt + max output) per minute, charged at admission (guard/admission/limits.py).
    rpm: int | None = Field(None, gt=0)
    tpm: int | None = Field(None, gt=0)
    # The models (base ids and LoRA adapter names) the tenant may use; None: every model. Any other answers
    # 404 model_not_found exactly as an unknown model does (guard/http/models.py).
    models: list[Annotated[str, Field(min_length=1)]] | None = None
    # The classes its requests may pick with X-Priority-Class (guard/admission/classes.py); None: its lane's
    # class only.
    priority_classes: list[PriorityClass] | None = None
    objectives: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:/-]+$")], NamedObjective] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _has_a_key(self) -> Tenant:
        if not self.api_keys and not self.api_key_sha256:
            raise ValueError(f"tenant {self.name!r} has neither api_keys nor api_key_sha256")
        for digest in self.api_key_sha256:
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
                raise ValueError(f"tenant {self.name!r}: api_key_sha256 entries must be 64 hex digits")
        return self

    def key_digests(self) -> list[bytes]:
        return [hashlib.sha256(k.encode()).digest() for k in self.api_keys] + [
            bytes.fromhex(d) for d in self.api_key_sha256
        ]


class Admission(Strict):
    safe_utilization: float = Field(0.85, gt=0, le=1.0)  # commit while used + reserved <= this * num_blocks
    resume_utilization: float | None = Field(None, gt=0, le=1.0)  # hysteresis: reopen below this
    # The engine is down when its telemetry stream says nothing (no snapshot, no busy heartbeat) for this long,
    # and its numbers count as a full pool when no snapshot (or busy heartbeat vouching for it) is this recent.
    telemetry_stale_s: PositiveSeconds = 2.0
    # A step that has run longer than this (as the engine's busy heartbeats say) is hung: the engine is down.
    # Far above any real step (a long CPU prefill takes seconds), far below a client's patience.
    step_hang_s: PositiveSeconds = 60.0

    @model_validator(mode="after")
    def _ordered(self) -> Admission:
        if self.resume_utilization is not None and self.resume_utilization > self.safe_utilization:
            raise ValueError("resume_utilization must not exceed safe_utilization")
        return self

    @property
    def resume(self) -> float:
        return self.resume_utilization if self.resume_utilization is not None else self.safe_utilization * 0.9


class Upstream(Strict):
    connect_timeout: PositiveSeconds = 2.0
    first_token_timeout: PositiveSeconds = 60.0  # no byte from the engine for this long: 504
    idle_timeout: PositiveSeconds = 60.0  # between two reads of a running stream (never a total timeout)
    # A non-streamed answer arrives whole when its generation ends, so its first byte comes that late: it is
    # bounded by this instead of first_token_timeout.
    unary_timeout: PositiveSeconds = 600.0
    client_stall_timeout: PositiveSeconds = 30.0  # a client that reads nothing for this long is dropped


class Migration(Strict):
    """Requests moved off a replica that dies, goes silent or drains (guard/http/migrate.py)."""

    max_migrations: int = Field(2, ge=0)  # moves per request; one more failure ends it with an error
    # A replica is silent when neither its telemetry nor any of its answers in flight said anything for
    # max(silence_floor_s, silence_steps x its step time): past an idle engine's telemetry refresh (1 s).
    silence_floor_s: PositiveSeconds = 3.0
    silence_steps: float = Field(50.0, gt=0)


class PluginRef(Strict):
    """A scorer of a scheduling profile and its weight."""

    name: str
    weight: float = Field(1.0, ge=0, allow_inf_nan=False)


class PluginSpec(Strict):
    """A named instance of a scheduling plugin, as llm-d's EndpointPickerConfig declares them: ``type`` is the
    registered plugin, ``parameters`` its settings (a filter's threshold...), ``name`` what profiles and
    decision records call it (default: the type). One type may run as several named instances."""

    type: str
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$")
    parameters: dict[str, Any] = Field(default_factory=dict)

    @property
    def instance(self) -> str:
        return self.name or self.type


class SchedulingProfile(Strict):
    """Replica choice as plugins (guard/pool/scheduling/): each name is a plugin instance of
    ``routing.plugins``, or a registered plugin type with its default parameters; checked where they are
    registered (guard/pool/scheduling/presets.py ``profile_for``), when the guard starts."""

    filters: list[str] = []
    scorers: list[PluginRef] = []
    picker: str = "max_score"


class NamedProfile(SchedulingProfile):
    name: str = Field(min_length=1)


class ProfileRule(Strict):
    """Which profile ranks a request: the first rule whose ``model`` (the model id it asks for) and
    ``objective`` (the named objective it chose) both match, of those it gives."""

    profile: str
    model: str | None = None
    objective: str | None = None

    @model_validator(mode="after")
    def _matches_something(self) -> ProfileRule:
        if self.model is None and self.objective is None:
            raise ValueError("a routing.select rule needs a model or an objective to match")
        return self


class Routing(Strict):
    """Replica choice, a ``policy`` preset or a ``profile`` of plugins (guard/pool/scheduling/; a profile is
    used instead of the preset, and naming another preset than the default beside it is an error), and the mode
    thresholds on saturation = (committed + queued blocks) / the blocks of the replicas that are up
    (guard/pool/routing.py)."""

    policy: Literal["kvguard", "round_robin", "least_loaded", "prefix"] = "kvguard"
    profile: SchedulingProfile | None = None  # the default profile (absent: the policy's preset)
    plugins: list[PluginSpec] = []  # named plugin instances with parameters, for the profiles to name
    profiles: list[NamedProfile] = []  # more profiles, chosen per request by ``select``
    select: list[ProfileRule] = []  # first match wins; no match: the default profile
    pressure_enter: float = Field(0.9, gt=0)
    pressure_exit: float = Field(0.7, gt=0)
    degraded_enter: float = Field(1.5, gt=0)
    degraded_exit: float = Field(1.1, gt=0)
    min_dwell_s: float = Field(5.0, ge=0)
    failure_threshold: int = Field(3, ge=1)  # consecutive upstream failures that open a backend's circuit
    cooldown_s: PositiveSeconds = 2.0  # open circuit: wait this long before a trial request
    health_interval_s: PositiveSeconds = 0.5

    @model_validator(mode="after")
    def _ordered(self) -> Routing:
        if self.profile is not None and self.policy != "kvguard":
            raise ValueError(f"routing.policy {self.policy!r} (a preset) and routing.profile: give one of them "
                             "(a profile replaces the default preset, kvguard, alone)")
        for what, names in (("routing.plugins", [p.instance for p in self.plugins]),
                            ("routing.profiles", [p.name for p in self.profiles])):
            if len(set(names)) < len(names):
                raise ValueError(f"{what}: a name is given twice ({', '.join(sorted(names))})")
        known = {p.name for p in self.profiles}
        for i, rule in enumerate(self.select):
            if rule.profile not in known:
                raise ValueError(f"routing.select[{i}].profile: no profile named {rule.profile!r} in routing.profiles")
        if not self.pressure_exit < self.pressure_enter <= self.degraded_exit < self.degraded_enter:
            raise ValueError("need pressure_exit < pressure_enter <= degraded_exit < degraded_enter")
        return self


class Limits(Strict):
    max_body_bytes: int = Field(1 << 20, gt=0)
    shutdown_timeout: PositiveSeconds = 10.0


class Connections(Strict):
    """Client connections (guard/wire/connections.py): how long the guard waits for each part of a request,
    how long an idle keep-alive connection stays, how many connections it holds. Read at start-up only."""

    # From accept, or from the first byte of a keep-alive connection's next request, to the end of the
    # headers; bytes do not extend it (a slowloris dribbles them). Clients send their headers in one write:
    # 10 s covers a lossy link's retransmissions (1 + 2 + 4 s) and is what Go servers commonly set.
    header_timeout_s: PositiveSeconds = 10.0
    # The body may pause at most this long between two reads, and must average body_min_rate beyond a first
    # allowance of this long: a body of which nothing more comes is cut 20 s after the last byte, within the
    # 30 s the issue asks for (Apache's mod_reqtimeout defaults: body=20, MinRate=500).
    body_timeout_s: PositiveSeconds = 20.0
    body_min_rate: float = Field(500.0, gt=0)  # bytes per second: a 1 MiB body may take 35 minutes
    # nginx's default; longer than the idle timeouts of client pools and of load balancers (60 s on AWS), so
    # that they, not the guard, close an idle connection and never send a request into one the guard closes.
    keepalive_timeout_s: PositiveSeconds = 75.0
    # None: from RLIMIT_NOFILE, (soft limit - 256) / 2, at most 10,000 (each client connection may hold one to
    # an engine); a larger value is lowered to that, so the guard never runs out of descriptors itself.
    max_connections: int | None = Field(None, gt=0)


class SharedState(Strict):
    """Where several guard processes keep what must be one (guard/state/): Redis, at ``redis_url``."""

    redis_url: str = Field(pattern=r"^(redis|rediss|unix)://")
    # A guard renews its lease (and so everything it reserved) every lease_ttl_s / 5; one that dies loses
    # its reservations this long after its last renewal.
    lease_ttl_s: float = Field(10.0, ge=2.0, le=15.0)
    # The deadline of one Redis round trip (each admission decision is one): a Redis that takes longer, slow
    # or gone, counts as down and the guard admits on its own, conservatively, so no request waits longer.
    timeout_s: PositiveSeconds = 0.25


class Batch(Strict):
    """The Batch API (guard/batch/): ``/v1/files`` and ``/v1/batches``, served only when configured. Batches,
    files and results live under ``store`` (SQLite in WAL mode and files), or in Redis with ``shared_state``.
    The limits are OpenAI's by default."""

    store: Path
    max_file_bytes: int = Field(200 * 1024 * 1024, gt=0)
    max_lines: int = Field(50_000, gt=0)
    max_in_flight: int = Field(64, gt=0)  # a guard's batch lines running at once, at most (all batches)
    # The most a guard's batch lines may lengthen a replica's decode step, as a ratio to the step without
    # them (1.2: by 20 %), from the step the guard fits against the batch size (guard/pool/latency.py); unset,
    # the KV budget alone paces the batch. Where a step grows with every sequence in it (a CPU engine), an
    # interactive request's TTFT grows with it, and this is what holds it (guard/batch/pace.py).
    max_slowdown: float | None = Field(None, gt=1.0)
    # A guard holds each batch it runs under a lease it renews every lease_ttl_s / 3; once it lapses (the
    # guard died) another guard, or this one restarted, takes the batch over.
    lease_ttl_s: PositiveSeconds = 10.0


class Autoscaling(Strict):
    """The autoscaling signals on /metrics, ``guard_desired_replicas{pool}`` and ``guard_saturation{pool}``
    (guard/plan/live.py says how they are computed; docs/kubernetes.md how to read them). Read at start-up."""

    pool: str = Field("default", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")  # the series' ``pool`` label
    interval_s: PositiveSeconds = 1.0  # how often the pool is read and the signals updated
    window_s: PositiveSeconds = 30.0  # arrival rate, service time and request size are measured over this
    scale_down_delay_s: float = Field(300.0, ge=0)  # the desired count falls to the highest of this long
    min_replicas: int = Field(1, ge=1)
    max_replicas: int | None = Field(None, ge=1)
    # The queueing wait the count is planned for: this share of the tightest TTFT objective of the lanes the
    # tenants use (the rest is the engine's own prefill), or max_wait_s when none of them has one.
    wait_share: float = Field(0.5, gt=0, le=1)
    max_wait_s: PositiveSeconds = 1.0

    @model_validator(mode="after")
    def _ordered(self) -> Autoscaling:
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError("autoscaling.max_replicas must be at least min_replicas")
        if self.window_s < self.interval_s:
            raise ValueError("autoscaling.window_s must be at least interval_s")
        return self


class GuardConfig(Strict):
    listen: Listen = Listen()
    engine: Backend | None = None  # a pool of one, as before pools existed
    engines: list[Backend] = Field(default_factory=list)  # a pool of replicas serving the same model
    fallbacks: list[Backend | StaticFallback] = Field(default_factory=list)
    admission: Admission = Admission()
    upstream: Upstream = Upstream()
    migration: Migration = Migration()
    routing: Routing = Routing()
    limits: Limits = Limits()
    connections: Connections = Connections()
    admin: Admin | None = None  # no admin listener unless configured
    shared_state: SharedState | None = None  # None: fairness, budget, limits and verdicts live in the process
    autoscaling: Autoscaling = Autoscaling()
    batch: Batch | None = None  # None: no Batch API (guard/batch/)
    lanes: dict[str, Lane] = Field(default_factory=lambda: dict(DEFAULT_LANES))
    tenants: list[Tenant] = Field(min_length=1)
    decision_log: Path | None = None  # each request's decision record as a JSON line (guard/records/log.py)
    # HMAC key for per-tenant cache salts. The default is validated too: it is the placeholder, refused below.
    secret: str = Field(PLACEHOLDER_SECRET, min_length=1, validate_default=True)

    @property
    def pool(self) -> list[Backend]:
        """The engine replicas, in config order (``engine:`` is a pool of one)."""
        return [self.engine] if self.engine is not None else self.engines

    @field_validator("secret")
    @classmethod
    def _not_the_placeholder(cls, secret: str) -> str:
        if secret == PLACEHOLDER_SECRET:
            raise ValueError(f"still the placeholder {PLACEHOLDER_SECRET!r}: set KVGUARD_SECRET in the environment "
                             "to a long random string (e.g. `openssl rand -hex 32`), the key of the tenants' "
                             "cache salts")
        return secret

    @field_validator("decision_log")
    @classmethod
    def _writable(cls, path: Path | None) -> Path | None:
        if path is not None and (path.is_dir() or not path.parent.is_dir()):
            raise ValueError(f"{str(path)!r} must be a file in an existing directory")
        return path

    @model_validator(mode="after")
    def _consistent(self) -> GuardConfig:
        if (self.engine is None) == (not self.engines):
            raise ValueError("give either engine (one replica) or engines (a list of replicas), not both or neither")
        names = [t.name for t in self.tenants]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"duplicate tenant name(s): {', '.join(dup)}")
        digests = [d for t in self.tenants for d in t.key_digests()]
        if len(digests) != len(set(digests)):
            raise ValueError("an API key is listed more than once")
        if (admin := self.admin) is not None:
            if {hashlib.sha256(key.encode()).digest() for key in admin.api_keys} & set(digests):
                raise ValueError("admin.api_keys: an admin key must not also be a tenant's API key")
            if admin.port and (admin.host, admin.port) == (self.listen.host, self.listen.port):
                raise ValueError("admin.port: the admin listener needs an address of its own, not listen's")
        for tenant in self.tenants:
            if tenant.lane not in self.lanes:
                raise ValueError(f"tenant {tenant.name!r}: unknown lane {tenant.lane!r} (lanes: {sorted(self.lanes)})")
        backends = [b.name for b in self.pool] + [f.name for f in self.fallbacks]
        if dup := sorted({n for n in backends if backends.count(n) > 1}):
            raise ValueError(f"engine and fallback names must be unique (give each replica a name): {', '.join(dup)}")
        return self


def config_hash(config: GuardConfig) -> str:
    """Which configuration runs, as ``guard_config_info{hash}`` shows it: the first 12 hex digits of the
    SHA-256 of the normalized config (every key, defaults included, in the models' order, so layout, comments
    and spelled-out defaults do not change it). The secret is left out: the hash is public."""
    return hashlib.sha256(config.model_dump_json(exclude={"secret"}).encode()).hexdigest()[:12]


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the file and the offending key."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that rejects a mapping with the same key twice (PyYAML keeps the last silently)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(f"duplicate key {key!r} at line {key_node.start_mark.line + 1}")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_config(path: str | Path) -> GuardConfig:
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    if secret := os.environ.get("KVGUARD_SECRET"):
        raw["secret"] = secret
    try:
        return GuardConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {format_validation_error(exc)}") from None


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem, each naming the key path: ``tenants.0.weight: Input should be greater than 0``."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = f"unknown key {err['loc'][-1]!r}"
        lines.append(f"{where}: {message}")
    return "; ".join(lines)
