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


def host_us(fn, reps=50) -> float:
    """Host time of one call (launches only; the GPU is not waited for)."""
    import time
    import torch
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t = (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    return round(t, 1)


def host_breakdown(q, k, v, c2u) -> dict:
    """Host microseconds of the steps of ikbo.attention's eager path."""
    from cutekern import ikbo
    from cutekern._attn_work import build_work
    plan = ikbo.plan_attention(q, k, v, c2u, check_indices=False)
    return {
        "validate": host_us(lambda: ikbo._validate_attention(q, k, v, c2u, None)),
        "build_work": host_us(lambda: build_work(c2u, k.shape[0], q.shape[1], 128)),
        "plan": host_us(lambda: ikbo.plan_attention(q, k, v, c2u, check_indices=False)),
        "plan_run": host_us(lambda: plan.run(q, k, v)),
        "one_shot": host_us(lambda: ikbo.attention(q, k, v, c2u, check_indices=False)),
    }


def run(root: Path, out_dir: Path, only=None, reps=3, seqs=(1024, 4096, 8192, 16384)):
    """Correctness of every config, then CUDA-graph replay times of plan.run (the kernel
    alone) with the configs interleaved `reps` times per shape, so clock and thermal drift
    hit all configs alike; eager one-shot and host costs once per config."""
    import torch
    from common import time_graph_ms, time_ms
    from cutekern import dispatch
    from cutekern.ikbo import attention, plan_attention
    from cutekern.reference import ikbo_attention_reference

    os.environ["CUTEKERN_DESIGN"] = "sm90"
    dirs = sorted(p for p in root.iterdir() if (p / "manifest.json").exists()
                  and (only is None or p.name == only))
    rows = {d.name: {"config": d.name} for d in dirs}

    def use(d):
        os.environ["CUTEKERN_ARTIFACTS"] = str(d)
        dispatch._cached_function.cache_clear()

    for d in dirs:
        use(d)
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
        rows[d.name]["correct"] = ok

    for s in seqs:
        b, u = 2048, 32
        c2u = torch.repeat_interleave(torch.arange(u), 64).int().cuda()
        q = torch.randn(b, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(u, s, 2, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(u, s, 2, 128, device="cuda", dtype=torch.bfloat16)
        flops = 4 * b * 2 * 64 * 128 * s
        plans = {}
        for d in dirs:
            use(d)
            row = rows[d.name]
            row[f"S{s}_eager_ms"] = time_ms(lambda: attention(q, k, v, c2u, check_indices=False),
                                            reps=10)
            plans[d.name] = plan = plan_attention(q, k, v, c2u, check_indices=False)
            row[f"S{s}_plan_eager_ms"] = time_ms(lambda: plan.run(q, k, v), reps=10)
            if s == 8192:
                row["host_us_S8192"] = host_breakdown(q, k, v, c2u)
        for _ in range(reps):
            for d in dirs:
                plan = plans[d.name]
                rows[d.name].setdefault(f"S{s}_graph_ms_all", []).append(
                    time_graph_ms(lambda: plan.run(q, k, v), reps=10))
        for d in dirs:
            row = rows[d.name]
            tg = min(row[f"S{s}_graph_ms_all"])
            row[f"S{s}_graph_ms"] = tg
            row[f"S{s}_graph_tflops"] = flops / tg / 1e9
        del plans
    for row in rows.values():
        print(json.dumps({k: v for k, v in row.items() if "all" not in k}), flush=True)
    (out_dir / "tune_attn.json").write_text(json.dumps(list(rows.values()), indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--make", type=Path)
    ap.add_argument("configs", nargs="?", default='{"default": {}}')
    ap.add_argument("--root", type=Path)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--only", default=None, help="one config directory name")
    ap.add_argument("--reps", type=int, default=3, help="interleaved rounds per shape")
    ap.add_argument("--seqs", default="1024,4096,8192,16384", help="key lengths S")
    a = ap.parse_args()
    if a.make:
        make(a.make, json.loads(a.configs))
    else:
        run(a.root, a.out, a.only, a.reps, tuple(int(x) for x in a.seqs.split(",")))
