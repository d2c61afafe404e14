"""BGMV MoE-LoRA on the GPU: shrink against the float64 reference (within one rounding to the
input dtype), expand against the float64 expand of the kernel's own shrink output, bitwise
determinism over 100 runs, batch invariance, token order == expert-sorted order bit for
bit, lora -1 tokens, routing skew, CUDA-graph replay with new contents, hypothesis fuzz."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from cutekern.bgmv_moe import bgmv_moe_expand, bgmv_moe_shrink, prepare_bgmv_moe
from cutekern.reference import bgmv_expand_reference, bgmv_live, bgmv_shrink_reference

DTYPES = [torch.bfloat16, torch.float16]
EPS = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def make(t, k, h, n, r, num_l, num_e, dtype, seed, *, skew=False, none_frac=0.2):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", generator=g).to(dtype)
    a = (torch.randn(num_l, num_e, r, h, device="cuda", generator=g) * h ** -0.5).to(dtype)
    b = (torch.randn(num_l, num_e, n, r, device="cuda", generator=g) * r ** -0.5).to(dtype)
    if skew:  # every token to the same experts
        ids = torch.arange(k, device="cuda", dtype=torch.int32).remainder(num_e).repeat(t, 1)
    else:
        ids = torch.stack([torch.randperm(num_e, device="cuda", generator=g)[:k] if k <= num_e else
                           torch.randint(0, num_e, (k,), device="cuda", generator=g)
                           for _ in range(t)]).to(torch.int32) if t else \
            torch.zeros(0, k, dtype=torch.int32, device="cuda")
    w = torch.softmax(torch.randn(t, k, device="cuda", generator=g), -1)
    lora = torch.randint(0, num_l, (t,), device="cuda", generator=g, dtype=torch.int32)
    lora[torch.rand(t, device="cuda", generator=g) < none_frac] = -1
    return x, a, b, ids.contiguous(), w.contiguous(), lora


def sorted_order(ids, block=16):
    """vLLM-style expert-sorted pair list, each expert's run padded to ``block`` with P."""
    p = ids.numel()
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    out = []
    for e in torch.unique(flat).tolist():
        run = order[flat[order] == e]
        pad = (-run.numel()) % block
        out.append(torch.cat([run, torch.full((pad,), p, device=ids.device)]))
    return torch.cat(out).to(torch.int32)


def check_shrink(s, x, a, ids, lora):
    ref = bgmv_shrink_reference(x, a, ids, lora).double()
    o = s.double()
    assert torch.isfinite(o).all(), "non-finite shrink output"
    eps = EPS[s.dtype]
    # fp32 accumulation then one rounding: half an ulp of |ref| plus fp32 slack on sum|x a|
    mag = bgmv_shrink_reference(x.abs(), a.abs(), ids, lora).double()
    err = (o - ref).abs()
    bad = err > eps * ref.abs() + 1e-5 * mag + 1e-6
    assert not bad.any(), f"shrink: {bad.sum().item()} / {bad.numel()} off; max err {err.max().item():.3g}"


def check_expand(y, s, b, ids, lora, w):
    ref = bgmv_expand_reference(s, b, ids, lora, w).double()
    mag = bgmv_expand_reference(s.abs(), b.abs(), ids, lora, None if w is None else w.abs()).double()
    o = y.double()
    assert y.dtype == torch.float32
    assert torch.isfinite(o).all(), "non-finite expand output"
    err = (o - ref).abs()
    bad = err > 1e-5 * mag + 1e-7
    assert not bad.any(), f"expand: {bad.sum().item()} / {bad.numel()} off; max err {err.max().item():.3g}"


