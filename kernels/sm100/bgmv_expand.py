"""sm_100a / sm_103a MoE-LoRA expand (see kernels/CONTRACT_BGMV.md, incl. its v2 section).
Compiled and SASS-checked only: there is no SM100 GPU here, this kernel has never run.

    finalize:     y[t, n] = sum_{j = 0..k-1 in order} w[t, j] * (sum_q s[p, q] * b[l, e, n, q])
    not finalize: y[p, n] = sum_q s[p, q] * b[l, e, n, q]        (p = t * k + j, fp32 out)

Two schedules, picked at run time by P = T * k vs `config.bin_min_pairs`:

pair mode (P < bin_min_pairs: small batch, latency; the v1 schedule, one launch)
- Work unit = (token t, block of 32 * nbx output columns); nbx (1 .. consumer_warps boxes
  of 32 columns) is picked at run time from (T, N) so the first wave covers the SMs at small
  batch. Every output element has ONE owner thread (consumer thread c owns column n0 + c),
  and it walks the token's pairs j = 0, 1, ..., k-1 in order: no atomics, fixed route order.
  One ring stage per live pair: the b slab of the bin and the s[p] row.

bin mode (P >= bin_min_pairs: large batch, bandwidth)
- Work item = (bin, part): bin = l * E + e over all L * E bins, part = one of
  `bin_col_parts` contiguous ranges of 32 * consumer_warps-column blocks (persistent
  grid-stride). The whole CTA scans the pair table p = 0..P-1 (one thread per token,
  `scan_tokens` tokens per thread per round, all loads of a round in flight); matches are
  compacted with warp ballots + popc (per-warp totals in shared memory, CTA barriers) into a
  `bin_list`-entry shared-memory window in increasing p (deterministic, no atomics). A full
  window is processed and the scan resumes after its last pair. A bin without pairs costs
  only its scan.
- Per column block of the part and per group of up to `bin_group` pairs of the window, ONE
  ring stage gets the bin's b slab (TMA boxes, loaded once per group and reused for every
  pair of the group) plus the group's s rows (cp.async.bulk, one per pair).
- finalize=False: y[p, cols] = dot for the bin's pairs; dead pairs (l or e out of range)
  get zero rows from a grid-stride pass (per warp: one pair per lane, ballot of the dead).
- finalize=True: the unweighted dot goes to ws[p, cols] (fp32, exact); a SECOND launch in
  the same __call__ / stream computes y[t, n] = acc, acc = fma(w[t, j], ws[t*k + j, n], acc)
  over the live j = 0..k-1 in order (acc = 0: a token without live pairs gets 0).
  ws is touched only there (rows of live pairs, all N columns); pair mode and
  finalize=False never read or write it.

Common machinery / arithmetic (identical in both modes => bit-identical results):
- Warp `consumer_warps` is the producer: b[l, e, n0 : n0 + 32 nbx, 0 : 64] as TMA boxes of
  (64 ranks x 32 columns) with the 128-byte swizzle (rank >= R and columns >= N are
  zero-filled by the TMA unit) plus s rows (R * 2 bytes) by raw cp.async.bulk; one full
  mbarrier (tx bytes) and one empty mbarrier (arrival of every consumer thread) per stage,
  `stages` deep.
- Consumer thread (column n): dot = explicit fp32 FMA chain over q = 0, 1, ..., R-1
  (16-byte swizzle-aware shared-memory loads of its b row, broadcast loads of s), the same
  helper in both modes; finalize: acc = fma(w, dot, acc) over the live j in order, the same
  expression as the bin-mode finalize pass (ws holds dot exactly). The sum order of an
  element is a function of R alone: independent of T, k, N blocking, grid, mode and other
  tokens (bitwise deterministic and batch invariant across the bin_min_pairs threshold).
  y is written, never accumulated into; rows of skipped pairs (not finalize) are 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from kernels.sm100._bin_scan import bulk_g2s, scan_pairs

# UTMALDG: TMA box loads of b; UBLKCP: cp.async.bulk of the s rows; SYNCS: mbarrier ops.
SASS_REQUIRED = ("UTMALDG", "UBLKCP", "SYNCS")
# no atomics / reductions to memory, no 16-byte cp.async (LDGSTS), no tensor-core MMA
SASS_FORBIDDEN = ("ATOM", "ATOMG", "ATOMS", "RED", "REDG", "LDGSTS", "HMMA", "UTCHMMA")

_SMEM_CAPACITY = 232448  # (228 - 1) KiB per-CTA opt-in maximum on sm_100 / sm_103
_MAX_R = 64        # TMA box extent along the rank (one 128-byte swizzle row)
_BOX_N = 32        # output columns per TMA box (one consumer warp)
_BOX_ELEMS = _MAX_R * _BOX_N
_VEC = 8
_FIN_THREADS = 256  # finalize pass: one thread per (token, column)


@dataclass(frozen=True)
class BgmvExpandSm100Config:
    """consumer_warps: compute warps; a unit covers at most 32 * consumer_warps columns
        (one per consumer thread), i.e. consumer_warps TMA boxes per stage.
    stages: depth of the shared-memory ring (one live pair per stage in pair mode, one group
        of up to bin_group pairs of a bin in bin mode).
    sm_count: persistent grid cap (only scheduling; results never depend on it).
    bin_min_pairs: P = T * k at or above which the bin-grouped schedule runs.
    bin_group: pairs sharing one b slab load (s rows per stage) in bin mode.
    bin_list: shared-memory pair window of the bin scan (entries).
    bin_col_parts: column parts per bin (work items = L * E * bin_col_parts; each rescans).
    scan_tokens: tokens per thread per scan round (loads in flight)."""

    consumer_warps: int = 4
    stages: int = 8
    sm_count: int = 148
    bin_min_pairs: int = 1024
    bin_group: int = 16
    bin_list: int = 1024
    bin_col_parts: int = 1
    scan_tokens: int = 4


def _smem_bytes(cfg: BgmvExpandSm100Config) -> int:
    nw = cfg.consumer_warps + 1
    return (cfg.stages * (cfg.consumer_warps * _BOX_ELEMS * 2 + cfg.bin_group * _MAX_R * 2)
            + 2048 + 4 * cfg.bin_list + 4 * nw * cfg.scan_tokens + 64)



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
        self.n_warps = config.consumer_warps + 1
        self.n_consumers = 32 * config.consumer_warps
        self.stage_b_elems = config.consumer_warps * _BOX_ELEMS
        self.group = config.bin_group
        self.stage_s_elems = config.bin_group * _MAX_R
        self.bin_list = config.bin_list
        self.scan_u = config.scan_tokens

    @staticmethod
    def can_implement(dtype, config: BgmvExpandSm100Config = BgmvExpandSm100Config()) -> bool:
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            return False
        if config.consumer_warps not in (1, 2, 4, 8):
            return False
        if config.stages < 2 or config.sm_count < 1:
            return False
        if config.bin_min_pairs < 1 or not 1 <= config.bin_group <= 64:
            return False
        if config.bin_list < config.bin_group or config.bin_list % 32 != 0:
            return False
        if config.bin_col_parts < 1 or not 1 <= config.scan_tokens <= 8:
            return False
        return _smem_bytes(config) <= _SMEM_CAPACITY

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, s: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                 lora: cute.Tensor, topk_w: cute.Tensor, y: cute.Tensor,
                 ws: cute.Tensor, stream: cuda.CUstream):
        if cutlass.const_expr(s.element_type != self.dtype or b.element_type != self.dtype):
            raise TypeError("s / b dtype does not match the compiled dtype")
        if cutlass.const_expr(y.element_type != cutlass.Float32
                              or ws.element_type != cutlass.Float32):
            raise TypeError("y and ws must be float32")

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
            plist: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, self.bin_list], 16]
            ptot: cute.struct.Align[
                cute.struct.MemRange[cutlass.Int32, self.n_warps * self.scan_u], 16]
            sS: cute.struct.Align[
                cute.struct.MemRange[self.dtype, self.stages * self.stage_s_elems], 128]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.dtype, self.stages * self.stage_b_elems], 1024]

        self.shared_storage = SharedStorage
        assert SharedStorage.size_in_bytes() <= _SMEM_CAPACITY

        T = topk_ids.shape[0]
        N = b.shape[2]
        P = T * topk_ids.shape[1]
        sms = cutlass.Int32(self.cfg.sm_count)
        grid = cutlass.min(cutlass.max(T * ((N + _BOX_N - 1) // _BOX_N), 1), sms)
        if P >= self.cfg.bin_min_pairs:
            grid = cutlass.min(
                cutlass.max(b.shape[0] * b.shape[1] * self.cfg.bin_col_parts, 1), sms)
        self.kernel(tma_atom_b, tma_b, s, b, topk_ids, lora, topk_w, y, ws).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=1,
            stream=stream)
        if cutlass.const_expr(self.finalize):
            if P >= self.cfg.bin_min_pairs:
                # bin mode, finalize: fixed-order per-token sum of the ws deltas
                nfb = (N + _FIN_THREADS - 1) // _FIN_THREADS
                fgrid = cutlass.min(cutlass.max(T * nfb, 1), sms * 8)
                self.fin_kernel(b, topk_ids, lora, topk_w, y, ws).launch(
                    grid=[fgrid, 1, 1], block=[_FIN_THREADS, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.jit
    def _dot(self, brow, srow, r8, sw):
        """THE per-pair dot (both modes): fp32 FMA chain over q = 0, 1, ..., R-1."""
        dot = cutlass.Float32(0.0)
        for g in cutlass.range(r8, unroll=1):
            bt = cute.make_tensor(brow + ((g ^ sw) * _VEC), cute.make_layout(_VEC))
            st = cute.make_tensor(srow + g * _VEC, cute.make_layout(_VEC))
            bv4 = bt.load().to(cutlass.Float32)
            sv4 = st.load().to(cutlass.Float32)
            bv = [bv4[z] for z in range(_VEC)]
            sv = [sv4[z] for z in range(_VEC)]
            for z in cutlass.range_constexpr(_VEC):
                dot = cute.math.fma(sv[z], bv[z], dot)
        return dot

    @cute.jit
    def _load_b(self, tma_atom_b: cute.CopyAtom, tma_b: cute.Tensor, sB: cute.Tensor,
                e, l, nb0, nbl, stage, full):
        """TMA boxes nb0 .. nb0 + nbl - 1 (32 columns each) of b[l, e] into ring stage."""
        # ((64, 32), n blocks) tiles of b[l, e]
        gB = cute.local_tile(tma_b, (_MAX_R, _BOX_N), (0, None, e, l))
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b, 0, cute.make_layout(1),
            cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        for i in cutlass.range(nbl, unroll=1):
            cute.copy(tma_atom_b, tBgB[(None, nb0 + i)],
                      tBsB[(None, stage * self.cw + i)], tma_bar_ptr=full + stage)

    @cute.kernel
    def kernel(self, tma_atom_b: cute.CopyAtom, tma_b: cute.Tensor, s: cute.Tensor,
               b: cute.Tensor, topk_ids: cute.Tensor, lora: cute.Tensor,
               topk_w: cute.Tensor, y: cute.Tensor, ws: cute.Tensor):
        cw = self.cw
        G = self.group
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
        P = T * K

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        full = storage.full_mbar.data_ptr()
        empty = storage.empty_mbar.data_ptr()
        s_buf = storage.sS.data_ptr()
        b_buf = storage.sB.data_ptr()
        # (64, 32, boxes) staged view of the ring, swizzled like the TMA writes it
        sB = storage.sB.get_tensor(
            cute.make_layout((_MAX_R, _BOX_N, self.stages * cw),
                             stride=(1, _MAX_R, _BOX_ELEMS)),
            swizzle=cute.make_swizzle(3, 4, 3))

        if warp == self.producer_warp:
            cpasync.prefetch_descriptor(tma_atom_b)
            if lane == 0:
                for i in cutlass.range_constexpr(self.stages):
                    cute.arch.mbarrier_init(full + i, 1)
                    cute.arch.mbarrier_init(empty + i, self.n_consumers)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        s_row = cutlass.Int64(s.stride[0])
        r8 = R // _VEC
        sw = lane % 8  # swizzle row phase of this thread's b row (row = lane in its box)

        if P >= self.cfg.bin_min_pairs:
            # ======================================================== bin mode
            plist = storage.plist.get_tensor(cute.make_layout(self.bin_list))
            ptot = storage.ptot.get_tensor(cute.make_layout(self.n_warps * self.scan_u))
            ncols = _BOX_N * cw
            nnb = (N + ncols - 1) // ncols
            nparts = self.cfg.bin_col_parts
            stage = cutlass.Int32(0)
            phase = cutlass.Int32(0)
            if warp == self.producer_warp:
                phase = cutlass.Int32(1)
            for u in cutlass.range(bidx, L * E * nparts, nblk, unroll=1):
                bn = u // nparts
                pc = u - bn * nparts
                bl = bn // E
                be = bn - bl * E
                nb_lo = (pc * nnb) // nparts
                nb_hi = ((pc + 1) * nnb) // nparts
                p_lo = cutlass.Int32(0)
                while p_lo < P:
                    fill, p_lo = scan_pairs(topk_ids, lora, plist, ptot, bl, be, p_lo,
                                            T, K, P, tidx, warp, lane, self.bin_list,
                                            self.threads, self.n_warps, self.scan_u)
                    if fill > 0:
                        if warp == self.producer_warp:
                            for nb in cutlass.range(nb_lo, nb_hi, unroll=1):
                                n0 = nb * ncols
                                nbl = cutlass.min(cw, (N - n0 + _BOX_N - 1) // _BOX_N)
                                g0 = cutlass.Int32(0)
                                while g0 < fill:
                                    gc = cutlass.min(cutlass.Int32(G), fill - g0)
                                    cute.arch.mbarrier_wait(empty + stage, phase)
                                    if lane == 0:
                                        cute.arch.mbarrier_arrive_and_expect_tx(
                                            full + stage, nbl * (_BOX_ELEMS * 2) + gc * R * 2)
                                        for z in cutlass.range(gc, unroll=1):
                                            pz = plist[g0 + z]
                                            bulk_g2s(s_buf + (stage * G + z) * _MAX_R,
                                                      s.iterator + cutlass.Int64(pz) * s_row,
                                                      full + stage, R * 2)
                                    cute.arch.sync_warp()
                                    self._load_b(tma_atom_b, tma_b, sB, be, bl,
                                                 nb * cw, nbl, stage, full)
                                    stage = stage + 1
                                    if stage == self.stages:
                                        stage = cutlass.Int32(0)
                                        phase = phase ^ 1
                                    g0 = g0 + gc
                        else:
                            for nb in cutlass.range(nb_lo, nb_hi, unroll=1):
                                n = nb * ncols + tidx
                                g0 = cutlass.Int32(0)
                                while g0 < fill:
                                    gc = cutlass.min(cutlass.Int32(G), fill - g0)
                                    cute.arch.mbarrier_wait(full + stage, phase)
                                    if n < N:
                                        brow = b_buf + (stage * self.stage_b_elems
                                                        + warp * _BOX_ELEMS + lane * _MAX_R)
                                        for z in cutlass.range(gc, unroll=1):
                                            pz = plist[g0 + z]
                                            dot = self._dot(
                                                brow, s_buf + (stage * G + z) * _MAX_R, r8, sw)
                                            if cutlass.const_expr(self.finalize):
                                                ws[(pz, n)] = dot
                                            else:
                                                y[(pz, n)] = dot
                                    cute.arch.mbarrier_arrive(empty + stage)
                                    stage = stage + 1
                                    if stage == self.stages:
                                        stage = cutlass.Int32(0)
                                        phase = phase ^ 1
                                    g0 = g0 + gc
                    # every reader of the window is done before the next scan rewrites it
                    cute.arch.barrier()
            if cutlass.const_expr(not self.finalize):
                # dead pairs: zero rows of y (one pair per consumer thread, ballot per warp)
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
                                for n in cutlass.range(lane, N, 32, unroll=1):
                                    y[(pd, n)] = cutlass.Float32(0.0)
        else:
            # ======================================================== pair mode
            # work decomposition (same in every CTA; never changes any sum)
            sms = cutlass.Int32(self.cfg.sm_count)
            nbx = cutlass.Int32(cw)
            for _ in cutlass.range_constexpr(self.cw.bit_length() - 1):
                if T * ((N + _BOX_N * nbx - 1) // (_BOX_N * nbx)) < sms:
                    nbx = nbx // 2
            ncols = _BOX_N * nbx
            nnb = (N + ncols - 1) // ncols
            units = T * nnb

            # -------------------------------------------------------- producer warp
            if warp == self.producer_warp:
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
                                bulk_g2s(s_buf + stage * self.stage_s_elems,
                                          s.iterator + cutlass.Int64(t * K + j) * s_row,
                                          full + stage, R * 2)
                            cute.arch.sync_warp()
                            self._load_b(tma_atom_b, tma_b, sB, e, l, n0 // _BOX_N, nbl,
                                         stage, full)
                            stage = stage + 1
                            if stage == self.stages:
                                stage = cutlass.Int32(0)
                                phase = phase ^ 1

            # -------------------------------------------------------- consumer warps
            if warp < self.producer_warp:
                stage = cutlass.Int32(0)
                phase = cutlass.Int32(0)
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
                                dot = self._dot(brow, s_buf + stage * self.stage_s_elems,
                                                r8, sw)
                                if cutlass.const_expr(self.finalize):
                                    acc = cute.math.fma(topk_w[(t, j)], dot, acc)
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

    @cute.kernel
    def fin_kernel(self, b: cute.Tensor, topk_ids: cute.Tensor, lora: cute.Tensor,
                   topk_w: cute.Tensor, y: cute.Tensor, ws: cute.Tensor):
        """Bin-mode finalize: y[t, n] = acc, acc = fma(w[t, j], ws[t*k + j, n], acc) over the
        live j = 0..k-1 in order: the pair-mode expression on the same dot values."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        L = b.shape[0]
        E = b.shape[1]
        N = b.shape[2]
        T = topk_ids.shape[0]
        K = topk_ids.shape[1]
        nfb = (N + _FIN_THREADS - 1) // _FIN_THREADS
        for u in cutlass.range(bidx, T * nfb, nblk, unroll=1):
            t = u // nfb
            n = (u - t * nfb) * _FIN_THREADS + tidx
            if n < N:
                l = lora[t]
                acc = cutlass.Float32(0.0)
                for j in cutlass.range(K, unroll=1):
                    e = topk_ids[(t, j)]
                    if l >= 0 and l < L and e >= 0 and e < E:
                        acc = cute.math.fma(topk_w[(t, j)], ws[(t * K + j, n)], acc)
                y[(t, n)] = acc
