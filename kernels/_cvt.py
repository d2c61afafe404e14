"""Device-side conversions shared by the kernels of every design (traced inside @cute.jit
code; kernels/_*.py are part of every kernel's compile-cache source hash)."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute


def widen(v):
    """A TensorSSA of 16-bit floats (an even number of elements) -> the same values in fp32.
    bf16: one integer op per element (x << 16 for the even elements, x & 0xffff0000 for the
    odd ones of each 32-bit word); v.to(Float32) extracts each odd half first (PRMT + SHF,
    1.5 instructions per element), and the conversions are a large share of the memory-bound
    kernels' instructions. fp16 and fp32 go through .to (fp32: unchanged). Exact either way."""
    if v.dtype is cutlass.Float32:
        return v
    if v.dtype is not cutlass.BFloat16:
        return v.to(cutlass.Float32)
    n = cute.size(v.shape)
    w = v.bitcast(cutlass.Int32)
    lo = (w * 65536).bitcast(cutlass.Float32)
    hi = (w & -65536).bitcast(cutlass.Float32)
    t = cute.make_rmem_tensor((n,), cutlass.Float32)
    for i in range(n // 2):
        t[2 * i] = lo[i]
        t[2 * i + 1] = hi[i]
    return t.load().reshape(v.shape)
