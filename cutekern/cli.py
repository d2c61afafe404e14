"""Command line: ``cutekern {build,export,bundle,selftest,bench,report}``."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _gpu_present() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def cmd_export(args) -> int:
    from .arch import parse_arches
    from .export import ExportError, export
    try:
        export(parse_arches(args.arch), args.out,
               ops=args.ops.split(",") if args.ops else None)
    except (ExportError, ValueError) as e:
        print(f"cutekern export: FAILED\n{e}", file=sys.stderr)
        return 1
    return 0


def cmd_bundle(args) -> int:
    from .export import ExportError, bundle
    try:
        bundle(args.out)
    except ExportError as e:
        print(f"cutekern bundle: FAILED\n{e}", file=sys.stderr)
        return 1
    return 0


def _run(cmd, env=None) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.call([str(c) for c in cmd], cwd=REPO, env=env)


def cmd_bench(args) -> int:
    if not _gpu_present():
        print("cutekern bench: no CUDA device; skipping benchmarks")
        return 0
    out = Path(args.out or REPO / "perf" / "results")
    out.mkdir(parents=True, exist_ok=True)
    rc = 0
    for script in sorted((REPO / "perf").glob("bench_*.py")):
        extra = ["--quick"] if args.quick else []
        rc |= _run([sys.executable, script, "--out", out, *extra])
    return rc


def cmd_selftest(args) -> int:
    """On a GPU machine without the DSL: every op's GPU fuzz through the runtime, then the
    benchmarks; everything lands in --out (report.json, pytest log, perf JSON)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["CUTEKERN_ARTIFACTS"] = str(Path(args.bundle).resolve())
    env["CUTEKERN_REPORT"] = str(out / "report.json")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    rc = _run([sys.executable, "-m", "pytest", "-x" if args.fail_fast else "-q", "-q",
               "-p", "no:cacheprovider", "tests/gpu", "-rfE"], env=env)
    if not args.no_bench:
        for script in sorted((REPO / "perf").glob("bench_*.py")):
            rc |= _run([sys.executable, script, "--out", out] + (["--quick"] if args.quick else []), env=env)
    print(f"selftest finished rc={rc}; results in {out}")
    return rc


def cmd_build(args) -> int:
    """The main job: export every kernel for every arch; benchmarks when a GPU is present."""
    rc = cmd_export(argparse.Namespace(arch=args.arch, out=args.out, ops=None))
    if rc == 0 and _gpu_present():
        os.environ.setdefault("CUTEKERN_ARTIFACTS", str(Path(args.out).resolve()))
        rc = cmd_bench(argparse.Namespace(out=None, quick=False))
    return rc


def cmd_report(args) -> int:
    return _run([sys.executable, REPO / "perf" / "report.py"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="cutekern", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="export all kernels for all archs (+ benchmarks on a GPU)")
    b.add_argument("--arch", default="all")
    b.add_argument("--out", default="build/export")
    b.set_defaults(fn=cmd_build)
    e = sub.add_parser("export", help="cross-compile registered kernels; write objects + manifest")
    e.add_argument("--arch", default="all", help="comma list of sm_80,sm_89,sm_90a,sm_100a,sm_103a or 'all'")
    e.add_argument("--out", required=True)
    e.add_argument("--ops", default=None, help="comma list of ops (default: all)")
    e.set_defaults(fn=cmd_export)
    bu = sub.add_parser("bundle", help="sm_90a objects + runtime library for a GPU box without the DSL")
    bu.add_argument("--out", required=True)
    bu.set_defaults(fn=cmd_bundle)
    s = sub.add_parser("selftest", help="GPU fuzz + benchmarks through the runtime, from a bundle")
    s.add_argument("--bundle", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--quick", action="store_true")
    s.add_argument("--no-bench", action="store_true")
    s.add_argument("--fail-fast", action="store_true")
    s.set_defaults(fn=cmd_selftest)
    be = sub.add_parser("bench", help="run perf/bench_*.py (GPU only)")
    be.add_argument("--out", default=None)
    be.add_argument("--quick", action="store_true")
    be.set_defaults(fn=cmd_bench)
    r = sub.add_parser("report", help="perf/results/*.json -> README table + PNG")
    r.set_defaults(fn=cmd_report)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
