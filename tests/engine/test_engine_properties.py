"""Random interleavings of add / step / abort (with forks, shared prefixes, priorities, both preemption
modes, and run-ahead scheduling on or off) against the real engine: the block accounting invariants hold after every operation, and once every
request has ended, every block is free again."""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support.invariants import assert_all_blocks_back, check_block_accounting

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling_params import SamplingParams

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 9, 9], []]


class EngineMachine(RuleBasedStateMachine):
    @initialize(mode=st.sampled_from(["recompute", "swap"]), num_blocks=st.integers(10, 20),
                prefix_caching=st.booleans(), async_scheduling=st.booleans())
    def start(self, mode: str, num_blocks: int, prefix_caching: bool, async_scheduling: bool) -> None:
        self.core = EngineCore(EngineConfig(
            model="tiny", device="cpu", block_size=4, num_blocks=num_blocks, max_num_seqs=6,
            max_num_batched_tokens=24, preemption_mode=mode, swap_blocks=num_blocks // 2,
            enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling))
        self.live: list[str] = []

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 255), min_size=1, max_size=10),
          max_tokens=st.integers(1, 16), n=st.integers(1, 3), salt=st.sampled_from([None, "a", "b"]),
          priority=st.integers(0, 2), greedy=st.booleans())
    def add(self, prefix, tail, max_tokens, n, salt, priority, greedy) -> None:
        params = SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0 if greedy else 1.0, seed=1,
                                ignore_eos=True)
        request = self.core.make_request(prefix + tail, params, cache_salt=salt, priority=priority)
        self.core.add(request)
        self.live.append(request.request_id)

    @rule(steps=st.integers(1, 4))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            for out in self.core.step():
                assert all(t >= 0 for c in out.outputs for t in c.token_ids), "no PENDING token shows"
                if out.finished:
                    self.live.remove(out.request_id)
                    assert all(c.finish_reason == "length" for c in out.outputs)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data) -> None:
        request_id = data.draw(st.sampled_from(self.live))
        self.live.remove(request_id)
        out = self.core.abort(request_id)
        assert out is not None and out.finished
        assert all(t >= 0 for c in out.outputs for t in c.token_ids), "no PENDING token shows"

    @invariant()
    def blocks_accounted(self) -> None:
        if hasattr(self, "core"):
            check_block_accounting(self.core)

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        for _ in range(2000):
            if not self.core.has_unfinished:
                break
            self.core.step()
            check_block_accounting(self.core)
        assert not self.core.has_unfinished, "every request finishes"
        snap = self.core.telemetry()
        event(f"preempted by recompute: {snap.preemptions_recompute_total > 0}")
        event(f"preempted by swap: {snap.preemptions_swap_total > 0}")
        event(f"prefix cache hit: {snap.prefix_cache_hits_total > 0}")
        assert_all_blocks_back(self.core)


EngineMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestEngineProperties = EngineMachine.TestCase
