"""Warp-level tensor-core dot products (mma.sync m16n8k16, fp32 accumulate) for the skinny
products of the memory-bound kernels (BGMV shrink / expand on sm90: M = a handful of pairs,
N = a LoRA rank or an output chunk, so WGMMA's 64-row tiles would mostly idle).

Fragment convention ("permuted k"). A dot product sums over k, so any assignment of k
positions to the instruction's k slots gives the same mathematical result as long as both
operands use the same one. We pick the one that lets every lane fill its registers with ONE
16-byte load per row and 32-element k block:
    lane = 4 * g + q (g = lane >> 2 picks the row of A / the column of B, q = lane & 3),
    lane loads elements 8q .. 8q+7 of the k block (a 16-byte vector) as 32-bit words w0..w3,
    step 0 of the block uses w0 (slots 2q, 2q+1) and w1 (slots 2q+8, 2q+9),
    step 1 uses w2 and w3 the same way.
So the same k element meets the same slot of the same instruction whether a row came from
global memory, shared memory, or sits in row 0 or row 11 of the tile: the fp32 result of a
row depends only on that row's data and the chain of instructions, which is what makes a
schedule with one live row (small batches) bit-identical to one with sixteen (large ones).
C / D: c0, c1 = D[g][2q, 2q+1], c2, c3 = D[g+8][2q, 2q+1].
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def mma_16816(a, b, c, bf16: bool, *, loc=None, ip=None):
    """D = A B + C for one m16n8k16 tile: a = 4 Int32 words (rows g / g+8, slots 2q.. / 2q+8..),
    b = 2 Int32 words, c = 4 Float32; returns the 4 Float32 of D (same positions as c)."""
    ty = "bf16" if bf16 else "f16"
    ops = [Int32(v).ir_value(loc=loc, ip=ip) for v in a] \
        + [Int32(v).ir_value(loc=loc, ip=ip) for v in b] \
        + [Float32(v).ir_value(loc=loc, ip=ip) for v in c]
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32(), T.f32(), T.f32(), T.f32()]),
        ops,
        f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


def words(frag):
    """A register tensor of 8 16-bit floats (one 16-byte vector) -> its 4 32-bit words."""
    w = frag.load().bitcast(Int32)
    return [w[i] for i in range(4)]


def mma_block(xa, xb, wv, acc, bf16: bool):
    """One 32-element k block (two chained m16n8k16 steps) in the permuted-k convention:
    xa / xb = the 4 words of the A rows g / g+8, wv = the 4 words of the B column g,
    acc = a register tensor of 4 fp32 accumulators, updated in place (a tensor, not a
    Python list: the update may sit inside a traced branch)."""
    c = [acc[i] for i in range(4)]
    d = mma_16816([xa[0], xb[0], xa[1], xb[1]], [wv[0], wv[1]], c, bf16)
    d = mma_16816([xa[2], xb[2], xa[3], xb[3]], [wv[2], wv[3]], d, bf16)
    for i in range(4):
        acc[i] = d[i]


def zero_unless(w, ok):
    """The words w where ok, else zeros (a select per word: no branch around the load)."""
    return [Int32(cutlass.select_(ok, v, Int32(0))) for v in w]


def is_bf16(dtype) -> bool:
    return dtype is cutlass.BFloat16


def all_loaded(frags, zmask):
    """An Int32 that is 0 at run time (zmask must be 0 there, opaque to the compiler) but
    depends on every word of the register tensors `frags`. OR-ing it into the first mma's
    operand keeps all their loads in flight before the chain: without it ptxas sinks each
    16-byte load down to its mma.sync, one memory round trip per k block. (An XOR tree, not
    a chain: it sits on the critical path between the last load and the first mma.)"""
    vals = []
    for f in frags:
        w = f.load().bitcast(Int32)
        vals += [w[i] for i in range(cute.size(w.shape))]
    while len(vals) > 1:
        nxt = []
        for i in range(0, len(vals), 3):
            grp = vals[i:i + 3]
            v = grp[0]
            for w in grp[1:]:
                v = v ^ w
            nxt.append(v)
        vals = nxt
    return vals[0] & zmask
