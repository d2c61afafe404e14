"""Pick the compiled function for an op on the current target.

Two sources, one launch path (the DSL-free runtime):
* AOT: ``$CUTEKERN_ARTIFACTS`` names an export directory (``cutekern export``/``bundle``);
* JIT: with nvidia-cutlass-dsl installed, compile on first use into the on-disk cache
  (``cutekern.compile``) and load that object the same way.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

from .arch import DESIGNS_FOR_ARCH, ENV_ARCH, ENV_DESIGN, target_arch, target_design
from .runtime import CuteKernRuntimeError, KernelFunction, Manifest, _library

ENV_ARTIFACTS = "CUTEKERN_ARTIFACTS"


@functools.lru_cache(maxsize=None)
def _manifest(root: str) -> Manifest:
    return Manifest(root)


@functools.lru_cache(maxsize=None)
def _jit_function(key) -> KernelFunction:
    from . import compile as ck
    entry = ck.build(key)
    meta = ck.read_meta(entry)
    return KernelFunction(meta, Path(entry) / "kernel.o", _library(None))


def dsl_available() -> bool:
    return importlib.util.find_spec("cutlass") is not None


def env_key() -> tuple:
    """The environment overrides a cached kernel lookup depends on."""
    return (os.environ.get(ENV_ARCH), os.environ.get(ENV_DESIGN), os.environ.get(ENV_ARTIFACTS))


def get_function(op: str, dtypes: dict, flags: dict, device=None, design=None) -> KernelFunction:
    """The compiled function for (op, dtypes, flags) on ``device``'s target. Cached per
    (device, environment overrides): this sits on every call's host path. ``design``: an op's
    own per-shape choice among the designs the target hosts; $CUTEKERN_DESIGN still wins."""
    env = env_key()
    dev = getattr(device, "index", device)
    return _cached_function(op, tuple(dtypes.items()), tuple(flags.items()), dev, env,
                            None if env[1] else design)


def resolve_key(op: str, dtypes: dict, flags: dict, device=None, design=None):
    """The KernelKey the dispatcher compiles for this target (honours $CUTEKERN_ARCH and
    $CUTEKERN_DESIGN, so any arch's kernel can be traced and compiled on a CPU box)."""
    from .registry import KernelKey, default_config
    arch = target_arch(device)
    design = design or target_design(arch)
    return KernelKey(op, design, arch, tuple(dtypes.items()), tuple(flags.items()),
                     default_config(op, design))


@functools.lru_cache(maxsize=256)
def _cached_function(op, dt, fl, device, env, design=None) -> KernelFunction:
    arch = target_arch(device)
    if design is not None:
        from .registry import OPS
        hosted = DESIGNS_FOR_ARCH[arch] + (OPS[op].extra_designs_on(arch) if op in OPS else ())
        if design not in hosted:
            raise ValueError(f"design {design!r} cannot run on {arch} (choices: {hosted})")
    design = design or target_design(arch)
    root = env[2]
    if root:
        return _manifest(root).function(op, design, arch, dt, fl)
    if dsl_available():
        return _jit_function(resolve_key(op, dict(dt), dict(fl), device, design))
    raise CuteKernRuntimeError(
        f"no kernels for {op} on {arch}: set {ENV_ARTIFACTS} to an export directory "
        f"(`cutekern export`) or install nvidia-cutlass-dsl for JIT compilation")
