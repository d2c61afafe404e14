"""sm_90a MoE-LoRA expand (see kernels/CONTRACT_BGMV.md).

    d[p, n] = sum_q s[p, q] * b[l, e, n, q]       (p = t * k + j, l = lora[t], e = topk_ids[t, j])
    finalize=True : y[t, n] = sum_{j = 0..k-1, in order, live pairs only} topk_w[t, j] * d[p, n]
    finalize=False: y[p, n] = d[p, n]  (0 for skipped pairs)

Work decomposition (persistent grid, grid-stride loop over work items): a work item is
(column chunk c of `32 * cols_per_lane` output columns, token t), token fastest, so the
CTAs running together cover many tokens of one column chunk and the (adapter, expert)
slices b[l, e, chunk, :] they share are read from DRAM once and then hit L2. The CTA has
8 warps, one per routed slot j (k <= 8): warp j computes d[t*k+j, n] for the chunk's
columns (lane owns columns n = chunk0 + 32 * i + lane), every b row and s vector is a
16-byte global load, all of a pair's loads are issued before its FMAs, and the k pairs of
a token are in flight at once on k warps (at T = 1 the first wave already holds every
b load of the whole op).
  finalize=False: warp j writes its y row directly.
  finalize=True : the k partial rows go to shared memory; after a CTA barrier one owner
  thread per column sums them in the fixed order j = 0, 1, ..., k-1 and writes y.

Reduction order (fixed by R only): d = fp32 FMA chain over q = 0, 1, ..., R-1 (one
thread, no split); finalize acc = 0, then acc = acc + w[t, j] * d_j for live j in
increasing j. Independent of T, the grid and other tokens: deterministic and
batch-invariant. No atomics: every y element has exactly one writer.

Known limit: the ABI gives expand no expert-sorted order, so pairs of one bin cannot be
grouped; every pair re-reads its b slice (from L2 after the first token of the chunk
wave), i.e. L2->SM traffic is P * N * R * 2 bytes. At large T this, not DRAM, bounds it.
v2 bin mode (P = T * k >= config.bin_min_pairs and config.bin_mode): bin_kernel's work item is
one (adapter, expert) bin (grid stride over L * E). The CTA scans the pair table (ballot +
popc compaction into a shared list in increasing p, no atomics), then per group of up to
bin_group pairs stages their s rows (cp.async, converted to fp32 once: exact) and streams the
bin's B slab in chunks of bin_cols columns through a bin_stages-deep 16-byte cp.async ring
(rows padded to 72 elements: conflict-free). Thread (column c, half h) keeps its b row in
fp32 registers (half of R_max at a time; for R > 32 a pair's chain is carried across the
halves through its exact fp32 output element) and computes d = FMA chain over q = 0..R-1,
the same expression as the pair schedule. finalize=False writes y[p, cols] (a grid-stride
pass zeroes the rows of dead pairs); finalize=True writes ws[p, cols] and a second launch
(fin_kernel) computes y[t, n] = (out = out + w[t, j] * ws[t*k+j, n] for live j in order),
the pair schedule's expression: bit-identical across modes.
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from kernels._cvt import widen
from kernels.sm90._bin_scan import collect_round, keep_remainder, slab_ptr

SASS_REQUIRED = ("LDG", "STG", "LDGSTS", "LDGDEPBAR", "VOTE")
SASS_FORBIDDEN = ("ATOM", "ATOMG", "ATOMS", "RED", "REDG", "STL", "LDL")

_DTYPES = (cutlass.Float16, cutlass.BFloat16)
_VEC = 8            # elements per 16-byte vector
_MAX_K = 8          # warps per CTA = routed slots
_MAX_RV = 8         # R <= 64: at most 8 vectors per b row
_R_MAX = 64
_PITCH = _R_MAX + 8  # bin-mode smem b row pitch (144 B: conflict-free per-thread row reads)
_SMEM_LIMIT = 227 * 1024


def _bin_smem_bytes(c) -> int:
    ring = c.bin_stages * c.bin_cols * _PITCH * 2
    srows = c.bin_group * _R_MAX * (2 + 4)
    return ring + srows + 4 * (c.bin_threads * c.bin_scan_unroll + c.bin_group) \
        + 4 * c.bin_scan_unroll * (c.bin_threads // 32) + 1024


@dataclass(frozen=True)
class BgmvExpandSm90Config:
    """cols_per_lane: output columns per lane (chunk = 32 * cols_per_lane columns). 2 doubles
        the b bytes in flight per warp (H200, T=32: 44 -> 37 us; 3 and 4 cost occupancy;
        perf/results/tune_memops_h200_small.json).
    num_sms, ctas_per_sm: grid size = min(work items, num_sms * ctas_per_sm). The default
    cap is far above any work-item count, i.e. one CTA per work item: the hardware block
    scheduler then balances bins of very uneven size (H200, T=256..2048: 11-14% faster than a
    persistent grid of num_sms=132; perf/results/tune_memops_h200_grid.json).
    pdl: variants built with after_shrink=True (the ones a plan launches right after its
        own shrink): the pair kernel (small T) is launched with programmatic stream
        serialization, so it may start while that shrink still runs; it issues its b loads
        (the routing and b are inputs that the shrink does not write) and waits
        (griddepcontrol.wait) before it loads s. Measured on the H200 against prefetching b
        into L2 before the wait and loading everything after it (which would be safe after
        any kernel): 0.5-1.2 us faster at T <= 32 (perf/results/
        tune_memops_h200_bgmv_pdl_l2.json). The stand-alone expand (after_shrink=False) is
        launched without PDL. A CTA whose pairs are all dead never waits: it only writes
        zeros to y, which the shrink does not touch."""

    cols_per_lane: int = 2
    num_sms: int = 65536
    ctas_per_sm: int = 2
    # ---- v2 bin mode (large T; see the module docstring)
    bin_mode: bool = True          # False: always the v1 pair schedule
    bin_min_pairs: int = 384       # P = T * k from which the bin schedule runs
    bin_threads: int = 256         # threads per bin CTA (multiple of bin_cols)
    bin_cols: int = 128            # output columns per ring stage (one owner column per thread)
    bin_group: int = 64            # pairs per B stream (their s rows staged in smem)
    bin_stages: int = 4            # cp.async ring depth (column chunks of the bin's B slab)
    bin_scan_unroll: int = 4       # pair-table entries per thread per scan round
    bin_ctas_per_sm: int = 2
    fin_threads: int = 128         # finalize pass: 4 columns per thread
    fin_ctas_per_sm: int = 8
    pdl: bool = True


class BgmvExpandSm90:
    def __init__(self, dtype, finalize: bool,
                 config: BgmvExpandSm90Config = BgmvExpandSm90Config(), after_shrink: bool = False):
        if not BgmvExpandSm90.can_implement(dtype, config):
            raise ValueError(f"BgmvExpandSm90 cannot implement {dtype} with {config}")
        self.dtype = dtype
        self.finalize = bool(finalize)
        self.cfg = config
        # PDL only where the kernel before is known to be the plan's shrink (see cfg.pdl)
        self.pdl = config.pdl and bool(after_shrink)
        self.NC = config.cols_per_lane
        self.CN = 32 * config.cols_per_lane
        self.num_threads = 32 * _MAX_K

    @staticmethod
    def can_implement(dtype, config: BgmvExpandSm90Config) -> bool:
        if dtype not in _DTYPES:
            return False
        c = config
        if not (1 <= c.cols_per_lane <= 4):
            return False
        if not (c.num_sms >= 1 and c.ctas_per_sm >= 1):
            return False
        if c.bin_cols < 32 or c.bin_cols % 32 or c.bin_threads % c.bin_cols:
            return False
        if not (c.bin_cols <= c.bin_threads <= 1024) or (c.bin_cols * _MAX_RV) % c.bin_threads:
            return False
        if not (1 <= c.bin_group <= c.bin_threads and 2 <= c.bin_stages <= 8):
            return False
        if not (1 <= c.bin_scan_unroll <= 32 and c.bin_min_pairs >= 1 and c.bin_ctas_per_sm >= 1):
            return False
        if not (32 <= c.fin_threads <= 1024 and c.fin_threads % 32 == 0 and c.fin_ctas_per_sm >= 1):
            return False
        return _bin_smem_bytes(c) <= _SMEM_LIMIT

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, s: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                 lora: cute.Tensor, topk_w: cute.Tensor, y: cute.Tensor, ws: cute.Tensor,
                 stream: cuda.CUstream):
        cfg = self.cfg
        T = lora.shape[0]
        N = b.shape[2]
        P = T * topk_ids.shape[1]
        use_bin = cutlass.Boolean(False)
        if cutlass.const_expr(cfg.bin_mode):
            use_bin = P >= cfg.bin_min_pairs
        if use_bin:
            b_items = b.shape[0] * b.shape[1]
            b_grid = cutlass.max(cutlass.min(b_items, cfg.num_sms * cfg.bin_ctas_per_sm), 1)
            if cutlass.const_expr(self.finalize):
                # per-pair deltas to ws, then the fixed-order per-token sum into y
                self.bin_kernel(s, b, topk_ids, lora, ws).launch(
                    grid=[b_grid, 1, 1], block=[cfg.bin_threads, 1, 1], stream=stream,
                    min_blocks_per_mp=cfg.bin_ctas_per_sm, preferred_smem_carveout=100)
                fcols = 4 * cfg.fin_threads
                f_items = T * ((N + fcols - 1) // fcols)
                f_grid = cutlass.max(cutlass.min(f_items, cfg.num_sms * cfg.fin_ctas_per_sm), 1)
                self.fin_kernel(topk_ids, lora, topk_w, ws, y, b.shape[0], b.shape[1]).launch(
                    grid=[f_grid, 1, 1], block=[cfg.fin_threads, 1, 1], stream=stream)
            else:
                self.bin_kernel(s, b, topk_ids, lora, y).launch(
                    grid=[b_grid, 1, 1], block=[cfg.bin_threads, 1, 1], stream=stream,
                    min_blocks_per_mp=cfg.bin_ctas_per_sm, preferred_smem_carveout=100)
        else:
            items = ((N + self.CN - 1) // self.CN) * T
            grid = cutlass.min(items, cfg.num_sms * cfg.ctas_per_sm)
            grid = cutlass.max(grid, 1)
            self.kernel(s, b, topk_ids, lora, topk_w, y).launch(
                grid=[grid, 1, 1], block=[self.num_threads, 1, 1], stream=stream,
                use_pdl=self.pdl)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, s: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
               lora: cute.Tensor, topk_w: cute.Tensor, y: cute.Tensor):
        NC, CN = self.NC, self.CN
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        T = lora.shape[0]
        K = topk_ids.shape[1]
        L = b.shape[0]
        E = b.shape[1]
        N = b.shape[2]
        R = b.shape[3]
        nrv = R // _VEC
        n_chunks = (N + CN - 1) // CN
        items = n_chunks * T

        vec_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                       num_bits_per_copy=128)
        sv = cute.zipped_divide(s, (1, _VEC))        # ((1, 8), (P, nrv))
        bv = cute.zipped_divide(b, (1, 1, 1, _VEC))  # ((1,1,1,8), (L, E, N, nrv))

        if cutlass.const_expr(self.finalize):
            smem = cutlass.utils.SmemAllocator()
            sd = smem.allocate_tensor(cutlass.Float32,
                                      cute.make_layout((CN, _MAX_K), stride=(1, CN)), 16)
            slive = smem.allocate_tensor(cutlass.Int32, cute.make_layout((_MAX_K,)), 16)
            sw = smem.allocate_tensor(cutlass.Float32, cute.make_layout((_MAX_K,)), 16)

        for w in cutlass.range(bid, items, nblk):
            c = w // T
            t = w - c * T
            n0 = c * CN
            j = warp
            p = t * K + j
            lo = lora[t]
            live = cutlass.Boolean(False)
            d = cute.make_rmem_tensor((NC,), cutlass.Float32)
            d.fill(0.0)
            wj = cutlass.Float32(0.0)
            if j < K:
                if cutlass.const_expr(self.finalize):
                    # the routing weight is loaded with the routing (off the critical path
                    # that starts at the wait) and handed to the finalize through smem
                    wj = topk_w[t, j]
                ex = topk_ids[t, j]
                live = (lo >= 0) & (lo < L) & (ex >= 0) & (ex < E)
                if live:
                    sf = cute.make_rmem_tensor((_VEC, _MAX_RV), self.dtype)
                    bf = cute.make_rmem_tensor((_VEC, _MAX_RV, NC), self.dtype)
                    # issue every load of the pair first: b (an input) before the wait for
                    # the shrink that writes s (self.pdl; a no-op once that kernel is done)
                    for qv in cutlass.range_constexpr(_MAX_RV):
                        if qv < nrv:
                            for i in cutlass.range_constexpr(NC):
                                n = cutlass.min(n0 + 32 * i + lane, N - 1)
                                cute.copy(vec_atom, bv[(None, (lo, ex, n, qv))], bf[None, qv, i])
                    if cutlass.const_expr(self.pdl):
                        cute.arch.griddepcontrol_wait()
                    for qv in cutlass.range_constexpr(_MAX_RV):
                        if qv < nrv:
                            cute.copy(vec_atom, sv[(None, (p, qv))], sf[None, qv])
                    # d[n] = FMA chain over q = 0 .. R-1
                    for qv in cutlass.range_constexpr(_MAX_RV):
                        if qv < nrv:
                            s32 = cute.make_rmem_tensor((_VEC,), cutlass.Float32)
                            s32.store(widen(sf[None, qv].load()))
                            for i in cutlass.range_constexpr(NC):
                                b32 = cute.make_rmem_tensor((_VEC,), cutlass.Float32)
                                b32.store(widen(bf[None, qv, i].load()))
                                acc = d[i]
                                for e8 in cutlass.range_constexpr(_VEC):
                                    acc = acc + s32[e8] * b32[e8]
                                d[i] = acc

            if cutlass.const_expr(self.finalize):
                for i in cutlass.range_constexpr(NC):
                    sd[32 * i + lane, j] = d[i]
                if lane == 0:
                    slive[j] = cutlass.Int32(live)
                    sw[j] = wj
                cute.arch.sync_threads()
                if tidx < CN:
                    n = n0 + tidx
                    out = cutlass.Float32(0.0)
                    for jj in cutlass.range(K):
                        if slive[jj] != 0:
                            out = out + sw[jj] * sd[tidx, jj]
                    if n < N:
                        y[t, n] = out
                # the next item rewrites sd / slive
                cute.arch.sync_threads()
            else:
                if j < K:
                    for i in cutlass.range_constexpr(NC):
                        n = n0 + 32 * i + lane
                        if n < N:
                            y[p, n] = d[i]

    # ================================================================== v2 bin mode
    @cute.kernel
    def bin_kernel(self, s: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                   lora: cute.Tensor, out: cute.Tensor):
        """out[p, n] = d[p, n] for the live pairs (out = ws when finalize, else y; y rows of
        dead pairs are zeroed when not finalize). Work item = one (adapter, expert) bin."""
        cfg = self.cfg
        NT, G, S, SU = cfg.bin_threads, cfg.bin_group, cfg.bin_stages, cfg.bin_scan_unroll
        CN = cfg.bin_cols
        NWP = NT // 32
        CAP = NT * SU + G
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        T = lora.shape[0]
        K = topk_ids.shape[1]
        L = b.shape[0]
        E = b.shape[1]
        N = b.shape[2]
        P = T * K
        items = L * E

        smem = cutlass.utils.SmemAllocator()
        sB = smem.allocate_tensor(self.dtype, cute.make_layout(
            (CN, _PITCH, S), stride=(_PITCH, 1, CN * _PITCH)), 128)
        sS = smem.allocate_tensor(self.dtype, cute.make_layout((G, _R_MAX), stride=(_R_MAX, 1)), 128)
        sSf = smem.allocate_tensor(cutlass.Float32,
                                   cute.make_layout((G, _R_MAX), stride=(_R_MAX, 1)), 128)
        slist = smem.allocate_tensor(cutlass.Int32, cute.make_layout((CAP,)), 16)
        swc = smem.allocate_tensor(cutlass.Int32, cute.make_layout((SU * NWP,)), 16)

        if cutlass.const_expr(not self.finalize):
            # dead pairs: their y rows are zero (one warp per pair)
            gw = bid * NWP + warp
            for p in cutlass.range(gw, P, nblk * NWP):
                t = p // K
                j = p - t * K
                lo = lora[t]
                ex = topk_ids[t, j]
                if not ((lo >= 0) & (lo < L) & (ex >= 0) & (ex < E)):
                    for n in cutlass.range(lane, N, 32):
                        out[p, n] = cutlass.Float32(0.0)

        for w in cutlass.range(bid, items, nblk):
            l_b = w // E
            e_b = w - l_b * E
            nl = cutlass.Int32(0)
            for base in cutlass.range(0, P, NT * SU):
                nl = collect_round(lora, topk_ids, l_b, e_b, base, P, K, nl, slist, swc,
                                   tidx, warp, lane, NT, NWP, SU)
                # full groups now; the remainder (< G) waits for the next round
                ng = nl // G
                for gi in cutlass.range(ng):
                    self.bin_group(s, b, out, sB, sS, sSf, slist, gi * G, G, l_b, e_b, N, tidx)
                nl = keep_remainder(slist, nl, ng, G, tidx)
            if nl > 0:
                self.bin_group(s, b, out, sB, sS, sSf, slist, 0, nl, l_b, e_b, N, tidx)
            cute.arch.sync_threads()

    @cute.jit
    def bin_group(self, s: cute.Tensor, b: cute.Tensor, out: cute.Tensor, sB: cute.Tensor,
                  sS: cute.Tensor, sSf: cute.Tensor, slist: cute.Tensor, off: cutlass.Int32,
                  n: cutlass.Int32, l_b: cutlass.Int32, e_b: cutlass.Int32, N: cutlass.Int32,
                  tidx: cutlass.Int32):
        """The n (<= G) pairs slist[off .. off+n) of bin (l_b, e_b): their s rows are staged
        once, then the bin's B slab streams through the ring in chunks of CN columns; thread
        (column c, half h) computes d[p, n] for the pairs m = h, h + TPC, ... with the same
        FMA chain as the pair schedule (q = 0 .. R-1, fp32)."""
        cfg = self.cfg
        NT, G, S, CN = cfg.bin_threads, cfg.bin_group, cfg.bin_stages, cfg.bin_cols
        TPC = NT // CN
        R = b.shape[3]
        R8 = R // _VEC
        nch = (N + CN - 1) // CN
        c = tidx % CN
        h = tidx // CN
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.dtype, num_bits_per_copy=128)
        slab = slab_ptr(b, l_b, e_b, _VEC)
        # ---- the group's s rows (own commit group, first)
        for ps in cutlass.range_constexpr((G * _MAX_RV + NT - 1) // NT):
            v = ps * NT + tidx
            m = v // _MAX_RV
            q = v - m * _MAX_RV
            if (m < n) & (q < R8):
                pm = slist[off + m]
                src = cute.local_tile(s[pm, None], (_VEC,), (q,))
                dst = cute.local_tile(sS[m, None], (_VEC,), (q,))
                cute.copy(atom, src, dst)
        cute.arch.cp_async_commit_group()
        for st in cutlass.range_constexpr(S - 1):
            if st < nch:
                self.bin_load_stage(b, slab, sB, N, R8, st, st, tidx)
            cute.arch.cp_async_commit_group()
        # s rows landed (the S-1 newer groups may be pending): convert them to fp32 once
        cute.arch.cp_async_wait_group(S - 1)
        cute.arch.sync_threads()
        for ps in cutlass.range_constexpr((G * _MAX_RV + NT - 1) // NT):
            v = ps * NT + tidx
            m = v // _MAX_RV
            q = v - m * _MAX_RV
            if (m < n) & (q < R8):
                vs = cute.local_tile(sS[m, None], (_VEC,), (q,))
                vf = cute.local_tile(sSf[m, None], (_VEC,), (q,))
                vf.store(vs.load().to(cutlass.Float32))  # once per group

        # b row in fp32 registers, half of R_max at a time: for R > 32 the chain of every
        # pair is carried across the halves through its (fp32, exact) output element, which
        # the same thread wrote; the fp32 operation sequence is unchanged.
        HV = _MAX_RV // 2
        bf = cute.make_rmem_tensor((_VEC, HV), cutlass.Float32)
        for hs in cutlass.range(nch):
            cute.arch.cp_async_wait_group(S - 2)
            cute.arch.sync_threads()
            nxt = hs + (S - 1)
            if nxt < nch:
                self.bin_load_stage(b, slab, sB, N, R8, nxt, nxt % S, tidx)
            cute.arch.cp_async_commit_group()
            slot = hs % S
            col = hs * CN + c
            for half in cutlass.range_constexpr(2):
                if (half == 0) | (R8 > HV):
                    for qq in cutlass.range_constexpr(HV):
                        qv = half * HV + qq
                        if qv < R8:
                            vb = cute.local_tile(sB[c, None, slot], (_VEC,), (qv,))
                            # (.to, not widen: widen spills at 128 registers here)
                            bf[None, qq].store(vb.load().to(cutlass.Float32))
                    for m in cutlass.range(h, n, TPC):
                        pm = slist[off + m]
                        d = cutlass.Float32(0.0)
                        if cutlass.const_expr(half == 1):
                            if col < N:
                                d = out[pm, col]
                        for qq in cutlass.range_constexpr(HV):
                            qv = half * HV + qq
                            if qv < R8:
                                s32 = cute.make_rmem_tensor((_VEC,), cutlass.Float32)
                                s32.store(cute.local_tile(sSf[m, None], (_VEC,), (qv,)).load())
                                acc = d
                                for e8 in cutlass.range_constexpr(_VEC):
                                    acc = acc + s32[e8] * bf[e8, qq]
                                d = acc
                        if col < N:
                            out[pm, col] = d
        # every thread is out of the ring / s rows before the next group refills them
        cute.arch.sync_threads()

    @cute.jit
    def bin_load_stage(self, b: cute.Tensor, slab: cute.Pointer, sB: cute.Tensor,
                       N: cutlass.Int32, R8: cutlass.Int32,
                       st: cutlass.Int32, slot: cutlass.Int32, tidx: cutlass.Int32):
        """cp.async column chunk `st` (CN rows of b[l_b, e_b], R elements each) into ring slot
        `slot`; rows past N and vectors past R are not copied (never used)."""
        cfg = self.cfg
        NT, CN = cfg.bin_threads, cfg.bin_cols
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.dtype, num_bits_per_copy=128)
        # 32-bit offsets inside the bin's slab (b[l_b, e_b]: N * R elements) from its base
        # pointer, computed once per group; indexing the 4-mode tensor per copy was ~15
        # integer instructions each, a quarter of the bin kernel's instructions
        s_n = cutlass.Int32(b.stride[2])
        for ps in cutlass.range_constexpr(CN * _MAX_RV // NT):
            v = ps * NT + tidx
            row = v // _MAX_RV
            q = v - row * _MAX_RV
            n = st * CN + row
            if (q < R8) & (n < N):
                src = cute.make_tensor(slab + cute.assume(n * s_n + q * _VEC, divby=_VEC),
                                       cute.make_layout(_VEC))
                dst = cute.local_tile(sB[row, None, slot], (_VEC,), (q,))
                cute.copy(atom, src, dst)

    @cute.kernel
    def fin_kernel(self, topk_ids: cute.Tensor, lora: cute.Tensor, topk_w: cute.Tensor,
                   ws: cute.Tensor, y: cute.Tensor, L: cutlass.Int32, E: cutlass.Int32):
        """y[t, n] = sum over live j = 0 .. k-1 (in order) of w[t, j] * ws[t*k+j, n]; the
        same expression (out = out + w * d, fp32) as the pair schedule's finalize."""
        FT = self.cfg.fin_threads
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        T = lora.shape[0]
        K = topk_ids.shape[1]
        N = y.shape[1]
        fcols = 4 * FT
        nfc = (N + fcols - 1) // fcols
        items = T * nfc
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float32,
                                   num_bits_per_copy=128)
        wsv = cute.zipped_divide(ws, (1, 4))     # ((1, 4), (P, N / 4))
        yv = cute.zipped_divide(y, (1, 4))       # ((1, 4), (T, N / 4))
        for w in cutlass.range(bid, items, nblk):
            t = w // nfc
            fc = w - t * nfc
            n4 = fc * FT + tidx                   # 4-column vector index
            lo = lora[t]
            o = cute.make_rmem_tensor((4,), cutlass.Float32)
            o.fill(0.0)
            if n4 * 4 < N:
                for jj in cutlass.range(K):
                    ex = topk_ids[t, jj]
                    if (lo >= 0) & (lo < L) & (ex >= 0) & (ex < E):
                        wv = topk_w[t, jj]
                        dv = cute.make_rmem_tensor((4,), cutlass.Float32)
                        cute.copy(atom, wsv[(None, (t * K + jj, n4))], dv)
                        for e4 in cutlass.range_constexpr(4):
                            out = o[e4]
                            out = out + wv * dv[e4]
                            o[e4] = out
                cute.copy(atom, o, yv[(None, (t, n4))])
