"""Tune IKBO attention on the GPU: every export dir under --root (one config each, made by
`python3 perf/tune_attn.py --make ROOT '{"name": {overrides}}'` on the CPU box) is checked
against the reference on a few shapes and timed, through the runtime."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def make(root: Path, configs: dict):
    from cutekern.export import export
    for name, ov in configs.items():
        export(("sm_90a",), root / f"sm90-{name}", designs=["sm90"], ops=["ikbo_attn"],
               overrides={"sm90": ov}, log=lambda *a: None)
        print("made", name, flush=True)


def run(root: Path, out_dir: Path, only=None):
    import torch
    from common import time_ms
    from cutekern import dispatch
    from cutekern.ikbo import attention
    from cutekern.reference import ikbo_attention_reference

    rows = []
    os.environ["CUTEKERN_DESIGN"] = "sm90"
    for d in sorted(p for p in root.iterdir() if (p / "manifest.json").exists()
                    and (only is None or p.name == only)):
        os.environ["CUTEKERN_ARTIFACTS"] = str(d)
        row = {"config": d.name}
        ok = True
        # correctness: ragged counts, kv_len 0/1/odd, n_seed off the tile, both head dims
        for counts, n_seed, dh, s, kv in [([3, 0, 5, 1], 64, 128, 300, [300, 7, 1, 0]),
                                          ([2, 1], 17, 64, 1000, [999, 130]),
                                          ([64] * 2, 64, 128, 4096, [4096, 2049])]:
            torch.manual_seed(1)
            u = len(counts)
            c2u = torch.repeat_interleave(torch.arange(u), torch.tensor(counts)).int().cuda()
            q = torch.randn(c2u.numel(), n_seed, 2, dh, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(u, s, 2, dh, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(u, s, 2, dh, device="cuda", dtype=torch.bfloat16)
            kvl = torch.tensor(kv, dtype=torch.int32, device="cuda")
            out, lse = attention(q, k, v, c2u, kvl, return_lse=True)
            ref, rlse = ikbo_attention_reference(q, k, v, c2u, kvl)
            err = (out.float() - ref).abs().max().item()
            fin = torch.isfinite(rlse)
            lerr = (lse[fin] - rlse[fin]).abs().max().item()
            ok &= bool(err < 0.05 and lerr < 0.01 and not torch.isnan(out).any()
                       and torch.equal(fin, torch.isfinite(lse)))
        row["correct"] = ok
        for s in (1024, 4096, 8192, 16384):
            b, u = 2048, 32
            c2u = torch.repeat_interleave(torch.arange(u), 64).int().cuda()
            q = torch.randn(b, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(u, s, 2, 128, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(u, s, 2, 128, device="cuda", dtype=torch.bfloat16)
            t = time_ms(lambda: attention(q, k, v, c2u, check_indices=False), reps=10)
            row[f"S{s}_ms"] = t
            row[f"S{s}_tflops"] = 4 * b * 2 * 64 * 128 * s / t / 1e9
        dispatch._cached_function.cache_clear()
        rows.append(row)
        print(json.dumps(row), flush=True)
    (out_dir / "tune_attn.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--make", type=Path)
    ap.add_argument("configs", nargs="?", default='{"default": {}}')
    ap.add_argument("--root", type=Path)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--only", default=None, help="one config directory name")
    a = ap.parse_args()
    if a.make:
        make(a.make, json.loads(a.configs))
    else:
        run(a.root, a.out, a.only)
