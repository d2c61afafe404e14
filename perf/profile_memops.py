"""Launches of AttnRes (H=7168, K=8, M from argv, row split from $CUTEKERN_ATTN_RES_SPLIT)
and of the BGMV plan (H=2688, r=32, E=128, top-6, T from argv) for `ncu` (no timing here).
Usage: CUTEKERN_ARTIFACTS=DIR CUTEKERN_DESIGN=sm90 ncu --clock-control none -k regex:kernel_cutlass \
    python3 perf/profile_memops.py attn_res:1,256,1024 bgmv:256,2048"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bgmv_moe import problem  # noqa: E402
from cutekern.attn_res import prepare_attn_res  # noqa: E402
from cutekern.bgmv_moe import prepare_bgmv_moe  # noqa: E402

for arg in sys.argv[1:]:
    op, sizes = arg.split(":")
    for n in map(int, sizes.split(",")):
        if op == "attn_res":
            h, nb, k = 7168, 8, 8
            r = lambda *s: torch.randn(*s, device="cuda").to(torch.bfloat16)  # noqa: E731
            prefix, delta, blocks, nw, qw, onw = r(n, h), r(n, h), r(n, nb, h), r(h), r(h) * 0.05, r(h)
            out = torch.empty(n, h, dtype=torch.bfloat16, device="cuda")
            run = prepare_attn_res(prefix, delta, blocks, nw, qw, onw, out, num_blocks=k).launch
        else:
            x, a, b, ids, w, lora = problem(n, 2688, 32, 128, 6, 0)
            run = prepare_bgmv_moe(x, a, b, ids, w, lora).run
        run()
        torch.cuda.synchronize()
