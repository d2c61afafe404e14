"""Plan time (one CUDA-graph replay, cold L2) of BGMV MoE-LoRA for every T in a range: where
the small-T cost steps (e.g. a kernel's grid passing one wave). Usage on the GPU box:
CUTEKERN_ARTIFACTS=... python3 perf/small_t_sweep.py --t 1 40 [--shape 2688:32:128:6]."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bgmv_moe import problem  # noqa: E402
from common import time_graph_ms  # noqa: E402

from cutekern.bgmv_moe import prepare_bgmv_moe  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, nargs=2, default=(1, 40))
    ap.add_argument("--shape", default="2688:32:128:6")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    h, r, e, k = (int(v) for v in a.shape.split(":"))
    rows = []
    for t in range(a.t[0], a.t[1] + 1):
        x, la, lb, ids, w, lora = problem(t, h, r, e, k, t)
        p = prepare_bgmv_moe(x, la, lb, ids, w, lora)
        us = 1e3 * time_graph_ms(p.run, reps=20)
        rows.append({"T": t, "us": round(us, 2)})
        print(f"T={t:3d} {us:7.2f} us", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"shape": a.shape, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
