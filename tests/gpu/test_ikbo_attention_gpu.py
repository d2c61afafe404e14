"""IKBO attention on the GPU against the fp32 reference: uniform and ragged candidate counts,
ragged kv_len (0, 1, S_max), users with 0 candidates, n_seed off the tile, LSE, poisoned
outputs ($CUTEKERN_POISON makes the op NaN-fill its outputs first), hypothesis fuzz."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from cutekern.ikbo import attention, plan_attention
from cutekern.reference import ikbo_attention_reference


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setenv("CUTEKERN_POISON", "1")


def problem(counts, n_seed, h, d, s_max, kv, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    u = len(counts)
    c2u = torch.repeat_interleave(torch.arange(u, device="cuda"), torch.tensor(counts, device="cuda")).int()
    b = c2u.numel()
    q = torch.randn(b, n_seed, h, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(u, s_max, h, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(u, s_max, h, d, device="cuda", generator=g).to(dtype)
    kv_len = torch.tensor(kv, dtype=torch.int32, device="cuda")
    return q, k, v, c2u, kv_len


def check(q, k, v, c2u, kv_len, scale=None, result=None):
    out, lse = result if result is not None else attention(q, k, v, c2u, kv_len, scale=scale,
                                                             return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = ikbo_attention_reference(q, k, v, c2u, kv_len, scale=scale)
    assert not torch.isnan(out).any(), "unwritten or NaN outputs"
    eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[q.dtype]
    err = (out.float() - ref).abs()
    bound = 4 * eps * ref.abs() + 8 * eps
    assert not (err > bound).any(), f"max err {err.max().item():.3g}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "lse -inf pattern differs"
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-3, atol=1e-3 + 16 * eps)


DT = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("d", [64, 128])
def test_uniform(design, dtype, d):
    counts = [8] * 4
    check(*problem(counts, 64, 2, d, 1024, [1024, 700, 1, 513], dtype, seed=d))


@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("counts,n_seed,kv", [
    ([3, 0, 5, 1], 64, [100, 50, 1, 257]),     # odd counts, a user without candidates
    ([1], 5, [33]),                           # one candidate, n_seed off the tile
    ([2, 7], 100, [0, 300]),                  # kv_len 0 -> out 0, lse -inf
    ([0, 4, 0], 17, [10, 511, 1]),
])
def test_ragged(design, dtype, counts, n_seed, kv):
    check(*problem(counts, n_seed, 2, 128, max(max(kv), 1), kv, dtype, seed=len(counts) + n_seed),
          scale=0.07)


@pytest.mark.parametrize("d", [64, 128])
def test_many_items(design, d):
    """Far more (chunk, head) items than SMs: persistent CTAs walk many items each, across
    users of 0..5 candidates (chunks of 64..128 rows) and kv_len 0..S_max."""
    g = torch.Generator().manual_seed(d)
    counts = torch.randint(0, 6, (300,), generator=g).tolist()
    kv = torch.randint(0, 181, (300,), generator=g).tolist()
    check(*problem(counts, 64, 2, d, 180, kv, torch.bfloat16, seed=d))


def test_plan_reuse(design):
    """One plan, several runs with new contents and new tensors of the plan's shapes; out=
    given; mismatched shapes rejected by name."""
    counts, kv = [4, 0, 3, 1], [300, 1, 129, 0]
    q, k, v, c2u, kv_len = problem(counts, 33, 2, 128, 300, kv, torch.float16, seed=1)
    plan = plan_attention(q, k, v, c2u, kv_len, scale=0.05)
    for seed in (2, 3):
        q2, k2, v2, _, _ = problem(counts, 33, 2, 128, 300, kv, torch.float16, seed=seed)
        check(q2, k2, v2, c2u, kv_len, scale=0.05, result=plan.run(q2, k2, v2, return_lse=True))
    out = torch.full_like(q, float("nan"))
    res = plan.run(q, k, v, out=out, return_lse=True)
    assert res[0] is out
    check(q, k, v, c2u, kv_len, scale=0.05, result=res)
    with pytest.raises(ValueError, match="'q'"):
        plan.run(q[:-1], k, v)
    with pytest.raises(ValueError, match="'k'"):
        plan.run(q, k[:, :-1], v[:, :-1])
    with pytest.raises(ValueError, match="'out'"):
        plan.run(q, k, v, out=out[:, :-1])


def test_plan_cuda_graph(design):
    q, k, v, c2u, kv_len = problem([5, 2], 64, 2, 64, 400, [400, 77], torch.bfloat16, seed=4)
    plan = plan_attention(q, k, v, c2u, kv_len)
    out = torch.empty_like(q)
    plan.run(q, k, v, out=out)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run(q, k, v, out=out)
    for seed in (5, 6):
        fresh = problem([5, 2], 64, 2, 64, 400, [400, 77], torch.bfloat16, seed=seed)
        for dst, src in zip((q, k, v), fresh[:3]):
            dst.copy_(src)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref, _ = ikbo_attention_reference(q, k, v, c2u, kv_len)
        assert not torch.isnan(out).any()
        assert (out.float() - ref).abs().max().item() < 0.05


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz(design, data):
    dtype = data.draw(st.sampled_from(DT))
    d = data.draw(st.sampled_from([64, 128]))
    counts = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=6).filter(lambda c: sum(c) > 0))
    n_seed = data.draw(st.sampled_from([1, 7, 64, 65, 128]))
    s_max = data.draw(st.integers(1, 1100))
    kv = [data.draw(st.integers(0, s_max)) for _ in counts]
    h = data.draw(st.integers(1, 3))
    check(*problem(counts, n_seed, h, d, s_max, kv, dtype, seed=data.draw(st.integers(0, 2**31 - 1))))


def test_cuda_graph_and_compile(design):
    q, k, v, c2u, kv_len = problem([3, 0, 2], 64, 2, 128, 256, [256, 0, 100], torch.bfloat16, seed=9)
    out = attention(q, k, v, c2u, kv_len, check_indices=False)  # warm-up loads the kernel
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = attention(q, k, v, c2u, kv_len, check_indices=False)
    fresh = problem([3, 0, 2], 64, 2, 128, 256, [256, 0, 100], torch.bfloat16, seed=10)
    q.copy_(fresh[0])
    k.copy_(fresh[1])
    g.replay()
    torch.cuda.synchronize()
    ref, _ = ikbo_attention_reference(q, k, v, c2u, kv_len)
    assert (out.float() - ref).abs().max().item() < 0.05
    f = torch.compile(lambda a, b, c, d, e: attention(a, b, c, d, e, return_lse=True), fullgraph=True)
    out2, lse2 = f(q, k, v, c2u, kv_len)
    ref, rlse = ikbo_attention_reference(q, k, v, c2u, kv_len)
    assert (out2.float() - ref).abs().max().item() < 0.05
    fin = torch.isfinite(rlse)
    assert torch.equal(fin, torch.isfinite(lse2))
