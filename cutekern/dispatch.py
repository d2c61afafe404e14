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

from .arch import target_arch, target_design
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


def get_function(op: str, dtypes: dict, flags: dict, device=None) -> KernelFunction:
    arch = target_arch(device)
    design = target_design(arch)
    dt = tuple(dtypes.items())
    fl = tuple(flags.items())
    root = os.environ.get(ENV_ARTIFACTS)
    if root:
        return _manifest(root).function(op, design, arch, dt, fl)
    if dsl_available():
        from .registry import KernelKey, default_config
        return _jit_function(KernelKey(op, design, arch, dt, fl, default_config(op, design)))
    raise CuteKernRuntimeError(
        f"no kernels for {op} on {arch}: set {ENV_ARTIFACTS} to an export directory "
        f"(`cutekern export`) or install nvidia-cutlass-dsl for JIT compilation")
