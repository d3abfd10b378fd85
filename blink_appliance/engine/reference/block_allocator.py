"""A fixed pool of KV-cache blocks: reference counts, a free stack, and the prefix cache's blocks.

Every block is in one of three states:
- held: one or more sequences hold it (its reference count);
- cached: no sequence holds it, but it keeps a prefix under its block hash (prefix cache);
- empty: on the free stack.

The free stack is a LIFO of block ids. At start it holds every block so that pops come out in
ascending order (0, 1, 2, ...). Releasing a sequence's blocks goes through its table in reverse, so
the next allocation gets its empty ones again in table order, and its cached ones join the end of
the LRU order with the table's tail first (the tail of a prefix is the least shared part).

Free capacity is the stack plus the cached blocks: an allocation pops the stack first and then
evicts cached blocks, least recently released first. A stack with one top index is what the GPU
scheduler keeps on the device too (pop = read below the top, then move the top), so the two agree
block for block on the same schedule.

The cache is a direct-mapped table of `table_size` entries (a power of two at least twice the
blocks), indexed by a hash's low bits: a block is registered only into an empty entry, and a lookup
hits only a block registered under the very same 128-bit hash (docs/engine.md, "Prefix cache").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from blink_appliance.wire.prefix_hash import cache_table_size


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
        self.table_size = cache_table_size(num_blocks)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # top of the stack is the end
        self._ref = [0] * num_blocks  # sequences holding each block; catches double frees and foreign ids
        self._cached: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first
        self._key: list[int | None] = [None] * num_blocks  # the hash a block is registered under
        self._table: dict[int, int] = {}  # table entry -> block

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: empty ones, then cached ones it evicts."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks nobody holds that keep a cached prefix."""
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take n blocks, the stack's top first, then the least recently released cached blocks
        (evicted from the cache); raises if fewer are free (callers check can_allocate and preempt
        first)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free:
            raise RuntimeError(f"out of KV blocks: asked for {n}, {self.num_free} free")
        from_stack = min(n, len(self._free))
        taken = self._free[len(self._free) - from_stack :]
        del self._free[len(self._free) - from_stack :]
        taken.reverse()
        for _ in range(n - from_stack):
            block, _ = self._cached.popitem(last=False)
            key = self._key[block]
            del self._table[key % self.table_size]
            self._key[block] = None
            taken.append(block)
        for b in taken:
            self._ref[b] = 1
        return taken

    def free(self, blocks: list[int]) -> None:
        """A sequence lets go of its blocks (in block-table order): each one nobody else holds goes
        back, on the stack or, when it is registered, to the end of the cached ones."""
        for b in blocks:
            if not (0 <= b < self.num_blocks) or not self._ref[b]:
                raise RuntimeError(f"block {b} freed but not allocated")
        if len(set(blocks)) != len(blocks):
            raise RuntimeError(f"blocks freed twice in one call: {blocks}")
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._key[b] is None:
                    self._free.append(b)
                else:
                    self._cached[b] = None

    # -- the prefix cache -------------------------------------------------------------------------
    def lookup(self, hashes: list[int], limit: int) -> list[int]:
        """The cached blocks of the longest prefix of hashes[:limit] (block hashes, in order)."""
        hits: list[int] = []
        for h in hashes[:limit]:
            b = self._table.get(h % self.table_size)
            if b is None or self._key[b] != h:
                break
            hits.append(b)
        return hits

    def revived(self, blocks: list[int]) -> int:
        """How many of these cached blocks nobody holds now: acquiring them takes free capacity."""
        return sum(1 for b in blocks if self._ref[b] == 0)

    def acquire(self, blocks: list[int]) -> None:
        """A sequence takes hold of cached blocks (lookup's hits)."""
        for b in blocks:
            if self._key[b] is None:
                raise RuntimeError(f"block {b} acquired but not cached")
            if self._ref[b] == 0:
                del self._cached[b]
            self._ref[b] += 1

    def register(self, block: int, key: int) -> bool:
        """Cache a full, computed block under its hash if its table entry is empty (a later block of
        the same hash, or one whose entry is taken, stays uncached). Returns whether it was cached."""
        if not self._ref[block] or self._key[block] is not None:
            raise RuntimeError(f"block {block} registered but not held, or registered twice")
        entry = key % self.table_size
        if entry in self._table:
            return False
        self._table[entry] = block
        self._key[block] = key
        return True

    def usage(self) -> BlockUsage:
        return BlockUsage(used=self.num_used, free=self.num_free, total=self.num_blocks)
