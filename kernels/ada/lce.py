"""Ada design of the LCE batched broadcast GEMM (sm_80 / sm_89; also built for sm_90a).

    c[l] = a @ b[l]  (+ d[idx[l]] in fp32 before conversion when has_addend)

Mainloop: 16-byte cp.async (LDGSTS) gmem->smem in an S-stage ring, ldmatrix (LDSM; the
transposed form for the N-major B operand) smem->registers, mma.sync m16n8k16 (HMMA)
with fp32 accumulators. Epilogue: accumulators -> fp32 smem tile (aliasing the ring),
then row-contiguous 16-byte reads so the optional d gather and the c stores coalesce.

Out-of-bounds handling: cp.async has no zero-fill in the DSL copy atom (a false
predicate skips the copy), so every smem vector of every stage is written each
k-tile: by cp.async when in bounds, by a plain zero store otherwise. That makes the
M/N/K tails exact without relying on what a stage held before.
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from cutekern.layout import broadcast_mode, gather_batch

SASS_REQUIRED = ("LDGSTS", "LDSM", "HMMA")
SASS_FORBIDDEN = ("HGMMA",)

# Ada's per-block shared memory limit; the design keeps it on sm_90a too so one
# tuning runs everywhere.
SMEM_LIMIT_BYTES = 99 * 1024

_AB_DTYPES = (cutlass.Float16, cutlass.BFloat16)


@dataclass(frozen=True)
class LceAdaConfig:
    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 32
    warps_m: int = 2   # warp grid over the CTA tile; each warp owns (tile_m/warps_m, tile_n/warps_n)
    warps_n: int = 2
    stages: int = 4    # 4 x 16 KB ring = 64 KB, the same as the fp32 epilogue tile it aliases

    @property
    def num_threads(self) -> int:
        return 32 * self.warps_m * self.warps_n


def _log2(x: int) -> int:
    assert x > 0 and x & (x - 1) == 0, x
    return x.bit_length() - 1


def _smem_bytes(config: LceAdaConfig, ab_bytes: int = 2) -> tuple:
    """(ring bytes, epilogue bytes, allocated bytes). The fp32 epilogue tile reuses the ring."""
    ring = config.stages * (config.tile_m + config.tile_n) * config.tile_k * ab_bytes
    epi = config.tile_m * config.tile_n * 4
    return ring, epi, max(ring, epi)


def _row_swizzle(row_bytes: int):
    """Byte-address swizzle for a row-major smem tile whose rows are `row_bytes` long:
    XOR the 16-byte chunk index (bits [4, 4+b)) with the row index so the 8 rows read by
    one ldmatrix (or written by one warp) land on distinct 16-byte bank groups."""
    chunks = row_bytes // 16
    if row_bytes >= 128:
        return 3, 4, _log2(row_bytes) - 4      # upper bits = row & 7
    return _log2(chunks), 4, 3                 # rows shorter than 128 B: upper bits start at 128 B


class LceGemmAda:
    def __init__(self, ab_dtype, c_dtype, has_addend: bool, config: LceAdaConfig = LceAdaConfig()):
        if not LceGemmAda.can_implement(ab_dtype, c_dtype, has_addend, config):
            raise ValueError(f"LceGemmAda cannot implement {ab_dtype}, {c_dtype}, {has_addend}, {config}")
        self.ab_dtype = ab_dtype
        self.c_dtype = c_dtype
        self.acc_dtype = cutlass.Float32
        self.has_addend = bool(has_addend)
        self.config = config
        self.bM, self.bN, self.bK = config.tile_m, config.tile_n, config.tile_k
        self.stages = config.stages
        self.num_threads = config.num_threads
        self.ring_bytes, self.epi_bytes, self.smem_bytes = _smem_bytes(config)
        self.mma_shape = (16, 8, 16)

    @staticmethod
    def can_implement(ab_dtype, c_dtype, has_addend, config: LceAdaConfig) -> bool:
        if ab_dtype not in _AB_DTYPES or c_dtype not in (ab_dtype, cutlass.Float32):
            return False
        bM, bN, bK = config.tile_m, config.tile_n, config.tile_k
        wm, wn = config.warps_m, config.warps_n
        nthr = config.num_threads
        pow2 = all(x > 0 and x & (x - 1) == 0 for x in (bM, bN, bK, wm, wn))
        if not pow2 or nthr > 1024:
            return False
        # ldmatrix x4 feeds 16 rows of A and 16 columns of B per warp
        if bM % (16 * wm) or bN % (16 * wn):
            return False
        # >= 2 k-blocks per tile: the pipeline's wait sits one k-block before the refill
        if bK % 16 or bK // 16 < 2 or bK > 64:
            return False
        if config.stages < 2:
            return False
        # gmem->smem copies: 8-element vectors, every thread busy, whole passes
        if nthr % (bK // 8) or bM % (nthr // (bK // 8)):
            return False
        if (bN // 8) > nthr or nthr % (bN // 8) or bK % (nthr // (bN // 8)):
            return False
        # epilogue: 4-element fp32 vectors along N
        if (bN // 4) > nthr or nthr % (bN // 4) or bM % (nthr // (bN // 4)):
            return False
        return _smem_bytes(config)[2] <= SMEM_LIMIT_BYTES

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, d: cute.Tensor,
                 idx: cute.Tensor, stream: cuda.CUstream):
        L = b.shape[0]
        # CuTe GEMM convention: A (M, K, L), B (N, K, L), C (M, N, L).
        # a is shared by every l: a stride-0 batch mode, never a copy.
        mA = broadcast_mode(a, L)
        mB = cute.make_tensor(b.iterator, cute.select(b.layout, mode=[2, 1, 0]))
        mC = cute.make_tensor(c.iterator, cute.select(c.layout, mode=[1, 2, 0]))

        bM, bN, bK, S = self.bM, self.bN, self.bK, self.stages
        ab_bytes = self.ab_dtype.width // 8

        # smem: A (bM, bK, S) K-major rows; B (bN, bK, S) N-major (k rows of bN);
        # C (bM, bN) fp32 row-major, aliasing the ring after the mainloop.
        sA_layout = cute.make_layout((bM, bK, S), stride=(bK, 1, bM * bK))
        sB_layout = cute.make_layout((bN, bK, S), stride=(1, bN, bN * bK))
        sC_layout = cute.make_layout((bM, bN), stride=(bN, 1))
        sA_swz = cute.make_swizzle(*_row_swizzle(bK * ab_bytes))
        sB_swz = cute.make_swizzle(*_row_swizzle(bN * ab_bytes))
        sC_swz = cute.make_swizzle(*_row_swizzle(bN * 4))

        # gmem->smem: 16-byte cp.async, threads laid along each operand's contiguous mode
        g2s_atom = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
            self.ab_dtype, num_bits_per_copy=128)
        ta_k = bK // 8
        copy_A = cute.make_tiled_copy_tv(
            g2s_atom,
            cute.make_layout((self.num_threads // ta_k, ta_k), stride=(ta_k, 1)),
            cute.make_layout((1, 8)))
        tb_n = bN // 8
        copy_B = cute.make_tiled_copy_tv(
            g2s_atom,
            cute.make_layout((tb_n, self.num_threads // tb_n), stride=(1, tb_n)),
            cute.make_layout((8, 1)))

        # epilogue: 4 fp32 (16 B) per thread along N; c uses the same thread/value map
        te_n = bN // 4
        epi_thr = cute.make_layout((self.num_threads // te_n, te_n), stride=(te_n, 1))
        epi_val = cute.make_layout((1, 4))
        copy_F32 = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float32, num_bits_per_copy=128),
            epi_thr, epi_val)
        copy_Cg = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.c_dtype,
                                num_bits_per_copy=4 * self.c_dtype.width),
            epi_thr, epi_val)

        # warp-level MMA; N permuted to 16 per warp so one ldmatrix.x4.trans feeds two n8 atoms
        mma_op = cute.nvgpu.warp.MmaF16BF16Op(self.ab_dtype, self.acc_dtype, self.mma_shape)
        tiled_mma = cute.make_tiled_mma(
            mma_op,
            cute.make_layout((self.config.warps_m, self.config.warps_n, 1)),
            permutation_mnk=(self.config.warps_m * 16, self.config.warps_n * 16, 16))

        m_tiles = (mC.shape[0] + bM - 1) // bM
        n_tiles = (mC.shape[1] + bN - 1) // bN
        # one flat grid axis (L may exceed 65535); m fastest so the m-tiles sharing b[l]
        # run together and b[l] is read from DRAM about once
        grid_x = m_tiles * n_tiles * L

        self.kernel(mA, mB, mC, d, idx,
                    sA_layout, sA_swz, sB_layout, sB_swz, sC_layout, sC_swz,
                    copy_A, copy_B, copy_F32, copy_Cg, tiled_mma, m_tiles, n_tiles).launch(
            grid=[grid_x, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, d: cute.Tensor,
               idx: cute.Tensor,
               sA_layout: cute.Layout, sA_swz: cute.Swizzle,
               sB_layout: cute.Layout, sB_swz: cute.Swizzle,
               sC_layout: cute.Layout, sC_swz: cute.Swizzle,
               copy_A: cute.TiledCopy, copy_B: cute.TiledCopy,
               copy_F32: cute.TiledCopy, copy_Cg: cute.TiledCopy,
               tiled_mma: cute.TiledMma, m_tiles: cutlass.Int32, n_tiles: cutlass.Int32):
        bM, bN, bK, S = self.bM, self.bN, self.bK, self.stages
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        mt = bid % m_tiles
        rest = bid // m_tiles
        nt = rest % n_tiles
        l = rest // n_tiles

        M = mC.shape[0]
        N = mC.shape[1]
        K = mB.shape[1]                   # reduction length (a's columns >= K are zero pad)
        k_tiles = (K + bK - 1) // bK

        # per-CTA tiles: gA (bM, bK, kt), gB (bN, bK, kt), gC (bM, bN); identity tensors
        # carry the global (row, col) of each element for predication
        gA = cute.local_tile(mA[None, None, l], (bM, bK), (mt, None))
        gB = cute.local_tile(mB[None, None, l], (bN, bK), (nt, None))
        gC = cute.local_tile(mC[None, None, l], (bM, bN), (mt, nt))
        cA = cute.local_tile(cute.make_identity_tensor((mA.shape[0], mA.shape[1])), (bM, bK), (mt, None))
        cB = cute.local_tile(cute.make_identity_tensor((mB.shape[0], mB.shape[1])), (bN, bK), (nt, None))
        cC = cute.local_tile(cute.make_identity_tensor((M, N)), (bM, bN), (mt, nt))

        # shared memory: one buffer; A ring, B ring, and later the fp32 C tile over both
        smem = cutlass.utils.SmemAllocator()
        base = smem.allocate(self.smem_bytes, byte_alignment=1024)
        a_ptr = cute.recast_ptr(base, sA_swz, dtype=self.ab_dtype)
        b_ptr = cute.recast_ptr(base + cute.cosize(sA_layout) * (self.ab_dtype.width // 8),
                                sB_swz, dtype=self.ab_dtype)
        c_ptr = cute.recast_ptr(base, sC_swz, dtype=cutlass.Float32)
        sA = cute.make_tensor(a_ptr, sA_layout)
        sB = cute.make_tensor(b_ptr, sB_layout)
        sC = cute.make_tensor(c_ptr, sC_layout)

        thr_A = copy_A.get_slice(tidx)
        thr_B = copy_B.get_slice(tidx)
        tAgA = thr_A.partition_S(gA)      # (CPY, CPY_M, CPY_K, kt)
        tAsA = thr_A.partition_D(sA)      # (CPY, CPY_M, CPY_K, S)
        tAcA = thr_A.partition_S(cA)
        tBgB = thr_B.partition_S(gB)      # (CPY, CPY_N, CPY_K, kt)
        tBsB = thr_B.partition_D(sB)
        tBcB = thr_B.partition_S(cB)

        # ---- prologue: fill stages 0 .. S-2 (one commit group per tile, even if empty)
        for s in cutlass.range_constexpr(S - 1):
            if s < k_tiles:
                self.load_tile(copy_A, tAgA, tAsA, tAcA, copy_B, tBgB, tBsB, tBcB,
                               M, N, K, s, s)
            cute.arch.cp_async_commit_group()

        # ---- MMA partitions and the ldmatrix views that feed them
        thr_mma = tiled_mma.get_slice(tidx)
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(tCsB[None, None, None, 0])
        acc = tiled_mma.make_fragment_C(thr_mma.partition_C(sC))
        acc.fill(0.0)

        s2r_A = cute.make_tiled_copy_A(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), self.ab_dtype), tiled_mma)
        # B is N-major in smem: the transposed ldmatrix yields the k-pairs the MMA wants
        s2r_B = cute.make_tiled_copy_B(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(True, 4), self.ab_dtype), tiled_mma)
        thr_s2r_A = s2r_A.get_slice(tidx)
        thr_s2r_B = s2r_B.get_slice(tidx)
        tXsA = thr_s2r_A.partition_S(sA)  # (CPY, MMA_M, MMA_K, S)
        tXrA = thr_s2r_A.retile(tCrA)
        tXsB = thr_s2r_B.partition_S(sB)
        tXrB = thr_s2r_B.retile(tCrB)
        num_kb = cute.size(tCrA, mode=[2])

        # tile 0 resident; stage it into registers for k-block 0
        cute.arch.cp_async_wait_group(S - 2)
        cute.arch.sync_threads()
        cute.copy(s2r_A, tXsA[None, None, 0, 0], tXrA[None, None, 0])
        cute.copy(s2r_B, tXsB[None, None, 0, 0], tXrB[None, None, 0])

        # ---- mainloop. Tile t is group t; at the last k-block of t we wait for t+1 (at
        # most S-2 groups in flight) and sync, which also proves every warp finished
        # reading stage (t-1)%S before k-block 0 of t+1 refills it with tile t+S.
        for t in range(k_tiles):
            read_stage = t % S
            next_stage = (t + 1) % S
            for kb in cutlass.range_constexpr(num_kb):
                if kb == num_kb - 1:
                    cute.arch.cp_async_wait_group(S - 2)
                    cute.arch.sync_threads()
                    cute.copy(s2r_A, tXsA[None, None, 0, next_stage], tXrA[None, None, 0])
                    cute.copy(s2r_B, tXsB[None, None, 0, next_stage], tXrB[None, None, 0])
                else:
                    cute.copy(s2r_A, tXsA[None, None, kb + 1, read_stage], tXrA[None, None, kb + 1])
                    cute.copy(s2r_B, tXsB[None, None, kb + 1, read_stage], tXrB[None, None, kb + 1])
                if kb == 0:
                    # refill the stage consumed by tile t-1 (free since the last sync)
                    if t + (S - 1) < k_tiles:
                        self.load_tile(copy_A, tAgA, tAsA, tAcA, copy_B, tBgB, tBsB, tBcB,
                                       M, N, K, t + (S - 1), (t + (S - 1)) % S)
                    cute.arch.cp_async_commit_group()
                cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)

        # ---- epilogue: the ring is dead once every copy landed and every warp left it
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        cute.autovec_copy(acc, thr_mma.partition_C(sC))
        cute.arch.sync_threads()

        thr_F = copy_F32.get_slice(tidx)
        thr_Cg = copy_Cg.get_slice(tidx)
        tEsC = thr_F.partition_S(sC)      # (CPY, EPI_M, EPI_N)
        tEcC = thr_F.partition_S(cC)
        tEgC = thr_Cg.partition_D(gC)
        if cutlass.const_expr(self.has_addend):
            # d[idx[l]]: the batch mode of the addend is an index map, not a copy
            gD = cute.local_tile(gather_batch(d, idx, l), (bM, bN), (mt, nt))
            tEgD = thr_F.partition_S(gD)
        for i in cutlass.range_constexpr(cute.size(tEsC, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(tEsC, mode=[2])):
                coord = tEcC[0, i, j]
                # N % 8 == 0 and the vector starts at a multiple of 4: in bounds as a whole
                if coord[0] < M:
                    if coord[1] < N:
                        v = cute.make_rmem_tensor_like(tEsC[None, i, j], cutlass.Float32)
                        cute.autovec_copy(tEsC[None, i, j], v)
                        x = v.load()
                        if cutlass.const_expr(self.has_addend):
                            dv = cute.make_rmem_tensor_like(tEsC[None, i, j], cutlass.Float32)
                            cute.copy(copy_F32, tEgD[None, i, j], dv)
                            x = x + dv.load()
                        o = cute.make_rmem_tensor_like(tEsC[None, i, j], self.c_dtype)
                        o.store(x.to(self.c_dtype))
                        cute.copy(copy_Cg, o, tEgC[None, i, j])

    @cute.jit
    def load_tile(self, copy_A: cute.TiledCopy, tAgA: cute.Tensor, tAsA: cute.Tensor,
                  tAcA: cute.Tensor, copy_B: cute.TiledCopy, tBgB: cute.Tensor,
                  tBsB: cute.Tensor, tBcB: cute.Tensor, M: cutlass.Int32, N: cutlass.Int32,
                  K: cutlass.Int32, tile: cutlass.Int32, stage: cutlass.Int32):
        """Issue k-tile `tile` into ring stage `stage`. Out-of-bounds vectors get zeros
        written directly (the stage may hold an older tile).
        A vectors are 8 k-values: k0 % 8 == 0 and k0 < K imply k0 + 8 <= Ka (Ka % 8 == 0,
        zero pad), so the whole vector is loadable. B vectors are 8 n-values of one k-row:
        in bounds iff n0 < N (N % 8 == 0) and k < K."""
        for i in cutlass.range_constexpr(cute.size(tAsA, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(tAsA, mode=[2])):
                crd = tAcA[0, i, j, tile]
                dst = tAsA[None, i, j, stage]
                if crd[0] < M and crd[1] < K:
                    cute.copy(copy_A, tAgA[None, i, j, tile], dst)
                else:
                    dst.fill(0)
        for i in cutlass.range_constexpr(cute.size(tBsB, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(tBsB, mode=[2])):
                crd = tBcB[0, i, j, tile]
                dst = tBsB[None, i, j, stage]
                if crd[0] < N and crd[1] < K:
                    cute.copy(copy_B, tBgB[None, i, j, tile], dst)
                else:
                    dst.fill(0)
