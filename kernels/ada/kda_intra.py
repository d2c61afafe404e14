"""Ada design of the KDA intra-chunk stage (sm_80 / sm_89; also built for sm_90a, where it
runs on the H200): everything of chunked prefill that is parallel over chunks.

One CTA of 4 warps per (chunk, head). From q, k, v, the gate g and beta it writes the chain
kernel's inputs (abi.kda_chain_abi; kernels/CONTRACT_KDA.md):

    G = cumsum(g) (the gate applied first when asked), Gamma = G[63]
    Aqk[r, s] = rq_r rk_s sum_d q_rd k_sd exp(G_rd - G_sd)   s <= r
    Akk[r, s] = beta_r rk_r rk_s sum_d k_rd k_sd exp(G_rd - G_sd)   s < r;  A = (I + Akk)^-1
    w = A (beta k exp G),  u = A (beta v),  kg = k exp(Gamma - G),  qg = q exp(G)

(rq, rk: the l2norm row factors, rq with the softmax-free scale; rows past the sequence's
end have q = k = v = beta = g = 0.) Every decay factor a tile sees is bounded:
- off-diagonal 16 x 16 blocks (rows in sub-chunk i, columns in sub-chunk j < i) are one
  mma.sync product per column block j of 16-bit operands split at the first token after
  sub-chunk j, b = 16 (j + 1): (k_r exp(G_r - G_b)) (k_s exp(G_b - G_s))^T, both <= 1;
- diagonal blocks (s <= r in one sub-chunk) are one mma.sync product per warp, split at the
  sub-chunk's first token f: (k_r exp(G_r - G_f)) <= 1 times (k_s exp(G_f - G_s)) <= 2^spread,
  each operand a bf16 hi + lo pair (fp16 inputs too: bf16's range), when every sub-chunk's
  spread in the K slab is at most `diag_spread`; otherwise summed in fp32 with the exact
  exponent (one exp per (r, s, d));
- A by blocked forward substitution in fp32 (16 x 16 diagonal inverses, then block rows);
- w and u as mma.sync products of A's 16-bit copy (fp32 accumulation).
G of all K columns is computed once, on all threads (g's rows as 16-byte vectors, then a
column scan with the gate applied on the way), and kept in shared memory in the log2 domain
(exp(x) = exp2(x log2 e)). q and k are processed in slabs of 64 columns (the score sums add
up over slabs) in a loop that is not unrolled: one copy of its code, so the instruction
cache stays warm (the straight-line build spent a third of its time on instruction fetch).
Shared memory 98 KB for K = 128 (the Ada limit is 99).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

from kernels.ada._tiles import gemm_smem, ldsm, row_atom, row_copy, smem_operand

SASS_REQUIRED = ("LDGSTS", "LDSM", "HMMA")
SASS_FORBIDDEN = ("HGMMA", "ATOM", "ATOMG", "RED", "REDG")

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_C = 64          # chunk
_SL = 64         # K slab
_NT = 128        # threads
# the diagonal blocks' 16-bit operand pairs are bf16 for either input type: a bf16 pair
# carries ~16 mantissa bits over bf16's exponent range, an fp16 pair's range caps the
# decay spread at 2^8 (most fp16 slabs would take the exact fp32 path)
_DIAG_DT = cutlass.BFloat16
_DIAG_SLOTS = 5  # 136 (r, s <= r) pairs of a 16 x 16 diagonal block over 32 lanes

_DTYPES = (cutlass.Float16, cutlass.BFloat16)
# G's order inside a 64-column slab of a row (column 8 c + 4 h + e -> place 32 h + 4 c + e):
# a thread's 8 columns are two 16-byte pieces 128 bytes apart, so one load instruction of the
# 8 threads on a row covers all 32 banks once (`_slab_col` is the inverse)
_G_SLAB_SHAPE = (4, 2, 8)
_G_SLAB_STRIDE = (1, 32, 4)


@dataclass(frozen=True)
class KdaIntraAdaConfig:
    chunk: int = 64
    num_warps: int = 4


def _flat8(t):
    """A thread's 8 consecutive elements of a row as a flat vector view (the copy atoms split
    them into atom-sized modes; the arithmetic wants one shape)."""
    return cute.make_tensor(t.iterator, cute.make_layout(8))


class KdaIntraAda:
    def __init__(self, dtype, g_dtype, head_k: int, config: KdaIntraAdaConfig = KdaIntraAdaConfig()):
        if not KdaIntraAda.can_implement(dtype, g_dtype, head_k, config):
            raise ValueError(f"KdaIntraAda cannot implement {dtype}, g {g_dtype}, K={head_k}, {config}")
        self.dtype = dtype
        self.g_dtype = g_dtype
        self.K = head_k
        self.NS = head_k // _SL
        self.config = config
        # largest decay (log2 units) over a 16-token sub-chunk for which the diagonal blocks
        # go to the tensor cores: the right factor exp2(G_first - G_s) then stays far inside
        # the bf16 operand pairs' range (2^127, for fp16 inputs too); wider spreads: exact fp32
        # (bounded: every row of k has |k_r| rk_r <= 2, as with l2norm or normalized inputs;
        # then bf16's right operands stay <= 2^111 and the left ones >= |k_rd rk_r| 2^-110, so
        # a safe gate's widest sub-chunk, 15 x 5 / ln 2 = 108, always takes the tensor cores)
        self.diag_spread = 110.0
        self.diag_spread_unbounded = 96.0

    @staticmethod
    def can_implement(dtype, g_dtype, head_k, config: KdaIntraAdaConfig) -> bool:
        return (dtype in _DTYPES and g_dtype in (cutlass.Float32, dtype) and head_k in (64, 128)
                and config.chunk == _C and config.num_warps == _NT // 32)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor,
                 beta: cute.Tensor, a_log: cute.Tensor, dt_bias: cute.Tensor,
                 chunks: cute.Tensor, w: cute.Tensor, u: cute.Tensor, qg: cute.Tensor,
                 kg: cute.Tensor, aqk: cute.Tensor, eg: cute.Tensor, scale: cutlass.Float32,
                 l2norm: cutlass.Int32, beta_sigmoid: cutlass.Int32, gate_mode: cutlass.Int32,
                 lower_bound: cutlass.Float32, stream: cuda.CUstream):
        dt = self.dtype
        s16 = cute.tile_to_shape(row_atom(), (_C, _SL), (0, 1))       # 16-bit (row, 64 cols) tiles
        s32 = cute.make_layout((_C, _SL), stride=(_SL, 1))      # fp32 (row, 64 cols) tiles

        @cute.struct
        class SharedStorage:
            r1: cute.struct.Align[cute.struct.MemRange[dt, 2 * cute.cosize(s16)], 1024]
            r2: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, _C * self.K], 1024]
            r3: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(s32)], 1024]
            r4: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(s16)], 1024]
            r5: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(s32)], 1024]
            r6: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(s16)], 1024]
            srow: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 4 * _C], 16]
            sflag: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 4], 16]

        copy_g2s = row_copy("g2s", dt, _NT)
        # the same (row, 8-column vector) map for register work on 16-bit and fp32 tiles
        copy_v16 = row_copy("universal", dt, _NT)
        copy_v32 = row_copy("universal", cutlass.Float32, _NT)
        op = warp.MmaF16BF16Op(dt, cutlass.Float32, (16, 8, 16))
        # score blocks: 4 warps along the 64 rows, 16 columns (one sub-chunk)
        mma_s = cute.make_tiled_mma(op, (4, 1, 1), permutation_mnk=(64, 16, 16))
        # diagonal blocks: one warp, 16 x 16
        mma_d = cute.make_tiled_mma(warp.MmaF16BF16Op(_DIAG_DT, cutlass.Float32, (16, 8, 16)),
                                    (1, 1, 1), permutation_mnk=(16, 16, 16))
        # w, u: 2 x 2 warps over 64 x 64
        mma_w = cute.make_tiled_mma(op, (2, 2, 1), permutation_mnk=(32, 32, 16))

        H = q.shape[1]
        self.kernel(q, k, v, g, beta, a_log, dt_bias, chunks, w, u, qg, kg, aqk, eg, scale,
                    l2norm, beta_sigmoid, gate_mode, lower_bound, s16, s32, copy_g2s, copy_v16,
                    copy_v32, mma_s, mma_d, mma_w, SharedStorage).launch(
            grid=[chunks.shape[0] * H, 1, 1], block=[_NT, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor,
               beta: cute.Tensor, a_log: cute.Tensor, dt_bias: cute.Tensor,
               chunks: cute.Tensor, w: cute.Tensor, u: cute.Tensor, qg: cute.Tensor,
               kg: cute.Tensor, aqk: cute.Tensor, eg: cute.Tensor, scale: cutlass.Float32,
               l2norm: cutlass.Int32, beta_sigmoid: cutlass.Int32, gate_mode: cutlass.Int32,
               lower_bound: cutlass.Float32, s16: cute.ComposedLayout, s32: cute.Layout,
               copy_g2s: cute.TiledCopy, copy_v16: cute.TiledCopy, copy_v32: cute.TiledCopy,
               mma_s: cute.TiledMma, mma_d: cute.TiledMma, mma_w: cute.TiledMma,
               SharedStorage: cutlass.Constexpr):
        dt, K, NS = self.dtype, self.K, self.NS
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        H = q.shape[1]
        h = bid % H
        c = bid // H
        row0 = chunks[c, 0]
        n = chunks[c, 1]
        lane = tidx % 32
        wid = tidx // 32

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(SharedStorage)
        r1 = st.r1.get_tensor(cute.make_layout(2 * cute.cosize(s16)))
        sQ = cute.make_tensor(r1.iterator, s16)                    # pass 1
        sK = cute.make_tensor(r1.iterator + cute.cosize(s16), s16)
        sAbf = cute.make_tensor(r1.iterator, s16)                  # after: A's 16-bit copy
        sOut = cute.make_tensor(r1.iterator + cute.cosize(s16), s16)   # w / u staging
        # G, log2 domain. A 64-column slab of a row is stored as [half][vector][4]: column
        # 8 c + 4 h + e at 32 h + 4 c + e, so the 8 threads reading one row (8 columns each,
        # two 16-byte loads) cover 128 contiguous bytes per load instruction; stored in column
        # order they spanned 256 bytes: 2-way bank conflicts on every G vector (ncu)
        sG = st.r2.get_tensor(cute.make_layout((_C, (*_G_SLAB_SHAPE, NS)), stride=(K, (*_G_SLAB_STRIDE, _SL))))
        r3 = st.r3.get_tensor(s32)
        sLk = cute.make_tensor(cute.recast_ptr(r3.iterator, dtype=dt), s16)
        sLq = cute.make_tensor(cute.recast_ptr(r3.iterator, dtype=dt) + cute.cosize(s16), s16)
        sAqk = r3                                                   # then Aqk fp32, then T
        sT = r3
        sR = st.r4.get_tensor(s16)                                 # pass 1: right operands
        sRhs = st.r4.get_tensor(s16)                               # w / u: B operand
        sRhsT = cute.composition(sRhs, cute.make_layout((_SL, _C), stride=(_C, 1)))
        sAkk = st.r5.get_tensor(s32)
        # the inverse's block-row products (r4 is free between pass 1 and w)
        sX = cute.make_tensor(cute.recast_ptr(st.r4.get_tensor(s16).iterator, dtype=cutlass.Float32),
                              cute.make_layout((16, 48), stride=(48, 1)))
        # the diagonal blocks' operands (bf16 views of the same buffers): left hi in r3,
        # right hi in r4, left lo in r5, right lo in r6
        p3 = cute.recast_ptr(r3.iterator, dtype=_DIAG_DT)
        p5 = cute.recast_ptr(st.r5.get_tensor(s32).iterator, dtype=_DIAG_DT)
        sDk = cute.make_tensor(p3, s16)
        sDq = cute.make_tensor(p3 + cute.cosize(s16), s16)
        sE = cute.make_tensor(cute.recast_ptr(st.r4.get_tensor(s16).iterator, dtype=_DIAG_DT), s16)
        sDk_lo = cute.make_tensor(p5, s16)
        sDq_lo = cute.make_tensor(p5 + cute.cosize(s16), s16)
        sE_lo = cute.make_tensor(cute.recast_ptr(st.r6.get_tensor(s16).iterator, dtype=_DIAG_DT), s16)
        # rq, rk, beta per row; column 3: the cumsum's half-chunk totals
        srow = st.srow.get_tensor(cute.make_layout((_C, 4), stride=(1, _C)))
        # [0], [1] per K slab: 1 when some diagonal block's decay spread is too wide for the
        # tensor cores; [2]: 1 when some row of k is not bounded (|k_r| rk_r > 2)
        sflag = st.sflag.get_tensor(cute.make_layout(4))
        if tidx < 4:
            sflag[tidx] = 0
        cute.arch.sync_threads()

        gq = cute.domain_offset((row0, 0), q[None, h, None])
        gk = cute.domain_offset((row0, 0), k[None, h, None])
        cT = cute.make_identity_tensor((_C, _SL))
        thr_g2s = copy_g2s.get_slice(tidx)
        thr16 = copy_v16.get_slice(tidx)
        thr32 = copy_v32.get_slice(tidx)
        tc = thr16.partition_S(cT)                                 # (8, 4, 1) coordinates

        # ---- the chunk's first reads all in flight together: the first K slab of q and k
        # (cp.async), g's rows (registers), then the rows behind the row factors
        self._load_qk(copy_g2s, thr_g2s, gq, gk, sQ, sK, tc, n, 0)
        # (rows past the end read the last row again; the scan skips them)
        grows = [self._row8(g, row0, n, tc[0, i, 0][0], h, sl * _SL + tc[0, i, 0][1])
                 for sl in range(NS) for i in range(4)]
        # the rows behind the row factors (their latency hides behind the gate scan)
        E = K // 2
        rf = tidx // 2
        rrf = row0 + cutlass.min(rf, n - 1)
        rowq = cute.make_rmem_tensor((E,), dt)
        rowk = cute.make_rmem_tensor((E,), dt)
        cute.autovec_copy(cute.local_tile(q[rrf, h, None], (E,), (tidx % 2,)), rowq)
        cute.autovec_copy(cute.local_tile(k[rrf, h, None], (E,), (tidx % 2,)), rowk)
        bt = cutlass.Float32(beta[row0 + cutlass.min(tidx % _C, n - 1), h])

        # ---- the score blocks' accumulators (kept over the K slabs) and diagonal pairs
        thr_s = mma_s.get_slice(tidx)
        s2r_sa = cute.make_tiled_copy_A(ldsm(dt, False), mma_s)
        s2r_sb = cute.make_tiled_copy_B(ldsm(dt, False), mma_s)
        acc_kk = [cute.make_rmem_tensor(thr_s.partition_shape_C((_C, 16)), cutlass.Float32)
                  for _ in range(3)]
        acc_qk = [cute.make_rmem_tensor(thr_s.partition_shape_C((_C, 16)), cutlass.Float32)
                  for _ in range(3)]
        for j in cutlass.range_constexpr(3):
            acc_kk[j].fill(0.0)
            acc_qk[j].fill(0.0)
        # the diagonal blocks' tensor-core path: one warp per 16 x 16 block
        thr_d = mma_d.get_slice(lane)
        s2r_da = cute.make_tiled_copy_A(ldsm(_DIAG_DT, False), mma_d)
        s2r_db = cute.make_tiled_copy_B(ldsm(_DIAG_DT, False), mma_d)
        acc_dk = cute.make_rmem_tensor(thr_d.partition_shape_C((16, 16)), cutlass.Float32)
        acc_dq = cute.make_rmem_tensor(thr_d.partition_shape_C((16, 16)), cutlass.Float32)
        acc_dk.fill(0.0)
        acc_dq.fill(0.0)
        dkk = cute.make_rmem_tensor((_DIAG_SLOTS,), cutlass.Float32)
        dqk = cute.make_rmem_tensor((_DIAG_SLOTS,), cutlass.Float32)
        dkk.fill(0.0)
        dqk.fill(0.0)
        # this lane's diagonal pairs: p = lane + 32 m -> (r, s <= r) in block `wid`
        pr = cute.make_rmem_tensor((_DIAG_SLOTS,), cutlass.Int32)
        ps = cute.make_rmem_tensor((_DIAG_SLOTS,), cutlass.Int32)
        for m in cutlass.range_constexpr(_DIAG_SLOTS):
            p = lane + 32 * m
            rr = cutlass.Int32((cute.math.sqrt(cutlass.Float32(8 * p + 1)) - 1.0) * 0.5)
            pr[m] = 16 * wid + rr
            ps[m] = 16 * wid + p - (rr * (rr + 1)) // 2

        # ---- G of every column (the first slab's q / k copies and the row factors' rows in
        # flight meanwhile); each thread's widest sub-chunk spread in `spread`
        spread = cute.make_rmem_tensor((1,), cutlass.Float32)
        self._gate_cumsum(grows, a_log, dt_bias, eg, sG, srow, spread, n, c, h, gate_mode,
                          lower_bound, tidx, thr32)
        # ---- row factors: l2norm (and the scale), beta
        self._row_factors(rowq, rowk, bt, srow, sflag, n, scale, l2norm, beta_sigmoid, tidx)
        # a K slab whose sub-chunk spread is too wide for the tensor cores (the threshold
        # depends on the row factors' range check); read after the pass's first barrier
        thr = cutlass.Float32(self.diag_spread)
        if sflag[2] != 0:
            thr = cutlass.Float32(self.diag_spread_unbounded)
        if spread[0] > thr:
            sflag[self._slab_col(tidx % K) // _SL] = 1

        # ---- pass 1 over K slabs: the score blocks (a loop, not unrolled: one copy of its
        # code keeps the instruction cache warm)
        for sl in cutlass.range(NS, unroll=1):
            if sl > 0:
                self._load_qk(copy_g2s, thr_g2s, gq, gk, sQ, sK, tc, n, sl)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            sGs = cute.local_tile(sG, (_C, _SL), (0, sl))
            # kg = k rk exp(Gamma - G), qg = q rq exp(G) of this slab from the staged rows (the
            # zero rows past the end give zeros)
            tkg = thr16.partition_D(cute.local_tile(kg[c, h, None, None], (_C, _SL), (0, sl)))
            tqg = thr16.partition_D(cute.local_tile(qg[c, h, None, None], (_C, _SL), (0, sl)))
            for i in cutlass.range_constexpr(4):
                r = tc[0, i, 0][0]
                gr = self._gvec(thr32, sGs, i)
                gl = self._row_vec(sGs, _C - 1, tc[0, i, 0][1])
                kv = self._vec(thr16, sK, i).load().to(cutlass.Float32) * srow[r, 1]
                qv = self._vec(thr16, sQ, i).load().to(cutlass.Float32) * srow[r, 0]
                okg = cute.make_rmem_tensor((8,), dt)
                oqg = cute.make_rmem_tensor((8,), dt)
                okg.store((kv * cute.math.exp2(gl - gr, fastmath=True)).to(dt))
                oqg.store((qv * cute.math.exp2(gr, fastmath=True)).to(dt))
                cute.copy(copy_v16, okg, tkg[None, i, 0])
                cute.copy(copy_v16, oqg, tqg[None, i, 0])

            # right operands, rows of sub-chunks 0..2: k_s exp(G_b - G_s), b = 16 (j + 1)
            tR = thr16.partition_D(sR)
            for i in cutlass.range_constexpr(3):
                r = tc[0, i, 0][0]
                kv = self._vec(thr16, sK, i).load().to(cutlass.Float32)
                gr = self._gvec(thr32, sGs, i)
                gb = self._row_vec(sGs, 16 * (i + 1), tc[0, i, 0][1])
                x = kv * srow[r, 1] * cute.math.exp2(gb - gr, fastmath=True)
                _flat8(tR[None, i, 0]).store(x.to(dt))
            for j in cutlass.range_constexpr(3):
                # left operands for column block j: rows of sub-chunks > j
                tLk = thr16.partition_D(sLk)
                tLq = thr16.partition_D(sLq)
                # (rows of sub-chunks <= j are left unwritten: warp w multiplies rows 16 w..,
                # and warps w <= j skip the product, whose rows the epilogue never reads)
                for i in cutlass.range_constexpr(4):
                    if i > j:
                        r = tc[0, i, 0][0]
                        gr = self._gvec(thr32, sGs, i)
                        gb = self._row_vec(sGs, 16 * (j + 1), tc[0, i, 0][1])
                        e = cute.math.exp2(gr - gb, fastmath=True)
                        kv = self._vec(thr16, sK, i).load().to(cutlass.Float32)
                        qv = self._vec(thr16, sQ, i).load().to(cutlass.Float32)
                        _flat8(tLk[None, i, 0]).store((kv * srow[r, 1] * e).to(dt))
                        _flat8(tLq[None, i, 0]).store((qv * srow[r, 0] * e).to(dt))
                cute.arch.sync_threads()
                if wid > j:
                    sRj = cute.local_tile(sR, (16, _SL), (j, 0))
                    self._gemm_ss(mma_s, thr_s, s2r_sa, s2r_sb, tidx, acc_kk[j], sLk, sRj)
                    self._gemm_ss(mma_s, thr_s, s2r_sa, s2r_sb, tidx, acc_qk[j], sLq, sRj)
                cute.arch.sync_threads()

            if sflag[sl] == 0:
                # diagonal blocks on the tensor cores, split at each sub-chunk's first token:
                # left k_r exp(G_r - G_f) <= 1, right k_s exp(G_f - G_s) <= 2^diag_spread,
                # each operand as a 16-bit pair hi + lo (hi hi' + hi lo' + lo hi': a short
                # sequence's few diagonal terms are not averaged by anything else)
                tE = thr16.partition_D(sE)
                tE_lo = thr16.partition_D(sE_lo)
                tDk = thr16.partition_D(sDk)
                tDq = thr16.partition_D(sDq)
                tDk_lo = thr16.partition_D(sDk_lo)
                tDq_lo = thr16.partition_D(sDq_lo)
                for i in cutlass.range_constexpr(4):
                    r = tc[0, i, 0][0]
                    gr = self._gvec(thr32, sGs, i)
                    gf = self._row_vec(sGs, 16 * i, tc[0, i, 0][1])
                    kv = self._vec(thr16, sK, i).load().to(cutlass.Float32) * srow[r, 1]
                    qv = self._vec(thr16, sQ, i).load().to(cutlass.Float32) * srow[r, 0]
                    e = cute.math.exp2(gr - gf, fastmath=True)
                    xk = kv * e
                    xq = qv * e
                    hk = xk.to(_DIAG_DT)
                    hq = xq.to(_DIAG_DT)
                    _flat8(tDk[None, i, 0]).store(hk)
                    _flat8(tDq[None, i, 0]).store(hq)
                    _flat8(tDk_lo[None, i, 0]).store((xk - hk.to(cutlass.Float32)).to(_DIAG_DT))
                    _flat8(tDq_lo[None, i, 0]).store((xq - hq.to(cutlass.Float32)).to(_DIAG_DT))
                    xe = kv * cute.math.exp2(gf - gr, fastmath=True)
                    he = xe.to(_DIAG_DT)
                    _flat8(tE[None, i, 0]).store(he)
                    _flat8(tE_lo[None, i, 0]).store((xe - he.to(cutlass.Float32)).to(_DIAG_DT))
                cute.arch.sync_threads()
                # warp w: its own 16 x 16 block
                sDk_w = cute.local_tile(sDk, (16, _SL), (wid, 0))
                sDq_w = cute.local_tile(sDq, (16, _SL), (wid, 0))
                sDk_lo_w = cute.local_tile(sDk_lo, (16, _SL), (wid, 0))
                sDq_lo_w = cute.local_tile(sDq_lo, (16, _SL), (wid, 0))
                sE_w = cute.local_tile(sE, (16, _SL), (wid, 0))
                sE_lo_w = cute.local_tile(sE_lo, (16, _SL), (wid, 0))
                self._gemm_ss(mma_d, thr_d, s2r_da, s2r_db, lane, acc_dk, sDk_w, sE_w)
                self._gemm_ss(mma_d, thr_d, s2r_da, s2r_db, lane, acc_dq, sDq_w, sE_w)
                self._gemm_ss(mma_d, thr_d, s2r_da, s2r_db, lane, acc_dk, sDk_lo_w, sE_w)
                self._gemm_ss(mma_d, thr_d, s2r_da, s2r_db, lane, acc_dq, sDq_lo_w, sE_w)
                self._gemm_ss(mma_d, thr_d, s2r_da, s2r_db, lane, acc_dk, sDk_w, sE_lo_w)
                self._gemm_ss(mma_d, thr_d, s2r_da, s2r_db, lane, acc_dq, sDq_w, sE_lo_w)
            else:
                # exact exponents; lanes start at different columns so that the 32 lanes'
                # loads fall on distinct banks (lane l: the column stored at (d + l) mod 64)
                for d in cutlass.range(_SL, unroll=4):
                    col = self._slab_col((d + lane) % _SL)
                    for m in cutlass.range_constexpr(_DIAG_SLOTS):
                        if lane + 32 * m < 136:
                            rr = pr[m]
                            ss = ps[m]
                            t = cute.math.exp2(sGs[rr, col] - sGs[ss, col], fastmath=True)
                            ks = sK[ss, col].to(cutlass.Float32) * t
                            dkk[m] = dkk[m] + sK[rr, col].to(cutlass.Float32) * ks
                            dqk[m] = dqk[m] + sQ[rr, col].to(cutlass.Float32) * ks
            cute.arch.sync_threads()

        # the rows of k and v behind w's and u's right-hand sides, loaded now so that their
        # latency hides behind the scores' epilogue and the inverse (rows past the end read
        # the last row again; beta is 0 there)
        NV = v.shape[2] // _SL
        kpre = [self._row8(k, row0, n, tc[0, i, 0][0], h, sl * _SL + tc[0, i, 0][1])
                for sl in range(NS) for i in range(4)]
        vpre = [self._row8(v, row0, n, tc[0, i, 0][0], h,
                           cutlass.min(vb, NV - 1) * _SL + tc[0, i, 0][1])
                for vb in range(2) for i in range(4)]

        # ---- scores into shared memory: Akk scaled by beta (the inverse's L), Aqk
        z32 = cute.make_rmem_tensor((8,), cutlass.Float32)
        z32.fill(0.0)
        for i in cutlass.range_constexpr(4):
            cute.autovec_copy(z32, thr32.partition_D(sAkk)[None, i, 0])
            cute.autovec_copy(z32, thr32.partition_D(sAqk)[None, i, 0])
        cute.arch.sync_threads()
        cS = cute.make_identity_tensor((_C, _C))
        for j in cutlass.range_constexpr(3):
            tcs = thr_s.partition_C(cute.local_tile(cS, (_C, 16), (0, j)))
            tkk = thr_s.partition_C(cute.local_tile(sAkk, (_C, 16), (0, j)))
            tqk = thr_s.partition_C(cute.local_tile(sAqk, (_C, 16), (0, j)))
            for e in cutlass.range_constexpr(cute.size(tcs)):
                rr = tcs[e][0]
                if rr >= 16 * (j + 1):
                    # the operands carried the row factors already; beta makes Akk the L of A
                    tkk[e] = acc_kk[j][e] * srow[rr, 2]
                    tqk[e] = acc_qk[j][e]
        # diagonal blocks: the tensor-core slabs' sums, then (after a barrier) the exact ones
        tcd = thr_d.partition_C(cute.local_tile(cS, (16, 16), (wid, wid)))
        tdk = thr_d.partition_C(cute.local_tile(sAkk, (16, 16), (wid, wid)))
        tdq = thr_d.partition_C(cute.local_tile(sAqk, (16, 16), (wid, wid)))
        for e in cutlass.range_constexpr(cute.size(tcd)):
            rr = tcd[e][0]
            ss = tcd[e][1]
            if ss <= rr:
                tdq[e] = acc_dq[e]
                if ss < rr:
                    tdk[e] = acc_dk[e] * srow[rr, 2]
        cute.arch.sync_threads()
        for m in cutlass.range_constexpr(_DIAG_SLOTS):
            if lane + 32 * m < 136:
                rr = pr[m]
                ss = ps[m]
                sAqk[rr, ss] = sAqk[rr, ss] + dqk[m] * srow[rr, 0] * srow[ss, 1]
                if ss < rr:
                    sAkk[rr, ss] = sAkk[rr, ss] + dkk[m] * srow[rr, 2] * srow[rr, 1] * srow[ss, 1]
        cute.arch.sync_threads()

        # ---- Aqk out (16-bit); its fp32 tile is then zeroed for T (the inverse)
        gA = cute.local_tile(aqk[c, h, None, None], (_C, _C), (0, 0))
        tgA = thr16.partition_D(gA)
        for i in cutlass.range_constexpr(4):
            x = thr32.partition_S(sAqk)[None, i, 0]
            o = cute.make_rmem_tensor_like(tgA[None, i, 0], dt)
            _flat8(o).store(_flat8(x).load().to(dt))
            cute.copy(copy_v16, o, tgA[None, i, 0])
            cute.autovec_copy(z32, _flat8(x))
        cute.arch.sync_threads()

        # ---- T = (I + L)^-1, L = sAkk (strictly lower): diagonal 16 x 16 blocks first
        if tidx < 64:
            b = tidx // 16
            jc = tidx % 16
            xs = cute.make_rmem_tensor((16,), cutlass.Float32)
            for r in cutlass.range_constexpr(16):
                val = cutlass.Float32(0.0)
                if r == jc:
                    val = cutlass.Float32(1.0)
                for s in cutlass.range_constexpr(r):
                    val = val - sAkk[16 * b + r, 16 * b + s] * xs[s]
                xs[r] = val
            for r in cutlass.range_constexpr(16):
                sT[16 * b + r, 16 * b + jc] = xs[r]
        cute.arch.sync_threads()
        # block rows: T_i,<i = -T_ii (L_i,<i T_<i,<i)  (T's upper blocks are zero)
        for ib in cutlass.range_constexpr(1, 4):
            wdt = 16 * ib
            self._block_product(sAkk, wdt, 0, sT, wdt, wdt, sX, 0, 1.0, tidx)
            cute.arch.sync_threads()
            self._block_product(sT, wdt, wdt, sX, 16, wdt, sT, wdt, -1.0, tidx)
            cute.arch.sync_threads()
        # A's 16-bit copy: the A operand of w and u
        tAb = thr16.partition_D(sAbf)
        for i in cutlass.range_constexpr(4):
            _flat8(tAb[None, i, 0]).store(_flat8(thr32.partition_S(sT)[None, i, 0]).load().to(dt))
        cute.arch.sync_threads()

        # ---- w = A (beta k rk exp G), one K slab at a time; then u = A (beta v)
        thr_w = mma_w.get_slice(tidx)
        s2r_wa = cute.make_tiled_copy_A(ldsm(dt, False), mma_w)
        s2r_wb = cute.make_tiled_copy_B(ldsm(dt, True), mma_w)
        r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt), mma_w)
        thr_r2s = r2s.get_slice(tidx)
        tRhs = thr16.partition_D(sRhs)
        for sl in cutlass.range_constexpr(NS):
            sGs = cute.local_tile(sG, (_C, _SL), (0, sl))
            for i in cutlass.range_constexpr(4):
                r = tc[0, i, 0][0]
                gr = self._gvec(thr32, sGs, i)
                kf = _flat8(kpre[sl * 4 + i]).load().to(cutlass.Float32) * (srow[r, 1] * srow[r, 2])
                _flat8(tRhs[None, i, 0]).store((kf * cute.math.exp2(gr, fastmath=True)).to(dt))
            cute.arch.sync_threads()
            self._wu_product(mma_w, thr_w, s2r_wa, s2r_wb, r2s, thr_r2s, tidx, sAbf, sRhsT, sOut,
                             thr16, copy_v16, w[c, h, None, None], sl)
        for vb in cutlass.range_constexpr(2):
            if vb < NV:
                self._u_block(vpre[4 * vb:4 * vb + 4], tRhs, srow, tc, mma_w, thr_w, s2r_wa,
                              s2r_wb, r2s, thr_r2s, tidx, sAbf, sRhsT, sOut, thr16, copy_v16,
                              u[c, h, None, None], vb)
        for vb in range(2, NV):   # V wider than 128 (not exported today): loads in the loop
            vv = [self._row8(v, row0, n, tc[0, i, 0][0], h, vb * _SL + tc[0, i, 0][1])
                  for i in range(4)]
            self._u_block(vv, tRhs, srow, tc, mma_w, thr_w, s2r_wa, s2r_wb, r2s, thr_r2s,
                          tidx, sAbf, sRhsT, sOut, thr16, copy_v16, u[c, h, None, None], vb)

    # ------------------------------------------------------------------ helpers
    @cute.jit
    def _row_factors(self, xq: cute.Tensor, xk: cute.Tensor, bt: cutlass.Float32,
                     srow: cute.Tensor, sflag: cute.Tensor, n: cutlass.Int32,
                     scale: cutlass.Float32, l2norm: cutlass.Int32, beta_sigmoid: cutlass.Int32,
                     tidx: cutlass.Int32):
        """Two threads per row, half of K each (xq, xk: the thread's halves of row tidx // 2,
        loaded by the caller; rows past the end read the last row again and get factor 0):
        rq = scale / |q_r|, rk = 1 / |k_r| (l2norm; else scale and 1); beta of row tidx (bt,
        sigmoid when asked); all 0 past the sequence's end. Flags k as unbounded when some
        row has |k_r| rk_r > 2 (the diagonal blocks' range check)."""
        r = tidx // 2
        part = tidx % 2
        fq = xq.load().to(cutlass.Float32)
        fk = xk.load().to(cutlass.Float32)
        sq = (fq * fq).reduce(cute.ReductionOp.ADD, cutlass.Float32(0.0), 0)
        sk = (fk * fk).reduce(cute.ReductionOp.ADD, cutlass.Float32(0.0), 0)
        sq = sq + cute.arch.shuffle_sync_bfly(sq, offset=1)
        sk = sk + cute.arch.shuffle_sync_bfly(sk, offset=1)
        if part == 0:
            rq = cutlass.Float32(0.0)
            rk = cutlass.Float32(0.0)
            if r < n:
                rq = scale
                rk = cutlass.Float32(1.0)
                if l2norm != 0:
                    rq = scale * cute.math.rsqrt(sq + 1e-6)
                    rk = cute.math.rsqrt(sk + 1e-6)
                if sk * rk * rk > 4.0:
                    sflag[2] = 1
            srow[r, 0] = rq
            srow[r, 1] = rk
        # beta: one row per thread
        if tidx < _C:
            b = bt
            if beta_sigmoid != 0:
                b = cute.arch.rcp_approx(1.0 + cute.math.exp(-b, fastmath=True))
            if tidx >= n:
                b = cutlass.Float32(0.0)
            srow[tidx, 2] = b
        cute.arch.sync_threads()

    @cute.jit
    def _load_qk(self, copy_g2s: cute.TiledCopy, thr_g2s: cute.TiledCopy, gq: cute.Tensor,
                 gk: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor, tc: cute.Tensor,
                 n: cutlass.Int32, sl: cutlass.Int32):
        """cp.async of K slab sl of the chunk's q and k rows (zeros past the end), committed."""
        tq = thr_g2s.partition_S(cute.local_tile(gq, (_C, _SL), (0, sl)))
        tk = thr_g2s.partition_S(cute.local_tile(gk, (_C, _SL), (0, sl)))
        dq = thr_g2s.partition_D(sQ)
        dk = thr_g2s.partition_D(sK)
        for i in cutlass.range_constexpr(cute.size(dq, mode=[1])):
            if tc[0, i, 0][0] < n:
                cute.copy(copy_g2s, tq[None, i, 0], dq[None, i, 0])
                cute.copy(copy_g2s, tk[None, i, 0], dk[None, i, 0])
            else:
                dq[None, i, 0].fill(0)
                dk[None, i, 0].fill(0)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _gate_cumsum(self, xs: list, a_log: cute.Tensor, dt_bias: cute.Tensor,
                     eg: cute.Tensor, sG: cute.Tensor, srow: cute.Tensor, spread: cute.Tensor,
                     n: cutlass.Int32, c: cutlass.Int32, h: cutlass.Int32,
                     gate_mode: cutlass.Int32, lower_bound: cutlass.Float32,
                     tidx: cutlass.Int32, thr32: cute.TiledCopy):
        """G (log2 domain) of all K columns over the chunk's rows into sG (64, K), on all
        threads: g's rows (xs: a thread's 4 row vectors per K slab, loaded by the caller) land
        in sG; then 128 / K threads per column scan
        it, the gate applied on the way (gate_mode 1: -exp(A_log) softplus(g + dt_bias); 2:
        lower_bound sigmoid(exp(A_log) (g + dt_bias)); rows past the end add 0). Writes
        exp(Gamma), and in ``spread`` the thread's widest sub-chunk decay spread (the caller
        flags the K slabs too wide for the tensor cores: the threshold needs the row factors)."""
        K, NS = self.K, self.NS
        for sl in cutlass.range_constexpr(NS):
            tG = thr32.partition_D(cute.local_tile(sG, (_C, _SL), (0, sl)))
            for i in cutlass.range_constexpr(4):
                x = cute.make_rmem_tensor((8,), cutlass.Float32)
                x.store(_flat8(xs[sl * 4 + i]).load().to(cutlass.Float32))
                cute.autovec_copy(x, tG[None, i, 0])
        HP = _NT // K              # threads per column
        RP = _C // HP              # rows per thread
        # a warp's 32 lanes take the columns stored at 32 consecutive places of a row (sG's
        # slab order): no bank conflicts in the scan
        col = self._slab_col(tidx % K)
        part = tidx // K
        ea = cutlass.Float32(1.0)
        dtb = cutlass.Float32(0.0)
        if gate_mode != 0:
            ea = cute.math.exp(a_log[h])
            dtb = dt_bias[h, col]
        cute.arch.sync_threads()
        acc = cutlass.Float32(0.0)
        widest = cutlass.Float32(0.0)
        for b in cutlass.range(RP // 16, unroll=1):
            r0 = part * RP + b * 16
            xv = cute.make_rmem_tensor((16,), cutlass.Float32)
            for e in cutlass.range_constexpr(16):
                xv[e] = sG[r0 + e, col]
            if gate_mode == 1:
                for e in cutlass.range_constexpr(16):
                    y = xv[e] + dtb
                    # softplus(y) = max(y, 0) + log(1 + exp(-|y|)), no overflow for any y
                    sp = cute.arch.fmax(y, 0.0) + _LN2 * cute.math.log2(
                        1.0 + cute.math.exp2(cute.arch.fmin(y, -y) * _LOG2E, fastmath=True),
                        fastmath=True)
                    xv[e] = -ea * sp
            elif gate_mode == 2:
                for e in cutlass.range_constexpr(16):
                    xv[e] = lower_bound * cute.arch.rcp_approx(
                        1.0 + cute.math.exp(-ea * (xv[e] + dtb), fastmath=True))
            top = cutlass.Float32(0.0)
            for e in cutlass.range_constexpr(16):
                if r0 + e < n:
                    acc = acc + xv[e] * _LOG2E
                sG[r0 + e, col] = acc
                if e == 0:
                    top = acc
            widest = cute.arch.fmax(widest, top - acc)
        spread[0] = widest
        if cutlass.const_expr(HP == 2):
            if part == 0:
                srow[col, 3] = acc
            cute.arch.sync_threads()
            if part == 1:
                base = srow[col, 3]
                for r in cutlass.range(RP, _C, unroll=8):
                    sG[r, col] = sG[r, col] + base
                eg[c, h, col] = cute.math.exp2(acc + base)
        else:
            eg[c, h, col] = cute.math.exp2(acc)
        cute.arch.sync_threads()

    @cute.jit
    def _u_block(self, vrows: list, tRhs: cute.Tensor, srow: cute.Tensor,
                 tc: cute.Tensor, mma_w: cute.TiledMma, thr_w: cute.TiledMma,
                 s2r_wa: cute.TiledCopy, s2r_wb: cute.TiledCopy, r2s: cute.TiledCopy,
                 thr_r2s: cute.TiledCopy, tidx: cutlass.Int32, sAbf: cute.Tensor,
                 sRhsT: cute.Tensor, sOut: cute.Tensor, thr16: cute.TiledCopy,
                 copy_v16: cute.TiledCopy, dst: cute.Tensor, col_block: cutlass.Int32):
        """u[:, 64 col_block ..] = A (beta v) from a thread's 4 row vectors of that block."""
        for i in cutlass.range_constexpr(4):
            r = tc[0, i, 0][0]
            vv = _flat8(vrows[i]).load().to(cutlass.Float32)
            _flat8(tRhs[None, i, 0]).store((vv * srow[r, 2]).to(self.dtype))
        cute.arch.sync_threads()
        self._wu_product(mma_w, thr_w, s2r_wa, s2r_wb, r2s, thr_r2s, tidx, sAbf, sRhsT, sOut,
                         thr16, copy_v16, dst, col_block)

    @cute.jit
    def _block_product(self, sA: cute.Tensor, a_r0: cutlass.Constexpr, a_c0: cutlass.Constexpr,
                       sB: cute.Tensor, depth: cutlass.Constexpr, width: cutlass.Constexpr,
                       sD: cute.Tensor, d_r0: cutlass.Constexpr, sign: cutlass.Constexpr,
                       tidx: cutlass.Int32):
        """sD[d_r0 + r, c] = sign sum_{m < depth} sA[a_r0 + r, a_c0 + m] sB[m, c] for the 16
        rows r and `width` columns c, in fp32: a thread owns 2 rows x 4 columns and reads
        4-wide vectors (2 + 4 loads per 32 FMAs instead of 2 loads per FMA)."""
        ncg = width // 4
        if tidx < 2 * width:
            cg = tidx % ncg
            r = 2 * (tidx // ncg)
            acc0 = cute.make_rmem_tensor((4,), cutlass.Float32)
            acc1 = cute.make_rmem_tensor((4,), cutlass.Float32)
            acc0.fill(0.0)
            acc1.fill(0.0)
            for m0 in cutlass.range_constexpr(0, depth, 4):
                a0 = cute.make_rmem_tensor((4,), cutlass.Float32)
                a1 = cute.make_rmem_tensor((4,), cutlass.Float32)
                cute.autovec_copy(cute.local_tile(sA[a_r0 + r, None], (4,), ((a_c0 + m0) // 4,)), a0)
                cute.autovec_copy(cute.local_tile(sA[a_r0 + r + 1, None], (4,), ((a_c0 + m0) // 4,)), a1)
                for mm in cutlass.range_constexpr(4):
                    b = cute.local_tile(sB[m0 + mm, None], (4,), (cg,)).load()
                    acc0.store(acc0.load() + a0[mm] * b)
                    acc1.store(acc1.load() + a1[mm] * b)
            if cutlass.const_expr(sign < 0):
                acc0.store(-acc0.load())
                acc1.store(-acc1.load())
            cute.autovec_copy(acc0, cute.local_tile(sD[d_r0 + r, None], (4,), (cg,)))
            cute.autovec_copy(acc1, cute.local_tile(sD[d_r0 + r + 1, None], (4,), (cg,)))

    @staticmethod
    def _row8(x, row0, n, r, h, col0):
        """8 elements of row min(r, n - 1) of a (rows, H, D) tensor from column col0 (a
        16-byte load, unconditional: no branch between a thread's loads)."""
        rr = cutlass.min(r, n - 1)
        t = cute.local_tile(x[row0 + rr, h, None], (8,), (col0 // 8,))
        out = cute.make_rmem_tensor((8,), x.element_type)
        cute.autovec_copy(t, out)
        return out

    @staticmethod
    def _vec(thr, s, i):
        """A thread's i-th 8-element row vector of tile s, flat."""
        return _flat8(thr.partition_S(s)[None, i, 0])

    @staticmethod
    def _g8(view):
        """8 fp32 of G (two 16-byte pieces in its slab order) as a flat vector."""
        x = cute.make_rmem_tensor((8,), cutlass.Float32)
        cute.autovec_copy(view, x)
        return x.load()

    @staticmethod
    def _row_vec(sG, row, col0):
        """The 8 fp32 of G's row `row` from column col0 (a thread's vector) as a vector."""
        return KdaIntraAda._g8(cute.local_tile(sG[row, None], (8,), (col0 // 8,)))

    @staticmethod
    def _gvec(thr, sGs, i):
        """A thread's i-th 8-column vector of a G slab as a vector."""
        return KdaIntraAda._g8(thr.partition_S(sGs)[None, i, 0])

    @staticmethod
    def _slab_col(p):
        """The column stored at place p of a row of G (the inverse of sG's slab order)."""
        return (p // _SL) * _SL + ((p // 4) % 8) * 8 + ((p // 32) % 2) * 4 + p % 4

    @staticmethod
    def _gemm_ss(tiled_mma, thr_mma, s2r_a, s2r_b, tidx, acc, sa, sb):
        """acc += sa (M, K) sb (N, K)^T, both from shared memory through ldmatrix."""
        gemm_smem(tiled_mma, acc, smem_operand(thr_mma, s2r_a, tidx, sa, "A"),
                  smem_operand(thr_mma, s2r_b, tidx, sb, "B"))

    @cute.jit
    def _wu_product(self, mma_w: cute.TiledMma, thr_w: cute.TiledMma, s2r_wa: cute.TiledCopy,
                    s2r_wb: cute.TiledCopy, r2s: cute.TiledCopy, thr_r2s: cute.TiledCopy,
                    tidx: cutlass.Int32, sAbf: cute.Tensor, sRhsT: cute.Tensor,
                    sOut: cute.Tensor, thr16: cute.TiledCopy, copy_v16: cute.TiledCopy,
                    dst: cute.Tensor, col_block: cutlass.Int32):
        """dst[:, 64 col_block ..] = A (the staged right-hand side), written as 16-bit."""
        acc = cute.make_rmem_tensor(thr_w.partition_shape_C((_C, _SL)), cutlass.Float32)
        acc.fill(0.0)
        self._gemm_ss(mma_w, thr_w, s2r_wa, s2r_wb, tidx, acc, sAbf, sRhsT)
        rO = cute.make_rmem_tensor_like(acc, self.dtype)
        rO.store(acc.load().to(self.dtype))
        cute.copy(r2s, thr_r2s.retile(rO), thr_r2s.partition_D(sOut))
        cute.arch.sync_threads()
        tO = thr16.partition_S(sOut)
        tD = thr16.partition_D(cute.local_tile(dst, (_C, _SL), (0, col_block)))
        for i in cutlass.range_constexpr(4):
            x = cute.make_rmem_tensor_like(tO[None, i, 0], self.dtype)
            cute.autovec_copy(tO[None, i, 0], x)
            cute.copy(copy_v16, x, tD[None, i, 0])
        cute.arch.sync_threads()
