"""Ada design of the MoE-LoRA shrink (sm_80 / sm_89; also built for sm_90a).

    s[p, r] = cvt(sum_h x[t, h] * a[l, e, r, h]),  p = order[q], t = p // k, j = p % k,
    l = lora[t], e = topk_ids[t, j]; 0 when the pair is skipped; padding entries ignored.

Decomposition. CTA = (group of consecutive `order` entries, block of `rows_per_cta` rows
of R). The group size is chosen at launch from Q: 1 entry per group for small Q (every
pair's rows spread over R / rows_per_cta CTAs, all loads of the first wave in flight at
once), up to `max_group` entries for large Q so runs of entries that share an (adapter,
expert) bin (expert-sorted order) reuse one A stream. Inside a group the CTA walks the
entries; a batch is a run of <= `batch` consecutive live entries with the same bin. A
batch streams A[l, e, rows, :] and the batch's x rows through a `stages`-deep ring of
16-byte cp.async (LDGSTS) H-chunks of `chunk_h` elements.

Reduction order (fixed by H only). The 8-element chunk c = h // 8 of every row belongs
to lane c % 32 of the warp that owns the row; each lane accumulates its chunks in
increasing c, the 8 products of a chunk in increasing h (fp32), then the warp combines
the 32 lane partials with a fixed xor-butterfly (16, 8, 4, 2, 1); all lanes end with
the same bits. Nothing depends on T, k, the grid, the group/batch cut, `order` or other
tokens: results are deterministic and batch-invariant. No atomics.
Bin mode (P = T*k >= config.bin_min_pairs, run-time choice; config.bin_mode=False: never).
CTA = ((adapter, expert) bin, block of bin_warps*bin_rows_per_warp rows): scan of the pair
table (lora, then topk_ids of matching tokens; warp prefix sums, list in increasing p, no
atomics) into a smem list, then groups of bin_batch pairs stream A once per group through
the same ring; per-row arithmetic identical to the pair schedule (bit-identical results).
Extra CTAs after the bins write the zero rows of dead pairs. `order` is unused there.
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from kernels.ada._bin_scan import scan_round, stage_dots

SASS_REQUIRED = ("LDGSTS", "LDGDEPBAR", "DEPBAR", "SHFL")
SASS_FORBIDDEN = ("ATOM", "ATOMG", "ATOMS", "RED", "REDG", "UTMALDG", "HGMMA")

SMEM_LIMIT_BYTES = 99 * 1024
_DTYPES = (cutlass.Float16, cutlass.BFloat16)


@dataclass(frozen=True)
class BgmvShrinkAdaConfig:
    rows_per_cta: int = 8    # rows of R per CTA (R % 8 == 0 at runtime)
    warps: int = 4           # each warp owns rows_per_cta / warps rows
    chunk_h: int = 512       # H elements per ring stage (multiple of 256: 32 lanes x 8)
    stages: int = 5          # cp.async ring depth
    batch: int = 8           # max entries sharing one A stream
    max_group: int = 16      # max consecutive order entries per CTA (large Q)
    q_per_group_div: int = 256  # group size = clamp(Q // this, 1, max_group)
    # ---- bin mode (large P = T * k): one CTA per ((adapter, expert) bin, row block)
    bin_mode: bool = True       # False: always the pair schedule (v1)
    bin_min_pairs: int = 256    # P >= this: bin mode
    bin_warps: int = 8
    bin_rows_per_warp: int = 4  # rows per CTA = bin_warps * bin_rows_per_warp
    bin_batch: int = 8          # pairs per group (A converted once per group)
    bin_chunk_h: int = 256
    bin_stages: int = 4
    bin_scan_tokens: int = 8    # tokens per thread per scan round
    bin_list_cap: int = 512     # pair-list capacity (multiple of bin_batch)

    @property
    def num_threads(self) -> int:
        return 32 * self.warps


def _smem_bytes(c: BgmvShrinkAdaConfig, elem_bytes: int = 2) -> int:
    return c.stages * (c.rows_per_cta + c.batch) * c.chunk_h * elem_bytes


def _bin_smem_bytes(c: BgmvShrinkAdaConfig, elem_bytes: int = 2) -> int:
    rb = c.bin_warps * c.bin_rows_per_warp
    return (c.bin_stages * (rb + c.bin_batch) * c.bin_chunk_h * elem_bytes
            + 4 * (c.bin_list_cap + c.bin_warps) + 256)


class BgmvShrinkAda:
    def __init__(self, dtype, config: BgmvShrinkAdaConfig = BgmvShrinkAdaConfig()):
        if not BgmvShrinkAda.can_implement(dtype, config):
            raise ValueError(f"BgmvShrinkAda cannot implement {dtype}, {config}")
        self.dtype = dtype
        self.config = config
        self.RB = config.rows_per_cta
        self.NW = config.warps
        self.RW = config.rows_per_cta // config.warps
        self.HC = config.chunk_h
        self.S = config.stages
        self.GE = config.batch
        self.NT = config.num_threads
        # bin mode geometry
        self.BNW = config.bin_warps
        self.BRW = config.bin_rows_per_warp
        self.BRB = config.bin_warps * config.bin_rows_per_warp
        self.BNT = 32 * config.bin_warps
        self.BGE = config.bin_batch
        self.BHC = config.bin_chunk_h
        self.BS = config.bin_stages
        self.BU = config.bin_scan_tokens
        self.BCAP = config.bin_list_cap

    @staticmethod
    def can_implement(dtype, config: BgmvShrinkAdaConfig) -> bool:
        c = config
        if dtype not in _DTYPES:
            return False
        if c.rows_per_cta <= 0 or 8 % c.rows_per_cta or c.warps <= 0:
            return False            # a row block must tile every R % 8 == 0
        if c.rows_per_cta % c.warps:
            return False
        if c.chunk_h <= 0 or c.chunk_h % 256 or c.stages < 2 or c.batch < 1 or c.max_group < 1:
            return False
        nt = c.num_threads
        cpr = c.chunk_h // 8       # 16-byte vectors per row of a stage
        if cpr % nt and nt % cpr:
            return False
        if (c.rows_per_cta * cpr) % nt or (c.batch * cpr) % nt:
            return False
        if c.q_per_group_div < 1:
            return False
        if c.bin_mode:
            bnt = 32 * c.bin_warps
            brb = c.bin_warps * c.bin_rows_per_warp
            bcpr = c.bin_chunk_h // 8
            if c.bin_warps < 1 or c.bin_rows_per_warp < 1 or c.bin_batch < 1:
                return False
            if c.bin_chunk_h <= 0 or c.bin_chunk_h % 256 or c.bin_stages < 2:
                return False
            if (brb * bcpr) % bnt or (c.bin_batch * bcpr) % bnt:
                return False
            if c.bin_scan_tokens < 1 or c.bin_list_cap < c.bin_batch or c.bin_list_cap % c.bin_batch:
                return False
            if c.bin_min_pairs < 1 or _bin_smem_bytes(c) > SMEM_LIMIT_BYTES:
                return False
        return _smem_bytes(c) <= SMEM_LIMIT_BYTES

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, x: cute.Tensor, a: cute.Tensor, topk_ids: cute.Tensor,
                 lora: cute.Tensor, order: cute.Tensor, s: cute.Tensor,
                 stream: cuda.CUstream):
        R = a.shape[2]
        Q = order.shape[0]
        gsz = cutlass.min(cutlass.max(Q // self.config.q_per_group_div, cutlass.Int32(1)),
                          cutlass.Int32(self.config.max_group))
        ngroups = cutlass.max((Q + gsz - 1) // gsz, cutlass.Int32(1))
        nrb = R // self.RB
        if cutlass.const_expr(self.config.bin_mode):
            P = x.shape[0] * topk_ids.shape[1]
            if P >= self.config.bin_min_pairs:
                nrbb = (R + self.BRB - 1) // self.BRB
                nbinblk = a.shape[0] * a.shape[1] * nrbb
                nz = (P + self.BNT - 1) // self.BNT
                self.bin_kernel(x, a, topk_ids, lora, s, nrbb, nbinblk).launch(
                    grid=[nbinblk + nz, 1, 1], block=[self.BNT, 1, 1], stream=stream)
            else:
                self.kernel(x, a, topk_ids, lora, order, s, gsz, nrb).launch(
                    grid=[ngroups * nrb, 1, 1], block=[self.NT, 1, 1], stream=stream)
        else:
            self.kernel(x, a, topk_ids, lora, order, s, gsz, nrb).launch(
                grid=[ngroups * nrb, 1, 1], block=[self.NT, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, x: cute.Tensor, a: cute.Tensor, topk_ids: cute.Tensor,
               lora: cute.Tensor, order: cute.Tensor, s: cute.Tensor,
               gsz: cutlass.Int32, nrb: cutlass.Int32):
        RB, HC, S, GE = self.RB, self.HC, self.S, self.GE
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        rb = bid % nrb
        g = bid // nrb
        r0 = rb * RB

        T = x.shape[0]
        H = x.shape[1]
        L = a.shape[0]
        E = a.shape[1]
        K = topk_ids.shape[1]
        P = T * K
        Q = order.shape[0]
        q0 = g * gsz
        gcnt = cutlass.min(gsz, Q - q0)

        smem = cutlass.utils.SmemAllocator()
        sA = smem.allocate_tensor(self.dtype, cute.make_layout((RB, HC, S), stride=(HC, 1, RB * HC)),
                                  byte_alignment=128)
        sX = smem.allocate_tensor(self.dtype, cute.make_layout((GE, HC, S), stride=(HC, 1, GE * HC)),
                                  byte_alignment=128)

        i = cutlass.Int32(0)
        while i < gcnt:
            q = q0 + i
            p = order[q]
            n = cutlass.Int32(1)
            if p >= 0 and p < P:
                t = p // K
                jj = p - t * K
                l = lora[t]
                e = topk_ids[t, jj]
                if l >= 0 and l < L and e >= 0 and e < E:
                    # extend the batch over following entries with the same bin. Three
                    # passes so the index loads of all GE-1 candidates are in flight together
                    # (order, then lora/topk_ids), not one dependent chain per entry.
                    pn = cute.make_rmem_tensor((GE,), cutlass.Int32)
                    same = cute.make_rmem_tensor((GE,), cutlass.Int32)
                    for m in cutlass.range_constexpr(1, GE):
                        pn[m] = cutlass.Int32(-1)
                        if i + m < gcnt:
                            pn[m] = order[q + m]
                    for m in cutlass.range_constexpr(1, GE):
                        p2 = pn[m]
                        same[m] = cutlass.Int32(0)
                        if p2 >= 0 and p2 < P:
                            t2 = p2 // K
                            j2 = p2 - t2 * K
                            if lora[t2] == l and topk_ids[t2, j2] == e:
                                same[m] = cutlass.Int32(1)
                    cont = cutlass.Int32(1)
                    for m in cutlass.range_constexpr(1, GE):
                        cont = cont * same[m]
                        n = n + cont
                    self.run_batch(x, a, order, s, sA, sX, l, e, q, n, r0, K, H, tidx)
                else:
                    if tidx < RB:
                        s[p, r0 + tidx] = self.dtype(0.0)
            i = i + n

    @cute.jit
    def run_batch(self, x: cute.Tensor, a: cute.Tensor, order: cute.Tensor, s: cute.Tensor,
                  sA: cute.Tensor, sX: cute.Tensor, l: cutlass.Int32, e: cutlass.Int32,
                  q: cutlass.Int32, n: cutlass.Int32, r0: cutlass.Int32, K: cutlass.Int32,
                  H: cutlass.Int32, tidx: cutlass.Int32):
        RW, HC, S, GE = self.RW, self.HC, self.S, self.GE
        nch = H // 8                       # 16-byte vectors per row
        n_st = (H + HC - 1) // HC           # ring stages of this batch
        warp = tidx // 32
        lane = tidx % 32

        # token of the x row each of this thread's x-copy slots serves (-1: row >= n)
        cpr = HC // 8
        xtok = cute.make_rmem_tensor((GE * cpr // self.NT,), cutlass.Int32)
        for ps in cutlass.range_constexpr(GE * cpr // self.NT):
            row = (ps * self.NT + tidx) // cpr
            xtok[ps] = cutlass.Int32(-1)
            if row < n:
                xtok[ps] = order[q + row] // K

        # ---- prologue: stages 0 .. S-2 (one commit group each, possibly empty)
        for st in cutlass.range_constexpr(S - 1):
            if st < n_st:
                self.load_stage(x, a, sA, sX, l, e, r0, xtok, nch, st, st, tidx)
            cute.arch.cp_async_commit_group()

        acc = cute.make_rmem_tensor((GE * RW,), cutlass.Float32)
        acc.fill(0.0)
        ra = cute.make_rmem_tensor((RW * 8,), cutlass.Float32)
        rx = cute.make_rmem_tensor((8,), cutlass.Float32)

        for hs in range(n_st):
            # stage hs landed; every warp finished stage hs-1, whose slot is refilled next
            cute.arch.cp_async_wait_group(S - 2)
            cute.arch.sync_threads()
            nxt = hs + (S - 1)
            if nxt < n_st:
                self.load_stage(x, a, sA, sX, l, e, r0, xtok, nch, nxt, nxt % S, tidx)
            cute.arch.cp_async_commit_group()

            stage_dots(sA, sX, ra, rx, acc, hs % S, hs, n, nch, warp, lane, RW, GE, HC)

        # every warp is out of the ring before the next batch's prologue refills it
        cute.arch.sync_threads()

        # ---- fixed butterfly over the 32 lane partials; lane 0 stores
        for m in cutlass.range_constexpr(GE):
            if m < n:
                pm = order[q + m]
                for rr in cutlass.range_constexpr(RW):
                    v = acc[m * RW + rr]
                    for off in cutlass.range_constexpr(5):
                        v = v + cute.arch.shuffle_sync_bfly(v, offset=16 >> off)
                    if lane == 0:
                        s[pm, r0 + warp * RW + rr] = v.to(self.dtype)

    @cute.jit
    def load_stage(self, x: cute.Tensor, a: cute.Tensor, sA: cute.Tensor, sX: cute.Tensor,
                   l: cutlass.Int32, e: cutlass.Int32, r0: cutlass.Int32, xtok: cute.Tensor,
                   nch: cutlass.Int32, st: cutlass.Int32, slot: cutlass.Int32,
                   tidx: cutlass.Int32):
        """cp.async H-chunk `st` of A[l, e, r0:r0+RB, :] and of the batch's x rows into
        ring slot `slot`. Vectors past H are not copied (and never read)."""
        RB, HC, GE, NT = self.RB, self.HC, self.GE, self.NT
        cpr = HC // 8
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.dtype, num_bits_per_copy=128)
        for ps in cutlass.range_constexpr(RB * cpr // NT):
            v = ps * NT + tidx
            row = v // cpr
            ch = v % cpr
            gch = st * cpr + ch
            if gch < nch:
                src = cute.local_tile(a[l, e, r0 + row, None], (8,), (gch,))
                dst = cute.local_tile(sA[row, None, slot], (8,), (ch,))
                cute.copy(atom, src, dst)
        for ps in cutlass.range_constexpr(GE * cpr // NT):
            v = ps * NT + tidx
            row = v // cpr
            ch = v % cpr
            gch = st * cpr + ch
            tok = xtok[ps]
            if tok >= 0 and gch < nch:
                src = cute.local_tile(x[tok, None], (8,), (gch,))
                dst = cute.local_tile(sX[row, None, slot], (8,), (ch,))
                cute.copy(atom, src, dst)

    # ------------------------------------------------------------------ bin mode
    @cute.kernel
    def bin_kernel(self, x: cute.Tensor, a: cute.Tensor, topk_ids: cute.Tensor,
                   lora: cute.Tensor, s: cute.Tensor, nrbb: cutlass.Int32,
                   nbinblk: cutlass.Int32):
        """CTA = ((adapter, expert) bin, block of BRB rows): collect the bin's pairs (scan of
        the pair table, increasing p), then stream A[l, e, rows, :] once per group of BGE
        pairs. CTAs past nbinblk write the zero rows of dead pairs."""
        BRB, BHC, BS, BGE, BNT, BNW, BCAP = (self.BRB, self.BHC, self.BS, self.BGE, self.BNT,
                                            self.BNW, self.BCAP)
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        T = x.shape[0]
        H = x.shape[1]
        L = a.shape[0]
        E = a.shape[1]
        R = a.shape[2]
        K = topk_ids.shape[1]
        P = T * K

        smem = cutlass.utils.SmemAllocator()
        sA = smem.allocate_tensor(self.dtype,
                                  cute.make_layout((BRB, BHC, BS), stride=(BHC, 1, BRB * BHC)),
                                  byte_alignment=128)
        sX = smem.allocate_tensor(self.dtype,
                                  cute.make_layout((BGE, BHC, BS), stride=(BHC, 1, BGE * BHC)),
                                  byte_alignment=128)
        sList = smem.allocate_tensor(cutlass.Int32, cute.make_layout((BCAP,)), byte_alignment=16)
        sW = smem.allocate_tensor(cutlass.Int32, cute.make_layout((BNW,)), byte_alignment=16)

        if bid < nbinblk:
            binid = bid // nrbb
            rbb = bid - binid * nrbb
            l = binid // E
            e = binid - l * E
            r0 = rbb * BRB
            tpos = cutlass.Int32(0)
            lo = cutlass.Int32(0)
            cnt = cutlass.Int32(0)
            while tpos < T:
                cute.arch.sync_threads()
                total = scan_round(topk_ids, lora, sList, sW, l, e, tpos, lo, cnt,
                                   BCAP - cnt, T, K, tidx, BNT, BNW, self.BU)
                take = cutlass.min(total - lo, BCAP - cnt)
                cnt = cnt + take
                if lo + take == total:
                    tpos = tpos + BNT * self.BU
                    lo = cutlass.Int32(0)
                else:
                    lo = lo + take
                if cnt == BCAP or tpos >= T:
                    g0 = cutlass.Int32(0)
                    while g0 < cnt:
                        n = cutlass.min(cnt - g0, cutlass.Int32(BGE))
                        self.run_group_bin(x, a, s, sA, sX, sList, l, e, g0, n, r0, R, K, H,
                                           tidx)
                        g0 = g0 + BGE
                    cnt = cutlass.Int32(0)
        else:
            # dead pairs: zero rows (live pairs are written by their bin's CTAs)
            p = (bid - nbinblk) * BNT + tidx
            if p < P:
                t = p // K
                jj = p - t * K
                lv = lora[t]
                ev = topk_ids[t, jj]
                if not (lv >= 0 and lv < L and ev >= 0 and ev < E):
                    for r in range(R):
                        s[p, r] = self.dtype(0.0)

    @cute.jit
    def run_group_bin(self, x: cute.Tensor, a: cute.Tensor, s: cute.Tensor, sA: cute.Tensor,
                      sX: cute.Tensor, sList: cute.Tensor, l: cutlass.Int32, e: cutlass.Int32,
                      g0: cutlass.Int32, n: cutlass.Int32, r0: cutlass.Int32, R: cutlass.Int32,
                      K: cutlass.Int32, H: cutlass.Int32, tidx: cutlass.Int32):
        """Pairs sList[g0 .. g0+n) (n <= BGE) against rows r0 .. r0+BRB of A[l, e]. Per row
        and pair the fp32 operation sequence is exactly the pair schedule's (run_batch):
        lane c % 32 owns chunk c, chunks in increasing c, products in increasing h, fused
        acc + x * a, then the xor butterfly 16, 8, 4, 2, 1."""
        BRW, HC, S, GE, NT = self.BRW, self.BHC, self.BS, self.BGE, self.BNT
        nch = H // 8
        n_st = (H + HC - 1) // HC
        warp = tidx // 32
        lane = tidx % 32
        cpr = HC // 8
        xtok = cute.make_rmem_tensor((GE * cpr // NT,), cutlass.Int32)
        for ps in cutlass.range_constexpr(GE * cpr // NT):
            row = (ps * NT + tidx) // cpr
            xtok[ps] = cutlass.Int32(-1)
            if row < n:
                xtok[ps] = sList[g0 + row] // K

        for st in cutlass.range_constexpr(S - 1):
            if st < n_st:
                self.load_stage_bin(x, a, sA, sX, l, e, r0, R, xtok, nch, st, st, tidx)
            cute.arch.cp_async_commit_group()

        acc = cute.make_rmem_tensor((GE * BRW,), cutlass.Float32)
        acc.fill(0.0)
        ra = cute.make_rmem_tensor((BRW * 8,), cutlass.Float32)
        rx = cute.make_rmem_tensor((8,), cutlass.Float32)

        for hs in range(n_st):
            cute.arch.cp_async_wait_group(S - 2)
            cute.arch.sync_threads()
            nxt = hs + (S - 1)
            if nxt < n_st:
                self.load_stage_bin(x, a, sA, sX, l, e, r0, R, xtok, nch, nxt, nxt % S, tidx)
            cute.arch.cp_async_commit_group()

            stage_dots(sA, sX, ra, rx, acc, hs % S, hs, n, nch, warp, lane, BRW, GE, HC)

        cute.arch.sync_threads()

        for m in cutlass.range_constexpr(GE):
            if m < n:
                pm = sList[g0 + m]
                for rr in cutlass.range_constexpr(BRW):
                    v = acc[m * BRW + rr]
                    for off in cutlass.range_constexpr(5):
                        v = v + cute.arch.shuffle_sync_bfly(v, offset=16 >> off)
                    row = r0 + warp * BRW + rr
                    if lane == 0 and row < R:
                        s[pm, row] = v.to(self.dtype)

    @cute.jit
    def load_stage_bin(self, x: cute.Tensor, a: cute.Tensor, sA: cute.Tensor, sX: cute.Tensor,
                       l: cutlass.Int32, e: cutlass.Int32, r0: cutlass.Int32, R: cutlass.Int32,
                       xtok: cute.Tensor, nch: cutlass.Int32, st: cutlass.Int32,
                       slot: cutlass.Int32, tidx: cutlass.Int32):
        BRB, HC, GE, NT = self.BRB, self.BHC, self.BGE, self.BNT
        cpr = HC // 8
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.dtype, num_bits_per_copy=128)
        for ps in cutlass.range_constexpr(BRB * cpr // NT):
            v = ps * NT + tidx
            row = v // cpr
            ch = v % cpr
            gch = st * cpr + ch
            if gch < nch and r0 + row < R:
                src = cute.local_tile(a[l, e, r0 + row, None], (8,), (gch,))
                dst = cute.local_tile(sA[row, None, slot], (8,), (ch,))
                cute.copy(atom, src, dst)
        for ps in cutlass.range_constexpr(GE * cpr // NT):
            v = ps * NT + tidx
            row = v // cpr
            ch = v % cpr
            gch = st * cpr + ch
            tok = xtok[ps]
            if tok >= 0 and gch < nch:
                src = cute.local_tile(x[tok, None], (8,), (gch,))
                dst = cute.local_tile(sX[row, None, slot], (8,), (ch,))
                cute.copy(atom, src, dst)
