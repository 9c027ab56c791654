"""Automatic prefix caching, scoped by cache salt (tenure)."""

from __future__ import annotations

from support.invariants import assert_all_blocks_back

from engine import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def test_same_prompt_and_salt_hits_the_cache_with_the_same_output(llm: LLM) -> None:
    first = llm.generate(PROMPT, GREEDY, cache_salt="tenant-a")[0]
    before = llm.telemetry()
    second = llm.generate(PROMPT, GREEDY, cache_salt="tenant-a")[0]
    after = llm.telemetry()
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens > 0
    assert second.num_cached_tokens % 16 == 0 and second.num_cached_tokens < len(second.prompt_token_ids)
    assert second.token_ids == first.token_ids and second.text == first.text
    assert after.prefix_cache_hits_total - before.prefix_cache_hits_total == second.num_cached_tokens
    assert after.prefix_cache_queries_total - before.prefix_cache_queries_total == len(second.prompt_token_ids)
    assert_all_blocks_back(llm.core)


def test_a_different_salt_never_shares_kv(llm: LLM) -> None:
    llm.generate(PROMPT, GREEDY, cache_salt="tenant-b")
    other = llm.generate(PROMPT, GREEDY, cache_salt="tenant-c")[0]
    unsalted = llm.generate(PROMPT, GREEDY)[0]
    again = llm.generate(PROMPT, GREEDY)[0]
    assert other.num_cached_tokens == 0
    assert unsalted.num_cached_tokens == 0
    assert again.num_cached_tokens > 0


def test_cached_blocks_are_reclaimable_and_reported(llm: LLM) -> None:
    llm.generate(PROMPT + "cache me", GREEDY, cache_salt="tenant-d")
    snap = llm.telemetry()
    assert snap.cached_blocks > 0
    assert snap.free_blocks + snap.cached_blocks == snap.num_blocks and snap.used_blocks == 0


def test_disabled_prefix_cache_never_hits() -> None:
    llm = LLM("tiny", device="cpu", num_blocks=64, enable_prefix_caching=False)
    llm.generate(PROMPT, GREEDY)
    second = llm.generate(PROMPT, GREEDY)[0]
    assert second.num_cached_tokens == 0 and llm.telemetry().cached_blocks == 0


def test_blocks_filled_while_decoding_are_published(llm: LLM) -> None:
    # 20 prompt tokens and 30 generated: 49 have KV (the last sampled token never ran), so blocks 0..2 are
    # full, two of them filled one decode step at a time. A prompt that continues the completion hits them all.
    prompt = [ord(c) for c in "published while decoding"[:20]]
    first = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
                         cache_salt="tenant-e")[0]
    second = llm.generate(prompt + first.token_ids[:29], GREEDY, cache_salt="tenant-e")[0]
    assert second.num_cached_tokens == 48
    llm.core.kv.check()
    assert_all_blocks_back(llm.core)
