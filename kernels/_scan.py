"""CTA-wide prefix sum of one count per thread (traced inside @cute.jit code): the compaction
step of the BGMV bin scans of both designs that collect a bin's pairs without atomics."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def cta_prefix(cnt: cutlass.Int32, sW: cute.Tensor, warp: cutlass.Int32, lane: cutlass.Int32,
               NW: cutlass.Constexpr):
    """(exclusive prefix of cnt over the CTA's threads in (warp, lane) order, CTA total).
    sW holds NW ints; one CTA barrier inside; the caller must not write sW again before the
    next barrier."""
    v = cnt                          # inclusive prefix over the warp
    for d in cutlass.range_constexpr(5):
        nb = cute.arch.shuffle_sync_up(v, offset=1 << d)
        if lane >= (1 << d):
            v = v + nb
    if lane == 31:
        sW[warp] = v
    cute.arch.sync_threads()
    wbase = cutlass.Int32(0)
    total = cutlass.Int32(0)
    for w in cutlass.range_constexpr(NW):
        tw = sW[w]
        if w < warp:
            wbase = wbase + tw
        total = total + tw
    return wbase + v - cnt, total
