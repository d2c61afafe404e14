"""sm_90a IKBO LCE in ONE launch: the user GEMM's tiles and the candidate GEMM's tiles in one
persistent grid, with per-tile ready flags between them (the IKBO spec's step 4).

    d[u] = a2 @ b2[u]   (fp32, the user phase)      c[l] = a @ b[l] + d[idx[l]]

One static walk over work items (cluster tiles): first every user tile, in M tiles of
`fused_user_tile_m` rows (half the candidate tile: twice as many, half as long, so they
fill the SMs left over by the candidate tiles' last partial wave), then the candidate tiles
exactly as LceGemmSm90 runs them. A user tile's accumulator goes straight from registers to
d with predicated stores; then its CTA publishes flags[u, mt, nt] = generation + 1
(release). The addend loader of a candidate tile waits (acquire) for the flags of the user
tiles under its rows before it TMA-loads the addend.

sync (int32): [0] the generation, [1] finished CTAs, [2:] the flags. Every CTA reads the
generation at entry; the last CTA to finish zeroes [1] and bumps [0], so the flags never
need a reset (CUDA-graph replays included) and a flag of an earlier launch never reads as
ready. Deadlock-free: a candidate item waits only for user items, which come earlier in
every cluster's walk, and the host sizes the grid to at most one CTA per SM (num_clusters),
so every item's cluster is resident or finishes before it.
"""
from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from cutekern.layout import broadcast_mode
from kernels.sm90.lce import LceGemmSm90, LceSm90Config, _m_tail_widths

SASS_REQUIRED = ("HGMMA", "UTMALDG", "SYNCS")
SASS_FORBIDDEN = ("HMMA",)


