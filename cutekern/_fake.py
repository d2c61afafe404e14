"""Fake (tensor-free) arguments for compiling an entry from its ABI. Needs the DSL."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor, make_fake_stream

from .abi import DTYPE_BYTES, ScalarArg, StreamArg, TensorArg

_DSL_DTYPES = {
    "float16": cutlass.Float16,
    "bfloat16": cutlass.BFloat16,
    "float32": cutlass.Float32,
    "int32": cutlass.Int32,
}


def dsl_dtype(name: str):
    return _DSL_DTYPES[name]


def fake_arg(arg):
    if isinstance(arg, StreamArg):
        return make_fake_stream()
    if isinstance(arg, ScalarArg):
        return _DSL_DTYPES[arg.dtype](0)
    assert isinstance(arg, TensorArg)
    shape = tuple(cute.sym_int() for _ in range(arg.rank))
    stride = tuple(cute.sym_int(64, divisibility=arg.align) for _ in range(arg.rank - 1)) + (1,)
    return make_fake_tensor(_DSL_DTYPES[arg.dtype], shape, stride,
                            assumed_align=max(4, arg.align * DTYPE_BYTES[arg.dtype]))


def fake_args(abi) -> list:
    return [fake_arg(a) for a in abi]
