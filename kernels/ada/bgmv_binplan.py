"""Ada design of the MoE-LoRA plan kernel for large batches (shrink and expand of one
(adapter, expert) bin in one CTA, one launch): the sm90 kernel (kernels/sm90/bgmv_binplan.py),
which uses no PDL, within Ada's 99 KB of shared memory per block. Same bits as the two-kernel
path and as the sm90 design.
"""
from __future__ import annotations

from dataclasses import dataclass

from kernels.ada.bgmv_shrink import NOT_ADA
from kernels.sm90 import bgmv_binplan as _sm90
from kernels.sm90.bgmv_binplan import BgmvBinPlanSm90, BgmvBinPlanSm90Config

SASS_REQUIRED = _sm90.SASS_REQUIRED
SASS_FORBIDDEN = _sm90.SASS_FORBIDDEN + NOT_ADA

SMEM_LIMIT_BYTES = 99 * 1024


@dataclass(frozen=True)
class BgmvBinPlanAdaConfig(BgmvBinPlanSm90Config):
    """BgmvBinPlanSm90Config (~54 KB of rings per CTA) at 3 CTAs per SM and without the small
    shape: at the sm90 bounds (4 x 4 warps, 8 x 2 warps: 128 registers) sm_80 / sm_89's ptxas
    spills both, and the small shape still spills at 6 CTAs per SM (168 registers). Nor the
    sm90 design's wide shape (many pairs per bin): not measured for this design.
    With the small-batch kernel (pair_max_pairs): without PDL the design's two pair kernels
    run one after the other, and one launch was faster on the H200 up to one wave of its
    CTAs (see BgmvBinPlanSm90Config.pair_max_pairs; perf/results/ab_bgmv_small_h200.json)."""

    bin_ctas_per_sm: int = 3
    small_per_bin: int = 0
    wide_min_per_bin: int = 0
    pair_max_pairs: int = 96


class BgmvBinPlanAda(BgmvBinPlanSm90):
    SMEM_LIMIT = SMEM_LIMIT_BYTES

    def __init__(self, dtype, finalize: bool, config: BgmvBinPlanAdaConfig = BgmvBinPlanAdaConfig()):
        super().__init__(dtype, finalize, config)
