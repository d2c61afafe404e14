"""Inter-CTA signalling inside one launch, without atomics or any reset between launches
(CUDA-graph replays included), and a bulk L2 prefetch.

Ready flags are launch counters. A flag has one writer per launch, which bumps it
(`bump_flag`: the value it read at the start of its work + 1, released after a CTA barrier
that orders the CTA's data stores before it). A reader waits for the count it expects
(`wait_flags`, acquire); it keeps that expectation in a word of its own (`seen`): it loads
the word at the start of its work and stores it + 1 afterwards, whether or not it had to
wait, so writer and reader advance in lock step, one count per launch, from zero. The
kernels that use these run all their CTAs co-resident (cooperative launch) and a CTA waits
only after it has done all the work other CTAs may wait for."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@cute.jit
def bump_flag(flags: cute.Tensor, idx: Int32, old: Int32, tidx: Int32):
    """Whole CTA: the CTA's stores so far become visible to whoever acquires
    flags[idx] == old + 1 (old: the flag's value before this launch, read by thread 0)."""
    cute.arch.sync_threads()
    if tidx == 0:
        cute.arch.store(flags.iterator + idx, old + 1, sem="release", scope="gpu")


@cute.jit
def wait_flags(flags: cute.Tensor, base: Int32, n: Int32, target: Int32, backoff_ns: cutlass.Constexpr):
    """Whole warp: spin until flags[base .. base + n) (n <= 32) all reached target (acquire:
    the writers' data is visible to the warp afterwards); sleeps between polls so spinning
    warps leave the L2 and issue slots to the ones still loading."""
    lane = cute.arch.lane_idx()
    ptr = flags.iterator + (base + cutlass.min(lane, n - 1))
    v = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
    pending = Int32(cute.arch.vote_ballot_sync((v - target) < 0))
    while pending != 0:
        nanosleep(backoff_ns)
        v = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
        pending = Int32(cute.arch.vote_ballot_sync((v - target) < 0))
    cute.arch.sync_warp()


@dsl_user_op
def nanosleep(ns, *, loc=None, ip=None):
    llvm.inline_asm(None, [Int32(ns).ir_value(loc=loc, ip=ip)], "nanosleep.u32 $0;", "r",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


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
