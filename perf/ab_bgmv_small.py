"""A/B of small-batch BGMV plans on one GPU: the one-launch small-batch kernel (fused=None)
against the two pair kernels (fused=False), graph replays with a cold L2 as in
bench_bgmv_moe.py, interleaved rounds, plus a bit-for-bit check of the two. Writes
ab_bgmv_small.json to --out."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bgmv_moe import problem  # noqa: E402
from common import git_commit, time_graph_ms  # noqa: E402

from cutekern.bgmv_moe import prepare_bgmv_moe  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--designs", default="sm90,ada")
    ap.add_argument("--tokens", default="1,2,4,6,8,12,16")
    ap.add_argument("--configs", default="2688:32:128:6,4096:32:128:2,2688:16:128:6,3072:32:256:8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    rows = []
    for cfg in args.configs.split(","):
        h, r, e, k = map(int, cfg.split(":"))
        for t in map(int, args.tokens.split(",")):
            x, a, b, ids, w, lora = problem(t, h, r, e, k, seed=t + h + r + e + k)
            for d in args.designs.split(","):
                os.environ["CUTEKERN_DESIGN"] = d
                one = prepare_bgmv_moe(x, a, b, ids, w, lora)
                two = prepare_bgmv_moe(x, a, b, ids, w, lora, fused=False)
                one.run()
                two.run()
                torch.cuda.synchronize()
                same = bool(torch.equal(one.out, two.out) and torch.equal(one.shrink_out, two.shrink_out))
                row = {"design": d, "H": h, "r": r, "E": e, "k": k, "T": t,
                       "one_launch": bool(one.meta["fused"]), "bitwise_equal": same,
                       "one_us": [], "two_us": []}
                for _ in range(args.rounds):
                    row["two_us"].append(round(1e3 * time_graph_ms(two.run, reps=args.reps), 2))
                    row["one_us"].append(round(1e3 * time_graph_ms(one.run, reps=args.reps), 2))
                rows.append(row)
                print(json.dumps(row), flush=True)
    os.environ.pop("CUTEKERN_DESIGN", None)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = Path(args.out) / "ab_bgmv_small.json"
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "commit": git_commit(),
                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
