"""Device code shared by the Ada-design BGMV kernels: the no-atomics scan that collects an
(adapter, expert) bin's pairs in increasing p (shrink and expand bin schedules) and the
shrink's per-stage dot products (pair and bin schedules: one expression, the same bits)."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from kernels._scan import cta_prefix


@cute.jit
def scan_round(topk_ids: cute.Tensor, lora: cute.Tensor, sList: cute.Tensor, sW: cute.Tensor,
                l: cutlass.Int32, e: cutlass.Int32, tpos: cutlass.Int32, lo: cutlass.Int32,
                base: cutlass.Int32, room: cutlass.Int32, T: cutlass.Int32, K: cutlass.Int32,
                tidx: cutlass.Int32, NT: cutlass.Constexpr, NW: cutlass.Constexpr,
                U: cutlass.Constexpr) -> cutlass.Int32:
    """One scan round over tokens tpos .. tpos + NT*U - 1 (thread i: U consecutive tokens).
    The bin's pairs get ranks 0, 1, ... in increasing p; those with rank in [lo, lo + room)
    are written to sList[base + rank - lo]. Returns the round's total (block uniform).
    Caller: sync_threads before (sW reuse); the trailing sync here publishes sList."""
    warp = tidx // 32
    lane = tidx % 32
    t0 = tpos + tidx * U
    lv = cute.make_rmem_tensor((U,), cutlass.Int32)
    for u in cutlass.range_constexpr(U):
        lv[u] = lora[cutlass.min(t0 + u, T - 1)]
    msk = cute.make_rmem_tensor((U,), cutlass.Int32)
    c = cutlass.Int32(0)
    for u in cutlass.range_constexpr(U):
        m = cutlass.Int32(0)
        if t0 + u < T and lv[u] == l:
            ev = cute.make_rmem_tensor((8,), cutlass.Int32)
            for j in cutlass.range_constexpr(8):
                ev[j] = topk_ids[t0 + u, cutlass.min(cutlass.Int32(j), K - 1)]
            for j in cutlass.range_constexpr(8):
                if j < K and ev[j] == e:
                    m = m | cutlass.Int32(1 << j)
        msk[u] = m
        c = c + cute.arch.popc(m)
    r, total = cta_prefix(c, sW, warp, lane, NW)
    if c > 0:
        for u in cutlass.range_constexpr(U):
            m = msk[u]
            if m != 0:
                for j in cutlass.range_constexpr(8):
                    if (m >> j) & 1:
                        if r >= lo and r < lo + room:
                            sList[base + r - lo] = (t0 + u) * K + j
                        r = r + 1
    cute.arch.sync_threads()
    return total


@cute.jit
def stage_dots(sA: cute.Tensor, sX: cute.Tensor, ra: cute.Tensor, rx: cute.Tensor,
               acc: cute.Tensor, slot: cutlass.Int32, hs: cutlass.Int32, n: cutlass.Int32,
               nch: cutlass.Int32, warp: cutlass.Int32, lane: cutlass.Int32,
               RW: cutlass.Constexpr, GE: cutlass.Constexpr, HC: cutlass.Constexpr):
    """acc[m * RW + rr] += the ring stage's part of dot(x row m, A row warp * RW + rr) for the
    n <= GE pairs: lane owns the 8-element vectors lane + 32 i, products in increasing h."""
    for ii in cutlass.range_constexpr(HC // 256):
        cl = lane + 32 * ii                  # vector within the stage
        if hs * (HC // 8) + cl < nch:
            for rr in cutlass.range_constexpr(RW):
                va = cute.local_tile(sA[warp * RW + rr, None, slot], (8,), (cl,))
                ra_r = cute.local_tile(ra, (8,), (rr,))
                ra_r.store(va.load().to(cutlass.Float32))
            for m in cutlass.range_constexpr(GE):
                if m < n:
                    vx = cute.local_tile(sX[m, None, slot], (8,), (cl,))
                    rx.store(vx.load().to(cutlass.Float32))
                    for rr in cutlass.range_constexpr(RW):
                        acc_v = acc[m * RW + rr]
                        for v in cutlass.range_constexpr(8):
                            acc_v = acc_v + rx[v] * ra[rr * 8 + v]
                        acc[m * RW + rr] = acc_v
