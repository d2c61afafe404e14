"""Ada design of AttnRes (Kimi attention residuals, fused serving form; sm_80 / sm_89,
also built for sm_90a to run on an H200 with <= 99 KB shared memory per block).

Per row m (contract: kernels/CONTRACT_ATTN_RES.md):
    p   = has_delta ? bf16(prefix[m] + delta[m]) : prefix[m]
    sources c_i = blocks[m, i] (i < K, i != write_idx), and p (counted twice when
    0 <= write_idx < K, since then c_write_idx == c_K == p)
    s_i = rsqrt(mean(c_i^2) + eps) * dot(c_i, norm_w * qk_w);  mix = softmax(s) . c
    out = bf16(rmsnorm(mix) * out_norm_w) or bf16(mix)

Design (memory-bound, every source row read from HBM once, no second pass):
- One CTA works on one row at a time, grid-stride over rows (persistent; the grid is
  min(M, sm_count * ctas_per_sm * 8192 / max_hidden)). A CTA's work is a flat stream of
  row loads ("items"): per row [prefix, delta (if has_delta), blocks i < K except
  write_idx]. Items go through an S-stage ring of shared-memory row buffers (each
  max_hidden elements) with 16-byte cp.async (LDGSTS), one commit group per item and
  S items in flight, so the next row's sources are already loading while a row
  finishes (max_hidden 8192: 4 stages + fp32 norm_w * qk_w in smem, 96 KB, 256
  threads, 120 registers -> two CTAs per H200 SM; 16384: 3 stages, weights re-read
  from L1/L2 per source, 512 threads).
- Thread t owns the 16-byte vectors v = j * T + t (j < VPT) of every row: it copies
  exactly the vectors it later reads, so the ring needs no barrier (cp.async.wait_group
  is enough; a stage is refilled only after the same thread consumed it).
  Vectors past H are never copied; their ring slots are zeroed once at start, and the
  weights there are 0, so the tail contributes nothing (stores are predicated).
- Online softmax over the sources in fp32: per source one block reduction of
  (sum c^2, dot(c, nw * qw)) -> score; running max / sum in registers (bit-identical
  in every thread, so all branches on them are uniform), the mix accumulator (fp32,
  VPT * 8 values per thread) rescaled only when the max grows. p is always the first
  source of a row (softmax is order-free), so it sets the running max directly.
- Row end: mix / l, optional output RMSNorm (one more block reduction), 16-byte stores.
- Block reductions: warp butterfly shuffles, one smem slot per warp, one barrier, then a
  butterfly over the per-warp sums; the slots are double-buffered by a reduction
  counter so consecutive reductions never need a second barrier.

Small M (row_split > 1; cutekern.attn_res picks the split per M): one CTA per row leaves
most SMs idle and streams each row through one SM, so a row is split over a group of C
CTAs. That build is the sm90 design's split_direct kernel (16-byte loads straight into
registers, nothing an sm_80 SM lacks) with its DSMEM exchange replaced by one through
global memory (AttnResSm90Config.xchg_global: Ada has no clusters): same arithmetic, same
bits as the sm90 split kernels.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from kernels._cvt import widen
from kernels.sm90.attn_res import split_build

# cp.async (LDGSTS) ring with its commit/wait groups (LDGDEPBAR / DEPBAR); no TMA/bulk copies
SASS_REQUIRED = ("LDGSTS", "LDGDEPBAR", "DEPBAR")
SASS_FORBIDDEN = ("UTMALDG", "UBLKCP", "HGMMA")
# split builds: 16-byte loads to registers and the global exchange (LDG / STG); no ring, no
# mbarrier (SYNCS), no cluster barrier (UCGABAR_*), no spills
SASS_REQUIRED_SPLIT = ("LDG", "STG")
SASS_FORBIDDEN_SPLIT = ("LDGSTS", "UTMALDG", "UBLKCP", "SYNCS", "UCGABAR_ARV",
                        "UCGABAR_WAIT", "LDL", "STL")

# Ada's per-block shared memory limit; kept on sm_90a too so one tuning runs everywhere.
SMEM_LIMIT_BYTES = 99 * 1024

_DTYPES = (cutlass.BFloat16,)
_MAX_HIDDEN = (8192, 16384)
_LOG2_E = math.log2(math.e)
_VEC = 8  # elements per 16-byte vector


@dataclass(frozen=True)
class AttnResAdaConfig:
    # 16-byte vectors of a row owned by each thread: threads = max_hidden / 8 / vecs_per_thread
    # (4 -> 256 threads for max_hidden 8192, 512 for 16384; 32 fp32 mix values per thread)
    vecs_per_thread: int = 4
    # shared memory per CTA for the ring (+ the fp32 key weights where they fit):
    # max_hidden 8192: weights 32 KB + 4 ring stages x 16 KB; 16384: 3 stages x 32 KB and the
    # weights re-read from global (L1/L2). Two such CTAs fit one H200 SM (228 KB).
    smem_budget: int = 96 * 1024
    # persistent grid cap = sm_count * ctas_per_sm * 8192 / max_hidden (132 SMs on H100/H200;
    # CTAs beyond what fits queue behind the resident ones; rows are grid-strided)
    sm_count: int = 132
    ctas_per_sm: int = 2
    # row_split > 1: compute warps per CTA at most (the sm90 split kernels' bound)
    split_consumer_warps: int = 8


def _split_build(dtype, max_hidden: int, config: AttnResAdaConfig, row_split: int):
    return split_build(dtype, max_hidden, row_split,
                       split_consumer_warps=config.split_consumer_warps,
                       num_sms=config.sm_count, xchg_global=True)


def _num_threads(max_hidden: int, config: AttnResAdaConfig) -> int:
    return max_hidden // _VEC // config.vecs_per_thread


_MIN_STAGES_WITH_W = 3


def _w_in_smem(max_hidden: int, config: AttnResAdaConfig) -> bool:
    """fp32 norm_w * qk_w in shared memory when that still leaves >= 3 ring stages."""
    return (config.smem_budget - 4 * max_hidden) // (2 * max_hidden) >= _MIN_STAGES_WITH_W


def _stages(max_hidden: int, config: AttnResAdaConfig) -> int:
    w_bytes = 4 * max_hidden if _w_in_smem(max_hidden, config) else 0
    return (config.smem_budget - w_bytes) // (2 * max_hidden)


def _smem_bytes(max_hidden: int, config: AttnResAdaConfig) -> int:
    nw = _num_threads(max_hidden, config) // 32
    w_bytes = 4 * max_hidden if _w_in_smem(max_hidden, config) else 0
    return _stages(max_hidden, config) * max_hidden * 2 + w_bytes + 256 + 2 * 2 * nw * 4


class AttnResAda:
    def __init__(self, dtype, max_hidden: int, config: AttnResAdaConfig = AttnResAdaConfig(), row_split: int = 1):
        if not AttnResAda.can_implement(dtype, max_hidden, config, row_split):
            raise ValueError(f"AttnResAda cannot implement {dtype}, {max_hidden}, {config}, "
                             f"row_split={row_split}")
        self.row_split = row_split
        # row_split > 1: the sm90 split kernel with the global exchange (module docstring)
        self._split = _split_build(dtype, max_hidden, config, row_split)
        if self._split is not None:
            self.sass_required, self.sass_forbidden = SASS_REQUIRED_SPLIT, SASS_FORBIDDEN_SPLIT
        self.dtype = dtype
        self.max_hidden = max_hidden
        self.config = config
        self.vpt = config.vecs_per_thread
        self.num_threads = _num_threads(max_hidden, config)
        self.num_warps = self.num_threads // 32
        self.stages = _stages(max_hidden, config)
        self.grid_cap = max(1, config.sm_count * config.ctas_per_sm * 8192 // max_hidden)
        self.w_in_smem = _w_in_smem(max_hidden, config)

    @staticmethod
    def can_implement(dtype, max_hidden, config: AttnResAdaConfig, row_split: int = 1) -> bool:
        if dtype not in _DTYPES or max_hidden not in _MAX_HIDDEN:
            return False
        if row_split != 1:  # the direct split kernels only (module docstring)
            return _split_build(dtype, max_hidden, config, row_split) is not None
        vpt = config.vecs_per_thread
        if vpt < 1 or (max_hidden // _VEC) % vpt:
            return False
        nthr = _num_threads(max_hidden, config)
        if nthr % 32 or nthr < 32 or nthr > 1024:
            return False
        nw = nthr // 32
        if nw & (nw - 1):                  # the cross-warp butterfly needs a power of two
            return False
        if _stages(max_hidden, config) < 2:
            return False
        if config.sm_count < 1 or config.ctas_per_sm < 1:
            return False
        return _smem_bytes(max_hidden, config) <= SMEM_LIMIT_BYTES

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, prefix: cute.Tensor, delta: cute.Tensor, blocks: cute.Tensor,
                 norm_w: cute.Tensor, qk_w: cute.Tensor, out_norm_w: cute.Tensor,
                 out: cute.Tensor, num_blocks: cutlass.Int32, write_idx: cutlass.Int32,
                 has_delta: cutlass.Int32, has_out_norm: cutlass.Int32,
                 eps: cutlass.Float32, out_eps: cutlass.Float32, work: cute.Tensor,
                 stream: cuda.CUstream):
        if cutlass.const_expr(self._split is not None):
            # work: the split kernel's exchange records
            self._split(prefix, delta, blocks, norm_w, qk_w, out_norm_w, out, num_blocks,
                        write_idx, has_delta, has_out_norm, eps, out_eps, work, stream)
        else:
            # work: the sm90 kernel's row-scheduler counters (shared ABI); unused here
            self._launch_ring(prefix, delta, blocks, norm_w, qk_w, out_norm_w, out,
                              num_blocks, write_idx, has_delta, has_out_norm, eps, out_eps,
                              stream)

    @cute.jit
    def _launch_ring(self, prefix: cute.Tensor, delta: cute.Tensor, blocks: cute.Tensor,
                     norm_w: cute.Tensor, qk_w: cute.Tensor, out_norm_w: cute.Tensor,
                     out: cute.Tensor, num_blocks: cutlass.Int32, write_idx: cutlass.Int32,
                     has_delta: cutlass.Int32, has_out_norm: cutlass.Int32,
                     eps: cutlass.Float32, out_eps: cutlass.Float32, stream: cuda.CUstream):
        dt = self.dtype
        T, VPT, S = self.num_threads, self.vpt, self.stages
        MH = self.max_hidden

        # ring: stage s holds one row; thread t's vector j at elements (j*T + t)*8 .. +8
        ring_layout = cute.make_layout((T * _VEC, VPT, S), stride=(1, T * _VEC, MH))

        # fp32 weights, thread-private like the ring: element e of thread t's vector j at
        # plane e // 4, float (j*T + t)*4 + e % 4 (each warp-wide 16-byte access is contiguous)
        w_layout = cute.make_layout(((4, 2), T, VPT), stride=((1, MH // 2), 4, 4 * T))
        w_elems = MH if self.w_in_smem else 4

        @cute.struct
        class SharedStorage:
            ring: cute.struct.Align[cute.struct.MemRange[dt, S * MH], 128]
            w: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, w_elems], 128]
            red: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 4 * self.num_warps], 16]

        thr_layout = cute.make_layout((T,))
        val_layout = cute.make_layout((_VEC,))
        copy_g2s = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                dt, num_bits_per_copy=128),
            thr_layout, val_layout)
        copy_r = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt, num_bits_per_copy=128),
            thr_layout, val_layout)

        M = prefix.shape[0]
        grid_n = cutlass.min(M, cutlass.Int32(self.grid_cap))
        self.kernel(prefix, delta, blocks, norm_w, qk_w, out_norm_w, out,
                    num_blocks, write_idx, has_delta, has_out_norm, eps, out_eps, grid_n,
                    ring_layout, w_layout, copy_g2s, copy_r, SharedStorage).launch(
            grid=[grid_n, 1, 1], block=[T, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, prefix: cute.Tensor, delta: cute.Tensor, blocks: cute.Tensor,
               norm_w: cute.Tensor, qk_w: cute.Tensor, out_norm_w: cute.Tensor,
               out: cute.Tensor, num_blocks: cutlass.Int32, write_idx: cutlass.Int32,
               has_delta: cutlass.Int32, has_out_norm: cutlass.Int32,
               eps: cutlass.Float32, out_eps: cutlass.Float32, grid_n: cutlass.Int32,
               ring_layout: cute.Layout, w_layout: cute.Layout, copy_g2s: cute.TiledCopy,
               copy_r: cute.TiledCopy, SharedStorage: cutlass.Constexpr):
        dt = self.dtype
        T, VPT, S, NW = self.num_threads, self.vpt, self.stages, self.num_warps
        TV = T * _VEC
        f32 = cutlass.Float32
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32

        M = prefix.shape[0]
        H = prefix.shape[1]
        inv_h = f32(1.0) / f32(H)
        K = num_blocks
        w_idx = write_idx
        hd = cutlass.Int32(0)
        if has_delta != 0:
            hd = cutlass.Int32(1)
        sk = cutlass.Int32(0)            # 1: write_idx is one of the K block sources
        if w_idx >= 0:
            if w_idx < K:
                sk = cutlass.Int32(1)
        n_items = 1 + hd + K - sk        # row loads per row
        mult = f32(1.0) + f32(sk)        # weight multiplicity of p
        n_rows = (M - bid + grid_n - 1) // grid_n
        total = n_rows * n_items

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sR = storage.ring.get_tensor(ring_layout)                                  # (T*8, VPT, S)
        sRed = storage.red.get_tensor(cute.make_layout((2, NW, 2), stride=(1, 2, 2 * NW)))
        sW = None
        if cutlass.const_expr(self.w_in_smem):
            sW = storage.w.get_tensor(w_layout)[None, tidx, None]                 # ((4,2), VPT)

        thr_g2s = copy_g2s.get_slice(tidx)
        thr_r = copy_r.get_slice(tidx)
        tsR = thr_g2s.partition_D(sR)                                              # (CPY, 1, VPT, S)
        proto = tsR[None, 0, 0, 0]

        # ---- ring tails: slots past H are never copied; zero them once
        for s in cutlass.range_constexpr(S):
            for j in cutlass.range_constexpr(VPT):
                if (tidx + j * T) * _VEC >= H:
                    tsR[None, 0, j, s].fill(0)

        # ---- registers: mix accumulator, current source (fp32), scratch vectors
        mix = [cute.make_rmem_tensor_like(proto, f32) for _ in range(VPT)]
        xf = [cute.make_rmem_tensor_like(proto, f32) for _ in range(VPT)]
        ta = cute.make_rmem_tensor_like(proto, dt)
        tb = cute.make_rmem_tensor_like(proto, dt)
        tNW = thr_r.partition_S(cute.local_tile(norm_w, (TV,), (None,)))          # (CPY, 1, n)
        tQW = thr_r.partition_S(cute.local_tile(qk_w, (TV,), (None,)))
        tON = thr_r.partition_S(cute.local_tile(out_norm_w, (TV,), (None,)))
        # w = norm_w * qk_w (fp32, 0 past H) in shared memory where it fits, else re-read
        # per source (L1/L2 hits)
        if cutlass.const_expr(self.w_in_smem):
            for j in cutlass.range_constexpr(VPT):
                ta.fill(0)
                tb.fill(0)
                if (tidx + j * T) * _VEC < H:
                    cute.copy(copy_r, tNW[None, 0, j], ta)
                    cute.copy(copy_r, tQW[None, 0, j], tb)
                sW[None, j].store((ta.load().to(f32) * tb.load().to(f32)).reshape((4, 2)))
        for j in cutlass.range_constexpr(VPT):
            mix[j].fill(0.0)

        # softmax state (identical in every thread): [0] running max, [1] running sum
        st = cute.make_rmem_tensor((2,), f32)
        st[0] = f32(0.0)
        st[1] = f32(0.0)
        # counters: [0] block reductions so far (parity picks the smem slots),
        # [1], [2] item-in-row and row of the next item to issue; [3], [4] of the next to consume
        ctr = cute.make_rmem_tensor((5,), cutlass.Int32)
        ctr[0] = cutlass.Int32(0)
        ctr[1] = cutlass.Int32(0)
        ctr[2] = bid
        ctr[3] = cutlass.Int32(0)
        ctr[4] = bid

        # ---- prologue: items 0 .. S-2, one commit group each (empty past the end)
        for s in cutlass.range_constexpr(S - 1):
            self.issue(copy_g2s, thr_g2s, tsR, prefix, delta, blocks, cutlass.Int32(s), total,
                       ctr, n_items, hd, sk, w_idx, grid_n, H, tidx)
            cute.arch.cp_async_commit_group()

        for q in cutlass.range(total, unroll=1):
            # refill the stage item q-1 used (this thread read it last iteration)
            self.issue(copy_g2s, thr_g2s, tsR, prefix, delta, blocks, q + (S - 1), total,
                       ctr, n_items, hd, sk, w_idx, grid_n, H, tidx)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(S - 1)          # item q has landed
            stage = q % S
            k = ctr[3]
            m = ctr[4]
            if k < hd:
                # prefix of a has_delta row: park it (fp32) in the mix registers until delta
                for j in cutlass.range_constexpr(VPT):
                    mix[j].store(widen(tsR[None, 0, j, stage].load()))
            else:
                if k == hd:
                    # ---- p: the first source of the row
                    if hd != 0:
                        tP = thr_r.partition_D(cute.local_tile(prefix[m, None], (TV,), (None,)))
                        for j in cutlass.range_constexpr(VPT):
                            pf = mix[j].load() + widen(tsR[None, 0, j, stage].load())
                            ta.store(pf.to(dt))             # round to nearest even
                            xf[j].store(widen(ta.load()))
                            if (tidx + j * T) * _VEC < H:
                                cute.copy(copy_r, ta, tP[None, 0, j])
                    else:
                        for j in cutlass.range_constexpr(VPT):
                            xf[j].store(widen(tsR[None, 0, j, stage].load()))
                    if w_idx >= 0:
                        tB = thr_r.partition_D(cute.local_tile(blocks[m, w_idx, None], (TV,), (None,)))
                        for j in cutlass.range_constexpr(VPT):
                            if (tidx + j * T) * _VEC < H:
                                tb.store(xf[j].load().to(dt))    # exact: xf holds bf16 values
                                cute.copy(copy_r, tb, tB[None, 0, j])
                    s_p = self.score(xf, sW, copy_r, tNW, tQW, ta, tb, H, tidx,
                                     sRed, ctr, warp, lane, inv_h, eps)
                    st[0] = s_p
                    st[1] = mult
                    for j in cutlass.range_constexpr(VPT):
                        mix[j].store(xf[j].load() * mult)
                else:
                    # ---- a block source: online softmax; rescale only when the max grows
                    for j in cutlass.range_constexpr(VPT):
                        xf[j].store(widen(tsR[None, 0, j, stage].load()))
                    s_i = self.score(xf, sW, copy_r, tNW, tQW, ta, tb, H, tidx,
                                     sRed, ctr, warp, lane, inv_h, eps)
                    if s_i > st[0]:
                        alpha = cute.math.exp2((st[0] - s_i) * _LOG2_E, fastmath=True)
                        st[0] = s_i
                        st[1] = st[1] * alpha
                        for j in cutlass.range_constexpr(VPT):
                            mix[j].store(mix[j].load() * alpha)
                    beta = cute.math.exp2((s_i - st[0]) * _LOG2_E, fastmath=True)
                    st[1] = st[1] + beta
                    for j in cutlass.range_constexpr(VPT):
                        mix[j].store(mix[j].load() + xf[j].load() * beta)
                if k == n_items - 1:
                    # ---- row end: normalize, optional output RMSNorm, store
                    inv_l = f32(1.0) / st[1]
                    tO = thr_r.partition_D(cute.local_tile(out[m, None], (TV,), (None,)))
                    if has_out_norm != 0:
                        acc = mix[0].load() * inv_l
                        acc = acc * acc
                        for j in cutlass.range_constexpr(1, VPT):
                            y = mix[j].load() * inv_l
                            acc = acc + y * y
                        ss, _ = self.block_sum2(acc.reduce(cute.ReductionOp.ADD, f32(0.0), 0),
                                                f32(0.0), sRed, ctr, warp, lane)
                        rn = cute.math.rsqrt(ss * inv_h + out_eps, fastmath=True) * inv_l
                        for j in cutlass.range_constexpr(VPT):
                            if (tidx + j * T) * _VEC < H:
                                cute.copy(copy_r, tON[None, 0, j], ta)
                                tb.store((mix[j].load() * rn * widen(ta.load())).to(dt))
                                cute.copy(copy_r, tb, tO[None, 0, j])
                    else:
                        for j in cutlass.range_constexpr(VPT):
                            if (tidx + j * T) * _VEC < H:
                                tb.store((mix[j].load() * inv_l).to(dt))
                                cute.copy(copy_r, tb, tO[None, 0, j])
            # advance the consume cursor
            ctr[3] = ctr[3] + 1
            if ctr[3] == n_items:
                ctr[3] = cutlass.Int32(0)
                ctr[4] = ctr[4] + grid_n
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def issue(self, copy_g2s: cute.TiledCopy, thr_g2s, tsR: cute.Tensor, prefix: cute.Tensor,
              delta: cute.Tensor, blocks: cute.Tensor, qi: cutlass.Int32, total: cutlass.Int32,
              ctr: cute.Tensor, n_items: cutlass.Int32, hd: cutlass.Int32, sk: cutlass.Int32,
              w_idx: cutlass.Int32, grid_n: cutlass.Int32, H: cutlass.Int32,
              tidx: cutlass.Int32):
        """cp.async item qi (a whole source row) into ring stage qi % S; no-op past the end.
        ctr[1], ctr[2] = (item in row, row) of item qi; advanced here."""
        if qi < total:
            stage = qi % self.stages
            k = ctr[1]
            m = ctr[2]
            if k == 0:
                self.load_row(copy_g2s, thr_g2s, tsR, prefix[m, None], stage, H, tidx)
            else:
                if k < 1 + hd:
                    self.load_row(copy_g2s, thr_g2s, tsR, delta[m, None], stage, H, tidx)
                else:
                    jb = k - 1 - hd                  # index among the block sources
                    i = jb
                    if sk != 0:
                        if jb >= w_idx:
                            i = jb + 1               # skip slot write_idx (it is p)
                    self.load_row(copy_g2s, thr_g2s, tsR, blocks[m, i, None], stage, H, tidx)
            ctr[1] = k + 1
            if k + 1 == n_items:
                ctr[1] = cutlass.Int32(0)
                ctr[2] = m + grid_n

    @cute.jit
    def load_row(self, copy_g2s: cute.TiledCopy, thr_g2s, tsR: cute.Tensor, g_row: cute.Tensor,
                 stage: cutlass.Int32, H: cutlass.Int32, tidx: cutlass.Int32):
        T = self.num_threads
        tg = thr_g2s.partition_S(cute.local_tile(g_row, (T * _VEC,), (None,)))   # (CPY, 1, n)
        for j in cutlass.range_constexpr(self.vpt):
            if (tidx + j * T) * _VEC < H:
                cute.copy(copy_g2s, tg[None, 0, j], tsR[None, 0, j, stage])

    @cute.jit
    def score(self, xf, sW, copy_r: cute.TiledCopy, tNW: cute.Tensor, tQW: cute.Tensor,
              ta: cute.Tensor, tb: cute.Tensor, H: cutlass.Int32, tidx: cutlass.Int32,
              sRed: cute.Tensor, ctr: cute.Tensor, warp: cutlass.Int32, lane: cutlass.Int32,
              inv_h: cutlass.Float32, eps: cutlass.Float32) -> cutlass.Float32:
        """rsqrt(mean(c^2) + eps) * dot(c, norm_w * qk_w) over the whole row (block reduce).
        Vectors past H: c is 0 (zeroed ring slots) and w is 0."""
        f32 = cutlass.Float32
        T = self.num_threads
        acc_ss = None
        acc_d = None
        for j in cutlass.range_constexpr(self.vpt):
            x = xf[j].load()
            if cutlass.const_expr(self.w_in_smem):
                wj = sW[None, j].load().reshape(x.shape)
            else:
                ta.fill(0)
                tb.fill(0)
                if (tidx + j * T) * _VEC < H:
                    cute.copy(copy_r, tNW[None, 0, j], ta)
                    cute.copy(copy_r, tQW[None, 0, j], tb)
                wj = widen(ta.load()) * widen(tb.load())
            if cutlass.const_expr(j == 0):
                acc_ss = x * x
                acc_d = x * wj
            else:
                acc_ss = acc_ss + x * x
                acc_d = acc_d + x * wj
        ss, dot = self.block_sum2(acc_ss.reduce(cute.ReductionOp.ADD, f32(0.0), 0),
                                  acc_d.reduce(cute.ReductionOp.ADD, f32(0.0), 0),
                                  sRed, ctr, warp, lane)
        return dot * cute.math.rsqrt(ss * inv_h + eps, fastmath=True)

    @cute.jit
    def block_sum2(self, a: cutlass.Float32, b: cutlass.Float32, sRed: cute.Tensor,
                   ctr: cute.Tensor, warp: cutlass.Int32, lane: cutlass.Int32):
        """CTA-wide sums of (a, b); every thread gets the same bits. One barrier: the
        smem slots alternate between two buffers (parity of ctr[0]), and a buffer is
        rewritten only after the next reduction's barrier, which every thread reaches
        after its reads of this one."""
        NW = self.num_warps
        par = ctr[0] % 2
        ctr[0] = ctr[0] + 1
        for i in cutlass.range_constexpr(5):
            off = 16 >> i
            a = a + cute.arch.shuffle_sync_bfly(a, offset=off)
            b = b + cute.arch.shuffle_sync_bfly(b, offset=off)
        if lane == 0:
            sRed[0, warp, par] = a
            sRed[1, warp, par] = b
        cute.arch.sync_threads()
        # lane l reads warp (l % NW)'s pair; a butterfly over NW lanes sums them in the
        # same order in every lane of every warp
        sa = sRed[0, lane % NW, par]
        sb = sRed[1, lane % NW, par]
        off = NW // 2
        while off > 0:
            sa = sa + cute.arch.shuffle_sync_bfly(sa, offset=off)
            sb = sb + cute.arch.shuffle_sync_bfly(sb, offset=off)
            off //= 2
        return sa, sb