def run_plan(x, a, b, ids, w, lora, *, finalize=True, order=None, fused=None):
    t, k = ids.shape
    n, r = b.shape[2], a.shape[2]
    s = torch.full((t * k, r), float("nan"), dtype=x.dtype, device="cuda")
    y = torch.full((t, n) if finalize else (t * k, n), float("nan"), device="cuda")
    plan = prepare_bgmv_moe(x, a, b, ids, w, lora, sorted_token_ids=order, finalize=finalize,
                            out=y, shrink_out=s, fused=fused)
    plan.run()
    torch.cuda.synchronize()
    return plan


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k,h,n,r,num_l,num_e", [
    (1, 6, 2688, 2688, 32, 8, 128),
    (4, 2, 3072, 3072, 16, 4, 256),
    (32, 8, 3072, 3072, 64, 8, 256),
    (257, 6, 2688, 2688, 32, 8, 128),
    (33, 3, 1032, 4104, 8, 1, 5),
    # sm90 plans: the pair expand's R <= 32 build at 3 CTAs per SM, one wave (336 and 390
    # items; 4104 = 64 * 64 + 8: a partial last column chunk) and several (3900 at R = 24),
    # and its staged build (R = 32 beyond one wave: 1344 and 2600 items); the pair shrink's
    # staged build (R <= 32 from 64 items) in all of these; the staged rank 33..64 builds of
    # both (from 264 items; R = 40: a partial second k block) in the last two and in
    # (32, 8, 3072, ..., 64) above
    (8, 6, 2688, 2688, 32, 8, 128),
    (6, 8, 1000, 4104, 24, 2, 16),
    (32, 6, 2688, 2688, 32, 8, 128),
    (60, 6, 1000, 4104, 24, 2, 16),
    (40, 6, 1000, 4104, 32, 2, 16),
    (8, 6, 2688, 2688, 64, 8, 128),
    (24, 6, 1000, 1032, 40, 2, 16),
    (5, 1, 8, 8, 8, 16, 512),
])
def test_plan_matches_reference(design, dtype, t, k, h, n, r, num_l, num_e):
    x, a, b, ids, w, lora = make(t, k, h, n, r, num_l, num_e, dtype, seed=t * 31 + k)
    for finalize in (True, False):
        plan = run_plan(x, a, b, ids, w, lora, finalize=finalize)
        check_shrink(plan.shrink_out, x, a, ids, lora)
        check_expand(plan.out, plan.shrink_out, b, ids, lora, w if finalize else None)


def test_skipped_tokens_give_zero_rows(design):
    x, a, b, ids, w, lora = make(40, 4, 1024, 512, 16, 4, 16, torch.bfloat16, seed=2)
    lora[::3] = -1
    plan = run_plan(x, a, b, ids, w, lora)
    dead = lora < 0
    assert (plan.out[dead] == 0).all()
    assert (plan.shrink_out.view(40, 4, 16)[dead] == 0).all()
    check_expand(plan.out, plan.shrink_out, b, ids, lora, w)


def assert_order_matches_token_order(x, a, b, ids, w, lora, order):
    """The plan with `order` gives the token-order results bit for bit, and both are right."""
    p1 = run_plan(x, a, b, ids, w, lora)
    s1, y1 = p1.shrink_out.clone(), p1.out.clone()
    p2 = run_plan(x, a, b, ids, w, lora, order=order)
    assert torch.equal(p2.shrink_out, s1) and torch.equal(p2.out, y1)
    check_shrink(s1, x, a, ids, lora)
    check_expand(y1, s1, b, ids, lora, w)


@pytest.mark.parametrize("skew", [False, True])
def test_sorted_order_equals_token_order_bitwise(design, skew):
    x, a, b, ids, w, lora = make(300, 6, 2688, 2688, 32, 8, 128, torch.bfloat16, seed=4, skew=skew)
    assert_order_matches_token_order(x, a, b, ids, w, lora, sorted_order(ids))


def test_padded_sorted_order_small_batch(design):
    """Few pairs (pair schedule) but a long padded order (Q >= 512): the sm90 pair kernel is
    compiled with its small shape only and must still cover every entry."""
    x, a, b, ids, w, lora = make(40, 6, 2688, 2688, 32, 8, 128, torch.bfloat16, seed=11)
    order = sorted_order(ids, block=64)
    assert order.numel() >= 512 and 40 * 6 < 384
    assert_order_matches_token_order(x, a, b, ids, w, lora, order)


@pytest.mark.parametrize("t,skew", [(8, False), (512, False), (512, True), (2048, False)])
def test_bitwise_deterministic_over_100_runs(design, t, skew):
    x, a, b, ids, w, lora = make(t, 6, 2688, 2688, 32, 8, 128, torch.bfloat16, seed=5, skew=skew)
    plan = run_plan(x, a, b, ids, w, lora)
    s0, y0 = plan.shrink_out.clone(), plan.out.clone()
    for _ in range(100):
        plan.shrink_out.fill_(float("nan"))
        plan.out.fill_(float("nan"))
        plan.run()
        torch.cuda.synchronize()
        assert torch.equal(plan.shrink_out, s0) and torch.equal(plan.out, y0)


