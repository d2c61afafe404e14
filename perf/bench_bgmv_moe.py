"""BGMV MoE-LoRA benchmark on one GPU: one plan.run() (shrink + expand, finalized fp32) as a
CUDA-graph replay with a cold L2, against the torch gather + einsum route timed the same way
in the same run. Achieved GB/s uses the spec's roofline bytes (U = distinct (adapter, expert)
bins actually touched), reported against the measured copy bandwidth. Pairs in token order;
at T >= 256 also in expert-sorted order (what a vLLM-style caller passes)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measured_ceilings, time_graph_ms, write_results  # noqa: E402

from cutekern.arch import DESIGNS_FOR_ARCH, target_arch  # noqa: E402
from cutekern.bgmv_moe import prepare_bgmv_moe  # noqa: E402
from cutekern.reference import bgmv_torch  # noqa: E402

L = 8
# (H, r, E, top-k): the spec's shapes
CONFIGS = [(2688, 32, 128, 6), (3072, 32, 256, 8), (3072, 32, 128, 6), (4096, 32, 128, 2),
           (2688, 16, 128, 6), (2688, 64, 128, 6)]
TOKENS = [1, 4, 8, 32, 256, 512, 1024, 2048]


def problem(t, h, r, e, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.bfloat16
    x = torch.randn(t, h, device="cuda", generator=g).to(dt)
    a = (torch.randn(L, e, r, h, device="cuda", generator=g) * h ** -0.5).to(dt)
    b = (torch.randn(L, e, h, r, device="cuda", generator=g) * r ** -0.5).to(dt)
    ids = torch.argsort(torch.rand(t, e, device="cuda", generator=g), dim=1)[:, :k].to(torch.int32).contiguous()
    w = torch.softmax(torch.randn(t, k, device="cuda", generator=g), -1)
    lora = torch.randint(0, L, (t,), device="cuda", generator=g, dtype=torch.int32)
    return x, a, b, ids, w, lora


def expert_sorted(ids):
    """Pair indices grouped by expert (stable), as moe_align-style callers provide them."""
    return torch.argsort(ids.reshape(-1), stable=True).to(torch.int32)


def run_case(t, h, r, e, k, designs, reps):
    x, a, b, ids, w, lora = problem(t, h, r, e, k, seed=t + h + r + e + k)
    bins = int(torch.unique(lora.long().unsqueeze(1) * e + ids.long()).numel())
    times = {}
    plan = None
    for d in designs:
        os.environ["CUTEKERN_DESIGN"] = d
        plan = prepare_bgmv_moe(x, a, b, ids, w, lora)
        times[f"cutekern_{d}"] = time_graph_ms(plan.run, reps=reps)
        if t >= 256:
            sp = prepare_bgmv_moe(x, a, b, ids, w, lora, sorted_token_ids=expert_sorted(ids))
            times[f"cutekern_{d}_sorted"] = time_graph_ms(sp.run, reps=reps)
    os.environ.pop("CUTEKERN_DESIGN", None)
    times["torch_gather_einsum"] = time_graph_ms(lambda: bgmv_torch(x, a, b, ids, w, lora), reps=reps)
    nbytes = plan.bytes_moved(bins)
    us = {kk: 1e3 * v for kk, v in times.items()}
    return {"name": f"H{h}_r{r}_E{e}_k{k}_T{t}",
            "shape": {"T": t, "H": h, "r": r, "E": e, "top_k": k, "L": L, "bins_touched": bins},
            "bytes": nbytes, "timings_us": us,
            "gbps": {kk: nbytes / v / 1e3 for kk, v in us.items()},
            "speedup_vs_torch": {kk: us["torch_gather_einsum"] / v for kk, v in us.items()
                                 if kk.startswith("cutekern")}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    designs = [d for d in ("sm90", "ada") if d in DESIGNS_FOR_ARCH[target_arch()]]
    ceil = measured_ceilings()
    configs = CONFIGS[:1] if a.quick else CONFIGS
    cases = []
    for h, r, e, k in configs:
        for t in TOKENS:
            c = run_case(t, h, r, e, k, designs, a.reps)
            c["fraction_of_copy_ceiling"] = {kk: v / ceil["copy_gbps"] for kk, v in c["gbps"].items()}
            cases.append(c)
            print(f"{c['name']:24s} " + "  ".join(
                f"{kk}={v:8.1f}us/{c['gbps'][kk]:5.0f}GB/s" for kk, v in c["timings_us"].items()), flush=True)
    path = write_results("bgmv_moe", cases, a.out, {
        "ceilings": ceil, "designs": designs, "adapters": L,
        "timing": "one CUDA-graph replay of shrink + expand, cold L2, median"})
    print(f"copy ceiling {ceil['copy_gbps']:.0f} GB/s; wrote {path}")


if __name__ == "__main__":
    main()
