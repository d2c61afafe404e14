"""Per-tile cycle timeline of the sm90 LCE candidate kernel (GPU only, diagnostics).

Export debug builds on the CPU box (config debug_timeline, see LceSm90Config), e.g.
    python3 perf/tune_lce.py --make ROOT       (with a CONFIGS entry {"debug_timeline": True})
then run on the GPU:
    python3 perf/timeline_lce.py ROOT [--out DIR]
Consumer thread 0 of every CTA stamps its first 32 tiles; this prints, per config, the
median over CTAs and steady-state tiles (2..29) of: the wait for the first stage, the
mainloop, the wait for the first addend subtile, the epilogue, and the gap to the next tile,
in cycles. The output of the debug run is garbage by design."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import lce_phase_functions, lce_problem  # noqa: E402
from cutekern.reference import pad_k  # noqa: E402
from cutekern.runtime import Manifest  # noqa: E402

PHASES = ("first_wait", "mainloop", "addend_wait", "epilogue", "gap")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    dt = torch.float16
    wc, wu, ec, eu, c2u = lce_problem(1024, 70, dt)
    wc, wu = pad_k(wc), pad_k(wu)
    u, (B, _, N), M = eu.shape[0], ec.shape, wc.shape[0]
    rows = []
    for d in sorted(p for p in a.root.iterdir() if (p / "manifest.json").exists()):
        design = d.name.split("-")[0]
        man = Manifest(d)
        f_user, f_cand = lce_phase_functions(man, design, M, users=u, n=N, batch=B)
        # one spare user slot, never referenced by c2u: the kernel writes its marks there
        part = torch.zeros(u + 1, M, N, device="cuda")
        out = torch.empty(B, M, N, dtype=dt, device="cuda")
        for _ in range(3):
            f_user(wu, eu, part[:u], part, c2u)
            part[u].zero_()
            f_cand(wc, ec, out, part, c2u)
        torch.cuda.synchronize()
        marks = part[u].view(-1).view(torch.int32)[: 132 * 32 * 8].view(132, 32, 8).cpu().long()
        per = {k: [] for k in PHASES}
        for cta in range(132):
            for t in range(2, 30):
                m, nxt = marks[cta, t], marks[cta, t + 1]
                if m[0] == 0 or nxt[0] == 0:
                    continue
                per["first_wait"].append(int(m[1] - m[0]))
                per["mainloop"].append(int(m[2] - m[1]))
                per["addend_wait"].append(int(m[3] - m[2]) if m[3] > 0 else 0)
                per["epilogue"].append(int(m[4] - m[2]))
                per["gap"].append(int(nxt[0] - m[4]))
        med = {k: statistics.median(v) if v else None for k, v in per.items()}
        tile = statistics.median([int(marks[c, 29, 0] - marks[c, 2, 0]) / 27 for c in range(132)
                                  if marks[c, 29, 0] > 0])
        # per-CTA pace: a CTA that is slower on every tile sets the end of a static schedule
        pace = sorted(int(marks[c, 29, 0] - marks[c, 2, 0]) / 27 for c in range(132)
                      if marks[c, 29, 0] > 0)
        q = lambda v, f: v[min(len(v) - 1, int(f * (len(v) - 1) + 0.5))]  # noqa: E731
        row = {"config": d.name, "median_cycles": med, "cycles_per_tile": tile,
               "cta_cycles_per_tile_pcts": [q(pace, f) for f in (0, .1, .5, .9, 1)]}
        rows.append(row)
        print(f"{d.name:24s} per tile {tile:8.0f} cyc | " +
              " ".join(f"{k} {v:.0f}" for k, v in med.items() if v is not None) +
              " | per-CTA cycles/tile min/p10/p50/p90/max " +
              " ".join(f"{x:.0f}" for x in row["cta_cycles_per_tile_pcts"]), flush=True)
    if a.out:
        (a.out / "timeline_lce.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
