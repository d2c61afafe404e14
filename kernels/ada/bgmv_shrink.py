"""Ada design of the MoE-LoRA shrink (sm_80 / sm_89; also built for sm_90a to run on an H200).

The sm90 kernel (kernels/sm90/bgmv_shrink.py) uses nothing an Ada SM lacks: 16-byte LDGs and
cp.async (LDGSTS) rings, warp ballots, and mma.sync m16n8k16 with fp32 accumulation (sm_80
and later). Its only sm_90 instruction is PDL's griddepcontrol, which a plan uses to start
the expand early; this design builds the same kernel without it and within Ada's 99 KB of
shared memory per block. So both schedules (pair and bin) and their arithmetic are the sm90
kernel's: the same chains, hence the same bits as the sm90 design (deterministic,
batch-invariant, no atomics; kernels/CONTRACT_BGMV.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from kernels.sm90 import bgmv_shrink as _sm90
from kernels.sm90.bgmv_shrink import BgmvShrinkSm90, BgmvShrinkSm90Config

# the sm90 kernel's fingerprints, and none of what Ada lacks: PDL (ACQBULK = griddepcontrol.wait,
# PREEXIT = launch_dependents), TMA, WGMMA
NOT_ADA = ("UTMALDG", "HGMMA", "ACQBULK", "PREEXIT")
SASS_REQUIRED = _sm90.SASS_REQUIRED
SASS_FORBIDDEN = _sm90.SASS_FORBIDDEN + NOT_ADA

SMEM_LIMIT_BYTES = 99 * 1024


@dataclass(frozen=True)
class BgmvShrinkAdaConfig(BgmvShrinkSm90Config):
    """BgmvShrinkSm90Config without PDL (sm_80 / sm_89 have no griddepcontrol) and without
    the staged pair build: its 4 CTAs per SM need 216 KB of an Ada SM's 100 KB of shared
    memory and 64 registers, which sm_89's ptxas cannot meet without spilling, and on the
    sm90 plan it pays off mainly by leaving room for the PDL expand."""

    pair_smem_min_items: int = 0
    pair_smem_wide_min_items: int = 0
    pdl: bool = False


class BgmvShrinkAda(BgmvShrinkSm90):
    SMEM_LIMIT = SMEM_LIMIT_BYTES

    def __init__(self, dtype, config: BgmvShrinkAdaConfig = BgmvShrinkAdaConfig()):
        super().__init__(dtype, config)

    @classmethod
    def can_implement(cls, dtype, config: BgmvShrinkSm90Config) -> bool:
        return not config.pdl and super().can_implement(dtype, config)
