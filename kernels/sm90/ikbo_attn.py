"""sm_90a IKBO candidate-over-user attention (see kernels/CONTRACT_ATTN.md).

Work item = (work chunk j, head h): query rows [r0, r1) of user u = work[j, 0] attend to
k[u, :kv_len[u], h], v[u, :kv_len[u], h] (non-causal flash attention, fp32 softmax).
Persistent: `num_ctas` CTAs (the host passes min(#items, SM count)) stride over the W * H
items, chunk fastest, so the CTAs running at any time share a few users' K/V in L2.

Structure (warp specialized, 3 warpgroups):
  - warpgroup 0, warp 0: TMA producer. Per item, loads the Q tile into one of `q_stages`
    Q slots (two 64-row boxes starting at row r0; rows past r1 belong to other chunks and
    are computed but never stored; rows past R are zero-filled by TMA), then streams (K tile,
    V tile) pairs of `block_n` keys through a `kv_stages`-deep shared-memory ring guarded by
    mbarriers. Both rings run on across items, so the next item's Q and first K/V tiles
    land while the consumers finish the current item and its epilogue.
  - warpgroups 1, 2: consumers, 64 query rows each. Per key tile t one WGMMA group holds
    O += P_{t-1} V_{t-1} (P from registers) and S_t = Q K_t^T (fp32), waited for once; then
    keys >= kv_len are masked to -inf, the online softmax runs in registers, O is rescaled
    and P_t converted to the input dtype (first S and last P V peeled). With `pingpong` the
    two warpgroups take turns issuing their groups (named barriers), so one's softmax runs
    under the other's GEMMs. V_{t-1} is held one tile longer than K_t: 3 K/V stages.
    (Measured on the H200: 640-660 TFLOP/s at S >= 4096 against 550-580 for one S and one
    P V group per tile with separate waits, which left the warpgroups in phase.)
  - epilogue: O / l and lse = m * scale + ln(l), predicated direct stores (rows < r1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.cute.nvgpu import cpasync

SASS_REQUIRED = ("HGMMA", "UTMALDG", "SYNCS")
SASS_FORBIDDEN = ("HMMA",)

_SMEM_CAPACITY = 227 * 1024  # sm_90 opt-in maximum per block
_SMEM_RESERVED = 2 * 1024  # mbarriers (< 100 B) + alignment (buffers are 1 KB multiples)
_WG_ROWS = 64  # WGMMA M per warpgroup
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


@dataclass(frozen=True)
class IkboAttnSm90Config:
    """block_m: query rows per work chunk (the host builds the work list with it); 64 per
        consumer warpgroup, so 128 = two consumer warpgroups (64 = one).
    block_n: keys per K/V tile (S accumulator = block_n / 2 fp32 registers per thread).
    kv_stages: depth of the (K, V) shared-memory ring (3: V_{t-1} is read in the same
        WGMMA group as K_t, so two stages are busy while the next one loads).
    q_stages: Q slots (2: the next item's Q loads during the current item; measured no
        faster than 1, whose refill waits for the last S GEMM of the current item).
    persistent: `num_ctas` CTAs stride over the items; False: one CTA per item, grid (W, H).
    pingpong: named barriers make the two consumer warpgroups take turns issuing their
        WGMMA groups, so one's softmax overlaps the other's GEMMs (block_m 128).
    zero_v_tail: zero the V rows past kv_len of the last (partial) tile in shared memory
        before P V, so NaN/Inf garbage in the padding of v cannot leak (0 * NaN = NaN)."""

    block_m: int = 128
    block_n: int = 128
    kv_stages: int = 3
    q_stages: int = 1
    persistent: bool = True
    pingpong: bool = True
    zero_v_tail: bool = True


def _smem_bytes(head_dim: int, cfg: IkboAttnSm90Config) -> int:
    q = cfg.block_m * head_dim * 2 * cfg.q_stages
    kv = 2 * cfg.block_n * head_dim * 2 * cfg.kv_stages
    return q + kv + _SMEM_RESERVED


class IkboAttnSm90:
    num_threads_per_wg = 128

    def __init__(self, dtype, head_dim: int, config: IkboAttnSm90Config = IkboAttnSm90Config()):
        if not IkboAttnSm90.can_implement(dtype, head_dim, config):
            raise ValueError(f"IkboAttnSm90 cannot run {dtype}/D={head_dim} with {config}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.cfg = config
        self.bm = config.block_m
        self.bn = config.block_n
        self.kv_stages = config.kv_stages
        self.num_mma_wg = config.block_m // _WG_ROWS
        self.threads_per_cta = (1 + self.num_mma_wg) * self.num_threads_per_wg
        self.num_mma_threads = self.num_mma_wg * self.num_threads_per_wg
        self.load_warp_id = 0
        # producer warpgroup gives registers to the consumers (128 x 24 + 256 x 240 <= 64K)
        self.load_regs = 24
        self.mma_regs = 240
        self.buffer_align_bytes = 1024

    @staticmethod
    def can_implement(dtype, head_dim, config: IkboAttnSm90Config) -> bool:
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            return False
        if head_dim not in (64, 128):
            return False
        if config.block_m not in (64, 128):
            return False
        if config.block_n not in (64, 128):
            return False
        if config.kv_stages < 2 or config.q_stages < 1:
            return False
        # registers per consumer thread: O (D/2) + S (bn/2) + P (bn/4) + ~60 for the rest
        if head_dim // 2 + config.block_n // 2 + config.block_n // 4 + 60 > 240:
            return False
        return _smem_bytes(head_dim, config) <= _SMEM_CAPACITY

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, kv_len: cute.Tensor,
                 work: cute.Tensor, scale: cute.Tensor, out: cute.Tensor, lse: cute.Tensor,
                 num_ctas: cutlass.Int32, stream: cuda.CUstream):
        D = self.head_dim
        bn = self.bn
        R = q.shape[0]
        H = q.shape[1]
        S = k.shape[1]
        U = k.shape[0]
        W = work.shape[0]

        # Q as (R, D, H): K-major A operand of S = Q K^T
        mQ = cute.make_tensor(
            q.iterator, cute.make_layout((R, D, H), stride=(q.stride[0], 1, q.stride[1])))
        # K as (S, D, H, U): K-major B operand of S = Q K^T
        mK = cute.make_tensor(
            k.iterator, cute.make_layout((S, D, H, U),
                                         stride=(k.stride[1], 1, k.stride[2], k.stride[0])))
        # V as (D, S, H, U): B operand of O = P V with N = D contiguous (MN-major)
        mV = cute.make_tensor(
            v.iterator, cute.make_layout((D, S, H, U),
                                         stride=(1, v.stride[1], v.stride[2], v.stride[0])))

        qk_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (_WG_ROWS, bn))
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN,
            cutlass.Float32, (1, 1, 1), (_WG_ROWS, D), warpgroup.OperandSource.RMEM)

        # one (64, D) box per consumer warpgroup per Q slot: box = slot * WG + warpgroup
        q_smem = sm90_utils.make_smem_layout_a(
            utils.LayoutEnum.ROW_MAJOR, (_WG_ROWS, bn, D), self.dtype,
            self.num_mma_wg * self.cfg.q_stages)
        k_smem = sm90_utils.make_smem_layout_b(
            utils.LayoutEnum.ROW_MAJOR, (_WG_ROWS, bn, D), self.dtype, self.kv_stages)
        v_smem = sm90_utils.make_smem_layout_b(
            utils.LayoutEnum.COL_MAJOR, (_WG_ROWS, D, bn), self.dtype, self.kv_stages)

        q_one = cute.slice_(q_smem, (None, None, 0))
        k_one = cute.slice_(k_smem, (None, None, 0))
        v_one = cute.slice_(v_smem, (None, None, 0))
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ, q_one, (_WG_ROWS, D))
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, k_one, (bn, D))
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mV, v_one, (D, bn))

        q_bytes = cute.size_in_bytes(self.dtype, q_one) * self.num_mma_wg
        kv_bytes = cute.size_in_bytes(self.dtype, k_one) + cute.size_in_bytes(self.dtype, v_one)

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[cutlass.Int64, self.cfg.q_stages * 2]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, self.kv_stages * 2]
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(q_smem)], self.buffer_align_bytes]
            sK: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(k_smem)], self.buffer_align_bytes]
            sV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(v_smem)], self.buffer_align_bytes]

        self.shared_storage = SharedStorage

        self.kernel(
            qk_mma, pv_mma, tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v,
            kv_len, work, scale, out, lse, q_smem, k_smem, v_smem, q_bytes, kv_bytes,
        ).launch(
            grid=[num_ctas, 1, 1] if cutlass.const_expr(self.cfg.persistent) else [W, H, 1],
            block=[self.threads_per_cta, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---------------------------------------------------------------- device side
    @cute.jit
    def _softmax_tile(self, acc_s: cute.Tensor, acc_o: cute.Tensor, tScS: cute.Tensor,
                      valid: cutlass.Int32, row_max: cute.Tensor, row_sum: cute.Tensor,
                      scale_log2: cutlass.Float32):
        """Mask keys >= valid, online softmax of acc_s in place (acc_s := unnormalized p),
        row statistics updated, O rows rescaled."""
        n_s_blk = self.bn // 8
        n_o_blk = self.head_dim // 8
        if valid < self.bn:
            # a select per element (an `if` per element here made the compiler carry the
            # whole fragment through every branch: ~1000 FSEL per masked tile)
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[e] = cutlass.Float32(cutlass.select_(
                    tScS[e][1] >= valid, -cutlass.Float32.inf, acc_s[e]))
        # row i of this thread: elements c + 2 i + 4 b. Max and sum run as 4 independent
        # chains (a 32-long dependency chain per row otherwise sits on the critical path
        # between this warpgroup's S and its next GEMM group).
        rows = [[c + 2 * i + 4 * b for b in range(n_s_blk) for c in range(2)] for i in range(2)]
        m_news = []
        for i in cutlass.range_constexpr(2):
            els = rows[i]
            part = [acc_s[els[0]], acc_s[els[1]], acc_s[els[2]], acc_s[els[3]]]
            for n in cutlass.range_constexpr(4, len(els)):
                part[n % 4] = cute.arch.fmax(part[n % 4], acc_s[els[n]])
            m_new = cute.arch.fmax(cute.arch.fmax(part[0], part[1]),
                                   cute.arch.fmax(part[2], part[3]))
            m_news.append(cute.arch.fmax(m_new, row_max[i]))
        for i in cutlass.range_constexpr(2):
            m_news[i] = cute.arch.warp_reduction_max(m_news[i], threads_in_group=4)
        corrs = []
        for i in cutlass.range_constexpr(2):
            els = rows[i]
            m_old = row_max[i]
            m_new = m_news[i]
            m_use = m_new
            if m_new == -cutlass.Float32.inf:
                m_use = 0.0  # fully masked row so far: keep exp2 finite
            corrs.append(cute.math.exp2((m_old - m_use) * scale_log2, fastmath=True))
            row_max[i] = m_new
            neg = m_use * scale_log2
            s_part = [cutlass.Float32(0.0)] * 4
            for n in cutlass.range_constexpr(len(els)):
                p = cute.math.exp2(acc_s[els[n]] * scale_log2 - neg, fastmath=True)
                acc_s[els[n]] = p
                s_part[n % 4] = s_part[n % 4] + p
            row_sum[i] = row_sum[i] * corrs[i] + ((s_part[0] + s_part[1]) + (s_part[2] + s_part[3]))
        for i in cutlass.range_constexpr(2):
            for b in cutlass.range_constexpr(n_o_blk):
                for c in cutlass.range_constexpr(2):
                    e = c + 2 * i + 4 * b
                    acc_o[e] = acc_o[e] * corrs[i]

    # plain methods, inlined while tracing (no staged state leaves them)
    def _item(self, work: cute.Tensor, item):
        """(chunk j, head h, user u) of work item `item`, chunk fastest; u < 0: an unused
        entry. The producer and the consumers walk the same items through this."""
        j = item % work.shape[0]
        return j, item // work.shape[0], work[(j, 0)]

    def _store_p(self, tOrP: cute.Tensor, acc_s: cute.Tensor):
        """P in the input dtype into the A-operand registers (same element order as S)."""
        cute.make_tensor(tOrP.iterator, acc_s.layout).store(acc_s.load().to(self.dtype))

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
        q_smem: cute.ComposedLayout,
        k_smem: cute.ComposedLayout,
        v_smem: cute.ComposedLayout,
        q_bytes: cutlass.Constexpr,
        kv_bytes: cutlass.Constexpr,
    ):
        D = self.head_dim
        bn = self.bn
        nwg = self.num_mma_wg
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        W = work.shape[0]
        # items [first, n_items) with stride `step`: persistent CTAs, or just this CTA's item
        first, n_items, step = bx, W * out.shape[1], nctas
        if cutlass.const_expr(not self.cfg.persistent):
            first = bx + by * W
            n_items = first + 1
            step = 1

        if warp_idx == self.load_warp_id:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)
            cpasync.prefetch_descriptor(tma_atom_v)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # full barrier: 1 producer arrive + tx bytes; empty barrier: 1 arrive per consumer warp
        q_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.q_mbar.data_ptr(),
            num_stages=self.cfg.q_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, nwg * 4),
            tx_count=q_bytes,
            defer_sync=True,
        )
        kv_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.kv_mbar.data_ptr(),
            num_stages=self.kv_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, nwg * 4),
            tx_count=kv_bytes,
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)  # (64, D, QS * WG)
        sK = storage.sK.get_tensor(k_smem.outer, swizzle=k_smem.inner)  # (bn, D, ST)
        sV = storage.sV.get_tensor(v_smem.outer, swizzle=v_smem.inner)  # (D, bn, ST)

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        wg_idx = cute.arch.make_warp_uniform(tidx // self.num_threads_per_wg)
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.load_regs)

        # ------------------------------------------------------------ producer warp
        if warp_idx == self.load_warp_id:
            q_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, self.cfg.q_stages)
            kv_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, self.kv_stages)
            for item in range(first, n_items, step):
                j, h, u = self._item(work, item)
                if u >= 0:
                    r0 = work[(j, 1)]
                    n_tiles = (kv_len[u] + (bn - 1)) // bn
                    # Q rows r0 + [0, 64 * WG): TMA box coordinates are element offsets, so
                    # the chunk start needs no alignment
                    gQ = cute.local_tile(
                        cute.domain_offset((r0, 0), mQ[(None, None, h)]), (_WG_ROWS, D),
                        (None, 0))  # (64, D, nQ)
                    tQsQ, tQgQ = cpasync.tma_partition(
                        tma_atom_q, 0, cute.make_layout(1),
                        cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
                    gK = cute.local_tile(mK[(None, None, h, u)], (bn, D), (None, 0))
                    tKsK, tKgK = cpasync.tma_partition(
                        tma_atom_k, 0, cute.make_layout(1),
                        cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
                    gV = cute.local_tile(mV[(None, None, h, u)], (D, bn), (0, None))
                    tVsV, tVgV = cpasync.tma_partition(
                        tma_atom_v, 0, cute.make_layout(1),
                        cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))

                    q_pipe.producer_acquire(q_state)
                    q_bar = q_pipe.producer_get_barrier(q_state)
                    for w in cutlass.range_constexpr(nwg):
                        cute.copy(tma_atom_q, tQgQ[(None, w)],
                                  tQsQ[(None, q_state.index * nwg + w)], tma_bar_ptr=q_bar)
                    q_pipe.producer_commit(q_state)
                    q_state.advance()

                    for t in range(n_tiles):
                        kv_pipe.producer_acquire(kv_state)
                        bar = kv_pipe.producer_get_barrier(kv_state)
                        cute.copy(tma_atom_k, tKgK[(None, t)], tKsK[(None, kv_state.index)],
                                  tma_bar_ptr=bar)
                        cute.copy(tma_atom_v, tVgV[(None, t)], tVsV[(None, kv_state.index)],
                                  tma_bar_ptr=bar)
                        kv_pipe.producer_commit(kv_state)
                        kv_state.advance()
            # no TMA write into smem outlives this warp's view of the rings
            kv_pipe.producer_tail(kv_state)
            q_pipe.producer_tail(q_state)

        # ------------------------------------------------------- consumer warpgroups
        if wg_idx > 0:
            cute.arch.setmaxregister_increase(self.mma_regs)
            w = wg_idx - 1  # which 64-row half of the chunk
            tid_wg = tidx % self.num_threads_per_wg
            scale_f = scale[0]
            scale_log2 = scale_f * _LOG2E

            thr_qk = qk_mma.get_slice(tid_wg)
            thr_pv = pv_mma.get_slice(tid_wg)
            tSrQ = qk_mma.make_fragment_A(thr_qk.partition_A(sQ))  # (MMA,1,D/16,QS*WG)
            tSrK = qk_mma.make_fragment_B(thr_qk.partition_B(sK))  # (MMA,1,D/16,ST)
            tOrV = pv_mma.make_fragment_B(thr_pv.partition_B(sV))  # (MMA,1,bn/16,ST)
            num_qk_kb = cute.size(tSrQ, mode=[2])

            s_shape = thr_qk.partition_shape_C((_WG_ROWS, bn))
            acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((_WG_ROWS, D)))
            # coordinates (row, col) of every accumulator element
            tScS = thr_qk.partition_C(cute.make_identity_tensor((_WG_ROWS, bn)))
            tOcO = thr_pv.partition_C(cute.make_identity_tensor((_WG_ROWS, D)))

            # WGMMA C fragment order (PTX m64nNk16): element e = c0 + 2*hi + 4*blk is
            # (row base + 8*hi, col 8*blk + 2*(lane%4) + c0); each thread owns 2 rows
            # and shares them with the 3 other lanes of its quad.
            n_o_blk = D // 8
            row_max = cute.make_rmem_tensor((2,), cutlass.Float32)
            row_sum = cute.make_rmem_tensor((2,), cutlass.Float32)

            # P in the dtype, laid out as the register A operand of P V. For 16-bit
            # types the A fragment of k-block kb holds exactly the C elements of
            # columns [16 kb, 16 kb + 16) in the same order, so a view of it with the
            # C layout takes the converted S elementwise.
            a_val = pv_mma.tv_layout_A.shape[1]
            n_a = cute.size(a_val)
            p_layout = cute.make_layout(
                (a_val, 1, bn // 16),
                stride=(cute.make_layout(a_val).stride, 0, n_a))
            tOrP = cute.make_rmem_tensor(p_layout, self.dtype)

            # V rows past kv_len in the last tile: each warpgroup zeroes all of them itself
            # (16-byte stores, predicated per row) and waits only for its own threads; both
            # write the same zeros, so no cross-warpgroup barrier breaks the ping-pong
            zero_bar = pipeline.NamedBarrier(barrier_id=4 + w,
                                             num_threads=self.num_threads_per_wg)
            d_thr = D // 8  # threads along D, 8 elements (16 bytes) each
            zero_copy = cute.make_tiled_copy_tv(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                    num_bits_per_copy=128),
                cute.make_layout((d_thr, self.num_threads_per_wg // d_thr),
                                 stride=(1, d_thr)),
                cute.make_layout((8, 1)))
            thr_zero = zero_copy.get_slice(tid_wg)
            tZsV = thr_zero.partition_D(sV)  # (CPY, D / (8 d_thr), bn / rows, ST)
            tZcV = thr_zero.partition_D(cute.make_identity_tensor((D, bn)))
            zeros = cute.make_fragment_like(tZsV[(None, 0, 0, 0)])  # one 16-byte chunk
            zeros.fill(0.0)
            # ping-pong: warpgroup w issues a WGMMA group between turn_mine.arrive_and_wait()
            # and turn_other.arrive(); warpgroup 0 goes first
            turn_mine = pipeline.NamedBarrier(barrier_id=2 + w, num_threads=self.num_mma_threads)
            turn_other = pipeline.NamedBarrier(barrier_id=3 - w,
                                               num_threads=self.num_mma_threads)
            pp = cutlass.const_expr(self.cfg.pingpong and nwg == 2)
            if cutlass.const_expr(pp):
                if w == 1:
                    turn_other.arrive()
            rel_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.kv_stages)

            q_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.cfg.q_stages)
            kv_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.kv_stages)
            for item in range(first, n_items, step):
                j, h, u = self._item(work, item)
                if u >= 0:
                    r0 = work[(j, 1)]
                    r1 = work[(j, 2)]
                    kvl = kv_len[u]
                    n_tiles = (kvl + (bn - 1)) // bn
                    acc_o.fill(0.0)
                    for i in cutlass.range_constexpr(2):
                        row_max[i] = -cutlass.Float32.inf
                        row_sum[i] = 0.0

                    q_pipe.consumer_wait(q_state)
                    qs = q_state.index * nwg + w
                    # kv_state: next tile to wait for (K_t); rel_state: the tile whose
                    # V is still needed (V_{t-1}). First and last groups are peeled so
                    # every WGMMA group has a static shape.
                    if n_tiles > 0:
                        kv_pipe.consumer_wait(kv_state)
                        acc_s = thr_qk.make_fragment_C(s_shape)
                        if cutlass.const_expr(pp):
                            turn_mine.arrive_and_wait()
                        warpgroup.fence()
                        for kb in cutlass.range_constexpr(num_qk_kb):
                            qk_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                            cute.gemm(qk_mma, acc_s, tSrQ[(None, None, kb, qs)],
                                      tSrK[(None, None, kb, kv_state.index)], acc_s)
                        warpgroup.commit_group()
                        if cutlass.const_expr(pp):
                            turn_other.arrive()
                        warpgroup.wait_group(0)
                        kv_state.advance()
                        self._softmax_tile(acc_s, acc_o, tScS, kvl, row_max, row_sum,
                                           scale_log2)
                        self._store_p(tOrP, acc_s)
                        for t in range(1, n_tiles):
                            kv_pipe.consumer_wait(kv_state)
                            acc_s = thr_qk.make_fragment_C(s_shape)
                            if cutlass.const_expr(pp):
                                turn_mine.arrive_and_wait()
                            warpgroup.fence()
                            pv_mma.set(warpgroup.Field.ACCUMULATE, True)
                            cute.gemm(pv_mma, acc_o, tOrP,
                                      tOrV[(None, None, None, rel_state.index)], acc_o)
                            for kb in cutlass.range_constexpr(num_qk_kb):
                                qk_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                                cute.gemm(qk_mma, acc_s, tSrQ[(None, None, kb, qs)],
                                          tSrK[(None, None, kb, kv_state.index)], acc_s)
                            warpgroup.commit_group()
                            if cutlass.const_expr(pp):
                                turn_other.arrive()
                            warpgroup.wait_group(0)
                            kv_pipe.consumer_release(rel_state)
                            rel_state.advance()
                            kv_state.advance()
                            self._softmax_tile(acc_s, acc_o, tScS, kvl - t * bn, row_max,
                                               row_sum, scale_log2)
                            self._store_p(tOrP, acc_s)
                        # last P V; zero V rows past kv_len first (padding may be NaN)
                        if cutlass.const_expr(self.cfg.zero_v_tail):
                            valid = kvl - (n_tiles - 1) * bn
                            if valid < bn:
                                for zm in cutlass.range_constexpr(cute.size(tZsV, mode=[1])):
                                    for zn in cutlass.range_constexpr(
                                            cute.size(tZsV, mode=[2])):
                                        if tZcV[(0, zm, zn)][1] >= valid:
                                            cute.copy(zero_copy, zeros,
                                                      tZsV[(None, zm, zn, rel_state.index)])
                                cute.arch.fence_proxy("async.shared", space="cta")
                                zero_bar.arrive_and_wait()
                        if cutlass.const_expr(pp):
                            turn_mine.arrive_and_wait()
                        warpgroup.fence()
                        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
                        cute.gemm(pv_mma, acc_o, tOrP,
                                  tOrV[(None, None, None, rel_state.index)], acc_o)
                        warpgroup.commit_group()
                        if cutlass.const_expr(pp):
                            turn_other.arrive()
                        warpgroup.wait_group(0)
                        kv_pipe.consumer_release(rel_state)
                        rel_state.advance()
                    # every S GEMM of this item is done: the producer may refill the slot
                    q_pipe.consumer_release(q_state)
                    q_state.advance()

                    # ---- epilogue: O / l, lse; only rows < r1 (the rest belong to others)
                    nrows = r1 - r0
                    row_base = w * _WG_ROWS
                    for i in cutlass.range_constexpr(2):
                        l_tot = cute.arch.warp_reduction_sum(row_sum[i], threads_in_group=4)
                        inv = cutlass.Float32(0.0)
                        lse_v = -cutlass.Float32.inf
                        if l_tot > 0.0:
                            inv = 1.0 / l_tot
                            lse_v = row_max[i] * scale_f + cute.math.log2(l_tot) * _LN2
                        lrow = row_base + tOcO[2 * i][0]
                        if lrow < nrows:
                            grow = r0 + lrow
                            if tOcO[2 * i][1] == 0:  # one lane of the quad writes lse
                                lse[(grow, h)] = lse_v
                            for b in cutlass.range_constexpr(n_o_blk):
                                for c in cutlass.range_constexpr(2):
                                    e = c + 2 * i + 4 * b
                                    out[(grow, h, tOcO[e][1])] = (acc_o[e] * inv).to(self.dtype)

            if cutlass.const_expr(pp):
                if w == 0:
                    # warpgroup 1's last hand-over: no named barrier keeps pending arrivals
                    turn_mine.arrive_and_wait()
