"""Device code shared by the sm90 BGMV bin kernels (shrink and expand): keeping a bin list's
remainder after its full groups ran, and the base pointer of a bin's weight slab. The pairs
are collected by kernels/_bin_scan.py: scan_round (shared with the Ada design)."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def keep_remainder(slist: cute.Tensor, nl: cutlass.Int32, ng: cutlass.Int32,
                   G: cutlass.Constexpr, tidx: cutlass.Int32):
    """After the ng full groups of G pairs were processed: move the remaining nl - ng * G
    (< G <= threads) list entries to the front; returns their count."""
    rem = nl - ng * G
    if ng > 0:
        mv = cutlass.Int32(0)
        if tidx < rem:
            mv = slist[ng * G + tidx]
        cute.arch.sync_threads()
        if tidx < rem:
            slist[tidx] = mv
        cute.arch.sync_threads()
    return rem


def slab_ptr(w: cute.Tensor, l_b, e_b, vec: int):
    """Base pointer of the (adapter, expert) slab w[l_b, e_b] of an [L, E, rows, cols] weight
    tensor. The bin kernels address a slab's rows from it with 32-bit offsets (prepare time
    rejects slabs of 2^31 elements or more) instead of indexing the 4-mode tensor per copy."""
    return w.iterator + cute.assume(cutlass.Int64(l_b) * cutlass.Int64(w.stride[0])
                                    + cutlass.Int64(e_b) * cutlass.Int64(w.stride[1]),
                                    divby=vec)

