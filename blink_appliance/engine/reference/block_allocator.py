"""A fixed pool of KV-cache blocks handed out from a free list.

The free list is a LIFO stack of block ids. At start it holds every block so that pops come out in
ascending order (0, 1, 2, ...). `free(blocks)` pushes a sequence's blocks back in reverse, so the next
allocation gets them again in the same order. A stack with one top index is what the GPU scheduler
keeps on the device too (pop = read below the top, then move the top), so the two agree block for
block on the same schedule.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockUsage:
    used: int
    free: int
    total: int

    @property
    def fraction_used(self) -> float:
        return self.used / self.total if self.total else 0.0


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # top of the stack is the end
        self._in_use = bytearray(num_blocks)  # catches double frees and foreign ids

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Pop n blocks; raises if fewer are free (callers check can_allocate and preempt first)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: asked for {n}, {len(self._free)} free")
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        for b in taken:
            self._in_use[b] = 1
        return taken

    def free(self, blocks: list[int]) -> None:
        """Return a sequence's blocks (in block-table order); the next allocation reuses them in that order."""
        for b in blocks:
            if not (0 <= b < self.num_blocks) or not self._in_use[b]:
                raise RuntimeError(f"block {b} freed but not allocated")
        if len(set(blocks)) != len(blocks):
            raise RuntimeError(f"blocks freed twice in one call: {blocks}")
        for b in blocks:
            self._in_use[b] = 0
        self._free.extend(reversed(blocks))

    def usage(self) -> BlockUsage:
        return BlockUsage(used=self.num_used, free=self.num_free, total=self.num_blocks)
