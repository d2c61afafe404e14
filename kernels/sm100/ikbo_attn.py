"""sm_100a / sm_103a IKBO candidate-over-user attention (see kernels/CONTRACT_ATTN.md).

One CTA per (work chunk j, head h): query rows [r0, r1) of user u = work[j, 0] attend to
k[u, :kv_len[u], h], v[u, :kv_len[u], h] (non-causal flash attention, fp32 softmax).

Structure (warp specialized, 6 warps, one simple pipeline):
  - warp 5: TMA producer. Q tile (128 rows from r0, once; rows past R zero-filled, rows past
    r1 computed but never stored), then (K, V) tile pairs through a `kv_stages` smem ring.
  - warp 4: MMA issuer (tcgen05, cta_group 1). S_t = Q K_t^T into one of two TMEM S buffers,
    then (once softmax has produced P_{t-1} in TMEM) O += P_{t-1} V_{t-1} with P read from
    TMEM (A operand) and V from smem. S_{t+1} is issued before waiting for P_t, so the
    tensor core computes the next scores while the softmax warps work.
  - warps 0-3 (128 threads, thread i owns TMEM lane = query row i): load S (tcgen05.ld),
    mask keys >= kv_len, online softmax (scale folded into exp2), rescale O in TMEM once the
    previous P V has finished, write P (16-bit, packed two per TMEM column) and signal the
    MMA warp. Epilogue: O / l from TMEM, lse = m * scale + ln(l), predicated stores of
    rows < r1. kv_len == 0: out = 0, lse = -inf, no MMA/TMA at all.

TMEM columns (512 allocated): S0 [0, bn), S1 [bn, 2 bn), O [2 bn, 2 bn + D),
P [2 bn + D, 2 bn + D + bn / 2).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

# UTCHMMA: tcgen05.mma kind::f16; UTCBAR: tcgen05.commit -> mbarrier; LDTM: tcgen05.ld;
# UTMALDG: TMA load. A warp-level HMMA/HGMMA would mean the tcgen05 path was not taken.
SASS_REQUIRED = ("UTCHMMA", "UTCBAR", "LDTM", "UTMALDG")
SASS_FORBIDDEN = ("HMMA", "HGMMA")  # exact mnemonics

_SMEM_CAPACITY = 232448  # (228 - 1) KiB per-CTA opt-in maximum on sm_100 / sm_103
_SMEM_RESERVED = 4 * 1024  # mbarriers, TMEM address slot, 1 KiB alignment of the buffers
_TMEM_COLS = 512
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


@dataclass(frozen=True)
class IkboAttnSm100Config:
    """block_m: query rows per work chunk (the host builds the work list with it); 128 =
        the UMMA M of one CTA (one TMEM lane per softmax thread).
    block_n: keys per K/V tile (= UMMA N of S = Q K^T, K of O = P V).
    kv_stages: depth of the (K, V) shared-memory ring (>= 2: K_{t+1} is loaded while
        V_t is still needed).
    zero_v_tail: zero the V rows past kv_len of the last (partial) tile in shared memory
        before P V, so NaN/Inf garbage in the padding of v cannot leak (0 * NaN = NaN)."""

    block_m: int = 128
    block_n: int = 128
    kv_stages: int = 2
    zero_v_tail: bool = True


def _smem_bytes(head_dim: int, cfg: IkboAttnSm100Config) -> int:
    q = cfg.block_m * head_dim * 2
    kv = 2 * cfg.block_n * head_dim * 2 * cfg.kv_stages
    return q + kv + _SMEM_RESERVED


class IkboAttnSm100:
    def __init__(self, dtype, head_dim: int,
                 config: IkboAttnSm100Config = IkboAttnSm100Config()):
        if not IkboAttnSm100.can_implement(dtype, head_dim, config):
            raise ValueError(f"IkboAttnSm100 cannot run {dtype}/D={head_dim} with {config}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.cfg = config
        self.bm = config.block_m
        self.bn = config.block_n
        self.kv_stages = config.kv_stages
        self.acc_dtype = cutlass.Float32
        # warps 0-3 must be the TMEM readers: warp w may only touch lanes 32 (w % 4) + [0, 32)
        self.softmax_warp_ids = (0, 1, 2, 3)
        self.mma_warp_id = 4
        self.tma_warp_id = 5
        self.threads_per_cta = 32 * 6
        self.num_softmax_threads = 32 * len(self.softmax_warp_ids)
        self.tmem_alloc_bar_id = 1
        self.softmax_bar_id = 2
        self.s_stages = 2
        self.tmem_s_offset = 0  # + stage * bn
        self.tmem_o_offset = 2 * self.bn
        self.tmem_p_offset = 2 * self.bn + head_dim
        self.o_chunk = 32  # O columns per tcgen05.ld/st in the rescale and the epilogue
        self.buffer_align_bytes = 1024

    @staticmethod
    def can_implement(dtype, head_dim, config: IkboAttnSm100Config) -> bool:
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            return False
        if head_dim not in (64, 128):
            return False
        if config.block_m != 128:
            return False
        if config.block_n not in (64, 128):
            return False
        if config.kv_stages < 2:
            return False
        if 2 * config.block_n + head_dim + config.block_n // 2 > _TMEM_COLS:
            return False
        return _smem_bytes(head_dim, config) <= _SMEM_CAPACITY

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, kv_len: cute.Tensor,
                 work: cute.Tensor, scale: cute.Tensor, out: cute.Tensor, lse: cute.Tensor,
                 num_ctas: cutlass.Int32, stream: cuda.CUstream):
        # num_ctas (persistent grid size of the sm90 design) is unused: grid (W, H)
        D = self.head_dim
        bm = self.bm
        bn = self.bn
        R = q.shape[0]
        H = q.shape[1]
        S = k.shape[1]
        U = k.shape[0]
        W = work.shape[0]

        # Q as (R, D, H): K-major A of S = Q K^T (GEMM convention (M, K, L))
        mQ = cute.make_tensor(
            q.iterator, cute.make_layout((R, D, H), stride=(q.stride[0], 1, q.stride[1])))
        # K as (S, D, (H, U)): K-major B of S = Q K^T ((N, K, L))
        mK = cute.make_tensor(
            k.iterator, cute.make_layout((S, D, (H, U)),
                                         stride=(k.stride[1], 1, (k.stride[2], k.stride[0]))))
        # V as (D, S, (H, U)): B of O = P V with N = D contiguous (MN-major)
        mV = cute.make_tensor(
            v.iterator, cute.make_layout((D, S, (H, U)),
                                         stride=(1, v.stride[1], (v.stride[2], v.stride[0]))))

        cta_group = tcgen05.CtaGroup.ONE
        qk_mma = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K,
            self.acc_dtype, cta_group, (bm, bn))
        # P comes from TMEM (K-major A operand), V from smem
        pv_mma = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN,
            self.acc_dtype, cta_group, (bm, D), tcgen05.OperandSource.TMEM)
        self.qk_tiler = (bm, bn, D)
        self.pv_tiler = (bm, D, bn)
        cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (qk_mma.thr_id.shape,))

        q_sl = sm100_utils.make_smem_layout_a(qk_mma, self.qk_tiler, self.dtype, 1)
        k_sl = sm100_utils.make_smem_layout_b(qk_mma, self.qk_tiler, self.dtype, self.kv_stages)
        v_sl = sm100_utils.make_smem_layout_b(pv_mma, self.pv_tiler, self.dtype, self.kv_stages)
        p_tl = sm100_utils.make_smem_layout_a(pv_mma, self.pv_tiler, self.dtype, 1)

        tma_op = cpasync.CopyBulkTensorTileG2SOp(cta_group)
        q_one = cute.select(q_sl, mode=[0, 1, 2])
        k_one = cute.select(k_sl, mode=[0, 1, 2])
        v_one = cute.select(v_sl, mode=[0, 1, 2])
        tma_atom_q, tma_q = cute.nvgpu.make_tiled_tma_atom_A(
            tma_op, mQ, q_one, self.qk_tiler, qk_mma, cluster_vmnk.shape)
        tma_atom_k, tma_k = cute.nvgpu.make_tiled_tma_atom_B(
            tma_op, mK, k_one, self.qk_tiler, qk_mma, cluster_vmnk.shape)
        tma_atom_v, tma_v = cute.nvgpu.make_tiled_tma_atom_B(
            tma_op, mV, v_one, self.pv_tiler, pv_mma, cluster_vmnk.shape)
        self.q_bytes = cute.size_in_bytes(self.dtype, q_one)
        self.kv_bytes = (cute.size_in_bytes(self.dtype, k_one)
                         + cute.size_in_bytes(self.dtype, v_one))

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, self.kv_stages * 2]
            s_mbar: cute.struct.MemRange[cutlass.Int64, self.s_stages * 2]
            p_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_holding_buf: cutlass.Int32
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(q_sl)], self.buffer_align_bytes]
            sK: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(k_sl)], self.buffer_align_bytes]
            sV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(v_sl)], self.buffer_align_bytes]

        self.shared_storage = SharedStorage
        assert SharedStorage.size_in_bytes() <= _SMEM_CAPACITY

        self.kernel(
            qk_mma, pv_mma, tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v,
            kv_len, work, scale, out, lse, q_sl, k_sl, v_sl, p_tl,
        ).launch(
            grid=[W, H, 1],
            block=[self.threads_per_cta, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_atom_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_v: cute.CopyAtom,
        mV: cute.Tensor,
        kv_len: cute.Tensor,
        work: cute.Tensor,
        scale: cute.Tensor,
        out: cute.Tensor,
        lse: cute.Tensor,
        q_sl: cute.ComposedLayout,
        k_sl: cute.ComposedLayout,
        v_sl: cute.ComposedLayout,
        p_tl: cute.ComposedLayout,
    ):
        D = self.head_dim
        bm = self.bm
        bn = self.bn
        tidx, _, _ = cute.arch.thread_idx()
        j, h, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        u = work[(j, 0)]
        # the whole CTA leaves together before any barrier or TMEM is set up
        if u >= 0:
            r0 = work[(j, 1)]
            r1 = work[(j, 2)]
            kvl = kv_len[u]
            n_tiles = (kvl + (bn - 1)) // bn

            if warp_idx == self.tma_warp_id:
                cpasync.prefetch_descriptor(tma_atom_q)
                cpasync.prefetch_descriptor(tma_atom_k)
                cpasync.prefetch_descriptor(tma_atom_v)

            smem = SmemAllocator()
            storage = smem.allocate(self.shared_storage)

            # Q / KV: full = TMA tx bytes, empty = tcgen05.commit of the MMA warp
            q_pipe = pipeline.PipelineTmaUmma.create(
                barrier_storage=storage.q_mbar.data_ptr(),
                num_stages=1,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                tx_count=self.q_bytes,
                defer_sync=True,
            )
            kv_pipe = pipeline.PipelineTmaUmma.create(
                barrier_storage=storage.kv_mbar.data_ptr(),
                num_stages=self.kv_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                tx_count=self.kv_bytes,
                defer_sync=True,
            )
            # S buffers: full = tcgen05.commit, empty = every softmax thread after its ld
            s_pipe = pipeline.PipelineUmmaAsync.create(
                barrier_storage=storage.s_mbar.data_ptr(),
                num_stages=self.s_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, self.num_softmax_threads),
                defer_sync=True,
            )
            # P (and O ownership): full = every softmax thread after its tcgen05.st of P and
            # of the rescaled O; empty = tcgen05.commit after O += P V (P read, O written)
            p_pipe = pipeline.PipelineAsyncUmma.create(
                barrier_storage=storage.p_mbar.data_ptr(),
                num_stages=1,
                producer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, self.num_softmax_threads),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                defer_sync=True,
            )
            tmem_alloc_bar = pipeline.NamedBarrier(
                barrier_id=self.tmem_alloc_bar_id,
                num_threads=32 * (len(self.softmax_warp_ids) + 1))
            softmax_bar = pipeline.NamedBarrier(
                barrier_id=self.softmax_bar_id, num_threads=self.num_softmax_threads)
            tmem = TmemAllocator(
                storage.tmem_holding_buf.ptr,
                barrier_for_retrieve=tmem_alloc_bar,
                allocator_warp_id=self.softmax_warp_ids[0],
            )
            # no cluster: mbarrier-init fence here, CTA barrier in pipeline_init_wait
            pipeline_init_arrive(cluster_shape_mn=None, is_relaxed=True)

            sQ = storage.sQ.get_tensor(q_sl.outer, swizzle=q_sl.inner)  # (MMA, M, K, 1)
            sK = storage.sK.get_tensor(k_sl.outer, swizzle=k_sl.inner)  # (MMA, N, K, ST)
            sV = storage.sV.get_tensor(v_sl.outer, swizzle=v_sl.inner)  # (MMA, N, K, ST)

            qk_thr = qk_mma.get_slice(0)
            pv_thr = pv_mma.get_slice(0)

            # TMEM accumulator / P views (tmem_ptr filled in per role below)
            s_acc_shape = qk_thr.partition_shape_C((bm, bn))
            o_acc_shape = pv_thr.partition_shape_C((bm, D))

            pipeline_init_wait(cluster_shape_mn=None)

            # ============================================================ TMA warp
            if warp_idx == self.tma_warp_id:
                if n_tiles > 0:
                    # Q rows r0 + [0, 128): TMA box coordinates are element offsets
                    gQ = cute.local_tile(
                        cute.domain_offset((r0, 0, 0), mQ), (bm, D), (0, 0, h))  # (bm, D)
                    tCgQ = qk_thr.partition_A(gQ)
                    tQsQ, tQgQ = cpasync.tma_partition(
                        tma_atom_q, 0, cute.make_layout(1),
                        cute.group_modes(sQ, 0, 3), cute.group_modes(tCgQ, 0, 3))
                    gK = cute.local_tile(mK, (bn, D), (None, 0, (h, u)))  # (bn, D, nK)
                    tCgK = qk_thr.partition_B(gK)
                    tKsK, tKgK = cpasync.tma_partition(
                        tma_atom_k, 0, cute.make_layout(1),
                        cute.group_modes(sK, 0, 3), cute.group_modes(tCgK, 0, 3))
                    gV = cute.local_tile(mV, (D, bn), (0, None, (h, u)))  # (D, bn, nK)
                    tCgV = pv_thr.partition_B(gV)
                    tVsV, tVgV = cpasync.tma_partition(
                        tma_atom_v, 0, cute.make_layout(1),
                        cute.group_modes(sV, 0, 3), cute.group_modes(tCgV, 0, 3))

                    q_state = pipeline.make_pipeline_state(
                        pipeline.PipelineUserType.Producer, 1)
                    q_pipe.producer_acquire(q_state)
                    cute.copy(tma_atom_q, tQgQ, tQsQ[(None, 0)],
                              tma_bar_ptr=q_pipe.producer_get_barrier(q_state))

                    kv_state = pipeline.make_pipeline_state(
                        pipeline.PipelineUserType.Producer, self.kv_stages)
                    for t in cutlass.range(n_tiles, unroll=1):
                        kv_pipe.producer_acquire(kv_state)
                        bar = kv_pipe.producer_get_barrier(kv_state)
                        cute.copy(tma_atom_k, tKgK[(None, t)], tKsK[(None, kv_state.index)],
                                  tma_bar_ptr=bar)
                        cute.copy(tma_atom_v, tVgV[(None, t)], tVsV[(None, kv_state.index)],
                                  tma_bar_ptr=bar)
                        kv_state.advance()
                    # do not exit while the MMA may still arrive on our empty barriers
                    kv_pipe.producer_tail(kv_state)

            # ============================================================ MMA warp
            if warp_idx == self.mma_warp_id:
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
                if n_tiles > 0:
                    tStS = cute.make_tensor(
                        tmem_ptr + self.tmem_s_offset, qk_thr.make_fragment_C(s_acc_shape).layout)
                    tOtO = cute.make_tensor(
                        tmem_ptr + self.tmem_o_offset, pv_thr.make_fragment_C(o_acc_shape).layout)
                    # P: the A operand of P V read from TMEM, 2 x 16-bit per 32-bit column
                    tP = cute.make_tensor(tStS.iterator, p_tl.outer)
                    tOrP_fake = pv_thr.make_fragment_A(tP)[(None, None, None, 0)]
                    tOrP = cute.make_tensor(
                        cute.recast_ptr(tmem_ptr + self.tmem_p_offset, dtype=self.dtype),
                        tOrP_fake.layout)
                    tSrQ = qk_mma.make_fragment_A(sQ)  # (MMA, 1, D/16, 1)
                    tSrK = qk_mma.make_fragment_B(sK)  # (MMA, 1, D/16, ST)
                    tOrV = pv_mma.make_fragment_B(sV)  # (MMA, 1, bn/16, ST)
                    n_qk_kb = cute.size(tSrQ, mode=[2])
                    n_pv_kb = cute.size(tOrP, mode=[2])

                    q_state = pipeline.make_pipeline_state(
                        pipeline.PipelineUserType.Consumer, 1)
                    kv_wait = pipeline.make_pipeline_state(
                        pipeline.PipelineUserType.Consumer, self.kv_stages)
                    kv_rel = pipeline.make_pipeline_state(
                        pipeline.PipelineUserType.Consumer, self.kv_stages)
                    s_state = pipeline.make_pipeline_state(
                        pipeline.PipelineUserType.Producer, self.s_stages)
                    p_state = pipeline.make_pipeline_state(
                        pipeline.PipelineUserType.Consumer, 1)

                    q_pipe.consumer_wait(q_state)
                    # S_0 first; then step t issues S_t before O += P_{t-1} V_{t-1}, so the
                    # tensor core computes the next scores while softmax works on S_{t-1}
                    kv_pipe.consumer_wait(kv_wait)
                    s_pipe.producer_acquire(s_state)
                    tStS_i = cute.make_tensor(tStS.iterator + s_state.index * bn, tStS.layout)
                    for kb in cutlass.range_constexpr(n_qk_kb):
                        qk_mma.set(tcgen05.Field.ACCUMULATE, kb != 0)
                        cute.gemm(qk_mma, tStS_i, tSrQ[(None, None, kb, 0)],
                                  tSrK[(None, None, kb, kv_wait.index)], tStS_i)
                    s_pipe.producer_commit(s_state)
                    s_state.advance()
                    kv_wait.advance()
                    for t in cutlass.range(1, n_tiles, unroll=1):
                        # ---- S_t = Q K_t^T into S buffer t % 2
                        kv_pipe.consumer_wait(kv_wait)
                        s_pipe.producer_acquire(s_state)
                        tStS_i = cute.make_tensor(tStS.iterator + s_state.index * bn,
                                                  tStS.layout)
                        for kb in cutlass.range_constexpr(n_qk_kb):
                            qk_mma.set(tcgen05.Field.ACCUMULATE, kb != 0)
                            cute.gemm(qk_mma, tStS_i, tSrQ[(None, None, kb, 0)],
                                      tSrK[(None, None, kb, kv_wait.index)], tStS_i)
                        s_pipe.producer_commit(s_state)
                        s_state.advance()
                        kv_wait.advance()
                        # ---- O += P_{t-1} V_{t-1}; O is overwritten by the first one
                        p_pipe.consumer_wait(p_state)
                        pv_mma.set(tcgen05.Field.ACCUMULATE, t > 1)
                        for kb in cutlass.range_constexpr(n_pv_kb):
                            cute.gemm(pv_mma, tOtO, tOrP[(None, None, kb)],
                                      tOrV[(None, None, kb, kv_rel.index)], tOtO)
                            pv_mma.set(tcgen05.Field.ACCUMULATE, True)
                        # tcgen05.commit: P buffer free / O final once these MMAs complete
                        p_pipe.consumer_release(p_state)
                        p_state.advance()
                        # tcgen05.commit: K/V slot free once P V has read it
                        kv_pipe.consumer_release(kv_rel)
                        kv_rel.advance()
                    # ---- last O += P V
                    p_pipe.consumer_wait(p_state)
                    pv_mma.set(tcgen05.Field.ACCUMULATE, n_tiles > 1)
                    for kb in cutlass.range_constexpr(n_pv_kb):
                        cute.gemm(pv_mma, tOtO, tOrP[(None, None, kb)],
                                  tOrV[(None, None, kb, kv_rel.index)], tOtO)
                        pv_mma.set(tcgen05.Field.ACCUMULATE, True)
                    p_pipe.consumer_release(p_state)
                    p_state.advance()
                    kv_pipe.consumer_release(kv_rel)
                    kv_rel.advance()
                    s_pipe.producer_tail(s_state)

            # ======================================================== softmax warps
            if warp_idx < self.mma_warp_id:
                tmem.allocate(_TMEM_COLS)
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
                tStS = cute.make_tensor(
                    tmem_ptr + self.tmem_s_offset, qk_thr.make_fragment_C(s_acc_shape).layout)
                tOtO = cute.make_tensor(
                    tmem_ptr + self.tmem_o_offset, pv_thr.make_fragment_C(o_acc_shape).layout)
                tid = tidx  # 0..127 = TMEM lane = query row in the chunk

                # S: tcgen05.ld 32x32b, thread i gets row i, all bn columns
                ld_s_atom = cute.make_copy_atom(
                    tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), self.acc_dtype)
                tiled_ld_s = tcgen05.make_tmem_copy(ld_s_atom, tStS)
                thr_ld_s = tiled_ld_s.get_slice(tid)
                tScS = qk_thr.partition_C(cute.make_identity_tensor((bm, bn)))
                tLcS = thr_ld_s.partition_D(tScS)
                tLrS = cute.make_rmem_tensor(tLcS.shape, self.acc_dtype)

                # P: bn 16-bit values per row packed into bn / 2 fp32 TMEM columns
                p_cols = bn // 2
                tStP = cute.make_tensor(tStS.iterator + self.tmem_p_offset,
                                        cute.composition(tStS.layout,
                                                         cute.make_layout((bm, p_cols))))
                tScP = cute.make_tensor(tScS.iterator,
                                        cute.composition(tScS.layout,
                                                         cute.make_layout((bm, p_cols))))
                st_p_atom = cute.make_copy_atom(
                    tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(32)), self.acc_dtype)
                tiled_st_p = tcgen05.make_tmem_copy(st_p_atom, tStP)
                thr_st_p = tiled_st_p.get_slice(tid)
                tSPtP = thr_st_p.partition_D(tStP)
                tSPrP = cute.make_rmem_tensor(thr_st_p.partition_S(tScP).shape, self.acc_dtype)
                # the same registers as 16-bit P, in the element order of tLrS
                tSPrP_e = cute.make_tensor(
                    cute.recast_ptr(tSPrP.iterator, dtype=self.dtype), tLrS.layout)

                # O in chunks of o_chunk columns (tcgen05.ld / st 32x32b)
                oc = self.o_chunk
                tOtO_c = cute.make_tensor(
                    tOtO.iterator, cute.composition(tOtO.layout, cute.make_layout((bm, oc))))
                tOcO = pv_thr.partition_C(cute.make_identity_tensor((bm, D)))
                tOcO_c = cute.make_tensor(
                    tOcO.iterator, cute.composition(tOcO.layout, cute.make_layout((bm, oc))))
                ld_o_atom = cute.make_copy_atom(
                    tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(oc)), self.acc_dtype)
                st_o_atom = cute.make_copy_atom(
                    tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(oc)), self.acc_dtype)
                tiled_ld_o = tcgen05.make_tmem_copy(ld_o_atom, tOtO_c)
                tiled_st_o = tcgen05.make_tmem_copy(st_o_atom, tOtO_c)
                thr_ld_o = tiled_ld_o.get_slice(tid)
                thr_st_o = tiled_st_o.get_slice(tid)
                tLcO = thr_ld_o.partition_D(tOcO_c)
                tLrO = cute.make_rmem_tensor(tLcO.shape, self.acc_dtype)
                n_o_chunks = D // oc

                scale_f = scale[0]
                scale_log2 = scale_f * _LOG2E
                row_max = -cutlass.Float32.inf
                row_sum = cutlass.Float32(0.0)

                s_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Consumer, self.s_stages)
                p_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)

                for t in cutlass.range(n_tiles, unroll=1):
                    # ---- S_t from TMEM
                    s_pipe.consumer_wait(s_state)
                    tStS_i = cute.make_tensor(tStS.iterator + s_state.index * bn, tStS.layout)
                    cute.copy(tiled_ld_s, thr_ld_s.partition_S(tStS_i), tLrS)
                    # ld complete before the MMA may overwrite the buffer with S_{t+2}
                    cute.arch.fence_view_async_tmem_load()
                    s_pipe.consumer_release(s_state)
                    s_state.advance()

                    # ---- mask keys >= kv_len (only the last tile can hold any)
                    valid = kvl - t * bn
                    if valid < bn:
                        for e in cutlass.range_constexpr(cute.size(tLrS)):
                            if tLcS[e][1] >= valid:
                                tLrS[e] = -cutlass.Float32.inf

                    # ---- online softmax of row tid (scores raw; scale folded into exp2)
                    m_old = row_max
                    m_new = m_old
                    for e in cutlass.range_constexpr(cute.size(tLrS)):
                        m_new = cute.arch.fmax(m_new, tLrS[e])
                    m_use = m_new
                    if m_new == -cutlass.Float32.inf:
                        m_use = 0.0  # fully masked row so far: keep exp2 finite
                    corr = cute.math.exp2((m_old - m_use) * scale_log2, fastmath=True)
                    row_max = m_new
                    neg = m_use * scale_log2
                    s_part = cutlass.Float32(0.0)
                    for e in cutlass.range_constexpr(cute.size(tLrS)):
                        p = cute.math.exp2(tLrS[e] * scale_log2 - neg, fastmath=True)
                        tLrS[e] = p
                        s_part = s_part + p
                    row_sum = row_sum * corr + s_part
                    tSPrP_e.store(tLrS.load().to(self.dtype))

                    # ---- wait until O += P_{t-1} V_{t-1} is done: P buffer free, O final
                    p_pipe.producer_acquire(p_state)
                    if t > 0:
                        for c in cutlass.range_constexpr(n_o_chunks):
                            tO_c = cute.make_tensor(tOtO_c.iterator + c * oc, tOtO_c.layout)
                            cute.copy(tiled_ld_o, thr_ld_o.partition_S(tO_c), tLrO)
                            for e in cutlass.range_constexpr(cute.size(tLrO)):
                                tLrO[e] = tLrO[e] * corr
                            cute.copy(tiled_st_o, tLrO, thr_st_o.partition_D(tO_c))

                    # ---- zero V rows past kv_len of a partial tile (padding may be NaN);
                    # the tile's TMA has landed: S_t (same barrier phase) was computed
                    if cutlass.const_expr(self.cfg.zero_v_tail):
                        if valid < bn:
                            stage = t % self.kv_stages
                            n_zero = (bn - valid) * D
                            for zi in cutlass.range(tid, n_zero, self.num_softmax_threads,
                                                    unroll=1):
                                key = valid + zi // D
                                sV[((zi % D, key % 16), 0, key // 16, stage)] = \
                                    self.dtype(0.0)
                            # generic-proxy writes -> visible to tcgen05.mma (async proxy)
                            cute.arch.fence_proxy("async.shared", space="cta")

                    cute.copy(tiled_st_p, tSPrP, tSPtP)
                    # P and rescaled O stores complete before the MMA warp reads them
                    cute.arch.fence_view_async_tmem_store()
                    p_pipe.producer_commit(p_state)
                    p_state.advance()

                # ---- epilogue: O / l, lse; only rows < r1 (the rest belong to others)
                nrows = r1 - r0
                inv = cutlass.Float32(0.0)
                lse_v = -cutlass.Float32.inf
                if row_sum > 0.0:
                    inv = 1.0 / row_sum
                    lse_v = row_max * scale_f + cute.math.log2(row_sum, fastmath=False) * _LN2
                if n_tiles > 0:
                    # last O += P V has completed
                    p_pipe.producer_acquire(p_state)
                grow = r0 + tid
                if tid < nrows:
                    lse[(grow, h)] = lse_v
                # tcgen05.ld is .sync.aligned: all 32 lanes of a warp must execute it, so the
                # TMEM loads stay outside the (warp-divergent) tid < nrows guard; only the
                # global stores are predicated
                tLrOut = cute.make_rmem_tensor(tLcO.shape, self.dtype)
                for c in cutlass.range_constexpr(n_o_chunks):
                    if n_tiles > 0:
                        tO_c = cute.make_tensor(tOtO_c.iterator + c * oc, tOtO_c.layout)
                        cute.copy(tiled_ld_o, thr_ld_o.partition_S(tO_c), tLrO)
                    else:
                        tLrO.fill(0.0)  # kv_len == 0: TMEM O never written
                    tLrOut.store((tLrO.load() * inv).to(self.dtype))
                    if tid < nrows:
                        for e in cutlass.range_constexpr(cute.size(tLrO)):
                            out[(grow, h, c * oc + tLcO[e][1])] = tLrOut[e]

                # every softmax warp is done with TMEM before warp 0 frees it
                cute.arch.fence_view_async_tmem_load()
                tmem.relinquish_alloc_permit()
                softmax_bar.arrive_and_wait()
                tmem.free(tmem_ptr)
