"""Decode attention's split count (cutekern.decode.pick_splits) measured: every forced split
count 1..64 (bounded by residency) at Qwen3-1.7B's heads, batches 1 / 4 / 16 / 64 and
contexts 1024 / 4096, CUDA-graph replays after an L2 flush; prints and writes each case's
times and the API's pick (perf/results/decode_splits.json with --out)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import git_commit, time_graph_ms  # noqa: E402

from bench_decode_attn import HKV, random_step  # noqa: E402  (Qwen3-1.7B's heads)
import cutekern.decode as dec  # noqa: E402
from cutekern.arch import sm_count  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--explore", type=int, default=None,
                    help="CTAs an SM holds of the build under test (default: "
                         "cutekern.decode.RESIDENT_PER_SM, the default build's)")
    args = ap.parse_args()
    dt, sms = torch.bfloat16, sm_count(torch.device("cuda"))
    pick_resident = dec.RESIDENT_PER_SM
    # more splits than the SMs hold at once would leave split 0 waiting for good
    explore = args.explore or pick_resident
    g = torch.Generator(device="cuda").manual_seed(0)
    qn = torch.ones(dec.HEAD_DIM, device="cuda", dtype=dt)
    rows = []
    for ctx in (1024, 4096):
        rope = dec.rope_table(ctx + 1, device="cuda")
        for b in (1, 4, 16, 64):
            qkv, kc, vc, lens, out = random_step(b, ctx, g, dt)
            ctas = b * HKV
            dec.SPLITS_OVERRIDE, dec.RESIDENT_PER_SM = None, pick_resident
            pick = dec.pick_splits(ctas, ctx + 1, sms)
            dec.RESIDENT_PER_SM = explore
            times = {}
            for n in sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, pick}):
                if n > 1 and ctas * n > sms * explore:
                    break
                dec.SPLITS_OVERRIDE = n
                times[n] = time_graph_ms(
                    lambda: dec.decode_attention(qkv, kc, vc, lens, qn, qn, rope, out=out),
                    reps=args.reps) * 1e3
            dec.SPLITS_OVERRIDE, dec.RESIDENT_PER_SM = None, pick_resident
            best = min(times, key=times.get)
            rows.append(dict(context=ctx, batch=b, pick=pick, best=best, us=times))
            print(f"ctx {ctx} b {b:3d}: pick {pick:2d} best {best:2d}  "
                  + "  ".join(f"{n}:{t:.1f}" for n, t in times.items()), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        doc = dict(device=torch.cuda.get_device_name(), git_commit=git_commit(), sms=sms,
                   resident_per_sm=pick_resident, explored_per_sm=explore, rows=rows)
        (Path(args.out) / "decode_splits.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
