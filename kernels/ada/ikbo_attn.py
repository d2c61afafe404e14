"""Ada design of IKBO candidate-over-user attention (sm_80 / sm_89; also built for sm_90a).

FA2-style, non-causal. CTA (chunk j, head h) owns query rows [r0, r1) of user
u = work[j, 0] and streams k[u, :kv_len[u], h], v[u, :kv_len[u], h] once for all of them.

- Q tile (block_m x D) cp.async'd once; rows >= r1 are zero-filled (never stored).
- K/V tiles (block_n x D) double-buffered with 16-byte cp.async (LDGSTS); key rows
  >= kv_len are zero-filled in smem (a NaN in an unused V row would poison P @ V)
  and their scores are set to -inf.
- S = Q K^T and O += P V with mma.sync m16n8k16 (HMMA), operands through ldmatrix
  (LDSM; the transposed form for V). One warp owns 16 query rows and the whole
  block_n, so every softmax reduction is a quad shuffle.
- Online softmax in fp32 registers; P is converted to the input dtype and reused in
  registers as the A operand of the second MMA.
- Epilogue: O / l through smem (the Q buffer) to row-predicated 16-byte stores;
  lse = scale * m + ln(l), -inf when kv_len == 0 (out rows are then 0).

cp.async in the DSL has no zero-fill form (a false predicate skips the copy), so every
out-of-bounds smem vector gets a plain zero store instead; the barrier at the top of
the next iteration publishes both kinds of write.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

from kernels.ada._tiles import ldsm, mn_view, row_atom, row_copy

SASS_REQUIRED = ("LDGSTS", "LDSM", "HMMA")
SASS_FORBIDDEN = ("HGMMA",)

# Ada's per-block shared memory limit; kept on sm_90a too so one tuning runs everywhere.
SMEM_LIMIT_BYTES = 99 * 1024

_DTYPES = (cutlass.Float16, cutlass.BFloat16)
_HEAD_DIMS = (64, 128)
_LOG2_E = math.log2(math.e)


@dataclass(frozen=True)
class IkboAttnAdaConfig:
    block_m: int = 128   # query rows per chunk; one warp per 16 rows (128 -> 8 warps)
    block_n: int = 64    # keys per K/V tile

    @property
    def num_warps(self) -> int:
        return self.block_m // 16

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps


def _smem_bytes(head_dim: int, config: IkboAttnAdaConfig, elem_bytes: int = 2) -> int:
    # Q tile + 2 stages each of K and V (all regions are multiples of 1 KB, so the
    # 1024-byte alignment of each region adds nothing)
    return (config.block_m + 4 * config.block_n) * head_dim * elem_bytes


class IkboAttnAda:
    def __init__(self, dtype, head_dim: int, config: IkboAttnAdaConfig = IkboAttnAdaConfig()):
        if not IkboAttnAda.can_implement(dtype, head_dim, config):
            raise ValueError(f"IkboAttnAda cannot implement {dtype}, {head_dim}, {config}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.config = config
        self.bM = config.block_m
        self.bN = config.block_n
        self.num_threads = config.num_threads
        self.smem_bytes = _smem_bytes(head_dim, config)

    @staticmethod
    def can_implement(dtype, head_dim, config: IkboAttnAdaConfig) -> bool:
        if dtype not in _DTYPES or head_dim not in _HEAD_DIMS:
            return False
        bM, bN = config.block_m, config.block_n
        if bM <= 0 or bM % 16 or bN <= 0 or bN % 16:
            return False
        nthr = config.num_threads
        if nthr > 1024:
            return False
        # gmem<->smem copies: 8 threads per 64-column row segment, nthr/8 rows per pass;
        # every tile must be whole passes
        rows_per_pass = nthr // 8
        if bM % rows_per_pass or bN % rows_per_pass:
            return False
        return _smem_bytes(head_dim, config) <= SMEM_LIMIT_BYTES

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, kv_len: cute.Tensor,
                 work: cute.Tensor, scale: cute.Tensor, out: cute.Tensor, lse: cute.Tensor,
                 num_ctas: cutlass.Int32, stream: cuda.CUstream):
        # num_ctas (persistent grid size of the sm90 design) is unused: grid (W, H)
        D, bM, bN = self.head_dim, self.bM, self.bN
        dt = self.dtype

        # smem rows of D elements in 64-element (128 B) swizzled segments
        atom = row_atom()
        sQ_layout = cute.tile_to_shape(atom, (bM, D), (0, 1))
        sKV_layout = cute.tile_to_shape(atom, (bN, D, 2), (0, 1, 2))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKV_layout)], 1024]

        copy_g2s = row_copy("g2s", dt, self.num_threads)
        copy_s2g = row_copy("universal", dt, self.num_threads)

        # warps stacked along M (16 rows each); N permuted to 16 so one ldmatrix.x4 feeds
        # two n8 atoms and two adjacent n8 accumulators form one k16 A fragment of P
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(dt, cutlass.Float32, (16, 8, 16)),
            (self.config.num_warps, 1, 1),
            permutation_mnk=(self.config.num_warps * 16, 16, 16))

        W = work.shape[0]
        H = q.shape[1]
        self.kernel(q, k, v, kv_len, work, scale, out, lse,
                    sQ_layout, sKV_layout, copy_g2s, copy_s2g, tiled_mma, SharedStorage).launch(
            grid=[W, H, 1], block=[self.num_threads, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, kv_len: cute.Tensor,
               work: cute.Tensor, scale: cute.Tensor, out: cute.Tensor, lse: cute.Tensor,
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               copy_g2s: cute.TiledCopy, copy_s2g: cute.TiledCopy, tiled_mma: cute.TiledMma,
               SharedStorage: cutlass.Constexpr):
        D, bM, bN = self.head_dim, self.bM, self.bN
        dt = self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        j, h, _ = cute.arch.block_idx()

        u = work[j, 0]
        if u >= 0:
            r0 = work[j, 1]
            r1 = work[j, 2]
            n_kv = kv_len[u]
            n_tiles = (n_kv + (bN - 1)) // bN
            sl2 = scale[0] * _LOG2_E          # exp(s * x) == exp2(s * log2(e) * x)

            # ---- gmem views: rows r0.. of head h; K/V tiles of user u, head h
            gQ = cute.local_tile(cute.domain_offset((r0, 0), q[None, h, None]), (bM, D), (0, 0))
            gO = cute.local_tile(cute.domain_offset((r0, 0), out[None, h, None]), (bM, D), (0, 0))
            gK = cute.local_tile(k[u, None, h, None], (bN, D), (None, 0))   # (bN, D, tiles)
            gV = cute.local_tile(v[u, None, h, None], (bN, D), (None, 0))
            # in-tile coordinates (row, col) for predication
            cQ = cute.make_identity_tensor((bM, D))
            cKV = cute.make_identity_tensor((bN, D))

            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout)
            sK = storage.sK.get_tensor(sKV_layout)       # (bN, D, 2)
            sV = storage.sV.get_tensor(sKV_layout)
            # V^T view (D, bN, 2) for the B operand of O += P V
            sVt = cute.composition(
                sV, cute.make_layout((D, bN, 2), stride=(bN, 1, bN * D)))

            thr_g2s = copy_g2s.get_slice(tidx)
            tQgQ = thr_g2s.partition_S(gQ)       # (CPY, CPY_M, CPY_D)
            tQsQ = thr_g2s.partition_D(sQ)
            tQcQ = thr_g2s.partition_S(cQ)
            tKgK = thr_g2s.partition_S(gK)       # (CPY, CPY_N, CPY_D, tiles)
            tKsK = thr_g2s.partition_D(sK)       # (CPY, CPY_N, CPY_D, 2)
            tVgV = thr_g2s.partition_S(gV)
            tVsV = thr_g2s.partition_D(sV)
            tKVc = thr_g2s.partition_S(cKV)      # (CPY, CPY_N, CPY_D)

            # ---- prologue: Q and K/V tile 0 in one commit group
            nrows = r1 - r0
            for i in cutlass.range_constexpr(cute.size(tQsQ, mode=[1])):
                for d in cutlass.range_constexpr(cute.size(tQsQ, mode=[2])):
                    if tQcQ[0, i, d][0] < nrows:
                        cute.copy(copy_g2s, tQgQ[None, i, d], tQsQ[None, i, d])
                    else:
                        tQsQ[None, i, d].fill(0)
            if n_tiles > 0:
                self.load_kv(copy_g2s, tKgK, tKsK, tVgV, tVsV, tKVc, n_kv, 0, 0)
            cute.arch.cp_async_commit_group()

            # ---- MMA fragments and ldmatrix views
            thr_mma = tiled_mma.get_slice(tidx)
            tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
            tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt[None, None, 0]))
            acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((bM, D)), cutlass.Float32)
            acc_O.fill(0.0)

            s2r_Q = cute.make_tiled_copy_A(ldsm(dt, False), tiled_mma)
            s2r_K = cute.make_tiled_copy_B(ldsm(dt, False), tiled_mma)
            # V is key-major in smem; the transposed ldmatrix yields the key pairs the MMA wants
            s2r_V = cute.make_tiled_copy_B(ldsm(dt, True), tiled_mma)
            thr_s2r_Q = s2r_Q.get_slice(tidx)
            thr_s2r_K = s2r_K.get_slice(tidx)
            thr_s2r_V = s2r_V.get_slice(tidx)
            tSsQ = thr_s2r_Q.partition_S(sQ)          # (CPY, MMA_M, MMA_K)
            tSrQ_v = thr_s2r_Q.retile(tSrQ)
            tSsK = thr_s2r_K.partition_S(sK)          # (CPY, MMA_N, MMA_K, 2)
            tSrK_v = thr_s2r_K.retile(tSrK)
            tOsVt = thr_s2r_V.partition_S(sVt)        # (CPY, MMA_D, MMA_KEYS, 2)
            tOrVt_v = thr_s2r_V.retile(tOrVt)

            # in-tile (row, col) of each score accumulator, as a (row, col) view
            tScS = thr_mma.partition_C(cute.make_identity_tensor((bM, bN)))
            tScS_mn = mn_view(tScS)
            acc_O_mn = mn_view(acc_O)

            n_rows_thr = cute.size(acc_O_mn, mode=[0])
            row_max = cute.make_rmem_tensor((n_rows_thr,), cutlass.Float32)
            row_sum = cute.make_rmem_tensor((n_rows_thr,), cutlass.Float32)   # thread partial
            row_max.fill(-cutlass.Float32.inf)
            row_sum.fill(0.0)

            num_kb_qk = cute.size(tSsQ, mode=[2])
            for t in range(n_tiles):
                stage = t % 2
                # tile t (and Q) landed; every warp is done with stage (t+1)%2 (tile t-1)
                cute.arch.cp_async_wait_group(0)
                cute.arch.sync_threads()
                if t + 1 < n_tiles:
                    self.load_kv(copy_g2s, tKgK, tKsK, tVgV, tVsV, tKVc, n_kv, t + 1, 1 - stage)
                cute.arch.cp_async_commit_group()

                # ---- S = Q K^T
                acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((bM, bN)), cutlass.Float32)
                acc_S.fill(0.0)
                for kb in cutlass.range_constexpr(num_kb_qk):
                    cute.copy(s2r_Q, tSsQ[None, None, kb], tSrQ_v[None, None, kb])
                    cute.copy(s2r_K, tSsK[None, None, kb, stage], tSrK_v[None, None, kb])
                    cute.gemm(tiled_mma, acc_S, tSrQ[None, None, kb], tSrK[None, None, kb], acc_S)

                # ---- mask keys >= kv_len, online softmax
                acc_S_mn = mn_view(acc_S)
                key0 = t * bN
                for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                    if key0 + tScS_mn[0, c][1] >= n_kv:
                        for r in cutlass.range_constexpr(n_rows_thr):
                            acc_S_mn[r, c] = -cutlass.Float32.inf
                for r in cutlass.range_constexpr(n_rows_thr):
                    s_row = acc_S_mn[r, None].load()
                    m_cur = s_row.reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0)
                    m_cur = self._quad_max(m_cur)
                    m_prev = row_max[r]
                    # every tile has >= 1 valid key, so m_new is finite
                    m_new = cute.arch.fmax(m_prev, m_cur)
                    m_scaled = m_new * sl2
                    p_row = cute.math.exp2(s_row * sl2 - m_scaled, fastmath=True)
                    corr = cute.math.exp2(m_prev * sl2 - m_scaled, fastmath=True)  # 0 on tile 0
                    row_sum[r] = row_sum[r] * corr + p_row.reduce(cute.ReductionOp.ADD, cutlass.Float32.zero, 0)
                    row_max[r] = m_new
                    acc_O_mn[r, None] = acc_O_mn[r, None].load() * corr
                    acc_S_mn[r, None] = p_row

                # ---- O += P V, P in registers: two n8 accumulators = one k16 A fragment
                rP = cute.make_rmem_tensor_like(acc_S, dt)
                rP.store(acc_S.load().to(dt))
                rP_div = cute.logical_divide(rP.layout, (None, None, 2))
                tOrP = cute.make_tensor(rP.iterator, cute.make_layout(
                    ((rP_div.shape[0], rP_div.shape[2][0]), rP_div.shape[1], rP_div.shape[2][1]),
                    stride=((rP_div.stride[0], rP_div.stride[2][0]), rP_div.stride[1],
                            rP_div.stride[2][1])))
                for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                    cute.copy(s2r_V, tOsVt[None, None, kb, stage], tOrVt_v[None, None, kb])
                    cute.gemm(tiled_mma, acc_O, tOrP[None, None, kb], tOrVt[None, None, kb], acc_O)

            # ---- epilogue. All copies landed (Q too when n_tiles == 0) and every warp is
            # out of sQ before it is reused for O.
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()

            lane = tidx % 32
            sc = scale[0]
            for r in cutlass.range_constexpr(n_rows_thr):
                l_tot = self._quad_sum(row_sum[r])
                inv = cutlass.Float32(0.0)
                lse_r = cutlass.Float32(-math.inf)
                if l_tot > 0.0:
                    inv = 1.0 / l_tot
                    lse_r = row_max[r] * sc + cute.math.log(l_tot)
                acc_O_mn[r, None] = acc_O_mn[r, None].load() * inv
                row = tScS_mn[r, 0][0]
                if lane % 4 == 0:
                    if row < nrows:
                        lse[r0 + row, h] = lse_r

            rO = cute.make_rmem_tensor_like(acc_O, dt)
            rO.store(acc_O.load().to(dt))
            r2s_O = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt),
                                           tiled_mma)
            thr_r2s_O = r2s_O.get_slice(tidx)
            cute.copy(r2s_O, thr_r2s_O.retile(rO), thr_r2s_O.partition_D(sQ))
            cute.arch.sync_threads()

            thr_s2g = copy_s2g.get_slice(tidx)
            tOsO = thr_s2g.partition_S(sQ)       # (CPY, CPY_M, CPY_D)
            tOgO = thr_s2g.partition_D(gO)
            tOcO = thr_s2g.partition_S(cQ)
            for i in cutlass.range_constexpr(cute.size(tOsO, mode=[1])):
                if tOcO[0, i, 0][0] < nrows:
                    for d in cutlass.range_constexpr(cute.size(tOsO, mode=[2])):
                        tmp = cute.make_rmem_tensor_like(tOsO[None, i, d], dt)
                        cute.autovec_copy(tOsO[None, i, d], tmp)
                        cute.copy(copy_s2g, tmp, tOgO[None, i, d])

    @cute.jit
    def load_kv(self, copy_g2s: cute.TiledCopy, tKgK: cute.Tensor, tKsK: cute.Tensor,
                tVgV: cute.Tensor, tVsV: cute.Tensor, tKVc: cute.Tensor, n_kv: cutlass.Int32,
                tile: cutlass.Int32, stage: cutlass.Int32):
        """Issue K/V tile `tile` into `stage`: cp.async for keys < kv_len, zeros otherwise."""
        key0 = tile * self.bN
        for i in cutlass.range_constexpr(cute.size(tKsK, mode=[1])):
            if key0 + tKVc[0, i, 0][0] < n_kv:
                for d in cutlass.range_constexpr(cute.size(tKsK, mode=[2])):
                    cute.copy(copy_g2s, tKgK[None, i, d, tile], tKsK[None, i, d, stage])
                    cute.copy(copy_g2s, tVgV[None, i, d, tile], tVsV[None, i, d, stage])
            else:
                for d in cutlass.range_constexpr(cute.size(tKsK, mode=[2])):
                    tKsK[None, i, d, stage].fill(0)
                    tVsV[None, i, d, stage].fill(0)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _quad_max(x):
        # the 4 lanes of a quad hold the same accumulator rows
        x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
        return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))

    @staticmethod
    def _quad_sum(x):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
        return x + cute.arch.shuffle_sync_bfly(x, offset=1)
