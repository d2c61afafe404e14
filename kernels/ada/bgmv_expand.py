"""Ada design of the MoE-LoRA expand (sm_80 / sm_89; also built for sm_90a).

    finalize:     y[t, n] = sum_{j = 0..k-1, in order, live pairs} w[t, j] * (s[p] . b[l, e, n, :])
    not finalize: y[p, n] = s[p] . b[l, e, n, :]   (0 for skipped pairs)
    p = t * k + j, l = lora[t], e = topk_ids[t, j]; y is written, never accumulated into.

Decomposition. CTA = (chunk of `cols` output columns, group of consecutive tokens). One
thread owns one output column of the chunk for every token of the group (one owner per
output element, no atomics). The group size is chosen at launch from T: 1 token per CTA
for small T (a token's k pairs x N / cols chunks all load in the first wave), up to
`max_tokens` for large T. The grid runs column-chunk-major, so CTAs alive at the same
time share the same column slice of every (adapter, expert) bin and b is served from L2.
The CTA streams its items (token, j) in order through a `stages`-deep ring of 16-byte
cp.async (LDGSTS) copies: item = b[l, e, n0:n0+cols, 0:R] (rows padded to 72 elements in
shared memory, so the 32 lanes of a warp reading their own rows hit distinct banks) plus
s[p, 0:R]. With the default depth all k <= 6 items of a token are in flight at once.

Reduction order (fixed by R only): the dot product runs q = 0, 1, ..., R-1 in fp32
(fused multiply-add), then the finalize sum runs j = 0, 1, ..., k-1 over live pairs
(acc = acc + w * dot). Deterministic and batch-invariant; no atomics.
Bin mode (P = T*k >= config.bin_min_pairs, run-time choice; config.bin_mode=False: never).
CTA = (adapter, expert) bin: scan of the pair table into a smem list (increasing p), s rows
of up to bin_pairs pairs staged as fp32, b[l, e] streamed once per group through a ring of
column blocks; out[p, n] = same fp32 dot chain as the pair schedule. finalize=False: out = y
(extra CTAs write dead pairs' zero rows); finalize=True: out = ws, then a second launch
computes y[t] = acc + w * ws[p] over live j in order (the pair schedule's expression).
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from kernels.ada._bin_scan import scan_round

SASS_REQUIRED = ("LDGSTS", "LDGDEPBAR", "DEPBAR")
SASS_FORBIDDEN = ("ATOM", "ATOMG", "ATOMS", "RED", "REDG", "UTMALDG", "HGMMA")

SMEM_LIMIT_BYTES = 99 * 1024
_DTYPES = (cutlass.Float16, cutlass.BFloat16)
_R_MAX = 64
_PITCH = _R_MAX + 8          # smem row pitch in elements (144 B: conflict-free row reads)


@dataclass(frozen=True)
class BgmvExpandAdaConfig:
    cols: int = 64            # output columns per CTA = threads per CTA (one owner each)
    stages: int = 8           # cp.async ring depth over (token, j) items
    max_tokens: int = 16      # max tokens per CTA (large T)
    t_per_group_div: int = 128  # tokens per CTA = clamp(T // this, 1, max_tokens)
    # ---- bin mode (large P = T * k): one CTA per (adapter, expert) bin over all columns
    bin_mode: bool = True       # False: always the pair schedule (v1)
    bin_min_pairs: int = 256    # P >= this: bin mode
    bin_threads: int = 128      # threads per bin CTA; a stage holds bin_threads * 8 vectors
    bin_stages: int = 4         # cp.async ring depth over column blocks
    bin_pairs: int = 32         # pairs per group (s rows staged as fp32 in smem)
    bin_scan_tokens: int = 4    # tokens per thread per scan round
    bin_list_cap: int = 256     # pair-list capacity (multiple of bin_pairs)
    fin_threads: int = 128      # finalize pass: 4 columns per thread
    fin_tokens: int = 4         # finalize pass: tokens per CTA

    @property
    def num_threads(self) -> int:
        return self.cols


def _smem_bytes(c: BgmvExpandAdaConfig, elem_bytes: int = 2) -> int:
    return c.stages * (c.cols * _PITCH + _R_MAX) * elem_bytes


def _bin_smem_bytes(c: BgmvExpandAdaConfig, elem_bytes: int = 2) -> int:
    return (c.bin_stages * c.bin_threads * 64 * elem_bytes + c.bin_pairs * _R_MAX * 4
            + 4 * (c.bin_list_cap + c.bin_threads // 32) + 256)


class BgmvExpandAda:
    def __init__(self, dtype, finalize: bool, config: BgmvExpandAdaConfig = BgmvExpandAdaConfig()):
        if not BgmvExpandAda.can_implement(dtype, config):
            raise ValueError(f"BgmvExpandAda cannot implement {dtype}, {config}")
        self.dtype = dtype
        self.finalize = bool(finalize)
        self.config = config
        self.NC = config.cols
        self.NT = config.num_threads
        self.S = config.stages
        self.BNT = config.bin_threads
        self.BNW = config.bin_threads // 32
        self.BS = config.bin_stages
        self.BGP = config.bin_pairs
        self.BU = config.bin_scan_tokens
        self.BCAP = config.bin_list_cap
        self.FNT = config.fin_threads
        self.FTB = config.fin_tokens

    @staticmethod
    def can_implement(dtype, config: BgmvExpandAdaConfig) -> bool:
        c = config
        if dtype not in _DTYPES:
            return False
        if c.cols < 32 or c.cols % 32 or c.cols > 1024:
            return False
        if c.stages < 2 or c.max_tokens < 1 or c.t_per_group_div < 1:
            return False
        if c.bin_mode:
            if c.bin_threads < 32 or c.bin_threads % 32 or c.bin_stages < 2:
                return False
            if c.bin_pairs < 1 or c.bin_scan_tokens < 1:
                return False
            if c.bin_list_cap < c.bin_pairs or c.bin_list_cap % c.bin_pairs:
                return False
            if c.fin_threads < 32 or c.fin_threads % 32 or c.fin_tokens < 1:
                return False
            if c.bin_min_pairs < 1 or _bin_smem_bytes(c) > SMEM_LIMIT_BYTES:
                return False
        return _smem_bytes(c) <= SMEM_LIMIT_BYTES

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, s: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                 lora: cute.Tensor, topk_w: cute.Tensor, y: cute.Tensor, ws: cute.Tensor,
                 stream: cuda.CUstream):
        T = lora.shape[0]
        N = b.shape[2]
        gt = cutlass.min(cutlass.max(T // self.config.t_per_group_div, cutlass.Int32(1)),
                         cutlass.Int32(self.config.max_tokens))
        ntg = cutlass.max((T + gt - 1) // gt, cutlass.Int32(1))
        nnc = cutlass.max((N + self.NC - 1) // self.NC, cutlass.Int32(1))
        if cutlass.const_expr(self.config.bin_mode):
            P = T * topk_ids.shape[1]
            if P >= self.config.bin_min_pairs:
                nbins = b.shape[0] * b.shape[1]
                if cutlass.const_expr(self.finalize):
                    self.bin_kernel(s, b, topk_ids, lora, ws, nbins).launch(
                        grid=[nbins, 1, 1], block=[self.BNT, 1, 1], stream=stream)
                    nfc = (N + 4 * self.FNT - 1) // (4 * self.FNT)
                    nft = (T + self.FTB - 1) // self.FTB
                    self.fin_kernel(topk_ids, lora, topk_w, y, ws, b.shape[0], b.shape[1],
                                    nfc).launch(
                        grid=[nft * nfc, 1, 1], block=[self.FNT, 1, 1], stream=stream)
                else:
                    nz = (P + 7) // 8
                    self.bin_kernel(s, b, topk_ids, lora, y, nbins).launch(
                        grid=[nbins + nz, 1, 1], block=[self.BNT, 1, 1], stream=stream)
            else:
                self.kernel(s, b, topk_ids, lora, topk_w, y, gt, ntg).launch(
                    grid=[ntg * nnc, 1, 1], block=[self.NT, 1, 1], stream=stream)
        else:
            self.kernel(s, b, topk_ids, lora, topk_w, y, gt, ntg).launch(
                grid=[ntg * nnc, 1, 1], block=[self.NT, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, s: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
               lora: cute.Tensor, topk_w: cute.Tensor, y: cute.Tensor,
               gt: cutlass.Int32, ntg: cutlass.Int32):
        NC, S = self.NC, self.S
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        tg = bid % ntg                   # token group fastest: column-chunk-major grid
        nc = bid // ntg
        n0 = nc * NC

        T = lora.shape[0]
        K = topk_ids.shape[1]
        L = b.shape[0]
        E = b.shape[1]
        N = b.shape[2]
        R = b.shape[3]
        R8 = R // 8
        t0 = tg * gt
        tcnt = cutlass.min(gt, T - t0)
        nit = tcnt * K                   # items (token, j) of this CTA, token-major

        smem = cutlass.utils.SmemAllocator()
        sB = smem.allocate_tensor(self.dtype,
                                  cute.make_layout((NC, _PITCH, S), stride=(_PITCH, 1, NC * _PITCH)),
                                  byte_alignment=128)
        sS = smem.allocate_tensor(self.dtype, cute.make_layout((_R_MAX, S), stride=(1, _R_MAX)),
                                  byte_alignment=128)

        # per-thread copy slots of a b slice (item independent): vector v = pass * NT + tidx
        # is (row v // R8, 16-byte chunk v % R8) of the (cols, R) slice; row -1: no copy
        npass = NC * (_R_MAX // 8) // self.NT
        crow = cute.make_rmem_tensor((npass,), cutlass.Int32)
        cch = cute.make_rmem_tensor((npass,), cutlass.Int32)
        for ps in cutlass.range_constexpr(npass):
            v = ps * self.NT + tidx
            row = v // R8
            crow[ps] = cutlass.Int32(-1)
            cch[ps] = v - row * R8
            if v < NC * R8:
                if n0 + row < N:
                    crow[ps] = row

        # ---- prologue: items 0 .. S-2
        for st in cutlass.range_constexpr(S - 1):
            if st < nit:
                self.load_item(s, b, topk_ids, lora, sB, sS, t0, st, st, K, L, E, R8, n0,
                               crow, cch, tidx)
            cute.arch.cp_async_commit_group()

        col = n0 + tidx
        acc = cutlass.Float32(0.0)
        rs = cute.make_rmem_tensor((8,), cutlass.Float32)
        rb = cute.make_rmem_tensor((8,), cutlass.Float32)
        for it in range(nit):
            # item `it` landed; every thread finished item it-1, whose slot is refilled next
            cute.arch.cp_async_wait_group(S - 2)
            cute.arch.sync_threads()
            nxt = it + (S - 1)
            if nxt < nit:
                self.load_item(s, b, topk_ids, lora, sB, sS, t0, nxt, nxt % S, K, L, E, R8, n0,
                               crow, cch, tidx)
            cute.arch.cp_async_commit_group()

            slot = it % S
            tl = it // K
            j = it - tl * K
            t = t0 + tl
            p = t * K + j
            l = lora[t]
            e = topk_ids[t, j]
            live = l >= 0 and l < L and e >= 0 and e < E
            dot = cutlass.Float32(0.0)
            if live:
                for qc in cutlass.range_constexpr(_R_MAX // 8):
                    if qc < R8:
                        rs.store(cute.local_tile(sS[None, slot], (8,), (qc,)).load()
                                 .to(cutlass.Float32))
                        rb.store(cute.local_tile(sB[tidx, None, slot], (8,), (qc,)).load()
                                 .to(cutlass.Float32))
                        for v in cutlass.range_constexpr(8):
                            dot = dot + rs[v] * rb[v]
            if cutlass.const_expr(self.finalize):
                if live:
                    acc = acc + topk_w[t, j] * dot
                if j == K - 1:
                    if col < N:
                        y[t, col] = acc
                    acc = cutlass.Float32(0.0)
            else:
                if col < N:
                    y[p, col] = dot

    @cute.jit
    def load_item(self, s: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                  lora: cute.Tensor, sB: cute.Tensor, sS: cute.Tensor, t0: cutlass.Int32,
                  it: cutlass.Int32, slot: cutlass.Int32, K: cutlass.Int32, L: cutlass.Int32,
                  E: cutlass.Int32, R8: cutlass.Int32, n0: cutlass.Int32, crow: cute.Tensor,
                  cch: cute.Tensor, tidx: cutlass.Int32):
        """cp.async item `it` (token t0 + it // k, expert slot it % k) into ring slot `slot`:
        b[l, e, n0:n0+cols, 0:R] and s[p, 0:R]. Skipped pairs copy nothing (never read)."""
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.dtype, num_bits_per_copy=128)
        tl = it // K
        j = it - tl * K
        t = t0 + tl
        l = lora[t]
        e = topk_ids[t, j]
        if l >= 0 and l < L and e >= 0 and e < E:
            for ps in cutlass.range_constexpr(cute.size(crow)):
                row = crow[ps]
                if row >= 0:
                    ch = cch[ps]
                    src = cute.local_tile(b[l, e, n0 + row, None], (8,), (ch,))
                    dst = cute.local_tile(sB[row, None, slot], (8,), (ch,))
                    cute.copy(atom, src, dst)
            if tidx < R8:
                src = cute.local_tile(s[t * K + j, None], (8,), (tidx,))
                dst = cute.local_tile(sS[None, slot], (8,), (tidx,))
                cute.copy(atom, src, dst)

    # ------------------------------------------------------------------ bin mode
    @cute.kernel
    def bin_kernel(self, s: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                   lora: cute.Tensor, out: cute.Tensor, nbins: cutlass.Int32):
        """CTA = (adapter, expert) bin: collect its pairs (increasing p), stage up to BGP of
        their s rows as fp32 in smem, stream b[l, e, :, 0:R] once per group through a ring
        of column blocks (a block = BNT * 8 16-byte vectors, dense rows, xor-swizzled) and
        write out[p, n] = s[p] . b[l, e, n] (same fp32 chain as the pair schedule). CTAs past
        nbins (finalize=False) write the zero rows of dead pairs."""
        BNT, BNW, BS, BGP, BCAP = self.BNT, self.BNW, self.BS, self.BGP, self.BCAP
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        T = lora.shape[0]
        K = topk_ids.shape[1]
        L = b.shape[0]
        E = b.shape[1]
        N = b.shape[2]
        R = b.shape[3]
        P = T * K

        smem = cutlass.utils.SmemAllocator()
        sB = smem.allocate_tensor(self.dtype, cute.make_layout((BNT * 64, BS), stride=(1, BNT * 64)),
                                  byte_alignment=128)
        sS = smem.allocate_tensor(cutlass.Float32,
                                  cute.make_layout((BGP, _R_MAX), stride=(_R_MAX, 1)),
                                  byte_alignment=128)
        sList = smem.allocate_tensor(cutlass.Int32, cute.make_layout((BCAP,)), byte_alignment=16)
        sW = smem.allocate_tensor(cutlass.Int32, cute.make_layout((BNW,)), byte_alignment=16)

        if bid < nbins:
            l = bid // E
            e = bid - l * E
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
                        n = cutlass.min(cnt - g0, cutlass.Int32(BGP))
                        self.run_group_bin(s, b, out, sB, sS, sList, l, e, g0, n, N, R, tidx)
                        g0 = g0 + BGP
                    cnt = cutlass.Int32(0)
        else:
            if cutlass.const_expr(not self.finalize):
                for i in cutlass.range_constexpr(8):
                    p = (bid - nbins) * 8 + i
                    if p < P:
                        t = p // K
                        jj = p - t * K
                        lv = lora[t]
                        ev = topk_ids[t, jj]
                        if not (lv >= 0 and lv < L and ev >= 0 and ev < E):
                            col = tidx
                            while col < N:
                                out[p, col] = cutlass.Float32(0.0)
                                col = col + BNT

    @cute.jit
    def run_group_bin(self, s: cute.Tensor, b: cute.Tensor, out: cute.Tensor, sB: cute.Tensor,
                      sS: cute.Tensor, sList: cute.Tensor, l: cutlass.Int32, e: cutlass.Int32,
                      g0: cutlass.Int32, n: cutlass.Int32, N: cutlass.Int32, R: cutlass.Int32,
                      tidx: cutlass.Int32):
        BNT, BS = self.BNT, self.BS
        R8 = R // 8
        cpt = 8 // R8                        # columns per thread per block (1..8)
        cpb = BNT * cpt                      # columns per block
        nvb = cpb * R8                       # 16-byte vectors per block (<= BNT * 8)
        nblk = (N + cpb - 1) // cpb
        swz = cutlass.Int32(0)
        if R8 % 2 == 0:
            swz = cutlass.Int32(7)
        # s rows of the group -> fp32 smem (exact conversion)
        idx = tidx
        while idx < n * R:
            g = idx // R
            q = idx - g * R
            sS[g, q] = s[sList[g0 + g], q].to(cutlass.Float32)
            idx = idx + BNT

        for st in cutlass.range_constexpr(BS - 1):
            if st < nblk:
                self.load_block(b, sB, l, e, st * cpb, st, nvb, R8, N, swz, tidx)
            cute.arch.cp_async_commit_group()

        rb = cute.make_rmem_tensor((_R_MAX,), cutlass.Float32)
        rs = cute.make_rmem_tensor((8,), cutlass.Float32)
        for blk in cutlass.range(nblk, unroll=1):
            cute.arch.cp_async_wait_group(BS - 2)
            cute.arch.sync_threads()
            nxt = blk + (BS - 1)
            if nxt < nblk:
                self.load_block(b, sB, l, e, nxt * cpb, nxt % BS, nvb, R8, N, swz, tidx)
            cute.arch.cp_async_commit_group()
            slot = blk % BS
            for c in cutlass.range(cpt, unroll=1):
                cl = tidx + BNT * c
                col = blk * cpb + cl
                if col < N:
                    for qc in cutlass.range_constexpr(_R_MAX // 8):
                        if qc < R8:
                            v = cl * R8 + qc
                            vs = v ^ ((v >> 3) & swz)
                            rbq = cute.local_tile(rb, (8,), (qc,))
                            rbq.store(cute.local_tile(sB[None, slot], (8,), (vs,)).load()
                                      .to(cutlass.Float32))
                    for gp in cutlass.range(n, unroll=1):
                        dot = cutlass.Float32(0.0)
                        for qc in cutlass.range_constexpr(_R_MAX // 8):
                            if qc < R8:
                                rs.store(cute.local_tile(sS[gp, None], (8,), (qc,)).load())
                                for v in cutlass.range_constexpr(8):
                                    dot = dot + rs[v] * rb[qc * 8 + v]
                        out[sList[g0 + gp], col] = dot
        # every thread is out of the ring and sS before the next group refills them
        cute.arch.sync_threads()

    @cute.jit
    def load_block(self, b: cute.Tensor, sB: cute.Tensor, l: cutlass.Int32, e: cutlass.Int32,
                   n0: cutlass.Int32, slot: cutlass.Int32, nvb: cutlass.Int32,
                   R8: cutlass.Int32, N: cutlass.Int32, swz: cutlass.Int32, tidx: cutlass.Int32):
        """cp.async columns n0 .. of b[l, e] (vector v = col * R8 + chunk) into ring slot."""
        BNT = self.BNT
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.dtype, num_bits_per_copy=128)
        for ps in cutlass.range(8, unroll=1):     # rolled: no per-slot hoisted addresses
            v = ps * BNT + tidx
            if v < nvb:
                row = v // R8
                ch = v - row * R8
                if n0 + row < N:
                    vs = v ^ ((v >> 3) & swz)
                    src = cute.local_tile(b[l, e, n0 + row, None], (8,), (ch,))
                    dst = cute.local_tile(sB[None, slot], (8,), (vs,))
                    cute.copy(atom, src, dst)

    @cute.kernel
    def fin_kernel(self, topk_ids: cute.Tensor, lora: cute.Tensor, topk_w: cute.Tensor,
                   y: cute.Tensor, ws: cute.Tensor, L: cutlass.Int32, E: cutlass.Int32,
                   nfc: cutlass.Int32):
        """y[t, n] = sum over live j = 0..k-1 (in order) of w[t, j] * ws[t*k + j, n], as
        acc = acc + w * d from acc = 0: the pair schedule's exact expression."""
        FNT, FTB = self.FNT, self.FTB
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        fc = bid % nfc
        tb = bid // nfc
        T = lora.shape[0]
        K = topk_ids.shape[1]
        N = y.shape[1]
        col = (fc * FNT + tidx) * 4
        rv = cute.make_rmem_tensor((8 * 4,), cutlass.Float32)
        rw = cute.make_rmem_tensor((8,), cutlass.Float32)
        lvj = cute.make_rmem_tensor((8,), cutlass.Int32)
        if col < N:
            for i in range(FTB):
                t = tb * FTB + i
                if t < T:
                    lv = lora[t]
                    for j in cutlass.range_constexpr(8):
                        if j < K:
                            ev = topk_ids[t, j]
                            lvj[j] = cutlass.Int32(0)
                            if lv >= 0 and lv < L and ev >= 0 and ev < E:
                                lvj[j] = cutlass.Int32(1)
                                rw[j] = topk_w[t, j]
                                cute.local_tile(rv, (4,), (j,)).store(
                                    cute.local_tile(ws[t * K + j, None], (4,), (col // 4,)).load())
                    for c in cutlass.range_constexpr(4):
                        acc = cutlass.Float32(0.0)
                        for j in cutlass.range_constexpr(8):
                            if j < K:
                                if lvj[j] != 0:
                                    acc = acc + rw[j] * rv[j * 4 + c]
                        y[t, col + c] = acc
