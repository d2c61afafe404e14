"""Tune the LCE kernels on the GPU: every export directory under --root (one tile config
each, made by `python3 perf/tune_lce.py --make ROOT` on the CPU box) is timed at the
reference shape, phase by phase, through the runtime."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# what the last tuning run compared (see perf/NOTES.md for the outcomes)
CONFIGS = {
    "sm90": {
        "default": {},
        "c22_n128": {"cluster_m": 2, "num_ctas": 128},
        "c22_n120": {"cluster_m": 2, "num_ctas": 120},
        "c22_n112": {"cluster_m": 2, "num_ctas": 112},
        "c22_n104": {"cluster_m": 2, "num_ctas": 104},
    },
}


def make(root: Path):
    from cutekern.export import export
    for design, cfgs in CONFIGS.items():
        for name, ov in cfgs.items():
            export(("sm_90a",), root / f"{design}-{name}", designs=[design], ops=["lce_gemm"],
                   overrides={design: ov}, log=lambda *a: None)
            print("made", design, name, flush=True)


def run(root: Path, out_dir: Path):
    import torch
    from common import LCE_REF, lce_problem, time_ms
    from cutekern.runtime import Manifest
    from cutekern.reference import pad_k, lce_reference

    M, N, KU, KC, B = LCE_REF["M"], LCE_REF["N"], LCE_REF["K_user"], LCE_REF["K_cand"], 1024
    dt = torch.float16
    wc, wu, ec, eu, c2u = lce_problem(B, 70, dt)
    wc, wu, u = pad_k(wc), pad_k(wu), eu.shape[0]
    ref = lce_reference(wc[:, :KC], wu[:, :KU], ec, eu, c2u)
    flops = 2 * M * N * (B * KC + u * KU)
    from cutekern.reference import lce_decomposed, lce_decomposed_padded, pad_k_rows
    ecp, eup = pad_k_rows(ec), pad_k_rows(eu)
    t_pad = time_ms(lambda: lce_decomposed_padded(wc, wu, ecp, eup, c2u))
    t_dec = time_ms(lambda: lce_decomposed(wc[:, :KC], wu[:, :KU], ec, eu, c2u))
    t_mm = time_ms(lambda: torch.matmul(wc, ecp))
    print(f"baselines: decomposed {t_dec:.3f} ms, decomposed_padded {t_pad:.3f} ms, "
          f"padded cand matmul alone {t_mm:.3f} ms", flush=True)
    rows = [{"baseline_decomposed_ms": t_dec, "baseline_decomposed_padded_ms": t_pad,
             "padded_cand_matmul_ms": t_mm}]
    for d in sorted(p for p in root.iterdir() if (p / "manifest.json").exists()):
        design = d.name.split("-")[0]
        man = Manifest(d)
        f_user = man.function("lce_gemm", design, "sm_90a", {"ab": "float16", "c": "float32"}, {"has_addend": False})
        f_cand = man.function("lce_gemm", design, "sm_90a", {"ab": "float16", "c": "float16"}, {"has_addend": True})
        f_noadd = man.function("lce_gemm", design, "sm_90a", {"ab": "float16", "c": "float32"}, {"has_addend": False})
        part = torch.empty(u, M, N, device="cuda")
        out = torch.full((B, M, N), float("nan"), dtype=dt, device="cuda")
        out32 = torch.empty(B, M, N, device="cuda")

        def both():
            f_user(wu, eu, part, part, c2u)
            f_cand(wc, ec, out, part, c2u)
        both()
        torch.cuda.synchronize()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        t_both = time_ms(both)
        t_user = time_ms(lambda: f_user(wu, eu, part, part, c2u))
        t_cand = time_ms(lambda: f_cand(wc, ec, out, part, c2u))
        t_cand32 = time_ms(lambda: f_noadd(wc, ec, out32, part, c2u))
        row = {"config": d.name, "config_fields": man.data["kernels"][0]["config"], "rel_err": err,
               "total_ms": t_both, "user_ms": t_user, "cand_addend_f16out_ms": t_cand,
               "cand_noaddend_f32out_ms": t_cand32, "useful_tflops": flops / t_both / 1e9}
        rows.append(row)
        print(f"{d.name:28s} err={err:.2e} total={t_both:.3f} user={t_user:.3f} cand={t_cand:.3f} "
              f"cand_noadd_f32={t_cand32:.3f} ms  {row['useful_tflops']:.0f} TF", flush=True)
    (out_dir / "tune_lce.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--make", type=Path)
    ap.add_argument("--root", type=Path)
    ap.add_argument("--out", type=Path, default=Path("."))
    a = ap.parse_args()
    if a.make:
        make(a.make)
    else:
        run(a.root, a.out)