@pytest.mark.parametrize("finalize", [True, False])
@pytest.mark.parametrize("h,n,r", [(2688, 2688, 32), (1000, 1016, 24), (3080, 520, 64),
                                   (2688, 1032, 16)])
def test_batch_invariance(design, finalize, h, n, r):
    """A token's outputs do not depend on which other tokens share the batch: subsets of 1..300
    tokens (the small-T pair schedule; 8 and 28 tokens at H_out = 2688, R = 32: the sm90
    plan's R <= 32 build of the pair expand, one wave and several) against the full batch of 1024 (the
    bin-grouped schedule), bit for bit. The odd shapes put partial k blocks / segments / column chunks at
    the end of H, N and R (H = 1000: a 32-element block with one live vector; R = 24); R = 16
    runs the sm90 expand's 16-element ring rows."""
    t, k = 1024, 6
    x, a, b, ids, w, lora = make(t, k, h, n, r, 8, 128, torch.bfloat16, seed=6)
    full = run_plan(x, a, b, ids, w, lora, finalize=finalize)
    for sel in (torch.arange(1, device="cuda"), torch.arange(0, t, 37, device="cuda"),
                torch.arange(8, 16, device="cuda"), torch.randperm(t, device="cuda")[:300]):
        sub = run_plan(x[sel].contiguous(), a, b, ids[sel].contiguous(), w[sel].contiguous(),
                       lora[sel].contiguous(), finalize=finalize)
        assert torch.equal(sub.shrink_out.view(len(sel), k, -1), full.shrink_out.view(t, k, -1)[sel])
        if finalize:
            assert torch.equal(sub.out, full.out[sel])
        else:
            assert torch.equal(sub.out.view(len(sel), k, -1), full.out.view(t, k, -1)[sel])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("finalize", [True, False])
