"""W4A16 GEMM of decode on one GPU: cutekern.w4a16.w4a16_linear (the Ada design, built for
sm_90a: kernels/ada/w4a16_gemm.py) against what a user would otherwise run in the same
process: the 16-bit dense weight through torch (cuBLAS GEMV / skinny GEMM), and the unfused
W4A16 route (dequantize the GPTQ storage to a 16-bit weight, then the same matmul).

Shapes: the linear layers of the megakernel's model (Qwen3-1.7B: qkv, o, gate + up, down, and
the LM head quantized as the spec's "W4A16 everywhere" variant) at batch 1 / 4 / 8 / 16,
bf16, group 128. CUDA-graph replays after an L2 flush (perf/common.py). Reported per case:
times, ratio = dense / ours (the spec's anchor: Marlin's ~3.87x over fp16 at batch 1, 4x the
bytes ratio), achieved GB/s of the W4A16 bytes (codes + scales + x + out) against the
measured copy ceiling, and the rel. error of both 16-bit routes against float64."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measured_ceilings, time_graph_ms, write_results  # noqa: E402

from cutekern.reference import w4a16_dequantize, w4a16_quantize  # noqa: E402
from cutekern.w4a16 import prepare_w4a16, w4a16_linear  # noqa: E402

# Qwen3-1.7B: hidden 2048, intermediate 6144, 16 q / 8 kv heads of 128, vocab 151936
SHAPES = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048),
          "down": (2048, 6144), "lm_head": (151936, 2048)}
BATCHES = (1, 4, 8, 16)
GROUP = 128


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--only", default="", help="comma-separated layer names")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="5 reps, qkv and the LM head only")
    args = ap.parse_args()
    if args.quick:
        args.reps = 5
        args.only = args.only or "qkv,lm_head"
    dt = torch.bfloat16
    ceil = measured_ceilings()
    print(f"ceilings: {ceil}", flush=True)
    cases = []
    names = [s for s in args.only.split(",") if s] or list(SHAPES)
    for name in names:
        n, k = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(n + k)
        w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(dt)
        qw, sc = w4a16_quantize(w, GROUP)
        del w
        prep = prepare_w4a16(qw, sc, GROUP)
        w16 = w4a16_dequantize(qw, sc, GROUP, dt).contiguous()      # [N, K] dense 16-bit
        w64 = None
        for m in BATCHES:
            x = torch.randn(m, k, device="cuda", generator=g).to(dt)
            out = torch.empty(m, n, device="cuda", dtype=dt)
            ours = lambda: w4a16_linear(x, prep, out=out)                       # noqa: E731
            dense = lambda: torch.matmul(x, w16.t())                           # noqa: E731
            unfused = lambda: torch.matmul(x, w4a16_dequantize(qw, sc, GROUP, dt).t())  # noqa: E731,E501
            if w64 is None and n * k <= 12288 * 2048:
                w64 = w4a16_dequantize(qw, sc, GROUP, torch.float64)
            ref = x.double() @ w64.t() if w64 is not None else None
            ours()
            torch.cuda.synchronize()
            err = rel_err(out, ref) if ref is not None else None
            err_dense = rel_err(dense(), ref) if ref is not None else None
            t_ours = time_graph_ms(ours, reps=args.reps)
            t_dense = time_graph_ms(dense, reps=args.reps)
            t_unf = time_graph_ms(unfused, reps=max(5, args.reps // 3)) if n * k <= 12288 * 2048 else None
            nbytes = n * k // 2 + (k // GROUP) * n * 2 + m * k * 2 + m * n * 2
            gbps = nbytes / t_ours / 1e6
            case = dict(layer=name, n=n, k=k, batch=m, dtype="bfloat16", group=GROUP,
                        ck_graph_ms=t_ours, dense_graph_ms=t_dense, unfused_graph_ms=t_unf,
                        ratio_vs_dense=t_dense / t_ours,
                        ratio_vs_unfused=(t_unf / t_ours) if t_unf else None,
                        w4a16_bytes=nbytes, ck_gbps=gbps, frac_copy_ceiling=gbps / ceil["copy_gbps"],
                        dense_gbps=(n * k * 2 + m * k * 2 + m * n * 2) / t_dense / 1e6,
                        ck_rel_err=err, dense_rel_err=err_dense)
            cases.append(case)
            print(f"{name:8s} N={n:6d} K={k:5d} m={m:2d}: ours {t_ours * 1e3:8.2f} us  dense "
                  f"{t_dense * 1e3:8.2f} us ({case['ratio_vs_dense']:.2f}x)  unfused "
                  f"{(t_unf or 0) * 1e3:8.2f} us  {gbps:7.0f} GB/s "
                  f"({case['frac_copy_ceiling']:.0%})  err {err} / dense {err_dense}", flush=True)
        del w16, w64, prep, qw, sc
        torch.cuda.empty_cache()
    path = write_results("w4a16", cases, args.out, extra={"ceilings": ceil})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
