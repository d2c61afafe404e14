"""Argument ABI shared by the compile side and the DSL-free runtime.

An op's entry takes a fixed list of arguments. Each tensor argument is described
by (name, dtype, rank, which mode is contiguous, alignment in elements); every
other extent and stride is dynamic. The compile side turns this into fake
tensors; the runtime turns it into the C structs the exported object expects.
This module must import without the DSL or torch.
"""
from __future__ import annotations

from dataclasses import dataclass

# dtype name -> bytes per element. Names are the ones the manifest stores.
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "int32": 4}


@dataclass(frozen=True)
class TensorArg:
    name: str
    dtype: str
    rank: int
    align: int = 8  # elements; base address and non-unit strides are multiples of this

    @property
    def n_dyn_shapes(self) -> int:
        return self.rank

    @property
    def n_dyn_strides(self) -> int:
        # the last mode is contiguous (stride 1, static); all others dynamic
        return self.rank - 1

    def to_json(self) -> dict:
        return {"kind": "tensor", "name": self.name, "dtype": self.dtype,
                "rank": self.rank, "align": self.align,
                "dynamic_shapes": self.n_dyn_shapes, "dynamic_strides": self.n_dyn_strides}


@dataclass(frozen=True)
class StreamArg:
    name: str = "stream"

    def to_json(self) -> dict:
        return {"kind": "stream", "name": self.name}


def lce_gemm_abi(ab_dtype: str, c_dtype: str) -> tuple:
    """ABI of the batched broadcast GEMM behind IKBO linear compression.

    c[l, m, n] = sum_k a[m, k] * b[l, k, n]  (+ d[idx[l], m, n] when the variant has an addend)
      a   (M, Ka)    ab_dtype   shared weight; Ka >= K, columns >= K are zero
      b   (L, K, N)  ab_dtype   per-batch embeddings, N contiguous
      c   (L, M, N)  c_dtype    output, N contiguous
      d   (U, M, N)  float32    per-user partial result (ignored without addend)
      idx (L,)       int32      batch -> user row of d (ignored without addend)
    """
    return (
        TensorArg("a", ab_dtype, 2, align=8),
        TensorArg("b", ab_dtype, 3, align=8),
        TensorArg("c", c_dtype, 3, align=16 // DTYPE_BYTES[c_dtype]),
        TensorArg("d", "float32", 3, align=4),
        TensorArg("idx", "int32", 1, align=1),
        StreamArg(),
    )


def ikbo_attention_abi(dtype: str) -> tuple:
    """ABI of IKBO candidate-over-user attention (one head dim per compiled variant).

    Rows r index (candidate, seed) pairs: r = b * n_seed + s. A user's candidates are
    contiguous, so its query rows form one contiguous range; the work list cuts every
    user's range into chunks of at most ``block_m`` rows (config), never mixing users.
      q     (R, H, D)        dtype    queries, D contiguous
      k, v  (U, S, H, D)     dtype    per-user keys/values, padded to S = S_max
      kv_len (U,)            int32    valid keys of each user (0..S)
      work  (W, 3)           int32    (user, row_begin, row_end) per chunk; user < 0: skip
      scale (1,)             float32  softmax scale
      out   (R, H, D)        dtype
      lse   (R, H)           float32  natural-log log-sum-exp of the scaled scores
    """
    return (
        TensorArg("q", dtype, 3, align=8),
        TensorArg("k", dtype, 4, align=8),
        TensorArg("v", dtype, 4, align=8),
        TensorArg("kv_len", "int32", 1, align=1),
        TensorArg("work", "int32", 2, align=1),
        TensorArg("scale", "float32", 1, align=1),
        TensorArg("out", dtype, 3, align=8),
        TensorArg("lse", "float32", 2, align=1),
        StreamArg(),
    )
