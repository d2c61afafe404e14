"""sm_90a MoE-LoRA shrink (see kernels/CONTRACT_BGMV.md).

    s[p, r] = cvt(sum_h x[t, h] * a[l, e, r, h]),  p = order[q], t = p // k, j = p % k,
    l = lora[t], e = topk_ids[t, j]; 0 for skipped pairs; padding entries of `order` ignored.

Work decomposition (persistent grid, grid-stride loop over work items):
  a work item is (a group of `gs` consecutive `order` entries, a block of `warps * rw` rows
  of A). Each warp owns `rw` rows of the block and computes their dot products with the
  x rows of every entry of the group. Two shapes, chosen at run time from Q = len(order):
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
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

SASS_REQUIRED = ("LDG", "SHFL")
SASS_FORBIDDEN = ("ATOM", "ATOMG", "ATOMS", "RED", "LDGSTS")

_DTYPES = (cutlass.Float16, cutlass.BFloat16)
_VEC = 8  # elements per 16-byte vector


@dataclass(frozen=True)
class BgmvShrinkSm90Config:
    """warps: warps per CTA (a CTA's rows = warps * rw).
    group: entries per work item in the batched shape (fp32 accumulators = group * rows_per_warp).
    rows_per_warp: A rows per warp in the batched shape.
    unroll: 32-lane h-steps whose loads are issued together, batched shape.
    small_unroll: the same for the small shape (1 entry, 1 row per warp).
    batched_min_entries: Q (= len(order)) from which the batched shape is used.
    num_sms, ctas_per_sm: persistent grid size = min(work items, num_sms * ctas_per_sm)."""

    warps: int = 4
    group: int = 4
    rows_per_warp: int = 2
    unroll: int = 2
    small_unroll: int = 8
    batched_min_entries: int = 512
    num_sms: int = 132
    ctas_per_sm: int = 3


class BgmvShrinkSm90:
    def __init__(self, dtype, config: BgmvShrinkSm90Config = BgmvShrinkSm90Config()):
        if not BgmvShrinkSm90.can_implement(dtype, config):
            raise ValueError(f"BgmvShrinkSm90 cannot implement {dtype} with {config}")
        self.dtype = dtype
        self.cfg = config
        self.W = config.warps
        self.num_threads = 32 * config.warps

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
        return c.batched_min_entries >= 1 and c.num_sms >= 1 and c.ctas_per_sm >= 1

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
        big = cutlass.Int32(Q >= cfg.batched_min_entries)
        items = big * items_big + (1 - big) * items_small
        grid = cutlass.min(items, cfg.num_sms * cfg.ctas_per_sm)
        grid = cutlass.max(grid, 1)
        self.kernel(x, a, topk_ids, lora, order, s).launch(
            grid=[grid, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, x: cute.Tensor, a: cute.Tensor, topk_ids: cute.Tensor,
               lora: cute.Tensor, order: cute.Tensor, s: cute.Tensor):
        cfg = self.cfg
        Q = order.shape[0]
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
                p = order[cutlass.min(q, Q - 1)]
                valid = (q < Q) & (p >= 0) & (p < P)
                pc = cutlass.select_(valid, p, 0)
                pc = cutlass.Int32(pc)
                t = pc // K
                j = pc - t * K
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
                            as_.store(af[None, None, u].load().to(cutlass.Float32))
                            for g in cutlass.range_constexpr(gs):
                                xs = cute.make_rmem_tensor((_VEC,), cutlass.Float32)
                                xs.store(xf[None, g, u].load().to(cutlass.Float32))
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
