"""W4A16 GEMM on the GPU (the Ada design, built for sm_90a on an H200): every output element
against float64 x W^T with W the GPTQ storage dequantized exactly (reference.w4a16_dequantize,
which the fragment order's bit-level emulation equals: tests/test_w4a16.py), fresh random
inputs, poisoned outputs; batches 1..16 (both builds) and larger (slices of 16), the Qwen3-1.7B
layer shapes, K split unevenly over the warps, both dtypes, a hypothesis fuzz, CUDA-graph
replay with new contents, torch.compile through the registered op."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from cutekern.arch import target_arch
from cutekern.reference import w4a16_dequantize, w4a16_quantize
from cutekern.registry import OPS
from cutekern.w4a16 import prepare_w4a16, w4a16_linear

pytestmark = pytest.mark.skipif("ada" not in OPS["w4a16_gemm"].designs_on(target_arch()),
                                reason="no W4A16 kernels for this arch")

DTYPES = (torch.float16, torch.bfloat16)


def make(n, k, m, dtype, seed, group=128):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen) * (0.5 + torch.rand(n, 1, device="cuda",
                                                                             generator=gen))
    qw, sc = w4a16_quantize(w.to(dtype), group)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    return x, qw, sc


def check(y, x, qw, sc, group, what):
    """Every element finite and within fp32-accumulation + one output rounding of float64."""
    ref = x.double() @ w4a16_dequantize(qw, sc, group, torch.float64).t()
    y = y.double()
    assert torch.isfinite(y).all(), f"{what}: non-finite outputs"
    eps = 2.0 ** -8 if x.dtype == torch.bfloat16 else 2.0 ** -11
    # output rounding (|ref| eps) + fp32 sums of K products (rms-scaled)
    scale = (x.double().abs() @ w4a16_dequantize(qw, sc, group, torch.float64).t().abs())
    bound = eps * ref.abs() + 4e-5 * scale + 1e-6
    err = (y - ref).abs()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {y.numel()} out of bound, max err "
                           f"{err.max().item():.3e}")


def run_poisoned(x, p, n):
    out = torch.full((*x.shape[:-1], n), float("nan"), dtype=x.dtype, device=x.device)
    y = w4a16_linear(x, p, out=out)
    torch.cuda.synchronize()
    assert y is out
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9, 13, 16, 17, 40])
def test_batches(dtype, m):
    n, k = 272, 1024      # 17 column blocks, 8 groups over 8 warps
    x, qw, sc = make(n, k, m, dtype, seed=m)
    p = prepare_w4a16(qw, sc)
    check(run_poisoned(x, p, n), x, qw, sc, 128, f"m={m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144),
                                 (16, 128), (48, 384), (32, 1152), (160, 2688), (24624, 1024)])
def test_shapes(dtype, n, k):
    """Qwen3-1.7B's qkv / o / gate+up / down, K of 1..21 groups over 8 warps (some warps
    without a group, uneven runs), and an N that takes 64-column tiles at 1 row on the H200
    (its last tile 3 / 4 full)."""
    for m in (1, 16):
        x, qw, sc = make(n, k, m, dtype, seed=n + k + m)
        p = prepare_w4a16(qw, sc)
        check(run_poisoned(x, p, n), x, qw, sc, 128, f"n={n} k={k} m={m}")


def test_leading_dims_and_fresh_output():
    x, qw, sc = make(64, 512, 6, torch.bfloat16, seed=3)
    p = prepare_w4a16(qw, sc)
    y = w4a16_linear(x.view(2, 3, 512), p)
    torch.cuda.synchronize()
    assert y.shape == (2, 3, 64)
    check(y.view(6, 64), x, qw, sc, 128, "3-d x")
    y0 = w4a16_linear(x[:0], p)
    assert y0.shape == (0, 64)


def test_strided_rows():
    """x rows with a padded stride (a slice of a wider buffer) and an unaligned view."""
    x, qw, sc = make(64, 512, 5, torch.float16, seed=4)
    p = prepare_w4a16(qw, sc)
    wide = torch.randn(5, 640, device="cuda").half()
    wide[:, :512] = x
    check(run_poisoned(wide[:, :512], p, 64), x, qw, sc, 128, "strided")
    flat = torch.randn(5 * 512 + 1, device="cuda").half()
    xv = flat[1:].view(5, 512)
    xv.copy_(x)
    check(run_poisoned(xv, p, 64), x, qw, sc, 128, "unaligned")


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(1, 24), st.integers(1, 40), st.integers(1, 24), st.sampled_from(DTYPES),
       st.sampled_from([64, 128, 192, 256]), st.sampled_from([None, 16, 32, 64]),
       st.integers(0, 2 ** 16))
def test_fuzz(m, n16, kg, dtype, group, cols, seed):
    """Shapes, groups and dtypes, with the tile width forced (None: the API's pick)."""
    import cutekern.w4a16 as w4
    n, k = 16 * n16, group * kg
    x, qw, sc = make(n, k, m, dtype, seed, group)
    p = prepare_w4a16(qw, sc, group)
    w4.COLS_OVERRIDE = cols
    try:
        out = run_poisoned(x, p, n)
    finally:
        w4.COLS_OVERRIDE = None
    check(out, x, qw, sc, group, f"m={m} n={n} k={k} g={group} cols={cols}")


def test_graph_replay_new_contents():
    x, qw, sc = make(2048, 2048, 4, torch.bfloat16, seed=9)
    p = prepare_w4a16(qw, sc)
    xs = x.clone()
    out = torch.empty(4, 2048, dtype=x.dtype, device="cuda")
    w4a16_linear(xs, p, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w4a16_linear(xs, p, out=out)
    for seed in (10, 11):
        x2, _, _ = make(2048, 2048, 4, torch.bfloat16, seed=seed)
        xs.copy_(x2)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(out, x2, qw, sc, 128, f"replay {seed}")


def test_torch_compile_uses_the_op():
    x, qw, sc = make(256, 1024, 3, torch.float16, seed=12)
    p = prepare_w4a16(qw, sc)
    f = torch.compile(lambda a: w4a16_linear(a, p) * 2, fullgraph=True)
    y = f(x)
    torch.cuda.synchronize()
    check(y / 2, x, qw, sc, 128, "compiled")


def test_batch_invariance():
    """A row's result does not depend on the other rows of its launch (8- or 16-row build)."""
    x, qw, sc = make(512, 2048, 16, torch.bfloat16, seed=13)
    p = prepare_w4a16(qw, sc)
    full = w4a16_linear(x, p)
    for m in (1, 5, 8, 9):
        part = w4a16_linear(x[:m].contiguous(), p)
        torch.cuda.synchronize()
        assert torch.equal(part, full[:m]), f"rows differ between batches of 16 and {m}"


def test_per_channel_scales():
    """group = K (one scale per column) and a K of one group split over 8 warps (7 idle)."""
    for k in (512, 2048):
        x, qw, sc = make(96, k, 3, torch.bfloat16, seed=k, group=k)
        p = prepare_w4a16(qw, sc, k)
        check(run_poisoned(x, p, 96), x, qw, sc, k, f"group=K={k}")


@pytest.mark.parametrize("ctas", [None, 2])
@pytest.mark.parametrize("cols", [16, 32, 64])
@pytest.mark.parametrize("ks", [1, 2, 4, 8])
def test_every_build_and_k_split(monkeypatch, cols, ks, ctas):
    """Every tile width at every K split (each warp a whole tile ... 8 warps per tile), block
    counts that leave the last tile 1 / 4 or 3 / 4 full, both row builds (rows 9..16 take 32
    columns where 64 is asked); on the full grid and on 2 CTAs (many tile rounds per CTA:
    the rings run across tiles)."""
    import cutekern.w4a16 as w4
    if cols > 16 and ks == 8:
        pytest.skip("the 32- and 64-column builds have 4 warps")
    monkeypatch.setattr(w4, "COLS_OVERRIDE", cols)
    monkeypatch.setattr(w4, "KSPLIT_OVERRIDE", ks)
    monkeypatch.setattr(w4, "CTAS_OVERRIDE", ctas)
    for m, n, k in ((3, 272, 1024), (13, 1040, 2048), (1, 16, 512), (8, 1200, 1024)):
        x, qw, sc = make(n, k, m, torch.bfloat16, seed=m + ks)
        p = prepare_w4a16(qw, sc)
        check(run_poisoned(x, p, n), x, qw, sc, 128, f"cols={cols} ks={ks} m={m} n={n}")
