"""The KV pool of a live engine (``--from-engine URL``), so a plan can be checked against what runs.

The engine publishes its pool in blocks (``GET /telemetry``: ``num_blocks`` x ``block_size`` tokens) and its
dtype (``engine_info{dtype}`` on ``GET /metrics``), not its bytes per token: those come from the workload's
model, with the engine's dtype as a named model's element size. Planning then happens in the engine's own
currency: a sequence takes whole blocks, as the engine and the guard's reservations count it.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass

from pydantic import ValidationError

from engine.protocol import TelemetrySnapshot
from guard.plan.workload import PlanError

# Element sizes of the dtypes the engine can run (engine/config.py's DTYPES), as engine_info names them.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
_INFO = "engine_info{"


@dataclass(slots=True, frozen=True)
class EnginePool:
    """One engine's KV pool as it reported it: ``num_blocks`` blocks of ``block_size`` tokens each."""

    url: str
    model: str
    num_blocks: int
    block_size: int
    dtype: str | None  # None when /metrics does not say

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_bytes(self) -> int | None:
        return DTYPE_BYTES.get(self.dtype) if self.dtype else None


def read_engine(url: str, timeout: float = 5.0) -> EnginePool:
    """The pool of the engine at ``url``; a `PlanError` naming the URL when it cannot be read."""
    url = url.rstrip("/")
    try:
        snapshot = TelemetrySnapshot.model_validate_json(_get(url + "/telemetry", timeout))
    except ValidationError as exc:
        raise PlanError(f"{url}/telemetry: not a telemetry snapshot: {exc.errors()[0]['msg']}") from None
    if snapshot.num_blocks <= 0 or snapshot.block_size <= 0:
        raise PlanError(f"{url}/telemetry: the engine reports no KV pool ({snapshot.num_blocks} blocks of "
                        f"{snapshot.block_size} tokens)")
    return EnginePool(url, snapshot.model, snapshot.num_blocks, snapshot.block_size,
                      _dtype(_get(url + "/metrics", timeout).decode(errors="replace")))


def _get(url: str, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        raise PlanError(f"{url}: HTTP {exc.code} (is the engine still loading?)") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise PlanError(f"{url}: cannot be read: {reason}") from None


def _dtype(metrics: str) -> str | None:
    """The ``dtype`` label of ``engine_info``, e.g. ``engine_info{block_size="16",dtype="float32",...} 1``."""
    for line in metrics.splitlines():
        if line.startswith(_INFO) and 'dtype="' in line:
            return line.split('dtype="', 1)[1].split('"', 1)[0]
    return None
