"""Device code shared by the BGMV bin kernels of every design that scans tokens (Ada, sm90):
the no-atomics scan that collects an (adapter, expert) bin's pairs in increasing p. A bin's
list has a fixed capacity; a round whose pairs do not all fit is scanned again with a rank
window (lo), so no routing (repeated expert ids included) overflows it."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute


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
    v = c
    for d in cutlass.range_constexpr(5):
        nb = cute.arch.shuffle_sync_up(v, 1 << d)
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
    r = wbase + v - c
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
def scan_step(topk_ids: cute.Tensor, lora: cute.Tensor, sList: cute.Tensor, sW: cute.Tensor,
              l: cutlass.Int32, e: cutlass.Int32, tpos: cutlass.Int32, lo: cutlass.Int32,
              cnt: cutlass.Int32, cap: cutlass.Int32, T: cutlass.Int32, K: cutlass.Int32,
              tidx: cutlass.Int32, NT: cutlass.Constexpr, NW: cutlass.Constexpr,
              U: cutlass.Constexpr):
    """One scan_round appended to a list of cnt <= cap entries, then the cursor advanced:
    the next token round, or the same round from rank lo on when its pairs did not all fit.
    Returns (tpos, lo, cnt)."""
    cute.arch.sync_threads()
    total = scan_round(topk_ids, lora, sList, sW, l, e, tpos, lo, cnt, cap - cnt, T, K, tidx,
                       NT, NW, U)
    take = cutlass.min(total - lo, cap - cnt)
    cnt = cnt + take
    if lo + take == total:
        tpos = tpos + NT * U
        lo = cutlass.Int32(0)
    else:
        lo = lo + take
    return tpos, lo, cnt
