"""The step contract: the scheduler's output alone tells the worker what to compute, and the scheduler's
``advance`` then ``settle`` commit the step (computed tokens, forks, appended tokens), as ``EngineCore.step``
does."""

from __future__ import annotations

from support.invariants import assert_all_blocks_back, check_block_accounting

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.protocol import TelemetrySnapshot
from engine.sampling_params import SamplingParams


def test_a_chunked_prefill_then_a_fork_through_the_step_contract() -> None:
    core = EngineCore(EngineConfig(model="tiny", device="cpu", block_size=4, num_blocks=32,
                                   max_num_batched_tokens=8))
    prompt = list(range(1, 11))
    core.add(core.make_request(prompt, SamplingParams(max_tokens=3, temperature=0.0, n=2)))

    out = core.scheduler.schedule()
    (seq,), (table,) = out.seqs, out.block_tables
    assert (out.token_ids, out.starts, out.num_samples) == (prompt[:8], [0], [0]), "8 of 10 prompt tokens fit"
    assert table == core.kv.block_ids(seq) and len(table) == 2
    assert out.sampling.rows == []
    result = core.runner.execute(out)
    assert result.sampled() == [] and result.num_tokens == 8
    core.scheduler.advance(out)
    assert core.scheduler.settle(out, result.sampled()) == []
    assert seq.num_computed_tokens == 8 and len(seq.token_ids) == 10
    check_block_accounting(core)

    out = core.scheduler.schedule()
    (table,) = out.block_tables
    assert (out.token_ids, out.starts, out.num_samples) == (prompt[8:], [8], [2]), "it samples, and forks one"
    assert table == core.kv.block_ids(seq) and len(table) == 3
    assert out.sampling.rows == [0, 0], "the prompt's last logits give both completions their first token"
    result = core.runner.execute(out)
    core.scheduler.advance(out)
    (request,) = core.scheduler.settle(out, result.sampled())
    parent, child = request.seqs
    assert (parent.index, child.index) == (0, 1) and child.num_computed_tokens == parent.num_computed_tokens == 10
    assert core.kv.tables[child.seq_id] == core.kv.tables[parent.seq_id], "a fork shares its parent's blocks"
    assert [parent.token_ids[-1], child.token_ids[-1]] == result.sampled()
    check_block_accounting(core)

    while core.has_unfinished:
        core.step()
        check_block_accounting(core)
    assert [len(s.output_token_ids) for s in request.seqs] == [3, 3]
    assert_all_blocks_back(core)


def test_telemetry_counts_the_tokens_still_to_prefill_per_priority() -> None:
    """``TelemetrySnapshot.prefill_tokens``: a waiting prompt's tokens, then what its chunked prefill has
    left, per engine priority; a decode counts nothing; the field survives the wire."""
    core = EngineCore(EngineConfig(model="tiny", device="cpu", block_size=4, num_blocks=32,
                                   max_num_batched_tokens=8))
    core.add(core.make_request(list(range(1, 11)), SamplingParams(max_tokens=2, temperature=0.0), priority=0))
    core.add(core.make_request(list(range(20, 26)), SamplingParams(max_tokens=2, temperature=0.0), priority=3))
    assert core.telemetry().prefill_tokens == {0: 10, 3: 6}
    core.step()  # 8 of the first prompt's 10 tokens; the second waits (the budget is spent)
    snapshot = core.telemetry()
    assert snapshot.prefill_tokens == {0: 2, 3: 6}
    assert TelemetrySnapshot.model_validate_json(snapshot.model_dump_json()).prefill_tokens == {0: 2, 3: 6}
    while core.has_unfinished:
        core.step()
    assert core.telemetry().prefill_tokens == {}


def test_each_steps_output_keeps_its_own_tokens_while_the_sequences_grow() -> None:
    """A step's outputs are windows on the sequences' token lists (``CompletionOutput``): read after later
    steps (as the server's loop does, behind the engine thread), each still holds exactly the tokens of its
    step, for every completion of ``n`` and with a step run ahead."""
    core = EngineCore(EngineConfig(model="tiny", device="cpu", block_size=4, num_blocks=64, async_scheduling=True))
    core.add(core.make_request(list(range(1, 7)), SamplingParams(max_tokens=9, temperature=0.0, n=2,
                                                                 ignore_eos=True), stream=True))
    steps = []
    while core.has_unfinished:
        steps += [[(c.num_tokens, c.token_ids_from(1), c.index) for c in output.outputs] + [output]
                  for output in core.step()]
    final = steps[-1][-1]
    assert final.finished and [len(c.token_ids) for c in final.outputs] == [9, 9]
    for *views, output in steps:
        for (count, after_first, index), completion in zip(views, output.outputs, strict=True):
            assert completion.num_tokens == count == len(completion.token_ids), "nothing grew into a window"
            assert completion.token_ids == final.outputs[index].token_ids[:count]
            assert completion.token_ids_from(1) == after_first == completion.token_ids[1:]
    assert [v[0][0] for v in steps] == list(range(1, 10)), "one output a step, one token more each"
