"""Stop strings: end a generation at the first occurrence of any of them, which is not returned.

Text arrives in pieces, so a stop string may straddle pieces: the matcher holds back the longest
tail that could still begin a stop string and releases it once it cannot.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text that is safe to send now; sets `stopped` when a stop string was found."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        first = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if first >= 0:
            self.stopped = True
            self._held = ""
            return buf[:first]
        keep = self._tail_that_may_start_a_stop(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back text, at the end of generation (it did not turn into a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _tail_that_may_start_a_stop(self, buf: str) -> int:
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
