"""Targets and dispatch. Import-light: no DSL, no torch at import time."""
from __future__ import annotations

import functools
import os

# every target we export, and the kernel design that serves it by default
ARCHES = ("sm_80", "sm_89", "sm_90a", "sm_100a", "sm_103a")
DEFAULT_DESIGN = {
    "sm_80": "ada", "sm_89": "ada",        # cp.async + mma.sync
    "sm_90a": "sm90",                       # TMA + WGMMA
    "sm_100a": "sm100", "sm_103a": "sm100",  # TMA + tcgen05 + TMEM
}
# designs each arch can host; the Ada design also builds for sm_90a (how it runs on an H200)
DESIGNS_FOR_ARCH = {
    "sm_80": ("ada",), "sm_89": ("ada",),
    "sm_90a": ("sm90", "ada"),
    "sm_100a": ("sm100",), "sm_103a": ("sm100",),
}
ENV_ARCH = "CUTEKERN_ARCH"      # override the dispatch target (trace any arch on a CPU box)
ENV_DESIGN = "CUTEKERN_DESIGN"  # force a design (e.g. "ada" on an H200)


def arch_from_capability(major: int, minor: int) -> str:
    if major == 8:
        # sm_80 SASS runs on 8.6/8.7 too; 8.9 has its own build
        return "sm_89" if minor >= 9 else "sm_80"
    if major == 9:
        return "sm_90a"
    if major == 10:
        return "sm_103a" if minor == 3 else "sm_100a"
    raise RuntimeError(f"cutekern: no kernels for compute capability {major}.{minor} "
                       f"(supported: 8.x, 9.0, 10.0, 10.3)")


def target_arch(device=None) -> str:
    """The arch to dispatch for: $CUTEKERN_ARCH if set, else the running device's."""
    env = os.environ.get(ENV_ARCH)
    if env:
        if env not in ARCHES:
            raise ValueError(f"{ENV_ARCH}={env!r} is not one of {ARCHES}")
        return env
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError(f"cutekern: no CUDA device; set {ENV_ARCH} to trace a target")
    major, minor = torch.cuda.get_device_capability(device)
    return arch_from_capability(major, minor)


@functools.lru_cache(maxsize=None)
def sm_count(device) -> int:
    """SMs of a CUDA device (index or torch.device; cached: asked on call paths)."""
    import torch
    return torch.cuda.get_device_properties(device).multi_processor_count


def target_design(arch: str) -> str:
    env = os.environ.get(ENV_DESIGN)
    if env:
        if env not in DESIGNS_FOR_ARCH[arch]:
            raise ValueError(f"{ENV_DESIGN}={env!r} cannot run on {arch} "
                             f"(choices: {DESIGNS_FOR_ARCH[arch]})")
        return env
    return DEFAULT_DESIGN[arch]


def parse_arches(spec: str) -> tuple:
    if spec == "all":
        return ARCHES
    out = tuple(s.strip() for s in spec.split(",") if s.strip())
    bad = [a for a in out if a not in ARCHES]
    if bad:
        raise ValueError(f"unknown arch(es) {bad}; choose from {ARCHES} or 'all'")
    return out
