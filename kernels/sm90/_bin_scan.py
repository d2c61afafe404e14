"""Device code shared by the sm90 BGMV bin kernels (shrink and expand): collecting the pairs
of one (adapter, expert) bin from the pair table, without atomics, and the base pointer of a
bin's weight slab.

Both kernels call `collect_round` once per round of NT * SU pairs and then `keep_remainder`
after processing the full groups; the list order (increasing p) and every value are what the
kernels computed inline before (bit-identical results)."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def collect_round(lora: cute.Tensor, topk_ids: cute.Tensor, l_b: cutlass.Int32,
                  e_b: cutlass.Int32, base: cutlass.Int32, P: cutlass.Int32, K: cutlass.Int32,
                  nl: cutlass.Int32, slist: cute.Tensor, swc: cute.Tensor, tidx: cutlass.Int32,
                  warp: cutlass.Int32, lane: cutlass.Int32, NT: cutlass.Constexpr,
                  NW: cutlass.Constexpr, SU: cutlass.Constexpr):
    """Append to slist[nl:] the pairs p in [base, base + NT * SU) of bin (l_b, e_b), in
    increasing p (u-major, then warp, then lane: warp ballots + popc, per-warp counts in swc
    (SU * NW ints)); returns the new list length (CTA-uniform). All index loads of the round
    are issued before the first ballot. Ends with a CTA barrier (the list is readable)."""
    hit = cute.make_rmem_tensor((SU,), cutlass.Int32)
    for u in cutlass.range_constexpr(SU):
        p = base + u * NT + tidx
        pc = cutlass.min(p, P - 1)
        t = pc // K
        j = pc - t * K
        lo = lora[t]
        ex = topk_ids[t, j]
        hit[u] = cutlass.Int32((p < P) & (lo == l_b) & (ex == e_b))
    for u in cutlass.range_constexpr(SU):
        bal = cute.arch.vote_ballot_sync(hit[u] != 0)
        if lane == 0:
            swc[u * NW + warp] = cute.arch.popc(cutlass.Int32(bal))
    cute.arch.sync_threads()
    lt = cutlass.Int32(cute.arch.lanemask_lt())
    run = nl
    for u in cutlass.range_constexpr(SU):
        mine = run
        for ww in cutlass.range_constexpr(NW):
            c = swc[u * NW + ww]
            mine = cutlass.Int32(cutlass.select_(ww < warp, mine + c, mine))
            run = run + c
        bal = cute.arch.vote_ballot_sync(hit[u] != 0)
        if hit[u] != 0:
            slist[mine + cute.arch.popc(cutlass.Int32(bal) & lt)] = base + u * NT + tidx
    cute.arch.sync_threads()
    return run


@cute.jit
def keep_remainder(slist: cute.Tensor, nl: cutlass.Int32, ng: cutlass.Int32,
                   G: cutlass.Constexpr, tidx: cutlass.Int32):
    """After the ng full groups of G pairs were processed: move the remaining nl - ng * G
    (< G <= threads) list entries to the front; returns their count."""
    rem = nl - ng * G
    if ng > 0:
        mv = cutlass.Int32(0)
        if tidx < rem:
            mv = slist[ng * G + tidx]
        cute.arch.sync_threads()
        if tidx < rem:
            slist[tidx] = mv
        cute.arch.sync_threads()
    return rem


def slab_ptr(w: cute.Tensor, l_b, e_b, vec: int):
    """Base pointer of the (adapter, expert) slab w[l_b, e_b] of an [L, E, rows, cols] weight
    tensor. The bin kernels address a slab's rows from it with 32-bit offsets (prepare time
    rejects slabs of 2^31 elements or more) instead of indexing the 4-mode tensor per copy."""
    return w.iterator + cute.assume(cutlass.Int64(l_b) * cutlass.Int64(w.stride[0])
                                    + cutlass.Int64(e_b) * cutlass.Int64(w.stride[1]),
                                    divby=vec)
