"""One launch of each LCE phase at the reference shape, for `ncu` (no timing here).
Usage: ncu --clock-control none -k regex:kernel python3 perf/profile_lce.py EXPORT_DIR DESIGN [cublas]
(cublas: also the padded candidate matmul alone through torch, cuBLAS's kernel for the same GEMM)"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import lce_phase_functions, lce_problem  # noqa: E402
from cutekern.reference import pad_k  # noqa: E402
from cutekern.runtime import Manifest  # noqa: E402

root, design = Path(sys.argv[1]), sys.argv[2]
dt = torch.float16
wc, wu, ec, eu, c2u = lce_problem(1024, 70, dt)
wc, wu = pad_k(wc), pad_k(wu)
u, (B, _, N), M = eu.shape[0], ec.shape, wc.shape[0]
man = Manifest(root)
f_user, f_cand = lce_phase_functions(man, design, M, users=u, n=N, batch=B)
part = torch.empty(u, M, N, device="cuda")
out = torch.empty(B, M, N, dtype=dt, device="cuda")
for _ in range(2):
    f_user(wu, eu, part, part, c2u)
    f_cand(wc, ec, out, part, c2u)
torch.cuda.synchronize()
if "cublas" in sys.argv[3:]:
    from cutekern.reference import pad_k_rows
    ecp = pad_k_rows(ec)
    for _ in range(2):
        torch.matmul(wc, ecp)
    torch.cuda.synchronize()
