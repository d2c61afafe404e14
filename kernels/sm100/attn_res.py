"""sm_100a / sm_103a AttnRes: Kimi attention residuals, fused serving form
(see kernels/CONTRACT_ATTN_RES.md and ../shared/specs/attn_res.md).

Per row m (rows are independent), with K = num_blocks, w = write_idx:

    p   = has_delta ? bf16(f32(prefix[m]) + f32(delta[m])) : prefix[m]
    prefix[m] = p (has_delta);  blocks[m, w] = p (w >= 0)
    c_i = blocks[m, i] (i < K, i != w),  c_w = p (w < K),  c_K = p
    s_i = rsqrt(mean(c_i^2) + eps) * dot(c_i, norm_w * qk_w)
    mix = sum_i softmax(s)_i c_i
    out = bf16(mix * rsqrt(mean(mix^2) + out_eps) * out_norm_w)  or  bf16(mix)

Design (the spec's tensor-memory design; compiled and SASS-checked only, never run here):
  - persistent grid, one 288-thread CTA per SM (grid = min(M, sm_count)); CTA b owns the
    rows b, b + grid, ...; shared memory (> half of the SM) and the 512-column TMEM
    allocation keep it at one CTA per SM.
  - warp 8 (one lane) is the loader: for each owned row it streams the row's items
    [prefix, delta (has_delta), blocks[m, i] for i < K except i == w] with one
    cp.async.bulk (global -> shared, H * 2 bytes, mbarrier complete_tx) per item into a
    `stages`-deep ring of max_hidden-sized slots (full / empty mbarriers). The loader runs
    ahead across rows, so the next row's sources stream in while this row is mixed.
    Every source row is read from HBM exactly once; blocks[m, w] (w < K) is never read
    (its source is p).
  - warps 0-7 (256 compute threads) own fixed 4-element units of the row: thread T owns
    units u = T + 256 j (elements 4u .. 4u + 3), j < J = max_hidden / 1024. Per item they
    read their units from the ring (8-byte ld.shared), convert to fp32 once, accumulate
    the partial dot(c, norm_w * qk_w) and sum(c^2), and store the fp32 values into tensor
    memory (tcgen05.st 32x32b.x4) before releasing the ring slot. Thread T uses TMEM lane
    T % 128 (warps w and w + 4 share lane quarter w % 4) and the column half T // 128.
    A source occupies `slot_cols = 8 * ceil(H / 1024)` columns (56 at H = 7168: all 9
    sources of K = 8 fit in the 512 columns; 128 at H = 16384: 4 per chunk).
  - the p item: prefix and delta slots are consumed together, p = bf16(prefix + delta)
    is written back (prefix in place, blocks[m, w]) straight from registers and becomes
    TMEM slot 0 (with multiplicity 2 when w < K).
  - chunk flush (when the TMEM slots are full, and at the end of the row): warp partials
    (shuffle reduce) -> shared memory -> one named barrier -> every thread forms the
    chunk's scores, updates the running max / sum (online softmax across chunks) and
    rescales its fp32 mix accumulator (registers), then reads each source back from TMEM
    (tcgen05.ld) and accumulates weight * c. Partials are double-buffered by chunk parity,
    so one barrier per chunk suffices.
  - epilogue: mix / l, optional out RMSNorm (one more block reduction), 8-byte stores.
Tails: every unit is predicated on u < H / 4 (H % 8 == 0 so H / 4 is whole); the TMEM
ld/st are warp-collective and run for every j < ceil(H / 1024) (CTA-uniform), invalid
units carry zeros. K = 0: one source p, weight 1, mix = p.

Small M (row_split > 1; cutekern.attn_res picks the split per M): one CTA per row leaves
most SMs idle, so a row is split over a cluster of C CTAs. That build is the sm90 design's
split_direct kernel (every source of the row straight into registers by 16-byte loads, the
CTA totals exchanged through DSMEM: nothing in it is sm90-only), built for sm_100a /
sm_103a; compiled and SASS-checked only, like the rest of this design.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import tcgen05
from cutlass.experimental import primitives as _prims
from cutlass.memory import SmemAllocator, TmemAllocator

from kernels.sm90.attn_res import SASS_FORBIDDEN_DIRECT, SASS_REQUIRED_DIRECT, split_build

# STTM: tcgen05.st (rows converted once to fp32 into tensor memory); LDTM: tcgen05.ld (the
# mix pass reads the sources back from TMEM); UBLKCP: cp.async.bulk global -> shared (the
# loader's one-copy-per-source-row); SYNCS: the mbarriers of the shared-memory ring.
# LDGSTS (cp.async) would mean the Ada-style load path; LDL / STL would mean the per-thread
# mix accumulator / unit state spilled to local memory.
SASS_REQUIRED = ("STTM", "LDTM", "UBLKCP", "SYNCS")
SASS_FORBIDDEN = ("LDGSTS", "LDL", "STL")  # exact mnemonics
# split builds: 16-byte loads to registers (LDG), the DSMEM exchange's mbarriers (SYNCS);
# no ring, no tensor memory
SASS_REQUIRED_SPLIT = SASS_REQUIRED_DIRECT
SASS_FORBIDDEN_SPLIT = SASS_FORBIDDEN_DIRECT + ("STTM", "LDTM")

_SMEM_CAPACITY = 232448  # (228 - 1) KiB per-CTA opt-in maximum on sm_100 / sm_103
_SMEM_RESERVED = 4 * 1024  # mbarriers, TMEM slot, reduction scratch, 1 KiB alignment slack
_TMEM_COLS = 512
_TMEM_LANES = 128
_UNIT = 4  # elements per thread unit (8 bytes of bf16; one tcgen05 32x32b.x4 column group)
_MAX_SLOTS = 9  # K + 1 <= NB + 1 = 9 distinct sources per row (NB <= 8)
_LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class AttnResSm100Config:
    """compute_warps: warps converting rows and mixing (8 = two threads per TMEM lane;
        4 = one); each owns max_hidden / (128 * compute_warps) 4-element units per row.
    max_stages: cap on the depth of the shared-memory ring of source rows (one
        max_hidden bf16 row per slot). The depth used is the most that fits next to the
        per-thread weight copies: 10 at max_hidden = 8192 (a whole row's items in flight
        for K = 8), 4 at 16384.
    sm_count: persistent grid cap (148 on B200 / GB200; any value is correct, CTAs
        stride over rows by the grid size)."""

    compute_warps: int = 8
    max_stages: int = 10
    sm_count: int = 148
    # row_split > 1: compute warps per CTA at most (the sm90 split kernels' bound)
    split_consumer_warps: int = 8


def _split_build(dtype, max_hidden: int, config: AttnResSm100Config, row_split: int):
    return split_build(dtype, max_hidden, row_split,
                       split_consumer_warps=config.split_consumer_warps,
                       num_sms=config.sm_count, xchg_global=False)


def _stages_that_fit(max_hidden: int, cfg: AttnResSm100Config) -> int:
    fixed = _SMEM_RESERVED + max_hidden * 4 + max_hidden * 2  # norm_w*qk_w f32, out_norm_w
    return min(cfg.max_stages, (_SMEM_CAPACITY - fixed) // (max_hidden * 2))


class AttnResSm100:
    def __init__(self, dtype, max_hidden: int, config: AttnResSm100Config = AttnResSm100Config(), row_split: int = 1):
        if not AttnResSm100.can_implement(dtype, max_hidden, config, row_split):
            raise ValueError(f"AttnResSm100 cannot implement {dtype} max_hidden={max_hidden} "
                             f"row_split={row_split} with {config}")
        self.row_split = row_split
        # row_split > 1: the sm90 cluster-split kernel (module docstring)
        self._split = _split_build(dtype, max_hidden, config, row_split)
        if self._split is not None:
            self.sass_required, self.sass_forbidden = SASS_REQUIRED_SPLIT, SASS_FORBIDDEN_SPLIT
        self.dtype = dtype
        self.max_hidden = max_hidden
        self.cfg = config
        self.ncw = config.compute_warps
        self.nct = 32 * self.ncw  # compute threads
        self.halves = self.ncw // 4  # threads per TMEM lane
        self.J = max_hidden // (_UNIT * self.nct)  # units per thread (compile-time bound)
        self.stages = _stages_that_fit(max_hidden, config)
        self.loader_warp = self.ncw
        self.threads = 32 * (self.ncw + 1)
        self.sm_count = config.sm_count
        self.compute_bar_id = 1
        self.tmem_bar_id = 2

    @staticmethod
    def can_implement(dtype, max_hidden, config: AttnResSm100Config = AttnResSm100Config(),
                      row_split: int = 1) -> bool:
        if dtype is not cutlass.BFloat16:
            return False
        if row_split != 1:  # the direct split kernels only (module docstring)
            return _split_build(dtype, max_hidden, config, row_split) is not None
        if config.compute_warps not in (4, 8):
            return False
        nct = 32 * config.compute_warps
        if max_hidden < _UNIT * nct or max_hidden % (_UNIT * nct) != 0:
            return False
        # one source slot (all units of a row) must fit in the 512 TMEM columns
        if (max_hidden // _TMEM_LANES) > _TMEM_COLS:
            return False
        if config.sm_count < 1:
            return False
        # >= 2: the p item needs the prefix and the delta slot at the same time
        return _stages_that_fit(max_hidden, config) >= 2

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, prefix: cute.Tensor, delta: cute.Tensor, blocks: cute.Tensor,
                 norm_w: cute.Tensor, qk_w: cute.Tensor, out_norm_w: cute.Tensor,
                 out: cute.Tensor, num_blocks: cutlass.Int32, write_idx: cutlass.Int32,
                 has_delta: cutlass.Int32, has_out_norm: cutlass.Int32,
                 eps: cutlass.Float32, out_eps: cutlass.Float32, work: cute.Tensor,
                 stream: cuda.CUstream):
        # work: the sm90 kernel's row-scheduler counters (shared ABI); unused by both
        if cutlass.const_expr(self._split is not None):
            self._split(prefix, delta, blocks, norm_w, qk_w, out_norm_w, out, num_blocks,
                        write_idx, has_delta, has_out_norm, eps, out_eps, work, stream)
        else:
            self._launch_tmem(prefix, delta, blocks, norm_w, qk_w, out_norm_w, out,
                              num_blocks, write_idx, has_delta, has_out_norm, eps, out_eps,
                              stream)

    @cute.jit
    def _launch_tmem(self, prefix: cute.Tensor, delta: cute.Tensor, blocks: cute.Tensor,
                     norm_w: cute.Tensor, qk_w: cute.Tensor, out_norm_w: cute.Tensor,
                     out: cute.Tensor, num_blocks: cutlass.Int32, write_idx: cutlass.Int32,
                     has_delta: cutlass.Int32, has_out_norm: cutlass.Int32,
                     eps: cutlass.Float32, out_eps: cutlass.Float32, stream: cuda.CUstream):
        if cutlass.const_expr(prefix.element_type != self.dtype):
            raise TypeError("AttnResSm100: dtype mismatch")
        maxh = self.max_hidden
        n_red = 2 * _MAX_SLOTS * self.ncw * 2

        @cute.struct
        class SharedStorage:
            full_mbar: cute.struct.MemRange[cutlass.Int64, self.stages]
            empty_mbar: cute.struct.MemRange[cutlass.Int64, self.stages]
            tmem_holding_buf: cutlass.Int32
            red: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, n_red], 16]
            red2: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 2 * self.ncw], 16]
            ring: cute.struct.Align[
                cute.struct.MemRange[self.dtype, self.stages * maxh], 1024]
            s_wq: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, maxh], 1024]
            s_ow: cute.struct.Align[cute.struct.MemRange[self.dtype, maxh], 1024]

        self.shared_storage = SharedStorage
        assert SharedStorage.size_in_bytes() <= _SMEM_CAPACITY, (
            f"shared storage {SharedStorage.size_in_bytes()} B exceeds the per-CTA limit")
        # > half of the SM's shared memory at the default configs (208 / 224 KB): one CTA
        # per SM, alone with its 512 TMEM columns (a second resident CTA would only wait
        # in tcgen05.alloc until the first one frees them: slower, still correct)

        M = prefix.shape[0]
        grid_x = cutlass.min(M, cutlass.Int32(self.sm_count))
        self.kernel(prefix, delta, blocks, norm_w, qk_w, out_norm_w, out,
                    num_blocks, write_idx, has_delta, has_out_norm, eps, out_eps).launch(
            grid=[grid_x, 1, 1],
            block=[self.threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---------------------------------------------------------------- device side
    def _unit_view(self, ptr, tidx):
        """(4, J) view of thread tidx's units of a row starting at ptr: unit j holds
        elements 4 (tidx + nct j) + [0, 4). Built as a layout so the 8-byte alignment of
        every unit is visible to the vectorizer."""
        v = cute.make_tensor(ptr, cute.make_layout((_UNIT, self.nct, self.J),
                                                   stride=(1, _UNIT, _UNIT * self.nct)))
        return v[(None, tidx, None)]

    @cute.kernel
    def kernel(self, prefix: cute.Tensor, delta: cute.Tensor, blocks: cute.Tensor,
               norm_w: cute.Tensor, qk_w: cute.Tensor, out_norm_w: cute.Tensor,
               out: cute.Tensor, num_blocks: cutlass.Int32, write_idx: cutlass.Int32,
               has_delta: cutlass.Int32, has_out_norm: cutlass.Int32,
               eps: cutlass.Float32, out_eps: cutlass.Float32):
        S = self.stages
        J = self.J
        nct = self.nct
        ncw = self.ncw
        maxh = self.max_hidden
        f32 = cutlass.Float32

        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        M = prefix.shape[0]
        H = prefix.shape[1]
        K = num_blocks
        w_idx = write_idx

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        full_bar = storage.full_mbar.data_ptr()
        empty_bar = storage.empty_mbar.data_ptr()
        ring_ptr = storage.ring.data_ptr()

        if warp_idx == self.loader_warp:
            if lane == 0:
                for s in cutlass.range_constexpr(S):
                    cute.arch.mbarrier_init(full_bar + s, 1)
                    cute.arch.mbarrier_init(empty_bar + s, ncw)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # p doubles as c_w when 0 <= w < K: blocks[m, w] is then neither read nor a slot
        dup = cutlass.Int32(0)
        if w_idx >= 0:
            if w_idx < K:
                dup = cutlass.Int32(1)
        n_blk = K - dup  # block rows read per row
        n_items = 1 + has_delta + n_blk

        # ================================================================ loader warp
        if warp_idx == self.loader_warp:
            if lane == 0:
                nbytes = H * 2
                it_ctr = cutlass.Int32(0)
                for m in cutlass.range(bidx, M, gdim, unroll=1):
                    for it in cutlass.range(n_items, unroll=1):
                        st = it_ctr % S
                        ph = (it_ctr // S) & 1
                        # slot free: all compute warps released its previous contents
                        cute.arch.mbarrier_wait(empty_bar + st, ph ^ 1)
                        cute.arch.mbarrier_arrive_and_expect_tx(full_bar + st, nbytes)
                        dst = (ring_ptr + st * maxh).to_llvm_ptr()
                        mbar = (full_bar + st).to_llvm_ptr()
                        kind = cutlass.Int32(2)  # 0 prefix, 1 delta, 2 block
                        if it == 0:
                            kind = cutlass.Int32(0)
                        if it == 1:
                            if has_delta != 0:
                                kind = cutlass.Int32(1)
                        if kind == 0:
                            src = prefix[(m, None)].iterator
                            _prims.cp_async_bulk_shared_cluster_global(
                                dst, src.to_llvm_ptr(), mbar, nbytes)
                        if kind == 1:
                            src = delta[(m, None)].iterator
                            _prims.cp_async_bulk_shared_cluster_global(
                                dst, src.to_llvm_ptr(), mbar, nbytes)
                        if kind == 2:
                            b = it - 1 - has_delta
                            if dup != 0:
                                if b >= w_idx:
                                    b = b + 1
                            src = blocks[(m, b, None)].iterator
                            _prims.cp_async_bulk_shared_cluster_global(
                                dst, src.to_llvm_ptr(), mbar, nbytes)
                        it_ctr = it_ctr + 1

        # ============================================================== compute warps
        if warp_idx < ncw:
            tmem_bar = pipeline.NamedBarrier(barrier_id=self.tmem_bar_id, num_threads=nct)
            tmem = TmemAllocator(storage.tmem_holding_buf.ptr, barrier_for_retrieve=tmem_bar,
                                 allocator_warp_id=0)
            tmem.allocate(_TMEM_COLS)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(f32)

            half = tidx // _TMEM_LANES
            tl = tidx % _TMEM_LANES  # TMEM lane of this thread (warp w -> lanes 32 (w % 4) + i)

            U = H // _UNIT
            Jrt = (U + nct - 1) // nct  # units per thread actually used (CTA-uniform)
            half_cols = _UNIT * Jrt
            slot_cols = self.halves * half_cols
            n_slots = cutlass.min(_TMEM_COLS // slot_cols, cutlass.Int32(_MAX_SLOTS))
            col0 = half * half_cols  # this thread's first column inside a slot
            inv_h = f32(1.0) / f32(H)

            # ---- TMEM copy atoms: one 32x32b.x4 (4 columns of this thread's lane) per unit
            unit_layout = cute.make_layout((_TMEM_LANES, _UNIT), stride=(65536, 1))
            ld_atom = cute.make_copy_atom(
                tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(_UNIT)), f32)
            st_atom = cute.make_copy_atom(
                tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(_UNIT)), f32)
            t_base = cute.make_tensor(tmem_ptr, unit_layout)
            tiled_ld = tcgen05.make_tmem_copy(ld_atom, t_base)
            tiled_st = tcgen05.make_tmem_copy(st_atom, t_base)
            thr_ld = tiled_ld.get_slice(tl)
            thr_st = tiled_st.get_slice(tl)
            cid = cute.make_identity_tensor((_TMEM_LANES, _UNIT))
            ld_shape = thr_ld.partition_D(cid).shape
            st_shape = thr_st.partition_S(cid).shape

            # ---- per-thread weights (each thread only ever reads back its own units)
            sWq = self._unit_view(storage.s_wq.data_ptr(), tidx)
            sOw = self._unit_view(storage.s_ow.data_ptr(), tidx)
            gNw = self._unit_view(norm_w.iterator, tidx)
            gQw = self._unit_view(qk_w.iterator, tidx)
            gOw = self._unit_view(out_norm_w.iterator, tidx)
            for j in cutlass.range_constexpr(J):
                if tidx + nct * j < U:
                    sWq[(None, j)].store(gNw[(None, j)].load().to(f32)
                                         * gQw[(None, j)].load().to(f32))
                    if has_out_norm != 0:
                        sOw[(None, j)].store(gOw[(None, j)].load())

            red = storage.red.get_tensor(cute.make_layout((2, _MAX_SLOTS, ncw, 2)))
            red2 = storage.red2.get_tensor(cute.make_layout((ncw, 2)))
            ring = storage.ring.get_tensor(
                cute.make_layout((_UNIT, nct, J, S), stride=(1, _UNIT, _UNIT * nct, maxh)))
            tRing = ring[(None, tidx, None, None)]  # (4, J, S)

            r_st = cute.make_rmem_tensor(st_shape, f32)
            r_st_flat = cute.make_tensor(r_st.iterator, cute.make_layout(_UNIT))
            r_ld = [cute.make_rmem_tensor(ld_shape, f32) for _ in range(J)]
            mix = [cute.make_rmem_tensor(ld_shape, f32) for _ in range(J)]

            it_ctr = cutlass.Int32(0)
            cpar = cutlass.Int32(0)  # chunk parity (partials buffer)
            rpar = cutlass.Int32(0)  # row parity (out-norm partials buffer)
            for m in cutlass.range(bidx, M, gdim, unroll=1):
                gP = self._unit_view(prefix[(m, None)].iterator, tidx)
                gO = self._unit_view(out[(m, None)].iterator, tidx)
                wrow = w_idx
                if wrow < 0:
                    wrow = cutlass.Int32(0)  # unused (no write); keeps the slice in range
                gB = self._unit_view(blocks[(m, wrow, None)].iterator, tidx)

                for j in cutlass.range_constexpr(J):
                    mix[j].fill(0.0)
                m_run = -f32.inf
                l_run = f32(0.0)

                # ---------------------------------------------------- p (slot 0)
                st0 = it_ctr % S
                cute.arch.mbarrier_wait(full_bar + st0, (it_ctr // S) & 1)
                st1 = (it_ctr + 1) % S
                if has_delta != 0:
                    cute.arch.mbarrier_wait(full_bar + st1, ((it_ctr + 1) // S) & 1)
                dot = f32(0.0)
                ssq = f32(0.0)
                for j in cutlass.range_constexpr(J):
                    if j < Jrt:
                        r_st_flat.fill(0.0)
                        if tidx + nct * j < U:
                            a = tRing[(None, j, st0)].load()
                            pv = a
                            if has_delta != 0:
                                d = tRing[(None, j, st1)].load()
                                pv = (a.to(f32) + d.to(f32)).to(self.dtype)
                                gP[(None, j)].store(pv)
                            if w_idx >= 0:
                                gB[(None, j)].store(pv)
                            x = pv.to(f32)
                            r_st_flat.store(x)
                            dot = dot + (x * sWq[(None, j)].load()).reduce(
                                cute.ReductionOp.ADD, f32(0.0), 0)
                            ssq = ssq + (x * x).reduce(cute.ReductionOp.ADD, f32(0.0), 0)
                        tdst = cute.make_tensor(tmem_ptr + (col0 + _UNIT * j), unit_layout)
                        cute.copy(tiled_st, r_st, thr_st.partition_D(tdst))
                # ring slots back to the loader (reads done: values are in registers / TMEM)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_warp()
                if lane == 0:
                    cute.arch.mbarrier_arrive(empty_bar + st0)
                    if has_delta != 0:
                        cute.arch.mbarrier_arrive(empty_bar + st1)
                it_ctr = it_ctr + 1 + has_delta
                dot = cute.arch.warp_reduction_sum(dot)
                ssq = cute.arch.warp_reduction_sum(ssq)
                if lane == 0:
                    red[(0, 0, warp_idx, cpar)] = dot
                    red[(1, 0, warp_idx, cpar)] = ssq

                # ------------------------------------ block sources; flush chunks
                slot = cutlass.Int32(1)
                first_chunk = cutlass.Int32(1)
                for b in cutlass.range(n_blk + 1, unroll=1):
                    if b == n_blk or slot == n_slots:
                        # ---- chunk flush: scores, online softmax, mix from TMEM
                        cute.arch.fence_view_async_tmem_store()
                        cute.arch.barrier(barrier_id=self.compute_bar_id, number_of_threads=nct)
                        m_new = m_run
                        for i in cutlass.range(slot, unroll=1):
                            dsum = f32(0.0)
                            qsum = f32(0.0)
                            for wv in cutlass.range_constexpr(ncw):
                                dsum = dsum + red[(0, i, wv, cpar)]
                                qsum = qsum + red[(1, i, wv, cpar)]
                            s_i = cute.math.rsqrt(qsum * inv_h + eps) * dsum
                            m_new = cute.arch.fmax(m_new, s_i)
                        corr = cute.math.exp2((m_run - m_new) * _LOG2E, fastmath=True)
                        l_run = l_run * corr
                        for j in cutlass.range_constexpr(J):
                            mix[j].store(mix[j].load() * corr)
                        for i in cutlass.range(slot, unroll=1):
                            dsum = f32(0.0)
                            qsum = f32(0.0)
                            for wv in cutlass.range_constexpr(ncw):
                                dsum = dsum + red[(0, i, wv, cpar)]
                                qsum = qsum + red[(1, i, wv, cpar)]
                            s_i = cute.math.rsqrt(qsum * inv_h + eps) * dsum
                            e = cute.math.exp2((s_i - m_new) * _LOG2E, fastmath=True)
                            if i == 0:
                                if first_chunk != 0:
                                    e = e * f32(1 + dup)
                            l_run = l_run + e
                            for j in cutlass.range_constexpr(J):
                                if j < Jrt:
                                    tsrc = cute.make_tensor(
                                        tmem_ptr + (i * slot_cols + col0 + _UNIT * j),
                                        unit_layout)
                                    cute.copy(tiled_ld, thr_ld.partition_S(tsrc), r_ld[j])
                            cute.arch.fence_view_async_tmem_load()
                            for j in cutlass.range_constexpr(J):
                                if j < Jrt:
                                    mix[j].store(mix[j].load() + r_ld[j].load() * e)
                        m_run = m_new
                        cpar = cpar ^ 1
                        first_chunk = cutlass.Int32(0)
                        slot = cutlass.Int32(0)
                    if b < n_blk:
                        # ---- one block source -> TMEM slot `slot`
                        stb = it_ctr % S
                        cute.arch.mbarrier_wait(full_bar + stb, (it_ctr // S) & 1)
                        dot = f32(0.0)
                        ssq = f32(0.0)
                        for j in cutlass.range_constexpr(J):
                            if j < Jrt:
                                r_st_flat.fill(0.0)
                                if tidx + nct * j < U:
                                    x = tRing[(None, j, stb)].load().to(f32)
                                    r_st_flat.store(x)
                                    dot = dot + (x * sWq[(None, j)].load()).reduce(
                                        cute.ReductionOp.ADD, f32(0.0), 0)
                                    ssq = ssq + (x * x).reduce(
                                        cute.ReductionOp.ADD, f32(0.0), 0)
                                tdst = cute.make_tensor(
                                    tmem_ptr + (slot * slot_cols + col0 + _UNIT * j),
                                    unit_layout)
                                cute.copy(tiled_st, r_st, thr_st.partition_D(tdst))
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.sync_warp()
                        if lane == 0:
                            cute.arch.mbarrier_arrive(empty_bar + stb)
                        it_ctr = it_ctr + 1
                        dot = cute.arch.warp_reduction_sum(dot)
                        ssq = cute.arch.warp_reduction_sum(ssq)
                        if lane == 0:
                            red[(0, slot, warp_idx, cpar)] = dot
                            red[(1, slot, warp_idx, cpar)] = ssq
                        slot = slot + 1

                # ------------------------------------------------ epilogue of the row
                inv_l = f32(1.0) / l_run
                rnorm = f32(1.0)
                if has_out_norm != 0:
                    q = f32(0.0)
                    for j in cutlass.range_constexpr(J):
                        v = mix[j].load() * inv_l
                        q = q + (v * v).reduce(cute.ReductionOp.ADD, f32(0.0), 0)
                    q = cute.arch.warp_reduction_sum(q)
                    if lane == 0:
                        red2[(warp_idx, rpar)] = q
                    cute.arch.barrier(barrier_id=self.compute_bar_id, number_of_threads=nct)
                    qt = f32(0.0)
                    for wv in cutlass.range_constexpr(ncw):
                        qt = qt + red2[(wv, rpar)]
                    rnorm = cute.math.rsqrt(qt * inv_h + out_eps)
                    rpar = rpar ^ 1
                for j in cutlass.range_constexpr(J):
                    if tidx + nct * j < U:
                        v = cute.make_tensor(mix[j].iterator, cute.make_layout(_UNIT)).load()
                        v = v * inv_l
                        if has_out_norm != 0:
                            v = v * rnorm * sOw[(None, j)].load().to(f32)
                        gO[(None, j)].store(v.to(self.dtype))

            # every compute warp is done with TMEM before warp 0 frees it
            cute.arch.fence_view_async_tmem_load()
            tmem.relinquish_alloc_permit()
            cute.arch.barrier(barrier_id=self.compute_bar_id, number_of_threads=nct)
            tmem.free(tmem_ptr)
