"""Sampling, stop conditions, n > 1 and per-tenant telemetry through the real engine."""

from __future__ import annotations

import torch
from support.invariants import assert_all_blocks_back

from engine import LLM, SamplingParams
from engine.worker.sampler import sample


def test_greedy_is_deterministic_and_prompts_differ(llm: LLM) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    a, b = llm.generate(["alpha", "omega"], params)
    assert a.token_ids == llm.generate("alpha", params)[0].token_ids
    assert a.token_ids != b.token_ids
    assert len(a.token_ids) == 16 and a.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    first = llm.generate("sample me", seeded)[0].token_ids
    assert llm.generate(["other", "sample me"], seeded)[1].token_ids == first
    assert llm.generate("sample me", SamplingParams(max_tokens=16, seed=4, ignore_eos=True))[0].token_ids != first
    greedy = llm.generate("sample me", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    top1 = llm.generate("sample me", SamplingParams(max_tokens=16, temperature=2.0, top_k=1, ignore_eos=True))[0]
    tiny_p = llm.generate("sample me", SamplingParams(max_tokens=16, top_p=1e-6, ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids == tiny_p.token_ids


def test_sampler_draws_from_the_filtered_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    draws = sample(logits, [SamplingParams(seed=0)] * 4000, [gen] * 4000)
    freq = torch.bincount(draws, minlength=4).float() / 4000
    # 3.8 binomial standard deviations at p = 0.5, n = 4000: holds for any CPU's draws (torch's sampler
    # vectorizes by CPU capability) with probability > 0.999.
    assert torch.allclose(freq, probs, atol=0.03), freq
    nucleus = sample(logits[:2000], [SamplingParams(top_p=0.75)] * 2000, [None] * 2000)
    assert set(nucleus.tolist()) == {0, 1}, "top_p=0.75 keeps the two tokens whose mass reaches 0.75"
    top2 = sample(logits[:2000], [SamplingParams(top_k=2)] * 2000, [None] * 2000)
    assert set(top2.tolist()) == {0, 1}


def test_stop_string_cuts_the_text(llm: LLM) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full = llm.generate("stop here", params)[0]
    text = full.text
    # Pick a stop string from the middle of the output whose first occurrence is where we found it.
    start = next(i for i in range(5, len(text) - 3) if text.find(text[i : i + 3]) == i and text[i : i + 3].isprintable())
    stop = text[start : start + 3]
    stopped = llm.generate("stop here", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                        stop=["never-appears", stop]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:start]
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert_all_blocks_back(llm.core)


def test_stop_token_and_eos(llm: LLM) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    full = llm.generate("tokens", params)[0].token_ids
    stopped = llm.generate("tokens", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                     stop_token_ids=[full[5]]))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == full[: full.index(full[5]) + 1]


def test_n_completions_share_the_prompt_and_follow_their_own_seeds(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=3)
    out = llm.generate("fork", greedy)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == out.outputs[2].token_ids
    sampled = llm.generate("fork", SamplingParams(max_tokens=12, seed=5, ignore_eos=True, n=3))[0]
    seqs = {tuple(c.token_ids) for c in sampled.outputs}
    assert len(seqs) == 3
    assert sampled.outputs[0].token_ids == llm.generate("fork", SamplingParams(max_tokens=12, seed=5,
                                                                                ignore_eos=True))[0].token_ids
    assert_all_blocks_back(llm.core)


def test_telemetry_pairs_the_decode_step_with_its_batch() -> None:
    """``itl_batch`` is the mean batch of the decode steps ``itl_s`` averages (the prefill step, with no decode,
    counts in neither), where ``num_running`` is one instant's: 0 once everything has finished."""
    llm = LLM("tiny", device="cpu", num_blocks=128)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm.generate(["one", "two", "three"], params)  # a prefill step, then 4 decode steps of 3
    llm.generate("four", params)  # a prefill step, then 4 decode steps of 1
    snap = llm.telemetry()
    assert snap.num_running == 0 and snap.itl_s > 0
    assert snap.itl_batch == (4 * 3 + 4 * 1) / 8


def test_telemetry_counts_per_tenant() -> None:
    llm = LLM("tiny", device="cpu", num_blocks=128)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm.generate(["one", "two"], params, tenant="acme")
    llm.generate("three", params, tenant="bulk")
    snap = llm.telemetry()
    assert snap.tenants["acme"].generation_tokens_total == 10
    assert snap.tenants["acme"].prompt_tokens_total == 6
    assert snap.tenants["bulk"].generation_tokens_total == 5
    assert snap.generation_tokens_total == 15 and snap.prompt_tokens_total == 11
    assert snap.step > 0 and snap.tokens_per_s > 0 and snap.bandwidth_utilization > 0
    assert snap.tenants["acme"].blocks == 0 and snap.tenants["acme"].running == 0
