"""Pieces the Ada design's tensor-core kernels share (ikbo_attn, kda_chain, kda_intra):
the swizzled shared-memory row atom, the 16-byte row copies and the ldmatrix atoms that go
with it, and the row / column view of an mma.sync accumulator. Traced inline (plain
Python over DSL objects)."""
from __future__ import annotations

import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp


def row_atom():
    """Shared-memory rows in 64-element (128 B, 16-bit) segments; the XOR swizzle puts the 8
    rows one ldmatrix reads (and one cp.async pass writes) on distinct bank groups. Tile it
    to a shape with ``cute.tile_to_shape``."""
    return cute.make_composed_layout(
        cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))


def row_copy(op, dtype, num_threads):
    """16-byte vectors of 8 elements, 8 threads along each 64-column segment of a row.
    ``op``: "g2s" (cp.async, cached in L2 only) or "universal" (plain loads / stores)."""
    atom_op = (cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL) if op == "g2s"
               else cute.nvgpu.CopyUniversalOp())
    return cute.make_tiled_copy_tv(
        cute.make_copy_atom(atom_op, dtype, num_bits_per_copy=128),
        cute.make_layout((num_threads // 8, 8), stride=(8, 1)), cute.make_layout((1, 8)))


def ldsm(dtype, transpose):
    """ldmatrix .x4 (four 8 x 8 16-bit matrices); transposed for operands stored with the
    MMA's M / N mode contiguous."""
    return cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=transpose, num_matrices=4), dtype)


def mn_view(acc):
    """((2, 2), MMA_M, MMA_N) accumulator -> ((2, MMA_M) rows, (2, MMA_N) cols) view."""
    lay = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def smem_operand(thr_mma, s2r, tidx, s_tile, which):
    """An mma.sync operand read from shared memory through ldmatrix: (copy, the thread's
    shared-memory view, its register fragment, the fragment as the copy sees it). ``which``:
    "A" or "B". Build once where the tile stays put; ``gemm_smem`` runs the product."""
    if which == "A":
        frag = thr_mma.make_fragment_A(thr_mma.partition_A(s_tile))
    else:
        frag = thr_mma.make_fragment_B(thr_mma.partition_B(s_tile))
    thr = s2r.get_slice(tidx)
    return s2r, thr.partition_S(s_tile), frag, thr.retile(frag)


def gemm_smem(tiled_mma, acc, a, b):
    """acc += A B^T over the operands' reduction mode, k-block by k-block (a Python loop:
    unrolled in the trace); ``a``, ``b`` from ``smem_operand``."""
    s2r_a, sa, ra, ra_v = a
    s2r_b, sb, rb, rb_v = b
    for kb in range(cute.size(ra, mode=[2])):
        cute.copy(s2r_a, sa[None, None, kb], ra_v[None, None, kb])
        cute.copy(s2r_b, sb[None, None, kb], rb_v[None, None, kb])
        cute.gemm(tiled_mma, acc, ra[None, None, kb], rb[None, None, kb], acc)
