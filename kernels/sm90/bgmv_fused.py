"""sm_90a MoE-LoRA shrink + expand in one launch, for the plans of small batches (see
kernels/CONTRACT_BGMV.md, "fused plan kernel").

Same results, bit for bit, as BgmvShrinkSm90 followed by BgmvExpandSm90 (their pair
schedules: this kernel runs their work items, `_pair_item` of each, with the same configs),
so a plan's output does not depend on whether it ran fused.

Why: at T <= 32 a plan was two dependent launches. Even with PDL, the expand's CTAs found
little room on the SMs while the shrink's held the register file, and each kernel paid its
own first-wave latency (H200, T = 8: ~9.2 us each alone, 13.8 us together).

Schedule (all CTAs co-resident: cooperative launch, grid <= max_ctas):
1. entry: read the launch generation (kernels/_sync.py); issue bulk L2 prefetches of every B
   slice (64 output rows x R) of the CTA's expand items, and of the A rows of its shrink
   items after the first;
2. shrink items (pair p, 8 A rows), grid-stride: after an item, a release store of its ready
   flag (one flag per item, one writer);
3. expand items (64 output columns, token t), grid-stride: warp j loads its pair's B slice
   (L2 by now), waits (acquire) for the R / 8 flags of pair t * k + j, loads s, runs the
   chains, and the CTA finalizes as the pair schedule does.
A CTA waits only after all its shrink items are done and every CTA is resident, so no wait
can block a shrink item. Skipped pairs still get their (zero) s row and flag; their expand
warps never wait. CTA 0 publishes the next generation once every CTA has read this one.

Pairs are in token order (the plan's own order; a plan with sorted_token_ids runs the two
kernels). sync: int32 [1 + max_ctas + P * R / 8], zeroed once (the plan owns it; two plans
must not share one, nor may one plan run on two streams at once).
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels._sync import prefetch_l2, publish_generation, read_generation, set_flag
from kernels.sm90._bin_scan import slab_ptr
from kernels.sm90.bgmv_expand import _CN, _MAX_K, _VEC, BgmvExpandSm90, BgmvExpandSm90Config
from kernels.sm90.bgmv_shrink import BgmvShrinkSm90, BgmvShrinkSm90Config

SASS_REQUIRED = ("LDG", "STG", "HMMA", "UBLKPF")
SASS_FORBIDDEN = ("ATOM", "ATOMG", "ATOMS", "RED", "REDG", "STL", "LDL")

_DTYPES = (cutlass.Float16, cutlass.BFloat16)


@dataclass(frozen=True)
class BgmvFusedSm90Config:
    """max_pairs: plans with P = T * k below this run this kernel (the separate kernels'
        bin schedules take over from their bin_min_pairs; keep it <= both).
    ctas_per_sm: the co-resident CTAs per SM the caller's max_ctas assumes (the register
        bound of 8 warps at <= 128 registers).
    seg_h: the shrink's segment length (part of the arithmetic: must equal
        BgmvShrinkSm90Config.seg_h, or plans would round differently from the ops).
    prefetch: issue the bulk L2 prefetches at entry."""

    max_pairs: int = 384
    ctas_per_sm: int = 2
    seg_h: int = BgmvShrinkSm90Config.seg_h
    prefetch: bool = True


class BgmvFusedSm90:
    def __init__(self, dtype, finalize: bool, config: BgmvFusedSm90Config = BgmvFusedSm90Config()):
        if not BgmvFusedSm90.can_implement(dtype, config):
            raise ValueError(f"BgmvFusedSm90 cannot implement {dtype} with {config}")
        self.dtype = dtype
        self.finalize = bool(finalize)
        self.cfg = config
        self.shr = BgmvShrinkSm90(dtype, BgmvShrinkSm90Config(seg_h=config.seg_h, pdl=False))
        self.exp = BgmvExpandSm90(dtype, finalize, BgmvExpandSm90Config(pdl=False))
        self.num_threads = 32 * _MAX_K
        assert self.shr.cfg.pair_warps == _MAX_K

    @staticmethod
    def can_implement(dtype, config: BgmvFusedSm90Config) -> bool:
        c = config
        return (dtype in _DTYPES and 1 <= c.max_pairs and 1 <= c.ctas_per_sm <= 2
                and c.seg_h == BgmvShrinkSm90Config.seg_h)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, x: cute.Tensor, a: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                 lora: cute.Tensor, topk_w: cute.Tensor, s: cute.Tensor, y: cute.Tensor,
                 sync: cute.Tensor, max_ctas: cutlass.Int32, stream: cuda.CUstream):
        T = x.shape[0]
        R = a.shape[2]
        N = b.shape[2]
        P = T * topk_ids.shape[1]
        shr_items = P * (R // 8)
        exp_items = ((N + _CN - 1) // _CN) * T
        grid = cutlass.max(cutlass.min(cutlass.max(shr_items, exp_items), max_ctas), 1)
        self.kernel(x, a, b, topk_ids, lora, topk_w, s, y, sync).launch(
            grid=[grid, 1, 1], block=[self.num_threads, 1, 1], stream=stream,
            min_blocks_per_mp=self.cfg.ctas_per_sm, preferred_smem_carveout=25,
            cooperative=True)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, x: cute.Tensor, a: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
               lora: cute.Tensor, topk_w: cute.Tensor, s: cute.Tensor, y: cute.Tensor,
               sync: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
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
        P = T * K
        NTL = R // 8
        shr_items = P * NTL
        exp_items = ((N + _CN - 1) // _CN) * T
        zmask = cutlass.Int32(H) >> 30           # 0 at run time, opaque to ptxas
        # sync = [generation, arrived[max_ctas], flags[P * NTL]]
        nflag_base = sync.shape[0] - shr_items
        flags = cute.make_tensor(sync.iterator + nflag_base, cute.make_layout((shr_items,)))

        target = read_generation(sync, tidx, bid)

        smem = cutlass.utils.SmemAllocator()
        part = smem.allocate_tensor(cutlass.Float32, cute.make_layout((_MAX_K, 8), stride=(8, 1)), 16)
        if cutlass.const_expr(self.finalize):
            sd = smem.allocate_tensor(cutlass.Float32,
                                      cute.make_layout((_CN, _MAX_K), stride=(1, _CN)), 16)
            slive = smem.allocate_tensor(cutlass.Int32, cute.make_layout((_MAX_K,)), 16)
            sw = smem.allocate_tensor(cutlass.Float32, cute.make_layout((_MAX_K,)), 16)
        else:
            sd = None
            slive = None
            sw = None
        vec_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                       num_bits_per_copy=128)
        st_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float32,
                                      num_bits_per_copy=64)
        sv = cute.zipped_divide(s, (1, _VEC))        # ((1, 8), (P, nrv))
        bv = cute.zipped_divide(b, (1, 1, 1, _VEC))  # ((1,1,1,8), (L, E, N, nrv))

        if cutlass.const_expr(self.cfg.prefetch):
            # the B slices of this CTA's expand items (warp j: slot j) ...
            if (lane == 0) & (warp < K):
                for w in cutlass.range(bid, exp_items, nblk):
                    c = w // T
                    t = w - c * T
                    lo = lora[t]
                    ex = topk_ids[t, warp]
                    if (lo >= 0) & (lo < L) & (ex >= 0) & (ex < E):
                        n0 = c * _CN
                        rows = cutlass.min(_CN, N - n0)
                        prefetch_l2(slab_ptr(b, lo, ex, _VEC) + cute.assume(n0 * b.stride[2], divby=_VEC),
                                    rows * b.stride[2] * 2)
            # ... and the A rows of its shrink items after the first (the first loads now)
            if tidx == 32 * (_MAX_K - 1):
                for w in cutlass.range(bid + nblk, shr_items, nblk):
                    p = w // NTL
                    nt = w - p * NTL
                    t = p // K
                    lo = lora[t]
                    ex = topk_ids[t, p - t * K]
                    if (lo >= 0) & (lo < L) & (ex >= 0) & (ex < E):
                        prefetch_l2(slab_ptr(a, lo, ex, _VEC) + cute.assume(nt * 8 * a.stride[2], divby=_VEC),
                                    8 * a.stride[2] * 2)

        # shrink items (token order: the item's pair is p = w // NTL)
        for w in cutlass.range(bid, shr_items, nblk):
            p = w // NTL
            nt = w - p * NTL
            t = p // K
            lo = lora[t]
            ex = topk_ids[t, p - t * K]
            live = (lo >= 0) & (lo < L) & (ex >= 0) & (ex < E)
            self.shr._pair_item(x, a, s, part, vec_atom, p, t, nt, lo, ex, live,
                                cutlass.Boolean(True), zmask, tidx, warp, g, q)
            set_flag(flags, w, target, tidx)

        # expand items: wait per pair for its s row (flags), then as the pair schedule
        for w in cutlass.range(bid, exp_items, nblk):
            c = w // T
            t = w - c * T
            self.exp._pair_item(s, b, topk_ids, lora, topk_w, y, sv, bv, vec_atom, st_atom, sd,
                                slive, sw, c, t, zmask, tidx, warp, lane, g, q, flags, target)

        if (bid == 0) & (warp == 0):
            publish_generation(sync, target, nblk, lane)
