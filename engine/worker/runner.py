"""Runs one scheduled step on the model: block moves, batch tensors, forward, logits, sampling.

The runner sees only the scheduler's output, plain data (``engine.sched.output``), and the step's grammar
bitmask (engine/structured/bitmask.py: which tokens each constrained draw may take, filled by the engine
core): it holds the device KV caches and the host swap copies, never the block tables or the sequences
behind them. Only the last token of a chunk that samples produces logits; prefill chunks that stop short of
the end produce none.

On CUDA, with a backend that allows it, a decode-only step replays a captured CUDA graph
(``engine.worker.cuda_graphs``); one whose every draw is greedy and unconstrained replays a graph that also
draws, and makes no fp32 logits. Every other step, and every step on CPU, runs the model eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.kv.copies import BlockCopies
from engine.model.loader import LoadedModel
from engine.model.lora_slots import LoraSlots
from engine.model.weights import weight_bytes
from engine.sched.output import SchedulerOutput
from engine.worker.batch import HostBatch
from engine.worker.cuda_graphs import DecodeGraphs
from engine.worker.host_cache import HostKVCache
from engine.worker.sampler import sample

if TYPE_CHECKING:
    from engine.structured.bitmask import GrammarBitmask


@dataclass(slots=True)
class StepResult:
    """One executed step. On CUDA its work may still be running: only ``sampled()`` waits for it."""

    # [chunks that sample, vocab] float32, in scheduling order; None for a graph step drawn greedily there
    logits: torch.Tensor | None
    tokens: torch.Tensor  # [draws] int64 on the device: one per entry of the output's ``sampling``, in its order
    num_tokens: int
    bytes_moved: int  # weights read once, KV read over every context, KV written for new tokens
    _host: torch.Tensor | None = None  # CUDA: the pinned copy of ``tokens`` on its way
    _copied: torch.cuda.Event | None = None  # ... recorded after that copy
    _sampled: list[int] | None = None

    def __post_init__(self) -> None:
        if self.tokens.is_cuda:
            # Start the copy home now, without waiting: the host goes on (schedules the next step) meanwhile.
            self._host = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True)
            self._host.copy_(self.tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def sampled(self) -> list[int]:
        """The step's tokens on the host, in the order of the output's ``sampling``. On CUDA this is the
        step's one wait for the device."""
        if self._sampled is None:
            if self._copied is not None:
                assert self._host is not None
                self._copied.synchronize()
                self._sampled = self._host.tolist()
            else:
                self._sampled = self.tokens.tolist()
        return self._sampled


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        swap_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        lora_slots: LoraSlots | None = None,
    ) -> None:
        self.model = loaded.model
        self.lora_slots = lora_slots
        self.block_size = block_size
        self.device = device
        cfg = loaded.config
        block_shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros((2, *block_shape), dtype=dtype, device=device)
                          for _ in range(cfg.num_hidden_layers)]
        self.host_cache = HostKVCache(swap_blocks, self.kv_caches)
        self.kv_bytes_per_token = cfg.kv_bytes_per_token(dtype)
        self.weight_bytes = weight_bytes(self.model)  # as resident: quantized, tied weights once
        self.graphs: DecodeGraphs | None = None
        if device.type == "cuda" and self.model.attn_backend.supports_cuda_graphs:
            # No sequence outgrows the model's context or the pool, whichever is smaller.
            max_blocks = min(num_blocks, -(-cfg.max_position_embeddings // block_size))
            self.graphs = DecodeGraphs(self.model, self.kv_caches, max_blocks, device)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, grammar: GrammarBitmask | None = None, previous: StepResult | None = None
    ) -> StepResult:
        """Run ``out``; on CUDA, return as soon as its work is queued (see ``StepResult.sampled``).

        ``previous``: the step before, when ``out`` was scheduled before its tokens were read back; its
        tokens fill ``out``'s ``PENDING`` inputs on the device, behind it on the same stream.
        """
        self._apply_copies(out.copies)
        batch = HostBatch.build(out, self.block_size)
        inputs = batch.to_device(self.device)
        if inputs.pending is not None:
            if previous is None:
                raise ValueError("a step with PENDING inputs needs the previous step's result")
            positions, rows = inputs.pending
            inputs.input_ids.index_copy_(0, positions, previous.tokens.index_select(0, rows))
        # A step with adapters runs eagerly: the captured graphs hold no adapter layout.
        lora = self.lora_slots is not None and self.lora_slots.prepare(out.loras, batch.query_lens)
        sampling = out.sampling
        every_row = len(sampling.rows) == sampling.num_rows  # one draw per row, in row order
        num_tokens = len(batch.input_ids)
        kv_bytes = self.kv_bytes_per_token * (sum(batch.seq_lens) + num_tokens)
        replayed = None
        if self.graphs is not None and batch.max_query_len == 1 and not lora:
            draw = grammar is None and all(p.greedy for p in sampling.params)
            replayed = self.graphs.run(inputs, draw)
        if replayed is not None and replayed.greedy is not None:
            # Drawn in the graph. index_select copies, so the next replay cannot overwrite the tokens on their
            # way home.
            tokens = replayed.greedy.index_select(0, inputs.logits_indices)
            if not every_row:
                tokens = tokens.index_select(0, self._rows(sampling.rows))
            return StepResult(None, tokens, num_tokens, self.weight_bytes + kv_bytes)
        if replayed is not None:
            hidden = replayed.hidden
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        # One draw per row needs no copy (a grammar would mask the logits in place).
        draws = logits if every_row and grammar is None else logits.index_select(0, self._rows(sampling.rows))
        tokens = sample(draws, sampling.params, sampling.generators, grammar)
        return StepResult(logits, tokens, num_tokens, self.weight_bytes + kv_bytes)

    def _rows(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    def _apply_copies(self, copies: BlockCopies) -> None:
        # Swap-outs read blocks that this step may already have handed to other sequences: copy them first.
        self.host_cache.swap_out(copies.swap_out)
        self.host_cache.swap_in(copies.swap_in)
        if copies.copy_on_write:
            src = torch.tensor([s for s, _ in copies.copy_on_write], device=self.device)
            dst = torch.tensor([d for _, d in copies.copy_on_write], device=self.device)
            for cache in self.kv_caches:
                cache[:, dst] = cache[:, src]
