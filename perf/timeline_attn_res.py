"""Per-phase cycle timeline of the sm90 AttnRes split kernels (GPU only, diagnostics).

Export a debug build on the CPU box, then run this with it on the GPU:
    python3 perf/tune_memops.py --make ROOT '{"tl": {"op": "attn_res", "design": "sm90",
        "overrides": {"debug_timeline": true}}}'
    CUTEKERN_ARTIFACTS=ROOT/tl python3 perf/timeline_attn_res.py [M ...]   (default M = 1)
Each CTA of the row-0 cluster prints clock64 cycles since its entry at: the mbarrier init
barrier, the first (prefix) slot full, all partials, the CTA reduction, the score exchange,
the mix, the output-norm exchange, the output store, the norm_w * qk_w loads, the cluster
wait and the end (see AttnResSm90Config.debug_timeline). The output is garbage by design."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from cutekern.attn_res import prepare_attn_res  # noqa: E402

H, NB, K = 7168, 8, 8
NAMES = ["entry", "init", "p_full", "partials", "cta_bar", "xchg", "mix", "onorm", "stored",
         "wq", "clu_wait", "end"]


def debug_run(m: int, split: int):
    """One cold-L2 launch (after two warm-up launches) of the sm90 kernel at row split
    `split` on random inputs (H=7168, 8 slots, K=8, delta + output norm); returns out, where
    a debug build leaves its marks."""
    os.environ["CUTEKERN_DESIGN"] = "sm90"
    os.environ["CUTEKERN_ATTN_RES_SPLIT"] = str(split)
    r = lambda *s: torch.randn(*s, device="cuda").to(torch.bfloat16)  # noqa: E731
    prefix, delta, blocks, nw, qw, onw = r(m, H), r(m, H), r(m, NB, H), r(H), r(H) * 0.05, r(H)
    out = torch.empty(m, H, dtype=torch.bfloat16, device="cuda")
    run = prepare_attn_res(prefix, delta, blocks, nw, qw, onw, out, num_blocks=K).launch
    for _ in range(3):  # the last run: cold L2, warm code
        common.flush_l2()
        run()
    torch.cuda.synchronize()
    return out


def main():
    for m, split in [(int(a), sp) for a in (sys.argv[1:] or ["1"]) for sp in (8, 4, 2)]:
        out = debug_run(m, split)
        seg = -(-(H // 8) // split) * 8
        v = out[0].view(torch.int32)
        for rank in range(split):
            t = v[rank * seg // 2: rank * seg // 2 + len(NAMES)].tolist()
            print(f"M={m} split={split} rank={rank}: " + " ".join(f"{n}={x}" for n, x in zip(NAMES, t)),
                  flush=True)


if __name__ == "__main__":
    main()
