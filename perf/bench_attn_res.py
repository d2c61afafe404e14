"""AttnRes benchmark on one GPU: cutekern (each design that runs here) against the torch
eager reference and torch.compile of the same code, timed in the same run as CUDA-graph
replays with a cold L2. H = 7168, NB = 8 slots, delta and output norm on (the common path);
effective GB/s = (K + 4) * M * H * 2 / t against the measured copy bandwidth. Small M is
also compared with the latency of one tiny kernel launch (graph replay)."""
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
from cutekern.attn_res import prepare_attn_res  # noqa: E402
from cutekern.reference import attn_res_torch  # noqa: E402

H, NB = 7168, 8
# static shapes (one compile per M: dynamic-shape code was 4x slower), at the M the targets name
COMPILE_MS = (1, 16, 256, 1024, 4096, 16384)
torch._dynamo.config.cache_size_limit = 64
_compiled = torch.compile(attn_res_torch, dynamic=False)


def launch_latency_us(reps) -> float:
    """One graph replay of a one-element kernel: the floor any single launch pays."""
    x = torch.zeros(1, device="cuda")
    return 1e3 * time_graph_ms(lambda: x.add_(1), reps=reps)


def run_case(m, k, designs, reps, with_compile):
    g = torch.Generator(device="cuda").manual_seed(m * 10 + k)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    prefix, delta, blocks = r(m, H), r(m, H), r(m, NB, H)
    nw = (1 + 0.3 * torch.randn(H, device="cuda", generator=g)).to(torch.bfloat16)
    qw = (0.05 * torch.randn(H, device="cuda", generator=g)).to(torch.bfloat16)
    onw = (1 + 0.3 * torch.randn(H, device="cuda", generator=g)).to(torch.bfloat16)
    out = torch.empty(m, H, dtype=torch.bfloat16, device="cuda")
    args = (prefix, delta, blocks, nw, qw, onw, k, -1)
    t = {}
    for d in designs:
        os.environ["CUTEKERN_DESIGN"] = d
        runner = prepare_attn_res(prefix, delta, blocks, nw, qw, onw, out, num_blocks=k)
        t[f"cutekern_{d}"] = time_graph_ms(runner.launch, reps=reps)
    os.environ.pop("CUTEKERN_DESIGN", None)
    t["torch_eager"] = time_graph_ms(lambda: attn_res_torch(*args), reps=reps)
    if with_compile:
        t["torch_compile"] = time_graph_ms(lambda: _compiled(*args), reps=reps)
    nbytes = (k + 4) * m * H * 2
    return {"name": f"M{m}_K{k}", "shape": {"M": m, "K": k, "H": H, "NB": NB},
            "bytes": nbytes, "timings_us": {kk: 1e3 * v for kk, v in t.items()},
            "gbps": {kk: nbytes / v / 1e6 for kk, v in t.items()}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    designs = [d for d in ("sm90", "ada") if d in DESIGNS_FOR_ARCH[target_arch()]]
    ceil = measured_ceilings()
    lat = launch_latency_us(a.reps)
    ms = [1, 16, 256, 1024, 4096] if a.quick else [2 ** i for i in range(15)]
    cases = []
    for k in (1, 4, 8):
        for m in ms:
            # torch.compile at K = 8, where the targets are stated
            c = run_case(m, k, designs, a.reps, with_compile=(k == 8 and m in COMPILE_MS))
            c["fraction_of_copy_ceiling"] = {kk: v / ceil["copy_gbps"] for kk, v in c["gbps"].items()}
            c["vs_launch_latency"] = {kk: v / lat for kk, v in c["timings_us"].items()}
            for base in ("torch_eager", "torch_compile"):
                if base in c["timings_us"]:
                    c[f"speedup_vs_{base}"] = {d: c["timings_us"][base] / c["timings_us"][f"cutekern_{d}"]
                                               for d in designs}
            cases.append(c)
            print(f"{c['name']:10s} " + "  ".join(
                f"{kk}={v:8.1f}us/{c['gbps'][kk]:6.0f}GB/s" for kk, v in c["timings_us"].items()), flush=True)
    path = write_results("attn_res", cases, a.out, {
        "ceilings": ceil, "launch_latency_us": lat, "designs": designs,
        "timing": "CUDA-graph replay, cold L2 (256 MB flush before each replay), median"})
    print(f"launch latency {lat:.2f} us; copy ceiling {ceil['copy_gbps']:.0f} GB/s; wrote {path}")


if __name__ == "__main__":
    main()
