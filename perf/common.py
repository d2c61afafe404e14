"""Timing and results helpers shared by the benchmarks (GPU only)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

_FLUSH = None


# How flush_l2 evicts the L2: "write" (zero a 256 MB buffer, as triton's do_bench does) leaves
# ~50 MB of dirty flush lines in the L2 that the timed kernel's loads must write back to DRAM;
# "read" (reduce over the buffer) leaves clean lines. perf/flush_study.py measures both.
FLUSH_MODE = os.environ.get("CUTEKERN_BENCH_FLUSH", "write")


def flush_l2():
    """Evict the L2 (60 MB on an H200) with a 256 MB buffer so every run starts cold."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.ones(256 * 2**20, dtype=torch.uint8, device="cuda")
    if FLUSH_MODE == "read":
        _FLUSH.view(torch.int32).max()
    elif FLUSH_MODE == "write":
        _FLUSH.zero_()
    elif FLUSH_MODE != "none":
        raise ValueError(f"CUTEKERN_BENCH_FLUSH={FLUSH_MODE!r}: expected write, read or none")


def time_ms(fn, reps=20, warmup=3) -> float:
    """Median device time of fn() over reps cold-L2 runs, with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush_l2()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """fn() recorded as a CUDA graph, after one warm-up run outside the capture (lazy loads,
    allocator)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_graph_ms(fn, reps=20) -> float:
    """Median device time of one CUDA-graph replay of fn() (host launch cost removed)."""
    g = capture_graph(fn)
    t = time_ms(g.replay, reps=reps)
    del g
    return t


def measured_ceilings() -> dict:
    """Dense fp16 matmul rate and device copy bandwidth, measured now on this GPU."""
    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.float16)
    y = torch.randn(n, n, device="cuda", dtype=torch.float16)
    t = time_ms(lambda: torch.mm(x, y), reps=10)
    src = torch.randn(2**30 // 4, device="cuda")
    dst = torch.empty_like(src)
    tc = time_ms(lambda: dst.copy_(src), reps=10)
    return {"matmul_fp16_tflops": 2 * n**3 / t / 1e9, "copy_gbps": 2 * src.numel() * 4 / tc / 1e6}


LCE_REF = dict(M=433, N=256, K_cand=866, K_user=1178)


def lce_problem(b, ratio, dtype, seed=0, M=433, N=256, K_cand=866, K_user=1178):
    """Random IKBO LCE inputs: b candidates, `ratio` per user (last user takes the rest),
    weights scaled so outputs are O(1). Returns (w_cand, w_user, e_cand, e_user, c2u)."""
    torch.manual_seed(seed)
    u = -(-b // ratio)
    counts = torch.full((u,), ratio)
    counts[-1] = b - ratio * (u - 1)
    c2u = torch.repeat_interleave(torch.arange(u), counts).to(torch.int32).cuda()
    mk = lambda *s, scale=1.0: (torch.randn(*s, device="cuda") * scale).to(dtype)  # noqa: E731
    return (mk(M, K_cand, scale=K_cand ** -0.5), mk(M, K_user, scale=K_user ** -0.5),
            mk(b, K_cand, N), mk(u, K_user, N), c2u)


def git_commit() -> str:
    """The commit the timed kernels came from: $CUTEKERN_GIT_COMMIT, else the COMMIT file of
    the artifacts bundle (a GPU box's copy of the repository may sit at another commit than
    the one the bundle was exported from), else the repository's HEAD."""
    env = os.environ.get("CUTEKERN_GIT_COMMIT")
    if env:
        return env
    bundle = os.environ.get("CUTEKERN_ARTIFACTS")
    p = Path(bundle) / "COMMIT" if bundle else None
    if p and p.exists():
        return p.read_text().strip()
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def write_results(op: str, cases: list, out_dir, extra: dict | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    doc = {
        "op": op, "device": props.name, "sm_count": props.multi_processor_count,
        "driver": torch.version.cuda, "torch": torch.__version__, "git_commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(extra or {}), "cases": cases,
    }
    path = out / f"{op}.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


def lce_phase_functions(man, design, m, ab="float16", arch="sm_90a", wide=True, narrow=True,
                        users=0, n=0, batch=0):
    """(user phase, candidate phase) kernels of an export for M rows, picked as the API picks
    them (cutekern.ikbo.pick_lce_function; the user phase's pick needs the users, N and the
    candidates); wide=False / narrow=False keep the default build."""
    from cutekern.ikbo import _lce_tiles, pick_lce_function
    exported = {f for e in man.data["kernels"] if e["op"] == "lce_gemm" and e["design"] == design
                for f in ("wide", "narrow") if f in e["flags"]}

    def phase(c, add, cand_tiles=0):
        def lookup(fl):  # an export with wide / narrow builds keys the default one False
            fl = {**{f: False for f in exported}, **fl}
            return man.function("lce_gemm", design, arch, {"ab": ab, "c": c}, fl)
        return pick_lce_function(lookup, add, m, wide and "wide" in exported,
                                 narrow and "narrow" in exported, users, n, None, cand_tiles)
    cand = phase(ab, True)
    return phase("float32", False, _lce_tiles(cand, m, n, batch)), cand
