"""Decode attention with q / k RMSNorm, RoPE and the KV-cache append (cutekern.decode, the Ada
design built for sm_90a: kernels/ada/decode_attn.py) against what a torch user would run in
the same process on the same static cache [B, Hkv, S, 128]:
- eager: rms_norm of q and k, RoPE from the same table, index_put of k / v at lens, then
  scaled_dot_product_attention (GQA) over the cache with a length mask (HF's static-cache
  route);
- torch.compile of the same function.

Qwen3-1.7B's heads (16 q / 8 KV, head_dim 128), bf16, batches 1 / 4 / 16 / 64 at context
lengths 76 (the spec's 64 in + 12 out), 1024 and 4096 (every row at that length); CUDA-graph
replays after an L2 flush (perf/common.py). Reported per case: times, ratios, achieved GB/s
of the bytes the step must move (the rows' cached K and V up to their length, qkv, out, the
appended k / v) against the measured copy ceiling, and each route's max error against
float64 (reference.decode_attention_reference)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measured_ceilings, time_graph_ms, write_results  # noqa: E402

from cutekern.decode import HEAD_DIM, decode_attention, rope_table  # noqa: E402
from cutekern.reference import decode_attention_reference  # noqa: E402

HQ, HKV = 16, 8          # Qwen3-1.7B
BATCHES = (1, 4, 16, 64)
CONTEXTS = (76, 1024, 4096)


def random_step(b, ctx, g, dt):
    """One step's inputs at Qwen3-1.7B's heads: qkv [b, (HQ + 2 HKV) 128], K / V caches of
    ctx + 1 positions filled with random rows, every row at ctx, and an empty out."""
    s = ctx + 1
    qkv = torch.randn(b, (HQ + 2 * HKV) * HEAD_DIM, device="cuda", generator=g).to(dt)
    kc = torch.randn(b, HKV, s, HEAD_DIM, device="cuda", generator=g).to(dt)
    vc = torch.randn(b, HKV, s, HEAD_DIM, device="cuda", generator=g).to(dt)
    lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty(b, HQ * HEAD_DIM, device="cuda", dtype=dt)
    return qkv, kc, vc, lens, out


def torch_step(qkv, kc, vc, lens, qn, kn, rope, eps=1e-6):
    """The eager route: the same contract in torch ops (static cache, masked SDPA)."""
    b = qkv.shape[0]
    x = qkv.view(b, HQ + 2 * HKV, HEAD_DIM)
    q = F.rms_norm(x[:, :HQ].float(), (HEAD_DIM,), qn.float(), eps)
    k = F.rms_norm(x[:, HQ:HQ + HKV].float(), (HEAD_DIM,), kn.float(), eps)
    cs = rope[lens.long()]                                           # [B, 128]
    cos = torch.cat([cs[:, :64], cs[:, :64]], -1)[:, None]
    sin = torch.cat([cs[:, 64:], cs[:, 64:]], -1)[:, None]
    rot = lambda t: t * cos + torch.cat([-t[..., 64:], t[..., :64]], -1) * sin  # noqa: E731
    q, k = rot(q).to(qkv.dtype), rot(k).to(qkv.dtype)
    rows = torch.arange(b, device=qkv.device)
    kc[rows, :, lens.long()] = k
    vc[rows, :, lens.long()] = x[:, HQ + HKV:]
    mask = torch.arange(kc.shape[2], device=qkv.device)[None] <= lens[:, None]
    o = F.scaled_dot_product_attention(q[:, :, None], kc, vc, attn_mask=mask[:, None, None],
                                       enable_gqa=True)
    return o.reshape(b, HQ * HEAD_DIM)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="5 reps, batches 1 / 16, two contexts")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=None)
    args = ap.parse_args()
    batches, contexts = (BATCHES, CONTEXTS) if not args.quick else ((1, 16), (76, 1024))
    batches, contexts = args.batches or batches, args.contexts or contexts
    if args.quick:
        args.reps = 5
    dt = torch.bfloat16
    ceil = measured_ceilings()
    print(f"ceilings: {ceil}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    qn = (1 + 0.2 * torch.randn(HEAD_DIM, device="cuda", generator=g)).to(dt)
    kn = (1 + 0.2 * torch.randn(HEAD_DIM, device="cuda", generator=g)).to(dt)
    compiled = torch.compile(torch_step, dynamic=True)
    cases = []
    for ctx in contexts:
        rope = rope_table(ctx + 1, device="cuda")
        for b in batches:
            qkv, kc, vc, lens, out = random_step(b, ctx, g, dt)
            kc0, vc0 = kc.clone(), vc.clone()

            def ours():
                decode_attention(qkv, kc, vc, lens, qn, kn, rope, out=out)

            ref = decode_attention_reference(qkv, kc0, vc0, lens.cpu(), qn, kn)[0]
            ours()
            y_eager = torch_step(qkv, kc, vc, lens, qn, kn, rope)
            y_comp = compiled(qkv, kc, vc, lens, qn, kn, rope)
            torch.cuda.synchronize()
            errs = {n: (y.double() - ref).abs().max().item()
                    for n, y in (("ck", out), ("eager", y_eager), ("compile", y_comp))}
            t_ours = time_graph_ms(ours, reps=args.reps)
            t_eager = time_graph_ms(lambda: torch_step(qkv, kc, vc, lens, qn, kn, rope),
                                    reps=args.reps)
            t_comp = time_graph_ms(lambda: compiled(qkv, kc, vc, lens, qn, kn, rope),
                                   reps=args.reps)
            nbytes = (b * HKV * ctx * HEAD_DIM * 2 * 2 + qkv.numel() * 2 + out.numel() * 2
                      + b * HKV * HEAD_DIM * 2 * 2)
            gbps = nbytes / t_ours / 1e6
            case = dict(batch=b, context=ctx, q_heads=HQ, kv_heads=HKV, dtype="bfloat16",
                        ck_graph_ms=t_ours, eager_graph_ms=t_eager, compile_graph_ms=t_comp,
                        ratio_vs_eager=t_eager / t_ours, ratio_vs_compile=t_comp / t_ours,
                        bytes=nbytes, ck_gbps=gbps, frac_copy_ceiling=gbps / ceil["copy_gbps"],
                        max_abs_err=errs)
            cases.append(case)
            print(f"ctx {ctx:5d} b {b:3d}: ck {t_ours * 1e3:7.2f} us  eager {t_eager * 1e3:7.2f} "
                  f"({case['ratio_vs_eager']:.2f}x)  compile {t_comp * 1e3:7.2f} "
                  f"({case['ratio_vs_compile']:.2f}x)  {gbps:6.0f} GB/s "
                  f"({case['frac_copy_ceiling']:.0%})  err {errs}", flush=True)
    path = write_results("decode_attn", cases, args.out, extra={"ceilings": ceil})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
