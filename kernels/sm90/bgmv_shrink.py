"""sm_90a MoE-LoRA shrink (see kernels/CONTRACT_BGMV.md).

    s[p, r] = cvt(sum_h x[t, h] * a[l, e, r, h]),  p = order[q], t = p // k, j = p % k,
    l = lora[t], e = topk_ids[t, j]; 0 for skipped pairs; padding entries of `order` ignored.

Work decomposition (persistent grid, grid-stride loop over work items):
  a work item is (a group of `gs` consecutive `order` entries, a block of `warps * rw` rows
  of A). Each warp owns `rw` rows of the block and computes their dot products with the
  x rows of every entry of the group. Two shapes, chosen at run time from Q = len(order)
  (with the bin schedule on, as by default, only the small shape is compiled: see small_only):
  - small (Q < config.batched_min_entries): gs = 1, rw = 1. One pair's R rows are spread
    over R / warps CTAs and R warps, so at T <= 32 the first wave already has every A row
    load of every pair in flight (each warp streams one 2*H-byte row with `small_unroll`
    16-byte loads per lane in flight).
  - batched (Q large): gs = config.group, rw = config.rows_per_warp. Consecutive entries of
    expert-sorted order mostly share an (adapter, expert) bin: the group is split into
    passes, one per distinct bin (first unprocessed entry leads), and in a pass each A
    vector is loaded once and multiplied with the x vectors of every member entry
    (gs * rw fp32 accumulators per lane). Consecutive work items are the row blocks of
    one group, then the next group, so the bin's A stays hot in L2 across groups.
  Loads are 16-byte global vector loads (LDG.E.128) straight to registers; x re-reads by
  the CTA's warps hit L1.

Reduction order (fixed by H only): lane `lane` of a warp owns the 8-element vectors
v = lane + 32 * i (i = 0, 1, ...; v < H / 8) of the row. It accumulates, in fp32,
acc = acc + x * a over its vectors in increasing v, elements 0..7 of a vector in order
(the same expression in every shape, so the same FMA chain). The 32 lane partials are
then combined by a xor-butterfly (offsets 16, 8, 4, 2, 1). Neither gs, rw, the unroll
depth, T, k, the grid nor `order` changes the sequence, so results are bitwise
deterministic and batch-invariant. No atomics: every s element has exactly one writer.
v2 bin mode (P = T * k >= config.bin_min_pairs and config.bin_mode; bin_kernel): work item =
(bin = l * E + e over all L * E bins, row block of bin_warps * bin_rows_per_warp rows), grid
stride over a persistent grid. The CTA scans the pair table p = 0 .. P-1 in rounds of
NT * bin_scan_unroll (all index loads of a round in flight), compacts its bin's pairs into a
shared-memory list in increasing p (warp ballot + popc, per-warp counts, no atomics), and
runs every full group of bin_group pairs as soon as it exists (the remainder waits for the
next round; the last partial group at the end). A group streams A[l, e, rows, :] and the
group's gathered x rows in bin_chunk_h-element H stages through a bin_stages-deep 16-byte
cp.async (LDGSTS) ring; each A vector read from shared memory is used for every pair of
the group. Lane `lane` of the warp owning a row reads the vectors v = lane + 32 * i in
increasing i, with the same FMA expression and butterfly as run_items: bit-identical to the
pair schedule. Dead pairs (skipped adapter / expert) are zeroed by a grid-stride pass; every
pair in [0, P) is written (order is not used in bin mode).
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from kernels._cvt import widen
from kernels.sm90._bin_scan import collect_round, keep_remainder, slab_ptr

SASS_REQUIRED = ("LDG", "SHFL", "LDGSTS", "LDGDEPBAR", "VOTE")
SASS_FORBIDDEN = ("ATOM", "ATOMG", "ATOMS", "RED", "REDG", "STL", "LDL")

_DTYPES = (cutlass.Float16, cutlass.BFloat16)
_VEC = 8  # elements per 16-byte vector
_SMEM_LIMIT = 227 * 1024


def _bin_smem_bytes(c) -> int:
    nt = 32 * c.bin_warps
    ring = c.bin_stages * (c.bin_warps * c.bin_rows_per_warp + c.bin_group) * c.bin_chunk_h * 2
    return ring + 4 * (nt * c.bin_scan_unroll + c.bin_group) + 4 * c.bin_scan_unroll * c.bin_warps + 1024


@dataclass(frozen=True)
class BgmvShrinkSm90Config:
    """warps: warps per CTA (a CTA's rows = warps * rw).
    group: entries per work item in the batched shape (fp32 accumulators = group * rows_per_warp).
    rows_per_warp: A rows per warp in the batched shape.
    unroll: 32-lane h-steps whose loads are issued together, batched shape.
    small_unroll: the same for the small shape (1 entry, 1 row per warp). 12 covers a whole
        H = 2688/3072 row in one round trip (H200, perf/results/tune_memops_h200_small.json:
        T=32 50 -> 44 us with the small-only specialization, 8 -> 12).
    batched_min_entries: Q (= len(order)) from which the batched shape is used.
    num_sms, ctas_per_sm: grid size = min(work items, num_sms * ctas_per_sm). The default
    cap is far above any work-item count, i.e. one CTA per work item: the hardware block
    scheduler then balances bins of very uneven size (H200, T=256..2048: 11-14% faster than a
    persistent grid of num_sms=132; perf/results/tune_memops_h200_grid.json).
    pdl: the pair kernel (small T) lets the next kernel in the stream launch as soon as all
        its CTAs run (griddepcontrol.launch_dependents): the expand of a plan then loads its
        B weights while this kernel runs and waits for s (see BgmvExpandSm90Config.pdl)."""

    warps: int = 4
    group: int = 4
    rows_per_warp: int = 2
    unroll: int = 2
    small_unroll: int = 12
    batched_min_entries: int = 512
    num_sms: int = 65536
    ctas_per_sm: int = 3
    # ---- v2 bin mode (large T; see the module docstring)
    bin_mode: bool = True          # False: always the v1 pair schedule
    bin_min_pairs: int = 384       # P = T * k from which the bin schedule runs
    bin_warps: int = 8             # warps per bin CTA
    bin_rows_per_warp: int = 4     # A rows per warp (row block = bin_warps * this)
    bin_group: int = 6             # pairs per A stream (fp32 acc = group * rows_per_warp)
    bin_chunk_h: int = 256         # H elements per ring stage (multiple of 256)
    bin_stages: int = 4            # cp.async ring depth
    bin_scan_unroll: int = 8       # pair-table entries per thread per scan round
    bin_ctas_per_sm: int = 2
    pdl: bool = True


class BgmvShrinkSm90:
    def __init__(self, dtype, config: BgmvShrinkSm90Config = BgmvShrinkSm90Config()):
        if not BgmvShrinkSm90.can_implement(dtype, config):
            raise ValueError(f"BgmvShrinkSm90 cannot implement {dtype} with {config}")
        self.dtype = dtype
        self.cfg = config
        self.W = config.warps
        self.num_threads = 32 * config.warps
        # With the bin schedule from P >= bin_min_pairs <= batched_min_entries, this kernel
        # only runs small batches: the batched shape is not compiled in (its registers
        # would set the small shape's occupancy). Both shapes give the same bits, so a
        # padded `order` (Q >= batched_min_entries) just takes the small shape.
        self.small_only = config.bin_mode and config.bin_min_pairs <= config.batched_min_entries

    @staticmethod
    def can_implement(dtype, config: BgmvShrinkSm90Config) -> bool:
        c = config
        if dtype not in _DTYPES:
            return False
        if not (1 <= c.warps <= 32 and 1 <= c.group <= 32 and 1 <= c.rows_per_warp <= 8):
            return False
        if c.group * c.rows_per_warp > 64:  # accumulator registers per lane
            return False
        if not (1 <= c.unroll <= 8 and 1 <= c.small_unroll <= 16):
            return False
        if not (c.batched_min_entries >= 1 and c.num_sms >= 1 and c.ctas_per_sm >= 1):
            return False
        # bin mode
        nt = 32 * c.bin_warps
        if not (1 <= c.bin_warps <= 16 and 1 <= c.bin_rows_per_warp <= 8 and 1 <= c.bin_group <= 32):
            return False
        if c.bin_group * c.bin_rows_per_warp > 64 or c.bin_group > nt:
            return False
        if c.bin_chunk_h < 256 or c.bin_chunk_h % 256 or not (2 <= c.bin_stages <= 8):
            return False
        cpr = c.bin_chunk_h // _VEC
        if (c.bin_warps * c.bin_rows_per_warp * cpr) % nt:
            return False
        if not (1 <= c.bin_scan_unroll <= 32 and c.bin_min_pairs >= 1 and c.bin_ctas_per_sm >= 1):
            return False
        return _bin_smem_bytes(c) <= _SMEM_LIMIT

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, x: cute.Tensor, a: cute.Tensor, topk_ids: cute.Tensor,
                 lora: cute.Tensor, order: cute.Tensor, s: cute.Tensor,
                 stream: cuda.CUstream):
        cfg = self.cfg
        Q = order.shape[0]
        R = a.shape[2]
        # work items of both shapes; the kernel derives the shape from Q the same way
        rows_small = self.W
        rows_big = self.W * cfg.rows_per_warp
        items_small = Q * ((R + rows_small - 1) // rows_small)
        items_big = ((Q + cfg.group - 1) // cfg.group) * ((R + rows_big - 1) // rows_big)
        big = cutlass.Int32(0)
        if cutlass.const_expr(not self.small_only):
            big = cutlass.Int32(Q >= cfg.batched_min_entries)
        items = big * items_big + (1 - big) * items_small
        grid = cutlass.min(items, cfg.num_sms * cfg.ctas_per_sm)
        grid = cutlass.max(grid, 1)
        P = x.shape[0] * topk_ids.shape[1]
        use_bin = cutlass.Boolean(False)
        if cutlass.const_expr(cfg.bin_mode):
            use_bin = P >= cfg.bin_min_pairs
        if use_bin:
            rb_rows = cfg.bin_warps * cfg.bin_rows_per_warp
            b_items = a.shape[0] * a.shape[1] * ((R + rb_rows - 1) // rb_rows)
            b_grid = cutlass.max(cutlass.min(b_items, cfg.num_sms * cfg.bin_ctas_per_sm), 1)
            self.bin_kernel(x, a, topk_ids, lora, s).launch(
                grid=[b_grid, 1, 1], block=[32 * cfg.bin_warps, 1, 1], stream=stream,
                min_blocks_per_mp=cfg.bin_ctas_per_sm, preferred_smem_carveout=100)
        else:
            self.kernel(x, a, topk_ids, lora, order, s).launch(
                grid=[grid, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, x: cute.Tensor, a: cute.Tensor, topk_ids: cute.Tensor,
               lora: cute.Tensor, order: cute.Tensor, s: cute.Tensor):
        cfg = self.cfg
        Q = order.shape[0]
        if cutlass.const_expr(cfg.pdl):
            # a dependent kernel waits (griddepcontrol.wait) before it reads s
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.small_only):
            self.run_items(x, a, topk_ids, lora, order, s, 1, 1, cfg.small_unroll)
        else:
            if Q >= cfg.batched_min_entries:
                self.run_items(x, a, topk_ids, lora, order, s,
                               cfg.group, cfg.rows_per_warp, cfg.unroll)
            else:
                self.run_items(x, a, topk_ids, lora, order, s, 1, 1, cfg.small_unroll)

    @cute.jit
    def run_items(self, x: cute.Tensor, a: cute.Tensor, topk_ids: cute.Tensor,
                  lora: cute.Tensor, order: cute.Tensor, s: cute.Tensor,
                  gs: cutlass.Constexpr, rw: cutlass.Constexpr, unr: cutlass.Constexpr):
        W = self.W
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        warp = cute.arch.warp_idx()
        warp = cute.arch.make_warp_uniform(warp)
        lane = cute.arch.lane_idx()

        T = x.shape[0]
        H = x.shape[1]
        L = a.shape[0]
        E = a.shape[1]
        R = a.shape[2]
        K = topk_ids.shape[1]
        P = T * K
        Q = order.shape[0]
        nvec = H // _VEC
        nit = (nvec + 31) // 32                 # 32-lane h-steps of a row
        nsteps = (nit + unr - 1) // unr          # batches of `unr` h-steps
        rows_blk = W * rw
        n_rb = (R + rows_blk - 1) // rows_blk
        n_groups = (Q + gs - 1) // gs
        items = n_groups * n_rb

        vec_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                       num_bits_per_copy=128)
        # row views as (8-element vector, vector index)
        xv = cute.zipped_divide(x, (1, _VEC))        # ((1, 8), (T, nvec))
        av = cute.zipped_divide(a, (1, 1, 1, _VEC))  # ((1,1,1,8), (L, E, R, nvec))

        for w in cutlass.range(bid, items, nblk):
            gi = w // n_rb
            rb = w - gi * n_rb
            q0 = gi * gs
            # ---- entries of the group: pair, token, bin (-1: dead or padding)
            pv = [None] * gs
            tv = [None] * gs
            binv = [None] * gs
            rem = cutlass.Int32(0)
            for g in cutlass.range_constexpr(gs):
                q = q0 + g
                if cutlass.const_expr(gs == 1):
                    # small shape (latency bound): guess token order (p == q, what a plan
                    # without sorted_token_ids passes) so the routing loads fly together
                    # with order's instead of after it (one dependent round trip less)
                    pg = cutlass.Int32(cutlass.min(q, P - 1))
                    tg = pg // K
                    lo_g = lora[tg]
                    ex_g = topk_ids[tg, pg - tg * K]
                p = order[cutlass.min(q, Q - 1)]
                valid = (q < Q) & (p >= 0) & (p < P)
                pc = cutlass.select_(valid, p, 0)
                pc = cutlass.Int32(pc)
                t = pc // K
                j = pc - t * K
                if cutlass.const_expr(gs == 1):
                    lo = lo_g
                    ex = ex_g
                    if pc != pg:
                        lo = lora[t]
                        ex = topk_ids[t, j]
                else:
                    lo = lora[t]
                    ex = topk_ids[t, j]
                live = valid & (lo >= 0) & (lo < L) & (ex >= 0) & (ex < E)
                binv[g] = cutlass.Int32(cutlass.select_(live, lo * E + ex, -1))
                pv[g] = cutlass.Int32(cutlass.select_(valid, p, -1))
                tv[g] = t
                rem = rem | cutlass.Int32(cutlass.select_(live, 1 << g, 0))
                # valid but skipped pair: this warp zeroes its rows of s[p]
                if valid & (binv[g] < 0):
                    for i in cutlass.range_constexpr(rw):
                        r = rb * rows_blk + i * W + warp
                        if (lane == 0) & (r < R):
                            s[pc, r] = self.dtype(0.0)

            # ---- one pass per distinct bin among the live entries
            while rem != 0:
                lead_bin = cutlass.Int32(-1)
                lead_t = cutlass.Int32(0)
                for g in cutlass.range_constexpr(gs - 1, -1, -1):
                    on = ((rem >> g) & 1) != 0
                    lead_bin = cutlass.Int32(cutlass.select_(on, binv[g], lead_bin))
                    lead_t = cutlass.Int32(cutlass.select_(on, tv[g], lead_t))
                members = cutlass.Int32(0)
                for g in cutlass.range_constexpr(gs):
                    hit = (((rem >> g) & 1) != 0) & (binv[g] == lead_bin)
                    members = members | cutlass.Int32(cutlass.select_(hit, 1 << g, 0))
                rem = rem & (~members)
                l_b = lead_bin // E
                e_b = lead_bin - l_b * E

                acc = cute.make_rmem_tensor((gs * rw,), cutlass.Float32)
                acc.fill(0.0)
                xf = cute.make_rmem_tensor((_VEC, gs, unr), self.dtype)
                af = cute.make_rmem_tensor((_VEC, rw, unr), self.dtype)
                # x row per member (non-members read the leader's row: valid, unused)
                trow = [None] * gs
                for g in cutlass.range_constexpr(gs):
                    trow[g] = cutlass.Int32(
                        cutlass.select_(((members >> g) & 1) != 0, tv[g], lead_t))
                arow = [None] * rw
                for i in cutlass.range_constexpr(rw):
                    r = rb * rows_blk + i * W + warp
                    arow[i] = cutlass.min(r, R - 1)

                for st in cutlass.range(nsteps):
                    for u in cutlass.range_constexpr(unr):
                        v = (st * unr + u) * 32 + lane
                        if v < nvec:
                            for i in cutlass.range_constexpr(rw):
                                cute.copy(vec_atom, av[(None, (l_b, e_b, arow[i], v))],
                                          af[None, i, u])
                            for g in cutlass.range_constexpr(gs):
                                cute.copy(vec_atom, xv[(None, (trow[g], v))], xf[None, g, u])
                    for u in cutlass.range_constexpr(unr):
                        v = (st * unr + u) * 32 + lane
                        if v < nvec:
                            as_ = cute.make_rmem_tensor((_VEC, rw), cutlass.Float32)
                            as_.store(widen(af[None, None, u].load()))
                            for g in cutlass.range_constexpr(gs):
                                xs = cute.make_rmem_tensor((_VEC,), cutlass.Float32)
                                xs.store(widen(xf[None, g, u].load()))
                                for i in cutlass.range_constexpr(rw):
                                    c = acc[g * rw + i]
                                    for e8 in cutlass.range_constexpr(_VEC):
                                        c = c + xs[e8] * as_[e8, i]
                                    acc[g * rw + i] = c

                # fixed butterfly over the 32 lane partials; lane 0 stores
                for g in cutlass.range_constexpr(gs):
                    for i in cutlass.range_constexpr(rw):
                        c = acc[g * rw + i]
                        for sh in cutlass.range_constexpr(5):
                            c = c + cute.arch.shuffle_sync_bfly(c, offset=16 >> sh)
                        r = rb * rows_blk + i * W + warp
                        if (lane == 0) & (((members >> g) & 1) != 0) & (r < R):
                            s[pv[g], r] = c.to(self.dtype)

    # ================================================================== v2 bin mode
    @cute.kernel
    def bin_kernel(self, x: cute.Tensor, a: cute.Tensor, topk_ids: cute.Tensor,
                   lora: cute.Tensor, s: cute.Tensor):
        cfg = self.cfg
        BW, RW, G = cfg.bin_warps, cfg.bin_rows_per_warp, cfg.bin_group
        HC, S, SU = cfg.bin_chunk_h, cfg.bin_stages, cfg.bin_scan_unroll
        NT = 32 * BW
        RB = BW * RW
        CAP = NT * SU + G
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        T = x.shape[0]
        H = x.shape[1]
        L = a.shape[0]
        E = a.shape[1]
        R = a.shape[2]
        K = topk_ids.shape[1]
        P = T * K
        n_rb = (R + RB - 1) // RB
        items = L * E * n_rb

        smem = cutlass.utils.SmemAllocator()
        sA = smem.allocate_tensor(self.dtype,
                                  cute.make_layout((RB, HC, S), stride=(HC, 1, RB * HC)), 128)
        sX = smem.allocate_tensor(self.dtype,
                                  cute.make_layout((G, HC, S), stride=(HC, 1, G * HC)), 128)
        slist = smem.allocate_tensor(cutlass.Int32, cute.make_layout((CAP,)), 16)
        swc = smem.allocate_tensor(cutlass.Int32, cute.make_layout((SU * BW,)), 16)

        # ---- dead pairs (skipped adapter / expert): their s rows are zero
        for p in cutlass.range(bid * NT + tidx, P, nblk * NT):
            t = p // K
            j = p - t * K
            lo = lora[t]
            ex = topk_ids[t, j]
            if not ((lo >= 0) & (lo < L) & (ex >= 0) & (ex < E)):
                for r in cutlass.range(R):
                    s[p, r] = self.dtype(0.0)

        for w in cutlass.range(bid, items, nblk):
            bn = w // n_rb
            rb = w - bn * n_rb
            r0 = rb * RB
            l_b = bn // E
            e_b = bn - l_b * E
            nl = cutlass.Int32(0)        # pairs collected, not yet processed (CTA-uniform)
            for base in cutlass.range(0, P, NT * SU):
                nl = collect_round(lora, topk_ids, l_b, e_b, base, P, K, nl, slist, swc,
                                   tidx, warp, lane, NT, BW, SU)
                # full groups now; the remainder (< G) waits for the next round
                ng = nl // G
                for gi in cutlass.range(ng):
                    self.bin_group(x, a, s, sA, sX, slist, gi * G, G, l_b, e_b, r0, K, R, H,
                                   tidx, warp, lane)
                nl = keep_remainder(slist, nl, ng, G, tidx)
            if nl > 0:
                self.bin_group(x, a, s, sA, sX, slist, 0, nl, l_b, e_b, r0, K, R, H,
                               tidx, warp, lane)
            cute.arch.sync_threads()

    @cute.jit
    def bin_group(self, x: cute.Tensor, a: cute.Tensor, s: cute.Tensor, sA: cute.Tensor,
                  sX: cute.Tensor, slist: cute.Tensor, off: cutlass.Int32, n: cutlass.Int32,
                  l_b: cutlass.Int32, e_b: cutlass.Int32, r0: cutlass.Int32, K: cutlass.Int32,
                  R: cutlass.Int32, H: cutlass.Int32, tidx: cutlass.Int32, warp: cutlass.Int32,
                  lane: cutlass.Int32):
        """s rows r0 .. r0+RB-1 of the n (<= G) pairs slist[off .. off+n): A[l_b, e_b, rows, :]
        and the pairs' x rows stream through the cp.async ring once; each A vector is used
        for every pair of the group. Same lane -> vector mapping, FMA chain and butterfly as
        the pair schedule (run_items)."""
        cfg = self.cfg
        BW, RW, G = cfg.bin_warps, cfg.bin_rows_per_warp, cfg.bin_group
        HC, S = cfg.bin_chunk_h, cfg.bin_stages
        NT = 32 * BW
        cpr = HC // _VEC
        nvec = H // _VEC
        n_st = (H + HC - 1) // HC
        NXS = (G * cpr + NT - 1) // NT
        # token of the x row each of this thread's x-copy slots serves (-1: no pair)
        xtok = cute.make_rmem_tensor((NXS,), cutlass.Int32)
        for ps in cutlass.range_constexpr(NXS):
            m = (ps * NT + tidx) // cpr
            xtok[ps] = cutlass.Int32(-1)
            if m < n:                         # (m < n <= G: slot inside the group)
                xtok[ps] = slist[off + m] // K

        slab = slab_ptr(a, l_b, e_b, _VEC)
        for st in cutlass.range_constexpr(S - 1):
            if st < n_st:
                self.bin_load_stage(x, a, slab, sA, sX, r0, R, xtok, nvec, st, st, tidx)
            cute.arch.cp_async_commit_group()

        acc = cute.make_rmem_tensor((G * RW,), cutlass.Float32)
        acc.fill(0.0)
        for hs in cutlass.range(n_st):
            cute.arch.cp_async_wait_group(S - 2)
            cute.arch.sync_threads()
            nxt = hs + (S - 1)
            if nxt < n_st:
                self.bin_load_stage(x, a, slab, sA, sX, r0, R, xtok, nvec, nxt, nxt % S, tidx)
            cute.arch.cp_async_commit_group()
            slot = hs % S
            for ii in cutlass.range_constexpr(HC // 256):
                cl = lane + 32 * ii
                v = hs * cpr + cl                # = lane + 32 * i, i increasing: as run_items
                if v < nvec:
                    as_ = cute.make_rmem_tensor((_VEC, RW), cutlass.Float32)
                    for i in cutlass.range_constexpr(RW):
                        va = cute.local_tile(sA[warp * RW + i, None, slot], (_VEC,), (cl,))
                        as_[None, i].store(widen(va.load()))
                    for g in cutlass.range_constexpr(G):
                        if g < n:
                            xs = cute.make_rmem_tensor((_VEC,), cutlass.Float32)
                            vx = cute.local_tile(sX[g, None, slot], (_VEC,), (cl,))
                            xs.store(widen(vx.load()))
                            for i in cutlass.range_constexpr(RW):
                                c = acc[g * RW + i]
                                for e8 in cutlass.range_constexpr(_VEC):
                                    c = c + xs[e8] * as_[e8, i]
                                acc[g * RW + i] = c
        # every warp is out of the ring (and done with slist) before it is refilled
        cute.arch.sync_threads()

        for g in cutlass.range_constexpr(G):
            if g < n:
                pg = slist[off + g]
                for i in cutlass.range_constexpr(RW):
                    c = acc[g * RW + i]
                    for sh in cutlass.range_constexpr(5):
                        c = c + cute.arch.shuffle_sync_bfly(c, offset=16 >> sh)
                    r = r0 + warp * RW + i
                    if (lane == 0) & (r < R):
                        s[pg, r] = c.to(self.dtype)
        cute.arch.sync_threads()

    @cute.jit
    def bin_load_stage(self, x: cute.Tensor, a: cute.Tensor, slab: cute.Pointer,
                       sA: cute.Tensor, sX: cute.Tensor, r0: cutlass.Int32,
                       R: cutlass.Int32, xtok: cute.Tensor, nvec: cutlass.Int32,
                       st: cutlass.Int32, slot: cutlass.Int32, tidx: cutlass.Int32):
        """cp.async H-chunk `st` of A[l_b, e_b, r0:r0+RB, :] and of the group's x rows into
        ring slot `slot`. Vectors past H or R are not copied (and never used)."""
        cfg = self.cfg
        BW, RW, G, HC = cfg.bin_warps, cfg.bin_rows_per_warp, cfg.bin_group, cfg.bin_chunk_h
        NT = 32 * BW
        RB = BW * RW
        cpr = HC // _VEC
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.dtype, num_bits_per_copy=128)
        # A rows from the bin's slab pointer with 32-bit offsets (R * H elements), not by
        # indexing the 4-mode tensor per copy (as in the bin expand)
        s_r = cutlass.Int32(a.stride[2])
        for ps in cutlass.range_constexpr(RB * cpr // NT):
            v = ps * NT + tidx
            row = v // cpr
            ch = v - row * cpr
            gch = st * cpr + ch
            if (gch < nvec) & (r0 + row < R):
                src = cute.make_tensor(slab + cute.assume((r0 + row) * s_r + gch * _VEC,
                                                          divby=_VEC), cute.make_layout(_VEC))
                dst = cute.local_tile(sA[row, None, slot], (_VEC,), (ch,))
                cute.copy(atom, src, dst)
        for ps in cutlass.range_constexpr((G * cpr + NT - 1) // NT):
            v = ps * NT + tidx
            row = v // cpr
            ch = v - row * cpr
            gch = st * cpr + ch
            tok = xtok[ps]
            if (tok >= 0) & (gch < nvec):
                src = cute.local_tile(x[tok, None], (_VEC,), (gch,))
                dst = cute.local_tile(sX[row, None, slot], (_VEC,), (ch,))
                cute.copy(atom, src, dst)
