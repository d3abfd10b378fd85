"""The front end's place in the request ring and the token arena: where its next record and prompt
go, kept by itself, and the region's ring words checked against that before they are trusted
(docs/protocol.md, "Words that hold what the protocol cannot produce"). EngineClient holds one."""

from __future__ import annotations

import logging

from blink_appliance.wire.region import RingRegion

log = logging.getLogger(__name__)


class RingCursor:
    """The producer's heads (`head`: records published; `arena_head`: prompt tokens allocated) and
    the checks of the words around them; the caller advances both as it publishes."""

    def __init__(self, region: RingRegion, repair_limit_s: float) -> None:
        self.region = region
        self.geometry = region.geometry
        # A tail word that contradicts our head is the engine's to put back (it keeps its own); one
        # that still does after this long is where the engine reads (it restarted the ring), and we
        # follow it. An engine puts its word back within one loop iteration, a step at most.
        self.repair_limit_ns = int(repair_limit_s * 1e9)
        self.head = self.arena_head = 0
        self.foreign_records = 0  # records another writer published on our ring (telemetry)
        self.faults = 0  # ring words found contradicting ours and not trusted (telemetry)
        self._tails_bad_since_ns = 0  # when the tails began contradicting our heads (0: they do not)
        self._faults_logged: set[str] = set()  # standing faults count and are logged once

    def take_heads(self) -> None:
        """Start (a front end taking over the region) where the engine reads next: after the records
        published at its tail, which the seq words tell without the req_head word; and in the arena
        where the last of them ends, or at the engine's arena tail when none is queued. The arena_head
        word is not trusted: one past every queued prompt would hold tokens nobody frees."""
        r, g = self.region, self.geometry
        tail, arena_tail = r.load("req_tail"), r.load("arena_tail")
        self.head, self.arena_head = r.load("req_head"), arena_tail
        self._follow_tails(tail, arena_tail)
        end = arena_tail
        if self.head > tail:
            last = int(r.read_record(self.head - 1)[0]["arena_end"])
            end = last if 0 <= last - arena_tail <= g.arena_tokens else arena_tail
        if r.load("arena_head") != end:
            log.error("the arena_head word is %d; the queued prompts end at %d: continuing there",
                      r.load("arena_head"), end)  # fmt: skip
            r.store("arena_head", end)
        self.arena_head = end

    def check(self, now_ns: int) -> tuple[int, int] | None:
        """Check the ring's words against ours (before a record goes in, and now and then from the
        client's pump). Returns the tails (req_tail, arena_tail) free space is measured from, or None
        while they are not believable. We are the ring's only producer, yet its words can move:

        - another writer published records after ours (issue 20, defect 7): the head moved forward
          over records whose seq words are there; continue after them and their prompts, or ours
          would sit where the engine never reads and every later request would hang behind them;
        - anything else that moved our heads (random bytes over the region) is put back: the engine
          measures prompts against the arena head, and a new epoch restarts a ring at its head;
        - a tail more than the ring holds behind our head, or ahead of it, is the engine's to put
          back: None (busy) until then, and past `repair_limit_s` it is where the engine reads
          (it restarted the ring, lifecycle.reset_inconsistent_rings): our heads move there.
        """
        r, g = self.region, self.geometry
        ring_head, arena_head, tail, arena_tail = r.load_words(
            ("req_head", "arena_head", "req_tail", "arena_tail")
        )
        if ring_head != self.head:
            if self._published(self.head, ring_head):
                log.error("%d request records were published by another writer; continuing after them",
                          ring_head - self.head)  # fmt: skip
                self.foreign_records += ring_head - self.head
                self.head = ring_head
                # Their prompts: ours go after the last one's (from the record, not the arena_head word).
                end = int(r.read_record(ring_head - 1)[0]["arena_end"])
                if self.arena_head < end <= self.arena_head + g.arena_tokens:
                    self.arena_head = end
            else:
                self._fault(f"req_head word {ring_head} is not ours ({self.head}); put back")
                r.doorbell("req_head", self.head)
        if arena_head != self.arena_head:
            self._fault(f"arena_head word {arena_head} is not ours ({self.arena_head}); put back")
            r.store("arena_head", self.arena_head)
        bad = [
            (name, word, capacity)
            for name, word, ours, capacity in (
                ("req_tail", tail, self.head, g.request_slots),
                ("arena_tail", arena_tail, self.arena_head, g.arena_tokens),
            )
            if not 0 <= ours - word <= capacity
        ]
        if not bad:
            self._tails_bad_since_ns = 0
            self._faults_logged.clear()
            return tail, arena_tail
        self._tails_bad_since_ns = self._tails_bad_since_ns or now_ns
        for name, word, capacity in bad:
            ours = self.head if name == "req_tail" else self.arena_head
            self._fault(f"{name} word {word} is not within {capacity} behind our head {ours}")
        if now_ns - self._tails_bad_since_ns < self.repair_limit_ns:
            return None
        self._follow_tails(tail, arena_tail)
        self._tails_bad_since_ns = 0
        return tail, arena_tail

    def _published(self, start: int, stop: int) -> bool:
        """Every record position in [start, stop) holds its record (seq = position + 1): more of
        them than the ring holds cannot be."""
        r = self.region
        return start < stop <= start + self.geometry.request_slots and all(
            r.record_seq(p) == p + 1 for p in range(start, stop)
        )

    def _follow_tails(self, tail: int, arena_tail: int) -> None:
        """Continue where the engine reads: after the records queued at its tail, and at its arena
        tail if our arena head is out of its reach. At a start, or once the tails contradicted our
        heads for longer than any engine takes to put its word back."""
        r, g = self.region, self.geometry
        head = tail
        while head < tail + g.request_slots and r.record_seq(head) == head + 1:
            head += 1
        if head != self.head:
            log.error("the engine reads the request ring at %d, %d records queued: continuing at %d, not %d",
                      tail, head - tail, head, self.head)  # fmt: skip
            self.head = head
            r.doorbell("req_head", head)
        if not 0 <= self.arena_head - arena_tail <= g.arena_tokens:
            log.error("the engine's arena tail is %d, out of reach of our arena head %d: continuing there",
                      arena_tail, self.arena_head)  # fmt: skip
            self.arena_head = arena_tail
            r.store("arena_head", arena_tail)

    def _fault(self, message: str) -> None:
        """Count and log a ring word we did not trust; a standing one counts and is logged once."""
        if message not in self._faults_logged:
            self.faults += 1
            log.error("shared region: %s", message)
            self._faults_logged.add(message)
