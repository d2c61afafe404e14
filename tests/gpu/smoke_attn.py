"""Quick GPU smoke of IKBO attention for one design ($CUTEKERN_DESIGN); run under `timeout`."""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cutekern.ikbo import attention  # noqa: E402
from cutekern.reference import ikbo_attention_reference  # noqa: E402

for counts, n_seed, d, s, kv in [([2, 1], 64, 128, 128, [128, 77]), ([3, 0, 2], 5, 64, 200, [1, 50, 200]),
                                 ([64] * 4, 64, 128, 2048, [2048, 1500, 1, 0])]:
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(0)
        u = len(counts)
        c2u = torch.repeat_interleave(torch.arange(u), torch.tensor(counts)).int().cuda()
        q = torch.randn(c2u.numel(), n_seed, 2, d, device="cuda").to(dtype)
        k = torch.randn(u, s, 2, d, device="cuda").to(dtype)
        v = torch.randn(u, s, 2, d, device="cuda").to(dtype)
        kvl = torch.tensor(kv, dtype=torch.int32, device="cuda")
        t0 = time.time()
        out, lse = attention(q, k, v, c2u, kvl, return_lse=True)
        torch.cuda.synchronize()
        ref, rlse = ikbo_attention_reference(q, k, v, c2u, kvl)
        fin = torch.isfinite(rlse)
        print(f"{str(dtype):15s} counts={counts[:4]} n_seed={n_seed} D={d} S={s}: nan={torch.isnan(out).sum().item()} "
              f"max_err={(out.float() - ref).abs().max().item():.3g} "
              f"lse_err={(lse[fin] - rlse[fin]).abs().max().item() if fin.any() else 0:.3g} "
              f"lse_inf_ok={torch.equal(fin, torch.isfinite(lse))} t={time.time() - t0:.3f}s", flush=True)
