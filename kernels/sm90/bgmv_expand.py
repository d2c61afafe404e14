"""sm_90a MoE-LoRA expand (see kernels/CONTRACT_BGMV.md, v3).

    d[p, n] = sum_q s[p, q] * b[l, e, n, q]       (p = t * k + j, l = lora[t], e = topk_ids[t, j])
    finalize=True : y[t, n] = sum_{j = 0..k-1, in order, live pairs only} topk_w[t, j] * d[p, n]
    finalize=False: y[p, n] = d[p, n]  (0 for skipped pairs)

Arithmetic (fixed by R only; kernels/_mma.py has the fragment convention): d is one tensor-core
chain (mma.sync m16n8k16, fp32 accumulation) over the 32-element k blocks of R (one block for
R <= 32, two up to 64), two steps per block, from 0; vectors past R are zeros. Finalize:
acc = 0, then acc = acc + w[t, j] * d_j for live j in increasing j. Which tile row a pair
occupies does not change its bits (mma rows are independent), so both schedules below agree
bit for bit: deterministic and batch-invariant. No atomics: every y element has one writer.

Pair schedule (P < bin_min_pairs: small T, latency). Work item = (column chunk of 64 output
columns, token t), token fastest, so the CTAs running together share b slices through L2. The
CTA has 8 warps, one per routed slot j (k <= 8): warp j loads its pair's b rows for the chunk
(8 n-tiles, 16-byte LDGs, all in flight), then s, and runs one chain per n-tile with the
pair's s in every tile row; lane (g, q) keeps n-tile g, i.e. columns 8g + 2q, 8g + 2q + 1.
  finalize=False: warp j writes its y row directly.
  finalize=True : the k partial rows go to shared memory; after a CTA barrier one owner
  thread per column sums them in the fixed order j = 0, 1, ..., k-1 and writes y.
A plan's pair expand (after_shrink) at R <= 32 runs one item per CTA from one wave of items
up, 3 CTAs per SM; beyond one such wave at R = 32 the lanes cp.async the same b vectors into
shared memory and read them back as the same fragments (4 CTAs per SM); at R = 33..64 the
same staging (two k blocks) from one wave of items (2 CTAs per SM). Same chains, same bits.

Bin schedule (P >= bin_min_pairs: large T, bandwidth). Work item = one (adapter, expert) bin
(grid stride over L * E). The CTA collects the bin's pairs from the routing table into a
shared list (kernels/sm90/_bin_scan.py: prefix sums, no atomics; a first few B stages are
already loading when P >= bin_prefetch_min * L * E); per group of up to 16 * bin_mtiles
pairs it loads their s rows as mma fragments (registers) and streams the bin's B slab
through a bin_stages-deep 16-byte cp.async ring in chunks of bin_cols columns (twice that at
rank 17..32, four times at rank <= 16: ring rows of 64, 32 or 16 elements, the same bytes per
stage); each warp takes n-tiles of the chunk and runs the same chain for every m-tile of
pairs, so every b element feeds up to 16 pairs per instruction. finalize=False writes y[p, cols] (a
grid-stride pass zeroes the rows of dead pairs); finalize=True writes ws[p, cols] and a
second launch (fin_kernel) computes y[t, n] = (out = out + w[t, j] * ws[t*k+j, n] for live j
in order), the pair schedule's expression: bit-identical across schedules.
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from kernels._mma import all_loaded, is_bf16, mma_block, words, zero_unless
from kernels.sm90._bin_scan import routed, run_bin, slab_ptr

SASS_REQUIRED = ("LDG", "STG", "HMMA", "LDGSTS", "LDGDEPBAR", "VOTE")
SASS_FORBIDDEN = ("ATOM", "ATOMG", "ATOMS", "RED", "REDG", "STL", "LDL")

_DTYPES = (cutlass.Float16, cutlass.BFloat16)
_VEC = 8            # elements per 16-byte vector
_KB = 32            # elements per k block
_MAX_K = 8          # warps per pair CTA = routed slots
_R_MAX = 64
_CN = 64            # pair schedule: output columns per work item (8 n-tiles)
_SMEM_LIMIT = 227 * 1024


def _pair_at(y, row, col):
    """y[row, col:col + 2] as a 2-element tensor the DSL knows is 8-byte aligned (col even;
    the ABI makes the row stride a multiple of 4 and the base 16-byte aligned)."""
    return cute.make_tensor(y.iterator + cute.assume(row * y.stride[0] + col, divby=2),
                            cute.make_layout(2))


def _bin_smem_bytes(c) -> int:
    ring = c.bin_stages * c.bin_cols * _R_MAX * 2
    return ring + 4 * (c.bin_threads * c.bin_scan_unroll + 16 * c.bin_mtiles) \
        + 4 * c.bin_scan_unroll * (c.bin_threads // 32) + 1024


@dataclass(frozen=True)
class BgmvExpandSm90Config:
    """num_sms, ctas_per_sm: pair-schedule grid = min(work items, num_sms * ctas_per_sm). The
    default cap is far above any work-item count, i.e. one CTA per work item.
    bin_*: the bin schedule (module docstring); bin_mtiles: 16-pair m-tiles per group,
    bin_cols: output columns per ring stage at rank 33..64, twice that at rank 17..32 and four
        times at rank <= 16 (the same bytes per stage; 128-column stages at rank 16 before: H200
        r=16 plans T=256 73.4 -> 69.9 us, T=512 89.2 -> 83.5, T=2048 210.5 -> 200.7,
        perf/results/tune_memops_h200_bgmv_r16_rows.json).
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

    num_sms: int = 65536
    ctas_per_sm: int = 2
    bin_mode: bool = True          # False: always the pair schedule
    bin_min_pairs: int = 384       # P = T * k from which the bin schedule runs
    bin_threads: int = 128         # 4 warps x 4 CTAs per SM (was 8 x 2 with 128 columns per
                                   # stage: T=256 101.9 -> 97.8 us, T=512 118.5 -> 117.2,
                                   # T=1024 and 2048 within 0.5%; tune_memops_h200_bgmv_rings3)
    bin_cols: int = 64             # output columns per ring stage (R > 32; x2 / x4 at R <= 32 / 16)
    bin_mtiles: int = 1            # 16-pair m-tiles per group
    bin_stages: int = 4            # cp.async ring depth (column chunks of the bin's B slab)
    bin_scan_unroll: int = 4       # pair-table entries per thread per scan round
    bin_ctas_per_sm: int = 4
    bin_prefetch_min: int = 2      # pairs per bin (P / (L * E)) from which a bin's first B
                                   # stages are issued before its pair scan (0: never)
    pair_dense_items: int = 264    # pair schedule at R <= 32: from this many work items (2 CTAs
                                   # per SM on 132 SMs: one wave) the kernel is the R <= 32
                                   # build alone, one item per CTA, bounded to 3 CTAs per SM
                                   # (plans only: the stand-alone finalize build spilled a
                                   # register at that bound). H200 before: T=6 12.0 us, T=7 14.0
                                   # (perf/small_t_sweep.py). It was capped at one wave (396
                                   # items) until the A/B of perf/results/
                                   # tune_memops_h200_bgmv_dense_all.json: more waves of 3
                                   # CTAs per SM beat fewer of 2 too (T=16 21.6 -> 20.2 us,
                                   # T=32 33.3 -> 30.7, T=60 51.5 -> 46.5).
    pair_dense_ctas_per_sm: int = 3
    # Above pair_staged_min_items items (one wave of the build above on 132 SMs) the R <= 32
    # build stages each warp's B vectors through shared memory by cp.async (4 KB per warp)
    # instead of holding them in registers: 55-61 registers, 4 CTAs per SM (5 spill). Same
    # fragments, same bits. H200 A/B (perf/results/tune_memops_h200_bgmv_staged_expand.json,
    # 3 rounds, plan us, staged at every count from 264): T=12 18.0 -> 16.0-16.6, T=24 27.2 ->
    # 26.0, T=32 31.5 -> 30.3, T=48 40.8 -> 38.5, but T=8 (336 items, one wave either way)
    # 12.45 -> 13.8, hence the threshold (0: never). Rank 32 only (four distinct vectors per
    # row; at rank 16 two lanes of four load copies): rank 16 ran 10-19% slower staged (T=32
    # 21.1 -> 24.9 us, T=60 32.1 -> 38.2, same file).
    pair_staged_min_items: int = 396
    pair_staged_ctas_per_sm: int = 4
    # rank 33..64: from this many items (0: never) a plan's pair expand runs a staged build
    # too (two k blocks: 8 KB of b per warp), one item per CTA, at most 2 CTAs per SM (84
    # registers: 3 per SM spill), beside the shrink's staged CTAs (BgmvShrinkSm90Config
    # .pair_smem_wide_min_items has the A/B).
    pair_staged64_min_items: int = 264
    pair_staged64_ctas_per_sm: int = 2
    fin_threads: int = 128         # finalize pass: 4 columns per thread
    fin_ctas_per_sm: int = 8
    pdl: bool = True
    bin_pdl: bool = True           # the bin kernel too (after_shrink variants; the shrink's
                                   # bin kernel triggers at entry): its CTAs take the SMs the
                                   # shrink's last wave leaves, issue their first B stages and
                                   # scan, then wait before a group's s loads. H200: T=256
                                   # 105.4 -> 103.0 us, T=1024 161.6 -> 155.4, T=2048 242.0 ->
                                   # 229.0 (tune_memops_h200_bgmv_binpdl.json)


