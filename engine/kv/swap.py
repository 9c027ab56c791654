"""Host (CPU) swap space for preemption by swap: which host block ids are free.

Only ids live here, so the KV layer stays torch-free; the tensors that hold swapped-out KV, and the copies
in and out of them, belong to the worker (``engine.worker.host_cache``), which sizes them to ``num_blocks``.
"""

from __future__ import annotations


class SwapSpace:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"swap_blocks: must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids are handed out first

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

    def check(self, held: list[int]) -> None:
        """Raise ``RuntimeError`` unless ``held`` (the ids in every host block table) and the free ids
        together are every id exactly once. O(num_blocks): for tests and checks of an idle engine."""
        if sorted(held + self._free) != list(range(self.num_blocks)):
            raise RuntimeError(f"swap space inconsistent: held {sorted(held)}, free {sorted(self._free)} "
                               f"of {self.num_blocks} host blocks")
