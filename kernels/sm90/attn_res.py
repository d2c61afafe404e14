"""sm_90a AttnRes: Kimi attention residuals, fused serving form (kernels/CONTRACT_ATTN_RES.md).

Per row m (rows are independent):
    p = has_delta ? bf16(prefix[m] + delta[m]) : prefix[m]; written back to prefix (has_delta)
    and blocks[m, w] (w >= 0); sources c_i = blocks[m, i] (i < K, c_w = p), c_K = p;
    s_i = rsqrt(mean(c_i^2) + eps) * dot(c_i, norm_w * qk_w); mix = sum softmax(s)_i c_i;
    out = bf16(rmsnorm(mix) * out_norm_w) or bf16(mix).

Design (memory bound; every source row crosses HBM once):
  - persistent grid; CTA (row_split = 1) or cluster of row_split CTAs (row_split > 1) b
    handles rows b, b + grid, ... (row_split = 1 with the batched schedule: row b, then rows
    claimed from a global counter; config.dynamic_rows)
  - warp NW (the last one): producer. One lane issues one cp.async.bulk (UBLKCP) per source
    row segment (no tensor map: any dynamic stride works) into a ring of slots in shared
    memory, guarded by full/empty mbarriers. The slot size is the runtime segment size
    (H for row_split = 1), so the ring holds min(max_stages, ring_bytes // (2 seg)) slots.
    Per row it loads prefix, delta (when has_delta), then blocks[m, i] for i < K, i != w.
  - warps 0..NW-1: consumers. Thread t owns the 16-byte chunks j = k * NT + t (k < CPT) of
    its segment (NT = 32 NW consumer threads); norm_w * qk_w (fp32) of its chunks lives in
    registers (or shared memory in the 16384 tier). p is computed from the prefix/delta slots
    into registers and stored (prefix, blocks[w]) with 16-byte stores. c_w == p, so when
    0 <= w < K the slot w is not loaded: p's score is raised by log2(2).
  - batched schedule (every row_split > 1; row_split = 1 when all loads of a row fit in the
    ring and config.batched): the partials (sum c^2, dot(c, nw qw)) of every source are
    computed from their slots, reduced with one batched warp butterfly and ONE named
    barrier per row (row_split > 1: the CTA totals are then exchanged through distributed
    shared memory: st.async with mbarrier complete_tx into every peer, double-buffered by
    row parity), the softmax is computed once, and the mix re-reads the slots (each slot is
    released right after its mix read). The output norm costs one more reduction (and one
    more DSMEM exchange). Every CTA of a cluster stores its own segment.
  - online schedule (row_split = 1 when the row does not fit in the ring, e.g. 16384 tier at
    large H): one reduction per source, online softmax (running max, rescaled accumulator).
  - chunks past the segment are never loaded or stored; they stay 0 in registers.
  - split_direct (row_split > 1 with at most 2 chunks per thread, i.e. every split kernel but
    the 16384 tier at split 2): no producer warp and no ring. Each thread loads its chunks of
    every source of the row straight into registers with 16-byte loads, all in flight at
    once, before it waits for anything (norm_w * qk_w products, the cluster barrier); the
    next row's loads go out as soon as the row is stored. Same partials, exchanges and mix
    (same bits) as the batched schedule. H200: M=1 7.6-8.2 -> 7.0-7.1 us, M=16 8.4 -> 7.9-8.0
    (perf/results/tune_memops_h200_attn_res_direct*.json).
  - xchg_global (config; the Ada design's split kernels, which have no clusters): the same
    split_direct kernel as a plain launch, the C CTAs of a row group (blocks g C .. g C + C-1)
    exchanging their totals through global memory instead of DSMEM: each total is one 8-byte
    word (sequence number << 32 | fp32 bits) stored relaxed at gpu scope into the CTA's record
    in `work`, and the peers poll those words until the sequence number is the expected one.
    A word carries its own flag, so there is no fence, no flag store and no reset: sequence
    numbers run on across launches (each CTA reads its last one from its record at entry;
    the CTAs of a group always make the same exchanges, so they stay equal), records are
    double-buffered by sequence parity (a peer cannot write exchange n + 2 before every CTA
    of the group has published n + 1, i.e. has read n). Same sums in the same order as the
    DSMEM exchange: same bits. The C CTAs of a group must be co-resident (they spin on each
    other): a grid of at most XCH_MAX_CTAS small CTAs, dispatched in block order.
  - row_split = C > 1: segment length seg = ceil(H / (8 C)) * 8, CTA c owns
    [c seg, min(H, (c + 1) seg)) (may be empty: the producer then arrives without a copy).
    Cluster barriers: after mbarrier init (relaxed arrive, wait before the first remote
    store) and at the very end (no CTA exits while a peer may still write into it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
from cutlass import Float32, Int32, Int64
from cutlass.cutlass_dsl import dsl_user_op
from cutlass._mlir.dialects import llvm as _llvm
from cutlass._mlir.dialects import nvvm as _nvvm

from kernels._cvt import widen
from kernels._xch import bits_f32 as _bits_f32, xch_put as _xch_put, xch_seq as _xch_seq
from cutekern.abi import (ATTN_RES_XCH_MAX_CTAS, ATTN_RES_XCH_OFF_WORDS, ATTN_RES_XCH_RECORD,
                          ATTN_RES_XCH_SPLITS)

# UBLKCP: cp.async.bulk (non-tensor) global -> shared; SYNCS: mbarrier ops.
# No LDGSTS (cp.async 16 B path), no local memory (LDL/STL = register spills).
SASS_REQUIRED = ("UBLKCP", "SYNCS")
SASS_FORBIDDEN = ("LDGSTS", "LDL", "STL")
# split_direct variants: 16-byte loads straight to registers (LDG) and the DSMEM exchange's
# mbarriers (SYNCS); no ring, so no bulk copies either
SASS_REQUIRED_DIRECT = ("LDG", "SYNCS")
SASS_FORBIDDEN_DIRECT = ("LDGSTS", "UBLKCP", "LDL", "STL")

_SMEM_CAPACITY = 227 * 1024  # sm_90 opt-in maximum per block
_SMEM_PER_SM = 228 * 1024  # per SM (1 KiB of it reserved per resident CTA)
_LOG2E = math.log2(math.e)
_CHUNK = 8  # elements per 16-byte chunk
_SMEM_SLACK = 512  # struct alignment padding
_MAXB = 8  # block sources per row at most (NB <= 8)
_NV = 2 * (1 + _MAXB)  # reduced values per row in the batched schedule: (ss, dd) per source
_MAX_LOADS = 2 + _MAXB  # bulk loads per row at most (prefix, delta, blocks)
_XREC = ATTN_RES_XCH_RECORD  # global exchange: 8-byte words per CTA record
assert _XREC == 2 * _NV, "a record holds 2 parities x _NV totals (cutekern/abi.py)"


@dataclass(frozen=True)
class AttnResSm90Config:
    """consumer_warps: compute warps (plus one producer warp) for row_split = 1. Each consumer
        thread owns chunks_per_thread = max_hidden / (256 * consumer_warps) 16-byte chunks of
        a row (4 at 8192, 8 at 16384): one pass of the consumers covers a max_hidden row.
    split_consumer_warps: upper bound of the compute warps for row_split > 1 (reduced to what
        the segment of max_hidden / row_split elements needs: 4 warps at 8192 / 8).
    wq_max_reg_chunks: norm_w * qk_w (fp32) stays in registers when chunks_per_thread is at
        most this; otherwise it lives in shared memory (fp32, conflict-free 16-byte reads)
        so the 16384 tier fits the register file without spills.
    ring_kb: upper bound of the source ring (KiB); clamped to what shared memory has left.
        192 (13 slots at H = 7168, 3 beyond a row's 10 loads) rather than the 224 that fit:
        a shallower look-ahead was 2-5% faster at M = 256..1024 and not slower at 4096 (with
        16 slots the next row's loads competed with the current row's last ones for DRAM;
        224 KiB capped at 13 slots times the same; 11-12 slots lose at M = 4096;
        perf/results/tune_memops_h200_attn_res_ring*.json).
        The ring holds min(max_stages, ring_bytes // (2 seg)) slots at runtime (>= 2).
    max_stages: mbarrier pairs allocated (upper bound of the runtime ring depth).
    split_stages: row_split > 1: ring depth cap (>= 10, one row's loads). The split kernels
        serve M < 128 (at most ~2 rows per cluster), and every mbarrier pair initialized
        costs ~80 cycles on the critical path at M = 1 (H200 timeline: 32 pairs, 1.2 K
        cycles before the first copy).
    num_sms: persistent grid size bound (132 on the H200); the grid is min(M, num_sms *
        ctas_per_sm) CTAs (row_split = 1) or min(M, num_sms * ctas_per_sm / C) clusters.
    ctas_per_sm: resident CTAs per SM targeted (launch bound + shared memory split).
    batched: row_split = 1: use the batched schedule (one reduction for all scores per row)
        whenever every load of a row fits in the ring; False = always the v1 online
        schedule (one reduction per source).
    batched_min_free: row_split = 1: the batched schedule is used only when the ring has at
        least this many slots beyond one row's loads (prefetch of the next row while a row
        is mixed); otherwise the online schedule streams through the ring.
    split_direct: row_split > 1 with at most 2 chunks per thread (the small-M kernels up to
        the 8192 tier at split 2, the 16384 tier from split 4): no producer warp and no ring;
        every thread loads its chunks of all of a row's sources straight into registers
        (16-byte loads, all in flight at once) and mixes from there. Saves the ring's
        mbarrier inits, the producer's one-by-one bulk copies and the shared-memory round
        trips on a latency-bound path; same arithmetic, same bits.
    dynamic_rows: row_split = 1, batched schedule: after its first row (row = CTA index) a
        CTA takes the next unclaimed row from a global counter (the `work` argument; the
        last CTA to finish resets it), instead of every grid-stride row. Per-CTA traces on
        the H200 (perf/trace_attn_res.py) showed some SMs streaming rows ~15-20% slower than
        others for the whole launch, and M / 132 rarely whole: with static rows the slowest
        CTA with the most rows set the end (M=4096: last CTA 190 us, median 168). Same bits
        (a row's arithmetic does not depend on which CTA runs it).
    dynamic_min_loads, dynamic_min_rows: dynamic rows only for rows of at least this many
        loads (K=8 with delta: 10) or launches of at least this many rows. The claim's round
        trip costs ~1 us per launch on short rows at mid M (K=1 M=512-1024: 18.9 -> 19.7 us,
        30.5 -> 31.4 in an A/B), where the imbalance it removes is smaller.
    xchg_global: row_split > 1 (split_direct only): exchange the CTA totals through global
        memory (sequence-tagged 8-byte words in `work`) instead of DSMEM, as a plain launch
        without clusters (see the module docstring). The Ada design's split kernels (sm_80 /
        sm_89 have no clusters) are this build.
    debug_timeline: diagnostics only, never exported by default: consumer thread 0 of the
        CTA(s) of row 0 records clock64 at the phases of the batched and direct schedules
        and writes the cycle counts over the first 64 bytes of its segment of out[0]
        (perf/timeline_attn_res.py reads them).
    debug_trace: diagnostics only (row_split = 1, batched schedule): consumer thread 0 of
        every CTA writes %globaltimer_lo (ns) at kernel entry, when its first row's first slot
        is full, after each of its first 12 rows' stores, at exit, and its row count, as int32
        into its own 16-byte chunks of its first row of out (perf/trace_attn_res.py reads them)."""

    consumer_warps: int = 8
    split_consumer_warps: int = 8
    wq_max_reg_chunks: int = 4
    ring_kb: int = 192
    max_stages: int = 32
    split_stages: int = 12
    split_direct: bool = True
    num_sms: int = 132
    ctas_per_sm: int = 1
    batched: bool = True
    batched_min_free: int = 2
    dynamic_rows: bool = True
    dynamic_min_loads: int = 8
    dynamic_min_rows: int = 2048
    xchg_global: bool = False
    debug_timeline: bool = False
    debug_trace: bool = False


def _layout_numbers(max_hidden: int, cfg: AttnResSm90Config, row_split: int):
    """(consumer warps, chunks per thread, wq in smem, wq smem bytes, ring bytes, max segment
    elements) or None."""
    C = row_split
    if C not in (1, 2, 4, 8) or cfg.ctas_per_sm < 1 or cfg.max_stages < 4:
        return None
    if C == 1:
        nw = cfg.consumer_warps
        if nw < 1 or (nw + 1) * 32 > 1024 or max_hidden % (_CHUNK * 32 * nw) != 0:
            return None
        cpt = max_hidden // (_CHUNK * 32 * nw)
        seg_max = max_hidden
    else:
        seg_ch = -(-(max_hidden // _CHUNK) // C)
        nw = max(1, min(cfg.split_consumer_warps, -(-seg_ch // 32)))
        if (nw + 1) * 32 > 1024:
            return None
        cpt = -(-seg_ch // (32 * nw))
        seg_max = seg_ch * _CHUNK
    if cfg.max_stages > (nw + 1) * 32:  # one thread per mbarrier pair initializes it
        return None
    wq_smem = cpt > cfg.wq_max_reg_chunks
    wq_bytes = nw * 32 * cpt * _CHUNK * 4 if wq_smem else 0
    fixed = (16 * cfg.max_stages + 16 * nw + 4 * (2 * _NV * nw + 2 * nw + 2 * _NV * C + 2 * C)
             + 64 + _SMEM_SLACK + wq_bytes)
    cap = min(_SMEM_CAPACITY, _SMEM_PER_SM // cfg.ctas_per_sm - 1024)
    if C > 1 and cpt <= 2 and cfg.split_direct:
        # split_direct: no ring (AttnResSm90 allocates a token one)
        if cfg.xchg_global and (C not in ATTN_RES_XCH_SPLITS
                                or cfg.num_sms * cfg.ctas_per_sm > ATTN_RES_XCH_MAX_CTAS):
            return None  # a record per CTA of the grid in `work`
        return (nw, cpt, wq_smem, wq_bytes, 128, seg_max) if fixed <= cap else None
    if C > 1 and cfg.xchg_global:
        return None  # the global exchange exists for the direct kernels only
    ring = min(cfg.ring_kb * 1024, cap - fixed) // 128 * 128
    if ring < 2 * 2 * seg_max:  # >= 2 slots at max_hidden
        return None
    if C > 1 and (ring < _MAX_LOADS * 2 * seg_max or cfg.max_stages < _MAX_LOADS
                  or cfg.split_stages < _MAX_LOADS):
        return None  # the split schedule keeps every load of a row resident
    return nw, cpt, wq_smem, wq_bytes, ring, seg_max


@dsl_user_op
def _bulk_g2s(dst: cute.Pointer, src: cute.Pointer, mbar: cute.Pointer, nbytes,
              *, loc=None, ip=None):
    """cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], n, [mbar]"""
    d = dst.to_llvm_ptr(loc=loc, ip=ip)
    d = _llvm.addrspacecast(_llvm.PointerType.get(7), d, loc=loc, ip=ip)  # shared::cluster
    _nvvm.cp_async_bulk_shared_cluster_global(
        d, src.to_llvm_ptr(loc=loc, ip=ip), mbar.to_llvm_ptr(loc=loc, ip=ip),
        Int32(nbytes).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)


@dsl_user_op
def _st_async_f32(dst: cute.Pointer, val: Float32, mbar: cute.Pointer, peer,
                  *, loc=None, ip=None):
    """st.async.shared::cluster.mbarrier::complete_tx::bytes.b32: store val at the address of
    the local smem pointer dst mapped into CTA `peer` of the cluster; 4 bytes complete_tx on
    that CTA's mbarrier at the mapped address of mbar."""
    bits = _llvm.bitcast(Int32.mlir_type, Float32(val).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)
    cute.arch.store_async_dsmem(dst, Int32(bits), mbar, peer, loc=loc, ip=ip)


def split_build(dtype, max_hidden: int, row_split: int, *, split_consumer_warps: int,
                num_sms: int, xchg_global: bool):
    """The split_direct kernel another design runs for small M (Ada: the exchange through
    global memory; sm100: DSMEM), or None where there is none (a row segment of more than
    2 chunks per thread, e.g. the 16384 tier over 2 CTAs)."""
    cfg = AttnResSm90Config(split_consumer_warps=split_consumer_warps, num_sms=num_sms,
                            ctas_per_sm=1, split_direct=True, xchg_global=xchg_global)
    if row_split < 2 or not AttnResSm90.can_implement(dtype, max_hidden, cfg, row_split):
        return None
    kern = AttnResSm90(dtype, max_hidden, cfg, row_split)
    return kern if kern.direct else None


class AttnResSm90:
    def __init__(self, dtype, max_hidden: int, config: AttnResSm90Config = AttnResSm90Config(),
                 row_split: int = 1, online: bool = False):
        if not AttnResSm90.can_implement(dtype, max_hidden, config, row_split):
            raise ValueError(
                f"AttnResSm90 cannot run {dtype}/max_hidden={max_hidden}/row_split={row_split} "
                f"with {config}")
        self.dtype = dtype
        self.max_hidden = max_hidden
        self.cfg = config
        self.row_split = row_split
        # online (row_split = 1): the v1 online schedule only (cutekern.attn_res picks this
        # build for short rows and few rows: H200, H=7168, K=1 M=256 / 1024 / 4096: 10.9 /
        # 28.1 / 83 us vs 12.9 / 30.6 / 84.9 batched; K=8 M=128 13.3 vs 15.0, M=256 20.6 vs
        # 21.5, but M=1024 57.5 vs 55.5; perf/results/tune_memops_h200_attn_res_online.json).
        # A build holding both schedules ran the online one slower (K=1 M=256 11.7 us).
        self.online = bool(online) and row_split == 1
        (self.num_warps_c, self.cpt, self.wq_smem, wq_bytes, ring_bytes,
         self.seg_max) = _layout_numbers(max_hidden, config, row_split)
        # large tier: norm_w * qk_w in smem and each source read twice from its slot
        # (score pass, then mix pass) instead of held in registers across the reduction
        self.reread = self.wq_smem
        self.num_threads_c = self.num_warps_c * 32
        # split kernels with few chunks per thread: sources straight to registers (no ring)
        self.direct = row_split > 1 and self.cpt <= 2 and config.split_direct
        # the direct kernel's exchange through global memory, no cluster (Ada design)
        self.xg = self.direct and config.xchg_global
        self.threads_per_cta = self.num_threads_c + (0 if self.direct else 32)
        if self.direct:
            self.sass_required, self.sass_forbidden = SASS_REQUIRED_DIRECT, SASS_FORBIDDEN_DIRECT
        self.ring_elems = 64 if self.direct else ring_bytes // 2
        self.wq_elems = wq_bytes // 4 if self.wq_smem else 4  # (dummy 16 B when in registers)
        self.max_stages = config.max_stages

    @staticmethod
    def can_implement(dtype, max_hidden, config: AttnResSm90Config, row_split: int = 1) -> bool:
        if dtype is not cutlass.BFloat16:
            return False
        if max_hidden % _CHUNK != 0 or max_hidden < _CHUNK:
            return False
        if (config.max_stages < 2 or config.num_sms < 1 or config.wq_max_reg_chunks < 0
                or config.batched_min_free < 0):
            return False
        return _layout_numbers(max_hidden, config, row_split) is not None

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, prefix: cute.Tensor, delta: cute.Tensor, blocks: cute.Tensor,
                 norm_w: cute.Tensor, qk_w: cute.Tensor, out_norm_w: cute.Tensor,
                 out: cute.Tensor, num_blocks: Int32, write_idx: Int32, has_delta: Int32,
                 has_out_norm: Int32, eps: Float32, out_eps: Float32, work: cute.Tensor,
                 stream: cuda.CUstream):
        M = prefix.shape[0]
        C = self.row_split
        NW = self.num_warps_c

        @cute.struct
        class SharedStorage:
            full: cute.struct.MemRange[Int64, self.max_stages]
            empty: cute.struct.MemRange[Int64, self.max_stages]
            xbar: cute.struct.MemRange[Int64, 4]  # DSMEM exchange: scores [2], out norm [2]
            red: cute.struct.MemRange[Float32, 4 * NW]
            red_s: cute.struct.Align[cute.struct.MemRange[Float32, 2 * _NV * NW], 16]
            red_n: cute.struct.Align[cute.struct.MemRange[Float32, 2 * NW], 16]
            xbuf_s: cute.struct.Align[cute.struct.MemRange[Float32, 2 * _NV * C], 16]
            xbuf_n: cute.struct.Align[cute.struct.MemRange[Float32, 2 * C], 16]
            wq: cute.struct.Align[cute.struct.MemRange[Float32, self.wq_elems], 16]
            rowid: cute.struct.MemRange[Int32, self.max_stages]  # dynamic_rows: row of a slot
            ring: cute.struct.Align[cute.struct.MemRange[self.dtype, self.ring_elems], 128]

        self.shared_storage = SharedStorage

        if cutlass.const_expr(C == 1):
            grid = cutlass.min(M, self.cfg.num_sms * self.cfg.ctas_per_sm)
            self.kernel(prefix, delta, blocks, norm_w, qk_w, out_norm_w, out, num_blocks,
                        write_idx, has_delta, has_out_norm, eps, out_eps, work).launch(
                grid=[grid, 1, 1],
                block=[self.threads_per_cta, 1, 1],
                stream=stream,
                **self._occupancy_kw(),
            )
        elif cutlass.const_expr(self.xg):
            # groups of C consecutive CTAs, no cluster: the exchange goes through `work`
            ngrp = cutlass.min(M, max(1, self.cfg.num_sms * self.cfg.ctas_per_sm // C))
            self.kernel(prefix, delta, blocks, norm_w, qk_w, out_norm_w, out, num_blocks,
                        write_idx, has_delta, has_out_norm, eps, out_eps, work).launch(
                grid=[ngrp * C, 1, 1],
                block=[self.threads_per_cta, 1, 1],
                stream=stream,
                **self._occupancy_kw(),
            )
        else:
            nclu = cutlass.min(M, max(1, self.cfg.num_sms * self.cfg.ctas_per_sm // C))
            self.kernel(prefix, delta, blocks, norm_w, qk_w, out_norm_w, out, num_blocks,
                        write_idx, has_delta, has_out_norm, eps, out_eps, work).launch(
                grid=[nclu * C, 1, 1],
                block=[self.threads_per_cta, 1, 1],
                cluster=[C, 1, 1],
                stream=stream,
                **self._occupancy_kw(),
            )

    def _occupancy_kw(self) -> dict:
        # ctas_per_sm > 1: launch bound (register cap) and the full shared-memory carveout
        # (stated, so that compiling needs no device query)
        if self.cfg.ctas_per_sm > 1:
            return {"min_blocks_per_mp": self.cfg.ctas_per_sm, "preferred_smem_carveout": 100}
        return {"min_blocks_per_mp": 1}

    # ---------------------------------------------------------------- device side
    @cute.jit
    def _advance(self, slot: Int32, phase: Int32, n_st: Int32):
        slot = slot + 1
        if slot == n_st:
            slot = Int32(0)
            phase = phase ^ 1
        return slot, phase

    @cute.jit
    def _skip(self, slot: Int32, phase: Int32, n_st: Int32, n: Int32):
        """(slot, phase) n loads later; 0 <= n <= n_st."""
        slot = slot + n
        if slot >= n_st:
            slot = slot - n_st
            phase = phase ^ 1
        return slot, phase

    @cute.jit
    def _produce(self, full, empty, ring, slot: Int32, phase: Int32, n_st: Int32,
                 src: cute.Pointer, stride: Int32, nbytes: Int32):
        cute.arch.mbarrier_wait(empty + slot, phase ^ 1)
        cute.arch.mbarrier_arrive_and_expect_tx(full + slot, nbytes)
        if cutlass.const_expr(self.row_split == 1):
            _bulk_g2s(ring + slot * stride, src, full + slot, nbytes)
        else:
            if nbytes > 0:  # empty segment (short H): arrival only, no copy
                _bulk_g2s(ring + cute.assume(slot * stride, divby=_CHUNK), src, full + slot,
                          nbytes)
        return self._advance(slot, phase, n_st)

    @cute.jit
    def _load_slot(self, ring, slot: Int32, H: Int32, tidx: Int32, nchunk: Int32,
                   dst: cute.Tensor):
        """dst[:, k] <- the thread's chunk k of ring slot `slot` (valid chunks only).
        H: the slot stride (elements)."""
        base = ring + cute.assume(slot * H, divby=_CHUNK)
        for k in cutlass.range_constexpr(self.cpt):
            j = k * self.num_threads_c + tidx
            if j < nchunk:
                src = cute.make_tensor(base + cute.assume(j * _CHUNK, divby=_CHUNK),
                                       cute.make_layout(_CHUNK))
                dst[None, k].store(src.load())

    @cute.jit
    def _add_slot(self, ring, slot: Int32, H: Int32, tidx: Int32, nchunk: Int32,
                  acc: cute.Tensor):
        """acc[:, k] <- bf16(fp32(acc[:, k]) + fp32(chunk k of ring slot `slot`)), round to
        nearest even (one fp32 add of two bf16 values: bit-exact vs the reference)."""
        base = ring + cute.assume(slot * H, divby=_CHUNK)
        for k in cutlass.range_constexpr(self.cpt):
            j = k * self.num_threads_c + tidx
            if j < nchunk:
                src = cute.make_tensor(base + cute.assume(j * _CHUNK, divby=_CHUNK),
                                       cute.make_layout(_CHUNK))
                acc[None, k].store(
                    (widen(acc[None, k].load()) + widen(src.load())).to(self.dtype))

    @cute.jit
    def _mix_slot(self, ring, slot: Int32, H: Int32, tidx: Int32, nchunk: Int32,
                  acc: cute.Tensor, corr: Float32, e: Float32):
        """acc[:, k] <- acc[:, k] * corr + e * fp32(chunk k of ring slot `slot`) (valid k;
        the others stay 0)."""
        base = ring + cute.assume(slot * H, divby=_CHUNK)
        for k in cutlass.range_constexpr(self.cpt):
            j = k * self.num_threads_c + tidx
            if j < nchunk:
                src = cute.make_tensor(base + cute.assume(j * _CHUNK, divby=_CHUNK),
                                       cute.make_layout(_CHUNK))
                acc[None, k].store(acc[None, k].load() * corr + widen(src.load()) * e)

    @cute.jit
    def _axpy_slot(self, ring, slot: Int32, H: Int32, tidx: Int32, nchunk: Int32,
                   acc: cute.Tensor, e: Float32):
        """acc[:, k] += e * fp32(chunk k of ring slot `slot`) (valid k)."""
        base = ring + cute.assume(slot * H, divby=_CHUNK)
        for k in cutlass.range_constexpr(self.cpt):
            j = k * self.num_threads_c + tidx
            if j < nchunk:
                src = cute.make_tensor(base + cute.assume(j * _CHUNK, divby=_CHUNK),
                                       cute.make_layout(_CHUNK))
                acc[None, k].store(acc[None, k].load() + widen(src.load()) * e)

    @cute.jit
    def _normed_out(self, acc: cute.Tensor, r: Float32, g: cute.Tensor, cp: cute.Tensor):
        """cp <- bf16(acc * r * g): the output RMSNorm's last step (g: out_norm_w chunks)."""
        for k in cutlass.range_constexpr(self.cpt):
            cp[None, k].store((acc[None, k].load() * r * widen(g[None, k].load())).to(self.dtype))

    @cute.jit
    def _store_row(self, gbase: cute.Pointer, tidx: Int32, nchunk: Int32, val: cute.Tensor):
        for k in cutlass.range_constexpr(self.cpt):
            j = k * self.num_threads_c + tidx
            if j < nchunk:
                dst = cute.make_tensor(gbase + cute.assume(j * _CHUNK, divby=_CHUNK),
                                       cute.make_layout(_CHUNK))
                dst.store(val[None, k].load())

    @cute.jit
    def _load_gvec(self, g: cute.Tensor, cbase: Int32, tidx: Int32, nchunk: Int32,
                   dst: cute.Tensor):
        """dst[:, k] <- g[cbase + 8 j : cbase + 8 j + 8], j = k * NT + tidx (valid j only)."""
        for k in cutlass.range_constexpr(self.cpt):
            j = k * self.num_threads_c + tidx
            if j < nchunk:
                src = cute.make_tensor(g.iterator + cute.assume(cbase + j * _CHUNK,
                                                                divby=_CHUNK),
                                       cute.make_layout(_CHUNK))
                dst[None, k].store(src.load())

    @cute.jit
    def _partials(self, c: cute.Tensor, wq: cute.Tensor, tidx: Int32):
        """(sum c^2, sum c * wq) over the thread's chunks: up to 4 independent FMA chains
        (chunk k feeds chain k % 4), then a tree; not one 8 * CPT long chain."""
        nch = min(self.cpt, 4)
        ssk = cute.make_rmem_tensor((nch,), Float32)
        ddk = cute.make_rmem_tensor((nch,), Float32)
        for k in cutlass.range_constexpr(self.cpt):
            x = widen(c[None, k].load())
            if cutlass.const_expr(self.wq_smem):
                q = wq[None, tidx, k].load()
            else:
                q = wq[None, k].load()
            if cutlass.const_expr(k < nch):
                a = x[0] * x[0]
                b = x[0] * q[0]
            else:
                a = ssk[k % nch] + x[0] * x[0]
                b = ddk[k % nch] + x[0] * q[0]
            for e in cutlass.range_constexpr(1, _CHUNK):
                a = a + x[e] * x[e]
                b = b + x[e] * q[e]
            ssk[k % nch] = a
            ddk[k % nch] = b
        return self._tree(ssk), self._tree(ddk)

    @cute.jit
    def _sumsq(self, acc: cute.Tensor):
        nch = min(self.cpt, 4)
        sqk = cute.make_rmem_tensor((nch,), Float32)
        for k in cutlass.range_constexpr(self.cpt):
            x = acc[None, k].load()
            if cutlass.const_expr(k < nch):
                a = x[0] * x[0]
            else:
                a = sqk[k % nch] + x[0] * x[0]
            for e2 in cutlass.range_constexpr(1, _CHUNK):
                a = a + x[e2] * x[e2]
            sqk[k % nch] = a
        return self._tree(sqk)

    def _tree(self, v: cute.Tensor):
        """Pairwise sum of a small register vector (static size)."""
        vals = [v[k] for k in range(cute.size(v))]
        while len(vals) > 1:
            nxt = [vals[i] + vals[i + 1] for i in range(0, len(vals) - 1, 2)]
            if len(vals) % 2:
                nxt.append(vals[-1])
            vals = nxt
        return vals[0]

    @cute.jit
    def _warp_sum2(self, a: Float32, b: Float32):
        for i in cutlass.range_constexpr(5):
            a = a + cute.arch.shuffle_sync_bfly(a, offset=16 >> i)
            b = b + cute.arch.shuffle_sync_bfly(b, offset=16 >> i)
        return a, b

    @cute.jit
    def _cta_sum2(self, a: Float32, b: Float32, red: cute.Tensor, par: Int32, warp: Int32,
                  lane: Int32):
        """Sum of the warp totals a, b over the consumer warps (one named barrier)."""
        if lane == 0:
            red[(0, warp, par)] = a
            red[(1, warp, par)] = b
        cute.arch.barrier(barrier_id=1, number_of_threads=self.num_threads_c)
        sa = Float32(0.0)
        sb = Float32(0.0)
        for w in cutlass.range_constexpr(self.num_warps_c):
            sa = sa + red[(0, w, par)]
            sb = sb + red[(1, w, par)]
        return sa, sb

    @cute.jit
    def _vsum(self, t: cute.Tensor):
        """Sum of a contiguous static-size fp32 vector in shared memory (vector loads)."""
        n = cute.size(t)
        r = cute.make_rmem_tensor((n,), Float32)
        r.store(t.load())
        return self._tree(r)

    @cute.jit
    def _lane_totals(self, t: cute.Tensor, tot: cute.Tensor, par: Int32, lane: Int32):
        """tot[v] <- sum of t[:, v, par] (the tree of _vsum): lane v sums value v and
        broadcasts it, 18 shuffles instead of every thread summing all 18 columns."""
        vl = lane
        if lane >= _NV:
            vl = Int32(0)
        val = self._vsum(t[(None, vl, par)])
        for v in cutlass.range_constexpr(_NV):
            tot[v] = cute.arch.shuffle_sync(val, v)

    @cute.jit
    def _xch_sum(self, grp: cute.Pointer, idx: Int32, seq: Int32):
        """Global exchange: the sum over the group's C records of word idx, once every one
        carries sequence number seq (polled; the same tree over ranks as _vsum of the DSMEM
        buffer, so the same bits)."""
        C = self.row_split
        vals = cute.make_rmem_tensor((C,), Float32)
        done = Int32(0)
        while done == 0:
            done = Int32(1)
            for r in cutlass.range_constexpr(C):
                w = cute.arch.load(grp + (r * _XREC + idx), Int64, sem="relaxed", scope="gpu")
                if Int32(w >> 32) != seq:
                    done = Int32(0)
                vals[r] = _bits_f32(Int32(w))
        return self._tree(vals)

    @cute.jit
    def _score_totals(self, part: cute.Tensor, red_s: cute.Tensor, xbuf_s: cute.Tensor, xbar,
                      tot: cute.Tensor, par: Int32, xph: Int32, rank: Int32, tidx: Int32,
                      warp: Int32, lane: Int32, tl: cute.Tensor, xch=None):
        """tot <- the row's (sum c^2, dot) totals of every source from the threads' partials:
        one batched butterfly (independent shuffles), one barrier, and (row_split > 1) one
        DSMEM exchange of the CTA totals (st.async, complete_tx on each CTA's xbar), or with
        xch = (group records, own record, sequence number) one exchange through global
        memory (xchg_global)."""
        C = self.row_split
        # reduce-scatter butterfly: at each level a lane keeps one half of its values (the
        # upper half when its lane bit is set, padded to even) and adds the partner's copy of
        # that half, so 9 + 5 + 3 + 2 + 1 = 20 shuffles instead of 5 x 18 (the shuffle unit,
        # shared by the SM's warps, set the pace: ~550 of the cycles at M = 1). Lane L ends
        # with the warp total of value `first` (none when rlen == 0). Fixed by the lane: the
        # same bits every run, in every schedule that calls this.
        first = Int32(0)
        rlen = Int32(_NV)
        n = _NV
        for i in cutlass.range_constexpr(5):
            off = 16 >> i
            if cutlass.const_expr(n % 2 == 1):
                part[n] = Float32(0.0)
                n = n + 1
            h = n // 2
            up = (lane & off) != 0
            for k in cutlass.range_constexpr(h):
                keep = part[k]
                send = part[h + k]
                if up:
                    keep = part[h + k]
                    send = part[k]
                part[k] = keep + cute.arch.shuffle_sync_bfly(send, offset=off)
            if up:
                first = first + h
                rlen = cutlass.max(rlen - h, Int32(0))
            else:
                rlen = cutlass.min(rlen, Int32(h))
            n = h
        if rlen > 0:
            red_s[(warp, first, par)] = part[0]
        cute.arch.barrier(barrier_id=1, number_of_threads=self.num_threads_c)
        if cutlass.const_expr(self.cfg.debug_timeline):
            tl[4] = cute.arch.clock64()
        if cutlass.const_expr(C == 1):
            self._lane_totals(red_s, tot, par, lane)
        elif cutlass.const_expr(self.xg):
            grp, own, seq = xch
            xo = (seq & 1) * _NV
            if tidx < _NV:
                _xch_put(own + (xo + tidx), self._vsum(red_s[(None, tidx, par)]), seq)
            # lane v polls and sums value v of every rank (each warp on its own: no barrier)
            vl = lane
            if lane >= _NV:
                vl = Int32(0)
            val = self._xch_sum(grp, xo + vl, seq)
            for v in cutlass.range_constexpr(_NV):
                tot[v] = cute.arch.shuffle_sync(val, v)
        else:
            if tidx < _NV:
                val = self._vsum(red_s[(None, tidx, par)])
                if tidx == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(xbar + par, C * _NV * 4)
                dst = xbuf_s.iterator + ((par * _NV + tidx) * C + rank)
                for r in cutlass.range_constexpr(C):
                    _st_async_f32(dst, val, xbar + par, r)
            cute.arch.mbarrier_wait(xbar + par, xph)
            self._lane_totals(xbuf_s, tot, par, lane)

    @cute.jit
    def _softmax(self, tot: cute.Tensor, tb: cute.Tensor, eb: cute.Tensor, nsrc_b: Int32,
                 lg_mult: Float32, inv_h: Float32, eps: Float32):
        """Softmax over the sources from the totals (p's score raised by log2 of its
        multiplicity): returns (p's weight numerator, 1 / sum); eb[j] = block j's numerator."""
        tp = cute.math.rsqrt(tot[0] * inv_h + eps, fastmath=True) * tot[1] * _LOG2E + lg_mult
        mx = tp
        for j in cutlass.range_constexpr(_MAXB):
            tb[j] = tp
            if j < nsrc_b:
                tb[j] = (cute.math.rsqrt(tot[2 + 2 * j] * inv_h + eps, fastmath=True)
                         * tot[3 + 2 * j] * _LOG2E)
            mx = cute.arch.fmax(mx, tb[j])
        ep = cute.math.exp2(tp - mx, fastmath=True)
        lsum = ep
        for j in cutlass.range_constexpr(_MAXB):
            eb[j] = Float32(0.0)
            if j < nsrc_b:
                eb[j] = cute.math.exp2(tb[j] - mx, fastmath=True)
            lsum = lsum + eb[j]
        return ep, Float32(1.0) / lsum

    @cute.jit
    def _out_row(self, acc: cute.Tensor, gn: cute.Tensor, cp: cute.Tensor, red_n: cute.Tensor,
                 xbuf_n: cute.Tensor, xbar, par: Int32, xph: Int32, rank: Int32,
                 has_out_norm: Int32, inv_h: Float32, out_eps: Float32, tidx: Int32,
                 warp: Int32, lane: Int32, xch=None):
        """cp <- bf16 of the mix acc, output-RMSNormed with weight gn when has_out_norm (one
        more reduction and, row_split > 1, one more DSMEM exchange)."""
        C = self.row_split
        CPT = self.cpt
        if has_out_norm != 0:
            sq = self._sumsq(acc)
            for i in cutlass.range_constexpr(5):
                sq = sq + cute.arch.shuffle_sync_bfly(sq, offset=16 >> i)
            if lane == 0:
                red_n[(warp, par)] = sq
            cute.arch.barrier(barrier_id=1, number_of_threads=self.num_threads_c)
            tot_n = Float32(0.0)
            if cutlass.const_expr(C == 1):
                tot_n = self._vsum(red_n[(None, par)])
            elif cutlass.const_expr(self.xg):
                grp, own, seq = xch
                xo = (seq & 1) * _NV
                if tidx == 0:
                    _xch_put(own + xo, self._vsum(red_n[(None, par)]), seq)
                tot_n = self._xch_sum(grp, xo, seq)  # one address: one request per warp
            else:
                if tidx == 0:
                    valn = self._vsum(red_n[(None, par)])
                    cute.arch.mbarrier_arrive_and_expect_tx(xbar + 2 + par, C * 4)
                    dstn = xbuf_n.iterator + (par * C + rank)
                    for r in cutlass.range_constexpr(C):
                        _st_async_f32(dstn, valn, xbar + 2 + par, r)
                cute.arch.mbarrier_wait(xbar + 2 + par, xph)
                tot_n = self._vsum(xbuf_n[(None, par)])
            rr = cute.math.rsqrt(tot_n * inv_h + out_eps, fastmath=True)
            self._normed_out(acc, rr, gn, cp)
        else:
            for k in cutlass.range_constexpr(CPT):
                cp[None, k].store(acc[None, k].load().to(self.dtype))

    @cute.jit
    def _rows_batched(self, ring, full, empty, xbar, red_s, red_n, xbuf_s, xbuf_n,
                      wq, cp, cs, acc, prefix: cute.Tensor, delta: cute.Tensor,
                      blocks: cute.Tensor, out_norm_w: cute.Tensor, out: cute.Tensor,
                      cid: Int32, ncl: Int32, rank: Int32, seg: Int32, cbase: Int32,
                      nchunk: Int32, n_st: Int32, w_idx: Int32, nsrc_b: Int32,
                      lg_mult: Float32, has_delta: Int32, has_out_norm: Int32,
                      eps: Float32, out_eps: Float32, tidx: Int32, warp: Int32, lane: Int32,
                      tl: cute.Tensor, rowid: cute.Tensor, dyn: Int32):
        """Batched schedule: per row, every load of the row is resident in the ring (the
        caller guarantees 1 + has_delta + nsrc_b <= n_st); one reduction (and, row_split > 1,
        one DSMEM exchange) for all scores, one for the output norm. dyn != 0: the rows are
        the producer's (rowid of each row's prefix slot; -1 ends), else cid, cid + ncl, ..."""
        CPT = self.cpt
        C = self.row_split
        M = prefix.shape[0]
        H = prefix.shape[1]
        s_pre = prefix.stride[0]
        s_out = out.stride[0]
        s_bm = blocks.stride[0]
        s_bn = blocks.stride[1]
        inv_h = Float32(1.0) / Float32(H)
        cb64 = Int64(cbase)

        part = cute.make_rmem_tensor((_NV,), Float32)
        mixv = None
        if cutlass.const_expr(C > 1 and CPT == 1):
            # the mix's slot chunks (zero where a thread has no chunk: _load_slot skips it)
            mixv = [cute.make_rmem_tensor((_CHUNK, 1), self.dtype) for _ in range(_MAXB)]
            for j in cutlass.range_constexpr(_MAXB):
                mixv[j].fill(0.0)
        tot = cute.make_rmem_tensor((_NV,), Float32)
        tb = cute.make_rmem_tensor((_MAXB,), Float32)
        eb = cute.make_rmem_tensor((_MAXB,), Float32)

        # out_norm_w of this thread's chunks, loaded once (rows share it) when it fits
        # (CPT > 4: reloaded into cs per row, fewer registers)
        if cutlass.const_expr(CPT <= 4):
            gn = cute.make_rmem_tensor((_CHUNK, CPT), self.dtype)
            gn.fill(0.0)
            if has_out_norm != 0:
                self._load_gvec(out_norm_w, cbase, tidx, nchunk, gn)
        else:
            gn = cs

        slot = Int32(0)
        phase = Int32(0)
        it = Int32(0)
        row = cid
        if dyn != 0:
            cute.arch.mbarrier_wait(full + slot, phase)
            row = rowid[slot]
        while (row >= 0) & (row < M):
            r64 = Int64(row)
            par = it & 1
            xph = (it >> 1) & 1
            # ---- p = prefix (+ delta); both slots are released once p is in registers
            slot_p = slot
            cute.arch.mbarrier_wait(full + slot, phase)
            if cutlass.const_expr(self.cfg.debug_timeline):
                tl[2] = cute.arch.clock64()
            if cutlass.const_expr(self.cfg.debug_trace):
                if it == 0:
                    tl[13] = cute.arch.globaltimer()
            self._load_slot(ring, slot, seg, tidx, nchunk, cp)
            slot, phase = self._advance(slot, phase, n_st)
            slot_d = slot
            if has_delta != 0:
                cute.arch.mbarrier_wait(full + slot, phase)
                self._add_slot(ring, slot, seg, tidx, nchunk, cp)
                slot, phase = self._advance(slot, phase, n_st)
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.mbarrier_arrive(empty + slot_p)
                if has_delta != 0:
                    cute.arch.mbarrier_arrive(empty + slot_d)
            if has_delta != 0:
                self._store_row(
                    prefix.iterator + cute.assume(r64 * Int64(s_pre) + cb64, divby=_CHUNK),
                    tidx, nchunk, cp)
            if w_idx >= 0:
                off_w = r64 * Int64(s_bm) + Int64(w_idx) * Int64(s_bn) + cb64
                self._store_row(blocks.iterator + cute.assume(off_w, divby=_CHUNK),
                                tidx, nchunk, cp)
            slot_b = slot
            ph_b = phase
            slot, phase = self._skip(slot, phase, n_st, nsrc_b)

            # ---- partials of every source (block sources read from their slots)
            a, b = self._partials(cp, wq, tidx)
            part[0] = a
            part[1] = b
            for j in cutlass.range_constexpr(_MAXB):
                part[2 + 2 * j] = Float32(0.0)
                part[3 + 2 * j] = Float32(0.0)
                if j < nsrc_b:
                    sj, pj = self._skip(slot_b, ph_b, n_st, Int32(j))
                    cute.arch.mbarrier_wait(full + sj, pj)
                    self._load_slot(ring, sj, seg, tidx, nchunk, cs)
                    a2, b2 = self._partials(cs, wq, tidx)
                    part[2 + 2 * j] = a2
                    part[3 + 2 * j] = b2
            if cutlass.const_expr(self.cfg.debug_timeline):
                tl[3] = cute.arch.clock64()
            self._score_totals(part, red_s, xbuf_s, xbar, tot, par, xph, rank, tidx, warp,
                               lane, tl)
            if cutlass.const_expr(self.cfg.debug_timeline):
                tl[5] = cute.arch.clock64()
            ep, inv_l = self._softmax(tot, tb, eb, nsrc_b, lg_mult, inv_h, eps)

            # ---- mix (slots re-read, each released after its read)
            wp = ep * inv_l
            for k in cutlass.range_constexpr(CPT):
                acc[None, k].store(widen(cp[None, k].load()) * wp)
            if cutlass.const_expr(C > 1 and CPT == 1):
                # small M is latency: every slot's chunk is read first (independent shared
                # memory loads, 8 bf16 registers each), then the FMAs, then one release
                # pass (was ~1.45 K cycles of load -> FMA -> sync per slot at M = 1)
                for j in cutlass.range_constexpr(_MAXB):
                    if j < nsrc_b:
                        sj, pj = self._skip(slot_b, ph_b, n_st, Int32(j))
                        self._load_slot(ring, sj, seg, tidx, nchunk, mixv[j])
                for j in cutlass.range_constexpr(_MAXB):
                    if j < nsrc_b:
                        acc[None, 0].store(acc[None, 0].load()
                                           + widen(mixv[j][None, 0].load()) * (eb[j] * inv_l))
                cute.arch.sync_warp()
                if lane == 0:
                    for j in cutlass.range_constexpr(_MAXB):
                        if j < nsrc_b:
                            sj, pj = self._skip(slot_b, ph_b, n_st, Int32(j))
                            cute.arch.mbarrier_arrive(empty + sj)
            else:
                for j in cutlass.range_constexpr(_MAXB):
                    if j < nsrc_b:
                        sj, pj = self._skip(slot_b, ph_b, n_st, Int32(j))
                        self._axpy_slot(ring, sj, seg, tidx, nchunk, acc, eb[j] * inv_l)
                        cute.arch.sync_warp()
                        if lane == 0:
                            cute.arch.mbarrier_arrive(empty + sj)

            if cutlass.const_expr(self.cfg.debug_timeline):
                tl[6] = cute.arch.clock64()
            # ---- output RMSNorm, store
            if cutlass.const_expr(CPT > 4):
                if has_out_norm != 0:
                    self._load_gvec(out_norm_w, cbase, tidx, nchunk, cs)  # gn is cs
            self._out_row(acc, gn, cp, red_n, xbuf_n, xbar, par, xph, rank, has_out_norm,
                          inv_h, out_eps, tidx, warp, lane)
            if cutlass.const_expr(self.cfg.debug_timeline):
                tl[7] = cute.arch.clock64()
            self._store_row(
                out.iterator + cute.assume(r64 * Int64(s_out) + cb64, divby=_CHUNK),
                tidx, nchunk, cp)
            if cutlass.const_expr(self.cfg.debug_timeline):
                tl[8] = cute.arch.clock64()
            if cutlass.const_expr(self.cfg.debug_trace and C == 1):
                if (tidx == 0) & (it < 12):
                    if it == 0:
                        self._trace_put(out, cid, Int32(0), tl[12])
                        self._trace_put(out, cid, Int32(1), tl[13])
                    self._trace_put(out, cid, 3 + it, cute.arch.globaltimer())
            it = it + 1
            if dyn != 0:
                cute.arch.mbarrier_wait(full + slot, phase)
                row = rowid[slot]
            else:
                row = row + ncl
        if cutlass.const_expr(self.cfg.debug_trace and C == 1):
            if (tidx == 0) & (it > 0):
                self._trace_put(out, cid, Int32(2), cute.arch.globaltimer())
                self._trace_put(out, cid, Int32(15), Int64(it))

    @cute.jit
    def _trace_put(self, out: cute.Tensor, row: Int32, i: Int32, val: Int64):
        """debug_trace: int32 mark i (< 16) into thread 0's chunk i // 4 of out[row]."""
        base = cute.recast_ptr(out.iterator + Int64(row) * Int64(out.stride[0]), dtype=Int32)
        t = cute.make_tensor(base, cute.make_layout(16 * self.num_threads_c))
        t[(i // 4) * 4 * self.num_threads_c + i % 4] = Int32(val & Int64(0xFFFFFFFF))

    @cute.jit
    def _load_row(self, gbase: cute.Pointer, tidx: Int32, nchunk: Int32, dst: cute.Tensor):
        """dst[:, k] <- the thread's chunk k of the row segment at gbase (valid chunks only)."""
        for k in cutlass.range_constexpr(self.cpt):
            j = k * self.num_threads_c + tidx
            if j < nchunk:
                src = cute.make_tensor(gbase + cute.assume(j * _CHUNK, divby=_CHUNK),
                                       cute.make_layout(_CHUNK))
                dst[None, k].store(src.load())

    @cute.jit
    def _issue_row(self, row, prefix: cute.Tensor, delta: cute.Tensor, blocks: cute.Tensor,
                   cbase: Int32, nchunk: Int32, w_idx: Int32, nsrc_b: Int32, has_delta: Int32,
                   tidx: Int32, cp: cute.Tensor, cd: cute.Tensor, src):
        """Every load of row `row` (prefix, delta, block sources), independent, in flight."""
        r64 = Int64(row)
        cb64 = Int64(cbase)
        self._load_row(prefix.iterator + cute.assume(r64 * Int64(prefix.stride[0]) + cb64,
                                                     divby=_CHUNK), tidx, nchunk, cp)
        if has_delta != 0:
            self._load_row(delta.iterator + cute.assume(r64 * Int64(delta.stride[0]) + cb64,
                                                        divby=_CHUNK), tidx, nchunk, cd)
        for j in cutlass.range_constexpr(_MAXB):
            if j < nsrc_b:
                bi = Int32(j)  # block index of source j: slot w (= p) is skipped
                if (w_idx >= 0) & (j >= w_idx):
                    bi = Int32(j + 1)
                off = r64 * Int64(blocks.stride[0]) + Int64(bi) * Int64(blocks.stride[1]) + cb64
                self._load_row(blocks.iterator + cute.assume(off, divby=_CHUNK), tidx,
                               nchunk, src[j])

    def _direct_regs(self):
        """split_direct registers: p, delta, the block sources, out_norm_w (bf16; chunks past
        the segment are never loaded and stay 0)."""
        CPT = self.cpt
        cp = cute.make_rmem_tensor((_CHUNK, CPT), self.dtype)
        cd = cute.make_rmem_tensor((_CHUNK, CPT), self.dtype)
        src = [cute.make_rmem_tensor((_CHUNK, CPT), self.dtype) for _ in range(_MAXB)]
        gn = cute.make_rmem_tensor((_CHUNK, CPT), self.dtype)
        cp.fill(0.0)
        cd.fill(0.0)
        gn.fill(0.0)
        for j in range(_MAXB):
            src[j].fill(0.0)
        return cp, cd, src, gn

    @cute.jit
    def _rows_direct(self, dregs, xbar, red_s, red_n, xbuf_s, xbuf_n, wq, nw_r, qw_r,
                     prefix: cute.Tensor,
                     delta: cute.Tensor, blocks: cute.Tensor, out_norm_w: cute.Tensor,
                     out: cute.Tensor, cid: Int32, ncl: Int32, rank: Int32, cbase: Int32,
                     nchunk: Int32, w_idx: Int32, nsrc_b: Int32, lg_mult: Float32,
                     has_delta: Int32, has_out_norm: Int32, eps: Float32, out_eps: Float32,
                     tidx: Int32, warp: Int32, lane: Int32, tl: cute.Tensor,
                     work: cute.Tensor, bid: Int32):
        """Split kernels (row_split > 1, cfg.split_direct): the batched schedule with every
        source of a row loaded straight into registers; the same arithmetic (and so the same
        bits) as _rows_batched. The first row's loads went out at kernel entry (dregs, before
        anything waits); each next row's loads go out as soon as the current row's registers
        are free."""
        CPT = self.cpt
        M = prefix.shape[0]
        H = prefix.shape[1]
        s_pre = prefix.stride[0]
        s_out = out.stride[0]
        s_bm = blocks.stride[0]
        s_bn = blocks.stride[1]
        inv_h = Float32(1.0) / Float32(H)
        cb64 = Int64(cbase)

        cp, cd, src, gn = dregs
        if has_out_norm != 0:
            self._load_gvec(out_norm_w, cbase, tidx, nchunk, gn)
        acc = cute.make_rmem_tensor((_CHUNK, CPT), Float32)
        part = cute.make_rmem_tensor((_NV,), Float32)
        tot = cute.make_rmem_tensor((_NV,), Float32)
        tb = cute.make_rmem_tensor((_MAXB,), Float32)
        eb = cute.make_rmem_tensor((_MAXB,), Float32)

        # xchg_global: this group's records in `work` (region of split C, CTAs in block
        # order) and the last sequence number this CTA published (the later of its two
        # parities; equal in every CTA of the group). Every thread reads it before the first
        # exchange's barrier, so no CTA overwrites it before all have read it.
        xgrp = None
        xown = None
        xseq = Int32(0)
        if cutlass.const_expr(self.xg):
            C = self.row_split
            rec0 = (ATTN_RES_XCH_SPLITS.index(C) * ATTN_RES_XCH_MAX_CTAS) * _XREC
            xgrp = cute.make_ptr(
                Int64, work.iterator.toint() + Int64(ATTN_RES_XCH_OFF_WORDS * 4)
                + (Int64(rec0) + Int64(bid - rank) * Int64(_XREC)) * Int64(8),
                cute.AddressSpace.gmem, assumed_align=8)
            xown = xgrp + rank * _XREC
            s0 = _xch_seq(xown)
            s1 = _xch_seq(xown + _NV)
            xseq = s1
            if s0 - s1 == 1:
                xseq = s0

        for k in cutlass.range_constexpr(CPT):
            wq[None, k].store(nw_r[None, k].load().to(Float32) * qw_r[None, k].load().to(Float32))
        if cutlass.const_expr(not self.xg):
            # peers store into this CTA's xbuf / xbar only after this (the kernel arrived)
            cute.arch.cluster_wait()

        it = Int32(0)
        for row in range(cid, M, ncl):
            r64 = Int64(row)
            par = it & 1
            xph = (it >> 1) & 1
            # ---- p = bf16(prefix + delta): written back, and to blocks[w]
            if has_delta != 0:
                for k in cutlass.range_constexpr(CPT):
                    cp[None, k].store(
                        (widen(cp[None, k].load()) + widen(cd[None, k].load()))
                        .to(self.dtype))
                self._store_row(
                    prefix.iterator + cute.assume(r64 * Int64(s_pre) + cb64, divby=_CHUNK),
                    tidx, nchunk, cp)
            if w_idx >= 0:
                off_w = r64 * Int64(s_bm) + Int64(w_idx) * Int64(s_bn) + cb64
                self._store_row(blocks.iterator + cute.assume(off_w, divby=_CHUNK),
                                tidx, nchunk, cp)

            # ---- partials, one batched butterfly, one barrier, one DSMEM exchange
            a, b = self._partials(cp, wq, tidx)
            if cutlass.const_expr(self.cfg.debug_timeline):
                tl[2] = cute.arch.clock64()
            part[0] = a
            part[1] = b
            for j in cutlass.range_constexpr(_MAXB):
                part[2 + 2 * j] = Float32(0.0)
                part[3 + 2 * j] = Float32(0.0)
                if j < nsrc_b:
                    a2, b2 = self._partials(src[j], wq, tidx)
                    part[2 + 2 * j] = a2
                    part[3 + 2 * j] = b2
            if cutlass.const_expr(self.cfg.debug_timeline):
                tl[3] = cute.arch.clock64()
            if cutlass.const_expr(self.xg):
                xseq = xseq + 1
            self._score_totals(part, red_s, xbuf_s, xbar, tot, par, xph, rank, tidx, warp,
                               lane, tl, (xgrp, xown, xseq))
            if cutlass.const_expr(self.cfg.debug_timeline):
                tl[5] = cute.arch.clock64()
            ep, inv_l = self._softmax(tot, tb, eb, nsrc_b, lg_mult, inv_h, eps)

            # ---- mix from registers
            wp = ep * inv_l
            for k in cutlass.range_constexpr(CPT):
                acc[None, k].store(widen(cp[None, k].load()) * wp)
            for j in cutlass.range_constexpr(_MAXB):
                if j < nsrc_b:
                    e = eb[j] * inv_l
                    for k in cutlass.range_constexpr(CPT):
                        acc[None, k].store(acc[None, k].load()
                                           + widen(src[j][None, k].load()) * e)
            if cutlass.const_expr(self.cfg.debug_timeline):
                tl[6] = cute.arch.clock64()

            # ---- output RMSNorm (one more exchange), store
            if cutlass.const_expr(self.xg):
                if has_out_norm != 0:
                    xseq = xseq + 1
            self._out_row(acc, gn, cp, red_n, xbuf_n, xbar, par, xph, rank, has_out_norm,
                          inv_h, out_eps, tidx, warp, lane, (xgrp, xown, xseq))
            if cutlass.const_expr(self.cfg.debug_timeline):
                tl[7] = cute.arch.clock64()
            self._store_row(
                out.iterator + cute.assume(r64 * Int64(s_out) + cb64, divby=_CHUNK),
                tidx, nchunk, cp)
            if cutlass.const_expr(self.cfg.debug_timeline):
                tl[8] = cute.arch.clock64()
            if row + ncl < M:
                self._issue_row(row + ncl, prefix, delta, blocks, cbase, nchunk, w_idx,
                                nsrc_b, has_delta, tidx, cp, cd, src)
            it = it + 1

    @cute.kernel
    def kernel(self, prefix: cute.Tensor, delta: cute.Tensor, blocks: cute.Tensor,
               norm_w: cute.Tensor, qk_w: cute.Tensor, out_norm_w: cute.Tensor,
               out: cute.Tensor, num_blocks: Int32, write_idx: Int32, has_delta: Int32,
               has_out_norm: Int32, eps: Float32, out_eps: Float32, work: cute.Tensor):
        NW = self.num_warps_c
        NT = self.num_threads_c
        CPT = self.cpt
        C = self.row_split
        tl = cute.make_rmem_tensor((16,), Int64)  # debug_timeline: clock64 marks
        if cutlass.const_expr(self.cfg.debug_trace):
            tl[12] = cute.arch.globaltimer()
        if cutlass.const_expr(self.cfg.debug_timeline):
            tl.fill(0)
            tl[0] = cute.arch.clock64()
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        M = prefix.shape[0]
        H = prefix.shape[1]
        s_pre = prefix.stride[0]
        s_del = delta.stride[0]
        s_bm = blocks.stride[0]
        s_bn = blocks.stride[1]
        K = num_blocks
        w_idx = write_idx
        if cutlass.const_expr(C == 1):
            rank = Int32(0)
            cid = bid
            ncl = nblk
            seg = H
            cbase = Int32(0)
            nchunk = H // _CHUNK
        else:
            if cutlass.const_expr(self.xg):
                rank = bid % C  # groups of C consecutive CTAs, no cluster
            else:
                rank = cute.arch.block_idx_in_cluster()
            cid = bid // C
            ncl = nblk // C
            # segment of CTA `rank`: [rank * seg, min(H, (rank + 1) * seg)), maybe empty
            seg = (H // _CHUNK + (C - 1)) // C * _CHUNK
            cbase = rank * seg
            nchunk = cutlass.max(cutlass.min(H - cbase, seg), Int32(0)) // _CHUNK
        nbytes = nchunk * (_CHUNK * 2)
        cb64 = Int64(cbase)
        # slots in the ring at this H (>= 2: the ring holds two max-size segments)
        n_st = cutlass.min(self.ring_elems // seg, self.max_stages)
        if cutlass.const_expr(C > 1):
            n_st = cutlass.min(n_st, self.cfg.split_stages)
        # block sources per row (slot w is p: not loaded) and loads per row
        nsrc_b = K
        lg_mult = Float32(0.0)  # log2 of p's multiplicity
        if w_idx >= 0 and w_idx < K:
            nsrc_b = K - 1
            lg_mult = Float32(1.0)
        nloads = nsrc_b + 1
        if has_delta != 0:
            nloads = nloads + 1
        use_batched = Int32(0)  # row_split = 1 only (row_split > 1 is always batched)
        if cutlass.const_expr(C == 1 and self.cfg.batched and not self.online):
            if nloads + self.cfg.batched_min_free <= n_st:
                use_batched = Int32(1)

        dyn = Int32(0)
        if cutlass.const_expr(C == 1 and self.cfg.dynamic_rows):
            if (nloads >= self.cfg.dynamic_min_loads) | (M >= self.cfg.dynamic_min_rows):
                dyn = use_batched

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        rowid = storage.rowid.get_tensor(cute.make_layout(self.max_stages))
        full = storage.full.data_ptr()
        empty = storage.empty.data_ptr()
        xbar = storage.xbar.data_ptr()
        ring = storage.ring.data_ptr()
        red = storage.red.get_tensor(cute.make_layout((2, NW, 2), stride=(1, 2, 2 * NW)))
        red_s = storage.red_s.get_tensor(
            cute.make_layout((NW, _NV, 2), stride=(1, NW, _NV * NW)))
        red_n = storage.red_n.get_tensor(cute.make_layout((NW, 2), stride=(1, NW)))
        xbuf_s = storage.xbuf_s.get_tensor(
            cute.make_layout((C, _NV, 2), stride=(1, C, _NV * C)))
        xbuf_n = storage.xbuf_n.get_tensor(cute.make_layout((C, 2), stride=(1, C)))

        # split_direct: the first row's loads go out at entry, before the mbarrier init and
        # the CTA barrier (~350-530 cycles at M = 1..16, debug_timeline, H200)
        dregs = None
        if cutlass.const_expr(self.direct):
            dregs = self._direct_regs()
            if cid < M:
                self._issue_row(cid, prefix, delta, blocks, cbase, nchunk, w_idx, nsrc_b,
                                has_delta, tidx, dregs[0], dregs[1], dregs[2])

        # lane 0 of every warp initializes every (NW + 1)-th used mbarrier pair. One thread
        # per pair within a warp was ~3900 cycles (2 us) at M = 1: the init takes a uniform
        # address, so the lanes of a warp run one after another (debug_timeline, H200).
        if cutlass.const_expr(self.xg):
            pass  # no mbarriers: the exchange polls global memory
        elif cutlass.const_expr(self.direct):
            if (lane == 0) & (warp == 0):
                for i in cutlass.range_constexpr(4):
                    cute.arch.mbarrier_init(xbar + i, 1)
                cute.arch.mbarrier_init_fence()
        elif lane == 0:
            for i in cutlass.range(warp, n_st, NW + 1):
                cute.arch.mbarrier_init(full + i, 1)
                cute.arch.mbarrier_init(empty + i, NW)
            if warp == NW:
                for i in cutlass.range_constexpr(4):
                    cute.arch.mbarrier_init(xbar + i, 1)
            cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(not self.xg):
            cute.arch.barrier()
        if cutlass.const_expr(self.cfg.debug_timeline):
            tl[1] = cute.arch.clock64()
        if cutlass.const_expr(C > 1 and not self.xg):
            # peers store into this CTA's xbuf / xbar only after this cluster barrier
            cute.arch.cluster_arrive_relaxed()

        # ------------------------------------------------------------ producer warp
        # (the direct kernels have no producer warp; a const gate, so that nothing of it is
        # traced for them: the Ada design builds them for sm_80 / sm_89)
        if cutlass.const_expr(not self.direct):
            if warp == NW:
                # row_split = 1: the consumers' norm_w / qk_w loads go out first; issued behind
                # the ring's bulk copies (up to a full ring per SM) they waited ~7-11 us for the
                # copies to drain (debug_timeline, H200: M=256 25.4 -> 23.6 us). The split
                # kernels (small M, a short ring) start their copies at once: latency first.
                if cutlass.const_expr(C == 1):
                    cute.arch.barrier(barrier_id=2, number_of_threads=NT + 32)
                if lane == 0:
                    slot = Int32(0)
                    phase = Int32(0)
                    row = cid
                    while row < M:
                        r64 = Int64(row)
                        if dyn != 0:
                            # the consumers read the row of a prefix slot once it is full (the
                            # full barrier's arrive below releases this store)
                            cute.arch.mbarrier_wait(empty + slot, phase ^ 1)
                            rowid[slot] = row
                        slot, phase = self._produce(
                            full, empty, ring, slot, phase, n_st,
                            prefix.iterator + cute.assume(r64 * Int64(s_pre) + cb64,
                                                          divby=_CHUNK),
                            seg, nbytes)
                        if has_delta != 0:
                            slot, phase = self._produce(
                                full, empty, ring, slot, phase, n_st,
                                delta.iterator + cute.assume(r64 * Int64(s_del) + cb64,
                                                             divby=_CHUNK),
                                seg, nbytes)
                        for i in range(K):
                            if i != w_idx:
                                off = r64 * Int64(s_bm) + Int64(i) * Int64(s_bn) + cb64
                                slot, phase = self._produce(
                                    full, empty, ring, slot, phase, n_st,
                                    blocks.iterator + cute.assume(off, divby=_CHUNK), seg,
                                    nbytes)
                        if dyn != 0:
                            row = ncl + cute.arch.atomic_add(work.iterator, Int32(1))
                        else:
                            row = row + ncl
                    if dyn != 0:
                        # no more rows: a slot whose row is -1 ends the consumers' loop
                        cute.arch.mbarrier_wait(empty + slot, phase ^ 1)
                        rowid[slot] = Int32(-1)
                        cute.arch.mbarrier_arrive(full + slot)
                        # the last CTA past its last claim zeroes the counters for the next
                        # launch (every CTA's claims precede its increment of work[1])
                        fin = cute.arch.atomic_add(work.iterator + 1, Int32(1), sem="acq_rel",
                                                   scope="gpu")
                        if fin == ncl - 1:
                            work[0] = Int32(0)
                            work[1] = Int32(0)
                if cutlass.const_expr(C > 1):
                    cute.arch.cluster_wait()

        # --------------------------------------------------------- consumer warps
        if warp < NW:
            inv_h = Float32(1.0) / Float32(H)

            # norm_w * qk_w of this thread's chunks (fp32), 0 past the segment. In shared
            # memory the element (e, t, k) of chunk k * NT + t sits at ((k * 2 + e // 4) * NT
            # + t) * 4 + e % 4: each 16-byte read of a warp is contiguous. Only the owning
            # thread writes and reads its entries (program order; no barrier needed).
            if cutlass.const_expr(self.wq_smem):
                wq = storage.wq.get_tensor(cute.make_layout(
                    ((4, 2), NT, CPT), stride=((1, 4 * NT), 4, 8 * NT)))
                wq_t = wq[None, tidx, None]
            else:
                wq = cute.make_rmem_tensor((_CHUNK, CPT), Float32)
                wq_t = wq
            # raw loads first, then let the producer start, then the products
            nw_r = cute.make_rmem_tensor((_CHUNK, CPT), self.dtype)
            qw_r = cute.make_rmem_tensor((_CHUNK, CPT), self.dtype)
            nw_r.fill(0.0)
            qw_r.fill(0.0)
            for k in cutlass.range_constexpr(CPT):
                j = k * NT + tidx
                if j < nchunk:
                    goff = cbase + j * _CHUNK
                    a = cute.make_tensor(norm_w.iterator + cute.assume(goff, divby=_CHUNK),
                                         cute.make_layout(_CHUNK))
                    b = cute.make_tensor(qk_w.iterator + cute.assume(goff, divby=_CHUNK),
                                         cute.make_layout(_CHUNK))
                    nw_r[None, k].store(a.load())
                    qw_r[None, k].store(b.load())
            if cutlass.const_expr(C == 1):
                cute.arch.barrier_arrive(barrier_id=2, number_of_threads=NT + 32)
            if cutlass.const_expr(not self.direct):
                # (direct: the first row's loads go out before these products and the
                # cluster wait, see _rows_direct)
                for k in cutlass.range_constexpr(CPT):
                    wq_t[None, k].store(nw_r[None, k].load().to(Float32)
                                        * qw_r[None, k].load().to(Float32))
            if cutlass.const_expr(self.cfg.debug_timeline):
                tl[9] = cute.arch.clock64()
            if cutlass.const_expr(C > 1 and not self.direct):
                cute.arch.cluster_wait()
            if cutlass.const_expr(self.cfg.debug_timeline):
                tl[10] = cute.arch.clock64()

            cp = cute.make_rmem_tensor((_CHUNK, CPT), self.dtype)  # p (bf16)
            cs = cute.make_rmem_tensor((_CHUNK, CPT), self.dtype)  # delta / source / out_norm_w
            cp.fill(0.0)
            cs.fill(0.0)
            acc = cute.make_rmem_tensor((_CHUNK, CPT), Float32)

            if cutlass.const_expr(self.direct):
                self._rows_direct(dregs, xbar, red_s, red_n, xbuf_s, xbuf_n, wq, nw_r, qw_r,
                                  prefix, delta,
                                  blocks, out_norm_w, out, cid, ncl, rank, cbase, nchunk,
                                  w_idx, nsrc_b, lg_mult, has_delta, has_out_norm, eps,
                                  out_eps, tidx, warp, lane, tl, work, bid)
            elif cutlass.const_expr(C > 1):
                # always batched: can_implement guarantees a ring of >= _MAX_LOADS segments
                self._rows_batched(ring, full, empty, xbar, red_s, red_n, xbuf_s, xbuf_n,
                                   wq, cp, cs, acc, prefix, delta, blocks, out_norm_w, out,
                                   cid, ncl, rank, seg, cbase, nchunk, n_st, w_idx, nsrc_b,
                                   lg_mult, has_delta, has_out_norm, eps, out_eps,
                                   tidx, warp, lane, tl, rowid, Int32(0))
            elif use_batched != 0:
                self._rows_batched(ring, full, empty, xbar, red_s, red_n, xbuf_s, xbuf_n,
                                   wq, cp, cs, acc, prefix, delta, blocks, out_norm_w, out,
                                   cid, ncl, rank, seg, cbase, nchunk, n_st, w_idx, nsrc_b,
                                   lg_mult, has_delta, has_out_norm, eps, out_eps,
                                   tidx, warp, lane, tl, rowid, dyn)
            else:
                self._rows_online(ring, full, empty, red, wq, cp, cs, acc, prefix, blocks,
                                  out_norm_w, out, K, w_idx, lg_mult, has_delta,
                                  has_out_norm, eps, out_eps, tidx, warp, lane, n_st, inv_h)

        if cutlass.const_expr(C > 1 and not self.xg):
            # no CTA exits while a peer may still store into its shared memory. Every store
            # into a CTA is tx-counted on an mbarrier that the CTA waited on, so only the
            # execution order matters here: relaxed arrive (no MEMBAR.GPU on the exit path)
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        if cutlass.const_expr(self.cfg.debug_timeline):
            # debug builds only: the marks (cycles since entry, this SM's clock) overwrite the
            # first 64 bytes of this CTA's segment of out[0] (the cluster/CTA of row 0)
            tl[11] = cute.arch.clock64()
            cute.arch.barrier()
            if (tidx == 0) & (cid == 0):
                dst = cute.make_tensor(cute.recast_ptr(out.iterator + cute.assume(cb64, divby=_CHUNK),
                                                       dtype=Int32), cute.make_layout(16))
                for i in cutlass.range_constexpr(16):
                    dst[i] = Int32(tl[i] - tl[0])

    @cute.jit
    def _rows_online(self, ring, full, empty, red, wq, cp, cs, acc, prefix: cute.Tensor,
                     blocks: cute.Tensor, out_norm_w: cute.Tensor, out: cute.Tensor,
                     K: Int32, w_idx: Int32, lg_mult: Float32, has_delta: Int32,
                     has_out_norm: Int32, eps: Float32, out_eps: Float32, tidx: Int32,
                     warp: Int32, lane: Int32, n_st: Int32, inv_h: Float32):
        """v1 online schedule (row_split = 1): one reduction per source."""
        NT = self.num_threads_c
        CPT = self.cpt
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        M = prefix.shape[0]
        H = prefix.shape[1]
        s_pre = prefix.stride[0]
        s_out = out.stride[0]
        s_bm = blocks.stride[0]
        s_bn = blocks.stride[1]
        nchunk = H // _CHUNK
        slot = Int32(0)
        phase = Int32(0)
        par = Int32(0)
        for row in range(bid, M, nblk):
            r64 = Int64(row)
            # ---- p = prefix (+ delta)
            slot_p = slot
            cute.arch.mbarrier_wait(full + slot, phase)
            self._load_slot(ring, slot, H, tidx, nchunk, cp)
            slot, phase = self._advance(slot, phase, n_st)
            slot_d = slot
            if has_delta != 0:
                cute.arch.mbarrier_wait(full + slot, phase)
                self._add_slot(ring, slot, H, tidx, nchunk, cp)
                slot, phase = self._advance(slot, phase, n_st)
                self._store_row(
                    prefix.iterator + cute.assume(r64 * Int64(s_pre), divby=_CHUNK),
                    tidx, nchunk, cp)
            if w_idx >= 0:
                off_w = r64 * Int64(s_bm) + Int64(w_idx) * Int64(s_bn)
                self._store_row(blocks.iterator + cute.assume(off_w, divby=_CHUNK),
                                tidx, nchunk, cp)

            for k in cutlass.range_constexpr(CPT):
                acc[None, k].store(widen(cp[None, k].load()))
            ss, dd = self._partials(acc, wq, tidx)
            ss, dd = self._warp_sum2(ss, dd)
            if lane == 0:  # every lane's shared loads fed the butterfly: slots free
                cute.arch.mbarrier_arrive(empty + slot_p)
                if has_delta != 0:
                    cute.arch.mbarrier_arrive(empty + slot_d)
            ss, dd = self._cta_sum2(ss, dd, red, par, warp, lane)
            par = par ^ 1
            # weight of p: mult * exp2(t_p - m) == exp2(t_p + log2(mult) - m), so p
            # enters once with its score raised by log2(mult) (0 or 1) and l = 1
            m_run = cute.math.rsqrt(ss * inv_h + eps, fastmath=True) * dd * _LOG2E + lg_mult
            l_run = Float32(1.0)

            # ---- block sources i < K (slot w is p, already counted)
            for i in range(K):
                if i != w_idx:
                    slot_s = slot
                    cute.arch.mbarrier_wait(full + slot, phase)
                    self._load_slot(ring, slot, H, tidx, nchunk, cs)
                    slot, phase = self._advance(slot, phase, n_st)
                    ss, dd = self._partials(cs, wq, tidx)
                    ss, dd = self._warp_sum2(ss, dd)
                    if cutlass.const_expr(not self.reread):
                        if lane == 0:  # the butterfly consumed every lane's loads
                            cute.arch.mbarrier_arrive(empty + slot_s)
                    ss, dd = self._cta_sum2(ss, dd, red, par, warp, lane)
                    par = par ^ 1
                    t = cute.math.rsqrt(ss * inv_h + eps, fastmath=True) * dd * _LOG2E
                    m_new = cute.arch.fmax(m_run, t)
                    corr = cute.math.exp2(m_run - m_new, fastmath=True)
                    e = cute.math.exp2(t - m_new, fastmath=True)
                    l_run = l_run * corr + e
                    m_run = m_new
                    if cutlass.const_expr(self.reread):
                        # source read again from its slot (the named barrier keeps the
                        # compiler from holding the first read live: fewer registers)
                        self._mix_slot(ring, slot_s, H, tidx, nchunk, acc, corr, e)
                        cute.arch.sync_warp()
                        if lane == 0:
                            cute.arch.mbarrier_arrive(empty + slot_s)
                    else:
                        for k in cutlass.range_constexpr(CPT):
                            acc[None, k].store(acc[None, k].load() * corr
                                               + widen(cs[None, k].load()) * e)

            # ---- mix, output RMSNorm, store
            inv_l = Float32(1.0) / l_run
            for k in cutlass.range_constexpr(CPT):
                acc[None, k].store(acc[None, k].load() * inv_l)
            if has_out_norm != 0:
                for k in cutlass.range_constexpr(CPT):
                    j = k * NT + tidx
                    if j < nchunk:
                        g = cute.make_tensor(
                            out_norm_w.iterator + cute.assume(j * _CHUNK, divby=_CHUNK),
                            cute.make_layout(_CHUNK))
                        cs[None, k].store(g.load())
                sq, _z = self._warp_sum2(self._sumsq(acc), Float32(0.0))
                sq, _z = self._cta_sum2(sq, _z, red, par, warp, lane)
                par = par ^ 1
                r = cute.math.rsqrt(sq * inv_h + out_eps, fastmath=True)
                self._normed_out(acc, r, cs, cp)
            else:
                for k in cutlass.range_constexpr(CPT):
                    cp[None, k].store(acc[None, k].load().to(self.dtype))
            self._store_row(out.iterator + cute.assume(r64 * Int64(s_out), divby=_CHUNK),
                            tidx, nchunk, cp)
