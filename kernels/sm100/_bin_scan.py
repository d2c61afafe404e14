"""Device code shared by the sm100 BGMV kernels (shrink and expand): the non-tensor bulk copy
and the no-atomics collection of an (adapter, expert) bin's pairs in increasing p."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm as _llvm
from cutlass._mlir.dialects import nvvm as _nvvm

_MAX_K = 8


def bulk_g2s(dst_smem, src_gmem, mbar, nbytes):
    """cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes (no tensor map)."""
    dst = _llvm.addrspacecast(_llvm.PointerType.get(7), dst_smem.llvm_ptr)
    _nvvm.cp_async_bulk_shared_cluster_global(
        dst, src_gmem.llvm_ptr, mbar.llvm_ptr, cutlass.Int32(nbytes).ir_value())


@cute.jit
def scan_pairs(topk_ids: cute.Tensor, lora: cute.Tensor, plist: cute.Tensor, ptot: cute.Tensor,
               bl, be, p_lo, T, K, P, tidx, warp, lane, C: cutlass.Constexpr,
               NT: cutlass.Constexpr, NW: cutlass.Constexpr, U: cutlass.Constexpr):
    """Whole CTA: collect the pairs p >= p_lo of bin (bl, be) into plist, increasing p,
    until the window (C entries) is full or the table ends. Returns (fill, next p_lo).
    Uniform. NT threads in NW warps, U tokens per thread per round."""
    lt_mask = cute.arch.lanemask_lt()
    fill = cutlass.Int32(0)
    while fill < C and p_lo < P:
        t_lo = p_lo // K
        masks = []
        for u in cutlass.range_constexpr(U):
            t = t_lo + (u * NT) + tidx
            mask = cutlass.Int32(0)
            if t < T:
                lt = lora[t]
                for j in cutlass.range_constexpr(_MAX_K):
                    if j < K:
                        ej = topk_ids[(t, j)]
                        if lt == bl and ej == be and t * K + j >= p_lo:
                            mask = mask | (1 << j)
            masks.append(mask)
        # warp ballots per (u, j): matches of lower lanes and of the whole warp
        lowers = []
        for u in cutlass.range_constexpr(U):
            below = cutlass.Int32(0)
            wtot = cutlass.Int32(0)
            for j in cutlass.range_constexpr(_MAX_K):
                bal = cute.arch.vote_ballot_sync(((masks[u] >> j) & 1) != 0)
                below = below + cute.arch.popc(bal & lt_mask)
                wtot = wtot + cute.arch.popc(bal)
            lowers.append(below)
            if lane == 0:
                ptot[u * NW + warp] = wtot
        cute.arch.barrier()
        total = cutlass.Int32(0)
        for u in cutlass.range_constexpr(U):
            base = fill + total
            for w in cutlass.range_constexpr(NW):
                v = ptot[u * NW + w]
                if w < warp:
                    base = base + v
                total = total + v
            idx = base + lowers[u]
            t = t_lo + (u * NT) + tidx
            for j in cutlass.range_constexpr(_MAX_K):
                if ((masks[u] >> j) & 1) != 0:
                    if idx < C:
                        plist[idx] = t * K + j
                    idx = idx + 1
        cute.arch.barrier()
        if fill + total > C:
            p_lo = plist[C - 1] + 1
            fill = cutlass.Int32(C)
        else:
            p_lo = (t_lo + U * NT) * K
            fill = fill + total
    return fill, p_lo
