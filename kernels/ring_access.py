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
def load_acquire(ptr, ON_GPU: tl.constexpr):
    """Acquire-load of u64 words another process publishes with a release store: reads issued after
    it (and, after a CTA barrier, every thread's reads) see the payload written before the word."""
    if ON_GPU:
        return tl.inline_asm_elementwise(
            "ld.acquire.sys.global.u64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        return tl.load(ptr, volatile=True)


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
