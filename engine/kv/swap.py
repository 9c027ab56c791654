"""Host (CPU) swap space for preemption by swap: a block allocator plus the tensors that hold the KV.

Swapped-out KV keeps the device layout, one host tensor per layer ``[2, swap_blocks, block_size, kvh, d]``,
so a swap is a gather/scatter of whole blocks. On CUDA the host tensors are pinned for fast copies.
"""

from __future__ import annotations

import torch


class SwapSpace:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"swap_blocks: must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids are handed out first
        self.caches: list[torch.Tensor] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} swap blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))

    def bind(self, device_caches: list[torch.Tensor]) -> None:
        """Allocate host tensors shaped like the device caches, with ``num_blocks`` blocks each."""
        pin = device_caches[0].is_cuda and torch.cuda.is_available()
        self.caches = [
            torch.zeros((2, self.num_blocks, *c.shape[2:]), dtype=c.dtype, pin_memory=pin) for c in device_caches
        ]

    def swap_out(self, device_caches: list[torch.Tensor], mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: ``mapping`` pairs are (device block, host block)."""
        self._copy(device_caches, self.caches, mapping)

    def swap_in(self, device_caches: list[torch.Tensor], mapping: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: ``mapping`` pairs are (host block, device block)."""
        self._copy(self.caches, device_caches, mapping)

    @staticmethod
    def _copy(src: list[torch.Tensor], dst: list[torch.Tensor], mapping: list[tuple[int, int]]) -> None:
        if not mapping:
            return
        src_idx = torch.tensor([s for s, _ in mapping], device=src[0].device)
        dst_idx = torch.tensor([d for _, d in mapping], device=dst[0].device)
        for s, d in zip(src, dst):
            d[:, dst_idx] = s[:, src_idx].to(d.device, non_blocking=True)
