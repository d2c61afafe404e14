"""The W4A16 SwiGLU MLP block of decode in one launch (cutekern.w4a16.w4a16_mlp, the Ada
design built for sm_90a: kernels/ada/w4a16_mlp.py) against what a user would otherwise run in
the same process:
- the same W4A16 GEMMs as separate launches: w4a16_linear(x, gate + up) (one N = 2F GEMM),
  torch silu * mul, w4a16_linear(h, down);
- the 16-bit dense weights through torch: matmul, silu * mul, matmul (cuBLAS).

Qwen3-1.7B's MLP (hidden 2048, intermediate 6144) at batch 1 / 4 / 8 / 16, bf16, group 128,
CUDA-graph replays after an L2 flush (perf/common.py). Reported per case: times, ratios,
achieved GB/s of the W4A16 bytes (codes + scales of the three weights + x + out) against the
measured copy ceiling, and every route's rel. error against float64."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_w4a16 import BATCHES, GROUP, rel_err  # noqa: E402
from common import measured_ceilings, time_graph_ms, write_results  # noqa: E402

from cutekern.reference import w4a16_dequantize, w4a16_quantize  # noqa: E402
from cutekern.w4a16 import (prepare_w4a16, prepare_w4a16_mlp, w4a16_linear,  # noqa: E402
                            w4a16_mlp)

HIDDEN, INTER = 2048, 6144   # Qwen3-1.7B


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="5 reps, batches 1 and 16")
    args = ap.parse_args()
    batches = BATCHES if not args.quick else (1, 16)
    if args.quick:
        args.reps = 5
    dt = torch.bfloat16
    ceil = measured_ceilings()
    print(f"ceilings: {ceil}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = {}
    for name, (n, k) in {"gate": (INTER, HIDDEN), "up": (INTER, HIDDEN),
                         "down": (HIDDEN, INTER)}.items():
        w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(dt)
        q[name] = w4a16_quantize(w, GROUP)
    prep = {n: prepare_w4a16(*q[n], GROUP) for n in q}
    mlp = prepare_w4a16_mlp(prep["gate"], prep["up"], prep["down"])
    # the separate-launch route's gate + up as one weight (rows gate then up)
    gu = prepare_w4a16(torch.cat([q["gate"][0], q["up"][0]], 1),
                       torch.cat([q["gate"][1], q["up"][1]], 1), GROUP)
    d64 = {n: w4a16_dequantize(*q[n], GROUP, torch.float64) for n in q}
    w16_gu = torch.cat([d64["gate"], d64["up"]], 0).to(dt).contiguous()
    w16_d = d64["down"].to(dt).contiguous()
    nbytes_w = sum(n * k // 2 + (k // GROUP) * n * 2 for n, k in
                   ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)))
    cases = []
    for m in batches:
        x = torch.randn(m, HIDDEN, device="cuda", generator=g).to(dt)
        out = torch.empty(m, HIDDEN, device="cuda", dtype=dt)
        h = torch.empty(m, INTER, device="cuda", dtype=dt)
        y_gu = torch.empty(m, 2 * INTER, device="cuda", dtype=dt)
        out2 = torch.empty(m, HIDDEN, device="cuda", dtype=dt)

        def ours():
            w4a16_mlp(x, mlp, out=out, h=h)

        def separate():
            w4a16_linear(x, gu, out=y_gu)
            hh = torch.nn.functional.silu(y_gu[:, :INTER]) * y_gu[:, INTER:]
            w4a16_linear(hh, prep["down"], out=out2)

        def dense():
            a = torch.matmul(x, w16_gu.t())
            return torch.matmul(torch.nn.functional.silu(a[:, :INTER]) * a[:, INTER:], w16_d.t())

        xd = x.double()
        ref = (torch.nn.functional.silu(xd @ d64["gate"].t()) * (xd @ d64["up"].t())) \
            @ d64["down"].t()
        ours()
        separate()
        yd = dense()
        torch.cuda.synchronize()
        errs = dict(ck=rel_err(out, ref), separate=rel_err(out2, ref), dense=rel_err(yd, ref))
        t_ours = time_graph_ms(ours, reps=args.reps)
        t_sep = time_graph_ms(separate, reps=args.reps)
        t_dense = time_graph_ms(dense, reps=args.reps)
        nbytes = nbytes_w + m * HIDDEN * 2 * 2
        gbps = nbytes / t_ours / 1e6
        case = dict(batch=m, hidden=HIDDEN, intermediate=INTER, dtype="bfloat16", group=GROUP,
                    ck_graph_ms=t_ours, separate_graph_ms=t_sep, dense_graph_ms=t_dense,
                    ratio_vs_separate=t_sep / t_ours, ratio_vs_dense=t_dense / t_ours,
                    w4a16_bytes=nbytes, ck_gbps=gbps, frac_copy_ceiling=gbps / ceil["copy_gbps"],
                    rel_err=errs)
        cases.append(case)
        print(f"mlp m={m:2d}: one launch {t_ours * 1e3:7.2f} us  separate {t_sep * 1e3:7.2f} us "
              f"({case['ratio_vs_separate']:.2f}x)  dense {t_dense * 1e3:7.2f} us "
              f"({case['ratio_vs_dense']:.2f}x)  {gbps:6.0f} GB/s "
              f"({case['frac_copy_ceiling']:.0%})  err {errs}", flush=True)
    path = write_results("w4a16_mlp", cases, args.out, extra={"ceilings": ceil})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
