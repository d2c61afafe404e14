"""A/B configs of the memory-bound ops (AttnRes, BGMV MoE) on the GPU, through the runtime.

On the CPU box: `python3 perf/tune_memops.py --make ROOT '{"name": {"op": "attn_res",
"design": "sm90", "overrides": {...}}}'` exports one directory per config (sm_90a). On the
GPU: `python3 perf/tune_memops.py --root ROOT --out DIR` checks every config against the
reference on a few shapes and times it (CUDA-graph replay, cold L2); AttnRes is timed for
every row split the export has. Results: DIR/tune_memops.json (one row per config).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

OPS = {"attn_res": ["attn_res"], "bgmv": ["bgmv_shrink", "bgmv_expand", "bgmv_binplan"]}


def make(root: Path, configs: dict):
    """One export dir per config. ``overrides`` apply to every op of the config;
    ``op_overrides`` ({op: {field: value}}) to one op only (configs differ per op);
    ``flags`` ({flag: value}) exports only the variants that have them. BGMV configs with
    ``"fused": false`` time plans as two kernels (prepare_bgmv_moe(fused=False))."""
    import shutil
    from cutekern.export import ExportError, export
    from cutekern.registry import default_config
    for name, c in configs.items():
        d = root / name
        entries = []
        try:
            for op in OPS[c["op"]]:
                fields = {k for k, _ in default_config(op, c["design"])}
                ov = {k: v for k, v in c.get("overrides", {}).items() if k in fields}
                ov.update(c.get("op_overrides", {}).get(op, {}))
                man = export(("sm_90a",), d / op, designs=[c["design"]], ops=[op],
                             overrides={c["design"]: ov}, flags=c.get("flags"),
                             log=lambda *a: None)
                for e in man["kernels"]:
                    e["object"], e["header"] = f"{op}/{e['object']}", f"{op}/{e['header']}"
                entries += man["kernels"]
        except ExportError as e:  # e.g. a config that spills: skip it, keep the others
            print("skipped", name, str(e).splitlines()[-1][:200], flush=True)
            shutil.rmtree(d, ignore_errors=True)
            continue
        (d / "manifest.json").write_text(json.dumps({**man, "kernels": entries}, default=str))
        (d / "tune.json").write_text(json.dumps(c))
        print("made", name, flush=True)


def _attn_res(design, splits, row):
    import torch
    from common import time_graph_ms
    from cutekern.attn_res import prepare_attn_res
    from cutekern.reference import attn_res_reference
    from cutekern.runtime import CuteKernRuntimeError
    bf = torch.bfloat16
    ok = True
    for split in splits:
        os.environ["CUTEKERN_ATTN_RES_SPLIT"] = str(split)
        for m, nb, h, k, w, delta, onorm in [(1, 8, 7168, 8, -1, True, True), (3, 8, 1032, 5, 2, True, False),
                                             (37, 4, 8, 4, 3, False, True), (300, 8, 7168, 7, 7, True, True),
                                             (5, 2, 16384, 2, -1, True, True), (17, 8, 12344, 0, 0, False, False)]:
            torch.manual_seed(m + k)
            prefix, d, blocks = torch.randn(m, h, device="cuda").to(bf), torch.randn(m, h, device="cuda").to(bf), \
                torch.randn(m, nb, h, device="cuda").to(bf)
            nw, qw, onw = (1 + 0.3 * torch.randn(h, device="cuda")).to(bf), (0.05 * torch.randn(h, device="cuda")).to(bf), \
                (1 + 0.3 * torch.randn(h, device="cuda")).to(bf)
            d = d if delta else None
            onw = onw if onorm else None
            ref = attn_res_reference(prefix.clone(), None if d is None else d.clone(), blocks.clone(), nw, qw, onw, k, w)
            out = torch.full((m, h), float("nan"), dtype=bf, device="cuda")
            try:
                run = prepare_attn_res(prefix, d, blocks, nw, qw, onw, out, num_blocks=k,
                                       block_write_idx=w)
            except CuteKernRuntimeError:  # a tier this export left out (config "flags")
                print(f"  (no kernel for split={split} h={h}: skipped)", flush=True)
                continue
            run.launch()
            torch.cuda.synchronize()
            good = torch.equal(prefix, ref[0]) and torch.equal(blocks, ref[1]) and bool(
                ((out.float() - ref[2]).abs() <= 2 ** -8 * ref[2].abs() + 2e-3).all())
            if not good:
                print(f"  WRONG split={split} m={m} h={h} k={k} w={w}", flush=True)
            ok &= good
        h, nb = 7168, 8
        ms = os.environ.get("TUNE_AR_M", "1,2,4,8,16,32,64,128,256,512,1024,4096")  # timed M
        for m in map(int, ms.split(",")):
            prefix, d, blocks = torch.randn(m, h, device="cuda").to(bf), torch.randn(m, h, device="cuda").to(bf), \
                torch.randn(m, nb, h, device="cuda").to(bf)
            nw = qw = onw = torch.ones(h, device="cuda", dtype=bf)
            out = torch.empty(m, h, dtype=bf, device="cuda")
            r = prepare_attn_res(prefix, d, blocks, nw, qw, onw, out, num_blocks=8)
            row[f"split{split}_M{m}_us"] = round(1e3 * time_graph_ms(r.launch, reps=20), 2)
            if split == 1 and m >= 128:  # shorter rows: per-row costs weigh more
                for kk in (1, 4):
                    r = prepare_attn_res(prefix, d, blocks, nw, qw, onw, out, num_blocks=kk)
                    row[f"split{split}_K{kk}_M{m}_us"] = round(1e3 * time_graph_ms(r.launch, reps=20), 2)
    os.environ.pop("CUTEKERN_ATTN_RES_SPLIT", None)
    return ok


def _bgmv(row):
    import torch
    from bench_bgmv_moe import problem
    from common import time_graph_ms
    from cutekern.bgmv_moe import prepare_bgmv_moe
    from cutekern.reference import bgmv_expand_reference, bgmv_shrink_reference
    ok = True
    r = int(os.environ.get("TUNE_BGMV_R", 32))   # LoRA rank of the timed and checked problems
    fused = row.get("fused")                     # None: the plan's choice
    x, a, b, ids, w, lora = problem(1024, 2688, r, 128, 6, 3)
    lora[::5] = -1
    full = prepare_bgmv_moe(x, a, b, ids, w, lora, fused=fused)
    full.run()
    two = prepare_bgmv_moe(x, a, b, ids, w, lora, fused=False)   # the two-kernel bin path
    two.run()
    torch.cuda.synchronize()
    if not (torch.equal(two.out, full.out) and torch.equal(two.shrink_out, full.shrink_out)):
        print("  WRONG bgmv: plan bits differ from the two-kernel plan's", flush=True)
        ok = False
    for t, sl in ((1024, slice(None)), (1, slice(7, 8)), (33, slice(100, 133)), (300, slice(500, 800))):
        p = prepare_bgmv_moe(x[sl].contiguous(), a, b, ids[sl].contiguous(), w[sl].contiguous(), lora[sl].contiguous(),
                             fused=fused)
        p.run()
        torch.cuda.synchronize()
        s_ref = bgmv_shrink_reference(x[sl], a, ids[sl], lora[sl])
        y_ref = bgmv_expand_reference(p.shrink_out, b, ids[sl], lora[sl], w[sl])
        good = bool(((p.shrink_out.float() - s_ref).abs() <= 2 ** -8 * s_ref.abs() + 1e-3).all()) and \
            bool(((p.out - y_ref).abs() <= 1e-4 * y_ref.abs() + 1e-4).all()) and \
            torch.equal(p.out, full.out[sl]) and torch.equal(p.shrink_out.view(t, 6, -1), full.shrink_out.view(1024, 6, -1)[sl])
        if not good:
            print(f"  WRONG bgmv T={t}", flush=True)
        ok &= good
    ts = os.environ.get("TUNE_BGMV_T", "1,4,8,32,256,512,1024,2048")   # the timed batch sizes
    for t in (int(v) for v in ts.split(",")):
        x, a, b, ids, w, lora = problem(t, 2688, r, 128, 6, t)
        p = prepare_bgmv_moe(x, a, b, ids, w, lora, fused=fused)
        row[f"T{t}_us"] = round(1e3 * time_graph_ms(p.run, reps=20), 2)
        if t >= 256 and len(p._calls) == 2:  # the two kernels alone (each its own replay)
            row[f"T{t}s_us"] = round(1e3 * time_graph_ms(p._calls[0].launch, reps=20), 2)
            row[f"T{t}e_us"] = round(1e3 * time_graph_ms(p._calls[1].launch, reps=20), 2)
    # more benchmark shapes at large T: $TUNE_BGMV_SHAPES = "H:r:E:k,..."
    for shape in filter(None, os.environ.get("TUNE_BGMV_SHAPES", "").split(",")):
        h, rr, e, k = (int(v) for v in shape.split(":"))
        for t in (256, 512, 1024, 2048):
            x, a, b, ids, w, lora = problem(t, h, rr, e, k, t)
            p = prepare_bgmv_moe(x, a, b, ids, w, lora, fused=fused)
            row[f"T{t}_H{h}r{rr}E{e}k{k}_us"] = round(1e3 * time_graph_ms(p.run, reps=20), 2)
    return ok


def run(root: Path, out_dir: Path, only=None):
    from cutekern import dispatch
    from cutekern.registry import OPS as REG
    rows = []
    for d in sorted(p for p in root.iterdir() if (p / "tune.json").exists() and (only is None or p.name == only)):
        c = json.loads((d / "tune.json").read_text())
        os.environ["CUTEKERN_ARTIFACTS"] = str(d)
        os.environ["CUTEKERN_DESIGN"] = c["design"]
        row = {"config": d.name, **c}
        try:
            if c["op"] == "attn_res":
                splits = sorted({dict(f)["row_split"] for _, f in REG["attn_res"].variants_for(c["design"])})
                row["correct"] = _attn_res(c["design"], splits, row)
            else:
                row["correct"] = _bgmv(row)
        except Exception as e:  # keep going: one broken config must not hide the others
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        dispatch._cached_function.cache_clear()
        dispatch._manifest.cache_clear()
        rows.append(row)
        print(json.dumps(row), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tune_memops.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--make", type=Path)
    ap.add_argument("configs", nargs="?", default="{}")
    ap.add_argument("--root", type=Path)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--only", default=None)
    a = ap.parse_args()
    if a.make:
        make(a.make, json.loads(a.configs))
    else:
        run(a.root, a.out, a.only)