class BgmvExpandSm90:
    SMEM_LIMIT = _SMEM_LIMIT    # per CTA (the Ada design's subclass lowers it)

    def __init__(self, dtype, finalize: bool,
                 config: BgmvExpandSm90Config = BgmvExpandSm90Config(), after_shrink: bool = False):
        if not type(self).can_implement(dtype, config):
            raise ValueError(f"{type(self).__name__} cannot implement {dtype} with {config}")
        self.dtype = dtype
        self.bf16 = is_bf16(dtype)
        self.finalize = bool(finalize)
        self.cfg = config
        # PDL only where the kernel before is known to be the plan's shrink (see cfg.pdl)
        self.pdl = config.pdl and bool(after_shrink)
        self.num_threads = 32 * _MAX_K

    @classmethod
    def can_implement(cls, dtype, config: BgmvExpandSm90Config) -> bool:
        if dtype not in _DTYPES:
            return False
        c = config
        if not (c.num_sms >= 1 and c.ctas_per_sm >= 1):
            return False
        nw = c.bin_threads // 32
        if c.bin_threads % 32 or not (64 <= c.bin_threads <= 1024):
            return False
        if c.bin_cols < 8 or c.bin_cols % (8 * nw) or (c.bin_cols * _R_MAX // _VEC) % c.bin_threads:
            return False
        if not (1 <= c.bin_mtiles <= 4 and 2 <= c.bin_stages <= 8):
            return False
        if not (1 <= c.bin_scan_unroll <= 32 and c.bin_min_pairs >= 1 and c.bin_ctas_per_sm >= 1):
            return False
        if not (32 <= c.fin_threads <= 1024 and c.fin_threads % 32 == 0 and c.fin_ctas_per_sm >= 1):
            return False
        return _bin_smem_bytes(c) <= cls.SMEM_LIMIT

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
            # finalize: per-pair deltas to ws, then the fixed-order per-token sum into y
            self.bin_kernel(s, b, topk_ids, lora, ws if self.finalize else y).launch(
                grid=[b_grid, 1, 1], block=[cfg.bin_threads, 1, 1], stream=stream,
                min_blocks_per_mp=cfg.bin_ctas_per_sm, preferred_smem_carveout=100,
                use_pdl=self.pdl and cfg.bin_pdl)
            if cutlass.const_expr(self.finalize):
                fcols = 4 * cfg.fin_threads
                f_items = T * ((N + fcols - 1) // fcols)
                f_grid = cutlass.max(cutlass.min(f_items, cfg.num_sms * cfg.fin_ctas_per_sm), 1)
                self.fin_kernel(topk_ids, lora, topk_w, ws, y, b.shape[0], b.shape[1]).launch(
                    grid=[f_grid, 1, 1], block=[cfg.fin_threads, 1, 1], stream=stream)
        else:
            items = ((N + _CN - 1) // _CN) * T
            dense = cutlass.Boolean(False)
            if cutlass.const_expr(self.pdl):
                dense = (items >= cfg.pair_dense_items) & (b.shape[3] <= _KB)
            wide = cutlass.Boolean(False)
            if cutlass.const_expr(self.pdl and cfg.pair_staged64_min_items > 0):
                wide = (items >= cfg.pair_staged64_min_items) & (b.shape[3] > _KB)
            if dense:
                self.launch_dense(s, b, topk_ids, lora, topk_w, y, items, stream)
            elif wide:
                self.launch_staged64(s, b, topk_ids, lora, topk_w, y, items, stream)
            else:
                grid = cutlass.min(items, cfg.num_sms * cfg.ctas_per_sm)
                grid = cutlass.max(grid, 1)
                self.kernel(s, b, topk_ids, lora, topk_w, y, False, False).launch(
                    grid=[grid, 1, 1], block=[self.num_threads, 1, 1], stream=stream,
                    use_pdl=self.pdl)

    @cute.jit
    def launch_staged64(self, s: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                        lora: cute.Tensor, topk_w: cute.Tensor, y: cute.Tensor,
                        items: cutlass.Int32, stream: cuda.CUstream):
        """The staged build for rank 33..64, one item per CTA (plans only)."""
        if cutlass.const_expr(self.pdl and self.cfg.pair_staged64_min_items > 0):
            self._launch_per_item(s, b, topk_ids, lora, topk_w, y, items, stream, False, True,
                                  self.cfg.pair_staged64_ctas_per_sm)

    @cute.jit
    def launch_dense(self, s: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                     lora: cute.Tensor, topk_w: cute.Tensor, y: cute.Tensor,
                     items: cutlass.Int32, stream: cuda.CUstream):
        """The pair kernel's R <= 32 build, one item per CTA (plans only): 3 CTAs per SM, or
        staged through shared memory at 4 per SM above pair_staged_min_items items."""
        if cutlass.const_expr(self.pdl):
            staged = cutlass.Boolean(False)
            if cutlass.const_expr(self.cfg.pair_staged_min_items > 0):
                staged = (items > self.cfg.pair_staged_min_items) & (b.shape[3] == _KB)
            if staged:
                self._launch_per_item(s, b, topk_ids, lora, topk_w, y, items, stream, True,
                                      True, self.cfg.pair_staged_ctas_per_sm)
            else:
                self._launch_per_item(s, b, topk_ids, lora, topk_w, y, items, stream, True,
                                      False, self.cfg.pair_dense_ctas_per_sm)

    @cute.jit
    def _launch_per_item(self, s: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                         lora: cute.Tensor, topk_w: cute.Tensor, y: cute.Tensor,
                         items: cutlass.Int32, stream: cuda.CUstream, r32: cutlass.Constexpr,
                         staged: cutlass.Constexpr, ctas_per_sm: cutlass.Constexpr):
        """A one-item-per-CTA build of the pair kernel (PDL: plans only); the staged ones
        take the shared memory carveout."""
        self.kernel(s, b, topk_ids, lora, topk_w, y, r32, staged).launch(
            grid=[items, 1, 1], block=[self.num_threads, 1, 1], stream=stream,
            min_blocks_per_mp=ctas_per_sm, preferred_smem_carveout=100 if staged else 25,
            use_pdl=True)

    # ------------------------------------------------------------------ pair schedule
    @cute.kernel
    def kernel(self, s: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
               lora: cute.Tensor, topk_w: cute.Tensor, y: cute.Tensor, r32: cutlass.Constexpr,
               staged: cutlass.Constexpr):
        """r32: the build for R <= 32 only (launched with pair_dense_ctas_per_sm); staged
        (r32 only): its B vectors go through shared memory (pair_staged_min_items)."""
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        T = lora.shape[0]
        N = b.shape[2]
        items = (N + _CN - 1) // _CN * T

        if cutlass.const_expr(self.finalize or staged):
            smem = cutlass.utils.SmemAllocator()
        if cutlass.const_expr(self.finalize):
            sd = smem.allocate_tensor(cutlass.Float32,
                                      cute.make_layout((_CN, _MAX_K), stride=(1, _CN)), 16)
            slive = smem.allocate_tensor(cutlass.Int32, cute.make_layout((_MAX_K,)), 16)
            sw = smem.allocate_tensor(cutlass.Float32, cute.make_layout((_MAX_K,)), 16)

        if cutlass.const_expr(not self.finalize):
            sd, slive, sw = None, None, None
        sBw = None
        if cutlass.const_expr(staged):
            nbw = 1 if r32 else 2               # k blocks of R per warp slot
            sB = smem.allocate_tensor(self.dtype,
                                      cute.make_layout(_MAX_K * nbw * 8 * 32 * _VEC), 16)
            # this warp's nbw x 8 x 32 vectors (lane-major per n-tile: conflict-free reads)
            sBw = cute.local_tile(sB, (nbw * 8 * 32 * _VEC,), (warp,))
        if cutlass.const_expr(r32 or staged):
            # one item per CTA (the launch covers every item): no loop-carried registers
            if bid < items:
                self._pair_item(bid, s, b, topk_ids, lora, topk_w, y, sd, slive, sw, tidx,
                                warp, lane, r32, sBw)
        else:
            for w in cutlass.range(bid, items, nblk):
                self._pair_item(w, s, b, topk_ids, lora, topk_w, y, sd, slive, sw, tidx,
                                warp, lane, r32)

    @cute.jit
    def _pair_item(self, w: cutlass.Int32, s: cute.Tensor, b: cute.Tensor,
                   topk_ids: cute.Tensor, lora: cute.Tensor, topk_w: cute.Tensor,
                   y: cute.Tensor, sd, slive, sw, tidx: cutlass.Int32, warp: cutlass.Int32,
                   lane: cutlass.Int32, r32: cutlass.Constexpr, sBw=None):
        """Work item w = (column chunk, token) of the pair schedule."""
        g = lane >> 2
        q = lane & 3
        T = lora.shape[0]
        K = topk_ids.shape[1]
        L = b.shape[0]
        E = b.shape[1]
        N = b.shape[2]
        R = b.shape[3]
        nrv = R // _VEC
        zmask = cutlass.Int32(N) >> 30           # 0 at run time, opaque to ptxas
        vec_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                       num_bits_per_copy=128)
        st_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float32,
                                      num_bits_per_copy=64)
        sv = cute.zipped_divide(s, (1, _VEC))        # ((1, 8), (P, nrv))
        bv = cute.zipped_divide(b, (1, 1, 1, _VEC))  # ((1,1,1,8), (L, E, N, nrv))
        c = w // T
        t = w - c * T
        n0 = c * _CN
        j = warp
        p = t * K + j
        lo = lora[t]
        live = cutlass.Boolean(False)
        # lane (g, q) ends with columns n0 + 8g + 2q, +1 (n-tile g of the chunk)
        d = cute.make_rmem_tensor((2,), cutlass.Float32)
        d.fill(0.0)
        wj = cutlass.Float32(0.0)
        if j < K:
            if cutlass.const_expr(self.finalize):
                # the routing weight is loaded with the routing (off the critical path
                # that starts at the wait) and handed to the finalize through smem
                wj = topk_w[t, j]
            ex = topk_ids[t, j]
            live = routed(lo, ex, L, E)
            if live:
                if cutlass.const_expr(r32 and self.finalize):
                    # wj goes to shared memory once the b loads are out (not held in a
                    # register under them: at 80 registers it spilled)
                    self._pair_dots(sv, bv, vec_atom, d, p, lo, ex, n0, N, nrv, g, q,
                                    zmask, 1, lambda: self._put_w(sw, j, wj, lane), b, sBw, lane)
                elif cutlass.const_expr(r32):
                    self._pair_dots(sv, bv, vec_atom, d, p, lo, ex, n0, N, nrv, g, q,
                                    zmask, 1, None, b, sBw, lane)
                else:
                    # the staged build (sBw) addresses b from the slab; the other one clamps
                    bs = b if sBw is not None else None
                    if R > _KB:
                        self._pair_dots(sv, bv, vec_atom, d, p, lo, ex, n0, N, nrv, g, q,
                                        zmask, 2, None, bs, sBw, lane)
                    else:
                        self._pair_dots(sv, bv, vec_atom, d, p, lo, ex, n0, N, nrv, g, q,
                                        zmask, 1, None, bs, sBw, lane)

        if cutlass.const_expr(self.finalize):
            for e2 in cutlass.range_constexpr(2):
                sd[8 * g + 2 * q + e2, j] = d[e2]
            if lane == 0:
                slive[j] = cutlass.Int32(live)
                if cutlass.const_expr(not r32):   # (r32: stored in _pair_dots)
                    sw[j] = wj
            cute.arch.sync_threads()
            if tidx < _CN:
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
            n = n0 + 8 * g + 2 * q
            if (j < K) & (n < N):     # (n even, N % 8 == 0: n + 1 < N too)
                cute.copy(st_atom, d, _pair_at(y, p, n))


    @cute.jit
    def _put_w(self, sw: cute.Tensor, j: cutlass.Int32, wj: cutlass.Float32,
               lane: cutlass.Int32):
        if lane == 0:
            sw[j] = wj

    @cute.jit
    def _pair_dots(self, sv, bv, vec_atom, d: cute.Tensor, p: cutlass.Int32, lo: cutlass.Int32,
                   ex: cutlass.Int32, n0: cutlass.Int32, N: cutlass.Int32, nrv: cutlass.Int32,
                   g: cutlass.Int32, q: cutlass.Int32, zmask: cutlass.Int32,
                   NB: cutlass.Constexpr, after_b=None, b=None, sBw=None, lane=None):
        """d = the chains of n-tile g of the chunk for pair p (NB k blocks of R). after_b:
        called once the b loads are issued. b: rows addressed from the slab's base pointer
        with 32-bit offsets, rows past N not loaded (zeros; same products): fewer address
        registers than a clamped 64-bit address per load (register builds: NB = 1 only).
        sBw (with b): the staged builds, through this warp's shared-memory slots."""
        bf = cute.make_rmem_tensor((_VEC, NB, 8), self.dtype)
        sf = cute.make_rmem_tensor((_VEC, NB), self.dtype)
        # every load of the pair first: b (an input) before the wait for the shrink that
        # writes s (self.pdl; a no-op once that kernel is done)
        if cutlass.const_expr(b is not None):
            # staged (sBw): cp.async the same vectors into this lane's slots, read back below
            staged = sBw is not None
            if cutlass.const_expr(staged):
                atom = cute.make_copy_atom(
                    cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype,
                    num_bits_per_copy=128)
            else:
                atom = vec_atom
                bf.fill(0.0)
            s_n = cutlass.Int32(b.stride[2])
            for kb in cutlass.range_constexpr(NB):
                base = slab_ptr(b, lo, ex, _VEC) + cute.assume(
                    (n0 + g) * s_n + cutlass.min(4 * kb + q, nrv - 1) * _VEC, divby=_VEC)
                for i in cutlass.range_constexpr(8):
                    if n0 + 8 * i + g < N:
                        src = cute.make_tensor(base + cute.assume(8 * i * s_n, divby=_VEC),
                                               cute.make_layout(_VEC))
                        if cutlass.const_expr(staged):
                            dst = cute.local_tile(sBw, (_VEC,), (32 * (8 * kb + i) + lane,))
                        else:
                            dst = bf[None, kb, i]
                        cute.copy(atom, src, dst)
            if cutlass.const_expr(staged):
                cute.arch.cp_async_commit_group()
        else:
            for i in cutlass.range_constexpr(8):
                n = cutlass.min(n0 + 8 * i + g, N - 1)
                for kb in cutlass.range_constexpr(NB):
                    v = cutlass.min(4 * kb + q, nrv - 1)
                    cute.copy(vec_atom, bv[(None, (lo, ex, n, v))], bf[None, kb, i])
        if cutlass.const_expr(after_b is not None):
            after_b()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        for kb in cutlass.range_constexpr(NB):
            v = cutlass.min(4 * kb + q, nrv - 1)
            cute.copy(vec_atom, sv[(None, (p, v))], sf[None, kb])
        if cutlass.const_expr(sBw is not None):
            cute.arch.cp_async_wait_group(0)
        # all loads in flight before the first mma (see kernels/_mma.py: all_loaded)
        hold = all_loaded([sf] if sBw is not None else [bf, sf], zmask)
        for i in cutlass.range_constexpr(8):
            acc = cute.make_rmem_tensor((4,), cutlass.Float32)
            acc.fill(0.0)
            if cutlass.const_expr(sBw is not None):
                # this n-tile's vectors from the lane's slots: the same words (rows past N
                # stay zero, as in the slab-addressed register build)
                bi = cute.make_rmem_tensor((_VEC, NB), self.dtype)
                bi.fill(0.0)
                if n0 + 8 * i + g < N:
                    for kb in cutlass.range_constexpr(NB):
                        cute.autovec_copy(
                            cute.local_tile(sBw, (_VEC,), (32 * (8 * kb + i) + lane,)),
                            bi[None, kb])
            for kb in cutlass.range_constexpr(NB):
                ok = 4 * kb + q < nrv
                sw_ = zero_unless(words(sf[None, kb]), ok)
                if cutlass.const_expr(i == 0 and kb == 0):
                    sw_[0] = sw_[0] | hold
                bw = words(bi[None, kb]) if sBw is not None else words(bf[None, kb, i])
                mma_block(sw_, sw_, zero_unless(bw, ok), acc, self.bf16)
            if g == i:
                d[0] = acc[0]
                d[1] = acc[1]

    # ================================================================== bin schedule
    @cute.kernel
    def bin_kernel(self, s: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                   lora: cute.Tensor, out: cute.Tensor):
        """out[p, n] = d[p, n] for the live pairs (out = ws when finalize, else y; y rows of
        dead pairs are zeroed when not finalize). Work item = one (adapter, expert) bin."""
        cfg = self.cfg
        NT, S, SU = cfg.bin_threads, cfg.bin_stages, cfg.bin_scan_unroll
        G = 16 * cfg.bin_mtiles
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
        sB = smem.allocate_tensor(self.dtype, cute.make_layout((S * CN * _R_MAX,)), 128)
        slist = smem.allocate_tensor(cutlass.Int32, cute.make_layout((CAP,)), 16)
        swc = smem.allocate_tensor(cutlass.Int32, cute.make_layout((SU * NWP + 1,)), 16)

        if cutlass.const_expr(not self.finalize):
            self.zero_dead(out, topk_ids, lora, L, E, P, K, N, bid, nblk, warp, lane, NWP)

        # with few empty bins, a bin's first B stages load while it scans (the loads of an
        # empty bin are wasted, hence the threshold)
        pre = cutlass.Boolean(False)
        if cutlass.const_expr(cfg.bin_prefetch_min > 0):
            pre = P >= cfg.bin_prefetch_min * L * E
        for w in cutlass.range(bid, items, nblk):
            l_b = w // E
            e_b = w - l_b * E
            # specialized on the ring row width RW (R rounded up to 16, 32 or 64): R <= 32
            # holds one k block of s fragments, and the stage holds 64 / RW times the columns
            # in the same shared memory, so the bytes in flight per CTA do not depend on R
            if b.shape[3] > _KB:
                self.bin_item(s, b, out, sB, slist, swc, lora, topk_ids, l_b, e_b, N, P, K,
                              tidx, warp, lane, pre, 64)
            elif b.shape[3] > 16:
                self.bin_item(s, b, out, sB, slist, swc, lora, topk_ids, l_b, e_b, N, P, K,
                              tidx, warp, lane, pre, 32)
            else:
                self.bin_item(s, b, out, sB, slist, swc, lora, topk_ids, l_b, e_b, N, P, K,
                              tidx, warp, lane, pre, 16)

    @cute.jit
    def zero_dead(self, y: cute.Tensor, topk_ids: cute.Tensor, lora: cute.Tensor, L, E, P, K,
                  N, bid, nblk, warp, lane, NWP: cutlass.Constexpr):
        """finalize=False, bin schedule: the y rows of dead pairs (skipped adapter / expert)
        are zero (grid-stride, one warp per pair). The bin schedule never visits them."""
        for p in cutlass.range(bid * NWP + warp, P, nblk * NWP):
            t = p // K
            j = p - t * K
            lo = lora[t]
            ex = topk_ids[t, j]
            if not routed(lo, ex, L, E):
                for n in cutlass.range(lane, N, 32):
                    y[p, n] = cutlass.Float32(0.0)

    @cute.jit
    def bin_item(self, s, b, out, sB, slist, swc, lora, topk_ids, l_b, e_b, N, P, K, tidx,
                 warp, lane, pre, RW: cutlass.Constexpr):
        """Bin (l_b, e_b): collect its pairs, run them in groups. pre: the first group's B
        stages are issued before the scan (one commit group per stage, as the group's own
        prologue would)."""
        cfg = self.cfg
        NT, SU = cfg.bin_threads, cfg.bin_scan_unroll
        G = 16 * cfg.bin_mtiles
        NWP = NT // 32
        CN = cfg.bin_cols * (_R_MAX // RW)
        nch = (N + CN - 1) // CN
        nrv = b.shape[3] // _VEC
        if pre:
            self.bin_prologue(b, slab_ptr(b, l_b, e_b, _VEC), sB, N, nrv, nch, tidx, RW)
        run_bin(lambda off, n, f: self.bin_group(s, b, out, sB, slist, off, n, l_b, e_b, N,
                                                  tidx, warp, lane, f, RW),
                lora, topk_ids, l_b, e_b, P, K, slist, swc, tidx, warp, lane, pre, NT, NWP,
                SU, G)

    @staticmethod
    def _sw(slot, row, ch, CN: int, RW: int):
        """Vector index of (slot, row, 16-byte chunk ch) in the flat B ring (rows of RW
        elements = RW / 8 chunks). The 8 lanes of a fragment read phase read rows g, g + 1:
        with 2- or 4-chunk rows those are 32 or 64 contiguous bytes of 128 already; with
        8-chunk rows the odd rows have their chunks XOR 4."""
        if RW < _R_MAX:
            return (slot * CN + row) * (RW // _VEC) + ch
        return (slot * CN + row) * 8 + (ch ^ ((row & 1) << 2))

    @cute.jit
    def bin_group(self, s: cute.Tensor, b: cute.Tensor, out: cute.Tensor, sB: cute.Tensor,
                  slist: cute.Tensor, off: cutlass.Int32, n: cutlass.Int32,
                  l_b: cutlass.Int32, e_b: cutlass.Int32, N: cutlass.Int32,
                  tidx: cutlass.Int32, warp: cutlass.Int32, lane: cutlass.Int32,
                  pre: cutlass.Boolean, RW: cutlass.Constexpr, slot0=None):
        """The n (<= G) pairs slist[off .. off+n) of bin (l_b, e_b): their s rows become mma
        fragments in registers, then the bin's B slab streams through the ring in chunks of
        CN columns (rows of RW elements); warp w runs n-tiles w, w + warps, ... of each
        chunk for every m-tile. slot0 (bgmv_binplan): chunk j sits in ring slot (slot0 + j) %
        stages (its first stages were issued by the shrink group before it; pre is True)."""
        cfg = self.cfg
        NT, S, MT = cfg.bin_threads, cfg.bin_stages, cfg.bin_mtiles
        NB = 2 if RW == _R_MAX else 1             # 32-element k blocks of R
        CN = cfg.bin_cols * (_R_MAX // RW)
        NWP = NT // 32
        NTW = CN // 8 // NWP                      # n-tiles per warp and chunk
        g = lane >> 2
        q = lane & 3
        R = b.shape[3]
        nrv = R // _VEC
        nch = (N + CN - 1) // CN
        vec_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                       num_bits_per_copy=128)
        st_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float32,
                                      num_bits_per_copy=64)
        sv = cute.zipped_divide(s, (1, _VEC))    # ((1, 8), (P, nrv))
        slab = slab_ptr(b, l_b, e_b, _VEC)
        if not pre:    # (else issued before the scan)
            self.bin_prologue(b, slab, sB, N, nrv, nch, tidx, RW)

        if cutlass.const_expr(self.pdl and cfg.bin_pdl):
            # s is the shrink's output: wait for it (the ring's first stages and the bin's
            # scan went out before; a no-op once the shrink is done)
            cute.arch.griddepcontrol_wait()
        # the group's s rows as A fragments (rows g / g + 8 of each m-tile), zeros past R
        # and for rows past the group; their pair ids for the stores
        sfr = cute.make_rmem_tensor((_VEC, 2, NB, MT), self.dtype)
        sfr.fill(0.0)
        prow = cute.make_rmem_tensor((2, MT), cutlass.Int32)
        for mt in cutlass.range_constexpr(MT):
            for hh in cutlass.range_constexpr(2):
                m = mt * 16 + g + 8 * hh
                prow[hh, mt] = cutlass.Int32(-1)
                if m < n:
                    pm = slist[off + m]
                    prow[hh, mt] = pm
                    for kb in cutlass.range_constexpr(NB):
                        if 4 * kb + q < nrv:
                            cute.copy(vec_atom, sv[(None, (pm, 4 * kb + q))], sfr[None, hh, kb, mt])

        for hs in cutlass.range(nch):
            cute.arch.cp_async_wait_group(S - 2)
            cute.arch.sync_threads()
            nxt = hs + (S - 1)
            if cutlass.const_expr(slot0 is None):
                if nxt < nch:
                    self.bin_load_stage(b, slab, sB, N, nrv, nxt, nxt % S, tidx, RW)
                cute.arch.cp_async_commit_group()
                slot = hs % S
            else:
                if nxt < nch:
                    self.bin_load_stage(b, slab, sB, N, nrv, nxt, (slot0 + nxt) % S, tidx, RW)
                cute.arch.cp_async_commit_group()
                slot = (slot0 + hs) % S
            for ii in cutlass.range_constexpr(NTW):
                nt = warp + NWP * ii
                bw = cute.make_rmem_tensor((_VEC, NB), self.dtype)
                bw.fill(0.0)
                for kb in cutlass.range_constexpr(NB):
                    if 4 * kb + q < nrv:
                        src = cute.local_tile(
                            sB, (_VEC,), (self._sw(slot, nt * 8 + g, 4 * kb + q, CN, RW),))
                        bw[None, kb].store(src.load())
                col = hs * CN + nt * 8 + 2 * q
                for mt in cutlass.range_constexpr(MT):
                    if mt * 16 < n:
                        acc = cute.make_rmem_tensor((4,), cutlass.Float32)
                        acc.fill(0.0)
                        for kb in cutlass.range_constexpr(NB):
                            mma_block(words(sfr[None, 0, kb, mt]), words(sfr[None, 1, kb, mt]),
                                      words(bw[None, kb]), acc, self.bf16)
                        for hh in cutlass.range_constexpr(2):
                            pm = prow[hh, mt]
                            if (pm >= 0) & (col < N):   # (col even, N % 8 == 0)
                                o2 = cute.make_rmem_tensor((2,), cutlass.Float32)
                                o2[0] = acc[2 * hh]
                                o2[1] = acc[2 * hh + 1]
                                cute.copy(st_atom, o2, _pair_at(out, pm, col))
        # every thread is out of the ring before the next group refills it
        cute.arch.sync_threads()

    @cute.jit
    def bin_prologue(self, b: cute.Tensor, slab: cute.Pointer, sB: cute.Tensor,
                     N: cutlass.Int32, nrv: cutlass.Int32, nch: cutlass.Int32,
                     tidx: cutlass.Int32, RW: cutlass.Constexpr):
        """The ring's first bin_stages - 1 column chunks, one commit group each."""
        for st in cutlass.range_constexpr(self.cfg.bin_stages - 1):
            if st < nch:
                self.bin_load_stage(b, slab, sB, N, nrv, st, st, tidx, RW)
            cute.arch.cp_async_commit_group()

    @cute.jit
    def bin_load_stage(self, b: cute.Tensor, slab: cute.Pointer, sB: cute.Tensor,
                       N: cutlass.Int32, nrv: cutlass.Int32,
                       st: cutlass.Int32, slot: cutlass.Int32, tidx: cutlass.Int32,
                       RW: cutlass.Constexpr):
        """cp.async column chunk `st` (CN rows of b[l_b, e_b], R elements each) into ring slot
        `slot`; rows past N and vectors past R are not copied (never read)."""
        cfg = self.cfg
        NT = cfg.bin_threads
        CN = cfg.bin_cols * (_R_MAX // RW)
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.dtype, num_bits_per_copy=128)
        # 32-bit offsets inside the bin's slab (b[l_b, e_b]: N * R elements) from its base
        # pointer; indexing the 4-mode tensor per copy costs ~15 integer instructions each
        s_n = cutlass.Int32(b.stride[2])
        CPR = RW // _VEC
        for ps in cutlass.range_constexpr(CN * CPR // NT):
            v = ps * NT + tidx
            row = v // CPR
            ch = v - row * CPR
            nn = st * CN + row
            if (ch < nrv) & (nn < N):
                src = cute.make_tensor(slab + cute.assume(nn * s_n + ch * _VEC, divby=_VEC),
                                       cute.make_layout(_VEC))
                dst = cute.local_tile(sB, (_VEC,), (self._sw(slot, row, ch, CN, RW),))
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
                # every slot's routing, then every live slot's ws vector, in flight together
                # (a loop over k waited for each in turn: T=2048 expand 154.5 -> 151.7 us,
                # tune_memops_h200_bgmv_fin.json); then the sum in slot order
                dv = cute.make_rmem_tensor((4, _MAX_K), cutlass.Float32)
                wv = cute.make_rmem_tensor((_MAX_K,), cutlass.Float32)
                lv = cute.make_rmem_tensor((_MAX_K,), cutlass.Int32)
                for jj in cutlass.range_constexpr(_MAX_K):
                    lv[jj] = cutlass.Int32(0)
                    wv[jj] = cutlass.Float32(0.0)
                    if jj < K:
                        ex = topk_ids[t, jj]
                        lv[jj] = cutlass.Int32(routed(lo, ex, L, E))
                        wv[jj] = topk_w[t, jj]
                for jj in cutlass.range_constexpr(_MAX_K):
                    if lv[jj] != 0:
                        cute.copy(atom, wsv[(None, (t * K + jj, n4))], dv[None, jj])
                for jj in cutlass.range_constexpr(_MAX_K):
                    if lv[jj] != 0:
                        for e4 in cutlass.range_constexpr(4):
                            out = o[e4]
                            out = out + wv[jj] * dv[e4, jj]
                            o[e4] = out
                cute.copy(atom, o, yv[(None, (t, n4))])
