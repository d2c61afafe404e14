"""Quick GPU smoke for one design ($CUTEKERN_DESIGN): a few shapes, max error and time.
Run under `timeout` first on a new kernel so a hang costs seconds, not the lease."""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cutekern.ikbo import LinearCompression  # noqa: E402
from cutekern.reference import lce_reference  # noqa: E402

for counts, m, n, kc, ku in [([2, 1], 16, 16, 16, 16), ([3, 0, 2], 7, 24, 13, 9),
                             ([70] * 14 + [44], 433, 256, 866, 1178)]:
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(0)
        u = len(counts)
        c2u = torch.repeat_interleave(torch.arange(u), torch.tensor(counts)).int().cuda()
        b = c2u.numel()
        wc = (torch.randn(m, kc, device="cuda") / kc ** .5).to(dtype)
        wu = (torch.randn(m, ku, device="cuda") / ku ** .5).to(dtype)
        ec = torch.randn(b, kc, n, device="cuda").to(dtype)
        eu = torch.randn(u, ku, n, device="cuda").to(dtype)
        lce = LinearCompression(wc, wu)
        out = torch.full((b, m, n), float("nan"), dtype=dtype, device="cuda")
        t0 = time.time()
        lce(ec, eu, c2u, out=out)
        torch.cuda.synchronize()
        t1 = time.time()
        ref = lce_reference(wc, wu, ec, eu, c2u)
        err = (out.double() - ref).abs()
        print(f"{str(dtype):15s} B={b} M={m} N={n} Kc={kc} Ku={ku}: nan={torch.isnan(out).sum().item()} "
              f"max_err={err.max().item():.3g} rel={((out.double()-ref).norm()/ref.norm()).item():.3g} "
              f"first_call={t1 - t0:.3f}s", flush=True)
