"""How the loop's Triton kernels touch the shared ring region, and the clock they stamp it with.

The region is host memory mapped into the GPU and written by another process (the front end), so
words that hand data from one side to the other need ordering at system scope (docs/protocol.md,
"Publication order"): a consumer acquires the word that publishes a payload before reading it, a
producer release-stores the word that publishes a payload after writing it. With ON_GPU these are
inline PTX (`ld.acquire.sys`, `st.release.sys`, `fence.acq_rel.sys`, `%globaltimer`); without
(Triton's CPU interpreter, which has no inline assembly and no reordering) plain loads and stores,
and the clock is a one-element tensor the launcher fills with the host's monotonic clock.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def snap_ring_word(src, dst, ON_GPU: tl.constexpr):
    """dst (device memory) = the ring's u64 word at src (scalars), read by one thread: the ring is host
    memory, and reads of one word from every warp of a program go over the bus one warp after another
    (H100: about 2.4 us a warp for the schedule's two dependent rounds). The caller puts a CTA barrier
    before anyone reads dst."""
    if ON_GPU:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; .reg .b64 v; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p ld.volatile.global.u64 v, [$1]; @p st.global.u64 [$2], v; mov.u32 $0, 0; }",
            "=r,l,l", [src, dst], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        tl.store(dst, tl.load(src, volatile=True))


@triton.constexpr_function
def snap_tails_index(block_r, block_d):
    """Where schedule's snap keeps req_tail and arena_tail (its last two words), after take_records'
    words: for the kernel and for DeviceScheduler, which sizes the snap and sets them from the ring
    before the first launch."""
    return 2 + 3 * block_r + block_d


@triton.jit
def snap_tails(snap_ptr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """req_tail and arena_tail in the snap: the program's own words (nothing else writes them while
    the loop runs), so it reads them there, not over the bus."""
    return snap_ptr + snap_tails_index(BLOCK_R, BLOCK_D)


@triton.jit
def snap_seq_words(records, tail, dst, N: tl.constexpr, REQ_SLOTS: tl.constexpr, REC_BYTES: tl.constexpr,
                   ON_GPU: tl.constexpr):  # fmt: skip
    """dst[r] = the seq word (first u64) of the record at position tail + r, r < N, acquired: thread r of
    the first warp loads record r, so the N acquires overlap (one thread's acquires would follow one
    another over the bus, and every warp's reads of the ring go one warp after another). `records`
    (u64 words) is the ring's record section, `dst` (u64, device memory) the snap; a CTA barrier comes
    before anyone reads dst."""
    tl.static_assert(N <= 32, "one record per thread of the first warp")
    tl.static_assert(REC_BYTES % 8 == 0, "records are whole u64 words")
    if ON_GPU:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; .reg .u64 i, a, v; mov.u32 t, %tid.x; setp.lt.u32 p, t, $4; "
            "cvt.u64.u32 i, t; add.u64 i, i, $2; rem.u64 i, i, $5; mul.lo.u64 i, i, $6; add.u64 a, $1, i; "
            "@p ld.acquire.sys.global.u64 v, [a]; "
            "cvt.u64.u32 i, t; shl.b64 i, i, 3; add.u64 i, i, $3; @p st.global.u64 [i], v; mov.u32 $0, 0; }",
            "=r,l,l,l,r,l,l",
            [records.to(tl.int64), tail, dst.to(tl.int64), tl.full([], N, tl.int32), tl.full([], REQ_SLOTS, tl.int64),
             tl.full([], REC_BYTES, tl.int64)],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        offs = tl.arange(0, N)
        tl.store(dst + offs, tl.load(records + ((tail + offs) % REQ_SLOTS) * (REC_BYTES // 8), volatile=True))


@triton.jit
def store_release(ptr, value, ON_GPU: tl.constexpr, mask=None):
    """Release-store of u64 words the other side polls, where `mask` (everywhere when None). The
    caller puts a CTA barrier first, so every thread's earlier reads and writes are ordered before
    the store by cumulativity. The ring is host memory over PCIe, where system-scope atomics are not
    supported (compute-sanitizer flags them), so a publication is a release store, not an exchange.
    Every thread holding a lane runs the asm (inline asm is not deduplicated): the same value each."""
    if ON_GPU:
        if mask is None:
            tl.inline_asm_elementwise(
                "st.release.sys.global.u64 [$1], $2; mov.u32 $0, 0;",
                "=r,l,l",
                [ptr, value.to(tl.int64)],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $3, 0; "
                "@p st.release.sys.global.u64 [$1], $2; mov.u32 $0, 0; }",
                "=r,l,l,r",
                [ptr, value.to(tl.int64), mask.to(tl.int32)],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
    else:
        tl.store(ptr, value.to(tl.int64), mask=mask)


@triton.jit
def fence_sys(ON_GPU: tl.constexpr):
    """Every thread: its earlier stores to the ring are visible to the host before its later ones.
    Run before the barrier that precedes a publication: a warp's release store is not relied on to
    order another warp's stores to host memory (on the H100 a channel's count became visible before
    its token and stamp, and the client read zeros; this is the likely cause)."""
    if ON_GPU:
        tl.inline_asm_elementwise(
            "fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def now_ns(host_clock_ptr, clock_offset_ptr, ON_GPU: tl.constexpr):
    """The loop's clock in ns: %globaltimer + clock_offset_ns[0] (the host clock's offset, measured
    at boot) on the GPU; host_clock_ns[0], stored by the launcher just before the launch, otherwise."""
    if ON_GPU:
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
        return t + tl.load(clock_offset_ptr)
    else:
        return tl.load(host_clock_ptr)


@triton.jit
def phase_stamp(stamps_ptr, i: tl.constexpr, STAMPS: tl.constexpr):
    """With STAMPS (a GPU profile, never in serving): once every warp is here, stamps[i] = the SM's
    cycle counter; stamps[0] also gets %globaltimer at 62 and the last stamp at 63, to convert cycles."""
    if STAMPS:
        tl.debug_barrier()
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
        tl.store(stamps_ptr + i, t)
        g = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
        tl.store(stamps_ptr + 62 + (i > 0), g)
