"""A/B of the LCE's two launches (user phase, candidate phase, PDL) against the one-launch
sm90 build with per-tile ready flags ($CUTEKERN_LCE_FUSED=1, kernels/sm90/lce_fused.py), on
the public API, in one process: per shape, both modes checked against the fp32 reference,
then timed interleaved (ABBA per round) as CUDA-graph replays with a cold L2, each timing
after `--cool` seconds idle (the burst regime the benchmark sees).

    CUTEKERN_ARTIFACTS=.bundle python3 perf/ab_lce_fused.py --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = [("reference", 1024, 70), ("B1024_r100", 1024, 100), ("B512_r50", 512, 50),
          ("B2048_r1000", 2048, 1000), ("B3072_r5", 3072, 5), ("B3072_r2", 3072, 2)]


def main():
    import torch
    from common import git_commit, lce_problem, time_graph_ms, time_ms
    from cutekern.ikbo import ENV_FUSED, LinearCompression
    from cutekern.reference import lce_decomposed_padded, lce_reference, pad_k, pad_k_rows

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cool", type=float, default=1.5)
    ap.add_argument("--shapes", default="all")
    a = ap.parse_args()
    shapes = SHAPES if a.shapes == "all" else [s for s in SHAPES if s[0] in a.shapes.split(",")]
    res = {"device": torch.cuda.get_device_name(), "git_commit": git_commit(),
           "tool": "perf/ab_lce_fused.py", "cool_s": a.cool, "rounds": a.rounds, "cases": []}
    for name, b, ratio in shapes:
        wc, wu, ec, eu, c2u = lce_problem(b, ratio, torch.float16)
        lce = LinearCompression(wc, wu)
        out = torch.empty(b, wc.shape[0], ec.shape[2], dtype=wc.dtype, device="cuda")
        ref = lce_reference(wc, wu, ec, eu, c2u).float()
        case = {"name": name, "B": b, "ratio": ratio, "users": eu.shape[0]}
        for mode in ("0", "1"):
            os.environ[ENV_FUSED] = mode
            for rep in range(3):  # fresh poison each time: every element must be written
                out.fill_(float("nan"))
                lce(ec, eu, c2u, out=out, check_indices=False)
                torch.cuda.synchronize()
                err = float(((out.float() - ref).norm() / ref.norm()).item())
                bad = int((~torch.isfinite(out)).sum().item())
                assert bad == 0 and err < 2e-3, (name, mode, rep, err, bad)
            case[f"rel_err_{mode}"] = err
        wcp, wup = pad_k(wc), pad_k(wu)
        ecp, eup = pad_k_rows(ec), pad_k_rows(eu)
        case["padded_graph_ms"] = time_graph_ms(
            lambda: lce_decomposed_padded(wcp, wup, ecp, eup, c2u), reps=a.reps)
        times = {"0": [], "1": []}
        eager = {"0": [], "1": []}
        for r in range(a.rounds):
            for mode in (("0", "1") if r % 2 == 0 else ("1", "0")):
                os.environ[ENV_FUSED] = mode
                time.sleep(a.cool)
                times[mode].append(time_graph_ms(
                    lambda: lce(ec, eu, c2u, out=out, check_indices=False), reps=a.reps))
                eager[mode].append(time_ms(
                    lambda: lce(ec, eu, c2u, out=out, check_indices=False), reps=a.reps))
        for mode, key in (("0", "two_launches"), ("1", "one_launch")):
            case[f"{key}_graph_ms"] = statistics.median(times[mode])
            case[f"{key}_graph_ms_rounds"] = times[mode]
            case[f"{key}_eager_ms"] = statistics.median(eager[mode])
        print(f"{name:12s} two launches {case['two_launches_graph_ms']:.4f} ms "
              f"(rounds {', '.join(f'{t:.4f}' for t in times['0'])}), one launch "
              f"{case['one_launch_graph_ms']:.4f} ms (rounds "
              f"{', '.join(f'{t:.4f}' for t in times['1'])}); eager "
              f"{case['two_launches_eager_ms']:.4f} / {case['one_launch_eager_ms']:.4f}; padded "
              f"{case['padded_graph_ms']:.4f}; rel err {case['rel_err_0']:.2e} / "
              f"{case['rel_err_1']:.2e}", flush=True)
        res["cases"].append(case)
    os.environ.pop(ENV_FUSED, None)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "ab_lce_fused.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
