"""Residual add + RMSNorm of a decode step (Ada design: plain 16-byte loads, CUDA cores):
the glue between the decoder's launches (cutekern.decode.add_rms_norm), three or four torch
kernels in one.

Per row b (one CTA): x[b] += y[b] in fp32 (the residual stream, in place), then
out[b] = x[b] * rsqrt(mean(x[b]^2) + eps) * w, rounded once to out's dtype. A thread takes 8
contiguous elements at a time (x and w: two 16-byte accesses, y and out: one); the row's sum of
squares meets through warp butterflies and shared memory, summed in warp order (fixed:
deterministic, no atomics); the second pass re-reads the x this thread wrote in the first.
Hidden size a multiple of 8.
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32

from kernels._cvt import widen

SASS_REQUIRED = ("LDG", "STG", "SHFL", "MUFU")
SASS_FORBIDDEN = ("HGMMA", "UTCHMMA", "UTMALDG", "ATOM", "ATOMG", "RED", "REDG", "LDL", "STL")
_DTYPES = (cutlass.Float16, cutlass.BFloat16)
VEC = 8            # elements a thread takes at a time


@dataclass(frozen=True)
class AddRmsNormAdaConfig:
    warps: int = 8     # 256 threads: one 8-element chunk each at hidden 2048


class AddRmsNormAda:
    def __init__(self, dtype, config: AddRmsNormAdaConfig = AddRmsNormAdaConfig()):
        if not AddRmsNormAda.can_implement(dtype, config):
            raise ValueError(f"AddRmsNormAda cannot implement {dtype}, {config}")
        self.dtype = dtype
        self.cfg = config

    @staticmethod
    def can_implement(dtype, config: AddRmsNormAdaConfig) -> bool:
        return dtype in _DTYPES and 1 <= config.warps <= 32

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, x: cute.Tensor, y: cute.Tensor, w: cute.Tensor, out: cute.Tensor,
                 eps: Float32, stream: cuda.CUstream):
        self.kernel(x, y, w, out, eps).launch(grid=[x.shape[0], 1, 1],
                                              block=[32 * self.cfg.warps, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, x: cute.Tensor, y: cute.Tensor, w: cute.Tensor, out: cute.Tensor,
               eps: Float32):
        W = self.cfg.warps
        NT = 32 * W
        dt = self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        d = x.shape[1]
        chunks = d // VEC

        @cute.struct
        class SharedStorage:
            red: cute.struct.MemRange[Float32, W]

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        sRed = storage.red.get_tensor(cute.make_layout((W,)))
        xrow, yrow, orow = x[b, None], y[b, None], out[b, None]

        ss = Float32(0.0)
        xv = cute.make_rmem_tensor((VEC,), Float32)
        yv = cute.make_rmem_tensor((VEC,), dt)
        for c in cutlass.range(tidx, chunks, NT, unroll=1):
            cute.autovec_copy(cute.local_tile(xrow, (VEC,), (c,)), xv)
            cute.autovec_copy(cute.local_tile(yrow, (VEC,), (c,)), yv)
            xv.store(xv.load() + widen(yv.load()))
            cute.autovec_copy(xv, cute.local_tile(xrow, (VEC,), (c,)))
            for e in cutlass.range_constexpr(VEC):
                ss = ss + xv[e] * xv[e]
        for off in cutlass.range_constexpr(5):
            ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=16 >> off)
        if lane == 0:
            sRed[warp] = ss
        cute.arch.sync_threads()
        tot = Float32(0.0)
        for i in cutlass.range_constexpr(W):
            tot = tot + sRed[i]
        rs = cute.math.rsqrt(tot / Float32(d) + eps, fastmath=False)

        wv = cute.make_rmem_tensor((VEC,), Float32)
        ov = cute.make_rmem_tensor((VEC,), dt)
        for c in cutlass.range(tidx, chunks, NT, unroll=1):
            cute.autovec_copy(cute.local_tile(xrow, (VEC,), (c,)), xv)
            cute.autovec_copy(cute.local_tile(w, (VEC,), (c,)), wv)
            ov.store((xv.load() * rs * wv.load()).to(dt))
            cute.autovec_copy(ov, cute.local_tile(orow, (VEC,), (c,)))
