"""perf/results/*.json -> the README performance table (between markers) and PNG plots."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "perf" / "results"
BEGIN, END = "<!-- perf-table:begin -->", "<!-- perf-table:end -->"


def lce_table(doc: dict) -> str:
    designs = doc.get("designs", [])
    cols = ["broadcast_bmm", "decomposed", "decomposed_padded"] + [f"cutekern_{d}" for d in designs]
    ceil = doc["ceilings"]["matmul_fp16_tflops"]
    lines = [f"**IKBO LCE** on {doc['device']} (commit `{doc['git_commit'][:10]}`, {doc['date'][:10]}, "
             f"torch {doc['torch']}; measured fp16 matmul ceiling {ceil:.0f} TFLOP/s). "
             f"Eager calls, cold L2, median ms (useful TFLOP/s); last columns: CUDA-graph replay "
             f"of the best cutekern design and its fraction of the ceiling.",
             "",
             "| case | B | ratio | " + " | ".join(cols) + " | cutekern vs padded decomposed | graph replay | of ceiling |",
             "|---|---|---|" + "---|" * len(cols) + "---|---|---|"]
    for c in doc["cases"]:
        best = min((c["timings_ms"][f"cutekern_{d}"] for d in designs), default=None)
        sp = c["timings_ms"]["decomposed_padded"] / best if best else float("nan")
        g = c.get("graph_timings_ms", {})
        gbest = min((g[f"cutekern_{d}"] for d in designs if f"cutekern_{d}" in g), default=None)
        gtxt = f"{gbest:.3f} ({c['graph_tflops'][min((k for k in g if k.startswith('cutekern')), key=g.get)]:.0f})" if gbest else "-"
        frac = f"{max(v for k, v in c.get('graph_tflops', c['tflops']).items() if k.startswith('cutekern')) / ceil:.0%}"
        lines.append(f"| {c['name']} | {c['shape']['B']} | {c['shape']['ratio']} | " + " | ".join(
            f"{c['timings_ms'][k]:.3f} ({c['tflops'][k]:.0f})" for k in cols) + f" | {sp:.2f}x | {gtxt} | {frac} |")
    return "\n".join(lines)


def plot_lce(doc: dict, path: Path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    cases = [c for c in doc["cases"] if c["name"].startswith("sweep")]
    keys = list(cases[0]["tflops"].keys()) if cases else []
    fig, ax = plt.subplots(figsize=(12, 4.5))
    x = range(len(cases))
    for k in keys:
        ax.plot(x, [c["tflops"][k] for c in cases], marker="o", label=k)
    ax.set_xticks(list(x), [f"B{c['shape']['B']}\nr{c['shape']['ratio']}" for c in cases], fontsize=7)
    ax.set_ylabel("useful TFLOP/s")
    ax.set_title(f"IKBO LCE sweep on {doc['device']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def attention_table(doc: dict) -> str:
    cols = sorted({k for c in doc["cases"] for k in c["timings_ms"]},
                  key=lambda k: (not k.startswith("cutekern"), k))
    ceil = doc["ceilings"]["matmul_fp16_tflops"]
    graph = any("eager_ms" in c for c in doc["cases"])
    how = ("CUDA-graph replays (cutekern through a plan); eager times are in the JSON"
           if graph else "eager calls")
    lines = [f"**IKBO attention** on {doc['device']} (commit `{doc['git_commit'][:10]}`, "
             f"{doc['date'][:10]}; B=2048, n_seed=64, H=2, D=128, bf16, 64 candidates per user; "
             f"ragged: counts 64 + 0/1, kv_len uniform in [S/2, S]). {how}, cold L2, median ms "
             f"(TFLOP/s); '-' = not applicable; last columns: the sm90 kernel over the "
             f"routes of the issue and its fraction of the measured {ceil:.0f} TFLOP/s matmul.", "",
             "| case | " + " | ".join(cols) + " | vs cuDNN pre-bcast | vs bcast + cuDNN | vs best torch | of ceiling |",
             "|---|" + "---|" * (len(cols) + 4)]
    for c in doc["cases"]:
        t, f = c["timings_ms"], c["tflops"]
        ck = t.get("cutekern_sm90")

        def ratio(k):
            return f"{t[k] / ck:.2f}x" if ck and k in t else "-"
        torch_routes = [k for k in t if not k.startswith("cutekern")]
        best = min(torch_routes, key=t.get) if torch_routes else None
        lines.append(f"| {c['name']} | " + " | ".join(
            f"{t[k]:.3f} ({f[k]:.0f})" if k in t else "-" for k in cols)
            + f" | {ratio('sdpa_cudnn_prebroadcast')} | {ratio('broadcast_plus_sdpa_cudnn')}"
            + f" | {ratio(best) if best else '-'} | "
            + (f"{f['cutekern_sm90'] / ceil:.0%}" if ck else "-") + " |")
    return "\n".join(lines)


def attn_res_table(doc: dict) -> str:
    designs = doc.get("designs", [])
    ceil = doc["ceilings"]["copy_gbps"]
    cols = [f"cutekern_{d}" for d in designs] + ["torch_eager", "torch_compile"]
    lines = [f"**AttnRes** on {doc['device']} (commit `{doc['git_commit'][:10]}`, {doc['date'][:10]}; "
             f"H=7168, 8 slots, delta + output norm; CUDA-graph replays, cold L2, median). "
             f"us (effective GB/s = (K+4)*M*H*2/t); measured copy ceiling {ceil:.0f} GB/s, one-kernel "
             f"launch latency {doc['launch_latency_us']:.1f} us; '-' = not timed.", "",
             "| K | M | " + " | ".join(cols) + " | best cutekern of ceiling | x launch latency | vs torch.compile |",
             "|---|---|" + "---|" * len(cols) + "---|---|---|"]
    for c in doc["cases"]:
        t, g = c["timings_us"], c["gbps"]
        best = min((f"cutekern_{d}" for d in designs), key=lambda k: t[k])
        vs = f"{t['torch_compile'] / t[best]:.1f}x" if "torch_compile" in t else "-"
        lines.append(f"| {c['shape']['K']} | {c['shape']['M']} | " + " | ".join(
            f"{t[k]:.1f} ({g[k]:.0f})" if k in t else "-" for k in cols)
            + f" | {g[best] / ceil:.0%} | {t[best] / doc['launch_latency_us']:.1f} | {vs} |")
    return "\n".join(lines)


def bgmv_table(doc: dict) -> str:
    ceil = doc["ceilings"]["copy_gbps"]
    cols = sorted({k for c in doc["cases"] for k in c["timings_us"]},
                  key=lambda k: (not k.startswith("cutekern"), k))
    lines = [f"**BGMV MoE-LoRA** on {doc['device']} (commit `{doc['git_commit'][:10]}`, {doc['date'][:10]}; "
             f"{doc['adapters']} adapters, bf16, shrink + finalized expand as one CUDA-graph replay, "
             f"cold L2, median). us (GB/s of the spec's roofline bytes); measured copy ceiling "
             f"{ceil:.0f} GB/s; `_sorted` = pairs passed in expert-sorted order.", "",
             "| H | r | E | top-k | T | " + " | ".join(cols) + " | best cutekern of ceiling | vs torch |",
             "|---|---|---|---|---|" + "---|" * len(cols) + "---|---|"]
    for c in doc["cases"]:
        t, g, sh = c["timings_us"], c["gbps"], c["shape"]
        best = min((k for k in t if k.startswith("cutekern")), key=t.get)
        lines.append(f"| {sh['H']} | {sh['r']} | {sh['E']} | {sh['top_k']} | {sh['T']} | " + " | ".join(
            f"{t[k]:.1f} ({g[k]:.0f})" if k in t else "-" for k in cols)
            + f" | {g[best] / ceil:.0%} | {t['torch_gather_einsum'] / t[best]:.1f}x |")
    return "\n".join(lines)


TABLES = {"lce": (lce_table, plot_lce), "ikbo_attention": (attention_table, None),
          "attn_res": (attn_res_table, None), "bgmv_moe": (bgmv_table, None)}


def main() -> int:
    parts = []
    for op, (table, plot) in TABLES.items():
        f = RESULTS / f"{op}.json"
        if not f.exists():
            continue
        doc = json.loads(f.read_text())
        parts.append(table(doc))
        if plot is not None:
            plot(doc, RESULTS / f"{op}.png")
    readme = ROOT / "README.md"
    text = readme.read_text()
    if BEGIN not in text:
        print("README has no perf-table markers", file=sys.stderr)
        return 1
    body = "\n\n".join(parts) if parts else "_No GPU results committed yet._"
    pre, rest = text.split(BEGIN, 1)
    _, post = rest.split(END, 1)
    readme.write_text(f"{pre}{BEGIN}\n{body}\n{END}{post}")
    print("README performance table updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
