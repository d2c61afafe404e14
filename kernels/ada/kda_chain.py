"""Ada design of the KDA chain: the sequential part of chunked prefill (sm_80 / sm_89; also
built for sm_90a, where it runs on the H200).

One CTA per (sequence, head, 64-column block of V) walks the sequence's chunks in order with
the state block S (K x 64, fp32) in registers. Per chunk (kernels/CONTRACT_KDA.md):

    v_new = u - w S                       (C x K) (K x 64)
    o     = qg S + Aqk v_new              (C x K) (K x 64) + (C x C) (C x 64)
    S     = Diag(exp Gamma) S + kg^T v_new   (K x C) (C x 64)

S and v_new enter the products as 16-bit operands (S's bf16 copy is staged in shared memory
once per chunk), accumulation is fp32 (mma.sync m16n8k16), S itself stays fp32. The
intra-chunk tensors w, u, qg, kg, Aqk come chunk-padded (every chunk 64 rows, rows past a
sequence's end zero), so no load is predicated; only o's rows are.

Shared memory (K = 128, one stage, 96.5 KB): w, qg, kg 16 KB each, u, v_new, Aqk, o 8 KB
each, S 16 KB, exp(Gamma) 512 B. The next chunk's w, qg, u are fetched (cp.async) as soon as
v_new is formed, its Aqk, kg and exp(Gamma) once the state update is done, and those are
waited for only after the next chunk's v_new: the loads of chunk c + 1 overlap the second
half of chunk c and the first half of c + 1 (waiting for all of them at the top of each chunk
put a memory latency into every step of the chain: ~2.7 us per chunk step on the H200).
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from kernels.ada._tiles import gemm_smem, ldsm, mn_view, row_atom, row_copy, smem_operand

SASS_REQUIRED = ("LDGSTS", "LDSM", "HMMA")
# one writer per output and per state element, in a fixed order: no atomics
SASS_FORBIDDEN = ("HGMMA", "ATOM", "ATOMG", "RED", "REDG")

SMEM_LIMIT_BYTES = 99 * 1024   # Ada's per-block limit, kept on sm_90a too

_DTYPES = (cutlass.Float16, cutlass.BFloat16)


@dataclass(frozen=True)
class KdaChainAdaConfig:
    chunk: int = 64      # tokens per chunk (the intra stage's tile)
    block_v: int = 64    # state columns per CTA
    warps_m: int = 2     # warp grid of every product (each warp 32 x 32 of a 64 x 64 tile)
    warps_n: int = 2

    @property
    def num_threads(self) -> int:
        return 32 * self.warps_m * self.warps_n


def _smem_bytes(head_k: int, config: KdaChainAdaConfig) -> int:
    c, bv = config.chunk, config.block_v
    # w, qg, kg; u, v_new, o; Aqk; S's 16-bit copy; exp(Gamma) in fp32
    return 2 * (3 * c * head_k + 3 * c * bv + c * c + head_k * bv) + 4 * head_k


class KdaChainAda:
    def __init__(self, dtype, head_k: int, config: KdaChainAdaConfig = KdaChainAdaConfig()):
        if not KdaChainAda.can_implement(dtype, head_k, config):
            raise ValueError(f"KdaChainAda cannot implement {dtype}, K={head_k}, {config}")
        self.dtype = dtype
        self.K = head_k
        self.C = config.chunk
        self.BV = config.block_v
        self.config = config
        self.num_threads = config.num_threads

    @staticmethod
    def can_implement(dtype, head_k, config: KdaChainAdaConfig) -> bool:
        if dtype not in _DTYPES or head_k not in (64, 128):
            return False
        if config.chunk != 64 or config.block_v != 64:
            return False   # the 64-element swizzle atom and the copy passes assume these
        if (config.warps_m, config.warps_n) != (2, 2):
            return False
        return _smem_bytes(head_k, config) <= SMEM_LIMIT_BYTES

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, w: cute.Tensor, u: cute.Tensor, qg: cute.Tensor, kg: cute.Tensor,
                 aqk: cute.Tensor, eg: cute.Tensor, cu_seqlens: cute.Tensor,
                 cu_chunks: cute.Tensor, h0: cute.Tensor, o: cute.Tensor, ht: cute.Tensor,
                 has_h0: cutlass.Int32, store_ht: cutlass.Int32, stream: cuda.CUstream):
        C, K, BV, dt = self.C, self.K, self.BV, self.dtype

        # every tile is rows of 64-element (128 B) swizzled segments
        atom = row_atom()
        sCK_layout = cute.tile_to_shape(atom, (C, K), (0, 1))     # w, qg, kg: (token, k)
        sCV_layout = cute.tile_to_shape(atom, (C, BV), (0, 1))    # u, v_new, o: (token, v)
        sCC_layout = cute.tile_to_shape(atom, (C, C), (0, 1))     # Aqk: (token, token)
        sKV_layout = cute.tile_to_shape(atom, (K, BV), (0, 1))    # S: (k, v)

        @cute.struct
        class SharedStorage:
            sW: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sCK_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sCK_layout)], 1024]
            sKg: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sCK_layout)], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sCV_layout)], 1024]
            sVn: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sCV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sCV_layout)], 1024]
            sA: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sCC_layout)], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKV_layout)], 1024]
            sEg: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, K], 16]

        copy_g2s = row_copy("g2s", dt, self.num_threads)
        copy_s2g = row_copy("universal", dt, self.num_threads)
        # exp(Gamma): K fp32 in 16-byte vectors, the first K / 4 threads
        copy_eg = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                cutlass.Float32, num_bits_per_copy=128),
            cute.make_layout(K // 4), cute.make_layout(4))

        # 2 x 2 warps; N permuted to 16 per warp so one ldmatrix.x4 feeds two n8 atoms
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(dt, cutlass.Float32, (16, 8, 16)),
            (self.config.warps_m, self.config.warps_n, 1),
            permutation_mnk=(self.config.warps_m * 16, self.config.warps_n * 16, 16))

        H = w.shape[1]
        v_blocks = u.shape[3] // BV
        num_seqs = cu_chunks.shape[0] - 1
        self.kernel(w, u, qg, kg, aqk, eg, cu_seqlens, cu_chunks, h0, o, ht, has_h0, store_ht,
                    sCK_layout, sCV_layout, sCC_layout, sKV_layout, copy_g2s, copy_s2g, copy_eg,
                    tiled_mma, SharedStorage).launch(
            grid=[num_seqs * H * v_blocks, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, w: cute.Tensor, u: cute.Tensor, qg: cute.Tensor, kg: cute.Tensor,
               aqk: cute.Tensor, eg: cute.Tensor, cu_seqlens: cute.Tensor,
               cu_chunks: cute.Tensor, h0: cute.Tensor, o: cute.Tensor, ht: cute.Tensor,
               has_h0: cutlass.Int32, store_ht: cutlass.Int32,
               sCK_layout: cute.ComposedLayout, sCV_layout: cute.ComposedLayout,
               sCC_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               copy_g2s: cute.TiledCopy, copy_s2g: cute.TiledCopy, copy_eg: cute.TiledCopy,
               tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        C, K, BV, dt = self.C, self.K, self.BV, self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        H = w.shape[1]
        v_blocks = u.shape[3] // BV
        vb = bid % v_blocks
        h = (bid // v_blocks) % H
        n = bid // (v_blocks * H)
        c_begin = cu_chunks[n]
        c_end = cu_chunks[n + 1]
        t_begin = cu_seqlens[n]
        t_end = cu_seqlens[n + 1]

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(SharedStorage)
        sW = st.sW.get_tensor(sCK_layout)
        sQ = st.sQ.get_tensor(sCK_layout)
        sKg = st.sKg.get_tensor(sCK_layout)
        sU = st.sU.get_tensor(sCV_layout)
        sVn = st.sVn.get_tensor(sCV_layout)
        sO = st.sO.get_tensor(sCV_layout)
        sA = st.sA.get_tensor(sCC_layout)
        sS = st.sS.get_tensor(sKV_layout)
        sEg = st.sEg.get_tensor(cute.make_layout(K))
        # operand views (same bytes): B operands are (N, reduction), kg^T is (k, token)
        sSt = cute.composition(sS, cute.make_layout((BV, K), stride=(K, 1)))
        sVnT = cute.composition(sVn, cute.make_layout((BV, C), stride=(C, 1)))
        sKgT = cute.composition(sKg, cute.make_layout((K, C), stride=(C, 1)))

        thr_mma = tiled_mma.get_slice(tidx)
        s2r_Ak = cute.make_tiled_copy_A(ldsm(dt, False), tiled_mma)   # A stored (m, k), k contiguous
        s2r_Am = cute.make_tiled_copy_A(ldsm(dt, True), tiled_mma)    # kg^T: m (= k dim) contiguous
        s2r_B = cute.make_tiled_copy_B(ldsm(dt, True), tiled_mma)     # B stored (k, n), n contiguous
        r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt), tiled_mma)
        thr_r2s = r2s.get_slice(tidx)

        # ---- product operands: smem views, their ldmatrix partitions and register fragments
        pW = smem_operand(thr_mma, s2r_Ak, tidx, sW, "A")
        pQ = smem_operand(thr_mma, s2r_Ak, tidx, sQ, "A")
        pA = smem_operand(thr_mma, s2r_Ak, tidx, sA, "A")
        pKgT = smem_operand(thr_mma, s2r_Am, tidx, sKgT, "A")
        pS = smem_operand(thr_mma, s2r_B, tidx, sSt, "B")
        pVn = smem_operand(thr_mma, s2r_B, tidx, sVnT, "B")

        # ---- the state block: fp32 accumulators of the (K, BV) update product
        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((K, BV)), cutlass.Float32)
        gH0 = cute.local_tile(h0[n, h, None, None], (K, BV), (0, vb))
        gHt = cute.local_tile(ht[n, h, None, None], (K, BV), (0, vb))
        if has_h0 != 0:
            cute.autovec_copy(thr_mma.partition_C(gH0), acc_S)
        else:
            acc_S.fill(0.0)
        acc_S_mn = mn_view(acc_S)
        tScS_mn = mn_view(thr_mma.partition_C(cute.make_identity_tensor((K, BV))))
        self._stage(acc_S, r2s, thr_r2s, sS)

        # ---- prologue: the first chunk's tiles in the two groups every chunk step has: w, qg,
        # u (the first half's operands), then Aqk, kg, exp(Gamma) (the second half's)
        if c_begin < c_end:
            self._load_tile(copy_g2s, tidx, w, sW, c_begin, h, 0)
            self._load_tile(copy_g2s, tidx, qg, sQ, c_begin, h, 0)
            self._load_tile(copy_g2s, tidx, u, sU, c_begin, h, vb)
        cute.arch.cp_async_commit_group()
        if c_begin < c_end:
            self._load_tile(copy_g2s, tidx, aqk, sA, c_begin, h, 0)
            self._load_tile(copy_g2s, tidx, kg, sKg, c_begin, h, 0)
            self._load_eg(copy_eg, tidx, eg, sEg, c_begin, h)
        cute.arch.cp_async_commit_group()

        cO = cute.make_identity_tensor((C, BV))
        thr_s2g = copy_s2g.get_slice(tidx)
        tOsO = thr_s2g.partition_S(sO)
        tOcO = thr_s2g.partition_S(cO)
        tCsU = thr_mma.partition_C(sU)
        for c in range(c_begin, c_end):
            # chunk c's w, qg, u landed (its Aqk, kg, exp(Gamma) may still be in flight: they
            # are first read after v_new); S's copy of the previous update is visible
            cute.arch.cp_async_wait_group(1)
            cute.arch.sync_threads()

            # ---- v_new = u - w S and the qg S half of o
            acc_V = cute.make_rmem_tensor(thr_mma.partition_shape_C((C, BV)), cutlass.Float32)
            acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((C, BV)), cutlass.Float32)
            acc_V.fill(0.0)
            acc_O.fill(0.0)
            gemm_smem(tiled_mma, acc_V, pW, pS)
            gemm_smem(tiled_mma, acc_O, pQ, pS)
            rU = cute.make_rmem_tensor_like(acc_V, dt)
            cute.autovec_copy(tCsU, rU)
            acc_V.store(rU.load().to(cutlass.Float32) - acc_V.load())
            self._stage(acc_V, r2s, thr_r2s, sVn)
            # v_new complete; every warp is done with w, qg, u and S's copy; Aqk, kg and
            # exp(Gamma) of chunk c landed
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            if c + 1 < c_end:
                self._load_tile(copy_g2s, tidx, w, sW, c + 1, h, 0)
                self._load_tile(copy_g2s, tidx, qg, sQ, c + 1, h, 0)
                self._load_tile(copy_g2s, tidx, u, sU, c + 1, h, vb)
            cute.arch.cp_async_commit_group()

            # ---- o = qg S + Aqk v_new, staged for coalesced stores
            gemm_smem(tiled_mma, acc_O, pA, pVn)
            self._stage(acc_O, r2s, thr_r2s, sO)

            # ---- S = Diag(exp Gamma) S + kg^T v_new; its 16-bit copy for the next chunk
            for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                acc_S_mn[r, None] = acc_S_mn[r, None].load() * sEg[tScS_mn[r, 0][0]]
            gemm_smem(tiled_mma, acc_S, pKgT, pVn)
            self._stage(acc_S, r2s, thr_r2s, sS)
            # o staged; every warp is done with Aqk, kg, exp(Gamma) and v_new
            cute.arch.sync_threads()
            if c + 1 < c_end:
                self._load_tile(copy_g2s, tidx, aqk, sA, c + 1, h, 0)
                self._load_tile(copy_g2s, tidx, kg, sKg, c + 1, h, 0)
                self._load_eg(copy_eg, tidx, eg, sEg, c + 1, h)
            cute.arch.cp_async_commit_group()

            # rows past the sequence's end are not stored
            row0 = t_begin + (c - c_begin) * C
            rows = t_end - row0
            gO = cute.local_tile(cute.domain_offset((row0, 0), o[None, h, None]), (C, BV), (0, vb))
            tOgO = thr_s2g.partition_D(gO)
            for i in cutlass.range_constexpr(cute.size(tOsO, mode=[1])):
                if tOcO[0, i, 0][0] < rows:
                    for j in cutlass.range_constexpr(cute.size(tOsO, mode=[2])):
                        tmp = cute.make_rmem_tensor_like(tOsO[None, i, j], dt)
                        cute.autovec_copy(tOsO[None, i, j], tmp)
                        cute.copy(copy_s2g, tmp, tOgO[None, i, j])

        cute.arch.cp_async_wait_group(0)
        if store_ht != 0:
            cute.autovec_copy(acc_S, thr_mma.partition_C(gHt))

    # ------------------------------------------------------------------ helpers (traced inline)
    def _stage(self, acc, r2s, thr_r2s, s_tile):
        """fp32 accumulators -> 16-bit tile in shared memory (the next products' operand)."""
        r = cute.make_rmem_tensor_like(acc, self.dtype)
        r.store(acc.load().to(self.dtype))
        cute.copy(r2s, thr_r2s.retile(r), thr_r2s.partition_D(s_tile))

    @cute.jit
    def _load_tile(self, copy_g2s: cute.TiledCopy, tidx: cutlass.Int32, src: cute.Tensor,
                   dst: cute.Tensor, c: cutlass.Int32, h: cutlass.Int32, col_block: cutlass.Int32):
        """Chunk c's (C, dst cols) tile of head h, column block col_block, into dst."""
        shape = cute.product_each(dst.shape)
        g = cute.local_tile(src[c, h, None, None], shape, (0, col_block))
        thr = copy_g2s.get_slice(tidx)
        cute.copy(copy_g2s, thr.partition_S(g), thr.partition_D(dst))

    @cute.jit
    def _load_eg(self, copy_eg: cute.TiledCopy, tidx: cutlass.Int32, eg: cute.Tensor,
                 sEg: cute.Tensor, c: cutlass.Int32, h: cutlass.Int32):
        if tidx < self.K // 4:
            thr = copy_eg.get_slice(tidx)
            g = cute.local_tile(eg[c, h, None], (self.K,), (0,))
            cute.copy(copy_eg, thr.partition_S(g), thr.partition_D(sEg))
