"""The Triton attention backend: the protocol of ``backend.AttentionBackend`` on the Triton kernels.

A step's batch may mix decode rows (query length 1) and prefill chunks, in any order. Both kernels take the
whole batch and each handles only its own kind of row, so no reordering or host-side splitting is needed:

    batch rows:      | prefill a (3) | decode b | prefill c (2) | decode d |
    decode kernel:         skip           yes         skip           yes
    prefill kernel:        yes            skip        yes            skip

Every output row is written by exactly one kernel. A kernel is launched only when the batch has a row of
its kind, which the host knows from ``meta.query_lens_cpu`` without touching the device. For a decode-only
batch the launches depend on nothing but the batch size, so the whole step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from engine.kernels.metadata import AttentionMetadata
from engine.kernels.triton_decode import choose_num_splits, decode_attention
from engine.kernels.triton_prefill import prefill_attention
from engine.kernels.triton_store import store_kv

# Off CUDA (interpreted Triton, for tests) there is no SM count; this one keeps small batches split.
HOST_PROGRAM_SLOTS = 8


class TritonAttentionBackend:
    """Stateless apart from the device's SM count; one instance serves every layer."""

    name = "triton"
    supports_cuda_graphs = True
    stores_rotated = True

    def __init__(self, num_sms: int | None = None) -> None:
        self._num_sms = num_sms

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        store_kv(key, value, kv_cache, slot_mapping)

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        output = torch.empty_like(query)
        args = (query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, output, scale)
        if 1 in meta.query_lens_cpu:
            splits = choose_num_splits(meta.num_seqs, kv_cache.shape[3], self.num_sms(query.device))
            decode_attention(*args, num_splits=splits)
        if meta.max_query_len > 1:
            prefill_attention(*args, max_query_len=meta.max_query_len)
        return output

    def num_sms(self, device: torch.device) -> int:
        """The SMs the split count is chosen for (on CPU, a stand-in count that keeps small batches split)."""
        if self._num_sms is None:
            self._num_sms = (
                torch.cuda.get_device_properties(device).multi_processor_count
                if device.type == "cuda"
                else HOST_PROGRAM_SLOTS
            )
        return self._num_sms
