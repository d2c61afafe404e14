"""One launch of each LCE phase at the reference shape, for `ncu` (no timing here).
Usage: ncu --clock-control none -k regex:kernel python3 perf/profile_lce.py EXPORT_DIR DESIGN"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cutekern.reference import pad_k  # noqa: E402
from cutekern.runtime import Manifest  # noqa: E402

root, design = Path(sys.argv[1]), sys.argv[2]
M, N, KU, KC, B, R = 433, 256, 1178, 866, 1024, 70
u = -(-B // R)
c2u = torch.repeat_interleave(torch.arange(u), torch.tensor([R] * (u - 1) + [B - R * (u - 1)])).int().cuda()
dt = torch.float16
wc = pad_k((torch.randn(M, KC, device="cuda") / KC ** .5).to(dt))
wu = pad_k((torch.randn(M, KU, device="cuda") / KU ** .5).to(dt))
ec = torch.randn(B, KC, N, device="cuda").to(dt)
eu = torch.randn(u, KU, N, device="cuda").to(dt)
man = Manifest(root)
f_user = man.function("lce_gemm", design, "sm_90a", {"ab": "float16", "c": "float32"}, {"has_addend": False})
f_cand = man.function("lce_gemm", design, "sm_90a", {"ab": "float16", "c": "float16"}, {"has_addend": True})
part = torch.empty(u, M, N, device="cuda")
out = torch.empty(B, M, N, dtype=dt, device="cuda")
for _ in range(2):
    f_user(wu, eu, part, part, c2u)
    f_cand(wc, ec, out, part, c2u)
torch.cuda.synchronize()
