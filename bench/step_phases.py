"""Where a live engine's step time goes, phase by phase: ``StepPhases`` times every ``EngineCore.step``.

It wraps the engine's own functions on a live core (``LLM(...).core`` or an ``EngineCore``) until ``detach``;
each phase is the wall time spent in the functions it names:

- schedule: ``Scheduler.schedule`` (the running queue, block allocation, the step's chunks);
- inputs: ``HostBatch.build`` and ``HostBatch.to_device`` (the host batch and the model's input tensors; on a
  GPU the pinned host-to-device copy is queued here, not waited for);
- model: the model's ``forward`` (or, on CUDA, ``DecodeGraphs.run``: a graph replay) and ``compute_logits``;
- sample: ``engine.worker.runner.sample`` and ``StepResult.sampled`` (sampling, then reading the tokens back);
- commit: ``Scheduler.advance`` and ``Scheduler.settle``, the two halves of a step's commit (tokens appended,
  stops checked, prefix blocks published);
- outputs: ``EngineCore.report`` (one ``RequestOutput`` per request reported, timed as one call a step:
  timing each request's output cost the wrapper's own work, ~0.5 us a sequence, which showed as host work);
- rest: the step's wall time less the phases above (block copies, telemetry, the step's own code).

On a GPU nothing in "model" waits for the device: it is the time to launch the kernels (or to replay a graph),
not their device time. Reading the tokens back in "sample" is the step's one synchronisation (the engine
reads nothing else back in a step; an op that did would move that wait into its own phase), so "sample"
holds the wait for every kernel the step queued that the host's own work did not hide. Host work per step is
therefore every phase but "model" and "sample" (``HOST_PHASES``); on a CPU, where the model runs inside
"model", "sample" is host work too.

Invariants: a step's phases sum to its wall time ("rest" takes the difference); a timed call nested in
another (a graph capture's forward inside ``DecodeGraphs.run``) counts once, in the outer one; a row is
recorded for every step that reported itself to the engine's stats (``EngineStats.on_step``) and for no
other, in order, so row ``i`` is the step of the ``i``-th ``on_step`` since ``StepPhases`` was made.
Where the engine schedules a steady decode's next step before this one's tokens are read back (its
``async_scheduling``), a step's row holds the next step's schedule, inputs and launches and this step's
wait and commit: the host's work per step, as the device sees it.

``HostBatch``, ``StepResult`` and the runner's ``sample`` are patched where every engine of the process sees
them: one ``StepPhases`` at a time per process. The names wrapped are the engine's; one renamed there
fails here at once, with an AttributeError in the benchmarks' smoke tests, rather than leaving a phase
silently empty on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import engine.worker.runner as runner_module
from engine.core import EngineCore

PHASES = ("schedule", "inputs", "model", "sample", "commit", "outputs", "rest")
HOST_PHASES = tuple(p for p in PHASES if p not in ("model", "sample"))
# The columns of ``format_phases``' rows.
PHASES_HEADER = f"{'model':<20}{'steps':<20}{'count':>6}{'step':>9}{'host':>9}" + "".join(f"{p:>9}" for p in PHASES)
_ABSENT = object()  # the owner held nothing under the name itself (an instance inherits it from its class)


class StepPhases:
    """Per-step phase timings of one engine core, in seconds: ``rows[i][j]`` is step ``i``'s ``PHASES[j]``."""

    def __init__(self, core: EngineCore) -> None:
        self.rows: list[tuple[float, ...]] = []
        self._spent = [0.0] * (len(PHASES) - 1)  # the current step's timed phases ("rest" is derived)
        self._inside = [False]  # a timed call is running: a nested one is the outer one's time
        self._ran = [False]  # the current step reported itself to the engine's stats: it did work
        self._patched: list[tuple[object, str, object]] = []
        runner, scheduler, host_batch = core.runner, core.scheduler, runner_module.HostBatch
        targets = [(scheduler, "schedule", "schedule"), (host_batch, "build", "inputs"),
                   (host_batch, "to_device", "inputs"), (runner.model, "forward", "model"),
                   (runner.model, "compute_logits", "model"), (runner_module, "sample", "sample"),
                   (runner_module.StepResult, "sampled", "sample"), (scheduler, "advance", "commit"),
                   (scheduler, "settle", "commit"), (core, "report", "outputs")]
        if runner.graphs is not None:  # CUDA: a decode step replays a graph instead of calling forward
            targets.append((runner.graphs, "run", "model"))
        for owner, name, phase in targets:
            self._patch(owner, name, self._timed(PHASES.index(phase), getattr(owner, name)))
        self._patch(core.stats, "on_step", self._marked(core.stats.on_step))
        self._patch(core, "step", self._timed_step(core.step))

    def detach(self) -> None:
        """Put back every function wrapped; ``rows`` stay."""
        for owner, name, original in reversed(self._patched):
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._patched.clear()

    def _patch(self, owner: object, name: str, wrapper: Callable) -> None:
        self._patched.append((owner, name, vars(owner).get(name, _ABSENT)))
        setattr(owner, name, wrapper)

    def _timed(self, index: int, fn: Callable) -> Callable:
        spent, inside, clock = self._spent, self._inside, time.perf_counter

        def timed(*args, **kwargs):
            if inside[0]:
                return fn(*args, **kwargs)
            inside[0] = True
            started = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[index] += clock() - started
                inside[0] = False

        return timed

    def _marked(self, on_step: Callable) -> Callable:
        ran = self._ran

        def marked(*args, **kwargs):
            ran[0] = True
            return on_step(*args, **kwargs)

        return marked

    def _timed_step(self, step: Callable) -> Callable:
        spent, ran, rows, clock = self._spent, self._ran, self.rows, time.perf_counter
        zeros = [0.0] * len(spent)

        def timed_step(*args, **kwargs):
            spent[:] = zeros  # calls outside a step (an abort's output) are not its time
            ran[0] = False
            started = clock()
            try:
                return step(*args, **kwargs)
            finally:
                wall = clock() - started
                if ran[0]:  # an idle step returns before reporting itself: nothing ran
                    rows.append((*spent, wall - sum(spent)))

        return timed_step


def summarize(rows: Sequence[Sequence[float]]) -> dict | None:
    """Mean milliseconds per step over ``rows`` (``StepPhases.rows`` or a selection of them), or None if none:
    ``steps``, ``step_ms`` (the wall time), ``host_ms`` (``HOST_PHASES``), ``model_ms``, ``sample_ms`` and
    ``phases_ms`` (every phase; they sum to ``step_ms``)."""
    if not rows:
        return None
    phases = {name: sum(column) / len(rows) * 1e3 for name, column in zip(PHASES, zip(*rows), strict=True)}
    return {"steps": len(rows), "step_ms": sum(phases.values()), "host_ms": sum(phases[p] for p in HOST_PHASES),
            "model_ms": phases["model"], "sample_ms": phases["sample"], "phases_ms": phases}


def format_phases(label: str, summaries: dict[str, dict | None]) -> list[str]:
    """Table rows, one per group of steps that has any: ``label``, the group's name, its steps, then its mean
    ms per step: the wall time, host work, and every phase (``PHASES_HEADER`` names the columns)."""
    rows = []
    for group, summary in summaries.items():
        if summary is not None:
            phases = "".join(f"{summary['phases_ms'][p]:>9.3f}" for p in PHASES)
            rows.append(f"{label:<20}{group:<20}{summary['steps']:>6}{summary['step_ms']:>9.3f}"
                        f"{summary['host_ms']:>9.3f}{phases}")
    return rows
