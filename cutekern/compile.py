"""Tensor-free compilation of registered variants, cached in memory and on disk.

``build(key)`` returns the directory holding the exported object (``kernel.o``), its C
header (``kernel.h``), the SASS listing and ``meta.json``. Disk entries are keyed by
(arch, DSL version, source hash, KernelKey digest), written into a temporary directory and
renamed into place under a lock, so concurrent processes never see half an entry.
Needs the DSL (nvidia-cutlass-dsl); nothing here touches a tensor or a GPU.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .registry import OPS, KernelKey, abi_for

_PKG_ROOT = Path(__file__).resolve().parent
_REPO_ROOT = _PKG_ROOT.parent
# files whose text shapes generated code besides the kernel module itself (registry.py: the
# constructor arguments each op passes its kernel class)
_COMMON_SOURCES = ("abi.py", "_fake.py", "layout.py", "compile.py", "registry.py")


def cache_dir() -> Path:
    return Path(os.environ.get("CUTEKERN_CACHE_DIR",
                               Path.home() / ".cache" / "cutekern")).expanduser()


@functools.lru_cache(maxsize=None)
def dsl_version() -> str:
    from importlib.metadata import version
    return version("nvidia-cutlass-dsl")


@functools.lru_cache(maxsize=None)
def source_hash(op: str, design: str) -> str:
    impl = OPS[op].designs[design]
    origin = Path(importlib.util.find_spec(impl.module).origin)
    # other kernels whose device code this one runs, transitively (bgmv_binplan: the shrink's
    # and the expand's bin groups; the Ada design's BGMV kernels: the sm90 ones)
    kernels_root = origin.parent.parent
    mods, todo = [], [origin]
    while todo:
        p = todo.pop()
        if p in mods:
            continue
        mods.append(p)
        todo += [kernels_root / d / f"{m}.py" for d, m in re.findall(
            r"^from kernels\.(\w+)\.([a-z]\w*) import", p.read_text(), re.M)]
    # kernels/<design>/_*.py of every design those come from: device code shared by that
    # design's kernels; kernels/_*.py: shared by every design
    dirs = sorted({p.parent for p in mods}) + [kernels_root]
    helpers = sorted(p for d in dirs for p in d.glob("_*.py") if p.name != "__init__.py")
    h = hashlib.sha256()
    for p in [origin] + sorted(mods[1:]) + helpers + [_PKG_ROOT / f for f in _COMMON_SOURCES]:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def entry_dir(key: KernelKey) -> Path:
    return (cache_dir() / key.arch / f"dsl-{dsl_version()}"
            / f"{key.prefix}-{source_hash(key.op, key.design)}")


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _set_arch(arch: str):
    # CUTE_DSL_ARCH is read once at import; later switches go through the DSL's envar
    os.environ.setdefault("CUTE_DSL_ARCH", arch)
    from cutlass.cutlass_dsl import CuTeDSL
    CuTeDSL._get_dsl().envar.arch = arch


def _nvdisasm() -> str:
    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    try:
        import nvidia.cu13 as cu  # nvidia-cuda-nvdisasm wheel
        cand = Path(list(cu.__path__)[0]) / "bin" / "nvdisasm"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")


def disassemble(cubin: Path) -> str:
    out = subprocess.run([_nvdisasm(), "-c", str(cubin)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"nvdisasm failed on {cubin}: {out.stderr.strip()}")
    return out.stdout


def sass_opcodes(sass: str) -> set:
    """Opcode mnemonics (first token, with dotted modifiers dropped) in a SASS listing."""
    ops = set()
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass):
        ops.add(m.group(1))
    return ops


def instantiate(key: KernelKey):
    """The kernel object for a key (the design's class with the key's config)."""
    impl = OPS[key.op].designs[key.design]
    mod = importlib.import_module(impl.module)
    from ._fake import dsl_dtype
    cfg = getattr(mod, impl.config_class)(**dict(key.config))
    dts = {r: dsl_dtype(v) for r, v in key.dtypes}
    kcls = getattr(mod, impl.kernel_class)
    return OPS[key.op].make(kcls, dts, dict(key.flags), cfg), mod


def _compile_into(key: KernelKey, out: Path) -> dict:
    import cutlass.cute as cute
    from ._fake import fake_args

    _set_arch(key.arch)
    kern, mod = instantiate(key)
    dump = out / "dump"
    dump.mkdir()
    t0 = time.time()
    compiled = cute.compile(kern, *fake_args(abi_for(key)),
                            options=f"--gpu-arch {key.arch} --keep-cubin --dump-dir {dump}")
    seconds = time.time() - t0
    compiled.export_to_c(file_path=str(out), file_name="kernel", function_prefix=key.prefix)
    cubins = sorted(dump.glob("*.cubin"))
    if not cubins:
        raise RuntimeError(f"{key.prefix}: the compiler kept no cubin")
    try:
        sass = "\n".join(disassemble(c) for c in cubins)
        sass_ok = True
    except RuntimeError:
        # JIT users need no disassembler; export refuses such entries (see build)
        sass, sass_ok = "", False
    (out / "kernel.sass").write_text(sass)
    shutil.rmtree(dump)
    found = sass_opcodes(sass)
    # a kernel object may declare its own fingerprints (a variant with another fast path)
    required = tuple(getattr(kern, "sass_required", getattr(mod, "SASS_REQUIRED", ())))
    forbidden = tuple(getattr(kern, "sass_forbidden", getattr(mod, "SASS_FORBIDDEN", ())))
    meta = {
        **key.as_dict(), "prefix": key.prefix, "digest": key.digest,
        "dsl_version": dsl_version(), "source_hash": source_hash(key.op, key.design),
        "compile_seconds": round(seconds, 2),
        "sass": {"disassembled": sass_ok, "required": list(required), "forbidden": list(forbidden),
                 "required_found": [f for f in required if any(o.startswith(f) for o in found)],
                 "forbidden_found": [f for f in forbidden if f in found]},
        "abi": [a.to_json() for a in abi_for(key)],
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    return meta


_memory: dict = {}


def _usable(entry: Path, need_sass: bool) -> bool:
    meta = entry / "meta.json"
    if not meta.exists():
        return False
    return not need_sass or json.loads(meta.read_text())["sass"].get("disassembled", True)


def build(key: KernelKey, *, use_disk: bool = True, need_sass: bool = False) -> Path:
    """Compile (or fetch from cache) one variant; returns its entry directory.
    ``need_sass``: the entry must carry a SASS listing (export); a cached entry compiled
    where no disassembler was found is rebuilt."""
    if key in _memory and _usable(_memory[key], need_sass):
        return _memory[key]
    final = entry_dir(key)
    if use_disk and _usable(final, need_sass):
        _memory[key] = final
        return final
    with _locked(final.parent / (final.name + ".lock")):
        if not (use_disk and _usable(final, need_sass)):
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
            try:
                _compile_into(key, tmp)
                if final.exists():
                    shutil.rmtree(final)
                os.rename(tmp, final)  # atomic publish
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
    _memory[key] = final
    return final


def read_meta(entry: Path) -> dict:
    return json.loads((entry / "meta.json").read_text())
