"""The one-launch W4A16 MLP block on the GPU (the Ada design, built for sm_90a on an H200).
Both halves are checked element by element: h (the kernel's silu(gate) * up, through the
``h`` argument) against float64 from the GPTQ storage dequantized exactly, and out against
float64 h_kernel @ Wd^T (so a wrong, stale or half-written h in phase 2 shows even where it
would round the same). Fresh random inputs, poisoned outputs, batches 1..40 (both builds,
slices of 16), Qwen3-1.7B's MLP, odd block counts, groups 64..K, a grid of a few CTAs (many
tiles per CTA in both phases, few flags), 30 launches back to back and CUDA-graph replays
(the generation word advances; flags are never reset), and a hypothesis fuzz."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import cutekern.w4a16 as w4
from cutekern.arch import target_arch
from cutekern.reference import w4a16_dequantize, w4a16_quantize
from cutekern.registry import OPS
from cutekern.w4a16 import prepare_w4a16, prepare_w4a16_mlp, w4a16_mlp

pytestmark = pytest.mark.skipif("ada" not in OPS["w4a16_mlp"].designs_on(target_arch()),
                                reason="no W4A16 MLP kernels for this arch")

DTYPES = (torch.float16, torch.bfloat16)


class Block:
    def __init__(self, k, f, d, dtype, seed, group=128, group_d=None):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.gen, self.dtype, self.k, self.f, self.d = gen, dtype, k, f, d
        self.q = {}
        for name, (n, kk, g) in {"gate": (f, k, group), "up": (f, k, group),
                                 "down": (d, f, group_d or group)}.items():
            w = torch.randn(n, kk, device="cuda", generator=gen) * kk ** -0.5
            self.q[name] = (*w4a16_quantize(w.to(dtype), g), g)
        self.mlp = prepare_w4a16_mlp(*(prepare_w4a16(*self.q[n]) for n in ("gate", "up", "down")))

    def dense(self, name):
        qw, sc, g = self.q[name]
        return w4a16_dequantize(qw, sc, g, torch.float64)

    def x(self, m):
        return torch.randn(m, self.k, device="cuda", generator=self.gen).to(self.dtype)

    def run(self, x):
        out = torch.full((*x.shape[:-1], self.d), float("nan"), dtype=x.dtype, device="cuda")
        h = torch.full((*x.shape[:-1], self.f), float("nan"), dtype=x.dtype, device="cuda")
        y = w4a16_mlp(x, self.mlp, out=out, h=h)
        torch.cuda.synchronize()
        assert y is out
        return h, out

    def check(self, x, h, out, what):
        eps = 2.0 ** -8 if x.dtype == torch.bfloat16 else 2.0 ** -11
        xd = x.double()
        wg, wu, wd = self.dense("gate"), self.dense("up"), self.dense("down")
        g, u = xd @ wg.t(), xd @ wu.t()
        sg = g * torch.sigmoid(g)
        href = sg * u
        # fp32 sums of K products (rms-scaled) in gate and up, through silu' (<= 1.1) and the
        # product, then one rounding of h
        eg = 4e-5 * (xd.abs() @ wg.t().abs())
        eu = 4e-5 * (xd.abs() @ wu.t().abs())
        bound = eps * href.abs() + 1.1 * eg * u.abs() + sg.abs() * eu + eg * eu + 1e-6
        hd = h.double()
        assert torch.isfinite(hd).all(), f"{what}: non-finite h"
        bad = (hd - href).abs() > bound
        assert not bad.any(), (f"{what}: h: {int(bad.sum())} of {h.numel()} out of bound, max "
                               f"err {(hd - href).abs().max().item():.3e}")
        ref = hd @ wd.t()
        od = out.double()
        assert torch.isfinite(od).all(), f"{what}: non-finite out"
        bound = eps * ref.abs() + 4e-5 * (hd.abs() @ wd.t().abs()) + 1e-6
        bad = (od - ref).abs() > bound
        assert not bad.any(), (f"{what}: out: {int(bad.sum())} of {out.numel()} out of bound, "
                               f"max err {(od - ref).abs().max().item():.3e}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen3_mlp(dtype):
    """Qwen3-1.7B's MLP (hidden 2048, intermediate 6144) at batches of both builds and beyond
    one launch (slices of 16)."""
    blk = Block(2048, 6144, 2048, dtype, seed=1)
    for m in (1, 2, 8, 9, 16, 17, 40):
        x = blk.x(m)
        blk.check(x, *blk.run(x), f"qwen3 m={m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,f,d,group,group_d", [
    (128, 64, 16, 64, 64),           # 4 gate / up tiles, one down tile
    (384, 320, 48, 128, 320),        # 20 / 3 tiles, per-channel down scales (group = K)
    (1152, 1088, 1040, 128, 64),     # 68 / 65 tiles, uneven K runs over the warps
    (2688, 1408, 2688, 64, 128),     # groups of 64 in gate / up
])
def test_shapes(dtype, k, f, d, group, group_d):
    blk = Block(k, f, d, dtype, seed=k + f + d, group=group, group_d=group_d)
    for m in (1, 5, 13):
        x = blk.x(m)
        blk.check(x, *blk.run(x), f"k={k} f={f} d={d} m={m}")


@pytest.mark.parametrize("ctas", [1, 2, 7])
def test_small_grid(monkeypatch, ctas):
    """A grid of 1 / 2 / 7 CTAs: many rounds per CTA in both phases, a wait over few flags
    (1: the CTA waits only for itself)."""
    monkeypatch.setattr(w4, "MLP_CTAS_OVERRIDE", ctas)
    blk = Block(1024, 1088, 272, torch.bfloat16, seed=ctas, group_d=64)
    for m in (3, 12):
        x = blk.x(m)
        blk.check(x, *blk.run(x), f"ctas={ctas} m={m}")


def test_back_to_back_launches():
    """30 launches without a sync between them, each with new x: every launch must wait for
    its own phase 1, not see the previous launch's flags as ready (same generation words)."""
    blk = Block(2048, 6144, 2048, torch.bfloat16, seed=7)
    xs = [blk.x(4) for _ in range(30)]
    hs = [torch.full((4, blk.f), float("nan"), dtype=blk.dtype, device="cuda") for _ in xs]
    outs = [torch.full((4, blk.d), float("nan"), dtype=blk.dtype, device="cuda") for _ in xs]
    gen0 = int(blk.mlp.sync[0])
    for x, h, o in zip(xs, hs, outs):
        w4a16_mlp(x, blk.mlp, out=o, h=h)
    torch.cuda.synchronize()
    assert int(blk.mlp.sync[0]) == gen0 + 30, "each launch publishes one generation"
    for i in (0, 1, 17, 29):
        blk.check(xs[i], hs[i], outs[i], f"launch {i}")


