"""IKBO LCE on the GPU against the float64 reference: fresh random inputs, poisoned outputs,
every element compared, ragged and edge shapes, and a hypothesis fuzz over shapes."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from cutekern.ikbo import LinearCompression, linear_compression
from cutekern.reference import lce_reference

DTYPES = [torch.float16, torch.bfloat16]


def make_problem(counts, m, n, kc, ku, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    u = len(counts)
    c2u = torch.repeat_interleave(torch.arange(u, device="cuda", dtype=torch.int32),
                                  torch.tensor(counts, device="cuda")).to(torch.int32)
    b = c2u.numel()
    # scaled so outputs are O(1) whatever K is
    w_cand = (torch.randn(m, kc, device="cuda", generator=g) / kc ** 0.5).to(dtype)
    w_user = (torch.randn(m, ku, device="cuda", generator=g) / ku ** 0.5).to(dtype)
    e_cand = torch.randn(b, kc, n, device="cuda", generator=g).to(dtype)
    e_user = torch.randn(u, ku, n, device="cuda", generator=g).to(dtype)
    return w_cand, w_user, e_cand, e_user, c2u


def check(out, args, dtype):
    ref = lce_reference(*args)
    assert out.shape == ref.shape and out.dtype == dtype
    o = out.double()
    assert torch.isfinite(o).all(), f"non-finite outputs: {(~torch.isfinite(o)).sum().item()}"
    # fp32 accumulation, one rounding to the output dtype: half an ulp of |ref| plus slack
    eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    err = (o - ref).abs()
    bound = 2 * eps * ref.abs() + 1e-3
    bad = err > bound
    assert not bad.any(), (f"{bad.sum().item()} / {bad.numel()} elements off; max err "
                           f"{err.max().item():.3g} at {tuple(torch.nonzero(bad)[0].tolist())}")
    rel = (o - ref).norm() / ref.norm().clamp_min(1e-30)
    assert rel < 4 * eps, rel


def refill(args, counts, m, n, kc, ku, dtype, seed, out):
    """New random contents in the embedding / index tensors of args (same addresses, the
    weights kept) and a NaN-poisoned out: what a bound launch or graph replay must pick up."""
    fresh = make_problem(counts, m, n, kc, ku, dtype, seed)
    for dst, src in zip(args[2:], fresh[2:]):
        dst.copy_(src)
    out.fill_(float("nan"))


def run_poisoned(args, dtype):
    w_cand, w_user, e_cand, e_user, c2u = args
    lce = LinearCompression(w_cand, w_user)
    out = torch.full((e_cand.shape[0], w_cand.shape[0], e_cand.shape[2]), float("nan"),
                     dtype=dtype, device="cuda")
    lce(e_cand, e_user, c2u, out=out)
    torch.cuda.synchronize()
    return out


def counts_for(b, ratio):
    u = -(-b // ratio)
    counts = [ratio] * u
    counts[-1] = b - ratio * (u - 1)
    return counts


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_shape(design, dtype):
    # M=433, N=256, K_user=1178, K_cand=866, B=1024, 70 candidates per user
    args = make_problem(counts_for(1024, 70), 433, 256, 866, 1178, dtype, seed=1)
    check(run_poisoned(args, dtype), args, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts,m,n,kc,ku", [
    ([1], 1, 8, 1, 1),                    # one user, one candidate, minimal sizes
    ([1], 433, 256, 866, 1178),           # one candidate at the reference dims
    ([3, 0, 2, 0, 0, 1], 7, 24, 13, 9),   # users with 0 candidates
    ([0, 5], 129, 264, 65, 7),            # first user empty; M, N, K off tile multiples
    ([1000], 64, 128, 64, 64),            # ratio 1000, one user
    ([1] * 37, 200, 136, 300, 17),        # ratio 1
    ([2, 1, 4, 3, 0, 7], 257, 512, 129, 250),
])
def test_edge_shapes(design, dtype, counts, m, n, kc, ku):
    args = make_problem(counts, m, n, kc, ku, dtype, seed=sum(counts) + m + n)
    check(run_poisoned(args, dtype), args, dtype)


# sm90: M tiles of the default build (224; the last one 208 / 216 / 224 wide, its epilogue
# skipping subtiles past M, the walk rotated when it is narrower than 112) and of the wide
# build (256; 240 / 248 / 256) that the dispatch picks for M it covers in fewer tiles;
# K_cand / K_user cover the last k-tile's k16 blocks (K % 32 in {1..16}: one block,
# {17..31, 0}: two), also K below one k-tile; >= 202 tiles, so CTAs run several. With 4
# users the user phase runs the narrow build (112; 96 / 104 / 112 wide) up to M = 512;
# `user_build` also runs every case without it (the default or wide build's user phase).
@pytest.fixture(params=["narrow", "no_narrow"])
def user_build(request, design, monkeypatch):
    import cutekern.ikbo as ikbo
    if request.param == "no_narrow":
        if design != "sm90":
            pytest.skip("the narrow user-phase build is an sm90-design variant")
        pick = ikbo.pick_lce_function

        def no_narrow(lookup, has_addend, m, has_wide, has_narrow=False, batch=0, *rest):
            # a user count whose narrow tiles never fit one wave: the pick's other builds
            return pick(lookup, has_addend, m, has_wide, has_narrow, 1 << 30, *rest)
        monkeypatch.setattr(ikbo, "pick_lce_function", no_narrow)
    ikbo._lce_function_cached.cache_clear()  # the pick is cached per shape
    yield request.param
    ikbo._lce_function_cached.cache_clear()


@pytest.mark.parametrize("m,kc,ku", [
    (257, 16, 17), (289, 33, 32), (432, 33, 32), (440, 48, 5), (441, 20, 64), (433, 866, 1),
    (448, 31, 15), (97, 866, 866),                                     # 224-wide build
    (449, 65, 160), (480, 8, 49), (505, 113, 31), (512, 866, 1178), (700, 97, 112),  # wide
])
def test_tail_tiles(design, user_build, m, kc, ku):
    counts = [40, 0, 30, 31]
    args = make_problem(counts, m, 136, kc, ku, torch.bfloat16, seed=m + kc)
    if design == "sm90":  # the user-phase build this case is meant to run
        from cutekern.ikbo import _lce_function, _lce_tiles
        dev = args[2].device
        cand = _lce_function("bfloat16", "bfloat16", True, m, dev)
        user = _lce_function("bfloat16", "float32", False, m, dev, len(counts), 136,
                             _lce_tiles(cand, m, 136, sum(counts)))
        assert user.meta["flags"].get("narrow") == (user_build == "narrow" and m <= 512)
    check(run_poisoned(args, torch.bfloat16), args, torch.bfloat16)


def test_one_shot_api_and_new_output(design):
    args = make_problem([2, 3], 33, 64, 40, 24, torch.float16, seed=7)
    out = linear_compression(*args)
    torch.cuda.synchronize()
    check(out, args, torch.float16)


def test_bad_indices_raise(design):
    args = list(make_problem([2, 2], 16, 16, 16, 16, torch.float16, seed=3))
    args[4] = torch.tensor([0, 2, 1, 1], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="'cand_to_user' has values outside"):
        linear_compression(*args)
    args[4] = torch.tensor([1, 0, 1, 1], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="'cand_to_user' must be non-decreasing"):
        linear_compression(*args)


def test_cuda_graph_and_compile(design):
    args = make_problem([3, 1, 4], 40, 32, 30, 20, torch.bfloat16, seed=11)
    lce = LinearCompression(args[0], args[1])
    out = torch.empty(8, 40, 32, dtype=torch.bfloat16, device="cuda")
    lce(*args[2:], out=out)  # warm-up loads the kernels
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        lce(*args[2:], out=out, check_indices=False)
    refill(args, [3, 1, 4], 40, 32, 30, 20, torch.bfloat16, 12, out)
    g.replay()
    torch.cuda.synchronize()
    check(out, (args[0], args[1], *args[2:]), torch.bfloat16)
    f = torch.compile(lambda a, b, c: lce(a, b, c), fullgraph=True)
    check(f(*args[2:]), (args[0], args[1], *args[2:]), torch.bfloat16)


@pytest.mark.parametrize("kc", [30, 0])
def test_plan_run(design, kc):
    """plan() binds once; run() recomputes from the tensors' current contents (eager and
    as a CUDA-graph replay), including the K_cand = 0 fallback."""
    args = make_problem([3, 0, 1, 4], 40, 32, kc, 20, torch.bfloat16, seed=21)
    lce = LinearCompression(args[0], args[1])
    plan = lce.plan(*args[2:])
    out = plan.out
    for seed in (22, 23):
        refill(args, [3, 0, 1, 4], 40, 32, kc, 20, torch.bfloat16, seed, out)
        assert plan.run() is out
        torch.cuda.synchronize()
        check(out, (args[0], args[1], *args[2:]), torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run()
    refill(args, [3, 0, 1, 4], 40, 32, kc, 20, torch.bfloat16, 24, out)
    g.replay()
    torch.cuda.synchronize()
    check(out, (args[0], args[1], *args[2:]), torch.bfloat16)
    with pytest.raises(ValueError, match="'cand_to_user'"):
        lce.plan(args[2], args[3], args[4].flip(0).contiguous())


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz(design, data):
    dtype = data.draw(st.sampled_from(DTYPES))
    ratio = data.draw(st.sampled_from([1, 2, 5, 70, 1000, None]))  # None: ragged counts
    if ratio is None:
        counts = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=24).filter(lambda c: sum(c) > 0))
    else:
        counts = counts_for(data.draw(st.integers(1, 1100 if ratio == 1000 else 300)), ratio)
    m = data.draw(st.integers(1, 700))  # both sm90 builds (224 / 256-row tiles), rotated walks
    n = 8 * data.draw(st.integers(1, 48))
    kc = data.draw(st.integers(1, 1200))
    ku = data.draw(st.integers(1, 1200))
    args = make_problem(counts, m, n, kc, ku, dtype, seed=data.draw(st.integers(0, 2**31 - 1)))
    check(run_poisoned(args, dtype), args, dtype)


@pytest.mark.parametrize("m,n,kc,ku", [(0, 16, 8, 8), (5, 16, 0, 9), (5, 16, 11, 0)])
def test_empty_extents(design, m, n, kc, ku):
    """M=0, K_cand=0 or K_user=0: no kernel can describe an empty extent; the op still
    returns the right (possibly empty) result."""
    g = torch.Generator(device="cuda").manual_seed(5)
    dt = torch.float16
    c2u = torch.tensor([0, 1, 1], dtype=torch.int32, device="cuda")
    args = (torch.randn(m, kc, device="cuda", generator=g).to(dt), torch.randn(m, ku, device="cuda", generator=g).to(dt),
            torch.randn(3, kc, n, device="cuda", generator=g).to(dt), torch.randn(2, ku, n, device="cuda", generator=g).to(dt), c2u)
    out = linear_compression(*args)
    torch.cuda.synchronize()
    ref = lce_reference(*args)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=1e-3)
