"""sm_90a AttnRes: Kimi attention residuals, fused serving form (kernels/CONTRACT_ATTN_RES.md).

Per row m (rows are independent):
    p = has_delta ? bf16(prefix[m] + delta[m]) : prefix[m]; written back to prefix (has_delta)
    and blocks[m, w] (w >= 0); sources c_i = blocks[m, i] (i < K, c_w = p), c_K = p;
    s_i = rsqrt(mean(c_i^2) + eps) * dot(c_i, norm_w * qk_w); mix = sum softmax(s)_i c_i;
    out = bf16(rmsnorm(mix) * out_norm_w) or bf16(mix).

Design (memory bound; every source row crosses HBM once):
  - persistent grid, one CTA per SM (grid = min(M, num_sms)); CTA b handles rows
    b, b + grid, ...
  - warp NW (the last one): producer. One lane issues one cp.async.bulk (UBLKCP) per source
    row (H * 2 bytes, no tensor map: any dynamic stride works) into a ring of row slots in
    shared memory, guarded by full/empty mbarriers. The slot size is the runtime row size,
    so the ring holds min(max_stages, ring_bytes // (2 H)) rows (14 rows of H = 7168).
    Per row it loads prefix, delta (when has_delta), then blocks[m, i] for i < K, i != w.
  - warps 0..NW-1: consumers. Thread t owns the 16-byte chunks j = k * NT + t (k < CPT) of
    the row (NT = 32 NW consumer threads, CPT chunks of 8 elements each); it keeps
    norm_w * qk_w (fp32) and the fp32 mix accumulator of its chunks in registers.
    The source sequence is p first (computed from the prefix/delta slots, stored with
    16-byte stores), then the blocks. c_w == p, so when 0 <= w < K the slot w is not loaded:
    p enters the softmax with multiplicity 2. Per source: partial (sum c^2, dot(c, nw qw)),
    warp butterfly, slot released (lane 0 of each warp arrives on the empty barrier once
    its warp's values are reduced, i.e. after every lane's shared loads completed), one
    named barrier for the cross-warp sum (double-buffered by parity, so one barrier per
    reduction), online softmax update (running max, exp2 with log2(e) folded into the score).
    Then mix / l, the optional output RMSNorm (one more reduction; out_norm_w is read from
    global/L2 per row, only when has_out_norm) and 16-byte stores.
  - chunks past H (tail) are never loaded or stored; they stay 0 in registers, so they add
    nothing to any reduction.
  - p's multiplicity m (1 or 2) is folded into its score (+log2 m) so p enters once.
  - 16384 tier (8 chunks per thread): norm_w * qk_w lives in shared memory (fp32) and each
    source is read from its slot twice (score pass, then mix pass; the slot is released
    after the second read, __syncwarp + lane 0 arrive), so the kernel needs no spills.
  - small M: grid = M CTAs, every source row of a row is in flight at once (the ring holds
    16 rows of H = 7168), so the latency is one row's bulk loads plus K + 2 reductions.
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

# UBLKCP: cp.async.bulk (non-tensor) global -> shared; SYNCS: mbarrier ops.
# No LDGSTS (cp.async 16 B path), no local memory (LDL/STL = register spills).
SASS_REQUIRED = ("UBLKCP", "SYNCS")
SASS_FORBIDDEN = ("LDGSTS", "LDL", "STL")

_SMEM_CAPACITY = 227 * 1024  # sm_90 opt-in maximum per block
_LOG2E = math.log2(math.e)
_CHUNK = 8  # elements per 16-byte chunk
_SMEM_SLACK = 512  # struct alignment padding


@dataclass(frozen=True)
class AttnResSm90Config:
    """consumer_warps: compute warps (plus one producer warp). Each consumer thread owns
        chunks_per_thread = max_hidden / (256 * consumer_warps) 16-byte chunks of a row
        (4 at 8192, 8 at 16384): one pass of the consumers covers a max_hidden row.
    wq_max_reg_chunks: norm_w * qk_w (fp32) stays in registers when chunks_per_thread is at
        most this; otherwise it lives in shared memory (fp32, conflict-free 16-byte reads)
        so the 16384 tier fits the register file without spills.
    ring_kb: upper bound of the source-row ring (KiB); clamped to what shared memory has
        left. The ring holds min(max_stages, ring_bytes // (2 H)) rows at runtime (>= 2).
    max_stages: mbarrier pairs allocated (upper bound of the runtime ring depth).
    num_sms: persistent grid size bound (132 on the H200); the grid is min(M, num_sms)."""

    consumer_warps: int = 8
    wq_max_reg_chunks: int = 4
    ring_kb: int = 224
    max_stages: int = 32
    num_sms: int = 132


def _layout_numbers(max_hidden: int, cfg: AttnResSm90Config):
    """(chunks per thread, wq in smem, wq smem bytes, ring bytes) or None."""
    nw = cfg.consumer_warps
    if nw < 1 or (nw + 1) * 32 > 1024 or max_hidden % (_CHUNK * 32 * nw) != 0:
        return None
    cpt = max_hidden // (_CHUNK * 32 * nw)
    wq_smem = cpt > cfg.wq_max_reg_chunks
    wq_bytes = max_hidden * 4 if wq_smem else 0
    fixed = 16 * cfg.max_stages + 16 * nw + _SMEM_SLACK + wq_bytes
    ring = min(cfg.ring_kb * 1024, _SMEM_CAPACITY - fixed) // 128 * 128
    if ring < 2 * 2 * max_hidden:  # >= 2 slots at max_hidden
        return None
    return cpt, wq_smem, wq_bytes, ring


@dsl_user_op
def _bulk_g2s(dst: cute.Pointer, src: cute.Pointer, mbar: cute.Pointer, nbytes,
              *, loc=None, ip=None):
    """cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], n, [mbar]"""
    d = dst.to_llvm_ptr(loc=loc, ip=ip)
    d = _llvm.addrspacecast(_llvm.PointerType.get(7), d, loc=loc, ip=ip)  # shared::cluster
    _nvvm.cp_async_bulk_shared_cluster_global(
        d, src.to_llvm_ptr(loc=loc, ip=ip), mbar.to_llvm_ptr(loc=loc, ip=ip),
        Int32(nbytes).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)


class AttnResSm90:
    def __init__(self, dtype, max_hidden: int, config: AttnResSm90Config = AttnResSm90Config()):
        if not AttnResSm90.can_implement(dtype, max_hidden, config):
            raise ValueError(
                f"AttnResSm90 cannot run {dtype}/max_hidden={max_hidden} with {config}")
        self.dtype = dtype
        self.max_hidden = max_hidden
        self.cfg = config
        self.cpt, self.wq_smem, wq_bytes, ring_bytes = _layout_numbers(max_hidden, config)
        # large tier: norm_w * qk_w in smem and each source read twice from its slot
        # (score pass, then mix pass) instead of held in registers across the reduction
        self.reread = self.wq_smem
        self.num_warps_c = config.consumer_warps
        self.num_threads_c = self.num_warps_c * 32
        self.threads_per_cta = self.num_threads_c + 32
        self.ring_elems = ring_bytes // 2
        self.wq_elems = wq_bytes // 4 if self.wq_smem else 4  # (dummy 16 B when in registers)
        self.max_stages = config.max_stages

    @staticmethod
    def can_implement(dtype, max_hidden, config: AttnResSm90Config) -> bool:
        if dtype is not cutlass.BFloat16:
            return False
        if max_hidden % _CHUNK != 0 or max_hidden < _CHUNK:
            return False
        if config.max_stages < 2 or config.num_sms < 1 or config.wq_max_reg_chunks < 0:
            return False
        return _layout_numbers(max_hidden, config) is not None

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, prefix: cute.Tensor, delta: cute.Tensor, blocks: cute.Tensor,
                 norm_w: cute.Tensor, qk_w: cute.Tensor, out_norm_w: cute.Tensor,
                 out: cute.Tensor, num_blocks: Int32, write_idx: Int32, has_delta: Int32,
                 has_out_norm: Int32, eps: Float32, out_eps: Float32, stream: cuda.CUstream):
        M = prefix.shape[0]
        grid = cutlass.min(M, self.cfg.num_sms)

        @cute.struct
        class SharedStorage:
            full: cute.struct.MemRange[Int64, self.max_stages]
            empty: cute.struct.MemRange[Int64, self.max_stages]
            red: cute.struct.MemRange[Float32, 4 * self.num_warps_c]
            wq: cute.struct.Align[cute.struct.MemRange[Float32, self.wq_elems], 16]
            ring: cute.struct.Align[cute.struct.MemRange[self.dtype, self.ring_elems], 128]

        self.shared_storage = SharedStorage

        self.kernel(prefix, delta, blocks, norm_w, qk_w, out_norm_w, out, num_blocks,
                    write_idx, has_delta, has_out_norm, eps, out_eps).launch(
            grid=[grid, 1, 1],
            block=[self.threads_per_cta, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---------------------------------------------------------------- device side
    @cute.jit
    def _advance(self, slot: Int32, phase: Int32, n_st: Int32):
        slot = slot + 1
        if slot == n_st:
            slot = Int32(0)
            phase = phase ^ 1
        return slot, phase

    @cute.jit
    def _produce(self, full, empty, ring, slot: Int32, phase: Int32, n_st: Int32,
                 src: cute.Pointer, H: Int32, nbytes: Int32):
        cute.arch.mbarrier_wait(empty + slot, phase ^ 1)
        cute.arch.mbarrier_arrive_and_expect_tx(full + slot, nbytes)
        _bulk_g2s(ring + slot * H, src, full + slot, nbytes)
        return self._advance(slot, phase, n_st)

    @cute.jit
    def _load_slot(self, ring, slot: Int32, H: Int32, tidx: Int32, nchunk: Int32,
                   dst: cute.Tensor):
        """dst[:, k] <- the thread's chunk k of ring slot `slot` (valid chunks only)."""
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
                    (acc[None, k].load().to(Float32) + src.load().to(Float32)).to(self.dtype))

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
                acc[None, k].store(acc[None, k].load() * corr + src.load().to(Float32) * e)

    @cute.jit
    def _store_row(self, gbase: cute.Pointer, tidx: Int32, nchunk: Int32, val: cute.Tensor):
        for k in cutlass.range_constexpr(self.cpt):
            j = k * self.num_threads_c + tidx
            if j < nchunk:
                dst = cute.make_tensor(gbase + cute.assume(j * _CHUNK, divby=_CHUNK),
                                       cute.make_layout(_CHUNK))
                dst.store(val[None, k].load())

    @cute.jit
    def _partials(self, c: cute.Tensor, wq: cute.Tensor, tidx: Int32):
        """(sum c^2, sum c * wq) over the thread's chunks: up to 4 independent FMA chains
        (chunk k feeds chain k % 4), then a tree; not one 8 * CPT long chain."""
        nch = min(self.cpt, 4)
        ssk = cute.make_rmem_tensor((nch,), Float32)
        ddk = cute.make_rmem_tensor((nch,), Float32)
        for k in cutlass.range_constexpr(self.cpt):
            x = c[None, k].load().to(Float32)
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

    @cute.kernel
    def kernel(self, prefix: cute.Tensor, delta: cute.Tensor, blocks: cute.Tensor,
               norm_w: cute.Tensor, qk_w: cute.Tensor, out_norm_w: cute.Tensor,
               out: cute.Tensor, num_blocks: Int32, write_idx: Int32, has_delta: Int32,
               has_out_norm: Int32, eps: Float32, out_eps: Float32):
        NW = self.num_warps_c
        NT = self.num_threads_c
        CPT = self.cpt
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        M = prefix.shape[0]
        H = prefix.shape[1]
        s_pre = prefix.stride[0]
        s_del = delta.stride[0]
        s_out = out.stride[0]
        s_bm = blocks.stride[0]
        s_bn = blocks.stride[1]
        K = num_blocks
        w_idx = write_idx
        nchunk = H // _CHUNK
        nbytes = H * 2
        # slots in the ring at this H (>= 2: the ring holds two max_hidden rows)
        n_st = cutlass.min(self.ring_elems // H, self.max_stages)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        full = storage.full.data_ptr()
        empty = storage.empty.data_ptr()
        ring = storage.ring.data_ptr()
        red = storage.red.get_tensor(cute.make_layout((2, NW, 2), stride=(1, 2, 2 * NW)))

        if tidx == 0:
            for s in cutlass.range_constexpr(self.max_stages):
                cute.arch.mbarrier_init(full + s, 1)
                cute.arch.mbarrier_init(empty + s, NW)
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        # ------------------------------------------------------------ producer warp
        if warp == NW:
            if lane == 0:
                slot = Int32(0)
                phase = Int32(0)
                for row in range(bid, M, nblk):
                    r64 = Int64(row)
                    slot, phase = self._produce(
                        full, empty, ring, slot, phase, n_st,
                        prefix.iterator + cute.assume(r64 * Int64(s_pre), divby=_CHUNK),
                        H, nbytes)
                    if has_delta != 0:
                        slot, phase = self._produce(
                            full, empty, ring, slot, phase, n_st,
                            delta.iterator + cute.assume(r64 * Int64(s_del), divby=_CHUNK),
                            H, nbytes)
                    for i in range(K):
                        if i != w_idx:
                            off = r64 * Int64(s_bm) + Int64(i) * Int64(s_bn)
                            slot, phase = self._produce(
                                full, empty, ring, slot, phase, n_st,
                                blocks.iterator + cute.assume(off, divby=_CHUNK), H, nbytes)

        # --------------------------------------------------------- consumer warps
        if warp < NW:
            inv_h = Float32(1.0) / Float32(H)
            # p counts twice when blocks[w] (w < K) is one of the sources
            lg_mult = Float32(0.0)  # log2 of p's multiplicity
            if w_idx >= 0 and w_idx < K:
                lg_mult = Float32(1.0)

            # norm_w * qk_w of this thread's chunks (fp32), 0 past H. In shared memory the
            # element (e, t, k) of chunk k * NT + t sits at ((k * 2 + e // 4) * NT + t) * 4
            # + e % 4: each 16-byte read of a warp is contiguous. Only the owning thread
            # writes and reads its entries (program order; no barrier needed).
            if cutlass.const_expr(self.wq_smem):
                wq = storage.wq.get_tensor(cute.make_layout(
                    ((4, 2), NT, CPT), stride=((1, 4 * NT), 4, 8 * NT)))
                wq_t = wq[None, tidx, None]
            else:
                wq = cute.make_rmem_tensor((_CHUNK, CPT), Float32)
                wq_t = wq
            for k in cutlass.range_constexpr(CPT):
                j = k * NT + tidx
                prod = cute.make_rmem_tensor((_CHUNK,), Float32)
                prod.fill(0.0)
                if j < nchunk:
                    a = cute.make_tensor(norm_w.iterator + cute.assume(j * _CHUNK, divby=_CHUNK),
                                         cute.make_layout(_CHUNK))
                    b = cute.make_tensor(qk_w.iterator + cute.assume(j * _CHUNK, divby=_CHUNK),
                                         cute.make_layout(_CHUNK))
                    prod.store(a.load().to(Float32) * b.load().to(Float32))
                wq_t[None, k].store(prod.load())

            cp = cute.make_rmem_tensor((_CHUNK, CPT), self.dtype)  # p (bf16)
            cs = cute.make_rmem_tensor((_CHUNK, CPT), self.dtype)  # delta / source / out_norm_w
            cp.fill(0.0)
            cs.fill(0.0)
            acc = cute.make_rmem_tensor((_CHUNK, CPT), Float32)

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
                    acc[None, k].store(cp[None, k].load().to(Float32))
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
                                                   + cs[None, k].load().to(Float32) * e)

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
                    nch = min(CPT, 4)
                    sqk = cute.make_rmem_tensor((nch,), Float32)
                    for k in cutlass.range_constexpr(CPT):
                        x = acc[None, k].load()
                        if cutlass.const_expr(k < nch):
                            a = x[0] * x[0]
                        else:
                            a = sqk[k % nch] + x[0] * x[0]
                        for e2 in cutlass.range_constexpr(1, _CHUNK):
                            a = a + x[e2] * x[e2]
                        sqk[k % nch] = a
                    sq, _z = self._warp_sum2(self._tree(sqk), Float32(0.0))
                    sq, _z = self._cta_sum2(sq, _z, red, par, warp, lane)
                    par = par ^ 1
                    r = cute.math.rsqrt(sq * inv_h + out_eps, fastmath=True)
                    for k in cutlass.range_constexpr(CPT):
                        cp[None, k].store(
                            (acc[None, k].load() * r * cs[None, k].load().to(Float32))
                            .to(self.dtype))
                else:
                    for k in cutlass.range_constexpr(CPT):
                        cp[None, k].store(acc[None, k].load().to(self.dtype))
                self._store_row(out.iterator + cute.assume(r64 * Int64(s_out), divby=_CHUNK),
                                tidx, nchunk, cp)
