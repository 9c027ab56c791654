"""Host (CPU) copies of swapped-out KV blocks, and the copies that move blocks in and out of them.

The host tensors keep the device layout, one per layer ``[2, num_blocks, block_size, kvh, d]``, so a swap
is a gather/scatter of whole blocks. On CUDA they are pinned for fast copies. Which host block ids are in
use is the KV layer's business (``engine.kv.swap.SwapSpace``); this class only moves bytes to and from them.
"""

from __future__ import annotations

import torch


class HostKVCache:
    def __init__(self, num_blocks: int, device_caches: list[torch.Tensor]) -> None:
        pin = device_caches[0].is_cuda and torch.cuda.is_available()
        self.caches = [
            torch.zeros((2, num_blocks, *c.shape[2:]), dtype=c.dtype, pin_memory=pin) for c in device_caches
        ]
        self.device_caches = device_caches

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: ``mapping`` pairs are (device block, host block)."""
        self._copy(self.device_caches, self.caches, mapping)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: ``mapping`` pairs are (host block, device block)."""
        self._copy(self.caches, self.device_caches, mapping)

    @staticmethod
    def _copy(src: list[torch.Tensor], dst: list[torch.Tensor], mapping: list[tuple[int, int]]) -> None:
        if not mapping:
            return
        src_idx = torch.tensor([s for s, _ in mapping], device=src[0].device)
        dst_idx = torch.tensor([d for _, d in mapping], device=dst[0].device)
        for s, d in zip(src, dst):
            d[:, dst_idx] = s[:, src_idx].to(d.device, non_blocking=True)
