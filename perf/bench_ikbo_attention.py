"""IKBO attention benchmark on one GPU: cutekern against SDPA (flash and cuDNN) on
pre-broadcast K/V, the same including the broadcast, and cuDNN on packed queries (uniform
counts only), all timed in the same run with a cold L2. FLOPs = 4*B*H*n_seed*D*sum(kv_len).

Every route is timed as a CUDA-graph replay (`timings_ms`: device time, as a serving engine
launches it) and as eager calls (`eager_ms`: includes whatever host time the GPU waits for).
cutekern is timed through a plan (`plan_attention(...).run`, the batch structure resolved
once, as every layer of a model would reuse it); `eager_ms` also has the one-shot call."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measured_ceilings, time_graph_ms, time_ms, write_results  # noqa: E402

from cutekern.arch import DESIGNS_FOR_ARCH, target_arch  # noqa: E402
from cutekern.ikbo import attention, plan_attention  # noqa: E402

B, NSEED, H, D, PER_USER = 2048, 64, 2, 128, 64


def sdpa(q, k, v, backend):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v)


def timed(timings, eager, name, fn, reps):
    """Graph-replay and eager times of fn under `name` (a route that cannot run or be
    captured is reported and left out)."""
    try:
        eager[name] = time_ms(fn, reps=reps)
    except RuntimeError as e:
        print(f"{name}: unavailable ({str(e)[:80]})")
        return
    try:
        timings[name] = time_graph_ms(fn, reps=reps)
    except RuntimeError as e:
        print(f"{name}: no CUDA-graph time ({str(e)[:80]})")


def run_case(s, ragged, designs, reps):
    torch.manual_seed(s)
    dt = torch.bfloat16
    if ragged:
        counts = PER_USER + torch.randint(0, 2, (B // PER_USER,))
        kv_len = torch.randint(s // 2, s + 1, (counts.numel(),), dtype=torch.int32)
    else:
        counts = torch.full((B // PER_USER,), PER_USER)
        kv_len = torch.full((counts.numel(),), s, dtype=torch.int32)
    u = counts.numel()
    c2u = torch.repeat_interleave(torch.arange(u), counts).int().cuda()
    b = c2u.numel()
    kv_len = kv_len.cuda()
    q = torch.randn(b, NSEED, H, D, device="cuda", dtype=dt)
    k = torch.randn(u, s, H, D, device="cuda", dtype=dt)
    v = torch.randn(u, s, H, D, device="cuda", dtype=dt)
    flops = 4 * H * NSEED * D * float((counts.cuda() * kv_len).sum())
    timings, eager = {}, {}
    for d in designs:
        import os
        os.environ["CUTEKERN_DESIGN"] = d
        plan = plan_attention(q, k, v, c2u, kv_len)
        timed(timings, eager, f"cutekern_{d}", lambda: plan.run(q, k, v), reps)
        eager[f"cutekern_{d}_one_shot"] = time_ms(
            lambda: attention(q, k, v, c2u, kv_len, check_indices=False), reps=reps)
    if not ragged:
        # SDPA layout [batch, heads, seq, dim]
        qs = q.permute(0, 2, 1, 3)
        # broadcast on the contiguous layout (fast copy), then a free permuted view
        kb = k.index_select(0, c2u.long()).permute(0, 2, 1, 3)
        vb = v.index_select(0, c2u.long()).permute(0, 2, 1, 3)
        for name, be in (("sdpa_flash_prebroadcast", SDPBackend.FLASH_ATTENTION),
                         ("sdpa_cudnn_prebroadcast", SDPBackend.CUDNN_ATTENTION)):
            timed(timings, eager, name, lambda: sdpa(qs, kb, vb, be), reps)
        del kb, vb

        def bcast_cudnn():
            kb2 = k.index_select(0, c2u.long()).permute(0, 2, 1, 3)
            vb2 = v.index_select(0, c2u.long()).permute(0, 2, 1, 3)
            return sdpa(qs, kb2, vb2, SDPBackend.CUDNN_ATTENTION)
        timed(timings, eager, "broadcast_plus_sdpa_cudnn", bcast_cudnn, reps)
        # packed: each user's candidates' queries as one sequence (uniform counts only)
        qp = q.view(u, PER_USER * NSEED, H, D).permute(0, 2, 1, 3)
        kp, vp = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        timed(timings, eager, "sdpa_cudnn_packed",
              lambda: sdpa(qp, kp, vp, SDPBackend.CUDNN_ATTENTION), reps)
    if ragged:
        # the best route a torch user can write for ragged batches: pad every user's
        # candidates to the largest count, pack them as one query sequence, mask keys past
        # kv_len (padding copies not timed; SDPA picks its backend for the mask)
        cmax = int(counts.max())
        qp = torch.zeros(u, cmax * NSEED, H, D, device="cuda", dtype=dt)
        starts = torch.cumsum(counts, 0) - counts
        for i in range(u):
            qp[i, :int(counts[i]) * NSEED] = q[int(starts[i]):int(starts[i]) + int(counts[i])].reshape(-1, H, D)
        mask = (torch.arange(s, device="cuda")[None, :] < kv_len[:, None])[:, None, None, :]
        qpp, kp, vp = qp.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        timed(timings, eager, "sdpa_packed_padded_masked",
              lambda: F.scaled_dot_product_attention(qpp, kp, vp, attn_mask=mask), reps)
    tflops = {kk: flops / t / 1e9 for kk, t in timings.items()}
    return {"name": f"{'ragged' if ragged else 'uniform'}_S{s}",
            "shape": {"B": b, "n_seed": NSEED, "H": H, "D": D, "S": s, "U": u, "ragged": ragged},
            "timings_ms": timings, "tflops": tflops, "eager_ms": eager,
            "eager_tflops": {kk: flops / t / 1e9 for kk, t in eager.items()}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    designs = [d for d in ("sm90", "ada") if d in DESIGNS_FOR_ARCH[target_arch()]]
    ceil = measured_ceilings()
    sizes = [1024, 4096, 8192] if a.quick else [512, 1024, 2048, 4096, 8192, 16384]
    cases = [run_case(s, False, designs, a.reps) for s in sizes]
    cases += [run_case(s, True, designs, a.reps) for s in (4096, 8192)]
    path = write_results("ikbo_attention", cases, a.out, {"ceilings": ceil, "designs": designs})
    for c in cases:
        print(f"{c['name']:14s} " + "  ".join(f"{k}={v:.3f}ms/{c['tflops'][k]:.0f}TF" for k, v in c["timings_ms"].items()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
