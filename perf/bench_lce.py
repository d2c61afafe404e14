"""IKBO Linear Compression benchmark on one GPU: cutekern (sm90 and Ada designs) against the
routes a user would otherwise take, all timed in the same run with a cold L2, each both as
eager calls (host launch cost included) and as CUDA-graph replays.

useful TFLOP/s = 2*M*N*(B*K_cand + U*K_user) / t
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LCE_REF, lce_problem, measured_ceilings, time_graph_ms, time_ms, write_results  # noqa: E402

from cutekern.arch import DESIGNS_FOR_ARCH, target_arch  # noqa: E402
from cutekern.ikbo import LinearCompression  # noqa: E402
from cutekern.reference import (lce_broadcast_bmm, lce_decomposed,  # noqa: E402
                                lce_decomposed_padded, pad_k, pad_k_rows)

M, N, K_USER, K_CAND = LCE_REF["M"], LCE_REF["N"], LCE_REF["K_user"], LCE_REF["K_cand"]


def run_case(name, b, ratio, dtype, designs, reps):
    w_cand, w_user, e_cand, e_user, c2u = lce_problem(b, ratio, dtype)
    u = e_user.shape[0]
    flops = 2 * M * N * (b * K_CAND + u * K_USER)
    # strongest torch route: weights padded once, embeddings assumed produced K-padded
    # upstream (padding them here is not timed)
    wc_p, wu_p = pad_k(w_cand), pad_k(w_user)
    ec_p, eu_p = pad_k_rows(e_cand), pad_k_rows(e_user)
    lce = LinearCompression(w_cand, w_user)
    out = torch.empty(b, M, N, dtype=dtype, device="cuda")
    ref = lce_decomposed_padded(wc_p, wu_p, ec_p, eu_p, c2u).float()
    routes = {
        "broadcast_bmm": lambda: lce_broadcast_bmm(w_cand, w_user, e_cand, e_user, c2u),
        "decomposed": lambda: lce_decomposed(w_cand, w_user, e_cand, e_user, c2u),
        "decomposed_padded": lambda: lce_decomposed_padded(wc_p, wu_p, ec_p, eu_p, c2u),
    }
    timings, graph, errors = {}, {}, {}
    for r, fn in routes.items():
        timings[r] = time_ms(fn, reps=reps)
        graph[r] = time_graph_ms(fn, reps=reps)
    for d in designs:
        os.environ["CUTEKERN_DESIGN"] = d
        fn = lambda: lce(e_cand, e_user, c2u, out=out, check_indices=False)
        out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        errors[f"cutekern_{d}"] = float(((out.float() - ref).norm() / ref.norm()).item())
        timings[f"cutekern_{d}"] = time_ms(fn, reps=reps)
        graph[f"cutekern_{d}"] = time_graph_ms(fn, reps=reps)
    os.environ.pop("CUTEKERN_DESIGN", None)
    tflops = {k: flops / t / 1e9 for k, t in timings.items()}
    tflops_graph = {k: flops / t / 1e9 for k, t in graph.items()}
    ratios = {f"{k}_vs_{base}": timings[base] / timings[k]
              for k in timings if k.startswith("cutekern")
              for base in routes}
    return {"name": name, "shape": {"B": b, "ratio": ratio, "U": u, "M": M, "N": N,
                                     "K_cand": K_CAND, "K_user": K_USER, "dtype": str(dtype).split(".")[-1]},
            "timings_ms": timings, "tflops": tflops, "speedup": ratios,
            "graph_timings_ms": graph, "graph_tflops": tflops_graph,
            "rel_err_vs_decomposed_padded": errors}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    designs = [d for d in ("sm90", "ada") if d in DESIGNS_FOR_ARCH[target_arch()]]
    ceil = measured_ceilings()
    cases = [run_case("reference", 1024, 70, torch.float16, designs, args.reps)]
    sweep_b = [1024, 3072] if args.quick else [512, 1024, 2048, 3072]
    sweep_r = [2, 1000] if args.quick else [2, 5, 10, 50, 100, 1000]
    for b in sweep_b:
        for r in sweep_r:
            cases.append(run_case(f"sweep_B{b}_r{r}", b, r, torch.float16, designs, args.reps))
    cases.append(run_case("reference_bf16", 1024, 70, torch.bfloat16, designs, args.reps))
    for c in cases:
        c["fraction_of_matmul_ceiling"] = {k: v / ceil["matmul_fp16_tflops"] for k, v in c["tflops"].items()}
    path = write_results("lce", cases, args.out, {"ceilings": ceil, "designs": designs})
    cols = ["broadcast_bmm", "decomposed", "decomposed_padded"] + [f"cutekern_{d}" for d in designs]
    print(f"ceilings: {ceil}")
    print(f"{'case':22s} " + " ".join(f"{c[:18]:>18s}" for c in cols) + "   (ms; TFLOP/s)")
    for c in cases:
        print(f"{c['name']:22s} " + " ".join(
            f"{c['timings_ms'][k]:8.3f} {c['tflops'][k]:6.0f}TF" for k in cols))
    print("CUDA-graph replay (ms):")
    for c in cases:
        print(f"{c['name']:22s} " + " ".join(f"{c['graph_timings_ms'][k]:8.3f} {c['graph_tflops'][k]:6.0f}TF" for k in cols))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
