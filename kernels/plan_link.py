"""Rank 1 of a tensor-parallel loop follows rank 0's step plan (docs/tensor_parallel.md).

Each rank holds five int32 link words; the peer writes some of them over NVLink:
- PLAN (rank 1's): the number of the last plan rank 0 published;
- ACK (rank 0's): the number of the last plan rank 1 copied;
- EXIT (rank 1's): 1 once rank 0's loop has ended;
- SEQ (each its own): rank 0's plan count, or the last plan rank 1 copied;
- TAKEN (rank 1's own): the plan `await_plan` saw, which the copies that follow it hold.

Rank 0 waits for the acknowledgement of its last plan before its schedule rewrites the step inputs
(`await_ack`), publishes after it (`publish_plan`), and says so when its loop ends (`publish_exit`).
Rank 1 waits for a plan or the exit (`await_plan`), copies rank 0's inputs (`copy_words`), then
acknowledges or stops (`finish_follow`). A plan published before the exit is still followed, so
the exit takes effect once every plan is. Stores the peer reads are releases at system scope, and
loads of what the peer wrote acquires, so the words order the inputs between the GPUs.
"""

from __future__ import annotations

import triton
import triton.language as tl

PLAN, ACK, EXIT, SEQ, TAKEN = 0, 1, 2, 3, 4
LINK_WORDS = 5


@triton.jit
def _acquire(ptr):
    return tl.atomic_add(ptr, 0, sem="acquire", scope="sys")


@triton.jit
def _await_ack_kernel(words_ptr):
    seq = tl.load(words_ptr + 3)
    acked = _acquire(words_ptr + 1)
    while acked < seq:
        acked = _acquire(words_ptr + 1)


@triton.jit
def _publish_plan_kernel(words_ptr, peer_words_ptr):
    seq = tl.load(words_ptr + 3) + 1
    tl.store(words_ptr + 3, seq)
    tl.atomic_xchg(peer_words_ptr + 0, seq, sem="release", scope="sys")


@triton.jit
def _publish_exit_kernel(keep_running_ptr, peer_words_ptr):
    if tl.load(keep_running_ptr) == 0:
        tl.atomic_xchg(peer_words_ptr + 2, 1, sem="release", scope="sys")


@triton.jit
def _await_plan_kernel(words_ptr):
    seq = tl.load(words_ptr + 3)
    waiting = (_acquire(words_ptr + 0) <= seq) & (_acquire(words_ptr + 2) == 0)
    while waiting:
        waiting = (_acquire(words_ptr + 0) <= seq) & (_acquire(words_ptr + 2) == 0)
    tl.store(words_ptr + 4, _acquire(words_ptr + 0))


@triton.jit
def _copy_words_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # Uncached: the same addresses held the last plan's values.
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n, cache_modifier=".cv"), mask=offs < n)


@triton.jit
def _finish_follow_kernel(words_ptr, peer_words_ptr, keep_running_ptr, bucket_index_ptr, no_bucket):
    plan = tl.load(words_ptr + 4)
    if plan > tl.load(words_ptr + 3):
        tl.store(words_ptr + 3, plan)
        tl.store(keep_running_ptr, 1)
        tl.atomic_xchg(peer_words_ptr + 1, plan, sem="release", scope="sys")
    else:  # no new plan, so the exit woke it: rank 0's loop ended, and this one ends without a forward
        tl.store(keep_running_ptr, 0)
        tl.store(bucket_index_ptr, no_bucket)


def await_ack(words) -> None:
    _await_ack_kernel[(1,)](words, num_warps=1)


def publish_plan(words, peer_words) -> None:
    _publish_plan_kernel[(1,)](words, peer_words, num_warps=1)


def publish_exit(keep_running, peer_words) -> None:
    _publish_exit_kernel[(1,)](keep_running, peer_words, num_warps=1)


def await_plan(words) -> None:
    _await_plan_kernel[(1,)](words, num_warps=1)


def copy_words(src, dst, block: int = 1024) -> None:
    """dst[:] = src[:] (same dtype and size, contiguous; src may be the peer's memory)."""
    if (
        src.dtype != dst.dtype
        or src.numel() != dst.numel()
        or not (src.is_contiguous() and dst.is_contiguous())
    ):
        raise ValueError("copy_words: src and dst must be contiguous tensors of one dtype and size")
    n = src.numel()
    if n:
        _copy_words_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, num_warps=4)


def finish_follow(words, peer_words, keep_running, bucket_index, no_bucket: int) -> None:
    _finish_follow_kernel[(1,)](words, peer_words, keep_running, bucket_index, no_bucket, num_warps=1)
