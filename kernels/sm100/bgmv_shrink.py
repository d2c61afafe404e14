"""sm_100a / sm_103a MoE-LoRA shrink (see kernels/CONTRACT_BGMV.md, incl. its v2 section).
Compiled and SASS-checked only: there is no SM100 GPU here, this kernel has never run.

    s[p, r] = cvt(sum_h x[t, h] * a[l, e, r, h])      p = order[q], t = p // k, j = p % k,
                                                       l = lora[t], e = topk_ids[t, j]

Two schedules in ONE kernel, picked at run time by P = T * k vs `config.bin_min_pairs`:

pair mode (P < bin_min_pairs: small batch, latency; the v1 schedule)
- Work unit = (a span of consecutive `order` entries, a block of rows r). Both sizes are
  picked at run time from (Q, R): at small batch the span shrinks to one entry and R is split
  in blocks of 8 rows so that the first wave covers many SMs; at large batch a span covers
  `max_run` entries and the whole rank, so x rows are read once per pair.
- Inside a span, a *run* is a maximal group of consecutive live entries (at most `max_run`)
  with the same (adapter, expert) bin: the run streams its bin's A rows [r0, r0 + rb) once
  and the x rows of its entries (expert-sorted order => most runs are several entries).

bin mode (P >= bin_min_pairs: large batch, bandwidth; `order` is not read)
- Work item = bin = l * E + e over all L * E bins (persistent grid-stride, whole rank per
  item). The whole CTA scans the pair table p = 0..P-1 (one thread per token, `scan_tokens`
  tokens per thread per round, all loads of a round in flight): a pair belongs to the bin iff
  lora[t] == l and topk_ids[t, j] == e. Per (round, warp) the matches are compacted with warp
  ballots + popc (lanes below / warp totals in shared memory, CTA barriers) into a
  `bin_list`-entry shared-memory window in increasing p (deterministic, no atomics). A full
  window is processed and the scan resumes after its last pair.
- The window is processed in groups of `max_run` pairs with exactly the pair-mode run code:
  the bin's A rows are streamed once per group into the ring and reused by every pair of the
  group. A bin without pairs costs only its scan.
- Dead pairs (l or e out of range) get their zero rows from a grid-stride pass (per warp: one
  pair per lane, ballot of the dead ones, the warp zeroes their rows).

Common machinery / arithmetic (identical in both modes => bit-identical results):
- Warp `consumer_warps` is the producer: raw cp.async.bulk copies (no tensor map, dynamic
  byte counts, one row per lane) of A rows and gathered x rows, whole H split into chunks of
  a multiple of 256 elements sized to fill a `stage_bytes` stage, into a `stages`-deep
  shared-memory ring guarded by full (tx-count) / empty (consumer arrival) mbarriers.
- Consumer warps 0..consumer_warps-1: warp w owns rows r0 + w + consumer_warps * i; lane
  L owns the 16-byte vectors g = L (mod 32) of every row (g = h / 8, global index), so it
  accumulates, in fp32 with explicit FMAs, h = 8 g + 0..7 for g ascending; the 32 lane
  partials are combined by a fixed xor-butterfly (16, 8, 4, 2, 1). The summation order of
  s[p, r] is therefore a function of H alone: independent of T, k, grid, mode, `order`,
  span/run/group/chunk sizes and other tokens (bitwise deterministic, batch invariant, the
  same value on both sides of the bin_min_pairs threshold). No atomics.
- Skipped pairs (l or e out of range) get zeros; padding entries of `order` are ignored.
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.memory import SmemAllocator

from kernels.sm100._bin_scan import bulk_g2s, scan_pairs

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
    max_run: most entries (same bin) sharing one stream of A rows (pair-mode runs and
        bin-mode groups); registers hold (64 / consumer_warps) * max_run fp32 partials/lane.
    stages: depth of the shared-memory ring.
    stage_bytes: bytes per ring stage; one stage holds (rb + m) rows of an H chunk, the chunk
        a multiple of 256 elements, so it must hold (64 + max_run) * 256 16-bit elements.
    sm_count: persistent grid cap (only scheduling; results never depend on it).
    bin_min_pairs: P = T * k at or above which the bin-grouped schedule runs.
    bin_list: shared-memory pair window of the bin scan (entries).
    scan_tokens: tokens per thread per scan round (loads in flight)."""

    consumer_warps: int = 8
    max_run: int = 4
    stages: int = 6
    stage_bytes: int = 36864
    sm_count: int = 148
    bin_min_pairs: int = 1024
    bin_list: int = 1024
    scan_tokens: int = 4