class LceFusedSm90(LceGemmSm90):
    def __init__(self, ab_dtype, config: LceSm90Config = LceSm90Config()):
        if not LceFusedSm90.can_implement_fused(ab_dtype, config):
            raise ValueError(f"LceFusedSm90 cannot run {ab_dtype} with {config}")
        super().__init__(ab_dtype, ab_dtype, True, dataclasses.replace(config, pdl=False))
        ut = config.fused_user_tile_m
        self.user_tile_m = ut
        # the user tiles' WGMMA widths: the full user tile, then its trimmed last tiles
        self.user_widths = (ut,) + _m_tail_widths(dataclasses.replace(config, tile_m=ut))

    @staticmethod
    def can_implement_fused(ab_dtype, cfg: LceSm90Config) -> bool:
        ut = cfg.fused_user_tile_m
        return (LceGemmSm90.can_implement(ab_dtype, ab_dtype, True, cfg)
                and cfg.addend_tma and cfg.cluster_m == 1
                and 8 <= ut <= cfg.tile_m and ut % (8 * cfg.cluster_n) == 0
                and not (cfg.debug_no_epilogue or cfg.debug_no_addend or cfg.debug_timeline))

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, d: cute.Tensor,
                 idx: cute.Tensor, a2: cute.Tensor, b2: cute.Tensor, sync: cute.Tensor,
                 num_clusters: Int32, stream: cuda.CUstream):
        M = a.shape[0]
        L = b.shape[0]
        K = b.shape[1]
        N = b.shape[2]
        U = b2.shape[0]
        K2 = b2.shape[1]

        # as LceGemmSm90: c[l]^T = b[l]^T a^T, so b is the (MN-major) WGMMA A operand and a
        # the (K-major) B operand; the same for the user GEMM's b2 / a2
        mA = cute.make_tensor(
            b.iterator, cute.make_layout((N, K, L), stride=(1, b.stride[1], b.stride[0])))
        a_mk = cute.make_tensor(a.iterator, cute.make_layout((M, K), stride=(a.stride[0], 1)))
        mB = broadcast_mode(a_mk, L)
        mA2 = cute.make_tensor(
            b2.iterator, cute.make_layout((N, K2, U), stride=(1, b2.stride[1], b2.stride[0])))
        a2_mk = cute.make_tensor(a2.iterator,
                                 cute.make_layout((M, K2), stride=(a2.stride[0], 1)))
        mB2 = broadcast_mode(a2_mk, U)
        mC = cute.make_tensor(
            c.iterator, cute.make_layout((N, M, L), stride=(1, c.stride[1], c.stride[0])))
        # d[u]^T: (N, M, U); written by the user tiles, read back as the addend
        mD = cute.make_tensor(
            d.iterator,
            cute.make_layout((N, M, d.shape[0]), stride=(1, d.stride[1], d.stride[0])))

        a_layout = utils.LayoutEnum.COL_MAJOR
        b_layout = utils.LayoutEnum.ROW_MAJOR
        c_layout = utils.LayoutEnum.COL_MAJOR
        self.c_layout = c_layout

        bm, bn, bk = self.cta_tile
        bu = self.user_tile_m
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype,
            OperandMajorMode.MN, OperandMajorMode.K,
            self.acc_dtype, (self.num_mma_wg, 1, 1), tiler_mn=(64, bn))

        a_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(a_layout, self.ab_dtype, bm), self.ab_dtype)
        a_smem_staged = cute.tile_to_shape(a_atom, (bm, bk, self.ab_stages), order=(1, 0, 2))
        b_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(b_layout, self.ab_dtype, bk), self.ab_dtype)
        b_smem_staged = cute.tile_to_shape(b_atom, (bn, bk, self.ab_stages), order=(0, 1, 2))
        epi_smem_staged = sm90_utils.make_smem_layout_epi(
            self.c_dtype, c_layout, self.epi_tile, self.epi_stages)

        a_smem = cute.slice_(a_smem_staged, (None, None, 0))
        b_smem = cute.slice_(b_smem_staged, (None, None, 0))
        # a user tile loads bu rows of a2 into the first bu rows of a b stage (the same
        # swizzled layout: rows are the outer mode)
        b_smem_u = cute.slice_(cute.tile_to_shape(b_atom, (bu, bk, 1), order=(0, 1, 2)),
                               (None, None, 0))
        mc_a = self.cluster_shape_mn[1]
        mc_b = self.cluster_shape_mn[0]
        op_a = (cpasync.CopyBulkTensorTileG2SOp() if mc_a == 1
                else cpasync.CopyBulkTensorTileG2SMulticastOp())
        op_b = (cpasync.CopyBulkTensorTileG2SOp() if mc_b == 1
                else cpasync.CopyBulkTensorTileG2SMulticastOp())
        tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(op_a, mA, a_smem, (bm, bk),
                                                        num_multicast=mc_a)
        tma_atom_b, tma_b = cpasync.make_tiled_tma_atom(op_b, mB, b_smem, (bn, bk),
                                                        num_multicast=mc_b)
        tma_atom_a2, tma_a2 = cpasync.make_tiled_tma_atom(op_a, mA2, a_smem, (bm, bk),
                                                          num_multicast=mc_a)
        tma_atom_b2, tma_b2 = cpasync.make_tiled_tma_atom(op_b, mB2, b_smem_u, (bu, bk),
                                                          num_multicast=mc_b)
        tma_atom_c, tma_c = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mC,
            cute.slice_(epi_smem_staged, (None, None, 0)), self.epi_tile)

        tma_bytes = cute.size_in_bytes(self.ab_dtype, a_smem) + \
            cute.size_in_bytes(self.ab_dtype, b_smem)
        tma_bytes_u = cute.size_in_bytes(self.ab_dtype, a_smem) + \
            cute.size_in_bytes(self.ab_dtype, b_smem_u)

        add_smem_staged = sm90_utils.make_smem_layout_epi(
            cutlass.Float32, c_layout, self.epi_tile, self.addend_stages)
        add_smem = cute.slice_(add_smem_staged, (None, None, 0))
        tma_atom_d, tma_d = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mD, add_smem, self.epi_tile)
        add_bytes = cute.size_in_bytes(cutlass.Float32, add_smem)

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            add_mbar: cute.struct.MemRange[cutlass.Int64, self.addend_stages * 2]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem_staged)],
                self.buffer_align_bytes]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem_staged)],
                self.buffer_align_bytes]
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(epi_smem_staged)],
                self.buffer_align_bytes]
            sAdd: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float32, cute.cosize(add_smem_staged)],
                self.buffer_align_bytes]

        self.shared_storage = SharedStorage

        cn = self.cluster_shape_mn[0]
        self.kernel_fused(
            tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_a2, tma_a2, tma_atom_b2, tma_b2,
            tma_atom_c, tma_c, mD, idx, sync, tiled_mma,
            a_smem_staged, b_smem_staged, epi_smem_staged, tma_bytes, tma_bytes_u,
            tma_atom_d, tma_d, add_smem_staged, add_bytes,
        ).launch(
            grid=[num_clusters * cn, 1, 1],
            block=[self.threads_per_cta, 1, 1],
            cluster=(cn, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---------------------------------------------------------------- device side
    @cute.jit
    def _item(self, w: Int32, w_user: Int32, ntc: Int32, ntm_u: Int32, ntm_c: Int32,
              n_rank: Int32):
        """Work item w of the walk -> (is_user, n tile of this CTA, m tile, batch entry):
        n fastest, then m, then the user / candidate index (the library's raster)."""
        is_user = w < w_user
        v = w
        ntm = ntm_u
        if not is_user:
            v = w - w_user
            ntm = ntm_c
        nc = v % ntc
        r = v // ntc
        return is_user, nc * self.cluster_shape_mn[0] + n_rank, r % ntm, r // ntm

    @cute.kernel
    def kernel_fused(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_a2: cute.CopyAtom,
        mA2: cute.Tensor,
        tma_atom_b2: cute.CopyAtom,
        mB2: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        mC: cute.Tensor,
        mD: cute.Tensor,
        idx: cute.Tensor,
        sync: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        epi_smem_staged: cute.ComposedLayout,
        tma_bytes: cutlass.Constexpr,
        tma_bytes_u: cutlass.Constexpr,
        tma_atom_d: cute.CopyAtom,
        mD_tma: cute.Tensor,
        add_smem_staged: cute.ComposedLayout,
        add_bytes: cutlass.Constexpr,
    ):
        bm, bn, bk = self.cta_tile
        bu = self.user_tile_m
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        if warp_idx == self.load_warp_id:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
            cpasync.prefetch_descriptor(tma_atom_a2)
            cpasync.prefetch_descriptor(tma_atom_b2)
            cpasync.prefetch_descriptor(tma_atom_c)
        if warp_idx == self.addend_load_warp_id:
            cpasync.prefetch_descriptor(tma_atom_d)

        # this launch's flag value: the generation the previous launch left, + 1
        target = cute.arch.load(sync.iterator, Int32, sem="relaxed", scope="gpu") + 1
        flags = sync.iterator + 2

        cta_layout_mnk = cute.make_layout((*self.cluster_shape_mn, 1))
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        mc_a = self.cluster_shape_mn[1]
        mc_b = self.cluster_shape_mn[0]
        a_mcast_mask = 0
        b_mcast_mask = 0
        if cutlass.const_expr(mc_a > 1):
            a_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=1)
        if cutlass.const_expr(mc_b > 1):
            b_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, (mc_a + mc_b - 1) * self.num_mma_wg * 4),
            tx_count=tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
            defer_sync=True,
        )
        add_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.add_mbar.data_ptr(),
            num_stages=self.addend_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=add_bytes,
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sC = storage.sC.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)
        sAdd = storage.sAdd.get_tensor(add_smem_staged.outer, swizzle=add_smem_staged.inner)
        # the first bu rows of every b stage: where a user tile's a2 rows land
        sB_u = storage.sB.get_tensor(
            cute.composition(b_smem_staged.outer,
                             cute.make_layout((bu, bk, self.ab_stages), stride=(1, bn, bn * bk))),
            swizzle=b_smem_staged.inner)

        gA = cute.local_tile(mA, (bm, bk), (None, None, None))
        gB = cute.local_tile(mB, (bn, bk), (None, None, None))
        gA2 = cute.local_tile(mA2, (bm, bk), (None, None, None))
        gB2 = cute.local_tile(mB2, (bu, bk), (None, None, None))
        gC = cute.local_tile(mC, (bm, bn), (None, None, None))

        a_cta_layout = cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape)
        b_cta_layout = cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape)
        tAsA, tAgA = cpasync.tma_partition(
            tma_atom_a, cluster_coord[1], a_cta_layout,
            cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b, cluster_coord[0], b_cta_layout,
            cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        tAsA2, tAgA2 = cpasync.tma_partition(
            tma_atom_a2, cluster_coord[1], a_cta_layout,
            cute.group_modes(sA, 0, 2), cute.group_modes(gA2, 0, 2))
        tBsB2, tBgB2 = cpasync.tma_partition(
            tma_atom_b2, cluster_coord[0], b_cta_layout,
            cute.group_modes(sB_u, 0, 2), cute.group_modes(gB2, 0, 2))

        wg_idx = cute.arch.make_warp_uniform(tidx // self.num_threads_per_wg)
        mma_thr_layout = cute.make_layout(self.num_mma_wg, stride=self.num_threads_per_wg)
        thr_mma = tiled_mma.get_slice(mma_thr_layout(wg_idx - 1))
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        tCgC = thr_mma.partition_C(gC)
        acc = cute.make_rmem_tensor(tCgC.shape[:3], self.acc_dtype)

        N = mC.shape[0]
        M_rows = mC.shape[1]
        L = mC.shape[2]
        U = mA2.shape[2]
        k_tiles_c = cute.size(gA, mode=[3])
        k_tiles_u = cute.size(gA2, mode=[3])
        kb_last_c = (mA.shape[1] - (k_tiles_c - 1) * bk + 15) // 16
        kb_last_u = (mA2.shape[1] - (k_tiles_u - 1) * bk + 15) // 16

        # WGMMA width views (as LceGemmSm90's m_tail): entry 0 the full tile; the candidate
        # widths run on the b stage's bn rows, the user widths on its first bu rows
        def width_views(ws):
            mmas, frags, accs, thrs = [], [], [], []
            for w in ws:
                mma_w = sm90_utils.make_trivial_tiled_mma(
                    self.ab_dtype, self.ab_dtype, OperandMajorMode.MN, OperandMajorMode.K,
                    self.acc_dtype, (self.num_mma_wg, 1, 1), tiler_mn=(64, w))
                b_w = cute.composition(
                    b_smem_staged.outer,
                    cute.make_layout((w, bk, self.ab_stages), stride=(1, bn, bn * bk)))
                sB_w = storage.sB.get_tensor(b_w, swizzle=b_smem_staged.inner)
                thr_w = mma_w.get_slice(mma_thr_layout(wg_idx - 1))
                mmas.append(mma_w)
                frags.append(mma_w.make_fragment_B(thr_w.partition_B(sB_w)))
                shape_w = thr_w.partition_C(cute.local_tile(mC, (bm, w), (0, 0, 0))).shape
                accs.append(cute.make_tensor(acc.iterator, cute.make_layout(shape_w)))
                thrs.append(thr_w)
            return mmas, frags, accs, thrs

        widths = (bn,) + _m_tail_widths(self.cfg)
        mmas, Bs, accs, _ = width_views(widths)
        mmas_u, Bs_u, accs_u, _ = width_views(self.user_widths)

        # the walk
        cn = self.cluster_shape_mn[0]
        n_clusters = cute.arch.grid_dim()[0] // cn
        cid = cute.arch.block_idx()[0] // cn
        ntc = (cute.ceil_div(N, bm) + cn - 1) // cn
        ntn = ntc * cn  # n tiles the flags are laid out over
        ntm_u = cute.ceil_div(M_rows, bu)
        ntm_c = cute.ceil_div(M_rows, bn)
        w_user = U * ntm_u * ntc
        total = w_user + L * ntm_c * ntc
        n_rank = cluster_coord[0]

        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.load_regs)

        # ------------------------------------------------------------ producer warp
        if warp_idx == self.load_warp_id:
            prod_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, self.ab_stages)
            w = cid
            while w < total:
                is_user, nt, mt, l = self._item(w, w_user, ntc, ntm_u, ntm_c, n_rank)
                prod_state.reset_count()
                if is_user:
                    tAgA_t = tAgA2[(None, nt, None, l)]
                    tBgB_t = tBgB2[(None, mt, None, l)]
                    for _k in range(k_tiles_u):
                        # a user stage carries fewer bytes (bu rows of a2): expect those
                        ab_pipeline.sync_object_empty.wait(prod_state.index, prod_state.phase)
                        ab_pipeline.sync_object_full.arrive_and_expect_tx(
                            prod_state.index, tma_bytes_u)
                        bar = ab_pipeline.producer_get_barrier(prod_state)
                        cute.copy(tma_atom_a2, tAgA_t[(None, prod_state.count)],
                                  tAsA2[(None, prod_state.index)],
                                  tma_bar_ptr=bar, mcast_mask=a_mcast_mask)
                        cute.copy(tma_atom_b2, tBgB_t[(None, prod_state.count)],
                                  tBsB2[(None, prod_state.index)],
                                  tma_bar_ptr=bar, mcast_mask=b_mcast_mask)
                        ab_pipeline.producer_commit(prod_state)
                        prod_state.advance()
                else:
                    tAgA_c = tAgA[(None, nt, None, l)]
                    tBgB_c = tBgB[(None, mt, None, l)]
                    for _k in range(k_tiles_c):
                        ab_pipeline.producer_acquire(prod_state)
                        bar = ab_pipeline.producer_get_barrier(prod_state)
                        cute.copy(tma_atom_a, tAgA_c[(None, prod_state.count)],
                                  tAsA[(None, prod_state.index)],
                                  tma_bar_ptr=bar, mcast_mask=a_mcast_mask)
                        cute.copy(tma_atom_b, tBgB_c[(None, prod_state.count)],
                                  tBsB[(None, prod_state.index)],
                                  tma_bar_ptr=bar, mcast_mask=b_mcast_mask)
                        ab_pipeline.producer_commit(prod_state)
                        prod_state.advance()
                w = w + n_clusters
            ab_pipeline.producer_tail(prod_state)

        epi_grid = (bm // self.epi_tile[0], bn // self.epi_tile[1])
        epi_num = epi_grid[0] * epi_grid[1]
        epi_order = cute.make_layout(epi_grid, stride=(epi_grid[1], 1))

        # ------------------------------------------------------- addend loader warp
        if warp_idx == self.addend_load_warp_id:
            gD_tma = cute.local_tile(mD_tma, (bm, bn), (None, None, None))
            add_prod_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, self.addend_stages)
            w = cid
            while w < total:
                is_user, nt, mt, l = self._item(w, w_user, ntc, ntm_u, ntm_c, n_rank)
                if not is_user:
                    u = idx[l]
                    # the user tiles under this candidate tile's rows: one flag per lane
                    m0 = (mt * bn) // bu
                    m1 = cutlass.min(ntm_u, ((mt + 1) * bn + bu - 1) // bu)
                    fl = flags + ((u * ntm_u + m0 + cutlass.min(lane, m1 - m0 - 1)) * ntn + nt)
                    pending = Int32(1)
                    while pending != 0:
                        v = cute.arch.load(fl, Int32, sem="acquire", scope="gpu")
                        pending = Int32(cute.arch.vote_ballot_sync((v - target) < 0))
                    # d was written through the generic proxy; the TMA reads it (async)
                    cute.arch.fence_proxy("async.global")
                    gD_epi = cute.zipped_divide(gD_tma[(None, None, nt, mt, u)], self.epi_tile)
                    bGS_sD, bGS_gD = cpasync.tma_partition(
                        tma_atom_d, 0, cute.make_layout(1),
                        cute.group_modes(sAdd, 0, 2), gD_epi)
                    n_epi = self._epi_count(M_rows, mt)
                    for e in cutlass.range_constexpr(epi_num):
                        if e < n_epi:
                            add_pipeline.producer_acquire(add_prod_state)
                            cute.copy(tma_atom_d, bGS_gD[(None, epi_order.get_hier_coord(e))],
                                      bGS_sD[(None, add_prod_state.index)],
                                      tma_bar_ptr=add_pipeline.producer_get_barrier(
                                          add_prod_state))
                            add_pipeline.producer_commit(add_prod_state)
                            add_prod_state.advance()
                w = w + n_clusters
            add_pipeline.producer_tail(add_prod_state)

        # ------------------------------------------------------- consumer warpgroups
        if wg_idx > 0:
            cute.arch.setmaxregister_increase(self.mma_regs)
            mma_tidx = tidx - self.num_threads_per_wg
            read_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.ab_stages)
            release_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.ab_stages)

            copy_atom_r2s = sm90_utils.sm90_get_smem_store_op(
                self.c_layout, elem_ty_d=self.c_dtype, elem_ty_acc=self.acc_dtype)
            copy_atom_c = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4),
                self.c_dtype)
            tiled_copy_c_atom = cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma)
            tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, tiled_copy_c_atom)
            thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
            tRS_sC = thr_copy_r2s.partition_D(sC)
            tRS_rAcc = tiled_copy_r2s.retile(acc)
            rD_shape = cute.shape(thr_copy_r2s.partition_S(sC))[:3]
            tRS_rD = cute.make_rmem_tensor(rD_shape, self.acc_dtype)
            tRS_rOut = cute.make_rmem_tensor(rD_shape, self.c_dtype)
            size_rD = cute.size(tRS_rD)
            tRS_sAdd = thr_copy_r2s.partition_S(sAdd)
            add_cons_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.addend_stages)

            epi_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)
            # (n, m) of every element of a user tile's accumulator fragment
            cI = cute.make_identity_tensor((N, M_rows))
            gcI_u = cute.local_tile(cI, (bm, bu), (None, None))
            # a tiled MMA of its own: the mainloop's ones carry their ACCUMULATE field as a
            # value of the loop, which a partition after the loop must not use
            thr_crd = sm90_utils.make_trivial_tiled_mma(
                self.ab_dtype, self.ab_dtype, OperandMajorMode.MN, OperandMajorMode.K,
                self.acc_dtype, (self.num_mma_wg, 1, 1), tiler_mn=(64, bu)).get_slice(mma_tidx)
            extent_nm = (N, M_rows)

            epi_cnt = Int32(0)
            w = cid
            while w < total:
                is_user, nt, mt, l = self._item(w, w_user, ntc, ntm_u, ntm_c, n_rank)
                if is_user:
                    rem_u = M_rows - mt * bu
                    sel = 0
                    for i in cutlass.range_constexpr(1, len(self.user_widths)):
                        if rem_u <= self.user_widths[i]:
                            sel = i
                    for i in cutlass.range_constexpr(len(self.user_widths)):
                        if sel == i:
                            read_state, release_state = self._mainloop(
                                mmas_u[i], accs_u[i], tCrA, Bs_u[i], ab_pipeline, read_state,
                                release_state, k_tiles_u, kb_last_u)
                    warpgroup.wait_group(0)
                    ab_pipeline.consumer_release(release_state)
                    release_state.advance()
                    # registers -> d[u] (the narrower widths fill a prefix of the bu-wide
                    # fragment; the rest lies past M and is predicated off)
                    crd = thr_crd.partition_C(gcI_u[(None, None, nt, mt)])
                    for v in cutlass.range_constexpr(cute.size(accs_u[0])):
                        c_v = crd[v]
                        if cute.elem_less(c_v, extent_nm):
                            mD[(c_v[0], c_v[1], l)] = accs_u[0][v]
                    # every thread's stores, then one release of the tile's flag
                    cute.arch.fence_acq_rel_gpu()
                    epi_bar.arrive_and_wait()
                    if mma_tidx == 0:
                        cute.arch.store(flags + ((l * ntm_u + mt) * ntn + nt), target,
                                        sem="release", scope="gpu")
                else:
                    rem_m = M_rows - mt * bn
                    sel = 0
                    for i in cutlass.range_constexpr(1, len(widths)):
                        if rem_m <= widths[i]:
                            sel = i
                    for i in cutlass.range_constexpr(len(widths)):
                        if sel == i:
                            read_state, release_state = self._mainloop(
                                mmas[i], accs[i], tCrA, Bs[i], ab_pipeline, read_state,
                                release_state, k_tiles_c, kb_last_c)
                    warpgroup.wait_group(0)
                    ab_pipeline.consumer_release(release_state)
                    release_state.advance()

                    gC_t = gC[(None, None, nt, mt, l)]
                    gC_epi = cute.zipped_divide(gC_t, self.epi_tile)
                    bSG_sC, bSG_gC = cpasync.tma_partition(
                        tma_atom_c, 0, cute.make_layout(1),
                        cute.group_modes(sC, 0, 2), gC_epi)
                    n_epi = self._epi_count(M_rows, mt)
                    for e in cutlass.range_constexpr(epi_num):
                        if e < n_epi:
                            for v in cutlass.range_constexpr(size_rD):
                                tRS_rD[v] = tRS_rAcc[e * size_rD + v]
                            ecrd = epi_order.get_hier_coord(e)
                            add_pipeline.consumer_wait(add_cons_state)
                            sAdd_e = tRS_sAdd[(None, None, None, add_cons_state.index)]
                            for v in cutlass.range_constexpr(size_rD):
                                tRS_rD[v] = tRS_rD[v] + sAdd_e[v]
                            tRS_rOut.store(tRS_rD.load().to(self.c_dtype))
                            buf = (epi_cnt + e) % self.epi_stages
                            cute.copy(tiled_copy_r2s, tRS_rOut, tRS_sC[(None, None, None, buf)])
                            cute.arch.fence_proxy("async.shared", space="cta")
                            if warp_idx == self.epi_store_warp_id:
                                cute.arch.cp_async_bulk_wait_group(self.epi_stages - 2, read=True)
                            epi_bar.arrive_and_wait()
                            if warp_idx == self.epi_store_warp_id:
                                add_pipeline.consumer_release(add_cons_state)
                                cute.copy(tma_atom_c, bSG_sC[(None, buf)], bSG_gC[(None, ecrd)])
                                cute.arch.cp_async_bulk_commit_group()
                            add_cons_state.advance()
                    epi_cnt = epi_cnt + n_epi
                w = w + n_clusters

            if warp_idx == self.epi_store_warp_id:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

        # the last CTA to finish hands the next launch its generation
        cute.arch.sync_threads()
        if tidx == 0:
            done = cute.arch.atomic_add(sync.iterator + 1, Int32(1), sem="acq_rel",
                                        scope="gpu")
            if done == cute.arch.grid_dim()[0] - 1:
                cute.arch.store(sync.iterator + 1, Int32(0), sem="relaxed", scope="gpu")
                cute.arch.store(sync.iterator, target, sem="release", scope="gpu")
