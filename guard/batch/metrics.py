"""The Batch API's series, on the guard's own registry (guard/metrics.py's ``GuardMetrics.registry``):

- ``guard_batch_requests_total{tenant,status}``: batch lines by how their run ended: ``completed`` (an
  output line), ``failed`` (an error line), ``retried`` (not the line's answer: it runs again);
- ``guard_batches{status}``: batches by status, over the whole store (every guard's, with shared state);
- ``guard_batch_lines_pending{tenant}``: lines not yet done of the batches this guard runs now.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from guard.metrics import GuardMetrics

STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelled")


class BatchMetrics:
    def __init__(self, metrics: GuardMetrics) -> None:
        registry = metrics.registry
        self.lines = Counter("guard_batch_requests", "Batch lines run, by how the run ended",
                             ["tenant", "status"], registry=registry)
        self.batches = Gauge("guard_batches", "Batches by status", ["status"], registry=registry)
        self.pending = Gauge("guard_batch_lines_pending", "Lines not yet done of the batches this guard runs",
                             ["tenant"], registry=registry)
        for status in STATUSES:
            self.batches.labels(status).set(0)

    def show_statuses(self, counts: dict[str, int]) -> None:
        for status in STATUSES:
            self.batches.labels(status).set(counts.get(status, 0))

    def show_pending(self, by_tenant: dict[str, int]) -> None:
        self.pending.clear()
        for tenant, lines in by_tenant.items():
            self.pending.labels(tenant).set(lines)
