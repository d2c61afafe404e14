"""L2 residency hints (inline PTX: the DSL takes a cache policy on its R2G copies but has no
createpolicy or discard). Used by the sm90 BGMV expand: its fp32 per-pair workspace is written
by one kernel and read once by the next; kept in L2 (evict_last) and discarded after the read,
it never needs to reach DRAM when it fits."""
from __future__ import annotations

from cutlass import Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def l2_policy(evict_last: bool, *, loc=None, ip=None) -> Int64:
    """A 64-bit L2 cache policy for the copies' cache_policy field: every access it tags gets
    the evict_last (else evict_normal) priority."""
    prio = "evict_last" if evict_last else "evict_normal"
    v = llvm.inline_asm(T.i64(), [], f"createpolicy.fractional.L2::{prio}.b64 $0, 1.0;", "=l",
                        has_side_effects=False, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return Int64(v)


@dsl_user_op
def l2_discard(addr, *, loc=None, ip=None):
    """Drop the 128-byte L2 line at global address addr (128-byte aligned) without writing it
    back: its data is dead (read for the last time by this CTA)."""
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)], "discard.global.L2 [$0], 128;",
                    "l,~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
