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

from kernels.sm90._bin_scan import run_bin, slab_ptr
from kernels.sm90.bgmv_expand import BgmvExpandSm90, BgmvExpandSm90Config
from kernels.sm90.bgmv_shrink import BgmvShrinkSm90, BgmvShrinkSm90Config

SASS_REQUIRED = ("LDG", "STG", "HMMA", "LDGSTS", "LDGDEPBAR", "VOTE")
SASS_FORBIDDEN = ("ATOM", "ATOMG", "ATOMS", "RED", "REDG", "STL", "LDL")

_VEC = 8
_R_MAX = 64
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


def _small_shape(c: BgmvBinPlanSm90Config) -> BgmvBinPlanSm90Config:
    return replace(c, bin_warps=c.small_warps, bin_ctas_per_sm=c.small_ctas_per_sm,
                   shrink_stages=c.small_stages, expand_stages=c.small_stages, small_per_bin=0)


def _shrink_cfg(c: BgmvBinPlanSm90Config) -> BgmvShrinkSm90Config:
    return BgmvShrinkSm90Config(bin_min_pairs=c.bin_min_pairs, bin_warps=c.bin_warps,
                                bin_chunk_h=c.shrink_chunk_h, bin_stages=c.shrink_stages,
                                bin_scan_unroll=c.scan_unroll, bin_ctas_per_sm=c.bin_ctas_per_sm,
                                bin_prefetch_min=c.prefetch_min, bin_small_per_bin=0, pdl=False)


def _expand_cfg(c: BgmvBinPlanSm90Config) -> BgmvExpandSm90Config:
    return BgmvExpandSm90Config(bin_min_pairs=c.bin_min_pairs, bin_threads=32 * c.bin_warps,
                                bin_cols=c.expand_cols, bin_stages=c.expand_stages,
                                bin_scan_unroll=c.scan_unroll, bin_ctas_per_sm=c.bin_ctas_per_sm,
                                bin_prefetch_min=c.prefetch_min, fin_threads=c.fin_threads,
                                fin_ctas_per_sm=c.fin_ctas_per_sm, pdl=False, bin_pdl=False)


def _ring_elems(c: BgmvBinPlanSm90Config) -> tuple:
    """(A elements, x elements, B elements) of the rings (B aliases A + x)."""
    a = c.shrink_stages * _R_MAX * c.shrink_chunk_h
    x = c.shrink_stages * 2 * 16 * c.shrink_chunk_h
    b = c.expand_stages * c.expand_cols * _R_MAX
    return a, x, b


def _smem_bytes(c: BgmvBinPlanSm90Config) -> int:
    a, x, b = _ring_elems(c)
    nt = 32 * c.bin_warps
    return 2 * max(a + x, b) + 4 * (nt * c.scan_unroll + 16) + 4 * c.scan_unroll * c.bin_warps \
        + 1024


class BgmvBinPlanSm90:
    SMEM_LIMIT = _SMEM_LIMIT    # per CTA (the Ada design's subclass lowers it)

    def __init__(self, dtype, finalize: bool, config: BgmvBinPlanSm90Config = BgmvBinPlanSm90Config()):
        if not type(self).can_implement(dtype, config):
            raise ValueError(f"{type(self).__name__} cannot implement {dtype} with {config}")
        self.dtype = dtype
        self.finalize = bool(finalize)
        self.cfg = config
        self.sh = BgmvShrinkSm90(dtype, _shrink_cfg(config))
        self.ex = BgmvExpandSm90(dtype, finalize, _expand_cfg(config))
        self.small = None
        if config.small_per_bin > 0:
            self.small = type(self)(dtype, finalize, _small_shape(config))

    @classmethod
    def can_implement(cls, dtype, config: BgmvBinPlanSm90Config) -> bool:
        c = config
        if not (c.bin_min_pairs >= 1 and c.bin_ctas_per_sm >= 1 and c.prefetch_min >= 0):
            return False
        if c.small_per_bin < 0 or c.small_min_per_bin < 0:
            return False
        if c.small_per_bin > 0 and not cls.can_implement(dtype, _small_shape(c)):
            return False
        if c.overlap and (c.shrink_stages != c.expand_stages
                          or c.shrink_chunk_h != c.expand_cols):
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
        cfg = self.cfg
        T = x.shape[0]
        N = b.shape[2]
        out = ws if self.finalize else y
        if cutlass.const_expr(self.small is not None):
            items = a.shape[0] * a.shape[1]
            P = T * topk_ids.shape[1]
            small = ((P > cfg.small_min_per_bin * items) & (P < cfg.small_per_bin * items)) \
                | ((items > cfg.small_min_bins) & (items <= cfg.small_max_bins)
                   & (P >= items) & (P <= cfg.small_max_per_bin * items))
            if small:
                self.small.launch_bins(x, a, b, topk_ids, lora, s, out, stream)
            else:
                self.launch_bins(x, a, b, topk_ids, lora, s, out, stream)
        else:   # no small shape (the Ada design)
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
        CAP = NT * SU + 16
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
            if R > 32:
                self.item(x, a, b, s, out, sA, sX, sB, slist, swc, lora, topk_ids, l_b, e_b,
                          N, P, K, tidx, warp, lane, pre, 64, 64)
            elif R > 16:
                self.item(x, a, b, s, out, sA, sX, sB, slist, swc, lora, topk_ids, l_b, e_b,
                          N, P, K, tidx, warp, lane, pre, 32, 32)
            else:
                self.item(x, a, b, s, out, sA, sX, sB, slist, swc, lora, topk_ids, l_b, e_b,
                          N, P, K, tidx, warp, lane, pre, 32, 16)

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
                cfg.bin_warps, cfg.scan_unroll, 16)

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
