"""sm_90a MoE-LoRA shrink (see kernels/CONTRACT_BGMV.md, v3).

    s[p, r] = cvt(sum_h x[t, h] * a[l, e, r, h]),  p = order[q], t = p // k, j = p % k,
    l = lora[t], e = topk_ids[t, j]; 0 for skipped pairs; padding entries of `order` ignored.

Arithmetic (fixed by H and config.seg_h only; kernels/_mma.py has the fragment convention):
the dot products run on the tensor cores (mma.sync m16n8k16, fp32 accumulation), pairs as the
M rows, A rows (the rank) as the N columns in tiles of 8, H as k in 32-element blocks. H is cut
into segments of seg_h elements; a segment's partial P_s is the mma chain over its blocks
(block order, two steps per block) starting from 0, and s = cvt(((0 + P_0) + P_1) + ...),
segments in order. Vectors past H are zeros (whole blocks past H add exact zeros: the pair
schedule issues them, the bin schedule skips them, same bits). Neither T, k,
`order`, the grid nor which tile row a pair occupies changes that sequence (rows of an mma
are independent), so both schedules below give the same bits: deterministic and
batch-invariant. No atomics: every s element has exactly one writer.

Pair schedule (P < bin_min_pairs: small T, latency bound). Work item = (order entry, n-tile of
8 A rows), grid-stride over a grid of one CTA per item (capped). The CTA's pair_warps warps
take the segments (warp w: segments w, w + pair_warps, ...): each loads its segment's x and A
vectors straight into registers (16-byte LDGs, all in flight together; with seg_h 384 and 8
warps one round covers H <= 3072), runs the chain with the pair's x in every tile row, and
leaves P_s in shared memory; 8 threads then add the partials in segment order. From
pair_smem_min_items items at rank <= 32 the staged build runs instead: each lane cp.asyncs
the same vectors into shared memory and reads them back as the same fragments (61 registers
instead of 125, so 4 CTAs per SM, and a plan's expand fits beside them to start its B loads
while this runs).

Bin schedule (P >= bin_min_pairs, large T, bandwidth bound). Work item = one (adapter,
expert) bin, grid-stride. The CTA collects the bin's pairs from the routing table into a
shared list (kernels/sm90/_bin_scan.py: prefix sums, no atomics; a first few A stages are
already loading when P >= bin_prefetch_min * L * E), and per group of up to 16 * bin_mtiles
pairs streams A[l, e] and
the group's x rows through a bin_stages-deep 16-byte cp.async ring in chunks of bin_chunk_h
columns (twice that at rank <= 32; rows XOR-swizzled by parity: conflict-free fragment reads).
Warp w computes the (m-tile, n-tile) units w, w + bin_warps, ...: the A slab is read from
DRAM once per group and every A element feeds up to 16 pairs per instruction. At 1-2 pairs
per bin on average (bin_small_min_per_bin < P / (L * E) < bin_small_per_bin) the same kernel
runs in its small-bin shape: more CTAs per SM with fewer warps and stages each, so the bins
run in about one wave instead of 1.5 (same bits). Dead pairs
(skipped adapter / expert) are zeroed by a grid-stride pass; every p in [0, P) is written
(`order` is not used in bin mode).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from kernels._mma import all_loaded, is_bf16, mma_block, words
from kernels.sm90._bin_scan import routed, run_bin, slab_ptr

SASS_REQUIRED = ("LDG", "HMMA", "LDGSTS", "LDGDEPBAR", "VOTE")
SASS_FORBIDDEN = ("ATOM", "ATOMG", "ATOMS", "RED", "REDG", "STL", "LDL")

_DTYPES = (cutlass.Float16, cutlass.BFloat16)
_VEC = 8      # elements per 16-byte vector
_KB = 32      # elements per k block (4 lanes x one vector)
_R_MAX = 64   # the contract's rank bound: the ring holds 64 A rows
_SMEM_LIMIT = 227 * 1024


def _pair_smem_bytes(c) -> int:
    """The staged pair build's slots: per warp and k block of a segment, 32 A vectors (one
    per lane) and 4 x vectors, 16 bytes each."""
    return c.pair_warps * (c.seg_h // _KB) * (32 + 4) * 16


def _has_staged(c) -> bool:
    """Whether the staged pair build is compiled at all (either threshold on)."""
    return c.pair_smem_min_items > 0 or c.pair_smem_wide_min_items > 0


def _bin_smem_bytes(c) -> int:
    nt = 32 * c.bin_warps
    # A: 64 rows x bin_chunk_h (or 32 x twice that); x rows: up to twice bin_chunk_h
    ring = c.bin_stages * (_R_MAX + 2 * 16 * c.bin_mtiles) * c.bin_chunk_h * 2
    return ring + 4 * (nt * c.bin_scan_unroll + 16 * c.bin_mtiles) \
        + 4 * c.bin_scan_unroll * c.bin_warps + 1024


@dataclass(frozen=True)
class BgmvShrinkSm90Config:
    """seg_h: H elements per segment (part of the arithmetic: changing it changes the bits).
    pair_warps: warps of a pair-schedule CTA = segments of one pair and n-tile in flight.
    num_sms, ctas_per_sm: pair-schedule grid = min(work items, num_sms * ctas_per_sm); the
        default cap is above any item count (one CTA per item).
    bin_*: the bin schedule (module docstring). bin_mtiles: 16-pair m-tiles per group;
        bin_chunk_h: H elements per ring stage at rank 33..64, twice that at rank <= 32 (the
        same bytes per stage).
    pdl: the pair kernel lets the next kernel in the stream launch as soon as all its CTAs
        run (griddepcontrol.launch_dependents): the expand of a plan then loads its B
        weights while this kernel runs and waits for s (see BgmvExpandSm90Config.pdl)."""

    seg_h: int = 384
    pair_warps: int = 8
    pair_ctas_per_sm: int = 2      # register bound: 2 x 8 warps resident per SM
    # From pair_smem_min_items work items the pair schedule runs its staged build: operands
    # by cp.async through shared memory (54 KB per CTA at seg_h 384), 61 registers, so 4 CTAs
    # fit an SM, and a plan's expand (PDL) finds room beside them to start its B loads early.
    # Same fragments, same chain: same bits. H200 A/B (perf/results/
    # tune_memops_h200_bgmv_pair_smem.json, 3 rounds, plan us): T=4 10.0 -> 9.65, T=8 13.4 ->
    # 12.3, T=12..60 within +-2%, T=1 7.5 -> 7.7 (hence the threshold; 0: never). At rank
    # 33..64 with the register build of the plan's expand it ran 5-10% slower (perf/results/
    # bgmv_moe_h200_d6b9f5e.json: T=4 13.4 -> 14.4 us, T=32 49.2 -> 54.3): see the next field.
    pair_smem_min_items: int = 64
    # rank 33..64: the staged build from this many items (0: never), where the plan's expand
    # runs its staged rank-64 build too (BgmvExpandSm90Config.pair_staged64_min_items). H200
    # (perf/results/tune_memops_h200_bgmv_staged_r64.json, 3 rounds, rank 64 plans, both
    # staged at every count): T=8 22.4 -> 20.3 us, T=16 33.8 -> 31.5, T=32 50.1 -> 47.6,
    # T=60 81.0 -> 74.0, but T=1 8.5 -> 9.1 and T=4 13.4 -> 14.4 (192 items), hence 264.
    pair_smem_wide_min_items: int = 264
    pair_smem_ctas_per_sm: int = 4
    num_sms: int = 65536
    ctas_per_sm: int = 4
    bin_mode: bool = True          # False: always the pair schedule
    bin_min_pairs: int = 384       # P = T * k from which the bin schedule runs
    bin_warps: int = 4
    bin_mtiles: int = 1
    bin_chunk_h: int = 64
    bin_stages: int = 4
    bin_scan_unroll: int = 8       # pair-table entries per thread per scan round
    bin_ctas_per_sm: int = 4
    bin_prefetch_min: int = 2      # pairs per bin (P / (L * E)) from which a bin's first A
                                   # stages are issued before its pair scan (0: never)
    # a second bin shape for bin_small_min_per_bin * L * E < P < bin_small_per_bin * L * E
    # (bin_small_per_bin 0: none). At 1-2 pairs per bin on average most bins hold a pair or
    # two, and the big shape's 4 CTAs per SM run them in about 1.5 waves; twice the CTAs per
    # SM, each with half the warps and stages (one stage in flight), run them in about one.
    # Outside that window the slower streaming of a small CTA costs more than the waves save.
    # H200 plans (H=2688 R=32 E=128 L=8 top-6, perf/results/tune_memops_h200_bgmv_small_bins
    # .json): T=256 (1.5 pairs per bin) 98.4 -> 94.5 us; small everywhere: T=1024 +0.7%,
    # T=2048 +4.5%. Benchmark (perf/results/bgmv_moe_h200_small_bins.json, small below 2 per
    # bin): 1.5 per bin -2.5 to -4.8% (H=2688 / 3072, r=16 / 32 / 64), 1.0 per bin -5.2%
    # (H=4096 top-2 T=512) and +7.1% (H=3072 E=256 top-8 T=256), 0.5 per bin +19%
    # (H=4096 top-2 T=256). Same bits: the arithmetic depends on seg_h only.
    bin_small_min_per_bin: int = 1
    bin_small_per_bin: int = 2
    bin_small_warps: int = 2
    bin_small_ctas_per_sm: int = 8
    bin_small_stages: int = 2
    pdl: bool = True


def _small_shape(c: BgmvShrinkSm90Config) -> BgmvShrinkSm90Config:
    return replace(c, bin_warps=c.bin_small_warps, bin_ctas_per_sm=c.bin_small_ctas_per_sm,
                   bin_stages=c.bin_small_stages, bin_small_per_bin=0)


class BgmvShrinkSm90:
    SMEM_LIMIT = _SMEM_LIMIT    # per CTA (the Ada design's subclass lowers it)

    def __init__(self, dtype, config: BgmvShrinkSm90Config = BgmvShrinkSm90Config()):
        if not type(self).can_implement(dtype, config):
            raise ValueError(f"{type(self).__name__} cannot implement {dtype} with {config}")
        self.dtype = dtype
        self.cfg = config
        self.bf16 = is_bf16(dtype)
        # the small-bin shape: the same kernel compiled with its own warps / ring / CTAs
        self.small = None
        if config.bin_mode and config.bin_small_per_bin > 0:
            self.small = type(self)(dtype, _small_shape(config))

    @classmethod
    def can_implement(cls, dtype, config: BgmvShrinkSm90Config) -> bool:
        c = config
        if dtype not in _DTYPES:
            return False
        if c.seg_h < _KB or c.seg_h % _KB or c.seg_h > 1024:
            return False
        if not (1 <= c.pair_warps <= 32 and c.num_sms >= 1 and c.ctas_per_sm >= 1):
            return False
        if not (1 <= c.bin_warps <= 16 and 1 <= c.bin_mtiles <= 4):
            return False
        # a stage row is whole groups of 8 vectors (the parity swizzle XORs chunk bit 2)
        if c.bin_chunk_h < 64 or c.bin_chunk_h % 64:
            return False
        if not (2 <= c.bin_stages <= 8):
            return False
        nt = 32 * c.bin_warps
        if (_R_MAX * (c.bin_chunk_h // _VEC)) % nt:
            return False
        if not (1 <= c.bin_scan_unroll <= 32 and c.bin_min_pairs >= 1 and c.bin_ctas_per_sm >= 1):
            return False
        if c.bin_small_per_bin < 0 or c.bin_small_min_per_bin < 0:
            return False
        if _has_staged(c) and (c.pair_smem_ctas_per_sm < 1 or _pair_smem_bytes(c) > cls.SMEM_LIMIT):
            return False
        if c.bin_small_per_bin > 0 and not cls.can_implement(dtype, _small_shape(c)):
            return False
        return _bin_smem_bytes(c) <= cls.SMEM_LIMIT

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, x: cute.Tensor, a: cute.Tensor, topk_ids: cute.Tensor,
                 lora: cute.Tensor, order: cute.Tensor, s: cute.Tensor,
                 stream: cuda.CUstream):
        cfg = self.cfg
        Q = order.shape[0]
        R = a.shape[2]
        P = x.shape[0] * topk_ids.shape[1]
        use_bin = cutlass.Boolean(False)
        if cutlass.const_expr(cfg.bin_mode):
            use_bin = P >= cfg.bin_min_pairs
        if use_bin:
            b_items = a.shape[0] * a.shape[1]
            small = cutlass.Boolean(False)
            if cutlass.const_expr(self.small is not None):
                small = (P > cfg.bin_small_min_per_bin * b_items) \
                    & (P < cfg.bin_small_per_bin * b_items)
            if small:
                self.small.launch_bin(x, a, topk_ids, lora, s, stream)
            else:
                self.launch_bin(x, a, topk_ids, lora, s, stream)
        else:
            items = Q * (R // 8)
            grid = cutlass.max(cutlass.min(items, cfg.num_sms * cfg.ctas_per_sm), 1)
            if cutlass.const_expr(_has_staged(cfg)):
                staged = cutlass.Boolean(False)
                if cutlass.const_expr(cfg.pair_smem_min_items > 0):
                    staged = (items >= cfg.pair_smem_min_items) & (R <= _KB)
                if cutlass.const_expr(cfg.pair_smem_wide_min_items > 0):
                    staged = staged | ((items >= cfg.pair_smem_wide_min_items) & (R > _KB))
                if staged:
                    self.launch_pair(x, a, topk_ids, lora, order, s, grid, stream, True)
                else:
                    self.launch_pair(x, a, topk_ids, lora, order, s, grid, stream, False)
            else:   # no staged build compiled at all (the Ada design)
                self.launch_pair(x, a, topk_ids, lora, order, s, grid, stream, False)

    @cute.jit
    def launch_pair(self, x: cute.Tensor, a: cute.Tensor, topk_ids: cute.Tensor,
                    lora: cute.Tensor, order: cute.Tensor, s: cute.Tensor, grid: cutlass.Int32,
                    stream: cuda.CUstream, staged: cutlass.Constexpr):
        """The pair kernel, its staged build (shared memory carveout, pair_smem_ctas_per_sm)
        or the register one."""
        cfg = self.cfg
        self.kernel(x, a, topk_ids, lora, order, s, staged).launch(
            grid=[grid, 1, 1], block=[32 * cfg.pair_warps, 1, 1], stream=stream,
            min_blocks_per_mp=cfg.pair_smem_ctas_per_sm if staged else cfg.pair_ctas_per_sm,
            preferred_smem_carveout=100 if staged else 25)

    @cute.jit
    def launch_bin(self, x: cute.Tensor, a: cute.Tensor, topk_ids: cute.Tensor,
                   lora: cute.Tensor, s: cute.Tensor, stream: cuda.CUstream):
        """The bin kernel in this instance's shape (a CTA per (adapter, expert) bin)."""
        cfg = self.cfg
        b_items = a.shape[0] * a.shape[1]
        b_grid = cutlass.max(cutlass.min(b_items, cfg.num_sms * cfg.bin_ctas_per_sm), 1)
        self.bin_kernel(x, a, topk_ids, lora, s).launch(
            grid=[b_grid, 1, 1], block=[32 * cfg.bin_warps, 1, 1], stream=stream,
            min_blocks_per_mp=cfg.bin_ctas_per_sm, preferred_smem_carveout=100)

    # ------------------------------------------------------------------ pair schedule
    @cute.kernel
    def kernel(self, x: cute.Tensor, a: cute.Tensor, topk_ids: cute.Tensor,
               lora: cute.Tensor, order: cute.Tensor, s: cute.Tensor, staged: cutlass.Constexpr):
        """staged: the build that stages each segment through shared memory
        (_pair_seg_smem) instead of holding it in registers."""
        cfg = self.cfg
        NW = cfg.pair_warps
        SB = cfg.seg_h // _KB                   # k blocks per segment
        if cutlass.const_expr(cfg.pdl):
            # a dependent kernel waits (griddepcontrol.wait) before it reads s
            cute.arch.griddepcontrol_launch_dependents()
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
        K = topk_ids.shape[1]
        P = T * K
        Q = order.shape[0]
        NTL = R // 8
        nvec = H // _VEC
        nb = (H + _KB - 1) // _KB
        nseg = (nb + SB - 1) // SB
        rounds = (nseg + NW - 1) // NW
        items = Q * NTL
        zmask = cutlass.Int32(H) >> 30           # 0 at run time (H < 2^30), unknown to ptxas

        smem = cutlass.utils.SmemAllocator()
        part = smem.allocate_tensor(cutlass.Float32, cute.make_layout((NW, 8), stride=(8, 1)), 16)
        vec_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                       num_bits_per_copy=128)
        sA, sX, cp_atom = None, None, None
        if cutlass.const_expr(staged):
            # per warp: its lanes' A vectors of one segment (lane-major per k block: the
            # reads are conflict-free) and the segment's x vectors (read as a broadcast)
            sA = smem.allocate_tensor(self.dtype, cute.make_layout(NW * SB * 32 * _VEC), 16)
            sX = smem.allocate_tensor(self.dtype, cute.make_layout(NW * SB * 4 * _VEC), 16)
            cp_atom = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype,
                num_bits_per_copy=128)

        for w in cutlass.range(bid, items, nblk):
            qi = w // NTL
            nt = w - qi * NTL
            # guess token order (p == q, what a plan without sorted_token_ids passes) so the
            # routing loads fly together with order's instead of after it
            pg = cutlass.Int32(cutlass.min(qi, P - 1))
            tg = pg // K
            lo = lora[tg]
            ex = topk_ids[tg, pg - tg * K]
            p = order[qi]
            valid = (p >= 0) & (p < P)
            pc = cutlass.Int32(cutlass.select_(valid, p, 0))
            t = pc // K
            if pc != pg:
                lo = lora[t]
                ex = topk_ids[t, pc - t * K]
            live = valid & routed(lo, ex, L, E)
            tot = cutlass.Float32(0.0)
            if live:
                r = nt * 8 + g
                for rd in cutlass.range(rounds):
                    seg = rd * NW + warp
                    if seg < nseg:
                        # lane (g, q) loads vector q of every k block of the segment from
                        # one base per operand (immediate offsets: few address registers);
                        # vectors past H stay zero
                        xs, as_ = self.seg_views(x, a, t, lo, ex, r, seg, q)
                        acc = cute.make_rmem_tensor((4,), cutlass.Float32)
                        acc.fill(0.0)
                        if cutlass.const_expr(staged):
                            self._pair_seg_smem(xs, as_, sA, sX, acc, seg, nvec, warp, lane,
                                                g, q, cp_atom)
                        else:
                            xf = cute.make_rmem_tensor((_VEC, SB), self.dtype)
                            af = cute.make_rmem_tensor((_VEC, SB), self.dtype)
                            xf.fill(0.0)
                            af.fill(0.0)
                            for bb in cutlass.range_constexpr(SB):
                                if (seg * SB + bb) * 4 + q < nvec:
                                    cute.copy(vec_atom, xs[None, bb], xf[None, bb])
                                    cute.copy(vec_atom, as_[None, bb], af[None, bb])
                            # ptxas sinks each load down to its mma (one round trip per
                            # block) unless the first mma depends on all of them: an
                            # always-zero term
                            hold = all_loaded([xf, af], zmask)
                            for bb in cutlass.range_constexpr(SB):
                                xw = words(xf[None, bb])
                                if cutlass.const_expr(bb == 0):
                                    xw[0] = xw[0] | hold
                                mma_block(xw, xw, words(af[None, bb]), acc, self.bf16)
                        if g == 0:
                            part[warp, 2 * q] = acc[0]
                            part[warp, 2 * q + 1] = acc[1]
                    cute.arch.sync_threads()
                    if tidx < 8:
                        for ww in cutlass.range_constexpr(NW):
                            if rd * NW + ww < nseg:
                                tot = tot + part[ww, tidx]
                    cute.arch.sync_threads()
            if valid & (tidx < 8):
                s[pc, nt * 8 + tidx] = tot.to(self.dtype)   # 0 for a skipped pair

    def seg_views(self, x: cute.Tensor, a: cute.Tensor, t, lo, ex, r, seg, q):
        """Lane (g, q)'s vectors of one segment: x[t] and A[lo, ex] row r, vector q of every
        k block ((8, SB) tensors from one base each: immediate offsets, few address registers)."""
        SB = self.cfg.seg_h // _KB
        h0 = seg * (SB * _KB) + _VEC * q
        xs = cute.make_tensor(x.iterator + cute.assume(t * x.stride[0] + h0, divby=_VEC),
                              cute.make_layout((_VEC, SB), stride=(1, _KB)))
        as_ = cute.make_tensor(
            slab_ptr(a, lo, ex, _VEC) + cute.assume(r * a.stride[2] + h0, divby=_VEC),
            cute.make_layout((_VEC, SB), stride=(1, _KB)))
        return xs, as_

    @cute.jit
    def _pair_seg_smem(self, xs: cute.Tensor, as_: cute.Tensor, sA: cute.Tensor,
                       sX: cute.Tensor, acc: cute.Tensor, seg: cutlass.Int32,
                       nvec: cutlass.Int32, warp: cutlass.Int32, lane: cutlass.Int32,
                       g: cutlass.Int32, q: cutlass.Int32, cp_atom):
        """One segment of the pair schedule staged through shared memory (staged build): the
        lane's A vectors and (lanes g == 0) the x vectors by cp.async, then the same mma
        chain on the same fragments as the register build (vectors past H are zeros).
        No operand registers are held across the loads, so 4 CTAs fit an SM instead of 2."""
        SB = self.cfg.seg_h // _KB
        va = warp * (SB * 32) + lane
        vx = warp * (SB * 4) + q
        self.seg_copy(xs, as_, sA, sX, seg, nvec, va, vx, g, q, cp_atom)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_warp()      # the x vectors come from the lanes g == 0
        self.seg_chain(sA, sX, acc, seg, nvec, va, vx, q)
        # the next round's copies overwrite this warp's vectors: every lane has read them
        cute.arch.sync_warp()

    @cute.jit
    def seg_copy(self, xs: cute.Tensor, as_: cute.Tensor, sA: cute.Tensor, sX: cute.Tensor,
                 seg: cutlass.Int32, nvec: cutlass.Int32, va: cutlass.Int32, vx: cutlass.Int32,
                 g: cutlass.Int32, q: cutlass.Int32, cp_atom):
        """cp.async a segment's vectors (seg_views) into the warp's slots: the lane's A vectors
        at va + 32 * block (lane-major per k block: conflict-free reads), the x vectors (lanes
        g == 0) at vx + 4 * block; vectors past H are not loaded."""
        SB = self.cfg.seg_h // _KB
        for bb in cutlass.range_constexpr(SB):
            if (seg * SB + bb) * 4 + q < nvec:
                cute.copy(cp_atom, as_[None, bb], cute.local_tile(sA, (_VEC,), (va + 32 * bb,)))
                if g == 0:
                    cute.copy(cp_atom, xs[None, bb], cute.local_tile(sX, (_VEC,), (vx + 4 * bb,)))

    @cute.jit
    def seg_chain(self, sA: cute.Tensor, sX: cute.Tensor, acc: cute.Tensor, seg: cutlass.Int32,
                  nvec: cutlass.Int32, va: cutlass.Int32, vx: cutlass.Int32, q: cutlass.Int32):
        """acc += the segment's mma chain on the vectors seg_copy left in shared memory (the
        pair's x in every tile row; vectors past H are zeros): P_seg when acc starts at 0."""
        SB = self.cfg.seg_h // _KB
        for bb in cutlass.range_constexpr(SB):
            xf = cute.make_rmem_tensor((_VEC,), self.dtype)
            af = cute.make_rmem_tensor((_VEC,), self.dtype)
            xf.fill(0.0)
            af.fill(0.0)
            if (seg * SB + bb) * 4 + q < nvec:
                cute.autovec_copy(cute.local_tile(sX, (_VEC,), (vx + 4 * bb,)), xf)
                cute.autovec_copy(cute.local_tile(sA, (_VEC,), (va + 32 * bb,)), af)
            xw = words(xf)
            mma_block(xw, xw, words(af), acc, self.bf16)

    # ================================================================== bin schedule
    @cute.kernel
    def bin_kernel(self, x: cute.Tensor, a: cute.Tensor, topk_ids: cute.Tensor,
                   lora: cute.Tensor, s: cute.Tensor):
        cfg = self.cfg
        if cutlass.const_expr(cfg.pdl):
            # a plan's expand (launched with PDL) may take the SMs this grid's CTAs leave;
            # it waits (griddepcontrol.wait) before it reads s
            cute.arch.griddepcontrol_launch_dependents()
        BW, G = cfg.bin_warps, 16 * cfg.bin_mtiles
        HC, S, SU = cfg.bin_chunk_h, cfg.bin_stages, cfg.bin_scan_unroll
        NT = 32 * BW
        CAP = NT * SU + G
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        T = x.shape[0]
        L = a.shape[0]
        E = a.shape[1]
        R = a.shape[2]
        K = topk_ids.shape[1]
        P = T * K
        items = L * E

        smem = cutlass.utils.SmemAllocator()
        # flat rings, addressed through _sw (parity-swizzled 16-byte vectors)
        sA = smem.allocate_tensor(self.dtype, cute.make_layout((S * _R_MAX * HC,)), 128)
        sX = smem.allocate_tensor(self.dtype, cute.make_layout((S * G * 2 * HC,)), 128)
        slist = smem.allocate_tensor(cutlass.Int32, cute.make_layout((CAP,)), 16)
        swc = smem.allocate_tensor(cutlass.Int32, cute.make_layout((SU * BW + 1,)), 16)

        self.zero_dead(s, topk_ids, lora, L, E, P, K, R, bid, nblk, tidx, NT)

        # with few empty bins, a bin's first weight stages load while it scans (the loads
        # of an empty bin are wasted, hence the threshold)
        pre = cutlass.Boolean(False)
        if cutlass.const_expr(cfg.bin_prefetch_min > 0):
            pre = P >= cfg.bin_prefetch_min * L * E
        for w in cutlass.range(bid, items, nblk):
            l_b = w // E
            e_b = w - l_b * E
            if R > 32:
                self.bin_item(x, a, s, sA, sX, slist, swc, lora, topk_ids, l_b, e_b, P, K,
                              tidx, warp, lane, pre, 64)
            else:
                self.bin_item(x, a, s, sA, sX, slist, swc, lora, topk_ids, l_b, e_b, P, K,
                              tidx, warp, lane, pre, 32)

    @cute.jit
    def bin_item(self, x, a, s, sA, sX, slist, swc, lora, topk_ids, l_b, e_b, P, K, tidx,
                 warp, lane, pre, RT: cutlass.Constexpr):
        """Bin (l_b, e_b): collect its pairs, run them in groups. RT = ring rows (the rank
        rounded up to 32 or 64): R <= 32 streams twice as many H columns per stage in the same
        shared memory, so the bytes in flight per CTA do not depend on R. pre: the first
        group's A stages are issued before the scan (one commit group per stage, as the
        group's own prologue would)."""
        cfg = self.cfg
        BW, G = cfg.bin_warps, 16 * cfg.bin_mtiles
        SU = cfg.bin_scan_unroll
        NT = 32 * BW
        if pre:
            self.prefetch_a(x, a, sA, sX, l_b, e_b, tidx, RT)
        run_bin(lambda off, n, f: self.bin_group(x, a, s, sA, sX, slist, off, n, l_b, e_b, K,
                                                  tidx, warp, lane, f, RT),
                lora, topk_ids, l_b, e_b, P, K, slist, swc, tidx, warp, lane, pre, NT, BW,
                SU, G)

    @cute.jit
    def zero_dead(self, s: cute.Tensor, topk_ids: cute.Tensor, lora: cute.Tensor, L, E, P, K,
                  R, bid, nblk, tidx, NT: cutlass.Constexpr):
        """Dead pairs (skipped adapter / expert): their s rows are zero (grid-stride, a
        thread per pair). The bin schedule never visits them."""
        for p in cutlass.range(bid * NT + tidx, P, nblk * NT):
            t = p // K
            j = p - t * K
            lo = lora[t]
            ex = topk_ids[t, j]
            if not routed(lo, ex, L, E):
                for r in cutlass.range(R):
                    s[p, r] = self.dtype(0.0)

    def stage_cols(self, RT: int) -> int:
        """H columns per ring stage for ring rows RT (the same bytes per stage at every RT)."""
        return self.cfg.bin_chunk_h * (_R_MAX // RT)

    @cute.jit
    def prefetch_a(self, x: cute.Tensor, a: cute.Tensor, sA: cute.Tensor, sX: cute.Tensor,
                   l_b, e_b, tidx, RT: cutlass.Constexpr):
        """The first bin_stages - 1 A stages of bin (l_b, e_b), one commit group each, issued
        before its pair scan (the first group then loads the x rows only)."""
        HC = self.stage_cols(RT)
        H = x.shape[1]
        n_st = (H + HC - 1) // HC
        slab = slab_ptr(a, l_b, e_b, _VEC)
        for st in cutlass.range_constexpr(self.cfg.bin_stages - 1):
            if st < n_st:
                self.bin_load_stage(x, a, slab, sA, sX, None, H // _VEC, st, st, tidx, RT, 1)
            cute.arch.cp_async_commit_group()

    @staticmethod
    def _sw(rows: int, HC: int, slot, row, ch):
        """Vector index of (slot, row, 16-byte chunk ch) in a flat ring of `rows` rows of HC
        elements: rows of odd parity have their chunks XOR 4, so the 8 lanes of a fragment
        read phase (rows g, g + 1 of one block) hit 8 different bank groups."""
        cpr = HC // _VEC
        return (slot * rows + row) * cpr + (ch ^ ((row & 1) << 2))

    @cute.jit
    def bin_group(self, x: cute.Tensor, a: cute.Tensor, s: cute.Tensor, sA: cute.Tensor,
                  sX: cute.Tensor, slist: cute.Tensor, off: cutlass.Int32, n: cutlass.Int32,
                  l_b: cutlass.Int32, e_b: cutlass.Int32, K: cutlass.Int32,
                  tidx: cutlass.Int32, warp: cutlass.Int32, lane: cutlass.Int32,
                  pre: cutlass.Boolean, RT: cutlass.Constexpr, tail=None):
        """s rows of the n (<= G) pairs slist[off .. off+n): A[l_b, e_b] and the pairs' x rows
        stream through the ring once (stages of HC = bin_chunk_h * 64 / RT columns); the same
        segment chains as the pair schedule: a chain closes (tot += cur) where a new segment
        starts, which may be inside a stage. tail (bgmv_binplan): tail(j, slot) issues stage j
        of what follows in the same ring (the expand's B chunks), one commit group each, in
        the ring positions after the last A stage."""
        cfg = self.cfg
        BW, MT, G = cfg.bin_warps, cfg.bin_mtiles, 16 * cfg.bin_mtiles
        HC, S = cfg.bin_chunk_h * (_R_MAX // RT), cfg.bin_stages
        NT = 32 * BW
        BPS = HC // _KB                          # k blocks per stage
        SB = cfg.seg_h // _KB                    # k blocks per segment
        UM = (MT * (RT // 8) + BW - 1) // BW     # (m-tile, n-tile) units per warp, at most
        cpr = HC // _VEC
        g = lane >> 2
        q = lane & 3
        H = x.shape[1]
        NTL = a.shape[2] // 8
        nvec = H // _VEC
        nb = (H + _KB - 1) // _KB
        n_st = (H + HC - 1) // HC
        NXS = (G * cpr + NT - 1) // NT
        # token of the x row each of this thread's x-copy slots serves (-1: no pair)
        xtok = cute.make_rmem_tensor((NXS,), cutlass.Int32)
        for ps in cutlass.range_constexpr(NXS):
            m = (ps * NT + tidx) // cpr
            xtok[ps] = cutlass.Int32(-1)
            if m < n:
                xtok[ps] = slist[off + m] // K

        slab = slab_ptr(a, l_b, e_b, _VEC)
        for st in cutlass.range_constexpr(S - 1):
            if st < n_st:
                if pre:        # A issued before the scan: the x rows only
                    self.bin_load_stage(x, a, slab, sA, sX, xtok, nvec, st, st, tidx, RT, 2)
                else:
                    self.bin_load_stage(x, a, slab, sA, sX, xtok, nvec, st, st, tidx, RT, 0)
            elif cutlass.const_expr(tail is not None):
                tail(st - n_st, st)
            cute.arch.cp_async_commit_group()

        tot = cute.make_rmem_tensor((4, UM), cutlass.Float32)
        cur = cute.make_rmem_tensor((4, UM), cutlass.Float32)
        tot.fill(0.0)
        cur.fill(0.0)
        for hs in cutlass.range(n_st):
            cute.arch.cp_async_wait_group(S - 2)
            cute.arch.sync_threads()
            nxt = hs + (S - 1)
            if nxt < n_st:
                self.bin_load_stage(x, a, slab, sA, sX, xtok, nvec, nxt, nxt % S, tidx, RT, 0)
            elif cutlass.const_expr(tail is not None):
                tail(nxt - n_st, nxt % S)
            cute.arch.cp_async_commit_group()
            slot = hs % S
            for i in cutlass.range_constexpr(UM):
                u = warp + BW * i
                mt = u // NTL
                nt = u - mt * NTL
                if (mt < MT) & (mt * 16 < n):
                    acc = cur[None, i]
                    for bb in cutlass.range_constexpr(BPS):
                        gb = hs * BPS + bb
                        if gb < nb:
                            if (gb > 0) & (gb % SB == 0):
                                for e4 in cutlass.range_constexpr(4):
                                    tot[e4, i] = tot[e4, i] + cur[e4, i]
                                    cur[e4, i] = cutlass.Float32(0.0)
                            ch = bb * 4 + q
                            ok = gb * 4 + q < nvec
                            xa = self._frag(sX, G, HC, slot, mt * 16 + g, ch, ok)
                            xb = self._frag(sX, G, HC, slot, mt * 16 + g + 8, ch, ok)
                            wv = self._frag(sA, RT, HC, slot, nt * 8 + g, ch, ok)
                            mma_block(xa, xb, wv, acc, self.bf16)
        # every warp is out of the ring (and done with slist) before it is refilled
        cute.arch.sync_threads()

        for i in cutlass.range_constexpr(UM):
            u = warp + BW * i
            mt = u // NTL
            nt = u - mt * NTL
            if mt < MT:
                for hh in cutlass.range_constexpr(2):
                    m = mt * 16 + g + 8 * hh
                    if m < n:
                        pm = slist[off + m]
                        # the last segment's chain closes here
                        s[pm, nt * 8 + 2 * q] = (tot[2 * hh, i] + cur[2 * hh, i]).to(self.dtype)
                        s[pm, nt * 8 + 2 * q + 1] = \
                            (tot[2 * hh + 1, i] + cur[2 * hh + 1, i]).to(self.dtype)
        cute.arch.sync_threads()

    @cute.jit
    def _frag(self, ring: cute.Tensor, rows: cutlass.Constexpr, HC: cutlass.Constexpr,
              slot: cutlass.Int32, row: cutlass.Int32, ch: cutlass.Int32, ok: cutlass.Boolean):
        """The 4 words of vector `ch` of `row` in ring slot `slot` (zeros where not ok)."""
        fr = cute.make_rmem_tensor((_VEC,), self.dtype)
        fr.fill(0.0)
        if ok:
            src = cute.local_tile(ring, (_VEC,), (self._sw(rows, HC, slot, row, ch),))
            fr.store(src.load())
        return words(fr)

    @cute.jit
    def bin_load_stage(self, x: cute.Tensor, a: cute.Tensor, slab: cute.Pointer,
                       sA: cute.Tensor, sX: cute.Tensor, xtok: cute.Tensor,
                       nvec: cutlass.Int32, st: cutlass.Int32, slot: cutlass.Int32,
                       tidx: cutlass.Int32, RT: cutlass.Constexpr, what: cutlass.Constexpr):
        """cp.async H-chunk `st` (HC columns) of A[l_b, e_b] (what != 2) and of the group's x
        rows (what != 1) into ring slot `slot`. Vectors past H or rows past R are not copied
        (the fragment reads zero the former and never read the latter)."""
        cfg = self.cfg
        G = 16 * cfg.bin_mtiles
        HC = cfg.bin_chunk_h * (_R_MAX // RT)
        NT = 32 * cfg.bin_warps
        cpr = HC // _VEC
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.dtype, num_bits_per_copy=128)
        # A rows from the bin's slab pointer with 32-bit offsets (R * H elements)
        R = a.shape[2]
        s_r = cutlass.Int32(a.stride[2])
        for ps in cutlass.range_constexpr(RT * cpr // NT if what != 2 else 0):
            v = ps * NT + tidx
            row = v // cpr
            ch = v - row * cpr
            gch = st * cpr + ch
            if (gch < nvec) & (row < R):
                src = cute.make_tensor(slab + cute.assume(row * s_r + gch * _VEC, divby=_VEC),
                                       cute.make_layout(_VEC))
                dst = cute.local_tile(sA, (_VEC,), (self._sw(RT, HC, slot, row, ch),))
                cute.copy(atom, src, dst)
        for ps in cutlass.range_constexpr((G * cpr + NT - 1) // NT if what != 1 else 0):
            v = ps * NT + tidx
            row = v // cpr
            ch = v - row * cpr
            gch = st * cpr + ch
            tok = xtok[ps]
            if (tok >= 0) & (gch < nvec):
                src = cute.local_tile(x[tok, None], (_VEC,), (gch,))
                dst = cute.local_tile(sX, (_VEC,), (self._sw(G, HC, slot, row, ch),))
                cute.copy(atom, src, dst)
