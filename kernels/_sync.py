"""Inter-CTA signalling inside one launch, without atomics: single-writer ready flags that
hold a launch generation (so they never need resetting between launches, CUDA-graph
replays included), and a bulk L2 prefetch.

A flag is written by exactly one thread per launch (release, after a CTA barrier that
orders the CTA's data stores before it) and polled by its readers (acquire). Its value is
the launch's generation + 1, where the generation is a word the previous launch left
behind (`publish_generation`), so a flag written by the previous launch never reads as
ready. The kernels that use these run all their CTAs co-resident (cooperative launch) and
a CTA waits only after it has done everything other CTAs may wait for."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@cute.jit
def read_generation(sync: cute.Tensor, tidx: Int32, bid: Int32) -> Int32:
    """The launch's target flag value (generation + 1). Every thread reads the word, then
    a CTA barrier, then thread 0 marks the CTA as arrived (sync[1 + bid] = target), so no
    thread of the CTA can see the next generation published by `publish_generation`."""
    gen = cute.arch.load(sync.iterator, Int32, sem="relaxed", scope="gpu")
    target = gen + 1
    cute.arch.sync_threads()
    if tidx == 0:
        cute.arch.store(sync.iterator + 1 + bid, target, sem="relaxed", scope="gpu")
    return target


@cute.jit
def publish_generation(sync: cute.Tensor, target: Int32, nblk: Int32, lane: Int32):
    """One warp of one CTA, at its end: once every CTA of the launch has arrived (read the
    generation), sync[0] = target, the generation the next launch reads."""
    for i in cutlass.range(lane, nblk, 32):
        pending = Int32(1)
        while pending != 0:
            v = cute.arch.load(sync.iterator + 1 + i, Int32, sem="relaxed", scope="gpu")
            pending = Int32(v != target)
    cute.arch.sync_warp()
    if lane == 0:
        cute.arch.store(sync.iterator, target, sem="relaxed", scope="gpu")


@cute.jit
def set_flag(flags: cute.Tensor, idx: Int32, target: Int32, tidx: Int32):
    """Whole CTA: the CTA's stores so far become visible to whoever acquires flags[idx]."""
    cute.arch.sync_threads()
    if tidx == 0:
        cute.arch.store(flags.iterator + idx, target, sem="release", scope="gpu")


@cute.jit
def wait_flags(flags: cute.Tensor, base: Int32, n: Int32, target: Int32):
    """Whole warp: spin until flags[base .. base + n) (n <= 32) all hold target (acquire:
    the writers' data is visible to the warp afterwards)."""
    lane = cute.arch.lane_idx()
    ptr = flags.iterator + (base + cutlass.min(lane, n - 1))
    pending = Int32(1)
    while pending != 0:
        v = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
        pending = Int32(cute.arch.vote_ballot_sync(v != target))
    cute.arch.sync_warp()


@dsl_user_op
def prefetch_l2(ptr, nbytes, *, loc=None, ip=None):
    """cp.async.bulk.prefetch.L2: nbytes (a multiple of 16, 16-byte aligned address) from
    global memory into L2, no destination, nothing to wait for."""
    addr = Int64(ptr.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip)
    llvm.inline_asm(
        None,
        [addr, Int32(nbytes).ir_value(loc=loc, ip=ip)],
        "cp.async.bulk.prefetch.L2.global [$0], $1;",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
