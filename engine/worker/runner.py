"""Runs one scheduled step on the model: block moves, batch tensors, forward, logits.

The batch (token ids, positions, slot_mapping, block tables, cu_seqlens) is laid out on the host once per
step and shared by every layer. Only the last token of a sequence whose uncomputed tokens all fit in this
step produces logits; prefill chunks that stop short of the end produce none.

On CUDA, with a backend that allows it, a decode-only step replays a captured CUDA graph
(``engine.worker.cuda_graphs``); every other step, and every step on CPU, runs the model eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import AttentionMetadata
from engine.kv.manager import BlockCopies, KVCacheManager
from engine.kv.swap import SwapSpace
from engine.model import LoadedModel
from engine.sched.scheduler import SchedulerOutput
from engine.worker.cuda_graphs import DecodeGraphs


@dataclass(slots=True)
class HostBatch:
    """One step's inputs as host lists, in scheduling order (see ``AttentionMetadata`` for the layout)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]  # padded with 0 to the longest table
    query_lens: list[int]
    seq_lens: list[int]
    logits_indices: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)


@dataclass(slots=True)
class StepResult:
    logits: torch.Tensor  # [sequences that sample, vocab] float32, in scheduling order
    num_tokens: int
    bytes_moved: int  # weights read once, KV read over every context, KV written for new tokens


class ModelRunner:
    def __init__(
        self, loaded: LoadedModel, kv: KVCacheManager, swap: SwapSpace, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.model = loaded.model
        self.kv = kv
        self.swap = swap
        self.device = device
        cfg = loaded.config
        block_shape = (kv.pool.num_blocks, kv.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros((2, *block_shape), dtype=dtype, device=device)
                          for _ in range(cfg.num_hidden_layers)]
        swap.bind(self.kv_caches)
        self.kv_bytes_per_token = cfg.kv_bytes_per_token(dtype)
        # Tied weights share storage: count each tensor once.
        seen = {p.data_ptr(): p.numel() * p.element_size() for p in self.model.parameters()}
        self.weight_bytes = sum(seen.values())
        self.graphs: DecodeGraphs | None = None
        if device.type == "cuda" and self.model.attn_backend.supports_cuda_graphs:
            # No sequence outgrows the model's context or the pool, whichever is smaller.
            max_blocks = min(kv.pool.num_blocks, -(-cfg.max_position_embeddings // kv.block_size))
            self.graphs = DecodeGraphs(self.model, self.kv_caches, max_blocks, device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        self._apply_copies(out.copies)
        batch = self._prepare(out)
        hidden = None
        if self.graphs is not None and batch.max_query_len == 1:
            hidden = self.graphs.run(batch)
        if hidden is None:
            input_ids, positions, meta = self._device_inputs(batch)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        logits_indices = torch.tensor(batch.logits_indices, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden[logits_indices])
        num_tokens = len(batch.input_ids)
        kv_bytes = self.kv_bytes_per_token * (sum(batch.seq_lens) + num_tokens)
        return StepResult(logits, num_tokens, self.weight_bytes + kv_bytes)

    def _apply_copies(self, copies: BlockCopies) -> None:
        # Swap-outs read blocks that this step may already have handed to other sequences: copy them first.
        self.swap.swap_out(self.kv_caches, copies.swap_out)
        self.swap.swap_in(self.kv_caches, copies.swap_in)
        if copies.copy_on_write:
            src = torch.tensor([s for s, _ in copies.copy_on_write], device=self.device)
            dst = torch.tensor([d for _, d in copies.copy_on_write], device=self.device)
            for cache in self.kv_caches:
                cache[:, dst] = cache[:, src]

    def _prepare(self, out: SchedulerOutput) -> HostBatch:
        block_size = self.kv.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        for item in out.scheduled:
            seq = item.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            table = self.kv.block_ids(seq)
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            tables.append(table)
            query_lens.append(end - start)
            seq_lens.append(end)
            if item.num_samples:
                logits_indices.append(len(input_ids) - 1)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return HostBatch(input_ids, positions, slots, padded, query_lens, seq_lens, logits_indices)

    def _device_inputs(self, batch: HostBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev = self.device
        meta = AttentionMetadata.from_host(batch.slot_mapping, batch.block_tables, batch.query_lens, batch.seq_lens,
                                           dev)
        return (
            torch.tensor(batch.input_ids, dtype=torch.int64, device=dev),
            torch.tensor(batch.positions, dtype=torch.int64, device=dev),
            meta,
        )
