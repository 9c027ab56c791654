"""CUDA graphs for decode-only steps, so that small batches are not bound by kernel launches.

A decode step of a small model is a few hundred short kernels; launched one by one from Python they take
longer than the memory traffic they do. A captured graph replays them in one launch. Graphs have fixed
shapes and fixed addresses, so every input lives in a static buffer and a batch of ``n`` sequences runs the
graph of the smallest captured size ``>= n``, its extra rows padded::

    rows:           0 .. n-1 (real)              n .. size-1 (padding)
    slot_mapping:   the real slots               -1: the store kernel writes nothing
    seq_lens:       the real context lengths      1: one cached token to read, from a valid block
    block_tables:   the real tables              whatever an earlier replay left: valid block ids

Each size is captured the first time a batch of that size arrives (the kernels' compilation and the
capture cost a few tens of milliseconds once). All graphs share one memory pool: they never run
concurrently, and a replay's output is consumed before the next replay overwrites the pool.

A step whose every draw is greedy and unconstrained replays a graph that goes on to the draw: the LM head's
logits in the model's dtype and their argmax per row (``Replayed.greedy``), so it makes no fp32 copy of the
logits (at batch 256 and a 152k vocabulary, 156 MB written and read again) and launches nothing outside the
graph but the tokens' copy home (engine/worker/runner.py). Any other step replays the graph of the same size
that ends at the hidden states, and samples from their logits as an eager step does. Only the outputs a
graph keeps (hidden states and token ids, small beside a batch's logits) stay allocated in the pool; the
logits are an intermediate of the replay (the memory profile counts them at the largest size).

Only a backend whose launches depend on nothing but the batch size may be captured
(``AttentionBackend.supports_cuda_graphs``); the host-side values of the captured ``AttentionMetadata``
(``seq_lens_cpu``, ``max_seq_len``) are placeholders such a backend never reads. Batches larger than
``MAX_CAPTURED_BATCH``, and any step with a prefill chunk, run eagerly.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import torch

from engine.kernels import AttentionMetadata
from engine.model.llama import LlamaForCausalLM
from engine.worker.batch import StepInputs

MAX_CAPTURED_BATCH = 256
# 1, 2, 4, 8, then every multiple of 16: padding wastes at most 15 rows of a batch above 16.
CAPTURE_SIZES = (1, 2, 4, 8, *range(16, MAX_CAPTURED_BATCH + 1, 16))


def greedy_draw(model: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token: the argmax of the LM head's logits in the model's dtype, which is their fp32
    cast's (the cast changes no value). What a drawing graph holds after the model."""
    return model.project_logits(hidden).argmax(dim=-1)


class Replayed(NamedTuple):
    """A decode step's outputs, row for row: final hidden states ``[n, hidden]`` and, from a graph that draws,
    each row's greedy token ``[n]`` (int64; None otherwise). Views of a graph's static outputs: the next
    replay overwrites them."""

    hidden: torch.Tensor
    greedy: torch.Tensor | None


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        rows = MAX_CAPTURED_BATCH
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((rows, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)  # one token per row
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, Replayed]] = {}  # by (size, draws)

    def run(self, inputs: StepInputs, draw: bool = False) -> Replayed | None:
        """A decode-only step's outputs (``Replayed``, its ``n`` rows; with ``draw``, its greedy tokens too),
        or None if it has no graph size."""
        n, width = inputs.meta.block_tables.shape
        if n > MAX_CAPTURED_BATCH:
            return None
        size = CAPTURE_SIZES[bisect.bisect_left(CAPTURE_SIZES, n)]
        # Device-to-device copies into the static buffers: the step's inputs are already on the device.
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(inputs.meta.slot_mapping)
        self.seq_lens[:n].copy_(inputs.meta.seq_lens)
        self.block_tables[:n, :width].copy_(inputs.meta.block_tables)
        # Rows past n may hold an earlier, larger batch's values: a real slot would be overwritten and a long
        # context re-read for nothing.
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].fill_(1)
        graph, (hidden, greedy) = self.graphs.get((size, draw)) or self._capture(size, draw)
        graph.replay()
        return Replayed(hidden[:n], None if greedy is None else greedy[:n])

    def step(self, size: int, draw: bool) -> Replayed:
        """The step a ``size``-row graph holds, run on the static buffers (captured, or eagerly)."""
        hidden = self.model(*self._static_args(size))
        return Replayed(hidden, greedy_draw(self.model, hidden) if draw else None)

    def _capture(self, size: int, draw: bool) -> tuple[torch.cuda.CUDAGraph, Replayed]:
        # An eager run first, on a side stream as capture requires: it compiles the Triton kernels for this
        # shape (nothing may compile inside a capture). It runs on the live inputs, so the K/V it stores are
        # the very ones the replay stores again.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step(size, draw)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.step(size, draw)
        self.graphs[size, draw] = (graph, outputs)
        return graph, outputs

    def _static_args(
        self, size: int
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata]:
        """The model's arguments for a ``size``-row graph: views of the static buffers."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[1] * size,
            max_query_len=1,
            max_seq_len=1,
        )
        return self.input_ids[:size], self.positions[:size], self.kv_caches, meta
