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
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

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

    @property
    def num_threads(self) -> int:
        return self.cols


def _smem_bytes(c: BgmvExpandAdaConfig, elem_bytes: int = 2) -> int:
    return c.stages * (c.cols * _PITCH + _R_MAX) * elem_bytes


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

    @staticmethod
    def can_implement(dtype, config: BgmvExpandAdaConfig) -> bool:
        c = config
        if dtype not in _DTYPES:
            return False
        if c.cols < 32 or c.cols % 32 or c.cols > 1024:
            return False
        if c.stages < 2 or c.max_tokens < 1 or c.t_per_group_div < 1:
            return False
        return _smem_bytes(c) <= SMEM_LIMIT_BYTES

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, s: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                 lora: cute.Tensor, topk_w: cute.Tensor, y: cute.Tensor,
                 stream: cuda.CUstream):
        T = lora.shape[0]
        N = b.shape[2]
        gt = cutlass.min(cutlass.max(T // self.config.t_per_group_div, cutlass.Int32(1)),
                         cutlass.Int32(self.config.max_tokens))
        ntg = cutlass.max((T + gt - 1) // gt, cutlass.Int32(1))
        nnc = cutlass.max((N + self.NC - 1) // self.NC, cutlass.Int32(1))
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
        NC, NT = self.NC, self.NT
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
