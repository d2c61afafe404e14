"""Where a W4A16 Qwen3-1.7B decode step (cutekern.qwen3) spends its time: torch.profiler
over a few eager steps, GPU kernel time per step grouped by kernel (ours by op, torch's by
name), next to the CUDA-graph replay time of the same step (the difference is what the
graph still pays between kernels). Usage: CUTEKERN_ARTIFACTS=DIR python3
perf/profile_qwen3_decode.py [--batch 1 16] [--context 1024] [--quantize-head] [--out DIR]
(with --quantize-head the head's launch counts with the W4A16 GEMMs)"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qwen3_decode import random_model  # noqa: E402
from common import capture_graph, git_commit, time_ms  # noqa: E402

from cutekern.qwen3 import prepare_qwen3_decoder  # noqa: E402
from cutekern.reference import Qwen3Config  # noqa: E402

OURS = (("w4a16_mlp", "W4a16Mlp"), ("w4a16_gemm", "W4a16Gemm"), ("decode_attn", "DecodeAttn"),
        ("add_rms_norm", "AddRmsNorm"))


def group(name: str) -> str:
    for op, cls in OURS:
        if cls.lower() in name.lower().replace("_", ""):
            return "ck " + op
    return name[:60]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quantize-head", action="store_true", help="the head in W4A16 too")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = Qwen3Config()
    params, _ = random_model(cfg, torch.bfloat16)
    base = prepare_qwen3_decoder(params, cfg, batch=1, max_len=2,
                                 quantize_head=args.quantize_head)
    report = dict(device=torch.cuda.get_device_name(), git_commit=git_commit(),
                  context=args.context, quantize_head=args.quantize_head, cases=[])
    for b in args.batch:
        dec = base.resized(b, args.context + args.steps + 2)
        l0 = torch.full((b,), args.context, dtype=torch.int32, device="cuda")
        dec.lens.copy_(l0)
        dec._forward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                dec.lens.copy_(l0)
                dec._forward()
            torch.cuda.synchronize()
        per = collections.defaultdict(lambda: [0, 0.0])
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                k = group(ev.name)
                per[k][0] += 1
                per[k][1] += ev.device_time_total
        rows = sorted(((k, n / args.steps, us / args.steps) for k, (n, us) in per.items()),
                      key=lambda r: -r[2])
        total = sum(r[2] for r in rows)
        g = capture_graph(dec._forward)
        t_graph = time_ms(lambda: (dec.lens.copy_(l0), g.replay()), reps=10) * 1e3
        print(f"batch {b}, context {args.context}: kernels {total:.0f} us per step, graph "
              f"replay {t_graph:.0f} us", flush=True)
        for k, n, us in rows[:14]:
            print(f"  {us:8.1f} us  {n:5.0f} launches  {k}", flush=True)
        report["cases"].append(dict(batch=b, kernel_us=total, graph_us=t_graph,
                                    kernels=[dict(name=k, launches=n, us=us) for k, n, us in rows]))
        del g, dec
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = "qwen3_decode_profile" + ("_w4head" if args.quantize_head else "") + ".json"
        (Path(args.out) / name).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
