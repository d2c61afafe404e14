"""Ada design of the W4A16 skinny GEMM of decode (batch 1..16; sm_80 / sm_89, also built for
sm_90a to run on the H200): out[b, n] = sum_k x[b, k] W[n, k], W = (code - 8) x scale with
4-bit codes in cutekern.w4a16's fragment order and one 16-bit scale per (group, column).

Persistent CTAs take tiles of 16 (narrow build), 32 or 64 (wide builds) output columns in a
static stride; `ksplit` warps share a tile, each summing a run of whole groups of K (ksplit = 1:
each warp a whole tile and its own stores). Each warp streams its (tile, k64 block) items
through a private ring of cp.async slots that runs across tiles (per slot: the lane's 16
bytes of codes per 16-column block, its activation vectors, and at a group's first block
the tile's scales). A lane reads back exactly what it copied (codes, activations), so only
the scales, copied by 2, 4 or 8 lanes, need a warp barrier.

The codes are the A operand of mma.sync m16n8k16 (16 columns x 16 k; a lane's words for
columns g and g + 8 are its A rows) and the activations the B operand (8 batch rows per
n8 tile: a lane's 16-byte vector of row g is its B fragment), so a batch of <= 8 rows costs
4 mma per 16 columns x 64 k and no zero rows. Per block a lane turns each code word into 4
registers of (code - 8) (shift, LOP3 with an exponent pattern, one HFMA2 each: exact); a
group's fp32 partial is scaled when the group ends (no 16-bit rounding of code x scale).
With ksplit > 1 the warps' partials are summed in a fixed order through shared memory: no
atomics, the same bits for a row whatever the other rows of its launch.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.cute.nvgpu import cpasync

from cutekern.abi import W4A16_KBLOCK
from kernels._mma import mma_16816, words

SASS_REQUIRED = ("LDGSTS", "HMMA")
# one writer per output, fixed-order sums: no atomics; codes and partials stay in registers
SASS_FORBIDDEN = ("HGMMA", "UTCHMMA", "UTMALDG", "ATOM", "ATOMG", "RED", "REDG", "LDL", "STL")

SMEM_LIMIT_BYTES = 99 * 1024   # Ada's per-block limit, kept on sm_90a too

_DTYPES = (cutlass.Float16, cutlass.BFloat16)
_VEC = 8          # 16-bit elements per 16-byte vector
_KBLK = W4A16_KBLOCK   # k per block: a lane's 16 bytes of codes


def _h2(lo: float, hi: float, fmt: str) -> int:
    """Two 16-bit floats packed as the Int32 a packed (x2) instruction reads."""
    if fmt == "e":
        a, b = (struct.unpack("<H", struct.pack("<e", v))[0] for v in (lo, hi))
    else:   # bf16: the high half of the fp32 pattern (exact for these constants)
        a, b = (struct.unpack("<I", struct.pack("<f", v))[0] >> 16 for v in (lo, hi))
    w = a | (b << 16)
    return w - (1 << 32) if w >= 1 << 31 else w


@dsl_user_op
def fma2(a, b, c, bf16: bool, *, loc=None, ip=None):
    """a * b + c on two packed 16-bit floats (fp16 or bf16), round to nearest."""
    ty = "bf16x2" if bf16 else "f16x2"
    ops = [Int32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c)]
    res = llvm.inline_asm(T.i32(), ops, f"fma.rn.{ty} $0, $1, $2, $3;", "=r,r,r,r",
                          has_side_effects=False, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    return Int32(res)


@dsl_user_op
def and_or(a, b, c, *, loc=None, ip=None):
    """(a & b) | c in one LOP3 (ptxas kept the AND and the OR apart)."""
    ops = [Int32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c)]
    res = llvm.inline_asm(T.i32(), ops, "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                          has_side_effects=False, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    return Int32(res)


_LOG2E = 1.4426950408889634


@cute.jit
def _silu_mul(gv: cutlass.Float32, uv: cutlass.Float32) -> cutlass.Float32:
    """silu(gate) * up in fp32 (exp2 with the fast path: relative error ~1e-7)."""
    return gv * uv / (cutlass.Float32(1.0) + cute.math.exp2(-gv * _LOG2E, fastmath=True))


@dataclass(frozen=True)
class W4a16GemmAdaConfig:
    # narrow build: 16-column tiles, K split over 8 warps (short N: enough warps per tile)
    warps: int = 8          # K split inside the CTA (runs of whole groups per warp)
    stages: int = 4         # ring slots per warp: stages - 1 blocks in flight while one computes
    stages16: int = 3       # the same for the rows16 build (twice the activation bytes per slot)
    ctas_per_sm: int = 2    # the persistent grid (the API launches sm_count x this, at most)
    # wide build: 32-column tiles (two code blocks share a slot's activations), 4 warps
    wide_warps: int = 4
    wide_stages: int = 6
    wide_stages16: int = 4
    wide_ctas_per_sm: int = 3
    # the 64-column build (rows 8; the wide build's warps and CTAs): four code blocks share
    # a slot's activations, half the tiles (and per-tile K sums) of the 32-column build
    wide64_stages: int = 4


@dataclass(frozen=True)
class _Shape:
    """One build's numbers (W4a16GemmAdaConfig's narrow or wide set)."""
    warps: int
    stages: int
    nt: int               # 16-column code blocks per tile
    ctas_per_sm: int
    nb: int               # batch tiles of 8 rows (2 for rows16: rows g and g + 8)


def build_shape(config: W4a16GemmAdaConfig, rows16: bool, cols: int) -> _Shape:
    if cols == 64:
        return _Shape(config.wide_warps, config.wide64_stages, 4, config.wide_ctas_per_sm,
                      2 if rows16 else 1)
    if cols == 32:
        return _Shape(config.wide_warps, config.wide_stages16 if rows16 else config.wide_stages,
                      2, config.wide_ctas_per_sm, 2 if rows16 else 1)
    return _Shape(config.warps, config.stages16 if rows16 else config.stages, 1,
                  config.ctas_per_sm, 2 if rows16 else 1)


def smem_bytes(b: _Shape) -> int:
    slot = b.nt * 512 + b.nb * 2 * 32 * 16 + b.nt * 32          # codes, activations, scales
    return b.warps * (b.stages * slot + 2 * b.nt * b.nb * 32 * 4 * 4)


class W4a16GemmAda:
    def __init__(self, dtype, rows16: bool, cols: int = 16,
                 config: W4a16GemmAdaConfig = W4a16GemmAdaConfig()):
        if not W4a16GemmAda.can_implement(dtype, rows16, cols, config):
            raise ValueError(f"W4a16GemmAda cannot implement {dtype}, rows16={rows16}, "
                             f"cols={cols}, {config}")
        self.dtype = dtype
        self.bf16 = dtype is cutlass.BFloat16
        self.rows16 = rows16
        self.b = build_shape(config, rows16, cols)

    @staticmethod
    def can_implement(dtype, rows16, cols, config: W4a16GemmAdaConfig) -> bool:
        # no 64-column rows-16 build: 64 fp32 accumulators per lane (a trial build of a
        # variant of this kernel spilled at 3 CTAs per SM)
        if cols not in (16, 32, 64) or (cols == 64 and rows16):
            return False
        b = build_shape(config, rows16, cols)
        if dtype not in _DTYPES or b.stages < 2 or b.warps < 1:
            return False
        return smem_bytes(b) <= SMEM_LIMIT_BYTES

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, x: cute.Tensor, packed: cute.Tensor, scales: cute.Tensor,
                 out: cute.Tensor, ctas: cutlass.Int32, ksplit: cutlass.Int32,
                 stream: cuda.CUstream):
        tiles = (packed.shape[0] + self.b.nt - 1) // self.b.nt
        rounds = (tiles + self.b.warps // ksplit - 1) // (self.b.warps // ksplit)
        grid = cutlass.max(cutlass.min(ctas, rounds), 1)
        # the occupancy bound also gives ptxas its register budget (without one it spilled a
        # few registers of the rows-8 build on sm_100a at 93 registers)
        self.kernel(x, packed, scales, out, ksplit).launch(
            grid=[grid, 1, 1], block=[32 * self.b.warps, 1, 1], stream=stream,
            min_blocks_per_mp=self.b.ctas_per_sm, preferred_smem_carveout=100)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, x: cute.Tensor, packed: cute.Tensor, scales: cute.Tensor,
               out: cute.Tensor, ksplit: Int32):
        sW, sX, sS, red = self._smem(self.b)
        self._gemm(self.b, x, packed, scales, out, ksplit, sW, sX, sS, red, False)

    def _smem(self, b: _Shape):
        """The CTA's buffers for build shape b (traced inline): per (warp, slot) codes [tile
        block][lane] (conflict-free 16-byte reads), activations [row half][k32 half][lane]
        (the same), the tile's scales; the warps' partials of two tiles (one barrier per
        tile)."""
        W, R, NT, NB = b.warps, b.stages, b.nt, b.nb
        smem = cutlass.utils.SmemAllocator()
        sW = smem.allocate_tensor(Int32, cute.make_layout(W * R * NT * 32 * 4), 16)
        sX = smem.allocate_tensor(self.dtype, cute.make_layout(W * R * NB * 2 * 32 * _VEC), 16)
        sS = smem.allocate_tensor(self.dtype, cute.make_layout(W * R * NT * 16), 16)
        red = smem.allocate_tensor(cutlass.Float32, cute.make_layout(2 * W * NT * NB * 32 * 4),
                                   16)
        return sW, sX, sS, red

    @cute.jit
    def _gemm(self, b: cutlass.Constexpr, x: cute.Tensor, packed: cute.Tensor,
              scales: cute.Tensor, out: cute.Tensor, ksplit: Int32, sW: cute.Tensor,
              sX: cute.Tensor, sS: cute.Tensor, red: cute.Tensor, act: cutlass.Constexpr):
        """out = x W^T over the CTA's rounds of tiles of build shape b (buffers of _smem).
        act (the MLP's gate / up phase): W holds gate and up as alternating 16-column blocks,
        b.nt == 2, and out[:, 16 t + c] = silu(gate) * up of tile t's columns c < 16."""
        W, R = b.warps, b.stages
        NT = b.nt                                 # code blocks (16 columns each) per tile
        NB = b.nb                                 # batch tiles of 8 rows (B operands)
        NA = NT * NB                              # accumulator sets: (code block, batch tile)
        dt = self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        g = lane >> 2
        q = lane & 3

        bt = x.shape[0]
        BPG = packed.shape[1] // scales.shape[0]  # blocks per group
        groups = scales.shape[0]
        # the CTA's warps: WN tiles at a time, each split over ksplit warps (1: no CTA sum)
        KS = ksplit
        WN = W // KS
        wn = warp // KS
        ks = warp - wn * KS
        g_lo = (groups * ks) // KS
        g_hi = (groups * (ks + 1)) // KS
        b_lo = g_lo * BPG
        nblk = (g_hi - g_lo) * BPG                # this warp's run of k64 blocks per tile
        n16 = packed.shape[0]
        tiles = (n16 + NT - 1) // NT              # the last one may hold fewer blocks
        rounds = (tiles + WN - 1) // WN
        my_rounds = (rounds - bid + grid - 1) // grid   # rounds bid, bid + grid, ...
        total = my_rounds * nblk

        cp_w = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   Int32, num_bits_per_copy=128)
        cp_x = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   dt, num_bits_per_copy=128)

        # the dequant's constants: (code | E) * m + c = code - 8, exact in either type
        if cutlass.const_expr(self.bf16):
            e_pat, m0, c0 = 0x43004300, _h2(1.0, 1.0, "b"), _h2(-136.0, -136.0, "b")
            m1, c1 = m0, c0
        else:
            e_pat, m0, c0 = 0x64006400, _h2(1.0, 1.0, "e"), _h2(-1032.0, -1032.0, "e")
            m1, c1 = _h2(1.0 / 16, 1.0 / 16, "e"), _h2(-72.0, -72.0, "e")

        # per (code block u, batch tile r): the tile's sum and the group's partial, D[n][batch]
        # of one m16n8k16 (codes as A: 16 columns; activations as B: 8 rows of the batch);
        # per code block the scales of columns g and g + 8
        acc = [cute.make_rmem_tensor((4,), cutlass.Float32) for _ in range(NA)]
        part = [cute.make_rmem_tensor((4,), cutlass.Float32) for _ in range(NA)]
        sc = [cute.make_rmem_tensor((2,), cutlass.Float32) for _ in range(NT)]
        for u in cutlass.range_constexpr(NT):
            sc[u].fill(0.0)

        # the copy side's position (item nx = tile it_t, block it_b of the run, ig = it_b % BPG,
        # slot isl) runs stages - 1 items ahead of the compute side's, across tiles
        # and the element offsets of its copies (codes: tile and block; activations: block;
        # scales: group and tile), stepped by additions (no multiplies per block)
        nx = Int32(0)
        it_t = Int32(0)
        it_b = Int32(0)
        ig = Int32(0)
        isl = Int32(0)
        tile0 = bid * WN + wn
        st = (tile0, tile0 * NT * packed.stride[0] + b_lo * packed.stride[1], b_lo * _KBLK,
              g_lo * scales.stride[0] + tile0 * (16 * NT))
        for _ in cutlass.range_constexpr(R - 1):
            if nx < total:
                self._issue(b, x, packed, scales, sW, sX, sS, cp_w, cp_x, warp, lane, bt, st,
                            isl, ig == 0)
            cute.arch.cp_async_commit_group()
            nx, it_t, it_b, ig, isl, st = self._advance(
                b, nx, it_t, it_b, ig, isl, st, nblk, BPG, packed, scales, bid, grid, WN, wn,
                b_lo, g_lo)
        csl = Int32(0)
        for tl in cutlass.range(my_rounds, unroll=1):
            for u in cutlass.range_constexpr(NA):
                acc[u].fill(0.0)
            ic = Int32(0)
            for _bi in cutlass.range(nblk, unroll=1):
                # slot isl (computed one item ago) is free once every lane is past it (the
                # scales come from other lanes)
                cute.arch.sync_warp()
                if nx < total:
                    self._issue(b, x, packed, scales, sW, sX, sS, cp_w, cp_x, warp, lane, bt, st,
                                isl, ig == 0)
                cute.arch.cp_async_commit_group()
                nx, it_t, it_b, ig, isl, st = self._advance(
                    b, nx, it_t, it_b, ig, isl, st, nblk, BPG, packed, scales, bid, grid, WN, wn,
                    b_lo, g_lo)
                cute.arch.cp_async_wait_group(R - 1)
                cute.arch.sync_warp()
                slot = warp * R + csl
                if ic == 0:
                    for u in cutlass.range_constexpr(NT):
                        for r in cutlass.range_constexpr(NB):
                            part[u * NB + r].fill(0.0)
                        for a in cutlass.range_constexpr(2):
                            sc[u][a] = sS[(slot * NT + u) * 16 + 8 * a + g].to(cutlass.Float32)
                wf = cute.make_rmem_tensor((4 * NT,), Int32)
                for u in cutlass.range_constexpr(NT):
                    cute.autovec_copy(cute.local_tile(sW, (4,), ((slot * NT + u) * 32 + lane,)),
                                      cute.local_tile(wf, (4,), (u,)))
                for h in cutlass.range_constexpr(2):
                    # batch tile bi's vector of this lane (row g + 8 bi; zeros past the batch)
                    xs = []
                    for bi in cutlass.range_constexpr(NB):
                        xv = cute.make_rmem_tensor((_VEC,), dt)
                        xv.fill(0.0)
                        if g + 8 * bi < bt:
                            cute.autovec_copy(cute.local_tile(
                                sX, (_VEC,), (((slot * NB + bi) * 2 + h) * 32 + lane,)), xv)
                        xs.append(words(xv))
                    for u in cutlass.range_constexpr(NT):
                        # columns g (word 2h) and g + 8 (word 2h + 1): the A rows g / g + 8
                        wlo = self._dequant(wf[4 * u + 2 * h], e_pat, m0, c0, m1, c1)
                        whi = self._dequant(wf[4 * u + 2 * h + 1], e_pat, m0, c0, m1, c1)
                        for r in cutlass.range_constexpr(NB):
                            self._mma_k32(wlo, whi, xs[r], part[u * NB + r])
                ic = ic + 1
                if ic == BPG:
                    ic = Int32(0)
                    for u in cutlass.range_constexpr(NT):
                        for r in cutlass.range_constexpr(NB):
                            for e in cutlass.range_constexpr(4):
                                ai = u * NB + r
                                acc[ai][e] = acc[ai][e] + part[ai][e] * sc[u][e >> 1]
                csl = csl + 1
                if csl == R:
                    csl = Int32(0)

            # lane (g, q), code block u, batch tile r: D[n][b] at n = 16u + g (c0, c1) and
            # 16u + g + 8 (c2, c3), b = 8r + 2q (c0, c2) and 8r + 2q + 1 (c1, c3)
            if KS == 1:
                # the warp's own tile, whole K: straight from the accumulators
                if cutlass.const_expr(act):
                    # code block 0 is the gate, 1 the up of the same 16 columns
                    col0 = ((bid + tl * grid) * WN + wn) * 16
                    for r in cutlass.range_constexpr(NB):
                        for e in cutlass.range_constexpr(4):
                            row = 8 * r + 2 * q + (e & 1)
                            col = col0 + g + 8 * (e >> 1)
                            if (row < bt) & (col < out.shape[1]):
                                out[row, col] = _silu_mul(acc[r][e], acc[NB + r][e]).to(dt)
                else:
                    col0 = ((bid + tl * grid) * WN + wn) * (16 * NT)
                    for u in cutlass.range_constexpr(NT):
                        for r in cutlass.range_constexpr(NB):
                            for e in cutlass.range_constexpr(4):
                                row = 8 * r + 2 * q + (e & 1)
                                col = col0 + 16 * u + g + 8 * (e >> 1)
                                if (row < bt) & (col < out.shape[1]):
                                    out[row, col] = acc[u * NB + r][e].to(dt)
            else:
                # the ksplit warps' partials of each tile, summed in warp order
                rbase = (tl & 1) * (W * NT * NB * 32 * 4)
                for u in cutlass.range_constexpr(NA):
                    for e in cutlass.range_constexpr(4):
                        ri = rbase + ((warp * NT * NB + u) * 32 + lane) * 4 + e
                        red[ri] = acc[u][e]
                cute.arch.sync_threads()
                if cutlass.const_expr(act):
                    self._act_sums(red, rbase, out, tidx, bid, tl, grid, WN, KS, bt, b)
                else:
                    self._sums(red, rbase, out, tidx, bid, tl, grid, WN, KS, bt, b)
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def _sums(self, red: cute.Tensor, rbase: Int32, out: cute.Tensor, tidx: Int32, bid: Int32,
              tl: Int32, grid: Int32, WN: Int32, KS: Int32, bt: Int32, b: cutlass.Constexpr):
        """out of the round's WN tiles: each element the sum of its KS warps' partials in warp
        order (partials at red[rbase + ((warp, code block, batch tile), lane, 4)])."""
        W, NT, NB = b.warps, b.nt, b.nb
        dt = self.dtype
        per_tile = 16 * NT * 8 * NB
        for idx in cutlass.range(tidx, WN * per_tile, 32 * W, unroll=1):
            t = idx // per_tile
            rc = idx - t * per_tile
            row = rc // (16 * NT)
            col = rc - row * (16 * NT)
            ocol = ((bid + tl * grid) * WN + t) * (16 * NT) + col
            if (row < bt) & (ocol < out.shape[1]):
                c16 = col & 15
                src = ((((col >> 4) * NB + (row >> 3)) * 32 + 4 * (c16 & 7)
                        + ((row & 7) >> 1)) * 4 + 2 * (c16 >> 3) + (row & 1))
                tot = cutlass.Float32(0.0)
                for kk in cutlass.range(KS, unroll=1):
                    tot = tot + red[rbase + (t * KS + kk) * NT * NB * 32 * 4 + src]
                out[row, ocol] = tot.to(dt)

    @cute.jit
    def _act_sums(self, red: cute.Tensor, rbase: Int32, out: cute.Tensor, tidx: Int32,
                  bid: Int32, tl: Int32, grid: Int32, WN: Int32, KS: Int32, bt: Int32,
                  b: cutlass.Constexpr):
        """_sums for the gate / up phase: out[:, 16 t + c] = silu(gate) * up of tile t's
        column c, gate and up each summed over the KS warps in warp order."""
        W, NB = b.warps, b.nb
        per_tile = 16 * 8 * NB
        up = NB * 32 * 4                          # code block 1's offset in a warp's partials
        for idx in cutlass.range(tidx, WN * per_tile, 32 * W, unroll=1):
            t = idx // per_tile
            rc = idx - t * per_tile
            row = rc // 16
            col = rc - row * 16
            ocol = ((bid + tl * grid) * WN + t) * 16 + col
            if (row < bt) & (ocol < out.shape[1]):
                src = (((row >> 3) * 32 + 4 * (col & 7) + ((row & 7) >> 1)) * 4
                       + 2 * (col >> 3) + (row & 1))
                gs = cutlass.Float32(0.0)
                us = cutlass.Float32(0.0)
                for kk in cutlass.range(KS, unroll=1):
                    base = rbase + (t * KS + kk) * 2 * NB * 32 * 4 + src
                    gs = gs + red[base]
                    us = us + red[base + up]
                out[row, ocol] = _silu_mul(gs, us).to(self.dtype)

    # ------------------------------------------------------------------ helpers (traced inline)
    def _mma_k32(self, wlo, whi, xw, acc):
        """acc (D[n][b], 4 fp32) += the 32-wide k block's two m16n8k16 steps: A rows g / g + 8
        = columns g / g + 8 (dequant registers wlo / whi), B = the 4 words of the lane's
        activation vector (permuted k: registers 0, 1 and words 0, 1 are the first step)."""
        d = [acc[i] for i in range(4)]
        for st in range(2):
            d = mma_16816([wlo[2 * st], whi[2 * st], wlo[2 * st + 1], whi[2 * st + 1]],
                          [xw[2 * st], xw[2 * st + 1]], d, self.bf16)
        for i in range(4):
            acc[i] = d[i]

    def _dequant(self, w, e_pat, m0, c0, m1, c1):
        """A code word -> its 4 registers of (code - 8): register r = nibbles (r, r + 4)."""
        regs = []
        for r in range(4):
            if self.bf16:
                regs.append(fma2(and_or(w >> (4 * r), 0x000F000F, e_pat), m0, c0, True))
            elif r % 2 == 0:
                regs.append(fma2(and_or(w >> (4 * r), 0x000F000F, e_pat), m0, c0, False))
            else:
                regs.append(fma2(and_or(w >> (4 * r - 4), 0x00F000F0, e_pat), m1, c1, False))
        return regs

    @cute.jit
    def _advance(self, b: cutlass.Constexpr, nx: Int32, it_t: Int32, it_b: Int32, ig: Int32,
                 isl: Int32, st, nblk: Int32, bpg: Int32, packed: cute.Tensor,
                 scales: cute.Tensor, bid: Int32, grid: Int32, WN: Int32, wn: Int32,
                 b_lo: Int32, g_lo: Int32):
        """The copy side's next item: item nx is block it_b of the run of round it_t, at
        position ig of its group, into slot isl; st = (tile, codes offset, activation offset,
        scale offset), stepped by additions within a run, recomputed at a new tile."""
        NT = b.nt
        tile, wo, xo, so = st
        nx = nx + 1
        it_b = it_b + 1
        ig = ig + 1
        isl = isl + 1
        wo = wo + packed.stride[1]
        xo = xo + _KBLK
        if ig == bpg:
            ig = Int32(0)
            so = so + scales.stride[0]
        if it_b == nblk:
            it_b = Int32(0)
            it_t = it_t + 1
            tile = (bid + it_t * grid) * WN + wn
            wo = tile * NT * packed.stride[0] + b_lo * packed.stride[1]
            xo = b_lo * _KBLK
            so = g_lo * scales.stride[0] + tile * (16 * NT)
        if isl == b.stages:
            isl = Int32(0)
        return nx, it_t, it_b, ig, isl, (tile, wo, xo, so)

    @cute.jit
    def _issue(self, b: cutlass.Constexpr, x: cute.Tensor, packed: cute.Tensor,
               scales: cute.Tensor, sW: cute.Tensor, sX: cute.Tensor, sS: cute.Tensor, cp_w,
               cp_x, warp: Int32, lane: Int32, bt: Int32, st, isl: Int32, group_start):
        """cp.async one (tile, k64 block) item into the warp's slot isl (st: _advance's tile
        and offsets): the lane's 16 bytes of codes per tile block, its activation vectors
        (rows < bt), the tile's scales (lanes 0 .. 2 NT - 1, at a group's first block)."""
        R, NT, NB = b.stages, b.nt, b.nb
        tile, wo, xo, so = st
        g = lane >> 2
        q = lane & 3
        slot = warp * R + isl
        for u in cutlass.range_constexpr(NT):
            # past N (the last tile of an odd block count): nothing loaded, nothing stored
            if tile * NT + u < packed.shape[0]:
                src = cute.make_tensor(
                    packed.iterator + cute.assume(wo + u * packed.stride[0]
                                                  + lane * packed.stride[2], divby=4),
                    cute.make_layout(4))
                cute.copy(cp_w, src, cute.local_tile(sW, (4,), ((slot * NT + u) * 32 + lane,)))
        for bi in cutlass.range_constexpr(NB):
            row = g + 8 * bi
            if row < bt:
                for h in cutlass.range_constexpr(2):
                    xs = cute.make_tensor(
                        x.iterator + cute.assume(row * x.stride[0] + xo + 32 * h + _VEC * q,
                                                 divby=_VEC),
                        cute.make_layout(_VEC))
                    cute.copy(cp_x, xs, cute.local_tile(
                        sX, (_VEC,), (((slot * NB + bi) * 2 + h) * 32 + lane,)))
        if group_start & (lane < 2 * NT) & (tile * NT + (lane >> 1) < packed.shape[0]):
            ss = cute.make_tensor(
                scales.iterator + cute.assume(so + _VEC * lane, divby=_VEC),
                cute.make_layout(_VEC))
            cute.copy(cp_x, ss, cute.local_tile(sS, (_VEC,), (slot * 2 * NT + lane,)))
