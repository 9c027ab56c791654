"""A KV block and the O(1) doubly linked queue of free blocks.

The free queue is ordered by eviction preference: the head is taken first. Blocks enter at the tail when
their last reference goes, so the least recently used block is always at the head (LRU). A free block may
still hold a cached prefix (it has a hash); taking it evicts that prefix. A cache hit on a free block
removes it from the middle of the queue, which is why the queue is linked rather than a list.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class KVBlock:
    """One fixed-size block of the KV pool.

    Invariants: ``ref_count == 0`` iff the block is in the free queue; ``block_hash`` is set only while the
    block is full and registered in the prefix cache (a block with a hash is immutable).
    """

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    prev: KVBlock | None = field(default=None, repr=False)
    next: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) push at the tail, pop at the head and removal anywhere."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        # Sentinels remove every empty-list special case from the link updates.
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None and block.prev is None and block.next is None, "block already queued"
        last.next, block.prev, block.next, self._tail.prev = block, last, self._tail, block
        self._len += 1

    def popleft(self) -> KVBlock:
        first = self._head.next
        if first is self._tail or first is None:
            raise IndexError("no free blocks")
        self.remove(first)
        return first

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, "block is not queued"
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self._len -= 1
