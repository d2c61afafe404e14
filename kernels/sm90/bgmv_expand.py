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
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

SASS_REQUIRED = ("LDG", "STG")
SASS_FORBIDDEN = ("ATOM", "ATOMG", "ATOMS", "RED", "LDGSTS")

_DTYPES = (cutlass.Float16, cutlass.BFloat16)
_VEC = 8            # elements per 16-byte vector
_MAX_K = 8          # warps per CTA = routed slots
_MAX_RV = 8         # R <= 64: at most 8 vectors per b row


@dataclass(frozen=True)
class BgmvExpandSm90Config:
    """cols_per_lane: output columns per lane (chunk = 32 * cols_per_lane columns).
    num_sms, ctas_per_sm: persistent grid size = min(work items, num_sms * ctas_per_sm)."""

    cols_per_lane: int = 1
    num_sms: int = 132
    ctas_per_sm: int = 2


class BgmvExpandSm90:
    def __init__(self, dtype, finalize: bool,
                 config: BgmvExpandSm90Config = BgmvExpandSm90Config()):
        if not BgmvExpandSm90.can_implement(dtype, config):
            raise ValueError(f"BgmvExpandSm90 cannot implement {dtype} with {config}")
        self.dtype = dtype
        self.finalize = bool(finalize)
        self.cfg = config
        self.NC = config.cols_per_lane
        self.CN = 32 * config.cols_per_lane
        self.num_threads = 32 * _MAX_K

    @staticmethod
    def can_implement(dtype, config: BgmvExpandSm90Config) -> bool:
        if dtype not in _DTYPES:
            return False
        if not (1 <= config.cols_per_lane <= 4):
            return False
        return config.num_sms >= 1 and config.ctas_per_sm >= 1

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, s: cute.Tensor, b: cute.Tensor, topk_ids: cute.Tensor,
                 lora: cute.Tensor, topk_w: cute.Tensor, y: cute.Tensor,
                 stream: cuda.CUstream):
        T = lora.shape[0]
        N = b.shape[2]
        items = ((N + self.CN - 1) // self.CN) * T
        grid = cutlass.min(items, self.cfg.num_sms * self.cfg.ctas_per_sm)
        grid = cutlass.max(grid, 1)
        self.kernel(s, b, topk_ids, lora, topk_w, y).launch(
            grid=[grid, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

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
            if j < K:
                ex = topk_ids[t, j]
                live = (lo >= 0) & (lo < L) & (ex >= 0) & (ex < E)
                if live:
                    sf = cute.make_rmem_tensor((_VEC, _MAX_RV), self.dtype)
                    bf = cute.make_rmem_tensor((_VEC, _MAX_RV, NC), self.dtype)
                    # issue every load of the pair first
                    for qv in cutlass.range_constexpr(_MAX_RV):
                        if qv < nrv:
                            cute.copy(vec_atom, sv[(None, (p, qv))], sf[None, qv])
                            for i in cutlass.range_constexpr(NC):
                                n = cutlass.min(n0 + 32 * i + lane, N - 1)
                                cute.copy(vec_atom, bv[(None, (lo, ex, n, qv))], bf[None, qv, i])
                    # d[n] = FMA chain over q = 0 .. R-1
                    for qv in cutlass.range_constexpr(_MAX_RV):
                        if qv < nrv:
                            s32 = cute.make_rmem_tensor((_VEC,), cutlass.Float32)
                            s32.store(sf[None, qv].load().to(cutlass.Float32))
                            for i in cutlass.range_constexpr(NC):
                                b32 = cute.make_rmem_tensor((_VEC,), cutlass.Float32)
                                b32.store(bf[None, qv, i].load().to(cutlass.Float32))
                                acc = d[i]
                                for e8 in cutlass.range_constexpr(_VEC):
                                    acc = acc + s32[e8] * b32[e8]
                                d[i] = acc

            if cutlass.const_expr(self.finalize):
                for i in cutlass.range_constexpr(NC):
                    sd[32 * i + lane, j] = d[i]
                if lane == 0:
                    slive[j] = cutlass.Int32(live)
                cute.arch.sync_threads()
                if tidx < CN:
                    n = n0 + tidx
                    out = cutlass.Float32(0.0)
                    for jj in cutlass.range(K):
                        if slive[jj] != 0:
                            out = out + topk_w[t, jj] * sd[tidx, jj]
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
