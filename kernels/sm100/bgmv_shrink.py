"""sm_100a / sm_103a MoE-LoRA shrink (see kernels/CONTRACT_BGMV.md). Compiled and
SASS-checked only: there is no SM100 GPU here, this kernel has never run.

    s[p, r] = cvt(sum_h x[t, h] * a[l, e, r, h])      p = order[q], t = p // k, j = p % k,
                                                       l = lora[t], e = topk_ids[t, j]

Design (memory bound; persistent grid, warp specialized, no tensor cores):
- Work unit = (a span of consecutive `order` entries, a block of rows r). Both sizes are
  picked at run time from (Q, R): at small batch the span shrinks to one entry and R is split
  in blocks of 8 rows so that the first wave covers many SMs; at large batch a span covers
  `max_run` entries and the whole rank, so x rows are read once per pair.
- Inside a span, a *run* is a maximal group of consecutive live entries (at most `max_run`)
  with the same (adapter, expert) bin: the run streams its bin's A rows [r0, r0 + rb) once
  and the x rows of its entries (expert-sorted order => most runs are several entries).
- Warp `consumer_warps` is the producer: raw cp.async.bulk copies (no tensor map, dynamic
  byte counts, one row per lane) of A rows and gathered x rows, whole H split into chunks of
  a multiple of 256 elements sized to fill a `stage_bytes` stage, into a `stages`-deep
  shared-memory ring guarded by full (tx-count) / empty (consumer arrival) mbarriers.
- Consumer warps 0..consumer_warps-1: warp w owns rows r0 + w + consumer_warps * i; lane
  L owns the 16-byte vectors g = L (mod 32) of every row (g = h / 8, global index), so it
  accumulates, in fp32 with FMAs, h = 8 g + 0..7 for g ascending; the 32 lane partials are
  combined by a fixed xor-butterfly (16, 8, 4, 2, 1). The summation order of s[p, r] is
  therefore a function of H alone: independent of T, k, grid, `order`, span/run/chunk sizes
  and other tokens (bitwise deterministic and batch invariant). No atomics.
- Skipped pairs (l or e out of range) get zeros; padding entries of `order` are ignored.
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm as _llvm
from cutlass._mlir.dialects import nvvm as _nvvm
from cutlass.memory import SmemAllocator

# UBLKCP: cp.async.bulk (global -> shared, mbarrier complete_tx); SYNCS: mbarrier ops.
SASS_REQUIRED = ("UBLKCP", "SYNCS")
# no atomics / reductions to memory, no 16-byte cp.async (LDGSTS), no tensor-core MMA
SASS_FORBIDDEN = ("ATOM", "ATOMG", "ATOMS", "RED", "REDG", "LDGSTS", "HMMA", "UTCHMMA")

_SMEM_CAPACITY = 232448  # (228 - 1) KiB per-CTA opt-in maximum on sm_100 / sm_103
_MAX_R = 64
_VEC = 8           # 16-byte vector of 16-bit elements
_CHUNK_ALIGN = 256  # H chunks are multiples of 32 lanes * 8 elements


@dataclass(frozen=True)
class BgmvShrinkSm100Config:
    """consumer_warps: compute warps (warp w owns rows w + consumer_warps * i of a unit's
        row block); 64 / consumer_warps rows per warp.
    max_run: most entries (same bin) sharing one stream of A rows; registers hold
        (64 / consumer_warps) * max_run fp32 partials per lane.
    stages: depth of the shared-memory ring.
    stage_bytes: bytes per ring stage; one stage holds (rb + m) rows of an H chunk, the chunk
        a multiple of 256 elements, so it must hold (64 + max_run) * 256 16-bit elements.
    sm_count: persistent grid cap (only scheduling; results never depend on it)."""

    consumer_warps: int = 8
    max_run: int = 4
    stages: int = 6
    stage_bytes: int = 36864
    sm_count: int = 148


def _smem_bytes(cfg: BgmvShrinkSm100Config) -> int:
    return cfg.stages * cfg.stage_bytes + 1024 + 16 * cfg.stages


def _bulk_g2s(dst_smem, src_gmem, mbar, nbytes):
    """cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes (no tensor map)."""
    dst = _llvm.addrspacecast(_llvm.PointerType.get(7), dst_smem.llvm_ptr)
    _nvvm.cp_async_bulk_shared_cluster_global(
        dst, src_gmem.llvm_ptr, mbar.llvm_ptr, cutlass.Int32(nbytes).ir_value())


class BgmvShrinkSm100:
    def __init__(self, dtype, config: BgmvShrinkSm100Config = BgmvShrinkSm100Config()):
        if not BgmvShrinkSm100.can_implement(dtype, config):
            raise ValueError(f"BgmvShrinkSm100 cannot implement {dtype} with {config}")
        self.dtype = dtype
        self.cfg = config
        self.cw = config.consumer_warps
        self.rpw = _MAX_R // config.consumer_warps
        self.mr = config.max_run
        self.stages = config.stages
        self.stage_elems = config.stage_bytes // 2
        self.producer_warp = config.consumer_warps
        self.threads = 32 * (config.consumer_warps + 1)
        self.n_consumers = 32 * config.consumer_warps

    @staticmethod
    def can_implement(dtype, config: BgmvShrinkSm100Config = BgmvShrinkSm100Config()) -> bool:
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            return False
        if config.consumer_warps not in (4, 8, 16):
            return False
        if not 1 <= config.max_run <= 8:
            return False
        if config.stages < 2 or config.sm_count < 1:
            return False
        if config.stage_bytes % 1024 != 0:
            return False
        if config.stage_bytes < (_MAX_R + config.max_run) * _CHUNK_ALIGN * 2:
            return False
        return _smem_bytes(config) <= _SMEM_CAPACITY

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, x: cute.Tensor, a: cute.Tensor, topk_ids: cute.Tensor,
                 lora: cute.Tensor, order: cute.Tensor, s: cute.Tensor,
                 stream: cuda.CUstream):
        if cutlass.const_expr(x.element_type != self.dtype or a.element_type != self.dtype
                              or s.element_type != self.dtype):
            raise TypeError("x / a / s dtype does not match the compiled dtype")

        @cute.struct
        class SharedStorage:
            full_mbar: cute.struct.MemRange[cutlass.Int64, self.stages]
            empty_mbar: cute.struct.MemRange[cutlass.Int64, self.stages]
            buf: cute.struct.Align[
                cute.struct.MemRange[self.dtype, self.stages * self.stage_elems], 1024]

        self.shared_storage = SharedStorage
        assert SharedStorage.size_in_bytes() <= _SMEM_CAPACITY

        Q = order.shape[0]
        R = a.shape[2]
        # finest decomposition: one entry x 8 rows per unit
        grid = cutlass.min(cutlass.max(Q * (R // 8), 1), cutlass.Int32(self.cfg.sm_count))
        self.kernel(x, a, topk_ids, lora, order, s).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=1,
            stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.jit
    def _decode_run(self, order: cute.Tensor, topk_ids: cute.Tensor, lora: cute.Tensor,
                    q, qend, P, K, L, E):
        """The run starting at order entry q (q < qend): (kind, m, l, e).
        kind 0 = padding entry (skip 1), 1 = skipped pair (write zeros, skip 1), 2 = live run
        of the m entries order[q .. q + m) of bin (l, e) (1 <= m <= max_run).
        Producer and consumers call this on the same data: identical segmentation."""
        kind = cutlass.Int32(0)
        m = cutlass.Int32(1)
        l = cutlass.Int32(-1)
        e = cutlass.Int32(-1)
        p = order[q]
        if p >= 0 and p < P:
            t = p // K
            l = lora[t]
            e = topk_ids[(t, p - t * K)]
            kind = cutlass.Int32(1)
            if l >= 0 and l < L and e >= 0 and e < E:
                kind = cutlass.Int32(2)
                going = cutlass.Boolean(True)
                for i in cutlass.range_constexpr(1, self.mr):
                    if going:
                        going = cutlass.Boolean(False)
                        if q + i < qend:
                            p2 = order[q + i]
                            if p2 >= 0 and p2 < P:
                                t2 = p2 // K
                                if lora[t2] == l:
                                    if topk_ids[(t2, p2 - t2 * K)] == e:
                                        m = m + 1
                                        going = cutlass.Boolean(True)
        return kind, m, l, e

    @cute.kernel
    def kernel(self, x: cute.Tensor, a: cute.Tensor, topk_ids: cute.Tensor,
               lora: cute.Tensor, order: cute.Tensor, s: cute.Tensor):
        cw = self.cw
        mr = self.mr
        rpw = self.rpw
        stage_elems = self.stage_elems
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32

        T = x.shape[0]
        H = x.shape[1]
        L = a.shape[0]
        E = a.shape[1]
        R = a.shape[2]
        K = topk_ids.shape[1]
        P = T * K
        Q = order.shape[0]

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        full = storage.full_mbar.data_ptr()
        empty = storage.empty_mbar.data_ptr()
        buf = storage.buf.data_ptr()

        if warp == self.producer_warp:
            if lane == 0:
                for i in cutlass.range_constexpr(self.stages):
                    cute.arch.mbarrier_init(full + i, 1)
                    cute.arch.mbarrier_init(empty + i, self.n_consumers)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        # ---- work decomposition (same in every CTA; never changes any sum)
        r8 = R // 8
        sms = cutlass.Int32(self.cfg.sm_count)
        qspan = cutlass.Int32(mr)
        if (Q + mr - 1) // mr < sms:
            qspan = cutlass.Int32(1)
        nq = (Q + qspan - 1) // qspan
        nrs = cutlass.Int32(1)
        for _ in cutlass.range_constexpr(3):
            if nq * nrs < sms and nrs < r8:
                nrs = nrs * 2
        rb = 8 * ((r8 + nrs - 1) // nrs)
        nrb = (R + rb - 1) // rb
        units = nq * nrb

        a_l = cutlass.Int64(a.stride[0])
        a_e = cutlass.Int64(a.stride[1])
        a_r = cutlass.Int64(a.stride[2])
        x_t = cutlass.Int64(x.stride[0])

        # ============================================================ producer warp
        if warp == self.producer_warp:
            stage = cutlass.Int32(0)
            phase = cutlass.Int32(1)
            for u in cutlass.range(bidx, units, nblk, unroll=1):
                qb = u // nrb
                r0 = (u - qb * nrb) * rb
                rcnt = cutlass.min(rb, R - r0)
                q = qb * qspan
                qend = cutlass.min(q + qspan, Q)
                while q < qend:
                    kind, m, rl, re_ = self._decode_run(
                        order, topk_ids, lora, q, qend, P, K, L, E)
                    if kind == 2:
                        l64 = cutlass.Int64(rl)
                        e64 = cutlass.Int64(re_)
                        rows = rcnt + m
                        cap = ((stage_elems // rows) // _CHUNK_ALIGN) * _CHUNK_ALIGN
                        h0 = cutlass.Int32(0)
                        while h0 < H:
                            hc = cutlass.min(cap, H - h0)
                            cute.arch.mbarrier_wait(empty + stage, phase)
                            if lane == 0:
                                # arm the stage with its byte count, then one bulk copy per
                                # row (A rows of the block, then the gathered x rows)
                                cute.arch.mbarrier_arrive_and_expect_tx(
                                    full + stage, rows * hc * 2)
                                sbase = buf + stage * stage_elems
                                for i in cutlass.range(rcnt, unroll=1):
                                    off = (l64 * a_l + e64 * a_e
                                           + cutlass.Int64(r0 + i) * a_r + cutlass.Int64(h0))
                                    _bulk_g2s(sbase + i * cap, a.iterator + off,
                                              full + stage, hc * 2)
                                for i in cutlass.range(m, unroll=1):
                                    ti = order[q + i] // K
                                    off = cutlass.Int64(ti) * x_t + cutlass.Int64(h0)
                                    _bulk_g2s(sbase + (rcnt + i) * cap, x.iterator + off,
                                              full + stage, hc * 2)
                            stage = stage + 1
                            if stage == self.stages:
                                stage = cutlass.Int32(0)
                                phase = phase ^ 1
                            h0 = h0 + hc
                    q = q + m

        # ============================================================ consumer warps
        if warp < self.producer_warp:
            stage = cutlass.Int32(0)
            phase = cutlass.Int32(0)
            acc = cute.make_rmem_tensor(cute.make_layout(rpw * mr), cutlass.Float32)
            for u in cutlass.range(bidx, units, nblk, unroll=1):
                qb = u // nrb
                r0 = (u - qb * nrb) * rb
                rcnt = cutlass.min(rb, R - r0)
                q = qb * qspan
                qend = cutlass.min(q + qspan, Q)
                while q < qend:
                    kind, m, rl, re_ = self._decode_run(
                        order, topk_ids, lora, q, qend, P, K, L, E)
                    if kind == 1:
                        # skipped pair: its rows of this block are zero
                        if lane == 0:
                            for i in cutlass.range_constexpr(rpw):
                                r = warp + cw * i
                                if r < rcnt:
                                    s[(order[q], r0 + r)] = self.dtype(0.0)
                    if kind == 2:
                        for i in cutlass.range_constexpr(rpw * mr):
                            acc[i] = cutlass.Float32(0.0)
                        rows = rcnt + m
                        cap = ((stage_elems // rows) // _CHUNK_ALIGN) * _CHUNK_ALIGN
                        h0 = cutlass.Int32(0)
                        while h0 < H:
                            hc = cutlass.min(cap, H - h0)
                            cute.arch.mbarrier_wait(full + stage, phase)
                            sbase = buf + stage * stage_elems
                            for v in cutlass.range(lane, hc // _VEC, 32, unroll=1):
                                voff = v * _VEC
                                xs = []
                                for z in cutlass.range_constexpr(mr):
                                    xrow = rcnt + cutlass.min(z, m - 1)
                                    xt = cute.make_tensor(
                                        sbase + (xrow * cap + voff),
                                        cute.make_layout(_VEC))
                                    xv = xt.load().to(cutlass.Float32)
                                    xs.append([xv[w] for w in range(_VEC)])
                                for i in cutlass.range_constexpr(rpw):
                                    r = warp + cw * i
                                    if r < rcnt:
                                        at = cute.make_tensor(
                                            sbase + (r * cap + voff), cute.make_layout(_VEC))
                                        av4 = at.load().to(cutlass.Float32)
                                        av = [av4[w] for w in range(_VEC)]
                                        for z in cutlass.range_constexpr(mr):
                                            if z < m:
                                                sacc = acc[i * mr + z]
                                                for w in cutlass.range_constexpr(_VEC):
                                                    sacc = xs[z][w] * av[w] + sacc
                                                acc[i * mr + z] = sacc
                            cute.arch.mbarrier_arrive(empty + stage)
                            stage = stage + 1
                            if stage == self.stages:
                                stage = cutlass.Int32(0)
                                phase = phase ^ 1
                            h0 = h0 + hc
                        # fixed butterfly over the 32 lane partials, then store
                        for i in cutlass.range_constexpr(rpw):
                            r = warp + cw * i
                            if r < rcnt:
                                for z in cutlass.range_constexpr(mr):
                                    if z < m:
                                        val = acc[i * mr + z]
                                        for sh in cutlass.range_constexpr(5):
                                            val = val + cute.arch.shuffle_sync_bfly(
                                                val, offset=16 >> sh)
                                        if lane == (i * mr + z) % 32:
                                            s[(order[q + z], r0 + r)] = val.to(self.dtype)
                    q = q + m