@pytest.mark.parametrize("t,k,h,n,r,num_l,num_e,skew", [
    (1024, 6, 2688, 2688, 32, 8, 128, False),
    (700, 8, 1000, 1016, 24, 4, 64, False),
    (400, 2, 3080, 520, 64, 8, 128, True),
    (300, 6, 2688, 1032, 16, 8, 128, False),
    # sm90's wide shape (P >= 10 pairs per bin: groups of 32 pairs; also the 700 x 8 case
    # above): ~20 live pairs per bin at rank 40; with skew ~48 per bin (a group of 32 + the
    # rest) at rank 64 and 16
    (100, 4, 1000, 1016, 40, 2, 8, False),
    (120, 4, 2688, 2688, 64, 2, 8, True),
    (160, 4, 520, 1032, 16, 2, 8, True),
])
def test_fused_plan_equals_two_kernels_bitwise(design, dtype, finalize, t, k, h, n, r, num_l,
                                               num_e, skew):
    """Large-batch plans run shrink + expand of each bin in one launch (both designs): the
    same bits as the two-kernel plan, and both against the
    references. Odd shapes: partial k blocks / column chunks at the ends of H, N, R; R = 16
    and 64 run the other ring-row specializations; lora -1 tokens (dead pairs) everywhere."""
    x, a, b, ids, w, lora = make(t, k, h, n, r, num_l, num_e, dtype, seed=t + r, skew=skew)
    one = run_plan(x, a, b, ids, w, lora, finalize=finalize)
    two = run_plan(x, a, b, ids, w, lora, finalize=finalize, fused=False)
    assert one.meta["fused"] and not two.meta["fused"]    # both designs have the kernel
    # the fp32 per-pair workspace of a finalized bin schedule (none when y is per pair)
    ws_bytes = t * k * n * 4 if finalize else 0
    assert one.meta["workspace_bytes"] == two.meta["workspace_bytes"] == ws_bytes
    check_shrink(one.shrink_out, x, a, ids, lora)
    check_expand(one.out, one.shrink_out, b, ids, lora, w if finalize else None)
    assert torch.equal(one.shrink_out, two.shrink_out)
    assert torch.equal(one.out, two.out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("finalize", [True, False])
@pytest.mark.parametrize("t,k,h,n,r,num_l,num_e,skew,plan", [
    (1, 6, 2688, 2688, 32, 8, 128, False, True),
    (8, 6, 2688, 2688, 32, 8, 128, False, True),  # 336 CTAs: one wave at 3 per SM (H200)
    (16, 6, 384, 1024, 8, 8, 256, False, True),   # P = 96: the default bound; R = 8
    (4, 8, 1000, 4104, 24, 2, 16, False, True),   # partial last segment, column chunk; R = 24
    (2, 2, 4096, 4096, 16, 4, 64, True, True),    # 11 segments, skew
    (3, 1, 8, 8, 8, 16, 512, False, True),        # one segment of one vector, one column chunk
    # more shrink units than 4 warps x C CTAs (plans run the two kernels there): the kernel's
    # second and further units per warp, launched directly
    (2, 2, 392, 16, 32, 1, 1, True, False),
    (4, 8, 3072, 3072, 32, 8, 256, False, False),
    (16, 6, 1024, 512, 32, 8, 256, False, False),
    (12, 8, 4096, 520, 16, 4, 64, True, False),   # C = 9 CTAs per token, 11 segments, skew
])
def test_small_plan_one_launch_equals_two_kernels_bitwise(monkeypatch, dtype, finalize, t, k, h,
                                                          n, r, num_l, num_e, skew, plan):
    """Ada design plans of small batches (T*k <= 96, rank <= 32, one wave of CTAs, one shrink
    unit per unit warp) run shrink and expand in one launch (a CTA per token and column chunk
    that also computes a share of the token's shrink and exchanges the segment partials
    through global memory): the same bits as the two pair kernels, and both against the
    references; run again (the launch counts of the exchange advance) with new contents and
    an all-dead token. (The sm90 design keeps its PDL-overlapped pair kernels: the one-launch
    kernel measured slower there.)"""
    from conftest import designs_here
    from cutekern.bgmv_moe import _binplan_function, _pair_plan_fits, _pair_plan_max, _pair_xch
    if "ada" not in designs_here():
        pytest.skip("needs a GPU that runs the Ada design")
    monkeypatch.setenv("CUTEKERN_DESIGN", "ada")
    x, a, b, ids, w, lora = make(t, k, h, n, r, num_l, num_e, dtype, seed=t + r + k, skew=skew)
    fn = _binplan_function(dtype, finalize, x.device)
    assert _pair_plan_max(fn) >= t * k
    fits = _pair_plan_fits(fn, t, k, r, h, n, x.device)
    if plan:
        if not fits:
            pytest.skip("on this GPU the plan runs the two kernels here (more CTAs than one "
                        "wave); an H200 runs all these plan cases in one launch")
        one = run_plan(x, a, b, ids, w, lora, finalize=finalize)
        assert one.meta["fused"] and len(one._calls) == 1
        outs = lambda: (one.shrink_out, one.out)              # noqa: E731
        run = one.run
    else:
        assert not fits and not run_plan(x, a, b, ids, w, lora, finalize=finalize).meta["fused"]
        s1 = torch.full((t * k, r), float("nan"), dtype=dtype, device="cuda")
        y1 = torch.full((t, n) if finalize else (t * k, n), float("nan"), device="cuda")
        xch = _pair_xch(t, k, r, h, n, x.device)
        call = fn.bind(x, a, b, ids, lora, w if finalize else torch.zeros_like(w), s1, y1, xch)
        outs = lambda: (s1, y1)                                # noqa: E731
        run = call.launch
        run()
        torch.cuda.synchronize()
    two = run_plan(x, a, b, ids, w, lora, finalize=finalize, fused=False)
    assert len(two._calls) == 2
    for rnd in range(3):
        if rnd:
            new = make(t, k, h, n, r, num_l, num_e, dtype, seed=100 * rnd + t, skew=skew)
            for dst, src in zip((x, a, b, ids, w, lora), new):
                dst.copy_(src)
            lora[0] = -1
            for o in (*outs(), two.shrink_out, two.out):
                o.fill_(float("nan"))
            run()
            two.run()
            torch.cuda.synchronize()
        s1, y1 = outs()
        check_shrink(s1, x, a, ids, lora)
        check_expand(y1, s1, b, ids, lora, w if finalize else None)
        assert torch.equal(s1, two.shrink_out)
        assert torch.equal(y1, two.out)


@pytest.mark.parametrize("t,k,h,n,r,num_l,num_e", [
    (1, 6, 2688, 2688, 32, 8, 128),
    (8, 6, 2688, 4104, 64, 8, 128),
    (40, 6, 1000, 4104, 24, 2, 16),
    (700, 8, 1000, 1016, 24, 4, 64),
])
def test_designs_agree_bitwise(monkeypatch, t, k, h, n, r, num_l, num_e):
    """The Ada design runs the sm90 kernels without PDL (and without the sm90 plan's staged /
    one-item-per-CTA builds; its one-launch plan kernel without the small-bin shape), i.e. the
    same mma chains: both designs give the same bits, small and large batches, finalized or
    not."""
    from conftest import designs_here
    if not {"sm90", "ada"} <= set(designs_here()):
        pytest.skip("needs a GPU that runs both designs")
    x, a, b, ids, w, lora = make(t, k, h, n, r, num_l, num_e, torch.bfloat16, seed=t + 7)
    got = {}
    for d in ("sm90", "ada"):
        monkeypatch.setenv("CUTEKERN_DESIGN", d)
        for finalize in (True, False):
            plan = run_plan(x, a, b, ids, w, lora, finalize=finalize)
            assert {c.fn.meta["design"] for c in plan._calls} == {d}   # that design's kernels ran
            got[d, finalize] = (plan.shrink_out.clone(), plan.out.clone())
    check_expand(got["ada", True][1], got["ada", True][0], b, ids, lora, w)
    for finalize in (True, False):
        assert torch.equal(got["sm90", finalize][0], got["ada", finalize][0])
        assert torch.equal(got["sm90", finalize][1], got["ada", finalize][1])


def test_one_bin_with_repeated_expert_ids(design):
    """Every token sends all 8 slots to expert 0 under adapter 0: one bin holds all T * k
    pairs, more per token round than the sm90 bin list holds, so the bin kernels collect
    those rounds pair by pair instead. Against the reference, and a token alone (pair
    schedule) against the same token in the batch, bit for bit."""
    t, k = 1500, 8
    x, a, b, ids, w, lora = make(t, k, 1024, 1032, 32, 2, 4, torch.bfloat16, seed=21,
                                 none_frac=0.0)
    ids.zero_()
    lora.zero_()
    full = run_plan(x, a, b, ids, w, lora)
    check_shrink(full.shrink_out, x, a, ids, lora)
    check_expand(full.out, full.shrink_out, b, ids, lora, w)
    one = run_plan(x[7:8].contiguous(), a, b, ids[7:8].contiguous(), w[7:8].contiguous(),
                   lora[7:8].contiguous())
    assert torch.equal(one.shrink_out, full.shrink_out[7 * k:8 * k])
    assert torch.equal(one.out, full.out[7:8])


# 8: the one-launch small-batch kernel; 32: pair schedules; 300 (1.76 pairs per bin) and
# 700: bins (the one-launch plan kernel)
@pytest.mark.parametrize("t", [8, 32, 300, 700])
def test_graph_replay_with_new_contents(design, t, warm_graph_pool):
    k, h, n, r, num_l, num_e = 6, 2688, 2688, 32, 8, 128
    x, a, b, ids, w, lora = make(t, k, h, n, r, num_l, num_e, torch.bfloat16, seed=7)
    plan = prepare_bgmv_moe(x, a, b, ids, w, lora)
    plan.run()
    torch.cuda.synchronize()
    warm_graph_pool()
    before = torch.cuda.memory_allocated()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run()
    assert torch.cuda.memory_allocated() == before, "run() allocated memory"
    for seed in (8, 9, 10):
        new = make(t, k, h, n, r, num_l, num_e, torch.bfloat16, seed=seed)
        for dst, src in zip((x, a, b, ids, w, lora), new):
            dst.copy_(src)
        plan.shrink_out.fill_(float("nan"))
        plan.out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check_shrink(plan.shrink_out, x, a, ids, lora)
        check_expand(plan.out, plan.shrink_out, b, ids, lora, w)


def test_one_shot_and_compile(design):
    x, a, b, ids, w, lora = make(9, 2, 512, 256, 16, 2, 8, torch.float16, seed=11)
    s = bgmv_moe_shrink(x, a, ids, lora)
    y = bgmv_moe_expand(s, b, ids, lora, w)
    yp = bgmv_moe_expand(s, b, ids, lora, finalize=False)
    torch.cuda.synchronize()
    check_shrink(s, x, a, ids, lora)
    check_expand(y, s, b, ids, lora, w)
    check_expand(yp, s, b, ids, lora, None)
    f = torch.compile(lambda *args: bgmv_moe_expand(bgmv_moe_shrink(*args[:4]), b, args[2], args[3], args[4]),
                      fullgraph=True)
    yc = f(x, a, ids, lora, w)
    assert torch.equal(yc, y)


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(t=st.one_of(st.integers(1, 64), st.integers(65, 1500)), k=st.integers(1, 8), h8=st.integers(1, 600), n8=st.integers(1, 600),
       r=st.sampled_from([8, 16, 24, 32, 40, 48, 56, 64]), num_l=st.integers(1, 16),
       num_e=st.sampled_from([1, 3, 8, 64, 128, 512]), skew=st.booleans(),
       none_frac=st.sampled_from([0.0, 0.3, 1.0]), finalize=st.booleans(),
       dtype=st.sampled_from(DTYPES), sort=st.booleans(), seed=st.integers(0, 2**30))
def test_fuzz(design, t, k, h8, n8, r, num_l, num_e, skew, none_frac, finalize, dtype, sort, seed):
    h, n = 8 * h8, 8 * n8
    if num_l * num_e * r * (h + n) * 2 > 2**30:  # keep the weights under 1 GiB
        num_e = max(1, 2**30 // (num_l * r * (h + n) * 2))
    x, a, b, ids, w, lora = make(t, k, h, n, r, num_l, num_e, dtype, seed, skew=skew,
                                 none_frac=none_frac)
    plan = run_plan(x, a, b, ids, w, lora, finalize=finalize, order=sorted_order(ids) if sort else None)
    check_shrink(plan.shrink_out, x, a, ids, lora)
    check_expand(plan.out, plan.shrink_out, b, ids, lora, w if finalize else None)
    assert bgmv_live(ids, lora, num_l, num_e).shape == ids.shape


def test_bad_inputs_name_the_argument():
    x, a, b, ids, w, lora = make(4, 2, 256, 256, 16, 2, 8, torch.bfloat16, seed=0)
    bad = ids.clone()
    bad[0, 0] = 8
    with pytest.raises(ValueError, match="'topk_ids'"):
        prepare_bgmv_moe(x, a, b, bad, w, lora)
    bad_l = lora.clone()
    bad_l[1] = 2
    with pytest.raises(ValueError, match="'lora_indices'"):
        prepare_bgmv_moe(x, a, b, ids, w, bad_l)
    with pytest.raises(ValueError, match="'sorted_token_ids'"):
        prepare_bgmv_moe(x, a, b, ids, w, lora, sorted_token_ids=torch.zeros(8, dtype=torch.int32, device="cuda"))
    with pytest.raises(TypeError, match="'lora_b'"):
        prepare_bgmv_moe(x, a, b.half(), ids, w, lora)


@pytest.mark.parametrize("t", [5, 600])
def test_out_of_range_ids_at_run_time_are_skipped(design, t):
    """run() does not re-check indices (no host sync); ids that go out of range after
    prepare (expert -1 or >= E, adapter >= L) make their pair contribute nothing."""
    x, a, b, ids, w, lora = make(t, 4, 1024, 512, 16, 4, 16, torch.bfloat16, seed=12, none_frac=0.0)
    plan = prepare_bgmv_moe(x, a, b, ids, w, lora)
    ids[0, 1], ids[1, 0], lora[2] = -1, 16, 4
    plan.run()
    torch.cuda.synchronize()
    assert not bgmv_live(ids, lora, 4, 16)[:3].all()
    check_shrink(plan.shrink_out, x, a, ids, lora)
    check_expand(plan.out, plan.shrink_out, b, ids, lora, w)


def test_zero_tokens(design):
    x, a, b, ids, w, lora = make(0, 2, 256, 256, 16, 2, 8, torch.bfloat16, seed=0)
    plan = prepare_bgmv_moe(x, a, b, ids, w, lora)
    assert plan.run().shape == (0, 256) and plan.shrink_out.shape == (0, 16)
