"""How many tokens a request that sets no ``max_tokens`` will generate: the output part of its reservation.

Clients leave ``max_tokens`` out by default (the OpenAI SDKs, LangChain, litellm), and reserving all the
room the context window leaves would make every default chat hold hundreds of blocks it never uses: two of
them fill a pool. Instead the guard reserves a prediction from what such requests actually generated:

    predicted = min(room, ceil(PERCENTILE of recent outputs * (1 + PAD_SHARE)) + PAD_TOKENS)

from the tenant's own recent outputs once it has ``MIN_SAMPLES`` of them, else its lane's, else every
tenant's, else ``DEFAULT_TOKENS``. A request whose output passes its reservation asks to grow it while it
streams (guard/admission/dispatch.py ``grow``); one that cannot grow runs on past its reservation and the
engine, not the guard, then bounds it (it may preempt: bench/no_max_tokens.py measures how often).
Requests with ``max_tokens`` keep their exact reservation and do not feed the prediction: their length is
the client's choice, not the model's.
"""

from __future__ import annotations

import math
from collections import deque

# A high quantile, not the top: a stream that outgrows its reservation grows it, and the engine keeps
# 1 - safe_utilization of its pool in reserve for the rest. Reserving near the top (p95 x 1.25) held 3.5x
# the blocks the answers used, halving how many ran at once (bench/no_max_tokens.py).
PERCENTILE = 0.75
PAD_SHARE = 0.10
PAD_TOKENS = 16
MIN_SAMPLES = 8
HISTORY = 256  # outputs kept per tenant, per lane and overall: the recent past, not all of it
DEFAULT_TOKENS = 512  # before any output was seen: a long chat answer


class OutputPredictor:
    def __init__(self) -> None:
        self._by_tenant: dict[str, deque[int]] = {}
        self._by_lane: dict[str, deque[int]] = {}
        self._all: deque[int] = deque(maxlen=HISTORY)

    def record(self, tenant: str, lane: str, output_tokens: int) -> None:
        """One sequence of a request without ``max_tokens`` ended after ``output_tokens`` tokens."""
        for history in (self._by_tenant.setdefault(tenant, deque(maxlen=HISTORY)),
                        self._by_lane.setdefault(lane, deque(maxlen=HISTORY)), self._all):
            history.append(output_tokens)

    def predict(self, tenant: str, lane: str, room: int) -> int:
        """The output tokens to reserve for one sequence, at most ``room`` (what the context leaves)."""
        for history in (self._by_tenant.get(tenant), self._by_lane.get(lane), self._all):
            if history is not None and len(history) >= MIN_SAMPLES:
                high = sorted(history)[min(len(history) - 1, math.ceil(PERCENTILE * len(history)) - 1)]
                return max(1, min(room, math.ceil(high * (1 + PAD_SHARE)) + PAD_TOKENS))
        return max(1, min(room, DEFAULT_TOKENS))
