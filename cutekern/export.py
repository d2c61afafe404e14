"""Ahead-of-time export: every registered variant for every requested arch, on any machine.

Layout of an export directory:
    manifest.json                  one entry per variant (see ``Manifest`` in runtime.py)
    <arch>/<prefix>.o / .h / .sass   the object, its C header, its SASS listing
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

MANIFEST_VERSION = 1


class ExportError(RuntimeError):
    pass


def _build_many(keys):
    """Worker process: compile variants into the shared disk cache (each entry is published
    under a per-key lock by an atomic rename, so workers and the parent never collide).
    A failure is left for the serial pass of ``export``, which rebuilds and reports it."""
    from . import compile as ck
    for key in keys:
        try:
            ck.build(key, need_sass=True)
        except Exception:  # noqa: BLE001
            pass


def export_jobs() -> int:
    """Compile processes for an export: $CUTEKERN_EXPORT_JOBS, else one per core (max 8)."""
    env = os.environ.get("CUTEKERN_EXPORT_JOBS")
    if env:
        return max(1, int(env))
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else (os.cpu_count() or 1)))


def _prebuild(keys, jobs, log):
    """Compile the variants in ``jobs`` fresh interpreters first (one compile is one core's
    work for seconds to a minute); the serial pass of ``export`` then reads each from the
    cache. Subprocesses rather than multiprocessing: nothing depends on the caller's
    ``__main__`` being import-safe."""
    import pickle
    import subprocess
    import sys
    t0 = time.time()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent),
                                                      env.get("PYTHONPATH")]))
    procs = []
    for w in range(jobs):  # round robin: neighbouring keys (same op) cost about the same
        p = subprocess.Popen([sys.executable, "-c", "import pickle, sys; from cutekern.export "
                              "import _build_many; _build_many(pickle.load(sys.stdin.buffer))"],
                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=env)
        p.stdin.write(pickle.dumps(keys[w::jobs]))
        p.stdin.close()
        procs.append(p)
    rcs = [p.wait() for p in procs]
    log(f"compiled {len(keys)} variants in {jobs} processes in {time.time() - t0:.0f}s"
        + (f" (worker exit codes {rcs})" if any(rcs) else ""))


def export(arches, out_dir, *, ops=None, designs=None, overrides=None, flags=None,
           log=print, jobs=None) -> dict:
    from . import compile as ck
    from .registry import all_keys

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # flags: {flag: value} a variant must have to be exported (tuning runs; None: all)
    keys = [k for k in all_keys(arches, overrides=overrides, ops=ops)
            if (designs is None or k.design in designs)
            and all(dict(k.flags).get(f) == v for f, v in (flags or {}).items())]
    if not keys:
        raise ExportError(f"no variants registered for arches={arches} ops={ops} designs={designs}")
    entries, failures = [], []
    t_all = time.time()
    jobs = export_jobs() if jobs is None else jobs
    todo = [k for k in keys if not ck._usable(ck.entry_dir(k), True)]  # cached: nothing to do
    if jobs > 1 and len(todo) > 1:
        _prebuild(todo, min(jobs, len(todo)), log)
    for i, key in enumerate(keys, 1):
        tag = f"[{i}/{len(keys)}] {key.arch:8s} {key.op} {key.design:5s} " \
              f"{'/'.join(v for _, v in key.dtypes)} {dict(key.flags)}"
        t0 = time.time()
        try:
            entry = ck.build(key, need_sass=True)
            meta = ck.read_meta(entry)
            sass = meta["sass"]
            if not sass.get("disassembled", True):
                raise ExportError("no SASS listing: install nvidia-cuda-nvdisasm (pip) or put "
                                  "nvdisasm on PATH")
            missing = sorted(set(sass["required"]) - set(sass["required_found"]))
            if missing or sass["forbidden_found"]:
                raise ExportError(f"SASS fingerprint check failed: missing {missing}, "
                                  f"forbidden present {sass['forbidden_found']}")
            dst = out / key.arch
            dst.mkdir(exist_ok=True)
            for ext in ("o", "h", "sass"):
                shutil.copyfile(entry / f"kernel.{ext}", dst / f"{key.prefix}.{ext}")
            meta.update(object=f"{key.arch}/{key.prefix}.o", header=f"{key.arch}/{key.prefix}.h")
            entries.append(meta)
            log(f"{tag}  ok  {time.time() - t0:5.1f}s  sass: {','.join(sass['required_found'])}")
        except Exception as e:  # keep going: report every failing variant at the end
            failures.append((tag, f"{type(e).__name__}: {e}"))
            log(f"{tag}  FAILED  {type(e).__name__}: {str(e)[:300]}")
    manifest = {"version": MANIFEST_VERSION, "dsl_version": ck.dsl_version(),
                "arches": list(arches), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "kernels": entries}
    tmp = out / ".manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, default=str))
    os.replace(tmp, out / "manifest.json")
    log(f"exported {len(entries)}/{len(keys)} variants to {out} in {time.time() - t_all:.0f}s")
    if failures:
        raise ExportError(f"{len(failures)} variant(s) failed:\n" +
                          "\n".join(f"  {t}: {e}" for t, e in failures))
    return manifest


def runtime_library_path() -> Path:
    """The DSL's C runtime library in the installed nvidia-cutlass-dsl (export side)."""
    import importlib.util
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None:
        raise ExportError("nvidia-cutlass-dsl is not installed")
    base = Path(list(spec.submodule_search_locations)[0])
    libs = sorted(base.glob("cu*/lib/libcute_dsl_runtime.so"))
    if not libs:
        raise ExportError(f"libcute_dsl_runtime.so not found under {base}")
    return libs[-1]


def bundle(out_dir, *, arches=("sm_90a",), log=print) -> Path:
    """A self-contained folder for a GPU machine without the DSL: the exported objects of
    every op for ``arches`` plus the runtime library (xz-compressed: the call limit is
    64 MiB and the library is 44 MB). ``cutekern selftest --bundle DIR`` runs from it."""
    import lzma
    out = Path(out_dir)
    export(arches, out, log=log)
    lib = runtime_library_path()
    (out / "lib").mkdir(exist_ok=True)
    with open(lib, "rb") as src, lzma.open(out / "lib" / (lib.name + ".xz"), "wb", preset=6) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    log(f"bundle {out}: {size / 2**20:.1f} MiB")
    if size > 60 * 2**20:
        raise ExportError(f"bundle is {size / 2**20:.1f} MiB, over the 60 MiB budget")
    return out
