"""One W4A16 GEMM launch (the LM head of Qwen3-1.7B, batch 1, bf16, group 128) for `ncu`
(no timing here). Usage: CUTEKERN_ARTIFACTS=DIR ncu --clock-control none -k regex:kernel_cutlass
python3 perf/profile_w4a16.py [N K M]"""
import sys

import torch

sys.path.insert(0, ".")
from cutekern.reference import w4a16_quantize  # noqa: E402
from cutekern.w4a16 import prepare_w4a16, w4a16_linear  # noqa: E402

n, k, m = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (151936, 2048, 1)
w = (torch.randn(n, k, device="cuda") * k ** -0.5).bfloat16()
p = prepare_w4a16(*w4a16_quantize(w, 128))
x = torch.randn(m, k, device="cuda").bfloat16()
w4a16_linear(x, p)
torch.cuda.synchronize()
