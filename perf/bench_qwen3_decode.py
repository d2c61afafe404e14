"""Whole decode steps of Qwen3-1.7B (28 layers, tied 151936-row head; random weights in the
real layout): cutekern's W4A16 decoder in launches (cutekern.qwen3: w4a16_linear,
decode_attention, w4a16_mlp per layer, add_rms_norm; the tied head in bf16 through cuBLAS,
and again with ``quantize_head=True``: the head in W4A16 too) against what a torch user runs
for the same model: the dequantized weights in bf16, F.linear, the static-cache attention of
perf/bench_decode_attn.py (masked SDPA), the same fp32 residual. The routes are each one CUDA
graph per step (as serving engines run decode), replayed with the rows'
lengths reset first (one tiny copy in each). Batches 1 / 4 / 8 / 16 at 64 and 1024 cached
tokens (the spec's 64 in / 12 out, and a long context).

Reported per case: ms per step, tokens/s, the ratio, the bytes a step must stream (weights
as each route stores them, the rows' K / V, the logits) as GB/s and fraction of the measured
copy ceiling, and the max |logit difference| between the routes relative to the largest
logit (the same quantized model, so only rounding differs). The W4A16 head changes the model,
so its logits are checked instead against its own input times the dequantized head (fp32)."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import capture_graph, measured_ceilings, time_ms, write_results  # noqa: E402

from bench_decode_attn import torch_step  # noqa: E402  (16 q / 8 KV heads: Qwen3-1.7B's)
from cutekern.decode import HEAD_DIM, rope_table  # noqa: E402
from cutekern.qwen3 import LINEARS, prepare_qwen3_decoder  # noqa: E402
from cutekern.reference import (Qwen3Config, decode_weight_bytes, w4a16_dequantize,  # noqa: E402
                                w4a16_quantize)

BATCHES = (1, 4, 8, 16)
CONTEXTS = (64, 1024)


def random_model(cfg, dt, seed=0):
    """qwen3_params's layout and scales, drawn on the GPU (2 G weights); every linear as its
    GPTQ pair for cutekern and as the dequantized bf16 weight for torch."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    d, f = cfg.hidden, cfg.intermediate
    hq, hk = cfg.q_heads * HEAD_DIM, cfg.kv_heads * HEAD_DIM
    shapes = dict(q=(hq, d), k=(hk, d), v=(hk, d), o=(d, hq), gate=(f, d), up=(f, d),
                  down=(d, f))
    norm = lambda n: (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(dt)  # noqa: E731
    gptq, dense = [], []
    for _ in range(cfg.layers):
        lq, ld = dict(input_norm=norm(d), post_norm=norm(d), q_norm=norm(HEAD_DIM),
                      k_norm=norm(HEAD_DIM)), {}
        for n in LINEARS:
            o, i = shapes[n]
            w = (torch.randn(o, i, device="cuda", generator=g) / math.sqrt(i)).to(dt)
            qw, sc = w4a16_quantize(w, 128)
            lq[n] = (qw, sc)
            ld[n] = w4a16_dequantize(qw, sc, 128, dtype=torch.float32).to(dt).contiguous()
        gptq.append(lq)
        dense.append(dict(ld, **{k: lq[k] for k in ("input_norm", "post_norm", "q_norm",
                                                      "k_norm")}))
    embed = torch.randn(cfg.vocab, d, device="cuda", generator=g).to(dt)
    return dict(embed=embed, layers=gptq, final_norm=norm(d)), dense


class TorchDecoder:
    """The torch route: bf16 F.linear, torch_step's attention, cutekern's buffers' shapes."""

    def __init__(self, cfg, dense, embed, final_norm, batch, max_len):
        self.cfg, self.embed = cfg, embed
        self.final_norm = final_norm.float()
        self.layers = [dict(qkv=torch.cat([p["q"], p["k"], p["v"]], 0), o=p["o"],
                            gu=torch.cat([p["gate"], p["up"]], 0), down=p["down"],
                            input_norm=p["input_norm"].float(), post_norm=p["post_norm"].float(),
                            q_norm=p["q_norm"], k_norm=p["k_norm"]) for p in dense]
        dt, hk = embed.dtype, cfg.kv_heads
        cache = lambda: torch.zeros(batch, hk, max_len, HEAD_DIM, dtype=dt, device="cuda")  # noqa: E731
        self.k_cache = [cache() for _ in dense]
        self.v_cache = [cache() for _ in dense]
        self.lens = torch.zeros(batch, dtype=torch.int32, device="cuda")
        self.tokens = torch.zeros(batch, dtype=torch.int64, device="cuda")
        self.rope = rope_table(max_len, device="cuda")
        self.logits = None

    def forward(self):
        cfg, eps, d = self.cfg, self.cfg.eps, self.cfg.hidden
        x = self.embed[self.tokens].float()
        for i, p in enumerate(self.layers):
            h = F.rms_norm(x, (d,), p["input_norm"], eps).to(self.embed.dtype)
            qkv = F.linear(h, p["qkv"])
            a = torch_step(qkv, self.k_cache[i], self.v_cache[i], self.lens, p["q_norm"],
                           p["k_norm"], self.rope, eps)
            x = x + F.linear(a, p["o"]).float()
            h = F.rms_norm(x, (d,), p["post_norm"], eps).to(self.embed.dtype)
            g, u = F.linear(h, p["gu"]).chunk(2, -1)
            x = x + F.linear(F.silu(g) * u, p["down"]).float()
        h = F.rms_norm(x, (d,), self.final_norm, eps).to(self.embed.dtype)
        self.logits = h @ self.embed.t()
        self.lens.add_(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--quick", action="store_true", help="5 reps, batches 1 / 16, 4 layers")
    args = ap.parse_args()
    batches = BATCHES if not args.quick else (1, 16)
    if args.quick:
        args.reps, args.layers = 5, 4
    cfg = Qwen3Config(layers=args.layers)
    dt = torch.bfloat16
    ceil = measured_ceilings()
    print(f"ceilings: {ceil}", flush=True)
    params, dense = random_model(cfg, dt)
    print("model ready", flush=True)
    w4_bytes = decode_weight_bytes(cfg, quant_layers=True, quant_head=False)
    bf16_bytes = decode_weight_bytes(cfg, quant_layers=False, quant_head=False)
    wq_bytes = decode_weight_bytes(cfg, quant_layers=True, quant_head=True)
    base = prepare_qwen3_decoder(params, cfg, batch=1, max_len=2)
    qhead = w4a16_quantize(params["embed"], 128)
    base_q = prepare_qwen3_decoder(dict(params, lm_head=qhead), cfg, batch=1, max_len=2,
                                   quantize_head=True)
    deq_head = w4a16_dequantize(*qhead, 128, dtype=torch.float32)          # [vocab, hidden]
    del qhead
    cases = []
    for ctx in CONTEXTS:
        for b in batches:
            max_len = ctx + 2
            ours = base.resized(b, max_len)
            ours_q = base_q.resized(b, max_len)
            ref = TorchDecoder(cfg, dense, params["embed"], params["final_norm"], b, max_len)
            g = torch.Generator(device="cuda").manual_seed(ctx + b)
            for i in range(cfg.layers):        # the same cached rows in both
                for kc in (ours.k_cache[i], ours.v_cache[i]):
                    kc.normal_(generator=g)
                for r in (ref, ours_q):
                    r.k_cache[i].copy_(ours.k_cache[i])
                    r.v_cache[i].copy_(ours.v_cache[i])
            tok = torch.randint(0, cfg.vocab, (b,), device="cuda", generator=g)
            l0 = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
            for r in (ours, ref, ours_q):
                r.tokens.copy_(tok)
                r.lens.copy_(l0)
            g_ours = capture_graph(ours._forward)
            g_ref = capture_graph(ref.forward)
            g_q = capture_graph(ours_q._forward)
            for r, gr in ((ours, g_ours), (ref, g_ref), (ours_q, g_q)):
                r.lens.copy_(l0)
                if r.logits is not None:             # the torch route's is the graph's own
                    r.logits.fill_(float("nan"))
                gr.replay()
            torch.cuda.synchronize()
            a, r = ours.logits.double(), ref.logits.double()
            rel = ((a - r).abs().max() / r.abs().max()).item()
            nan = bool(torch.isnan(a).any())
            want_q = (ours_q._h.float() @ deq_head.t()).double()
            rel_q = ((ours_q.logits.double() - want_q).abs().max() / want_q.abs().max()).item()
            nan = nan or bool(torch.isnan(ours_q.logits).any())
            t_ours = time_ms(lambda: (ours.lens.copy_(l0), g_ours.replay()), reps=args.reps)
            t_ref = time_ms(lambda: (ref.lens.copy_(l0), g_ref.replay()), reps=args.reps)
            t_q = time_ms(lambda: (ours_q.lens.copy_(l0), g_q.replay()), reps=args.reps)
            kv = 2 * cfg.layers * b * cfg.kv_heads * (ctx + 1) * HEAD_DIM * 2
            logit_bytes = b * cfg.vocab * 2
            by_ours, by_ref = w4_bytes + kv + logit_bytes, bf16_bytes + kv + logit_bytes
            by_q = wq_bytes + kv + logit_bytes
            case = dict(batch=b, context=ctx, layers=cfg.layers, dtype="bfloat16",
                        ck_graph_ms=t_ours, torch_bf16_graph_ms=t_ref,
                        ratio_vs_torch_bf16=t_ref / t_ours, ck_tokens_per_s=b / t_ours * 1e3,
                        torch_tokens_per_s=b / t_ref * 1e3, ck_bytes=by_ours,
                        torch_bytes=by_ref, ck_gbps=by_ours / t_ours / 1e6,
                        torch_gbps=by_ref / t_ref / 1e6,
                        ck_frac_copy_ceiling=by_ours / t_ours / 1e6 / ceil["copy_gbps"],
                        ck_floor_ms=by_ours / ceil["copy_gbps"] / 1e6,
                        max_rel_logit_diff=rel, ck_nan=nan,
                        ck_w4head_graph_ms=t_q, ratio_w4head_vs_torch_bf16=t_ref / t_q,
                        ck_w4head_tokens_per_s=b / t_q * 1e3, ck_w4head_bytes=by_q,
                        ck_w4head_gbps=by_q / t_q / 1e6,
                        ck_w4head_frac_copy_ceiling=by_q / t_q / 1e6 / ceil["copy_gbps"],
                        ck_w4head_floor_ms=by_q / ceil["copy_gbps"] / 1e6,
                        w4head_max_rel_logit_err=rel_q)
            cases.append(case)
            print(f"ctx {ctx:5d} b {b:3d}: ck {t_ours:7.3f} ms  torch bf16 {t_ref:7.3f} ms "
                  f"({case['ratio_vs_torch_bf16']:.2f}x)  ck {case['ck_gbps']:6.0f} GB/s "
                  f"({case['ck_frac_copy_ceiling']:.0%} of copy; floor "
                  f"{case['ck_floor_ms']:.3f} ms)  logit diff {rel:.2e} nan {nan}\n"
                  f"{'':17s}w4 head {t_q:7.3f} ms ({t_ref / t_q:.2f}x torch)  "
                  f"{case['ck_w4head_gbps']:6.0f} GB/s "
                  f"({case['ck_w4head_frac_copy_ceiling']:.0%} of copy; floor "
                  f"{case['ck_w4head_floor_ms']:.3f} ms)  head err {rel_q:.2e}", flush=True)
            del g_ours, g_ref, g_q, ours, ref, ours_q
            torch.cuda.empty_cache()
    path = write_results("qwen3_decode", cases, args.out, extra={"ceilings": ceil,
                                                                 "model": "Qwen3-1.7B dims"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
