"""Where a small-batch BGMV plan's one launch spends its time (debug build): per-CTA
globaltimer stamps of the pair kernel (config pair_timeline; export with
`perf/tune_memops.py --make ROOT '{"tl": {"op": "bgmv", "design": "ada",
"op_overrides": {"bgmv_binplan": {"pair_timeline": true}}}}'`, and run with
CUTEKERN_DESIGN=ada; for the sm90 design add "pair_max_pairs": 96, whose default 0 compiles no
such kernel), read back after a cold-L2 graph
replay. Stamps per CTA: 0 entry, 1 routing + launch count known, 2 first shrink unit's
vectors in shared memory (warp 0), 3 warp 0's units published, 4 warp 0's s fragment summed
(exchange done), 5 b vectors in, 6 output stored; then the SM id. Prints quantiles of each
stamp (ns after the earliest entry) and writes timeline_bgmv_small.json to --out."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bgmv_moe import problem  # noqa: E402
from common import time_graph_ms  # noqa: E402

from cutekern.abi import BGMV_PAIR_COLS, bgmv_pair_xch_words  # noqa: E402
from cutekern.bgmv_moe import _binplan_function, _pair_xch  # noqa: E402

NAMES = ["entry", "routing", "unit_in", "units_out", "xch_done", "b_in", "stored"]


def q(v, f):
    v = sorted(v)
    return v[min(len(v) - 1, int(f * len(v)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--configs", default="2688:32:128:6")
    a_ = ap.parse_args()
    res = []
    for cfg in a_.configs.split(","):
        h, r, e, k = map(int, cfg.split(":"))
        for t in map(int, a_.tokens.split(",")):
            x, a, b, ids, w, lora = problem(t, h, r, e, k, seed=t + h + r + e + k)
            n = b.shape[2]
            ctas = t * -(-n // BGMV_PAIR_COLS)
            ws = _pair_xch(t, k, r, h, n, x.device, extra_words=8 * ctas)
            s = torch.empty(t * k, r, dtype=x.dtype, device="cuda")
            y = torch.empty(t, n, dtype=torch.float32, device="cuda")
            fn = _binplan_function(x.dtype, True, x.device)
            cfg = fn.meta["config"]
            assert cfg.get("pair_timeline") and cfg.get("pair_max_pairs", 0) > 0, \
                "needs an export with pair_timeline and the small-batch kernel (pair_max_pairs)"
            call = fn.bind(x, a, b, ids, lora, w, s, y, ws)
            us = 1e3 * time_graph_ms(call.launch, reps=20)
            torch.cuda.synchronize()
            base = bgmv_pair_xch_words(t, k, r, h, n)
            st = ws.view(torch.int64).reshape(-1)[base:base + 8 * ctas].view(ctas, 8).cpu()
            t0 = int(st[:, 0].min())
            row = {"H": h, "r": r, "E": e, "k": k, "T": t, "ctas": ctas, "replay_us": round(us, 2)}
            for i, nm in enumerate(NAMES):
                v = [int(z) - t0 for z in st[:, i].tolist()]
                row[nm] = {"p10": q(v, .1), "p50": q(v, .5), "p90": q(v, .9), "max": max(v)}
            sms = st[:, 7].tolist()
            row["ctas_per_sm_max"] = max(sms.count(s_) for s_ in set(sms))
            row["sms_used"] = len(set(sms))
            res.append(row)
            print(json.dumps(row), flush=True)
    Path(a_.out, "timeline_bgmv_small.json").write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "rows": res}, indent=1))


if __name__ == "__main__":
    main()
