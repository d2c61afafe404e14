"""Device code shared by the sm90 BGMV bin kernels (shrink and expand): collecting the pairs
of one (adapter, expert) bin from the pair table, without atomics, and the base pointer of a
bin's weight slab.

Both kernels collect a bin's pairs in token rounds (`collect_tokens`: 4 * NT tokens, all their
slots) and fall back to pair rounds (`collect_round`: NT * SU pairs) for a round whose hits would
overflow the list; after each round they process the full groups and `keep_remainder`."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from kernels._scan import cta_prefix


def routed(lo, ex, L, E):
    """A pair is routed (live) when its adapter lo and expert ex are in range: lora -1 (and
    any id out of range) skips it. The one predicate of every sm90 BGMV schedule."""
    return (lo >= 0) & (lo < L) & (ex >= 0) & (ex < E)


def _bit(b: int) -> int:
    """1 << b as an int32 constant (bit 31 is the sign bit)."""
    v = 1 << b
    return v - (1 << 32) if v >= (1 << 31) else v


@cute.jit
def collect_round(lora: cute.Tensor, topk_ids: cute.Tensor, l_b: cutlass.Int32,
                  e_b: cutlass.Int32, base: cutlass.Int32, P: cutlass.Int32, K: cutlass.Int32,
                  nl: cutlass.Int32, slist: cute.Tensor, swc: cute.Tensor, tidx: cutlass.Int32,
                  warp: cutlass.Int32, lane: cutlass.Int32, NT: cutlass.Constexpr,
                  NW: cutlass.Constexpr, SU: cutlass.Constexpr):
    """Append to slist[nl:] the pairs p in [base, base + NT * SU) of bin (l_b, e_b) (thread
    tidx tests p = base + u * NT + tidx, u = 0 .. SU-1; all index loads of the round in flight
    together); returns the new list length (CTA-uniform). The list order is deterministic
    (u-major, then warp, then lane), and no result depends on it: a pair's bits do not depend
    on the tile row or group it lands in. swc holds SU * NW + 1 ints. Ends with a CTA barrier
    (the list is readable)."""
    T = P // K
    p0 = base + tidx
    t = p0 // K                      # one division per round; then stepped by NT
    j = p0 - t * K
    ts = NT // K
    js = NT - ts * K
    bits = cutlass.Int32(0)
    for u in cutlass.range_constexpr(SU):
        tc = cutlass.min(t, T - 1)
        lo = lora[tc]
        ex = topk_ids[tc, j]
        hit = (t < T) & (lo == l_b) & (ex == e_b)
        bits = bits | cutlass.Int32(cutlass.select_(hit, _bit(u), 0))
        t = t + ts
        j = j + js
        wrap = j >= K
        j = cutlass.Int32(cutlass.select_(wrap, j - K, j))
        t = cutlass.Int32(cutlass.select_(wrap, t + 1, t))
    for u in cutlass.range_constexpr(SU):
        bal = cute.arch.vote_ballot_sync(((bits >> u) & 1) != 0)
        if lane == 0:
            swc[u * NW + warp] = cute.arch.popc(cutlass.Int32(bal))
    cute.arch.sync_threads()
    # warp 0: exclusive prefix of the SU * NW counts (u-major) in place, total at the end
    NV = SU * NW
    V = (NV + 31) // 32
    if warp == 0:
        vals = cute.make_rmem_tensor((V,), cutlass.Int32)
        tot = cutlass.Int32(0)
        for v in cutlass.range_constexpr(V):
            idx = lane * V + v
            vals[v] = cutlass.Int32(0)
            if idx < NV:
                vals[v] = swc[idx]
            tot = tot + vals[v]
        x = tot
        for d in cutlass.range_constexpr(5):
            y = cute.arch.shuffle_sync_up(x, offset=1 << d)
            if lane >= (1 << d):
                x = x + y
        run = x - tot
        for v in cutlass.range_constexpr(V):
            idx = lane * V + v
            if idx < NV:
                swc[idx] = run
            run = run + vals[v]
        if lane == 31:
            swc[NV] = x
    cute.arch.sync_threads()
    lt = cutlass.Int32(cute.arch.lanemask_lt())
    for u in cutlass.range_constexpr(SU):
        on = ((bits >> u) & 1) != 0
        bal = cute.arch.vote_ballot_sync(on)
        if on:
            slist[nl + swc[u * NW + warp] + cute.arch.popc(cutlass.Int32(bal) & lt)] = p0 + u * NT
    run = nl + swc[NV]
    cute.arch.sync_threads()
    return run


@cute.jit
def collect_tokens(lora: cute.Tensor, topk_ids: cute.Tensor, l_b: cutlass.Int32,
                   e_b: cutlass.Int32, tbase: cutlass.Int32, T: cutlass.Int32,
                   K: cutlass.Int32, nl: cutlass.Int32, slist: cute.Tensor, swc: cute.Tensor,
                   tidx: cutlass.Int32, warp: cutlass.Int32, lane: cutlass.Int32,
                   NT: cutlass.Constexpr, NW: cutlass.Constexpr, CAP: cutlass.Constexpr):
    """Token round: append to slist[nl:] the pairs t * k + j of bin (l_b, e_b) for the tokens
    t in [tbase, tbase + 4 * NT) (thread tidx: t = tbase + u * NT + tidx, u < 4; a token's
    expert ids are loaded only when its adapter is l_b). A round covers k times the pairs of
    a pair round (collect_round) with the same three CTA barriers. Returns (new length,
    fits): when the round's hits do not fit in the list (CAP entries; with CAP >= 4 * NT + G
    only possible with repeated expert ids in a token) nothing is appended and fits is False,
    and the caller collects the round's pairs with pair rounds instead. Ends with a CTA
    barrier."""
    hm = cutlass.Int32(0)            # bit 8u + j: pair (token u, slot j) hits
    for u in cutlass.range_constexpr(4):
        t = tbase + u * NT + tidx
        tc = cutlass.min(t, T - 1)
        if (t < T) & (lora[tc] == l_b):
            for j in cutlass.range_constexpr(8):
                if j < K:
                    if topk_ids[tc, j] == e_b:
                        hm = hm | _bit(8 * u + j)
    excl, tot = cta_prefix(cute.arch.popc(hm), swc, warp, lane, NW)
    fits = nl + tot <= CAP
    if fits:
        pos = nl + excl
        for b in cutlass.range_constexpr(32):
            if ((hm >> b) & 1) != 0:
                slist[pos] = (tbase + (b // 8) * NT + tidx) * K + (b % 8)
                pos = pos + 1
    cute.arch.sync_threads()
    return nl + cutlass.Int32(cutlass.select_(fits, tot, 0)), fits


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


@cute.jit
def collect_next(lora: cute.Tensor, topk_ids: cute.Tensor, l_b: cutlass.Int32,
                 e_b: cutlass.Int32, T: cutlass.Int32, K: cutlass.Int32, nl: cutlass.Int32,
                 tb: cutlass.Int32, base: cutlass.Int32, pend: cutlass.Int32,
                 pm: cutlass.Boolean, slist: cute.Tensor, swc: cute.Tensor,
                 tidx: cutlass.Int32, warp: cutlass.Int32, lane: cutlass.Int32,
                 NT: cutlass.Constexpr, NW: cutlass.Constexpr, SU: cutlass.Constexpr,
                 CAP: cutlass.Constexpr):
    """One collection round of a bin's scan, whose cursor is (tb: the token round; pm: inside
    its pair rounds, at pair base, up to pend): a token round, or, for a token round whose
    hits would overflow the list, its pairs in pair rounds. Returns (nl, tb, base, pend, pm);
    the scan is done when tb >= T. The caller runs the full groups after every round."""
    if pm:
        nl = collect_round(lora, topk_ids, l_b, e_b, base, pend, K, nl, slist, swc, tidx, warp,
                           lane, NT, NW, SU)
        base = base + NT * SU
        if base >= pend:
            pm = cutlass.Boolean(False)
            tb = tb + 4 * NT
    else:
        nl, fits = collect_tokens(lora, topk_ids, l_b, e_b, tb, T, K, nl, slist, swc, tidx,
                                  warp, lane, NT, NW, CAP)
        if fits:
            tb = tb + 4 * NT
        else:
            pm = cutlass.Boolean(True)
            base = tb * K
            pend = cutlass.min(tb + 4 * NT, T) * K
    return nl, tb, base, pend, pm


@cute.jit
def run_bin(group, lora: cute.Tensor, topk_ids: cute.Tensor, l_b: cutlass.Int32,
            e_b: cutlass.Int32, P: cutlass.Int32, K: cutlass.Int32, slist: cute.Tensor,
            swc: cute.Tensor, tidx: cutlass.Int32, warp: cutlass.Int32, lane: cutlass.Int32,
            first: cutlass.Boolean, NT: cutlass.Constexpr, NW: cutlass.Constexpr,
            SU: cutlass.Constexpr, G: cutlass.Constexpr):
    """The pairs of bin (l_b, e_b), in groups: collect them round by round (token rounds; a
    round whose hits would overflow the list is collected again in pair rounds) and call
    group(off, n, first) for each full group of G as soon as it is listed, then for the
    remainder. first: the next group finds its weight stages already issued (the caller's
    prefetch before the scan); an empty bin waits for those before the ring is reused. Ends
    with a CTA barrier. group has one call site in the round loop: it is inlined, and
    registers count."""
    nl = cutlass.Int32(0)            # pairs collected, not yet processed (CTA-uniform)
    T = P // K
    CAP = NT * SU + G
    tb = cutlass.Int32(0)
    base = cutlass.Int32(0)
    pend = cutlass.Int32(0)
    pm = cutlass.Boolean(False)
    while tb < T:
        nl, tb, base, pend, pm = collect_next(lora, topk_ids, l_b, e_b, T, K, nl, tb, base,
                                              pend, pm, slist, swc, tidx, warp, lane, NT,
                                              NW, SU, CAP)
        # full groups now; the remainder (< G) waits for the next round
        ng = nl // G
        for gi in cutlass.range(ng):
            group(gi * G, G, first)
            first = cutlass.Boolean(False)
        nl = keep_remainder(slist, nl, ng, G, tidx)
    if nl > 0:
        group(0, nl, first)
        first = cutlass.Boolean(False)
    if first:
        # an empty bin: its prefetched stages land before the ring is reused
        cute.arch.cp_async_wait_group(0)
    cute.arch.sync_threads()
