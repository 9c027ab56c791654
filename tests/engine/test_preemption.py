"""Preemption (by recompute and by swap) must not change what a request generates."""

from __future__ import annotations

import pytest
from support.invariants import assert_all_blocks_back

from engine import LLM, SamplingParams

PROMPTS = [f"Request {i}: " + "abcdefghij"[: i + 1] * (i % 3 + 1) for i in range(10)]


def run(**options: object) -> tuple[list[list[int]], LLM]:
    llm = LLM("tiny", device="cpu", block_size=8, max_num_batched_tokens=64, **options)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True, n=2)]
    outputs = llm.generate(PROMPTS, [params[i % 2] for i in range(len(PROMPTS))])
    return [[c.token_ids for c in out.outputs] for out in outputs], llm


@pytest.fixture(scope="module")
def reference() -> list[list[list[int]]]:
    tokens, llm = run(num_blocks=1024)
    assert llm.telemetry().preemptions_total == 0
    return tokens


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_recompute_preemption_keeps_outputs(reference: list, prefix_caching: bool) -> None:
    tokens, llm = run(num_blocks=14, enable_prefix_caching=prefix_caching)
    snap = llm.telemetry()
    assert snap.preemptions_recompute_total >= 10, snap
    assert snap.preemptions_swap_total == 0
    assert tokens == reference
    assert_all_blocks_back(llm.core)


def test_swap_preemption_keeps_outputs(reference: list) -> None:
    tokens, llm = run(num_blocks=14, preemption_mode="swap", swap_blocks=64)
    snap = llm.telemetry()
    assert snap.preemptions_swap_total >= 10, snap
    assert llm.core.stats.swap_bytes["out"] > 0 and llm.core.stats.swap_bytes["in"] > 0
    assert tokens == reference
    assert_all_blocks_back(llm.core)


def test_swap_falls_back_to_recompute_when_host_space_is_full(reference: list) -> None:
    tokens, llm = run(num_blocks=14, preemption_mode="swap", swap_blocks=4)
    snap = llm.telemetry()
    assert snap.preemptions_swap_total > 0 and snap.preemptions_recompute_total > 0, snap
    assert tokens == reference
    assert_all_blocks_back(llm.core)


def test_lower_priority_is_preempted_first() -> None:
    llm = LLM("tiny", device="cpu", block_size=8, num_blocks=12, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm.generate(["urgent: abc", "routine: xyz"], params, priority=[0, 5], tenant=["vip", "batch"])
    tenants = llm.telemetry().tenants
    assert tenants["batch"].preemptions_total > 0
    assert tenants["vip"].preemptions_total == 0
