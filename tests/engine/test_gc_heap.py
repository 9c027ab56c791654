"""The engine's startup heap is out of the garbage collector's sight (engine/gc_heap.py): a full collection
during serving walks what serving allocated, not the model, torch and triton."""

from __future__ import annotations

import gc

from engine import LLM, SamplingParams


def test_a_built_engine_is_frozen_and_what_it_allocates_later_is_collected() -> None:
    llm = LLM("tiny", device="cpu", num_blocks=64)
    tracked = {id(obj) for obj in gc.get_objects()}  # generations 0-2: what a full collection walks
    core = llm.core
    for part in (core, core.scheduler, core.kv, core.runner, core.loaded.model, *core.loaded.model.modules()):
        assert id(part) not in tracked, f"{type(part).__name__} is still walked by every full collection"
    (output,) = llm.generate([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    assert gc.is_tracked(output) and id(output) in {id(obj) for obj in gc.get_objects()}