def _smem_bytes(cfg: BgmvShrinkSm100Config) -> int:
    nw = cfg.consumer_warps + 1
    return (cfg.stages * cfg.stage_bytes + 1024 + 16 * cfg.stages
            + 4 * cfg.bin_list + 4 * nw * cfg.scan_tokens + 64)



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
        self.n_warps = config.consumer_warps + 1
        self.n_consumers = 32 * config.consumer_warps
        self.bin_list = config.bin_list
        self.scan_u = config.scan_tokens

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
        if config.bin_min_pairs < 1 or not 1 <= config.scan_tokens <= 8:
            return False
        if config.bin_list < config.max_run or config.bin_list % 32 != 0:
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
            plist: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, self.bin_list], 16]
            ptot: cute.struct.Align[
                cute.struct.MemRange[cutlass.Int32, self.n_warps * self.scan_u], 16]
            buf: cute.struct.Align[
                cute.struct.MemRange[self.dtype, self.stages * self.stage_elems], 1024]

        self.shared_storage = SharedStorage
        assert SharedStorage.size_in_bytes() <= _SMEM_CAPACITY

        Q = order.shape[0]
        R = a.shape[2]
        P = x.shape[0] * topk_ids.shape[1]
        sms = cutlass.Int32(self.cfg.sm_count)
        # pair mode: finest decomposition is one entry x 8 rows per unit
        grid = cutlass.min(cutlass.max(Q * (R // 8), 1), sms)
        if P >= self.cfg.bin_min_pairs:
            # bin mode: persistent over the L * E bins
            grid = cutlass.min(cutlass.max(a.shape[0] * a.shape[1], 1), sms)
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

    @cute.jit
    def _produce_run(self, x: cute.Tensor, a: cute.Tensor, src: cute.Tensor, q, m, rl, re_,
                     r0, rcnt, K, buf, full, empty, stage, phase, lane):
        """Producer side of one live run / group: the m pairs src[q .. q + m) of bin (rl, re_),
        rows [r0, r0 + rcnt). Streams H in chunks: per stage the A rows, then the x rows."""
        stage_elems = self.stage_elems
        H = x.shape[1]
        a_l = cutlass.Int64(a.stride[0])
        a_e = cutlass.Int64(a.stride[1])
        a_r = cutlass.Int64(a.stride[2])
        x_t = cutlass.Int64(x.stride[0])
        l64 = cutlass.Int64(rl)
        e64 = cutlass.Int64(re_)
        rows = rcnt + m
        cap = ((stage_elems // rows) // _CHUNK_ALIGN) * _CHUNK_ALIGN
        h0 = cutlass.Int32(0)
        while h0 < H:
            hc = cutlass.min(cap, H - h0)
            cute.arch.mbarrier_wait(empty + stage, phase)
            if lane == 0:
                # arm the stage with its byte count, then one bulk copy per row (A rows of
                # the block, then the gathered x rows)
                cute.arch.mbarrier_arrive_and_expect_tx(full + stage, rows * hc * 2)
                sbase = buf + stage * stage_elems
                for i in cutlass.range(rcnt, unroll=1):
                    off = (l64 * a_l + e64 * a_e
                           + cutlass.Int64(r0 + i) * a_r + cutlass.Int64(h0))
                    bulk_g2s(sbase + i * cap, a.iterator + off, full + stage, hc * 2)
                for i in cutlass.range(m, unroll=1):
                    ti = src[q + i] // K
                    off = cutlass.Int64(ti) * x_t + cutlass.Int64(h0)
                    bulk_g2s(sbase + (rcnt + i) * cap, x.iterator + off, full + stage, hc * 2)
            stage = stage + 1
            if stage == self.stages:
                stage = cutlass.Int32(0)
                phase = phase ^ 1
            h0 = h0 + hc
        return stage, phase

    @cute.jit
    def _consume_run(self, s: cute.Tensor, src: cute.Tensor, q, m, r0, rcnt, H, buf, full,
                     empty, stage, phase, warp, lane):
        """Consumer side of one live run / group (same segmentation as the producer): writes
        s[src[q + z], r0 + r] for z < m, r < rcnt. THE arithmetic of s (both modes)."""
        cw = self.cw
        mr = self.mr
        rpw = self.rpw
        stage_elems = self.stage_elems
        acc = cute.make_rmem_tensor(cute.make_layout(rpw * mr), cutlass.Float32)
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
                    xt = cute.make_tensor(sbase + (xrow * cap + voff), cute.make_layout(_VEC))
                    xv = xt.load().to(cutlass.Float32)
                    xs.append([xv[w] for w in range(_VEC)])
                for i in cutlass.range_constexpr(rpw):
                    r = warp + cw * i
                    if r < rcnt:
                        at = cute.make_tensor(sbase + (r * cap + voff), cute.make_layout(_VEC))
                        av4 = at.load().to(cutlass.Float32)
                        av = [av4[w] for w in range(_VEC)]
                        for z in cutlass.range_constexpr(mr):
                            if z < m:
                                sacc = acc[i * mr + z]
                                for w in cutlass.range_constexpr(_VEC):
                                    sacc = cute.math.fma(xs[z][w], av[w], sacc)
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
                            val = val + cute.arch.shuffle_sync_bfly(val, offset=16 >> sh)
                        if lane == (i * mr + z) % 32:
                            s[(src[q + z], r0 + r)] = val.to(self.dtype)
        return stage, phase

    @cute.kernel
    def kernel(self, x: cute.Tensor, a: cute.Tensor, topk_ids: cute.Tensor,
               lora: cute.Tensor, order: cute.Tensor, s: cute.Tensor):
        mr = self.mr
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

        if P >= self.cfg.bin_min_pairs:
            # ======================================================== bin mode
            plist = storage.plist.get_tensor(cute.make_layout(self.bin_list))
            ptot = storage.ptot.get_tensor(cute.make_layout(self.n_warps * self.scan_u))
            stage = cutlass.Int32(0)
            phase = cutlass.Int32(0)
            if warp == self.producer_warp:
                phase = cutlass.Int32(1)
            for u in cutlass.range(bidx, L * E, nblk, unroll=1):
                bl = u // E
                be = u - bl * E
                p_lo = cutlass.Int32(0)
                while p_lo < P:
                    fill, p_lo = scan_pairs(topk_ids, lora, plist, ptot, bl, be, p_lo,
                                            T, K, P, tidx, warp, lane, self.bin_list,
                                            self.threads, self.n_warps, self.scan_u)
                    q = cutlass.Int32(0)
                    while q < fill:
                        m = cutlass.min(cutlass.Int32(mr), fill - q)
                        if warp == self.producer_warp:
                            stage, phase = self._produce_run(
                                x, a, plist, q, m, bl, be, 0, R, K, buf, full, empty,
                                stage, phase, lane)
                        else:
                            stage, phase = self._consume_run(
                                s, plist, q, m, 0, R, H, buf, full, empty, stage, phase,
                                warp, lane)
                        q = q + m
                    # every reader of the window is done before the next scan rewrites it
                    cute.arch.barrier()
            # dead pairs: zero rows (one pair per consumer thread, ballot per warp)
            if warp < self.producer_warp:
                nc = self.n_consumers
                for pb in cutlass.range(bidx * nc, P, nblk * nc, unroll=1):
                    p = pb + tidx
                    dead = cutlass.Boolean(False)
                    if p < P:
                        t = p // K
                        l = lora[t]
                        e = topk_ids[(t, p - t * K)]
                        dead = cutlass.Boolean(True)
                        if l >= 0 and l < L and e >= 0 and e < E:
                            dead = cutlass.Boolean(False)
                    bal = cute.arch.vote_ballot_sync(dead)
                    for i in cutlass.range(32, unroll=1):
                        if ((bal >> i) & 1) != 0:
                            pd = pb + warp * 32 + i
                            for r in cutlass.range(lane, R, 32, unroll=1):
                                s[(pd, r)] = self.dtype(0.0)
        else:
            # ======================================================== pair mode
            # work decomposition (same in every CTA; never changes any sum)
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

            # -------------------------------------------------------- producer warp
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
                            stage, phase = self._produce_run(
                                x, a, order, q, m, rl, re_, r0, rcnt, K, buf, full, empty,
                                stage, phase, lane)
                        q = q + m

            # -------------------------------------------------------- consumer warps
            if warp < self.producer_warp:
                stage = cutlass.Int32(0)
                phase = cutlass.Int32(0)
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
                                for i in cutlass.range_constexpr(self.rpw):
                                    r = warp + self.cw * i
                                    if r < rcnt:
                                        s[(order[q], r0 + r)] = self.dtype(0.0)
                        if kind == 2:
                            stage, phase = self._consume_run(
                                s, order, q, m, r0, rcnt, H, buf, full, empty, stage, phase,
                                warp, lane)
                        q = q + m
