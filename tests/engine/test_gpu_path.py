"""The GPU path: a step's inputs in one copy, padded decode-graph batches, and the memory profile's scratch
step.

On CUDA the real graphs are captured and replayed. Without a GPU the graph is a stand-in that replays the
captured call eagerly (through the interpreted Triton kernels) into the same static buffers, so what is
checked there is everything around the capture: the padded size, the copies into the static buffers, and
that padding rows (including rows an earlier, larger batch left behind) neither write to the KV cache nor
change the real rows' results.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")  # before the imports below: the Triton backend imports triton

from engine import LLM, SamplingParams
from engine.kernels import AttentionMetadata, TorchAttentionBackend
from engine.kernels.triton_backend import TritonAttentionBackend
from engine.model.loader import load_model
from engine.sched.output import SchedulerOutput
from engine.worker.batch import HostBatch
from engine.worker.cuda_graphs import CAPTURE_SIZES, DecodeGraphs, Replayed
from engine.worker.memory_profile import scratch_step

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 40
MAX_BLOCKS_PER_SEQ = 8


class EagerReplay:
    """Stands in for a captured CUDA graph: ``replay`` reruns the call and refreshes the static outputs."""

    def __init__(self, call, outputs: Replayed) -> None:
        self.call = call
        self.outputs = outputs

    def replay(self) -> None:
        for output, fresh in zip(self.outputs, self.call(), strict=True):
            if output is not None:
                output.copy_(fresh)


class EagerDecodeGraphs(DecodeGraphs):
    def _capture(self, size: int, draw: bool) -> tuple[EagerReplay, Replayed]:
        replay = EagerReplay(lambda: self.step(size, draw), self.step(size, draw))
        self.graphs[size, draw] = (replay, replay.outputs)
        return replay, replay.outputs


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", DEVICE, torch.float32, TritonAttentionBackend()).model


def random_caches(model, seed: int) -> list[torch.Tensor]:
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    return [torch.randn(shape, generator=generator).to(DEVICE) for _ in range(config.num_hidden_layers)]


def decode_batch(context_lens: list[int], seed: int) -> HostBatch:
    """One decode token per sequence, each sequence in its own random blocks of the pool."""
    generator = torch.Generator().manual_seed(seed)
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in context_lens]
    width = max(len(t) for t in tables)
    return HostBatch(
        input_ids=torch.randint(0, 256, (len(context_lens),), generator=generator).tolist(),
        positions=[n - 1 for n in context_lens],
        slot_mapping=[t[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
                      for t, n in zip(tables, context_lens)],
        block_tables=[t + [0] * (width - len(t)) for t in tables],
        query_lens=[1] * len(context_lens),
        seq_lens=context_lens,
        logits_indices=list(range(len(context_lens))),
    )


def eager(model, caches: list[torch.Tensor], batch: HostBatch) -> torch.Tensor:
    n = batch.num_seqs
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(batch.slot_mapping, device=DEVICE),
        block_tables=torch.tensor(batch.block_tables, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32, device=DEVICE),
        query_lens_cpu=batch.query_lens,
        seq_lens_cpu=batch.seq_lens,
        max_query_len=1,
        max_seq_len=max(batch.seq_lens),
    )
    inputs = torch.tensor(batch.input_ids, device=DEVICE), torch.tensor(batch.positions, device=DEVICE)
    return model(*inputs, caches, meta)


@torch.inference_mode()
def test_padded_replays_match_eager_steps_and_padding_writes_nothing(model, monkeypatch) -> None:
    graph_caches = random_caches(model, seed=0)
    eager_caches = random_caches(model, seed=0)
    if DEVICE.type == "cuda":
        graphs = DecodeGraphs(model, graph_caches, MAX_BLOCKS_PER_SEQ, DEVICE)
    else:
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
        graphs = EagerDecodeGraphs(model, graph_caches, MAX_BLOCKS_PER_SEQ, DEVICE)
    # Five rows run padded to 8; then three rows run padded to 4, over rows 3..4 that still hold the first
    # batch's real slots and contexts.
    for context_lens, seed in (([5, 1, 17, 8, 30], 1), ([9, 4, 21], 2)):
        # Fresh contents, as other steps would leave: a stale row re-run would now write different values.
        for graph_cache, eager_cache, fresh in zip(graph_caches, eager_caches, random_caches(model, seed)):
            graph_cache.copy_(fresh)
            eager_cache.copy_(fresh)
        batch = decode_batch(context_lens, seed)
        before = [c.clone() for c in graph_caches]
        replayed = graphs.run(batch.to_device(DEVICE), draw=seed == 2)  # the second batch draws in the graph
        expected = eager(model, eager_caches, batch)
        assert replayed.hidden.shape == expected.shape
        assert torch.allclose(replayed.hidden, expected, atol=1e-5)
        if seed == 2:
            assert torch.equal(replayed.greedy, model.compute_logits(replayed.hidden).argmax(dim=-1))
        else:
            assert replayed.greedy is None
        for old, graph_cache, eager_cache in zip(before, graph_caches, eager_caches):
            assert written_slots(old, graph_cache) == sorted(batch.slot_mapping)
            # Not bit-equal: the projections ran on 8 (or 4) rows instead of 5 (or 3), another GEMM blocking.
            assert torch.allclose(graph_cache, eager_cache, atol=1e-5)
    assert sorted(graphs.graphs) == [(4, True), (8, False)]


@torch.inference_mode()
def test_a_greedy_decode_step_draws_in_the_graph_and_a_sampled_one_from_its_logits(monkeypatch) -> None:
    """Through the engine: with the graph stand-in in its runner, greedy decode steps take their tokens from
    the graph's argmax and make no fp32 logits, seeded sampled ones draw from the graph's hidden states, and
    both give the tokens an eager runner gives (the torch backend's, which never captures a graph: the two
    backends' tokens are held equal by test_kernels_triton.py, and it is the quicker in the interpreter)."""
    # Each step read back before the next (on CUDA the engine would run ahead, and the step ahead of the last
    # one would be a fourth decode step, whose tokens are dropped): the count below is the one the requests need.
    options = {"model": "tiny", "device": DEVICE.type, "dtype": "float32", "num_blocks": NUM_BLOCKS,
               "block_size": BLOCK_SIZE, "async_scheduling": False}
    prompts = [[3, 14, 15, 92, 65], [89, 79, 32, 38, 46, 26, 43]]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=4, temperature=0.8, seed=7, ignore_eos=True)
    eager_llm = LLM(**options, attention_backend="torch")
    expected = [[o.token_ids for o in eager_llm.generate(prompts, params)] for params in (greedy, sampled)]
    llm = LLM(**options, attention_backend="triton")
    runner = llm.core.runner
    if DEVICE.type != "cuda":
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    runner.graphs = (DecodeGraphs if DEVICE.type == "cuda" else EagerDecodeGraphs)(
        runner.model, runner.kv_caches, MAX_BLOCKS_PER_SEQ, DEVICE)
    results = []
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda *args, **kwargs: results.append(execute(*args, **kwargs))
                        or results[-1])
    for params, tokens in zip((greedy, sampled), expected, strict=True):
        results.clear()
        assert [o.token_ids for o in llm.generate(prompts, params)] == tokens
        drawn_in_graph = sum(result.logits is None for result in results)
        assert drawn_in_graph == (3 if params is greedy else 0), "a prefill step and three decode steps"
    assert runner.graphs.graphs, "decode steps replayed"


