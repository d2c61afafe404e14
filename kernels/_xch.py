"""Exchange of fp32 values between CTAs through global memory without flags, fences or resets:
one 8-byte word (seq << 32 | fp32 bits) stored relaxed at gpu scope is single-copy atomic, so a
reader that sees the sequence number it expects also sees the value. Sequence numbers only
grow (a writer stores the number of the current launch), so a stale word never matches.
Used by the AttnRes split kernels of the Ada design (kernels/sm90/attn_res.py, xchg_global) and
the BGMV small-batch plan kernel (kernels/sm90/bgmv_binplan.py); decode attention's splits
(kernels/ada/decode_attn.py) use the bit helpers with a fixed tag, cleared by the reader."""
from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm as _llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def f32_bits(val: Float32, *, loc=None, ip=None) -> Int32:
    return Int32(_llvm.bitcast(Int32.mlir_type, Float32(val).ir_value(loc=loc, ip=ip),
                               loc=loc, ip=ip))


@dsl_user_op
def bits_f32(bits: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(_llvm.bitcast(Float32.mlir_type, Int32(bits).ir_value(loc=loc, ip=ip),
                                 loc=loc, ip=ip))


@cute.jit
def xch_put(word: cute.Pointer, val: Float32, seq: Int32):
    """word <- (seq << 32 | fp32 bits of val), relaxed at gpu scope."""
    w = (Int64(seq) << 32) | (Int64(f32_bits(val)) & Int64(0xFFFFFFFF))
    cute.arch.store(word, w, sem="relaxed", scope="gpu")


@cute.jit
def xch_seq(word: cute.Pointer) -> Int32:
    """The sequence number of an exchange word."""
    return Int32(cute.arch.load(word, Int64, sem="relaxed", scope="gpu") >> 32)


@dsl_user_op
def globaltimer(*, loc=None, ip=None) -> Int64:
    """The GPU-wide nanosecond timer (comparable across SMs; debug timelines)."""
    from cutlass.cutlass_dsl import T
    return Int64(_llvm.inline_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l",
                                  has_side_effects=True, is_align_stack=False,
                                  asm_dialect=_llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def smid(*, loc=None, ip=None) -> Int32:
    from cutlass.cutlass_dsl import T
    return Int32(_llvm.inline_asm(T.i32(), [], "mov.u32 $0, %smid;", "=r",
                                  has_side_effects=True, is_align_stack=False,
                                  asm_dialect=_llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))
