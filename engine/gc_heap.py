"""Keep Python's full garbage collections off the step loop's critical path.

A loaded engine's heap holds a few hundred thousand long-lived objects (torch, triton, the tokenizer, the
model's modules) that will never be garbage. Python's oldest-generation collection walks all of them: on a
2-core EPYC that is about 150 ms, once in ~150 steps at batch 256, and every stream sees it as one
long gap between tokens (docs/benchmarks.md, "the step loop's host work"). Freezing the heap once the
engine is built moves those objects out of the collector's sight; objects created later are collected as
usual.

Invariant: only objects alive at the freeze are exempt. Cyclic garbage among them (a discarded engine's,
in a process that builds several) is then reclaimed by reference counting alone, which frees everything
but cycles; a process that builds engines in a loop keeps a few thousand small objects per engine.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what is garbage now, then exempt every surviving object from future collections."""
    gc.collect()
    gc.freeze()
