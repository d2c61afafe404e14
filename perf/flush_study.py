"""How the L2 flush method changes the memory-bound timings (GPU only).

Every benchmark times a cold L2. Zeroing a 256 MB buffer (the default, as triton's do_bench)
leaves the L2 full of dirty lines, so the timed kernel also pays their write-back to DRAM;
a reduction over the same buffer leaves clean lines. This times AttnRes (H=7168, K=8, every
design that runs here), the BGMV plan (H=2688, r=32, E=128, top-6) and a one-element kernel
under both methods and with a warm L2, side by side. Writes DIR/flush_study.json."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_bgmv_moe import problem  # noqa: E402
from cutekern.arch import DESIGNS_FOR_ARCH, target_arch  # noqa: E402
from cutekern.attn_res import prepare_attn_res  # noqa: E402
from cutekern.bgmv_moe import prepare_bgmv_moe  # noqa: E402
from cutekern.reference import attn_res_torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    designs = [d for d in ("sm90", "ada") if d in DESIGNS_FOR_ARCH[target_arch()]]
    cases = {}
    one = torch.zeros(1, device="cuda")
    cases["one_element_kernel"] = lambda: one.add_(1)
    H, NB, K = 7168, 8, 8
    r = lambda *s: torch.randn(*s, device="cuda").to(torch.bfloat16)  # noqa: E731
    compiled = torch.compile(attn_res_torch, dynamic=False)
    for m in (1, 256, 1024, 4096):
        prefix, delta, blocks, nw, qw, onw = r(m, H), r(m, H), r(m, NB, H), r(H), r(H) * 0.05, r(H)
        out = torch.empty(m, H, dtype=torch.bfloat16, device="cuda")
        for d in designs:
            os.environ["CUTEKERN_DESIGN"] = d
            cases[f"attn_res_M{m}_{d}"] = prepare_attn_res(prefix, delta, blocks, nw, qw, onw, out,
                                                           num_blocks=K).launch
        os.environ.pop("CUTEKERN_DESIGN", None)
        if m == 1024:
            args = (prefix, delta, blocks, nw, qw, onw, K, -1)
            cases[f"attn_res_M{m}_torch_compile"] = lambda args=args: compiled(*args)
    for t in (32, 256, 2048):
        x, aa, bb, ids, w, lora = problem(t, 2688, 32, 128, 6, 0)
        for d in designs:
            os.environ["CUTEKERN_DESIGN"] = d
            cases[f"bgmv_T{t}_{d}"] = prepare_bgmv_moe(x, aa, bb, ids, w, lora).run
        os.environ.pop("CUTEKERN_DESIGN", None)
    rows = {}
    for name, fn in cases.items():
        rows[name] = {}
        for mode in ("write", "read", "none"):
            common.FLUSH_MODE = mode
            rows[name][mode] = round(1e3 * common.time_graph_ms(fn, reps=a.reps), 2)
        print(name, rows[name], flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "flush_study.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "git_commit": common.git_commit(),
         "unit": "us, median CUDA-graph replay", "cases": rows}, indent=1))


if __name__ == "__main__":
    main()
