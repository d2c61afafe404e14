"""sm_100a / sm_103a MoE-LoRA expand (see kernels/CONTRACT_BGMV.md). Compiled and
SASS-checked only: there is no SM100 GPU here, this kernel has never run.

    finalize:     y[t, n] = sum_{j = 0..k-1 in order} w[t, j] * (sum_q s[p, q] * b[l, e, n, q])
    not finalize: y[p, n] = sum_q s[p, q] * b[l, e, n, q]        (p = t * k + j, fp32 out)

Design (memory bound; persistent grid, warp specialized, no tensor cores):
- Work unit = (token t, block of 32 * nbx output columns); nbx (1 .. consumer_warps boxes
  of 32 columns) is picked at run time from (T, N) so the first wave covers the SMs at small
  batch. Every output element has ONE owner thread (consumer thread c owns column n0 + c),
  and it walks the token's pairs j = 0, 1, ..., k-1 in order: no atomics, fixed route order.
- Warp `consumer_warps` is the producer: for each live pair, one ring stage gets the
  b[l, e, n0 : n0 + 32 nbx, 0 : 64] slab as TMA boxes of (64 ranks x 32 columns) with the
  128-byte swizzle (rank >= R and columns >= N are zero-filled by the TMA unit) plus the s[p]
  row (R * 2 bytes) by a raw cp.async.bulk; one full mbarrier (tx bytes) and one empty
  mbarrier (arrival of every consumer thread) per stage, `stages` deep.
- Consumer thread: dot = fp32 FMA chain over q = 0, 1, ..., R-1 (16-byte swizzle-aware
  shared-memory loads of its b row, broadcast loads of s); finalize: acc = w * dot + acc over
  j in order (skipped pairs contribute nothing), y[t, n] = acc (0 when no pair is live).
  The sum order of an element is a function of R alone: independent of T, k, N blocking,
  grid and other tokens (bitwise deterministic and batch invariant). y is written, never
  accumulated into; rows of skipped pairs (not finalize) are written as 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm as _llvm
from cutlass._mlir.dialects import nvvm as _nvvm
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

# UTMALDG: TMA box loads of b; UBLKCP: cp.async.bulk of the s rows; SYNCS: mbarrier ops.
SASS_REQUIRED = ("UTMALDG", "UBLKCP", "SYNCS")
# no atomics / reductions to memory, no 16-byte cp.async (LDGSTS), no tensor-core MMA
SASS_FORBIDDEN = ("ATOM", "ATOMG", "ATOMS", "RED", "REDG", "LDGSTS", "HMMA", "UTCHMMA")

_SMEM_CAPACITY = 232448  # (228 - 1) KiB per-CTA opt-in maximum on sm_100 / sm_103
_MAX_R = 64        # TMA box extent along the rank (one 128-byte swizzle row)
_BOX_N = 32        # output columns per TMA box (one consumer warp)
_BOX_ELEMS = _MAX_R * _BOX_N
_VEC = 8


@dataclass(frozen=True)
class BgmvExpandSm100Config:
    """consumer_warps: compute warps; a unit covers at most 32 * consumer_warps columns
        (one per consumer thread), i.e. consumer_warps TMA boxes per stage.
    stages: depth of the shared-memory ring (one live pair per stage).
    sm_count: persistent grid cap (only scheduling; results never depend on it)."""

    consumer_warps: int = 4
    stages: int = 8
    sm_count: int = 148


def _smem_bytes(cfg: BgmvExpandSm100Config) -> int:
    return cfg.stages * (cfg.consumer_warps * _BOX_ELEMS * 2 + _MAX_R * 2) + 2048


def _bulk_g2s(dst_smem, src_gmem, mbar, nbytes):
    """cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes (no tensor map)."""
    dst = _llvm.addrspacecast(_llvm.PointerType.get(7), dst_smem.llvm_ptr)
    _nvvm.cp_async_bulk_shared_cluster_global(
        dst, src_gmem.llvm_ptr, mbar.llvm_ptr, cutlass.Int32(nbytes).ir_value())


class BgmvExpandSm100:
    def __init__(self, dtype, finalize: bool,
                 config: BgmvExpandSm100Config = BgmvExpandSm100Config()):
        if not BgmvExpandSm100.can_implement(dtype, config):
            raise ValueError(f"BgmvExpandSm100 cannot implement {dtype} with {config}")
        self.dtype = dtype
        self.finalize = bool(finalize)
        self.cfg = config
        self.cw = config.consumer_warps
        self.stages = config.stages
        self.producer_warp = config.consumer_warps
        self.threads = 32 * (config.consumer_warps + 1)
        self.n_consumers = 32 * config.consumer_warps
        self.stage_b_elems = config.consumer_warps * _BOX_ELEMS

    @staticmethod
    def can_implement(dtype, config: BgmvExpandSm100Config = BgmvExpandSm100Config()) -> bool:
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            return False
        if config.consumer_warps not in (1, 2, 4, 8):
            return False
        if config.stages < 2 or config.sm_count < 1:
            return False
        return _smem_bytes(config) <= _SMEM_CAPACITY

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, s: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                 lora: cute.Tensor, topk_w: cute.Tensor, y: cute.Tensor,
                 stream: cuda.CUstream):
        if cutlass.const_expr(s.element_type != self.dtype or b.element_type != self.dtype):
            raise TypeError("s / b dtype does not match the compiled dtype")
        if cutlass.const_expr(y.element_type != cutlass.Float32):
            raise TypeError("y must be float32")

        # b (L, E, N, R) -> (R, N, E, L): rank contiguous, the TMA inner box dimension
        mB = cute.make_tensor(b.iterator, cute.select(b.layout, mode=[3, 2, 1, 0]))
        # one box: 64 ranks x 32 columns, rank-major rows of 128 B, 128-byte swizzle
        box_layout = cute.make_composed_layout(
            cute.make_swizzle(3, 4, 3), 0,
            cute.make_layout((_MAX_R, _BOX_N), stride=(1, _MAX_R)))
        tma_atom_b, tma_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mB, box_layout, (_MAX_R, _BOX_N))

        @cute.struct
        class SharedStorage:
            full_mbar: cute.struct.MemRange[cutlass.Int64, self.stages]
            empty_mbar: cute.struct.MemRange[cutlass.Int64, self.stages]
            sS: cute.struct.Align[
                cute.struct.MemRange[self.dtype, self.stages * _MAX_R], 128]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.dtype, self.stages * self.stage_b_elems], 1024]

        self.shared_storage = SharedStorage
        assert SharedStorage.size_in_bytes() <= _SMEM_CAPACITY

        T = topk_ids.shape[0]
        N = b.shape[2]
        grid = cutlass.min(cutlass.max(T * ((N + _BOX_N - 1) // _BOX_N), 1),
                           cutlass.Int32(self.cfg.sm_count))
        self.kernel(tma_atom_b, tma_b, s, b, topk_ids, lora, topk_w, y).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=1,
            stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_atom_b: cute.CopyAtom, tma_b: cute.Tensor, s: cute.Tensor,
               b: cute.Tensor, topk_ids: cute.Tensor, lora: cute.Tensor,
               topk_w: cute.Tensor, y: cute.Tensor):
        cw = self.cw
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32

        L = b.shape[0]
        E = b.shape[1]
        N = b.shape[2]
        R = b.shape[3]
        T = topk_ids.shape[0]
        K = topk_ids.shape[1]

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        full = storage.full_mbar.data_ptr()
        empty = storage.empty_mbar.data_ptr()
        s_buf = storage.sS.data_ptr()
        b_buf = storage.sB.data_ptr()

        if warp == self.producer_warp:
            cpasync.prefetch_descriptor(tma_atom_b)
            if lane == 0:
                for i in cutlass.range_constexpr(self.stages):
                    cute.arch.mbarrier_init(full + i, 1)
                    cute.arch.mbarrier_init(empty + i, self.n_consumers)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        # ---- work decomposition (same in every CTA; never changes any sum)
        sms = cutlass.Int32(self.cfg.sm_count)
        nbx = cutlass.Int32(cw)
        for _ in cutlass.range_constexpr(cw.bit_length() - 1):
            if T * ((N + _BOX_N * nbx - 1) // (_BOX_N * nbx)) < sms:
                nbx = nbx // 2
        ncols = _BOX_N * nbx
        nnb = (N + ncols - 1) // ncols
        units = T * nnb
        s_row = cutlass.Int64(s.stride[0])

        # ============================================================ producer warp
        if warp == self.producer_warp:
            # (64, 32, boxes) staged view of the ring, swizzled like the TMA writes it
            sB = storage.sB.get_tensor(
                cute.make_layout((_MAX_R, _BOX_N, self.stages * cw),
                                 stride=(1, _MAX_R, _BOX_ELEMS)),
                swizzle=cute.make_swizzle(3, 4, 3))
            stage = cutlass.Int32(0)
            phase = cutlass.Int32(1)
            for u in cutlass.range(bidx, units, nblk, unroll=1):
                t = u // nnb
                n0 = (u - t * nnb) * ncols
                nbl = cutlass.min(nbx, (N - n0 + _BOX_N - 1) // _BOX_N)
                l = lora[t]
                for j in cutlass.range(K, unroll=1):
                    e = topk_ids[(t, j)]
                    if l >= 0 and l < L and e >= 0 and e < E:
                        cute.arch.mbarrier_wait(empty + stage, phase)
                        if lane == 0:
                            cute.arch.mbarrier_arrive_and_expect_tx(
                                full + stage, nbl * (_BOX_ELEMS * 2) + R * 2)
                            _bulk_g2s(s_buf + stage * _MAX_R,
                                      s.iterator + cutlass.Int64(t * K + j) * s_row,
                                      full + stage, R * 2)
                        cute.arch.sync_warp()
                        # ((64, 32), n blocks) tiles of b[l, e]
                        gB = cute.local_tile(tma_b, (_MAX_R, _BOX_N), (0, None, e, l))
                        tBsB, tBgB = cpasync.tma_partition(
                            tma_atom_b, 0, cute.make_layout(1),
                            cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
                        nb0 = n0 // _BOX_N
                        for i in cutlass.range(nbl, unroll=1):
                            cute.copy(tma_atom_b, tBgB[(None, nb0 + i)],
                                      tBsB[(None, stage * cw + i)], tma_bar_ptr=full + stage)
                        stage = stage + 1
                        if stage == self.stages:
                            stage = cutlass.Int32(0)
                            phase = phase ^ 1

        # ============================================================ consumer warps
        if warp < self.producer_warp:
            stage = cutlass.Int32(0)
            phase = cutlass.Int32(0)
            r8 = R // _VEC
            sw = lane % 8  # swizzle row phase of this thread's b row (row = lane in its box)
            for u in cutlass.range(bidx, units, nblk, unroll=1):
                t = u // nnb
                n0 = (u - t * nnb) * ncols
                n = n0 + tidx
                active = tidx < ncols and n < N
                l = lora[t]
                acc = cutlass.Float32(0.0)
                for j in cutlass.range(K, unroll=1):
                    e = topk_ids[(t, j)]
                    if l >= 0 and l < L and e >= 0 and e < E:
                        cute.arch.mbarrier_wait(full + stage, phase)
                        if active:
                            brow = b_buf + (stage * self.stage_b_elems + warp * _BOX_ELEMS
                                            + lane * _MAX_R)
                            srow = s_buf + stage * _MAX_R
                            dot = cutlass.Float32(0.0)
                            for g in cutlass.range(r8, unroll=1):
                                bt = cute.make_tensor(brow + ((g ^ sw) * _VEC),
                                                      cute.make_layout(_VEC))
                                st = cute.make_tensor(srow + g * _VEC, cute.make_layout(_VEC))
                                bv4 = bt.load().to(cutlass.Float32)
                                sv4 = st.load().to(cutlass.Float32)
                                bv = [bv4[z] for z in range(_VEC)]
                                sv = [sv4[z] for z in range(_VEC)]
                                for z in cutlass.range_constexpr(_VEC):
                                    dot = sv[z] * bv[z] + dot
                            if cutlass.const_expr(self.finalize):
                                acc = topk_w[(t, j)] * dot + acc
                            else:
                                y[(t * K + j, n)] = dot
                        cute.arch.mbarrier_arrive(empty + stage)
                        stage = stage + 1
                        if stage == self.stages:
                            stage = cutlass.Int32(0)
                            phase = phase ^ 1
                    else:
                        if cutlass.const_expr(not self.finalize):
                            if active:
                                y[(t * K + j, n)] = cutlass.Float32(0.0)
                if cutlass.const_expr(self.finalize):
                    if active:
                        y[(t, n)] = acc