def test_reused_h_buffer():
    """The same h buffer across launches (phase 2 must read this launch's h): two launches
    whose x differ, the second checked."""
    blk = Block(1024, 2048, 1024, torch.float16, seed=8)
    h = torch.empty(6, blk.f, dtype=blk.dtype, device="cuda")
    out = torch.empty(6, blk.d, dtype=blk.dtype, device="cuda")
    x1, x2 = blk.x(6), blk.x(6)
    w4a16_mlp(x1, blk.mlp, out=out, h=h)
    w4a16_mlp(x2, blk.mlp, out=out, h=h)
    torch.cuda.synchronize()
    blk.check(x2, h, out, "second launch")


def test_graph_replay_new_contents():
    blk = Block(2048, 6144, 2048, torch.bfloat16, seed=9)
    xs = blk.x(8)
    h = torch.empty(8, blk.f, dtype=blk.dtype, device="cuda")
    out = torch.empty(8, blk.d, dtype=blk.dtype, device="cuda")
    w4a16_mlp(xs, blk.mlp, out=out, h=h)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w4a16_mlp(xs, blk.mlp, out=out, h=h)
    for i in range(3):
        x = blk.x(8)
        xs.copy_(x)
        out.fill_(float("nan"))
        h.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        blk.check(x, h, out, f"replay {i}")


def test_leading_dims_and_fresh_outputs():
    blk = Block(512, 256, 128, torch.bfloat16, seed=10)
    x = blk.x(6)
    y = w4a16_mlp(x.view(2, 3, 512), blk.mlp)
    torch.cuda.synchronize()
    assert y.shape == (2, 3, 128)
    h = torch.empty(6, blk.f, dtype=blk.dtype, device="cuda")
    y2 = w4a16_mlp(x, blk.mlp, h=h)
    torch.cuda.synchronize()
    assert torch.equal(y.view(6, 128), y2), "same launch shape, different bits"
    blk.check(x, h, y2, "3-d x")


def test_batch_invariance():
    """A row's result does not depend on the other rows of its launch."""
    blk = Block(1024, 1024, 512, torch.bfloat16, seed=11)
    x = blk.x(16)
    full = w4a16_mlp(x, blk.mlp)
    for m in (1, 5, 8, 9):
        part = w4a16_mlp(x[:m].contiguous(), blk.mlp)
        torch.cuda.synchronize()
        assert torch.equal(part, full[:m]), f"rows differ between batches of 16 and {m}"


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(1, 20), st.integers(1, 12), st.integers(1, 24), st.integers(1, 40),
       st.sampled_from(DTYPES), st.sampled_from([64, 128]), st.sampled_from([None, 1, 3]),
       st.integers(0, 2 ** 16))
def test_fuzz(m, kg, f64, d16, dtype, group, ctas, seed):
    """Batch, K, F, D, dtype, group and grid (None: the API's)."""
    w4.MLP_CTAS_OVERRIDE = ctas
    try:
        blk = Block(group * kg, 64 * f64, 16 * d16, dtype, seed, group=group, group_d=64)
        x = blk.x(m)
        h, out = blk.run(x)
    finally:
        w4.MLP_CTAS_OVERRIDE = None
    blk.check(x, h, out, f"m={m} k={group * kg} f={64 * f64} d={16 * d16} ctas={ctas}")


def test_torch_compile_uses_the_op():
    blk = Block(512, 256, 128, torch.float16, seed=12)
    x = blk.x(3)
    f = torch.compile(lambda a: w4a16_mlp(a, blk.mlp) * 2, fullgraph=True)
    y = f(x)
    torch.cuda.synchronize()
    h = torch.empty(3, blk.f, dtype=blk.dtype, device="cuda")
    want = w4a16_mlp(x, blk.mlp, h=h)
    torch.cuda.synchronize()
    assert torch.equal(y / 2, want)
