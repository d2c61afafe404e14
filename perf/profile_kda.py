"""Launches of the KDA kernels (intra-chunk stage, then the chain) at the benchmark's spec
inputs for `ncu` (no timing here). Each argument is TOKENSxHEADS, one sequence.
Usage: CUTEKERN_ARTIFACTS=DIR ncu --clock-control none -k regex:kernel_cutlass \
    --set full python3 perf/profile_kda.py 8192x64 512x64"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kda import chain_inputs, problem  # noqa: E402
from cutekern import kda  # noqa: E402

for arg in sys.argv[1:] or ["8192x64"]:
    t, h = map(int, arg.split("x"))
    p = problem([t], h, seed=0)
    kw_intra, args_chain = chain_inputs(p, [t], None)   # runs the intra kernel once
    kda._chain(*args_chain)
    torch.cuda.synchronize()
