"""sm_90a MoE-LoRA plan kernel for large batches: shrink and expand of one (adapter, expert) bin
in the same CTA, one launch (see kernels/CONTRACT_BGMV.md, v3.3).

The two-kernel bin path (kernels/sm90/bgmv_shrink.py, bgmv_expand.py) runs every bin's shrink,
then, behind a grid-wide dependency (PDL wait), every bin's expand: the SMs idle through the
shrink's last partial wave, every bin's pair table is scanned twice, and each CTA fills and
drains its ring once per kernel. But the expand of a bin needs only the s rows of that bin's
own pairs. Here a CTA collects a bin's pairs once and, per group of up to 16 pairs, runs the
shrink's group (A[l, e] and the pairs' x rows through the ring -> s rows, stored to s) and then
the expand's group (s rows from s, just written by this CTA, B[l, e] through the same shared
memory -> ws or y). Nothing else changes: the device code of both groups is the stand-alone
kernels' own (bin_group, bin_load_stage, run_bin), so the bits equal the two-kernel path's,
which equal the pair schedules' (deterministic and batch-invariant, no atomics). finalize: the
expand's fin_kernel sums ws per token afterwards (a second launch, stream-ordered).

Small batches (P < bin_min_pairs) keep the two pair kernels: the plan dispatches on P
(cutekern/bgmv_moe.py reads bin_min_pairs from this variant's config).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync

from cutekern.abi import BGMV_PAIR_COLS, BGMV_PAIR_SMEM_BYTES, BGMV_SEG_H
from kernels._mma import is_bf16, mma_block, words, zero_unless
from kernels._xch import bits_f32, globaltimer, smid, xch_put
from kernels.sm90._bin_scan import routed, run_bin, slab_ptr
from kernels.sm90.bgmv_expand import BgmvExpandSm90, BgmvExpandSm90Config, _pair_at
from kernels.sm90.bgmv_shrink import BgmvShrinkSm90, BgmvShrinkSm90Config

SASS_REQUIRED = ("LDG", "STG", "HMMA", "LDGSTS", "LDGDEPBAR", "VOTE")
SASS_FORBIDDEN = ("ATOM", "ATOMG", "ATOMS", "RED", "REDG", "STL", "LDL")

_VEC = 8
_KB = 32            # elements per k block
_R_MAX = 64
_MAX_K = 8
_POLL = 8           # exchange words a lane polls per round trip
_SMEM_LIMIT = 227 * 1024


@dataclass(frozen=True)
class BgmvBinPlanSm90Config:
    """bin_min_pairs: P = T * k from which a plan runs this kernel (below: the pair kernels).
    bin_warps, bin_ctas_per_sm: CTA shape (both phases; 4 x 4 as the stand-alone bin kernels).
    shrink_chunk_h, shrink_stages: the shrink phase's ring (BgmvShrinkSm90Config.bin_chunk_h,
        bin_stages). expand_cols, expand_stages: the expand phase's (bin_cols, bin_stages).
        The expand's ring aliases the shrink's (the phases of a group run one after the other).
    scan_unroll: pair-table entries per thread per scan round (the one scan of a bin).
    prefetch_min: pairs per bin (P / (L * E)) from which a bin's first A stages are issued
        before its pair scan (0: never).
    overlap: one ring stream per group: the B chunks follow the last A stages in the same
        ring (the shrink's loop issues the first ones), so B is already loading when the
        shrink's last stages are computed. Needs the same stages and stage size in both
        phases (shrink_stages == expand_stages, shrink_chunk_h == expand_cols).
    small_*: a second shape (the same kernel compiled with fewer warps and stages and more
        CTAs per SM) for small_min_per_bin * L * E < P < small_per_bin * L * E (small_per_bin
        0: none), as the stand-alone shrink's small-bin shape: at 1-2 pairs per bin most bins
        hold one group of a pair or two, and twice the CTAs per SM run them in about one
        wave. Also when small_min_bins < L * E <= small_max_bins and L * E <= P <=
        small_max_per_bin * L * E: then at least ~63% of the bins are touched, more than one
        wave of the big shape (132 SMs x 4) and at most one of the small one (132 x 8), with
        a pair or two each. H200 (perf/results/tune_memops_h200_bgmv_binplan_small_rule.json,
        two rounds): H=4096 top-2 T=512 (1 pair per bin) 134.1-135.8 -> 119.6-120.0 us, T=1024
        (2 per bin) 157.0-161.5 -> 156.9-157.5. With up to 6 per bin it also took top-6 T=1024
        (-1.6%) and r=16 T=512 (-1.5%) but lost 1-1.5% at r=16 T=1024 and H=4096 T=2048; over
        2048 bins (top-8 E=256 T=256, 1 per bin) it lost 17% (tune_memops_h200_bgmv_binplan_
        shapes.json), hence the bin bounds. Same bits.
    fin_threads, fin_ctas_per_sm: the finalize pass (BgmvExpandSm90Config)."""

    bin_min_pairs: int = 384
    bin_warps: int = 4
    bin_ctas_per_sm: int = 4
    shrink_chunk_h: int = 64
    shrink_stages: int = 4
    expand_cols: int = 64
    expand_stages: int = 4
    scan_unroll: int = 8
    prefetch_min: int = 2
    overlap: bool = True
    small_min_per_bin: int = 1
    small_per_bin: int = 2
    small_warps: int = 2
    small_ctas_per_sm: int = 8
    small_stages: int = 2
    small_min_bins: int = 840
    small_max_bins: int = 1056
    small_max_per_bin: int = 2
    fin_threads: int = 128
    fin_ctas_per_sm: int = 8
    group_mtiles: int = 1          # 16-pair m-tiles per group (both phases)
    # A third shape for many pairs per bin (P >= wide_min_per_bin * L * E; 0: none), at ranks
    # above wide_rank_min (32, 16 or 0: the builds compiled into it): groups of 16 *
    # wide_mtiles pairs, so a bin of up to 32 pairs streams its weights once (one group) where
    # the default shape streams them once per 16 pairs, at wide_ctas_per_sm CTAs per SM with
    # wide_stages ring stages (the doubled x ring fits 4 CTAs per SM at 3 stages). At ~12
    # pairs per bin ~10% of the bins hold more than 16. H200 (graph replays, cold L2, two
    # process orders x two rounds), T=2048 top-6 E=128 L=8: H=2688 r=32 215.5-217 -> 201.5-202.6
    # us, r=16 190-192.6 -> 165.7-166.5, r=64 357-358.5 -> 287.6-288.5 (3 CTAs per SM x 4
    # stages: 317-323), H=3072 r=32 254.6-258 -> 224.6-225 (perf/results/tune_memops_h200_bgmv_
    # groups.json, _groups_wide.json). At 6 pairs per bin (T=1024) 0 to +4%, 3 CTAs per SM up
    # to +12%; at 8 per bin (top-8 E=256 T=2048) -2%: hence the bound.
    wide_min_per_bin: int = 10
    wide_ctas_per_sm: int = 4
    wide_mtiles: int = 2
    wide_stages: int = 3
    wide_rank_min: int = 0         # the shape serves ranks above this (32, 16 or 0)
    # Small batches: plans with P <= pair_max_pairs at rank <= 32 whose grid fits one wave
    # run pair_kernel (a CTA per (token, 64 output columns) doing a share of the token's
    # shrink as well; see its docstring) instead of the two pair kernels; 0: never (not
    # compiled). Off here: the sm90 pair kernels overlap through PDL, and measured against
    # them on the H200 this kernel was slower at every size (H=2688 r=32 top-6: T=1 8.2-8.5
    # vs 7.6-7.9 us, T=4 11.5 vs 9.7-10.0, T=8 14.3-14.5 vs 11.6-12.3; perf/results/
    # ab_bgmv_small_h200.json). The Ada design, without PDL, runs it.
    pair_max_pairs: int = 0
    pair_unit_warps: int = 4       # warps of a CTA that take shrink units
    pair_ctas_per_sm: int = 3
    pair_timeline: bool = False    # debug: per-CTA globaltimer stamps after the exchange words


def _small_shape(c: BgmvBinPlanSm90Config) -> BgmvBinPlanSm90Config:
    return replace(c, bin_warps=c.small_warps, bin_ctas_per_sm=c.small_ctas_per_sm,
                   shrink_stages=c.small_stages, expand_stages=c.small_stages, small_per_bin=0,
                   group_mtiles=1, wide_min_per_bin=0)


def _wide_shape(c: BgmvBinPlanSm90Config) -> BgmvBinPlanSm90Config:
    return replace(c, bin_ctas_per_sm=c.wide_ctas_per_sm, group_mtiles=c.wide_mtiles,
                   shrink_stages=c.wide_stages, expand_stages=c.wide_stages,
                   small_per_bin=0, wide_min_per_bin=0)


def _shrink_cfg(c: BgmvBinPlanSm90Config) -> BgmvShrinkSm90Config:
    return BgmvShrinkSm90Config(bin_min_pairs=c.bin_min_pairs, bin_warps=c.bin_warps,
                                bin_chunk_h=c.shrink_chunk_h, bin_stages=c.shrink_stages,
                                bin_scan_unroll=c.scan_unroll, bin_ctas_per_sm=c.bin_ctas_per_sm,
                                bin_prefetch_min=c.prefetch_min, bin_small_per_bin=0, pdl=False,
                                bin_mtiles=c.group_mtiles)


def _expand_cfg(c: BgmvBinPlanSm90Config) -> BgmvExpandSm90Config:
    return BgmvExpandSm90Config(bin_min_pairs=c.bin_min_pairs, bin_threads=32 * c.bin_warps,
                                bin_cols=c.expand_cols, bin_stages=c.expand_stages,
                                bin_scan_unroll=c.scan_unroll, bin_ctas_per_sm=c.bin_ctas_per_sm,
                                bin_prefetch_min=c.prefetch_min, fin_threads=c.fin_threads,
                                fin_ctas_per_sm=c.fin_ctas_per_sm, pdl=False, bin_pdl=False,
                                bin_mtiles=c.group_mtiles)


def _ring_elems(c: BgmvBinPlanSm90Config) -> tuple:
    """(A elements, x elements, B elements) of the rings (B aliases A + x)."""
    a = c.shrink_stages * _R_MAX * c.shrink_chunk_h
    x = c.shrink_stages * 2 * 16 * c.group_mtiles * c.shrink_chunk_h
    b = c.expand_stages * c.expand_cols * _R_MAX
    return a, x, b


def _smem_bytes(c: BgmvBinPlanSm90Config) -> int:
    a, x, b = _ring_elems(c)
    nt = 32 * c.bin_warps
    return 2 * max(a + x, b) + 4 * (nt * c.scan_unroll + 16 * c.group_mtiles) \
        + 4 * c.scan_unroll * c.bin_warps \
        + 1024


def _pair_smem_bytes(c: BgmvBinPlanSm90Config) -> int:
    sb = BGMV_SEG_H // _KB
    return 16 * (c.pair_unit_warps * sb * (32 + 4) + _MAX_K * 8 * 32) \
        + 4 * (BGMV_PAIR_COLS * _MAX_K + 3 * _MAX_K + 2) + 1024


class BgmvBinPlanSm90:
    SMEM_LIMIT = _SMEM_LIMIT    # per CTA (the Ada design's subclass lowers it)

    def __init__(self, dtype, finalize: bool, config: BgmvBinPlanSm90Config = BgmvBinPlanSm90Config(),
                 rank_min: int = 0):
        if not type(self).can_implement(dtype, config):
            raise ValueError(f"{type(self).__name__} cannot implement {dtype} with {config}")
        self.dtype = dtype
        self.bf16 = is_bf16(dtype)
        self.finalize = bool(finalize)
        self.cfg = config
        self.sh = BgmvShrinkSm90(dtype, _shrink_cfg(config))
        self.ex = BgmvExpandSm90(dtype, finalize, _expand_cfg(config))
        self.rank_min = rank_min         # the bin kernel's builds for ranks above this only
        self.small = None
        if config.small_per_bin > 0:
            self.small = type(self)(dtype, finalize, _small_shape(config))
        self.wide = None
        if config.wide_min_per_bin > 0:
            self.wide = type(self)(dtype, finalize, _wide_shape(config),
                                   rank_min=config.wide_rank_min)

    @classmethod
    def can_implement(cls, dtype, config: BgmvBinPlanSm90Config) -> bool:
        c = config
        if not (c.bin_min_pairs >= 1 and c.bin_ctas_per_sm >= 1 and c.prefetch_min >= 0
                and 1 <= c.group_mtiles <= 4):
            return False
        if c.small_per_bin < 0 or c.small_min_per_bin < 0:
            return False
        if c.small_per_bin > 0 and not cls.can_implement(dtype, _small_shape(c)):
            return False
        if c.wide_rank_min not in (0, 16, 32):
            return False
        if c.wide_min_per_bin < 0 or (c.wide_min_per_bin > 0
                                      and not cls.can_implement(dtype, _wide_shape(c))):
            return False
        if c.overlap and (c.shrink_stages != c.expand_stages
                          or c.shrink_chunk_h != c.expand_cols):
            return False
        if c.pair_max_pairs > 0:
            # the pair kernel reproduces the shrink's segments (its seg_h) bit for bit
            if _shrink_cfg(c).seg_h != BGMV_SEG_H or not 1 <= c.pair_unit_warps <= _MAX_K:
                return False
            if c.pair_ctas_per_sm < 1 or _pair_smem_bytes(c) > min(cls.SMEM_LIMIT,
                                                                   BGMV_PAIR_SMEM_BYTES):
                return False
        if not (BgmvShrinkSm90.can_implement(dtype, _shrink_cfg(c))
                and BgmvExpandSm90.can_implement(dtype, _expand_cfg(c))):
            return False
        return _smem_bytes(c) <= cls.SMEM_LIMIT

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, x: cute.Tensor, a: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                 lora: cute.Tensor, topk_w: cute.Tensor, s: cute.Tensor, y: cute.Tensor,
                 ws: cute.Tensor, stream: cuda.CUstream):
        pair = cutlass.Boolean(False)
        if cutlass.const_expr(self.cfg.pair_max_pairs > 0):
            pair = (x.shape[0] * topk_ids.shape[1] < self.cfg.bin_min_pairs) & (a.shape[2] <= _KB)
        if pair:
            self.launch_pairs(x, a, b, topk_ids, lora, topk_w, s, y, ws, stream)
        else:
            self.launch_plan(x, a, b, topk_ids, lora, topk_w, s, y, ws, stream)

    @cute.jit
    def launch_pairs(self, x: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
                     topk_ids: cute.Tensor, lora: cute.Tensor, topk_w: cute.Tensor,
                     s: cute.Tensor, y: cute.Tensor, ws: cute.Tensor, stream: cuda.CUstream):
        """The small-batch kernel: one CTA per (token, column chunk), token-major."""
        if cutlass.const_expr(self.cfg.pair_max_pairs > 0):
            C = (b.shape[2] + BGMV_PAIR_COLS - 1) // BGMV_PAIR_COLS
            self.pair_kernel(x, a, b, topk_ids, lora, topk_w, s, y, ws).launch(
                grid=[x.shape[0] * C, 1, 1], block=[32 * _MAX_K, 1, 1], stream=stream,
                min_blocks_per_mp=self.cfg.pair_ctas_per_sm, preferred_smem_carveout=100)

    @cute.jit
    def launch_plan(self, x: cute.Tensor, a: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                    lora: cute.Tensor, topk_w: cute.Tensor, s: cute.Tensor, y: cute.Tensor,
                    ws: cute.Tensor, stream: cuda.CUstream):
        """The bin kernel (its shape by the batch), then the finalize pass."""
        cfg = self.cfg
        T = x.shape[0]
        N = b.shape[2]
        out = ws if self.finalize else y
        items = a.shape[0] * a.shape[1]
        P = T * topk_ids.shape[1]
        wide = cutlass.Boolean(False)
        if cutlass.const_expr(self.wide is not None):
            wide = (a.shape[2] > cfg.wide_rank_min) & (P >= cfg.wide_min_per_bin * items)
        small = cutlass.Boolean(False)
        if cutlass.const_expr(self.small is not None):
            small = ((P > cfg.small_min_per_bin * items) & (P < cfg.small_per_bin * items)) \
                | ((items > cfg.small_min_bins) & (items <= cfg.small_max_bins)
                   & (P >= items) & (P <= cfg.small_max_per_bin * items))
        if wide:
            if cutlass.const_expr(self.wide is not None):
                self.wide.launch_bins(x, a, b, topk_ids, lora, s, out, stream)
        elif small:
            if cutlass.const_expr(self.small is not None):
                self.small.launch_bins(x, a, b, topk_ids, lora, s, out, stream)
        else:
            self.launch_bins(x, a, b, topk_ids, lora, s, out, stream)
        if cutlass.const_expr(self.finalize):
            fcols = 4 * cfg.fin_threads
            f_items = T * ((N + fcols - 1) // fcols)
            f_grid = cutlass.max(cutlass.min(f_items, 65536 * cfg.fin_ctas_per_sm), 1)
            self.ex.fin_kernel(topk_ids, lora, topk_w, ws, y, b.shape[0], b.shape[1]).launch(
                grid=[f_grid, 1, 1], block=[cfg.fin_threads, 1, 1], stream=stream)

    @cute.jit
    def launch_bins(self, x: cute.Tensor, a: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                    lora: cute.Tensor, s: cute.Tensor, out: cute.Tensor, stream: cuda.CUstream):
        """The bin kernel in this instance's shape (a CTA per (adapter, expert) bin)."""
        cfg = self.cfg
        items = a.shape[0] * a.shape[1]
        grid = cutlass.max(cutlass.min(items, 65536 * cfg.bin_ctas_per_sm), 1)
        self.kernel(x, a, b, topk_ids, lora, s, out).launch(
            grid=[grid, 1, 1], block=[32 * cfg.bin_warps, 1, 1], stream=stream,
            min_blocks_per_mp=cfg.bin_ctas_per_sm, preferred_smem_carveout=100)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, x: cute.Tensor, a: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
               lora: cute.Tensor, s: cute.Tensor, out: cute.Tensor):
        """s rows of every pair; out[p, n] = d[p, n] for live pairs (out = ws when finalize,
        else y, whose dead-pair rows are zeroed). Work item = one (adapter, expert) bin."""
        cfg = self.cfg
        BW, SU = cfg.bin_warps, cfg.scan_unroll
        NT = 32 * BW
        CAP = NT * SU + 16 * cfg.group_mtiles
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        T = x.shape[0]
        L = a.shape[0]
        E = a.shape[1]
        R = a.shape[2]
        N = b.shape[2]
        K = topk_ids.shape[1]
        P = T * K
        items = L * E

        ea, ex_, eb = _ring_elems(cfg)
        smem = cutlass.utils.SmemAllocator()
        ring = smem.allocate_tensor(self.dtype, cute.make_layout((max(ea + ex_, eb),)), 128)
        sA = cute.make_tensor(ring.iterator, cute.make_layout((ea,)))
        sX = cute.make_tensor(ring.iterator + ea, cute.make_layout((ex_,)))
        sB = cute.make_tensor(ring.iterator, cute.make_layout((eb,)))
        slist = smem.allocate_tensor(cutlass.Int32, cute.make_layout((CAP,)), 16)
        swc = smem.allocate_tensor(cutlass.Int32, cute.make_layout((SU * BW + 1,)), 16)

        # dead pairs (skipped adapter / expert): zero s rows (and y rows, per pair)
        self.sh.zero_dead(s, topk_ids, lora, L, E, P, K, R, bid, nblk, tidx, NT)
        if cutlass.const_expr(not self.finalize):
            self.ex.zero_dead(out, topk_ids, lora, L, E, P, K, N, bid, nblk, warp, lane, BW)

        pre = cutlass.Boolean(False)
        if cutlass.const_expr(cfg.prefetch_min > 0):
            pre = P >= cfg.prefetch_min * L * E
        for w in cutlass.range(bid, items, nblk):
            l_b = w // E
            e_b = w - l_b * E
            # ring rows by rank class (the stand-alone kernels' specializations)
            if cutlass.const_expr(self.rank_min >= 32):   # (plans run it at R > 32 only)
                self.item(x, a, b, s, out, sA, sX, sB, slist, swc, lora, topk_ids, l_b, e_b,
                          N, P, K, tidx, warp, lane, pre, 64, 64)
            elif cutlass.const_expr(self.rank_min >= 16):
                if R > 32:
                    self.item(x, a, b, s, out, sA, sX, sB, slist, swc, lora, topk_ids, l_b,
                              e_b, N, P, K, tidx, warp, lane, pre, 64, 64)
                else:
                    self.item(x, a, b, s, out, sA, sX, sB, slist, swc, lora, topk_ids, l_b,
                              e_b, N, P, K, tidx, warp, lane, pre, 32, 32)
            else:
                if R > 32:
                    self.item(x, a, b, s, out, sA, sX, sB, slist, swc, lora, topk_ids, l_b,
                              e_b, N, P, K, tidx, warp, lane, pre, 64, 64)
                elif R > 16:
                    self.item(x, a, b, s, out, sA, sX, sB, slist, swc, lora, topk_ids, l_b,
                              e_b, N, P, K, tidx, warp, lane, pre, 32, 32)
                else:
                    self.item(x, a, b, s, out, sA, sX, sB, slist, swc, lora, topk_ids, l_b,
                              e_b, N, P, K, tidx, warp, lane, pre, 32, 16)

    @cute.jit
    def item(self, x, a, b, s, out, sA, sX, sB, slist, swc, lora, topk_ids, l_b, e_b, N, P, K,
             tidx, warp, lane, pre, RT: cutlass.Constexpr, RW: cutlass.Constexpr):
        """Bin (l_b, e_b): one scan; per group the shrink's group, then the expand's."""
        cfg = self.cfg
        NT = 32 * cfg.bin_warps
        if pre:
            self.sh.prefetch_a(x, a, sA, sX, l_b, e_b, tidx, RT)
        run_bin(lambda off, n, f: self.group(x, a, b, s, out, sA, sX, sB, slist, off, n, l_b,
                                             e_b, N, K, tidx, warp, lane, f, RT, RW),
                lora, topk_ids, l_b, e_b, P, K, slist, swc, tidx, warp, lane, pre, NT,
                cfg.bin_warps, cfg.scan_unroll, 16 * cfg.group_mtiles)

    @cute.jit
    def group(self, x, a, b, s, out, sA, sX, sB, slist, off, n, l_b, e_b, N, K, tidx, warp,
              lane, first, RT: cutlass.Constexpr, RW: cutlass.Constexpr):
        # shrink: s rows of the group's pairs (stored; ends with a CTA barrier, so they are
        # visible to the expand's fragment loads below, and no warp reads an A slot again)
        if cutlass.const_expr(self.cfg.overlap):
            S = self.cfg.shrink_stages
            HC = self.sh.stage_cols(RT)
            n_st = (x.shape[1] + HC - 1) // HC
            CN = self.ex.cfg.bin_cols * (_R_MAX // RW)
            nch = (N + CN - 1) // CN
            nrv = b.shape[3] // _VEC
            slab_b = slab_ptr(b, l_b, e_b, _VEC)
            # B chunk j takes ring position n_st + j (slot (n_st + j) % S): the shrink's loop
            # issues chunks 0 .. S-2 as its last A stages are computed
            self.sh.bin_group(x, a, s, sA, sX, slist, off, n, l_b, e_b, K, tidx, warp, lane,
                              first, RT,
                              lambda j, slot: self._b_chunk(b, slab_b, sB, N, nrv, nch, j,
                                                            slot, tidx, RW))
            self.ex.bin_group(s, b, out, sB, slist, off, n, l_b, e_b, N, tidx, warp, lane,
                              cutlass.Boolean(True), RW, n_st % S)
        else:
            self.sh.bin_group(x, a, s, sA, sX, slist, off, n, l_b, e_b, K, tidx, warp, lane,
                              first, RT)
            self.ex.bin_group(s, b, out, sB, slist, off, n, l_b, e_b, N, tidx, warp, lane,
                              cutlass.Boolean(False), RW)

    @cute.jit
    def _b_chunk(self, b, slab_b, sB, N, nrv, nch, j, slot, tidx, RW: cutlass.Constexpr):
        if j < nch:
            self.ex.bin_load_stage(b, slab_b, sB, N, nrv, j, slot, tidx, RW)

    # ================================================================== small batches
    @cute.kernel
    def pair_kernel(self, x: cute.Tensor, a: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                    lora: cute.Tensor, topk_w: cute.Tensor, s: cute.Tensor, y: cute.Tensor,
                    ws: cute.Tensor):
        """Shrink + expand of a small batch in one launch, rank <= 32. CTA (t, c) owns output
        columns 64c .. 64c+63 of token t (the pair expand's work item; warp j = slot j) and
        a share of token t's shrink: the shrink's units (pair j, 8 ranks, segment of seg_h
        elements of H) are dealt to the token's C CTAs (unit u to CTA u % C, its warp
        (u // C) % pair_unit_warps). A CTA cp.asyncs its units' A and x vectors into shared
        memory, then (once they landed) its b vectors, runs each unit's mma chain and
        publishes the 8 segment partials through the exchange buffer `ws`
        (cutekern.abi.bgmv_pair_xch_words); lane (g, q) of warp j then sums rank 8q + g of
        pair j over the segments in order (polled), which is the pair shrink's
        s = cvt(((0 + P_0) + P_1) + ...), and the warp runs the pair expand's chains on
        those s fragments. Same arithmetic as the two pair kernels, so the same bits.
        Progress: a CTA waits only for CTAs of its own token (C consecutive block indices;
        plans bound C to 128), so once a token's first CTA runs, the rest of its group only
        needs slots that earlier, complete groups free. Sequence numbers: CTA bid's word bid
        counts its launches (every launch of a plan runs the same grid), so every CTA
        expects the same number from its peers; ws starts zeroed."""
        cfg = self.cfg
        SB = BGMV_SEG_H // _KB                  # k blocks per segment
        NU = cfg.pair_unit_warps
        CN = BGMV_PAIR_COLS
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        g = lane >> 2
        q = lane & 3

        T = x.shape[0]
        H = x.shape[1]
        L = a.shape[0]
        E = a.shape[1]
        R = a.shape[2]
        N = b.shape[2]
        K = topk_ids.shape[1]
        C = (N + CN - 1) // CN
        t = bid // C
        c = bid - t * C
        n0 = c * CN
        NTL = R // 8                            # 8-rank tiles (= 16-byte vectors of a row)
        nvec = H // _VEC
        nb = (H + _KB - 1) // _KB
        nseg = (nb + SB - 1) // SB
        U = K * NTL * nseg

        smem = cutlass.utils.SmemAllocator()
        sA = smem.allocate_tensor(self.dtype, cute.make_layout(NU * SB * 32 * _VEC), 16)
        sX = smem.allocate_tensor(self.dtype, cute.make_layout(NU * SB * 4 * _VEC), 16)
        sB = smem.allocate_tensor(self.dtype, cute.make_layout(_MAX_K * 8 * 32 * _VEC), 16)
        sBw = cute.local_tile(sB, (8 * 32 * _VEC,), (warp,))
        sd = smem.allocate_tensor(Float32, cute.make_layout((CN, _MAX_K), stride=(1, CN)), 16)
        sex = smem.allocate_tensor(Int32, cute.make_layout((_MAX_K,)), 16)
        sw = smem.allocate_tensor(Float32, cute.make_layout((_MAX_K,)), 16)
        slive = smem.allocate_tensor(Int32, cute.make_layout((_MAX_K,)), 16)
        shdr = smem.allocate_tensor(Int32, cute.make_layout((2,)), 16)
        cp_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype,
            num_bits_per_copy=128)
        st_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32,
                                      num_bits_per_copy=64)

        xw = cute.make_ptr(Int64, ws.iterator.toint(), cute.AddressSpace.gmem, assumed_align=8)
        own = xw + bid
        slots = xw + T * C

        TL = cfg.pair_timeline
        tl = None
        if cutlass.const_expr(TL):
            tl = slots + T * K * NTL * nseg * 8 + bid * 8
            if tidx == 0:
                cute.arch.store(tl, globaltimer())
                cute.arch.store(tl + 7, Int64(smid()))
        # the token's routing and this CTA's launch count: one round trip, then a barrier
        if tidx < K:
            sex[tidx] = topk_ids[t, tidx]
            sw[tidx] = Float32(0.0)
            if cutlass.const_expr(self.finalize):
                sw[tidx] = topk_w[t, tidx]
        if tidx == 32:
            shdr[0] = Int32(cute.arch.load(own, Int64, sem="relaxed", scope="gpu"))
        if tidx == 64:
            shdr[1] = lora[t]
        cute.arch.sync_threads()
        seq = shdr[0] + 1
        lo = shdr[1]
        if tidx == 0:
            cute.arch.store(own, Int64(seq), sem="relaxed", scope="gpu")
            if cutlass.const_expr(TL):
                cute.arch.store(tl + 1, globaltimer())

        # shrink units of this warp: u = c + C * (warp + NU * i), i < nu
        nu = Int32(0)
        if warp < NU:
            first = c + C * warp
            if first < U:
                nu = (U - 1 - first) // (C * NU) + 1
        va = warp * (SB * 32) + lane
        vx = warp * (SB * 4) + q
        self._unit_issue(x, a, sA, sX, c + C * warp, nu > 0, lo, sex, t, NTL, nseg, nvec, L, E,
                         va, vx, g, q, cp_atom)
        cute.arch.cp_async_commit_group()
        # the units' vectors before any b vector: the exchange waits for every unit of the
        # token, the b vectors are needed only after it, and issued together they share the
        # DRAM bandwidth (H200, T=8: the units' vectors landed 4.5-7.6 us after entry)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        if cutlass.const_expr(TL):
            if tidx == 0:
                cute.arch.store(tl + 2, globaltimer())
        # this warp's b vectors (slot j = warp), lane-major per n-tile as the staged expand
        j = warp
        live = cutlass.Boolean(False)
        if j < K:
            live = routed(lo, sex[j], L, E)
        if live:
            base = slab_ptr(b, lo, sex[j], _VEC) + cute.assume(
                (n0 + g) * b.stride[2] + q * _VEC, divby=_VEC)
            if q < NTL:
                for i in cutlass.range_constexpr(8):
                    if n0 + 8 * i + g < N:
                        src = cute.make_tensor(base + cute.assume(8 * i * b.stride[2], divby=_VEC),
                                               cute.make_layout(_VEC))
                        cute.copy(cp_atom, src, cute.local_tile(sBw, (_VEC,), (32 * i + lane,)))
        cute.arch.cp_async_commit_group()

        for i in cutlass.range(nu):
            u = c + C * (warp + NU * i)
            if i > 0:
                # (more units than unit warps x CTAs: rare; this wait includes the b vectors)
                self._unit_issue(x, a, sA, sX, u, True, lo, sex, t, NTL, nseg, nvec, L, E,
                                 va, vx, g, q, cp_atom)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
                cute.arch.sync_warp()                # x vectors come from the lanes g == 0
            self._unit_run(sA, sX, slots, u, seq, lo, sex, t, K, NTL, nseg, nvec, L, E, va, vx,
                           g, q)
            cute.arch.sync_warp()                    # the next unit overwrites the slots
        if cutlass.const_expr(TL):
            if tidx == 0:
                cute.arch.store(tl + 3, globaltimer())

        # s[p, 8q + g] of pair p = (t, j): the segment partials in order (polled)
        p = t * K + j
        tot = Float32(0.0)
        if live & (q < NTL):
            wp = slots + ((p * NTL + q) * nseg) * 8 + g
            vals = cute.make_rmem_tensor((_POLL,), Float32)
            for s0 in cutlass.range(0, nseg, _POLL):
                done = Int32(0)
                while done == 0:
                    done = Int32(1)
                    for k2 in cutlass.range_constexpr(_POLL):
                        vals[k2] = Float32(0.0)
                        if s0 + k2 < nseg:
                            wv = cute.arch.load(wp + (s0 + k2) * 8, Int64, sem="relaxed",
                                                scope="gpu")
                            if Int32(wv >> 32) != seq:
                                done = Int32(0)
                            vals[k2] = bits_f32(Int32(wv))
                for k2 in cutlass.range_constexpr(_POLL):
                    if s0 + k2 < nseg:
                        tot = tot + vals[k2]
        if (c == 0) & (j < K) & (q < NTL):
            s[p, 8 * q + g] = tot.to(self.dtype)         # 0 for a skipped pair
        # the s fragment of lane (g, q): ranks 8q .. 8q+7, from lanes (0..7, q)
        sf = cute.make_rmem_tensor((_VEC,), self.dtype)
        for k2 in cutlass.range_constexpr(_VEC):
            sf[k2] = cute.arch.shuffle_sync(tot, 4 * k2 + q).to(self.dtype)

        if cutlass.const_expr(TL):
            if tidx == 0:
                cute.arch.store(tl + 4, globaltimer())
        cute.arch.cp_async_wait_group(0)
        if cutlass.const_expr(TL):
            if tidx == 0:
                cute.arch.store(tl + 5, globaltimer())
        d = cute.make_rmem_tensor((2,), Float32)
        d.fill(0.0)
        if live:
            ok = q < NTL
            for i in cutlass.range_constexpr(8):
                acc = cute.make_rmem_tensor((4,), Float32)
                acc.fill(0.0)
                bi = cute.make_rmem_tensor((_VEC,), self.dtype)
                bi.fill(0.0)
                if (n0 + 8 * i + g < N) & ok:
                    cute.autovec_copy(cute.local_tile(sBw, (_VEC,), (32 * i + lane,)), bi)
                sw_ = zero_unless(words(sf), ok)
                mma_block(sw_, sw_, zero_unless(words(bi), ok), acc, self.bf16)
                if g == i:
                    d[0] = acc[0]
                    d[1] = acc[1]

        if cutlass.const_expr(self.finalize):
            # the pair expand's finalize: y[t, n] = sum over live j in order of w[t, j] * d_j
            if j < K:
                for e2 in cutlass.range_constexpr(2):
                    sd[8 * g + 2 * q + e2, j] = d[e2]
                if lane == 0:
                    slive[j] = Int32(live)
            cute.arch.sync_threads()
            if tidx < CN:
                n = n0 + tidx
                out = Float32(0.0)
                for jj in cutlass.range(K):
                    if slive[jj] != 0:
                        out = out + sw[jj] * sd[tidx, jj]
                if n < N:
                    y[t, n] = out
        else:
            n = n0 + 8 * g + 2 * q
            if (j < K) & (n < N):
                cute.copy(st_atom, d, _pair_at(y, p, n))
        if cutlass.const_expr(TL):
            if tidx == 0:
                cute.arch.store(tl + 6, globaltimer())

    @staticmethod
    def _unit_decode(u, NTL, nseg):
        """Unit u of a token -> (slot j, 8-rank tile, segment), segment fastest."""
        seg = u % nseg
        r2 = u // nseg
        nt = r2 % NTL
        return r2 // NTL, nt, seg

    @cute.jit
    def _unit_issue(self, x, a, sA, sX, u, has, lo, sex, t, NTL, nseg, nvec, L, E, va, vx, g, q,
                    cp_atom):
        """cp.async the A vectors (each lane) and x vectors (lanes g == 0) of shrink unit u,
        as the pair shrink's staged build does (vectors past H not loaded)."""
        if has:
            ju, nt, seg = self._unit_decode(u, NTL, nseg)
            ex = sex[ju]
            if routed(lo, ex, L, E):
                xs, as_ = self.sh.seg_views(x, a, t, lo, ex, nt * 8 + g, seg, q)
                self.sh.seg_copy(xs, as_, sA, sX, seg, nvec, va, vx, g, q, cp_atom)

    @cute.jit
    def _unit_run(self, sA, sX, slots, u, seq, lo, sex, t, K, NTL, nseg, nvec, L, E, va, vx,
                  g, q):
        """Shrink unit u (its vectors in shared memory): the pair shrink's segment chain, its
        8 partials published by the lanes g == 0 (dead pairs publish nothing: never polled)."""
        ju, nt, seg = self._unit_decode(u, NTL, nseg)
        if routed(lo, sex[ju], L, E):
            acc = cute.make_rmem_tensor((4,), Float32)
            acc.fill(0.0)
            self.sh.seg_chain(sA, sX, acc, seg, nvec, va, vx, q)
            if g == 0:
                wp = slots + (((t * K + ju) * NTL + nt) * nseg + seg) * 8 + 2 * q
                xch_put(wp, acc[0], seq)
                xch_put(wp + 1, acc[1], seq)
