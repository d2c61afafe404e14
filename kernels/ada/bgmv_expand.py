"""Ada design of the MoE-LoRA expand (sm_80 / sm_89; also built for sm_90a to run on an H200).

The sm90 kernel (kernels/sm90/bgmv_expand.py: pair schedule, bin schedule + fixed-order
finalize pass) built without PDL (sm_80 / sm_89 have no griddepcontrol) and within Ada's
99 KB of shared memory per block; see kernels/ada/bgmv_shrink.py. Same chains, same bits as
the sm90 design. A plan's expand is the stand-alone kernel: the sm90 plan's staged builds
exist to start beside the shrink (PDL), and its one-item-per-CTA R <= 32 build, built
without PDL, spills a register in the finalize variant on sm_90a.
"""
from __future__ import annotations

from dataclasses import dataclass

from kernels.ada.bgmv_shrink import NOT_ADA
from kernels.sm90 import bgmv_expand as _sm90
from kernels.sm90.bgmv_expand import BgmvExpandSm90, BgmvExpandSm90Config

SASS_REQUIRED = _sm90.SASS_REQUIRED
SASS_FORBIDDEN = _sm90.SASS_FORBIDDEN + NOT_ADA

SMEM_LIMIT_BYTES = 99 * 1024


@dataclass(frozen=True)
class BgmvExpandAdaConfig(BgmvExpandSm90Config):
    """BgmvExpandSm90Config without PDL, and the bin kernel at 3 CTAs per SM: at 4 (a
    128-register bound) sm_80 / sm_89's ptxas spills it where sm_90a's does not."""

    bin_ctas_per_sm: int = 3
    pdl: bool = False
    bin_pdl: bool = False


class BgmvExpandAda(BgmvExpandSm90):
    SMEM_LIMIT = SMEM_LIMIT_BYTES

    def __init__(self, dtype, finalize: bool, config: BgmvExpandAdaConfig = BgmvExpandAdaConfig()):
        super().__init__(dtype, finalize, config)

    @classmethod
    def can_implement(cls, dtype, config: BgmvExpandSm90Config) -> bool:
        return not (config.pdl or config.bin_pdl) and super().can_implement(dtype, config)
