"""SM100 (B200 / GB300: sm_100a, sm_103a) batched broadcast GEMM for IKBO LCE.

    c[l] = cvt(a @ b[l] (+ d[idx[l]]))   fp32 accumulation, l < L

Design (see kernels/CONTRACT.md):
- persistent CTAs (grid = min(#tiles, sm_count)); tile t -> (m, n, l) with m fastest, so the
  CTAs running at one time share the same b[l] tiles in L2 (a is L2-resident anyway);
- warp-specialized: warps 0-3 epilogue, warp 4 MMA, warp 5 TMA A/B loads, warp 6 (only with
  an addend) TMA loads of the fp32 addend d[idx[l]] into a small shared-memory ring;
- A/B: TMA into a `ab_stages`-deep shared-memory ring (PipelineTmaUmma);
- MMA: tcgen05 (UMMA, cta_group 1) issued by one warp, accumulator in tensor memory, two
  accumulator buffers (PipelineUmmaAsync) so the epilogue of tile i overlaps the mainloop of
  tile i+1;
- epilogue: tcgen05.ld (TMEM -> registers) per 128 x epi_n sub-tile, + addend from shared
  memory, convert, registers -> shared memory -> TMA store (clips at M/N edges).

The shared weight a is never copied: it is an (M, Ka, L) view with a stride-0 L mode
(cutekern.layout.broadcast_mode). The addend gather d[idx[l]] is the TMA coordinate idx[l]
in the U mode of d. M, N, K edges: TMA zero-fills out-of-bounds loads and clips stores.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator, get_num_tmem_alloc_cols
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.utils import LayoutEnum

from cutekern.layout import broadcast_mode

# Fingerprints a correct sm_100a/sm_103a build must (not) contain in its SASS.
# UTCHMMA: tcgen05.mma f16/bf16 kind; UTCBAR: tcgen05.commit to an mbarrier; LDTM: tcgen05.ld;
# UTMALDG / UTMASTG: TMA load / store. A plain warp-level HMMA would mean the tcgen05 path was
# not taken.
SASS_REQUIRED = ("UTCHMMA", "UTCBAR", "LDTM", "UTMALDG", "UTMASTG")
SASS_FORBIDDEN = ("HMMA", "HGMMA")  # exact mnemonics (UTCHMMA is its own opcode)

_SMEM_CAPACITY = {"sm_100": 232448, "sm_103": 232448}  # (228 - 1) KiB, per CTA opt-in max
_BARRIER_RESERVE = 1024  # mbarriers + TMEM holding slot + alignment slack


@dataclass(frozen=True)
class LceSm100Config:
    """Compile-time tuning of LceGemmSm100.

    mma_tile_mn:   UMMA tile (cta_group 1): M = 128 (one TMEM lane per epilogue thread),
                   N in [32, 256] step 32.
    tile_k:        K-block per pipeline stage, multiple of 64 (one 128B swizzle atom of
                   16-bit K-major A); each stage issues tile_k / 16 UMMAs.
    max_ab_stages: depth of the A/B ring; lowered to what fits next to the epilogue buffers
                   (4 without addend; 3 with the fp32 addend ring at the default tile).
    acc_stages:    TMEM accumulator buffers (2 lets the epilogue overlap the next mainloop).
    epi_n:         epilogue sub-tile width (columns per tcgen05.ld / TMA store).
    c_stages:      shared-memory buffers for the output TMA store.
    d_stages:      shared-memory buffers for the addend TMA load.
    sm_count:      persistent grid size cap (148 SMs on B200; fewer/more only changes
                   scheduling, never correctness: CTAs stride over tiles by grid size).
    """

    mma_tile_mn: Tuple[int, int] = (128, 256)
    tile_k: int = 64
    max_ab_stages: int = 4
    acc_stages: int = 2
    epi_n: int = 32
    c_stages: int = 2
    d_stages: int = 2
    sm_count: int = 148


def _dtype_bytes(dt) -> int:
    return dt.width // 8


def _ab_stages_that_fit(ab_dtype, c_dtype, has_addend: bool, cfg: LceSm100Config,
                        arch: str = "sm_100") -> int:
    """Pure-Python smem budget (mirrors SharedStorage): how many A/B stages fit next to the
    epilogue rings. Every buffer is a multiple of 1 KiB and 1 KiB aligned; the mbarriers and
    the TMEM address slot take < 1 KiB; one more KiB is kept as slack."""
    tm, tn = cfg.mma_tile_mn
    ab_stage = (tm + tn) * cfg.tile_k * _dtype_bytes(ab_dtype)
    fixed = _BARRIER_RESERVE + cfg.c_stages * tm * cfg.epi_n * _dtype_bytes(c_dtype) + 1024
    if has_addend:
        fixed += cfg.d_stages * tm * cfg.epi_n * 4
    return min(cfg.max_ab_stages, (_SMEM_CAPACITY[arch] - fixed) // ab_stage)


class LceGemmSm100:
    """c[l] = cvt(a @ b[l] (+ d[idx[l]])) on SM100 with TMA + tcgen05 + TMEM, persistent."""

    def __init__(self, ab_dtype, c_dtype, has_addend: bool,
                 config: LceSm100Config = LceSm100Config()):
        if not LceGemmSm100.can_implement(ab_dtype, c_dtype, has_addend, config):
            raise ValueError(
                f"LceGemmSm100 cannot implement ab={ab_dtype} c={c_dtype} "
                f"addend={has_addend} config={config}")
        self.ab_dtype = ab_dtype
        self.c_dtype = c_dtype
        self.acc_dtype = cutlass.Float32
        self.d_dtype = cutlass.Float32
        self.has_addend = bool(has_addend)
        self.config = config

        self.mma_tiler_mn = tuple(config.mma_tile_mn)
        self.tile_k = config.tile_k
        self.num_ab_stage = _ab_stages_that_fit(ab_dtype, c_dtype, has_addend, config)
        self.num_acc_stage = config.acc_stages
        self.num_c_stage = config.c_stages
        self.num_d_stage = config.d_stages
        self.epi_tile = (self.mma_tiler_mn[0], config.epi_n)
        self.sm_count = config.sm_count

        # warp roles; epilogue warps must be 0..3 so that warp w reads TMEM lanes 32w..32w+31
        self.epilog_warp_ids = (0, 1, 2, 3)
        self.mma_warp_id = 4
        self.tma_warp_id = 5
        self.d_load_warp_id = 6
        n_warps = 7 if self.has_addend else 6
        self.threads_per_cta = 32 * n_warps
        # named barrier ids (0 is __syncthreads)
        self.epilog_sync_bar_id = 1
        self.tmem_alloc_sync_bar_id = 2

    @staticmethod
    def can_implement(ab_dtype, c_dtype, has_addend, config: LceSm100Config = LceSm100Config()
                      ) -> bool:
        if ab_dtype not in (cutlass.Float16, cutlass.BFloat16):
            return False
        if c_dtype not in (ab_dtype, cutlass.Float32):
            return False
        tm, tn = config.mma_tile_mn
        if tm not in (64, 128) or tn % 32 != 0 or not 32 <= tn <= 256:
            return False
        # 64-row tiles use a different TMEM datapath layout; the epilogue below assumes 128
        if tm != 128:
            return False
        if config.tile_k % 16 != 0 or config.tile_k < 16:
            return False
        # 16-bit A/B with 128B swizzle: one swizzle atom is 64 elements along K
        if config.tile_k % 64 != 0:
            return False
        if config.epi_n not in (16, 32, 64) or tn % config.epi_n != 0:
            return False
        if config.acc_stages < 1 or config.acc_stages * tn > 512:
            return False
        if config.c_stages < 1 or config.d_stages < 1 or config.sm_count < 1:
            return False
        return _ab_stages_that_fit(ab_dtype, c_dtype, has_addend, config) >= 2

    # ------------------------------------------------------------------ host side
    def _make_tiled_mma(self):
        return sm100_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            tcgen05.OperandMajorMode.K,    # a is K-major
            tcgen05.OperandMajorMode.MN,   # b is N-major (N contiguous)
            self.acc_dtype,
            tcgen05.CtaGroup.ONE,
            self.mma_tiler_mn,
        )

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, d: cute.Tensor,
                 idx: cute.Tensor, stream: cuda.CUstream):
        if cutlass.const_expr(a.element_type != self.ab_dtype or b.element_type != self.ab_dtype):
            raise TypeError("a/b dtype does not match the compiled ab_dtype")
        if cutlass.const_expr(c.element_type != self.c_dtype):
            raise TypeError("c dtype does not match the compiled c_dtype")

        L = c.shape[0]
        # CuTe GEMM convention: A (M, K, L), B (N, K, L), C (M, N, L)
        mA = broadcast_mode(a, L)                                            # stride 0 in L
        mB = cute.make_tensor(b.iterator, cute.select(b.layout, mode=[2, 1, 0]))  # (N, K, L)
        mC = cute.make_tensor(c.iterator, cute.select(c.layout, mode=[1, 2, 0]))  # (M, N, L)

        # the tiled MMA below is built for K-major A and N-major B; the ABI guarantees both
        if cutlass.const_expr(LayoutEnum.from_tensor(mA).mma_major_mode()
                              != tcgen05.OperandMajorMode.K):
            raise ValueError("a must be K-major (stride 1 along K)")
        if cutlass.const_expr(LayoutEnum.from_tensor(mB).mma_major_mode()
                              != tcgen05.OperandMajorMode.MN):
            raise ValueError("b must be N-major (stride 1 along N)")
        self.c_layout = LayoutEnum.from_tensor(mC)

        tiled_mma = self._make_tiled_mma()
        mma_inst_k = cute.size(tiled_mma.shape_mnk, mode=[2])
        self.mma_tiler = (self.mma_tiler_mn[0], self.mma_tiler_mn[1], self.tile_k)
        self.num_kblocks_per_stage = self.tile_k // mma_inst_k
        self.cta_tile_shape_mnk = self.mma_tiler
        self.cluster_layout_vmnk = cute.tiled_divide(
            cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))

        # shared-memory layouts
        self.a_smem_layout_staged = sm100_utils.make_smem_layout_a(
            tiled_mma, self.mma_tiler, self.ab_dtype, self.num_ab_stage)
        self.b_smem_layout_staged = sm100_utils.make_smem_layout_b(
            tiled_mma, self.mma_tiler, self.ab_dtype, self.num_ab_stage)
        self.c_smem_layout_staged = sm100_utils.make_smem_layout_epi(
            self.c_dtype, self.c_layout, self.epi_tile, self.num_c_stage)
        self.d_smem_layout_staged = sm100_utils.make_smem_layout_epi(
            self.d_dtype, self.c_layout, self.epi_tile, self.num_d_stage)

        # TMA atoms: A/B loads (no cluster, no multicast), C store, D load
        a_smem_layout = cute.slice_(self.a_smem_layout_staged, (None, None, None, 0))
        tma_atom_a, tma_tensor_a = cute.nvgpu.make_tiled_tma_atom_A(
            cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE), mA, a_smem_layout,
            self.mma_tiler, tiled_mma, self.cluster_layout_vmnk.shape)
        b_smem_layout = cute.slice_(self.b_smem_layout_staged, (None, None, None, 0))
        tma_atom_b, tma_tensor_b = cute.nvgpu.make_tiled_tma_atom_B(
            cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE), mB, b_smem_layout,
            self.mma_tiler, tiled_mma, self.cluster_layout_vmnk.shape)
        self.num_tma_load_bytes = (cute.size_in_bytes(self.ab_dtype, a_smem_layout)
                                   + cute.size_in_bytes(self.ab_dtype, b_smem_layout))

        c_smem_layout = cute.slice_(self.c_smem_layout_staged, (None, None, 0))
        tma_atom_c, tma_tensor_c = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mC, c_smem_layout, self.epi_tile)

        tma_atom_d = None
        tma_tensor_d = None
        self.num_tma_d_bytes = 0
        if cutlass.const_expr(self.has_addend):
            # d (U, M, N) -> (M, N, U); the U coordinate of a tile is idx[l]
            mD = cute.make_tensor(d.iterator, cute.select(d.layout, mode=[1, 2, 0]))
            d_smem_layout = cute.slice_(self.d_smem_layout_staged, (None, None, 0))
            tma_atom_d, tma_tensor_d = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), mD, d_smem_layout, self.epi_tile)
            self.num_tma_d_bytes = cute.size_in_bytes(self.d_dtype, d_smem_layout)

        # TMEM: acc_stages buffers of (128 lanes x N columns) fp32
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage))
        self.num_tmem_alloc_cols = get_num_tmem_alloc_cols(tCtAcc_fake)

        buffer_align_bytes = 1024
        # without an addend the d ring is a 1-element placeholder (no TMA, no barriers used)
        d_stages_alloc = self.num_d_stage if self.has_addend else 1
        d_smem_size = cute.cosize(self.d_smem_layout_staged.outer) if self.has_addend else 1

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.num_ab_stage * 2]
            acc_mbar: cute.struct.MemRange[cutlass.Int64, self.num_acc_stage * 2]
            d_mbar: cute.struct.MemRange[cutlass.Int64, d_stages_alloc * 2]
            tmem_holding_buf: cutlass.Int32
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(self.c_smem_layout_staged.outer)],
                buffer_align_bytes]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_layout_staged.outer)],
                buffer_align_bytes]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem_layout_staged.outer)],
                buffer_align_bytes]
            # last, so that the no-addend placeholder adds no alignment padding
            sD: cute.struct.Align[
                cute.struct.MemRange[self.d_dtype, d_smem_size], buffer_align_bytes]

        self.shared_storage = SharedStorage
        # the pure-Python budget in _ab_stages_that_fit must agree with the real struct
        assert SharedStorage.size_in_bytes() <= _SMEM_CAPACITY["sm_100"], (
            f"shared storage {SharedStorage.size_in_bytes()} B exceeds the SM100 per-CTA limit")

        # persistent grid: one CTA per SM at most (smem use forces 1 CTA/SM)
        tiles_m = cute.ceil_div(c.shape[1], self.mma_tiler[0])
        tiles_n = cute.ceil_div(c.shape[2], self.mma_tiler[1])
        num_tiles = tiles_m * tiles_n * L
        grid_x = cutlass.min(num_tiles, cutlass.Int32(self.sm_count))

        self.kernel(
            tiled_mma,
            tma_atom_a, tma_tensor_a,
            tma_atom_b, tma_tensor_b,
            tma_atom_c, tma_tensor_c,
            tma_atom_d, tma_tensor_d,
            idx,
            self.a_smem_layout_staged,
            self.b_smem_layout_staged,
            self.c_smem_layout_staged,
            self.d_smem_layout_staged,
            tCtAcc_fake.layout,
        ).launch(
            grid=[grid_x, 1, 1],
            block=[self.threads_per_cta, 1, 1],
            cluster=[1, 1, 1],
            stream=stream,
        )

    # ------------------------------------------------------------------ device side
    @staticmethod
    def _tile_coord(tile_idx, tiles_m, tiles_n):
        # m fastest: CTAs live at the same time share b[l] tiles through L2
        m = tile_idx % tiles_m
        rest = tile_idx // tiles_m
        return m, rest % tiles_n, rest // tiles_n

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA_mkl: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_nkl: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        mC_mnl: cute.Tensor,
        tma_atom_d,
        mD_mnu,
        mIdx: cute.Tensor,
        a_smem_layout_staged: cute.ComposedLayout,
        b_smem_layout_staged: cute.ComposedLayout,
        c_smem_layout_staged: cute.ComposedLayout,
        d_smem_layout_staged: cute.ComposedLayout,
        acc_tmem_layout: cute.Layout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid_x, _, _ = cute.arch.grid_dim()

        if warp_idx == self.tma_warp_id:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
        if warp_idx == self.epilog_warp_ids[0]:
            cpasync.prefetch_descriptor(tma_atom_c)
        if cutlass.const_expr(self.has_addend):
            if warp_idx == self.d_load_warp_id:
                cpasync.prefetch_descriptor(tma_atom_d)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # ---- pipelines (mbarriers initialised by warp 0; fenced + CTA-synced below)
        # A/B ring: full = TMA tx bytes (1 elected producer arrive), empty = tcgen05.commit
        ab_pipeline = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=self.num_ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=self.num_tma_load_bytes,
            defer_sync=True,
        )
        # accumulator ring: full = tcgen05.commit, empty = one arrive per epilogue warp
        acc_pipeline = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_mbar.data_ptr(),
            num_stages=self.num_acc_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, len(self.epilog_warp_ids)),
            defer_sync=True,
        )
        d_pipeline = None
        if cutlass.const_expr(self.has_addend):
            # addend ring: full = TMA tx bytes, empty = lane 0 of each epilogue warp
            d_pipeline = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.d_mbar.data_ptr(),
                num_stages=self.num_d_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, len(self.epilog_warp_ids)),
                tx_count=self.num_tma_d_bytes,
                defer_sync=True,
            )

        tmem_alloc_barrier = pipeline.NamedBarrier(
            barrier_id=self.tmem_alloc_sync_bar_id,
            num_threads=32 * len((self.mma_warp_id, *self.epilog_warp_ids)),
        )
        tmem = TmemAllocator(
            storage.tmem_holding_buf.ptr,
            barrier_for_retrieve=tmem_alloc_barrier,
            allocator_warp_id=self.epilog_warp_ids[0],
        )
        epilog_sync_barrier = pipeline.NamedBarrier(
            barrier_id=self.epilog_sync_bar_id,
            num_threads=32 * len(self.epilog_warp_ids),
        )

        # no cluster: this is an mbarrier-init fence; the CTA barrier is pipeline_init_wait
        pipeline_init_arrive(cluster_shape_mn=None, is_relaxed=True)

        # ---- shared-memory tensors
        sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
        sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
        sC = storage.sC.get_tensor(c_smem_layout_staged.outer, swizzle=c_smem_layout_staged.inner)

        # ---- global tiles
        # (bM, bK, RestM, RestK, RestL)
        gA_mkl = cute.local_tile(mA_mkl, cute.slice_(self.mma_tiler, (None, 0, None)),
                                 (None, None, None))
        # (bN, bK, RestN, RestK, RestL)
        gB_nkl = cute.local_tile(mB_nkl, cute.slice_(self.mma_tiler, (0, None, None)),
                                 (None, None, None))
        # (bM, bN, RestM, RestN, RestL)
        gC_mnl = cute.local_tile(mC_mnl, cute.slice_(self.mma_tiler, (None, None, 0)),
                                 (None, None, None))
        # K comes from b: a's columns [K, Ka) are zero and are never needed
        k_tile_cnt = cute.size(gB_nkl, mode=[3])
        tiles_m = cute.size(gC_mnl, mode=[2])
        tiles_n = cute.size(gC_mnl, mode=[3])
        num_tiles = tiles_m * tiles_n * cute.size(gC_mnl, mode=[4])

        thr_mma = tiled_mma.get_slice(0)
        tCgA = thr_mma.partition_A(gA_mkl)  # (MMA, MMA_M, MMA_K, RestM, RestK, RestL)
        tCgB = thr_mma.partition_B(gB_nkl)  # (MMA, MMA_N, MMA_K, RestN, RestK, RestL)
        tCgC = thr_mma.partition_C(gC_mnl)  # (MMA, MMA_M, MMA_N, RestM, RestN, RestL)

        # TMA partitions: ((atom_v, rest_v), STAGE) / ((atom_v, rest_v), RestX, RestK, RestL)
        tAsA, tAgA = cpasync.tma_partition(
            tma_atom_a, 0, cute.make_layout(1),
            cute.group_modes(sA, 0, 3), cute.group_modes(tCgA, 0, 3))
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b, 0, cute.make_layout(1),
            cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3))

        # MMA fragments (smem descriptors) and the TMEM accumulator layout
        tCrA = tiled_mma.make_fragment_A(sA)  # (MMA, MMA_M, MMA_K, STAGE)
        tCrB = tiled_mma.make_fragment_B(sB)  # (MMA, MMA_N, MMA_K, STAGE)

        pipeline_init_wait(cluster_shape_mn=None)

        # =========================================================== TMA A/B producer warp
        if warp_idx == self.tma_warp_id:
            ab_producer_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, self.num_ab_stage)
            for tile_idx in cutlass.range(bidx, num_tiles, grid_x, unroll=1):
                tile_m, tile_n, tile_l = self._tile_coord(tile_idx, tiles_m, tiles_n)
                tAgA_slice = tAgA[(None, tile_m, None, tile_l)]  # ((atom_v, rest_v), RestK)
                tBgB_slice = tBgB[(None, tile_n, None, tile_l)]
                for k_tile in cutlass.range(0, k_tile_cnt, 1, unroll=1):
                    # wait for the slot to be freed by the MMA, then arm its tx count
                    ab_pipeline.producer_acquire(ab_producer_state)
                    bar = ab_pipeline.producer_get_barrier(ab_producer_state)
                    cute.copy(tma_atom_a, tAgA_slice[(None, k_tile)],
                              tAsA[(None, ab_producer_state.index)], tma_bar_ptr=bar)
                    cute.copy(tma_atom_b, tBgB_slice[(None, k_tile)],
                              tBsB[(None, ab_producer_state.index)], tma_bar_ptr=bar)
                    ab_producer_state.advance()
            # do not exit while the MMA may still arrive on our empty barriers
            ab_pipeline.producer_tail(ab_producer_state)

        # =========================================================== MMA warp
        if warp_idx == self.mma_warp_id:
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc_base = cute.make_tensor(tmem_ptr, acc_tmem_layout)  # (MMA, M, N, STAGE)

            ab_consumer_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.num_ab_stage)
            acc_producer_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, self.num_acc_stage)
            for tile_idx in cutlass.range(bidx, num_tiles, grid_x, unroll=1):
                tCtAcc = tCtAcc_base[(None, None, None, acc_producer_state.index)]
                # the epilogue must have drained this TMEM buffer
                acc_pipeline.producer_acquire(acc_producer_state)
                # first MMA of a tile overwrites the accumulator
                tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                for k_tile in cutlass.range(0, k_tile_cnt, 1, unroll=1):
                    ab_pipeline.consumer_wait(ab_consumer_state)
                    for kblk in cutlass.range(self.num_kblocks_per_stage, unroll_full=True):
                        kcrd = (None, None, kblk, ab_consumer_state.index)
                        cute.gemm(tiled_mma, tCtAcc, tCrA[kcrd], tCrB[kcrd], tCtAcc)
                        tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                    # tcgen05.commit: the slot is freed once these MMAs have read it
                    ab_pipeline.consumer_release(ab_consumer_state)
                    ab_consumer_state.advance()
                # tcgen05.commit: accumulator ready once all MMAs of the tile are done
                acc_pipeline.producer_commit(acc_producer_state)
                acc_producer_state.advance()
            acc_pipeline.producer_tail(acc_producer_state)

        # =========================================================== addend TMA load warp
        if cutlass.const_expr(self.has_addend):
            if warp_idx == self.d_load_warp_id:
                sD = storage.sD.get_tensor(d_smem_layout_staged.outer,
                                           swizzle=d_smem_layout_staged.inner)
                # (bM, bN, RestM, RestN, RestU) -> (EPI_M, EPI_N, epi_m, epi_n, RestM, RestN, RestU)
                gD_mnu = cute.local_tile(mD_mnu, cute.slice_(self.mma_tiler, (None, None, 0)),
                                         (None, None, None))
                gD_epi = cute.flat_divide(gD_mnu, self.epi_tile)
                # ((atom_v, rest_v), STAGE) / ((atom_v, rest_v), epi_m, epi_n, RestM, RestN, RestU)
                bGS_sD, bGS_gD = cpasync.tma_partition(
                    tma_atom_d, 0, cute.make_layout(1),
                    cute.group_modes(sD, 0, 2), cute.group_modes(gD_epi, 0, 2))
                d_producer_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.num_d_stage)
                for tile_idx in cutlass.range(bidx, num_tiles, grid_x, unroll=1):
                    tile_m, tile_n, tile_l = self._tile_coord(tile_idx, tiles_m, tiles_n)
                    user = mIdx[tile_l]  # gather: row of d added to batch entry l
                    bGS_gD_tile = bGS_gD[(None, None, None, tile_m, tile_n, user)]
                    bGS_gD_tile = cute.group_modes(bGS_gD_tile, 1, cute.rank(bGS_gD_tile))
                    # same sub-tile order as the epilogue (epi_m fastest, then epi_n)
                    for sub in cutlass.range(cute.size(bGS_gD_tile, mode=[1]), unroll=1):
                        d_pipeline.producer_acquire(d_producer_state)
                        cute.copy(tma_atom_d, bGS_gD_tile[(None, sub)],
                                  bGS_sD[(None, d_producer_state.index)],
                                  tma_bar_ptr=d_pipeline.producer_get_barrier(d_producer_state))
                        d_producer_state.advance()
                d_pipeline.producer_tail(d_producer_state)

        # =========================================================== epilogue warps
        if warp_idx < self.mma_warp_id:
            tmem.allocate(self.num_tmem_alloc_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc_base = cute.make_tensor(tmem_ptr, acc_tmem_layout)

            epi_tidx = tidx  # 0..127: thread t owns TMEM lane (row) t
            # TMEM -> register copy (tcgen05.ld) over one epi sub-tile
            copy_atom_t2r = sm100_utils.get_tmem_load_op(
                self.cta_tile_shape_mnk, self.c_layout, self.c_dtype, self.acc_dtype,
                self.epi_tile, False)
            # (EPI_M, EPI_N, epi_m, epi_n, STAGE)
            tAcc_epi = cute.flat_divide(tCtAcc_base[((None, None), 0, 0, None)], self.epi_tile)
            tiled_copy_t2r = tcgen05.make_tmem_copy(copy_atom_t2r, tAcc_epi[(None, None, 0, 0, 0)])
            thr_copy_t2r = tiled_copy_t2r.get_slice(epi_tidx)
            tTR_tAcc_base = thr_copy_t2r.partition_S(tAcc_epi)  # (T2R, T2R_M, T2R_N, epi_m, epi_n, STAGE)
            # (EPI_M, EPI_N, epi_m, epi_n, RestM, RestN, RestL)
            gC_epi = cute.flat_divide(tCgC[((None, None), 0, 0, None, None, None)], self.epi_tile)
            tTR_gC = thr_copy_t2r.partition_D(gC_epi)
            tTR_rAcc = cute.make_rmem_tensor(
                tTR_gC[(None, None, None, 0, 0, 0, 0, 0)].shape, self.acc_dtype)

            # registers -> smem (C staging for the TMA store), same thread/value ownership
            tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, self.c_dtype)
            copy_atom_r2s = sm100_utils.get_smem_store_op(
                self.c_layout, self.c_dtype, self.acc_dtype, tiled_copy_t2r)
            tiled_copy_r2s = cute.make_tiled_copy_D(copy_atom_r2s, tiled_copy_t2r)
            thr_copy_r2s = tiled_copy_r2s.get_slice(epi_tidx)
            tRS_sC = thr_copy_r2s.partition_D(sC)      # (R2S, R2S_M, R2S_N, STAGE)
            tRS_rC = tiled_copy_r2s.retile(tTR_rC)

            # smem -> gmem TMA store partitions
            bSG_sC, bSG_gC_part = cpasync.tma_partition(
                tma_atom_c, 0, cute.make_layout(1),
                cute.group_modes(sC, 0, 2), cute.group_modes(gC_epi, 0, 2))

            # addend: smem -> registers with the t2r ownership (thread t reads row t)
            tSR_sD = None
            tSR_rD = None
            tTR_rD = None
            tiled_copy_s2r = None
            if cutlass.const_expr(self.has_addend):
                sD = storage.sD.get_tensor(d_smem_layout_staged.outer,
                                           swizzle=d_smem_layout_staged.inner)
                tTR_rD = cute.make_rmem_tensor(tTR_rAcc.shape, self.d_dtype)
                copy_atom_s2r = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.d_dtype)
                tiled_copy_s2r = cute.make_tiled_copy_D(copy_atom_s2r, tiled_copy_t2r)
                thr_copy_s2r = tiled_copy_s2r.get_slice(epi_tidx)
                tSR_sD = thr_copy_s2r.partition_D(sD)   # (S2R, S2R_M, S2R_N, STAGE)
                tSR_rD = tiled_copy_s2r.retile(tTR_rD)

            c_pipeline = pipeline.PipelineTmaStore.create(
                num_stages=self.num_c_stage,
                producer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, 32 * len(self.epilog_warp_ids)),
            )
            acc_consumer_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.num_acc_stage)
            d_consumer_state = None
            if cutlass.const_expr(self.has_addend):
                d_consumer_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Consumer, self.num_d_stage)

            subtile_cnt = cute.size(tTR_tAcc_base, mode=[3]) * cute.size(tTR_tAcc_base, mode=[4])
            for tile_idx in cutlass.range(bidx, num_tiles, grid_x, unroll=1):
                tile_m, tile_n, tile_l = self._tile_coord(tile_idx, tiles_m, tiles_n)
                # ((atom_v, rest_v), epi_m * epi_n)
                bSG_gC = bSG_gC_part[(None, None, None, tile_m, tile_n, tile_l)]
                bSG_gC = cute.group_modes(bSG_gC, 1, cute.rank(bSG_gC))
                # (T2R, T2R_M, T2R_N, epi_m * epi_n)
                tTR_tAcc = tTR_tAcc_base[(None, None, None, None, None, acc_consumer_state.index)]
                tTR_tAcc = cute.group_modes(tTR_tAcc, 3, cute.rank(tTR_tAcc))
                # running sub-tile count picks the C staging buffer round-robin
                num_prev_subtiles = ((tile_idx - bidx) // grid_x) * subtile_cnt

                acc_pipeline.consumer_wait(acc_consumer_state)

                for sub in cutlass.range(subtile_cnt, unroll=1):
                    cute.copy(tiled_copy_t2r, tTR_tAcc[(None, None, None, sub)], tTR_rAcc)
                    acc_vec = tiled_copy_r2s.retile(tTR_rAcc).load()
                    if cutlass.const_expr(self.has_addend):
                        d_pipeline.consumer_wait(d_consumer_state)
                        cute.copy(tiled_copy_s2r,
                                  tSR_sD[(None, None, None, d_consumer_state.index)], tSR_rD)
                        # generic-proxy reads must be ordered before the next TMA write
                        cute.arch.fence_proxy("async.shared", space="cta")
                        d_pipeline.consumer_release(d_consumer_state)
                        d_consumer_state.advance()
                        acc_vec = acc_vec + tiled_copy_r2s.retile(tTR_rD).load()
                    tRS_rC.store(acc_vec.to(self.c_dtype))

                    c_buffer = (num_prev_subtiles + sub) % self.num_c_stage
                    cute.copy(tiled_copy_r2s, tRS_rC, tRS_sC[(None, None, None, c_buffer)])
                    # make the smem writes visible to the TMA (async proxy), then sync writers
                    cute.arch.fence_proxy("async.shared", space="cta")
                    epilog_sync_barrier.arrive_and_wait()
                    if warp_idx == self.epilog_warp_ids[0]:
                        cute.copy(tma_atom_c, bSG_sC[(None, c_buffer)], bSG_gC[(None, sub)])
                        c_pipeline.producer_commit()
                        # keep at most c_stages-1 stores in flight: the next buffer is free
                        c_pipeline.producer_acquire()
                    epilog_sync_barrier.arrive_and_wait()

                # all tcgen05.ld of this buffer have completed -> hand it back to the MMA
                cute.arch.fence_view_async_tmem_load()
                with cute.arch.elect_one():
                    acc_pipeline.consumer_release(acc_consumer_state)
                acc_consumer_state.advance()

            tmem.relinquish_alloc_permit()
            # every epilogue warp is done with TMEM before warp 0 frees it
            epilog_sync_barrier.arrive_and_wait()
            tmem.free(tmem_ptr)
            c_pipeline.producer_tail()
