"""Ada design of one decode step's attention with Qwen3's per-head q / k RMSNorm and RoPE (the
megakernel's attention task; kernels/CONTRACT_MEGAKERNEL.md). Per batch row b and KV head,
from the step's projections qkv[b] = [q heads | k heads | v heads] (head_dim 128):

    q_h = rope(rmsnorm(q_h) * q_norm),  k = rope(rmsnorm(k) * k_norm)      (fp32, pos = lens[b])
    k_cache[b, kvh, pos] = dtype(k),  v_cache[b, kvh, pos] = v
    out[b, h] = softmax(q_h K^T / sqrt(128)) V    over positions 0..pos

One CTA per (row, KV head, pair of that head's q heads): GQA reads a KV head's cache once for
two q heads (groups of more than two heads take more CTAs of the same head; their second
reads are L2 hits). RoPE reads a host-built fp32 table (cos | sin per position: no in-kernel
sin / cos of large angles). The new position's k / v never round-trip through the cache:
every CTA derives them itself, the first of each head's CTAs stores them, and the scores use
the stored (rounded) k.

- Half-warps over positions, a lane per 8 of the 128 channels: a position's K and V rows are
  one 16-byte load per lane each; a lane keeps `unroll` positions' K and V loads in flight,
  then 2 dot products of 8 (fp32), a 4-step butterfly per score, one online-softmax update
  per head for the `unroll` positions (exp2 with the scale folded into q).
- The half-warps' (max, sum, 128 partial outputs) meet in shared memory, summed in a fixed
  order (deterministic, no atomics); out is rounded once.
- Splits (grid z, the host's pick: launches with fewer CTAs than 2 per SM): split z takes
  positions [p z / n, p (z + 1) / n); splits 1.. publish their (max, sum, partial outputs)
  per head as 8-byte words (tag | fp32 bits, one relaxed store: the tag vouches for the
  value), split 0 polls them (a split's words loaded together, the next split's in flight
  while they are checked), sums them in split order and clears them for the next launch.
  Split 0 waits for the others, so every CTA of the launch must be resident (the host keeps
  the launch within cutekern.decode.RESIDENT_PER_SM = 2 CTAs of 8 warps per SM, which the
  register count allows: tests/test_export.py).
- A row whose lens[b] is outside the cache (or the RoPE table) writes NaN to its outputs and
  leaves the cache alone (the host cannot check device-resident lengths without a sync).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from kernels._cvt import widen
from kernels._xch import bits_f32, f32_bits

SMEM_LIMIT_BYTES = 99 * 1024
HEAD_DIM = 128
_HEADS = 2              # q heads per CTA
_LOG2_E = 1.4426950408889634
_NEG = -1.0e30          # finite start of a running max (an empty half-warp must not NaN)
_REC = HEAD_DIM + 2     # exchange words per head: partial outputs, max, sum
_FULL = 1 << 32         # an exchange word's tag: (1 << 32) | fp32 bits; 0 = empty

SASS_REQUIRED = ("LDG", "SHFL", "MUFU")
SASS_FORBIDDEN = ("HGMMA", "UTCHMMA", "UTMALDG", "ATOM", "ATOMG", "RED", "REDG", "LDL", "STL")

_DTYPES = (cutlass.Float16, cutlass.BFloat16)


@dataclass(frozen=True)
class DecodeAttnAdaConfig:
    # 16 half-warps share a CTA's positions: 5-20% faster than 4 warps at 1..16 rows on an
    # H100 (perf/results/decode_splits_h100*.json), 2 CTAs an SM
    warps: int = 8
    unroll: int = 4     # positions per half-warp per step: 2 x unroll 16-byte loads in flight


def smem_bytes(config: DecodeAttnAdaConfig) -> int:
    nhw = 2 * config.warps
    return 4 * (_HEADS * HEAD_DIM + 2 * HEAD_DIM + 2 * nhw * _HEADS + nhw * _HEADS * HEAD_DIM)


def _rows(n):
    """Register layout of n rows of 8 contiguous values (one 16-byte vector per row of
    16-bit values): rows index whole vectors (the default layout is column-major)."""
    return cute.make_layout((n, 8), stride=(8, 1))


@cute.jit
def _put(word: cute.Pointer, val: Float32):
    """Publish val: value and tag in one 8-byte store (single-copy atomic, relaxed at gpu
    scope), so a reader that sees the tag sees the value; no fence, no flag."""
    cute.arch.store(word, Int64(_FULL) | (Int64(f32_bits(val)) & Int64(0xFFFFFFFF)),
                    sem="relaxed", scope="gpu")


@cute.jit
def _load4(rec: cute.Pointer, e: Int32):
    """One split record's words a thread needs (max, sum, its 2 partial outputs), loaded
    together (split 0 only: it polls them until tagged; every split is resident)."""
    return (cute.arch.load(rec + HEAD_DIM, Int64, sem="relaxed", scope="gpu"),
            cute.arch.load(rec + HEAD_DIM + 1, Int64, sem="relaxed", scope="gpu"),
            cute.arch.load(rec + e, Int64, sem="relaxed", scope="gpu"),
            cute.arch.load(rec + e + 1, Int64, sem="relaxed", scope="gpu"))


@cute.jit
def _val(w: Int64) -> Float32:
    return bits_f32(Int32(w & Int64(0xFFFFFFFF)))


@cute.jit
def _clear(word: cute.Pointer):
    cute.arch.store(word, Int64(0), sem="relaxed", scope="gpu")


class DecodeAttnAda:
    def __init__(self, dtype, config: DecodeAttnAdaConfig = DecodeAttnAdaConfig()):
        if not DecodeAttnAda.can_implement(dtype, config):
            raise ValueError(f"DecodeAttnAda cannot implement {dtype}, {config}")
        self.dtype = dtype
        self.cfg = config

    @staticmethod
    def can_implement(dtype, config: DecodeAttnAdaConfig) -> bool:
        # 3 warps derive q, q, k and a fourth v before the positions start
        return (dtype in _DTYPES and 4 <= config.warps <= 16 and 1 <= config.unroll <= 8
                and smem_bytes(config) <= SMEM_LIMIT_BYTES)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, qkv: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor,
                 lens: cute.Tensor, q_norm: cute.Tensor, k_norm: cute.Tensor, rope: cute.Tensor,
                 out: cute.Tensor, eps: Float32, xch: cute.Tensor, splits: Int32,
                 stream: cuda.CUstream):
        hkv = k_cache.shape[1]
        group = (out.shape[1] // HEAD_DIM) // hkv
        self.kernel(qkv, k_cache, v_cache, lens, q_norm, k_norm, rope, out, eps, xch).launch(
            grid=[qkv.shape[0] * hkv, (group + _HEADS - 1) // _HEADS, splits],
            block=[32 * self.cfg.warps, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, qkv: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor,
               lens: cute.Tensor, q_norm: cute.Tensor, k_norm: cute.Tensor, rope: cute.Tensor,
               out: cute.Tensor, eps: Float32, xch: cute.Tensor):
        D = HEAD_DIM
        NHW = 2 * self.cfg.warps
        NT = 32 * self.cfg.warps
        U = self.cfg.unroll
        dt = self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()
        _, gy, splits = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        hkv = k_cache.shape[1]
        hq = out.shape[1] // D
        group = hq // hkv
        b = bx // hkv
        kvh = bx - b * hkv
        h0 = kvh * group + _HEADS * by          # this CTA's first q head
        nh = cutlass.min(group - _HEADS * by, _HEADS)
        pos = lens[b]                            # cached positions = the new token's position
        valid = (pos >= 0) & (pos < k_cache.shape[2]) & (pos < rope.shape[0])

        @cute.struct
        class SharedStorage:
            q: cute.struct.MemRange[Float32, _HEADS * D]
            kv: cute.struct.MemRange[Float32, 2 * D]
            ml: cute.struct.MemRange[Float32, 2 * NHW * _HEADS]
            acc: cute.struct.MemRange[Float32, NHW * _HEADS * D]

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        sQ = storage.q.get_tensor(cute.make_layout((_HEADS, D), stride=(D, 1)))
        sKV = storage.kv.get_tensor(cute.make_layout((2, D), stride=(D, 1)))
        sML = storage.ml.get_tensor(cute.make_layout((NHW, _HEADS, 2), stride=(2 * _HEADS, 2, 1)))
        sAcc = storage.acc.get_tensor(cute.make_layout((NHW, _HEADS, D),
                                                       stride=(_HEADS * D, D, 1)))
        if valid:
            # this CTA group's exchange records: split 1.. x head x (128 partial outputs,
            # max, sum), one 8-byte word each
            xrec = cute.make_ptr(Int64, xch.iterator.toint() + Int64(
                (bx * gy + by) * (splits - 1)) * Int64(_HEADS * _REC * 8),
                cute.AddressSpace.gmem, assumed_align=8)
            self._attend(qkv, k_cache, v_cache, q_norm, k_norm, rope, out, eps, sQ, sKV, sML,
                         sAcc, b, kvh, by, h0, nh, pos, hq, hkv, tidx, warp, lane, bz, splits,
                         xrec)
        elif bz == 0:
            # a length outside the cache: NaN out (loud), cache untouched
            for i in cutlass.range(tidx, _HEADS * D, NT, unroll=1):
                h = i // D
                if h < nh:
                    out[b, h0 * D + i] = dt(math.nan)

    @cute.jit
    def _attend(self, qkv: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor,
                q_norm: cute.Tensor, k_norm: cute.Tensor, rope: cute.Tensor, out: cute.Tensor,
                eps: Float32, sQ: cute.Tensor, sKV: cute.Tensor, sML: cute.Tensor,
                sAcc: cute.Tensor, b: Int32, kvh: Int32, by: Int32, h0: Int32, nh: Int32, pos: Int32,
                hq: Int32, hkv: Int32, tidx: Int32, warp: Int32, lane: Int32, z: Int32,
                splits: Int32, xrec: cute.Pointer):
        D = HEAD_DIM
        NHW = 2 * self.cfg.warps
        NT = 32 * self.cfg.warps
        U = self.cfg.unroll
        dt = self.dtype
        # ---- the new token: warps 0, 1 its q heads, 2 its k (4 channels a lane), 3 its v
        xr = cute.make_rmem_tensor((4,), dt)
        if warp < 3:
            wr = cute.make_rmem_tensor((4,), dt)
            col = (hq + kvh) * D
            if warp == 2:
                cute.autovec_copy(cute.local_tile(k_norm, (4,), (lane,)), wr)
            else:
                # a group of one head: warp 1 derives some valid head, never stored
                col = cutlass.min(h0 + warp, hq - 1) * D
                cute.autovec_copy(cute.local_tile(q_norm, (4,), (lane,)), wr)
            cute.autovec_copy(cute.local_tile(qkv[b, None], (4,), (col // 4 + lane,)), xr)
            x = cute.make_rmem_tensor((4,), Float32)
            x.store(widen(xr.load()))
            ss = x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3]
            for off in cutlass.range_constexpr(5):
                ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=16 >> off)
            rs = cute.math.rsqrt(ss * (1.0 / D) + eps, fastmath=False)
            x.store(x.load() * rs * widen(wr.load()))
            # rotate-half RoPE: channel i pairs with i +- 64, held by lane +- 16
            cs = cute.make_rmem_tensor((4,), Float32)
            sn = cute.make_rmem_tensor((4,), Float32)
            cute.autovec_copy(cute.local_tile(rope[pos, None], (4,), (lane % 16,)), cs)
            cute.autovec_copy(cute.local_tile(rope[pos, None], (4,), (16 + lane % 16,)), sn)
            sign = Float32(1.0)
            if lane < 16:
                sign = Float32(-1.0)
            y = cute.make_rmem_tensor((4,), Float32)
            for e in cutlass.range_constexpr(4):
                other = cute.arch.shuffle_sync_bfly(x[e], offset=16)
                y[e] = x[e] * cs[e] + sign * other * sn[e]
            if warp == 2:
                xr.store(y.load().to(dt))
                for e in cutlass.range_constexpr(4):
                    sKV[0, lane * 4 + e] = Float32(xr[e])
                if (by == 0) & (z == 0):
                    cute.autovec_copy(xr, cute.local_tile(k_cache[b, kvh, pos, None], (4,),
                                                          (lane,)))
            else:
                # scores in the exp2 domain: q carries 1/sqrt(D) and log2(e)
                for e in cutlass.range_constexpr(4):
                    sQ[warp, lane * 4 + e] = y[e] * (_LOG2_E / math.sqrt(D))
        if warp == 3:
            col = (hq + hkv + kvh) * D
            cute.autovec_copy(cute.local_tile(qkv[b, None], (4,), (col // 4 + lane,)), xr)
            for e in cutlass.range_constexpr(4):
                sKV[1, lane * 4 + e] = Float32(xr[e])
            if (by == 0) & (z == 0):
                cute.autovec_copy(xr, cute.local_tile(v_cache[b, kvh, pos, None], (4,),
                                                      (lane,)))
        cute.arch.sync_threads()

        # ---- this split's cached positions lo .. hi - 1: half-warp hw takes lo + hw,
        # lo + hw + NHW, ...; lane j of it channels 8j .. 8j + 7
        lo = (pos * z) // splits
        hi = (pos * (z + 1)) // splits
        j = tidx % 16
        hw = tidx // 16
        qf = cute.make_rmem_tensor(_rows(_HEADS), Float32)
        for h in cutlass.range_constexpr(_HEADS):
            cute.autovec_copy(cute.local_tile(sQ[h, None], (8,), (j,)), qf[h, None])
        kn = cute.make_rmem_tensor((8,), Float32)
        vn = cute.make_rmem_tensor((8,), Float32)
        cute.autovec_copy(cute.local_tile(sKV[0, None], (8,), (j,)), kn)
        cute.autovec_copy(cute.local_tile(sKV[1, None], (8,), (j,)), vn)
        # state per head: [h, 0] running max, [h, 1] running sum; half-warp 0 starts with
        # the new position (every lane computes its score: the butterflies need all 32)
        st = cute.make_rmem_tensor((_HEADS, 2), Float32)
        acc = cute.make_rmem_tensor(_rows(_HEADS), Float32)
        for h in cutlass.range_constexpr(_HEADS):
            s_new = self._dot8(qf, h, kn)
            st[h, 0] = Float32(_NEG)
            st[h, 1] = Float32(0.0)
            acc[h, None].fill(0.0)
            if (hw == 0) & (z == 0):
                st[h, 0] = s_new
                st[h, 1] = Float32(1.0)
                acc[h, None].store(vn.load())

        kr = cute.make_rmem_tensor(_rows(U), dt)
        vr = cute.make_rmem_tensor(_rows(U), dt)
        vf = cute.make_rmem_tensor(_rows(U), Float32)
        kf = cute.make_rmem_tensor((8,), Float32)
        sc = cute.make_rmem_tensor((_HEADS, U), Float32)
        for base in cutlass.range(lo, hi, NHW * U, unroll=1):
            for u in cutlass.range_constexpr(U):
                # past the end: reread the last cached position, score -inf below
                s = cutlass.min(base + u * NHW + hw, hi - 1)
                cute.autovec_copy(cute.local_tile(k_cache[b, kvh, s, None], (8,), (j,)),
                                  kr[u, None])
                cute.autovec_copy(cute.local_tile(v_cache[b, kvh, s, None], (8,), (j,)),
                                  vr[u, None])
            for u in cutlass.range_constexpr(U):
                kf.store(widen(kr[u, None].load()))
                vf[u, None].store(widen(vr[u, None].load()))
                for h in cutlass.range_constexpr(_HEADS):
                    sc[h, u] = self._dot8(qf, h, kf)
                    if base + u * NHW + hw >= hi:
                        sc[h, u] = Float32(-math.inf)
            for h in cutlass.range_constexpr(_HEADS):
                mx = st[h, 0]
                for u in cutlass.range_constexpr(U):
                    mx = cute.arch.fmax(mx, sc[h, u])
                alpha = cute.math.exp2(st[h, 0] - mx, fastmath=True)
                lsum = st[h, 1] * alpha
                acc[h, None].store(acc[h, None].load() * alpha)
                for u in cutlass.range_constexpr(U):
                    p = cute.math.exp2(sc[h, u] - mx, fastmath=True)
                    lsum = lsum + p
                    acc[h, None].store(acc[h, None].load() + vf[u, None].load() * p)
                st[h, 0] = mx
                st[h, 1] = lsum

        # ---- half-warps meet in shared memory; fixed order
        for h in cutlass.range_constexpr(_HEADS):
            if j == 0:
                sML[hw, h, 0] = st[h, 0]
                sML[hw, h, 1] = st[h, 1]
            cute.autovec_copy(acc[h, None], cute.local_tile(sAcc[hw, h, None], (8,), (j,)))
        cute.arch.sync_threads()
        # ---- then the splits (z > 0 publish, split 0 sums them in split order and stores)
        for i in cutlass.range(tidx, _HEADS * D // 2, NT, unroll=1):
            h = i // (D // 2)
            e = 2 * (i - h * (D // 2))
            mx = sML[0, h, 0]
            for w in cutlass.range_constexpr(1, NHW):
                mx = cute.arch.fmax(mx, sML[w, h, 0])
            tot = Float32(0.0)
            o0 = Float32(0.0)
            o1 = Float32(0.0)
            for w in cutlass.range_constexpr(NHW):
                f = cute.math.exp2(sML[w, h, 0] - mx, fastmath=True)
                tot = tot + sML[w, h, 1] * f
                o0 = o0 + sAcc[w, h, e] * f
                o1 = o1 + sAcc[w, h, e + 1] * f
            if z > 0:
                rec = xrec + ((z - 1) * _HEADS + h) * _REC
                _put(rec + e, o0)
                _put(rec + e + 1, o1)
                if e == 0:
                    _put(rec + D, mx)
                    _put(rec + D + 1, tot)
            else:
                # a split's 4 words are loaded together and the next split's are in flight
                # while this one's are checked: one L2 round trip a split at most, not four
                if splits > 1:
                    rec = xrec + h * _REC
                    nm, nt, n0, n1 = _load4(rec, e)
                    for zz in cutlass.range(1, splits, unroll=1):
                        wm, wt, w0, w1 = nm, nt, n0, n1
                        rec = xrec + ((zz - 1) * _HEADS + h) * _REC
                        # the last split reloads its own words (unused)
                        nxt = xrec + ((cutlass.min(zz, splits - 2)) * _HEADS + h) * _REC
                        nm, nt, n0, n1 = _load4(nxt, e)
                        while ((wm >> 32) == 0) | ((wt >> 32) == 0) | ((w0 >> 32) == 0) \
                                | ((w1 >> 32) == 0):
                            wm, wt, w0, w1 = _load4(rec, e)
                        mz = _val(wm)
                        tz = _val(wt)
                        p0 = _val(w0)
                        p1 = _val(w1)
                        m2 = cute.arch.fmax(mx, mz)
                        fa = cute.math.exp2(mx - m2, fastmath=True)
                        fb = cute.math.exp2(mz - m2, fastmath=True)
                        tot = tot * fa + tz * fb
                        o0 = o0 * fa + p0 * fb
                        o1 = o1 * fa + p1 * fb
                        mx = m2
                if h < nh:
                    r = cute.arch.rcp_approx(tot)   # tot >= 1: the max position counts 1
                    ov = cute.make_rmem_tensor((2,), Float32)
                    ov[0] = o0 * r
                    ov[1] = o1 * r
                    ob = cute.make_rmem_tensor((2,), dt)
                    ob.store(ov.load().to(dt))
                    cute.autovec_copy(ob, cute.local_tile(out[b, None], (2,),
                                                          (((h0 + h) * D + e) // 2,)))
        if (z == 0) & (splits > 1):
            # every thread has read its words (a head's max / sum words are read by all its
            # threads): back to 0 for the next launch
            cute.arch.sync_threads()
            for i in cutlass.range(tidx, _HEADS * D // 2, NT, unroll=1):
                h = i // (D // 2)
                e = 2 * (i - h * (D // 2))
                for zz in cutlass.range(1, splits, unroll=1):
                    rec = xrec + ((zz - 1) * _HEADS + h) * _REC
                    _clear(rec + e)
                    _clear(rec + e + 1)
                    if e == 0:
                        _clear(rec + D)
                        _clear(rec + D + 1)

    @staticmethod
    @cute.jit
    def _dot8(qf: cute.Tensor, h: cutlass.Constexpr, kf: cute.Tensor) -> Float32:
        """q_h . k over a lane's 8 channels, summed over its half-warp's 16 lanes."""
        d = qf[h, 0] * kf[0]
        for e in cutlass.range_constexpr(1, 8):
            d = d + qf[h, e] * kf[e]
        for off in cutlass.range_constexpr(4):
            d = d + cute.arch.shuffle_sync_bfly(d, offset=8 >> off)
        return d
