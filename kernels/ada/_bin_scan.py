"""Device code shared by the Ada-design BGMV kernels: the shrink's per-stage dot products (pair
and bin schedules: one expression, the same bits). The bin scan is kernels/_bin_scan.py."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute


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
