"""Residual add + RMSNorm (cutekern.decode.add_rms_norm, the Ada design built for sm_90a) on
the GPU: the residual bit for bit against torch's fp32 add, every output element within one
rounding of the float64 norm of that residual (NaN fails); fresh random inputs, poisoned
outputs, hidden sizes from 8 to 16384 (off powers of two, past one chunk per thread), strided
rows, 1..200 rows, a row's bits independent of its batch, CUDA-graph replay, torch.compile,
a hypothesis fuzz."""
import pytest
import torch

from hypothesis import HealthCheck, given, settings, strategies as st

from cutekern.arch import target_arch
from cutekern.decode import add_rms_norm
from cutekern.registry import OPS

pytestmark = pytest.mark.skipif("ada" not in OPS["add_rms_norm"].designs_on(target_arch()),
                                reason="no add_rms_norm kernels for this arch")

# one rounding to the output dtype (half an ulp: 2^-9 / 2^-12 relative) plus fp32 error
REL = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10}


def make(b, d, dtype, seed=0, stride=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cols = stride or d
    x = (torch.randn(b, cols, device="cuda", generator=g) * 3)[:, :d]
    y = (torch.randn(b, cols, device="cuda", generator=g)).to(dtype)[:, :d]
    w = 1 + 0.3 * torch.randn(d, device="cuda", generator=g)
    out = torch.full((b, cols), float("nan"), device="cuda", dtype=dtype)[:, :d]
    return x, y, w, out


def check(x0, y, w, x, out, eps=1e-6):
    want_x = x0 + y.float()
    assert torch.equal(x, want_x)                   # the same single fp32 add
    r = want_x.double()
    ref = r * torch.rsqrt((r * r).mean(-1, keepdim=True) + eps) * w.double()
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs()
    tol = REL[out.dtype] * ref.abs() + 1e-6 * ref.abs().amax(-1, keepdim=True)
    assert bool((err <= tol).all()), (err / ref.abs().clamp_min(1e-30)).max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,d", [(1, 8), (3, 2048), (17, 7168), (5, 2056), (2, 16384),
                                 (200, 1024), (4, 2040), (1, 4104)])
def test_matches_float64(dtype, b, d):
    x, y, w, out = make(b, d, dtype, seed=b + d)
    x0 = x.clone()
    add_rms_norm(x, y, w, out, eps=1e-6)
    check(x0, y, w, x, out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_strided_rows(dtype):
    x, y, w, out = make(6, 2048, dtype, seed=3, stride=2048 + 64)
    x0 = x.clone()
    add_rms_norm(x, y, w, out, eps=1e-5)
    check(x0, y, w, x, out, eps=1e-5)
    torch.cuda.synchronize()


def test_row_independent_of_batch():
    x, y, w, out = make(9, 2048, torch.bfloat16, seed=5)
    x1, out1 = x[4:5].clone(), out[4:5].clone()
    add_rms_norm(x, y, w, out)
    add_rms_norm(x1, y[4:5], w, out1)
    assert torch.equal(out[4:5], out1) and torch.equal(x[4:5], x1)


def test_graph_replay_new_contents():
    x, y, w, out = make(4, 2048, torch.bfloat16, seed=6)
    add_rms_norm(x, y, w, out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        add_rms_norm(x, y, w, out)
    for seed in (7, 8):
        x2, y2, w2, _ = make(4, 2048, torch.bfloat16, seed=seed)
        x.copy_(x2)
        y.copy_(y2)
        w.copy_(w2)
        out.fill_(float("nan"))
        x0 = x.clone()
        g.replay()
        torch.cuda.synchronize()
        check(x0, y, w, x, out)


def test_torch_compile():
    x, y, w, out = make(3, 1024, torch.float16, seed=9)
    x0 = x.clone()

    @torch.compile(fullgraph=True)
    def f(x, y, w, out):
        add_rms_norm(x, y, w, out)
        return out * 2

    r = f(x, y, w, out)
    check(x0, y, w, x, out)
    assert torch.equal(r, out * 2)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(b=st.integers(1, 70), d8=st.integers(1, 2500), fp16=st.booleans(),
       pad=st.sampled_from([0, 8, 64]), seed=st.integers(0, 1000))
def test_fuzz(b, d8, fp16, pad, seed):
    d = 8 * d8
    x, y, w, out = make(b, d, torch.float16 if fp16 else torch.bfloat16, seed, d + pad)
    x0 = x.clone()
    add_rms_norm(x, y, w, out, eps=1e-6)
    check(x0, y, w, x, out)
