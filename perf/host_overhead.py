"""Host (CPU) time per call of the public APIs on the GPU box, and where it goes.

Eager calls are only as fast as the host can issue them: time_ms in the benchmarks includes
whatever the host spends after the L2 flush is queued. This script issues N calls back to
back without syncing (so the GPU never stalls the host) and reports microseconds of host
time per call, plus a cProfile of the calls (top entries by cumulative time).

    CUTEKERN_ARTIFACTS=.bundle python3 perf/host_overhead.py --out DIR
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def per_call_us(fn, n=200) -> float:
    import torch
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * t / n


def profile(fn, n=200, top=25) -> str:
    import torch
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def cases():
    import torch
    from common import lce_problem
    from cutekern.ikbo import LinearCompression
    from cutekern.reference import pad_k
    out = {}
    # LCE: a small batch so the GPU outruns the host (the host path is shape-independent)
    wc, wu, ec, eu, c2u = lce_problem(64, 8, torch.bfloat16)
    lce = LinearCompression(wc, wu)
    buf = torch.empty(ec.shape[0], wc.shape[0], ec.shape[2], dtype=wc.dtype, device="cuda")
    out["lce_call_out"] = lambda: lce(ec, eu, c2u, out=buf, check_indices=False)
    out["lce_call_alloc"] = lambda: lce(ec, eu, c2u, check_indices=False)
    from cutekern.ikbo import _launch
    wcp, wup = pad_k(wc), pad_k(wu)
    out["lce_launch_only"] = lambda: _launch(wcp, wup, ec, eu, c2u, buf, check=False)
    plan = lce.plan(ec, eu, c2u, buf)
    out["lce_plan_run"] = plan.run
    # the other ops' bound paths, for comparison
    from bench_bgmv_moe import problem
    from cutekern.bgmv_moe import prepare_bgmv_moe
    x, a, b, ids, w, lora = problem(8, 2688, 32, 128, 6, 8)
    bp = prepare_bgmv_moe(x, a, b, ids, w, lora)
    out["bgmv_plan_run"] = bp.run
    from cutekern.attn_res import prepare_attn_res
    bf = torch.bfloat16
    pre, dl, bl = (torch.randn(4, 7168, device="cuda").to(bf), torch.randn(4, 7168, device="cuda").to(bf),
                   torch.randn(4, 8, 7168, device="cuda").to(bf))
    ones = torch.ones(7168, device="cuda", dtype=bf)
    ar = prepare_attn_res(pre, dl, bl, ones, ones, ones, torch.empty_like(pre), num_blocks=8)
    out["attn_res_launch"] = ar.launch
    # KDA (perf/results/kda_host_h200.json has the 27th session's A/Bs: 180-560 us of host
    # time per call on the H200's host, the runtime's per-argument check a large part of it
    # before the op skipped it): a short sequence (the GPU outruns the host), then one long
    # chain, which the op splits (its extra launches)
    from bench_kda import problem as kda_problem, run_ours as kda_call
    p1 = kda_problem([512], 8, seed=0)
    out["kda_call"] = lambda: kda_call(p1)
    p2 = kda_problem([16384], 1, seed=0)
    out["kda_call_split"] = lambda: kda_call(p2)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--n", type=int, default=200)
    a = ap.parse_args()
    res, prof = {}, []
    for name, fn in cases().items():
        res[name] = round(per_call_us(fn, a.n), 1)
        print(f"{name:20s} {res[name]:8.1f} us host per call", flush=True)
        prof.append(f"==== {name}\n" + profile(fn, a.n))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "host_overhead.json").write_text(json.dumps(res, indent=1))
    (a.out / "host_overhead_profile.txt").write_text("\n".join(prof))


if __name__ == "__main__":
    main()