def written_slots(before: torch.Tensor, after: torch.Tensor) -> list[int]:
    """Cache slots whose K or V changed, in the flat numbering of ``slot_mapping``."""
    changed = (before != after).flatten(3).any(-1).any(0)  # [blocks, block_size]
    return changed.flatten().nonzero().flatten().tolist()


def test_step_inputs_are_the_host_lists_in_one_device_buffer() -> None:
    # A prefill chunk that samples, one that does not, and a decode: tables of 2, 1 and 3 blocks.
    out = SchedulerOutput(num_new_tokens=[3, 2, 1], num_samples=[1, 0, 1], starts=[2, 0, 10],
                          token_ids=[7, 8, 9, 1, 2, 3], block_tables=[[4, 9], [5], [6, 2, 8]], pending_rows=[-1] * 3)
    batch = HostBatch.build(out, BLOCK_SIZE)
    inputs = batch.to_device(DEVICE)
    expected = AttentionMetadata.from_host(batch.slot_mapping, batch.block_tables, batch.query_lens,
                                           batch.seq_lens, DEVICE)
    meta = inputs.meta
    assert inputs.input_ids.tolist() == [7, 8, 9, 1, 2, 3] and inputs.positions.tolist() == [2, 3, 4, 0, 1, 10]
    assert inputs.logits_indices.tolist() == [2, 5]
    assert meta.slot_mapping.tolist() == [18, 19, 36, 20, 21, 34]
    for name in ("slot_mapping", "block_tables", "query_start_loc", "seq_lens"):
        ours, theirs = getattr(meta, name), getattr(expected, name)
        assert ours.device.type == DEVICE.type and ours.dtype == theirs.dtype and torch.equal(ours, theirs), name
    assert meta.block_tables.tolist() == [[4, 9, 0], [5, 0, 0], [6, 2, 8]]
    assert (meta.query_lens_cpu, meta.seq_lens_cpu, meta.max_query_len, meta.max_seq_len) == (
        [3, 2, 1], [5, 2, 11], 3, 11)
    # One buffer: the token inputs are views of the same storage.
    assert inputs.input_ids.untyped_storage().data_ptr() == inputs.positions.untyped_storage().data_ptr()


def test_capture_sizes_cover_every_batch_up_to_the_limit() -> None:
    assert CAPTURE_SIZES[:5] == (1, 2, 4, 8, 16)
    assert all(b - a <= 16 for a, b in itertools.pairwise(CAPTURE_SIZES))


def test_memory_profile_scratch_step_is_a_valid_batch() -> None:
    model = load_model("tiny", torch.device("cpu"), torch.float32, TorchAttentionBackend()).model
    input_ids, positions, caches, meta = scratch_step(model, [5, 1, 9], BLOCK_SIZE, torch.device("cpu"))
    # Blocks 0-1 for the first sequence, 2 for the second, 3-5 for the third; slots follow positions.
    assert caches[0].shape[1] == 6
    assert meta.slot_mapping.tolist() == [0, 1, 2, 3, 4, 8, *range(12, 21)]
    assert meta.block_tables.tolist() == [[0, 1, 2], [2, 3, 4], [3, 4, 5]]
    assert meta.query_start_loc.tolist() == [0, 5, 6, 15]
    hidden = model(input_ids, positions, caches, meta)
    assert hidden.shape == (15, model.config.hidden_size) and torch.isfinite(hidden).all()
