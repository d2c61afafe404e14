"""Per-CTA wall-clock trace of the sm90 AttnRes kernel at row_split 1 (GPU only, diagnostics).

Export a debug build on the CPU box, then run this with it on the GPU:
    python3 perf/tune_memops.py --make ROOT '{"tr": {"op": "attn_res", "design": "sm90",
        "overrides": {"debug_trace": true}, "flags": {"max_hidden": 8192, "row_split": 1}}}'
    CUTEKERN_ARTIFACTS=ROOT/tr python3 perf/trace_attn_res.py [M ...]   (default 256 1024)
Every CTA's consumer thread 0 writes %globaltimer_lo (ns) at entry, when its first row's
first slot is full, after each of its first 12 rows' stores, at exit, and its row count (see
AttnResSm90Config.debug_trace); this prints, relative to the earliest entry, percentiles over
CTAs of each mark and the per-row intervals. The output is garbage by design."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timeline_attn_res import debug_run  # noqa: E402

NT = 256  # consumer threads of the 8192 tier (thread 0's chunks are NT * 8 elements apart)


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


def main():
    res = {}
    for m in [int(a) for a in (sys.argv[1:] or ["256", "1024"])]:
        out = debug_run(m, 1)
        ncta = min(m, 132)
        v = out[:ncta].view(torch.int32).cpu().long()
        idx = [(i // 4) * 4 * NT + i % 4 for i in range(16)]
        marks = v[:, idx] & 0xFFFFFFFF
        t0 = int(marks[:, 0].min())
        rel = ((marks - t0) % (1 << 32)).tolist()
        rows = [int(marks[c, 15]) for c in range(ncta)]
        entry = [x[0] for x in rel]
        first = [x[1] for x in rel]
        exit_ = [x[2] for x in rel]
        done = [[x[3 + i] for i in range(min(rows[c], 12))] for c, x in enumerate(rel)]
        iv = [d[i] - d[i - 1] for d in done for i in range(1, len(d))]
        row0 = [d[0] - f for d, f in zip(done, first)]
        summ = {
            "entry_us": [pct(entry, q) / 1e3 for q in (0, .5, 1)],
            "first_data_us": [pct(first, q) / 1e3 for q in (0, .5, 1)],
            "row0_after_first_data_us": [pct(row0, q) / 1e3 for q in (0, .5, 1)],
            "row_interval_us": [pct(iv, q) / 1e3 for q in (0, .1, .5, .9, 1)] if iv else [],
            "exit_us": [pct(exit_, q) / 1e3 for q in (0, .5, 1)],
            "rows_per_cta": [min(rows), max(rows)],
        }
        res[m] = {"summary": summ, "marks_ns": rel, "rows": rows}
        print(f"M={m}: " + json.dumps(summ), flush=True)
    out_dir = Path(os.environ.get("OUT", "."))
    (out_dir / "trace_attn_res.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
