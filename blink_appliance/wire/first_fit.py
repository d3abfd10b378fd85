"""First-fit allocation of an area the front end hands out in ranges, one per output channel (the
logprob area, the constraint area). The front end both takes and gives back every range, so the
engine only ever sees a record's offset; requests finish in any order, hence a list of free ranges.
"""

from __future__ import annotations

import bisect


class FirstFit:
    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)] if size else []  # sorted, disjoint [start, end)
        self._held: dict[int, tuple[int, int]] = {}  # slot -> its range
        # Channels a previous front end left in flight: where their ranges are is not known, so
        # nothing is handed out until the engine has finished all of them.
        self._unknown: set[int] = set()

    def adopt(self, slots: set[int]) -> None:
        self._unknown = set(slots)

    def reserve(self, slot: int, n: int) -> int | None:
        """The first of `n` free units, now held by `slot`; None when no range is large enough."""
        if self._unknown:
            return None
        for i, (start, end) in enumerate(self._free):
            if end - start >= n:
                if end - start == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, end)
                self._held[slot] = (start, start + n)
                return start
        return None

    def release(self, slot: int) -> None:
        """The engine is done with `slot`: its range (if any) is free again, merged with its neighbours."""
        self._unknown.discard(slot)
        held = self._held.pop(slot, None)
        if held is None:
            return
        start, end = held
        i = bisect.bisect(self._free, held)
        if i < len(self._free) and self._free[i][0] == end:
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:
            start = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (start, end))

    @property
    def free_units(self) -> int:
        return sum(end - start for start, end in self._free)
