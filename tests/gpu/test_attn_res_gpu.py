"""AttnRes on the GPU against the fp32 reference: prefix and blocks bit-exact, out within a
bf16 bound (tighter than the public bar), fresh random inputs, NaN-poisoned outputs, every
K, with/without delta and output norm, snapshot writes, M from 1 to 16384, hidden sizes
7168 / non-power-of-two / the upper tier, a hypothesis fuzz, CUDA-graph capture + replay."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from cutekern.abi import ATTN_RES_WORK_WORDS
from cutekern.attn_res import attn_res, prepare_attn_res
from cutekern.reference import attn_res_reference

BF16 = torch.bfloat16


def make(m, nb, h, seed, *, delta=True, onorm=True, row_pad=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(BF16)  # noqa: E731

    def rows(*shape):  # optionally a strided view: rows padded by row_pad elements
        if not row_pad:
            return r(*shape)
        full = r(*shape[:-1], shape[-1] + row_pad)
        return full[..., :shape[-1]]

    prefix = rows(m, h)
    d = rows(m, h) if delta else None
    blocks = rows(m, nb, h)
    # weights around 1 with spread, so scores differ between sources
    nw = (1 + 0.3 * torch.randn(h, device="cuda", generator=g)).to(BF16)
    qw = (0.05 * torch.randn(h, device="cuda", generator=g)).to(BF16)
    onw = (1 + 0.3 * torch.randn(h, device="cuda", generator=g)).to(BF16) if onorm else None
    return prefix, d, blocks, nw, qw, onw


def check(prefix, d, blocks, nw, qw, onw, k, w, out, ref_in, eps=1e-5, oeps=1e-5):
    p_ref, b_ref, o_ref = attn_res_reference(*ref_in, k, w, eps, oeps)
    assert torch.equal(prefix, p_ref), f"prefix not bit-exact: {(prefix != p_ref).sum().item()} differ"
    assert torch.equal(blocks, b_ref), f"blocks not bit-exact: {(blocks != b_ref).sum().item()} differ"
    o = out.float()
    assert torch.isfinite(o).all(), f"non-finite outputs: {(~torch.isfinite(o)).sum().item()}"
    err = (o - o_ref).abs()
    # one bf16 rounding of an fp32 value (half an ulp = 2**-9 relative) plus fp32 slack;
    # the public bar is atol 8e-2, rtol 3e-2
    bound = 2 ** -8 * o_ref.abs() + 2e-3
    bad = err > bound
    assert not bad.any(), (f"{bad.sum().item()} / {bad.numel()} out elements off; max err "
                           f"{err.max().item():.3g} at {tuple(torch.nonzero(bad)[0].tolist())}")


def run_case(m, nb, h, k, w, seed, *, delta=True, onorm=True, row_pad=0, eps=1e-5, oeps=1e-5):
    prefix, d, blocks, nw, qw, onw = make(m, nb, h, seed, delta=delta, onorm=onorm, row_pad=row_pad)
    ref_in = (prefix.clone(), None if d is None else d.clone(), blocks.clone(), nw, qw, onw)
    out = torch.full((m, h), float("nan"), dtype=BF16, device="cuda")
    runner = prepare_attn_res(prefix, d, blocks, nw, qw, onw, out, num_blocks=k,
                              block_write_idx=w, eps=eps, output_norm_eps=oeps)
    runner.launch()
    torch.cuda.synchronize()
    check(prefix, d, blocks, nw, qw, onw, k, w, out, ref_in, eps, oeps)


@pytest.mark.parametrize("k", range(9))
def test_every_num_blocks(design, k):
    # delta / output norm / snapshot write vary with K so every combination is met
    run_case(257, 8, 7168, k, k if k < 8 and k % 2 else -1, seed=k,
             delta=k % 2 == 0, onorm=k % 3 != 0)


@pytest.mark.parametrize("delta", [True, False])
@pytest.mark.parametrize("onorm", [True, False])
def test_delta_and_output_norm(design, delta, onorm):
    run_case(64, 8, 7168, 5, 5, seed=11, delta=delta, onorm=onorm)


@pytest.mark.parametrize("w", [0, 3, 7])
def test_snapshot_write_slot(design, w):
    # w < K: the written slot is read back as the new prefix (the reference's order)
    run_case(33, 8, 7168, 6, w, seed=20 + w)


@pytest.mark.parametrize("m", [1, 2, 3, 16, 128, 255, 1024, 4099])
def test_rows(design, m):
    run_case(m, 8, 7168, 8, -1, seed=m)


@pytest.mark.parametrize("h", [8, 1032, 2056, 8192, 8200, 12344, 16384])
def test_hidden_sizes(design, h):
    run_case(37, 4, h, 3, 3, seed=h)


@pytest.mark.parametrize("split", [2, 4, 8])
@pytest.mark.parametrize("m,h,k,w", [(1, 7168, 8, -1), (100, 7168, 7, 2), (41, 16384, 5, 5),
                                     (19, 8200, 0, 0), (70, 1032, 3, -1), (9, 40, 3, -1)])
def test_forced_row_split(design, monkeypatch, split, m, h, k, w):
    """The split kernels at any M (sm90: clusters exchanging through DSMEM; Ada: groups of
    CTAs exchanging through global memory): several rows per group (the direct kernels
    prefetch the next row's sources), both hidden tiers (sm90's 16384 at split 2 keeps the
    ring; Ada has no such build), empty slices (small H over 8 CTAs), K = 0 and w < K."""
    if design == "ada" and h > 8192 and split == 2:
        pytest.skip("the Ada design has no 16384-tier build over 2 CTAs")
    monkeypatch.setenv("CUTEKERN_ATTN_RES_SPLIT", str(split))
    run_case(m, 8, h, k, w, seed=split * 1000 + m)


@pytest.mark.parametrize("h", [1032, 8200])
def test_many_short_rows(design, h):
    """sm90: K=1 rows (3 loads) take the dynamic-row path only from M >= 2048; both tiers."""
    run_case(2100, 2, h, 1, -1, seed=h + 1)


def test_large_m(design):
    run_case(16384, 8, 7168, 8, -1, seed=5)


def test_strided_rows_and_eps(design):
    run_case(50, 3, 7168, 2, 2, seed=3, row_pad=64, eps=1e-3, oeps=0.5)


def test_one_shot_allocates_out(design):
    prefix, d, blocks, nw, qw, onw = make(5, 2, 1024, 7)
    ref_in = (prefix.clone(), d.clone(), blocks.clone(), nw, qw, onw)
    out = attn_res(prefix, d, blocks, nw, qw, onw, num_blocks=2, block_write_idx=-1)
    torch.cuda.synchronize()
    check(prefix, d, blocks, nw, qw, onw, 2, -1, out, ref_in)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(m=st.integers(1, 1500), nb=st.integers(1, 8), h8=st.integers(1, 2048),
       data=st.data(), delta=st.booleans(), onorm=st.booleans(), seed=st.integers(0, 2**30))
def test_fuzz(design, m, nb, h8, data, delta, onorm, seed):
    k = data.draw(st.integers(0, nb), label="num_blocks")
    w = data.draw(st.integers(-1, nb - 1), label="block_write_idx")
    pad = data.draw(st.sampled_from([0, 8, 40]), label="row_pad")
    run_case(m, nb, 8 * h8, k, w, seed, delta=delta, onorm=onorm, row_pad=pad)


# 8: the split kernels (Ada: exchange records in the runner's work buffer); 96 / 300: one
# CTA per row (sm90: static / dynamic rows)
@pytest.mark.parametrize("m", [8, 96, 300])
def test_graph_capture_and_replay_with_new_contents(design, warm_graph_pool, m):
    nb, h, k, w = 8, 7168, 7, 7
    prefix, d, blocks, nw, qw, onw = make(m, nb, h, 1)
    out = torch.full((m, h), float("nan"), dtype=BF16, device="cuda")
    runner = prepare_attn_res(prefix, d, blocks, nw, qw, onw, out, num_blocks=k, block_write_idx=w)
    runner.launch()  # warm-up outside the capture
    warm_graph_pool()
    before = torch.cuda.memory_allocated()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        runner.launch()
    assert torch.cuda.memory_allocated() == before, "launch() allocated memory"
    for seed in (2, 3, 4):
        src = make(m, nb, h, seed)
        for dst, s in zip((prefix, d, blocks, nw, qw, onw), src):
            dst.copy_(s)
        out.fill_(float("nan"))
        ref_in = (prefix.clone(), d.clone(), blocks.clone(), nw.clone(), qw.clone(), onw.clone())
        g.replay()
        torch.cuda.synchronize()
        check(prefix, d, blocks, nw, qw, onw, k, w, out, ref_in)
    # the row-scheduler counters are back to zero after every launch
    assert runner._work[:2].tolist() == [0, 0]


@pytest.mark.parametrize("m,split,h", [(1, 8, 7168), (5, 8, 1032), (16, 4, 7168), (9, 4, 12344),
                                       (40, 2, 7168), (100, 2, 7168), (30, 8, 12344)])
def test_split_designs_agree_bitwise(monkeypatch, m, split, h):
    """The Ada design's split kernels (totals exchanged through global memory) and the sm90
    ones (DSMEM): the same sums in the same order, so the same bits in every output."""
    monkeypatch.setenv("CUTEKERN_ATTN_RES_SPLIT", str(split))
    res = {}
    for d in ("sm90", "ada"):
        monkeypatch.setenv("CUTEKERN_DESIGN", d)
        prefix, dd, blocks, nw, qw, onw = make(m, 8, h, seed=m + split)
        out = torch.full((m, h), float("nan"), dtype=BF16, device="cuda")
        runner = prepare_attn_res(prefix, dd, blocks, nw, qw, onw, out, num_blocks=8,
                                  block_write_idx=3)
        assert runner._work.numel() == (2 if d == "sm90" else ATTN_RES_WORK_WORDS)
        runner.launch()
        torch.cuda.synchronize()
        res[d] = (out, prefix, blocks)
    for name, a, b in zip(("out", "prefix", "blocks"), res["sm90"], res["ada"]):
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} elements differ"


def test_split_exchange_state_across_launches(design):
    """The split kernels' exchange state (Ada: sequence numbers in the work buffer) carries
    over between launches: one-shot calls on one stream (one shared buffer) with M and
    so splits and groups changing from call to call, with and without the output norm (1 or
    2 exchanges per row), twice round, and a runner launched between them; every call checked
    (a stale or skipped exchange would hang or give wrong sums)."""
    nb = 8
    cases = [(1, 7168, 8, -1, True), (13, 7168, 5, 2, True), (40, 1032, 8, 7, False),
             (3, 12344, 0, 0, True), (16, 7168, 8, -1, False), (64, 2056, 3, -1, True)]
    prefix, d, blocks, nw, qw, onw = make(7, nb, 7168, 77)
    out_r = torch.empty((7, 7168), dtype=BF16, device="cuda")
    runner = prepare_attn_res(prefix, d, blocks, nw, qw, onw, out_r, num_blocks=6)
    for rnd in range(2):
        for i, (m, h, k, w, onorm) in enumerate(cases):
            args = make(m, nb, h, 100 * rnd + i, onorm=onorm)
            ref_in = tuple(None if t is None else t.clone() for t in args)
            out = torch.full((m, h), float("nan"), dtype=BF16, device="cuda")
            attn_res(*args, out=out, num_blocks=k, block_write_idx=w)
            torch.cuda.synchronize()
            check(*args, k, w, out, ref_in)
            src = make(7, nb, 7168, 1000 * rnd + i)
            for dst, t in zip((prefix, d, blocks), src[:3]):
                dst.copy_(t)
            ref_r = (prefix.clone(), d.clone(), blocks.clone(), nw, qw, onw)
            out_r.fill_(float("nan"))
            runner.launch()
            torch.cuda.synchronize()
            check(prefix, d, blocks, nw, qw, onw, 6, -1, out_r, ref_r)


@pytest.mark.parametrize("m", [133, 1000])
def test_repeated_launches_reset_the_row_counters(design, m):
    """One runner, several launches with new contents: every row is computed each time (a
    counter left non-zero would skip rows, which the NaN-poisoned out would show)."""
    nb, h, k, w = 8, 1032, 8, -1
    prefix, d, blocks, nw, qw, onw = make(m, nb, h, 11)
    out = torch.empty((m, h), dtype=BF16, device="cuda")
    runner = prepare_attn_res(prefix, d, blocks, nw, qw, onw, out, num_blocks=k, block_write_idx=w)
    for seed in (12, 13, 14):
        for dst, s in zip((prefix, d, blocks), make(m, nb, h, seed)[:3]):
            dst.copy_(s)
        out.fill_(float("nan"))
        ref_in = (prefix.clone(), d.clone(), blocks.clone(), nw, qw, onw)
        runner.launch()
        torch.cuda.synchronize()
        check(prefix, d, blocks, nw, qw, onw, k, w, out, ref_in)
        assert runner._work.tolist() == [0, 0]


def test_one_shot_calls_on_two_streams(design):
    """One-shot calls keep one row-counter buffer per stream: two calls running at once on
    two streams (dynamic rows: M >= 2048) must not share it."""
    nb, h, k = 2, 1032, 1
    cases = []
    for seed in (31, 32):
        prefix, d, blocks, nw, qw, onw = make(2300, nb, h, seed)
        ref_in = (prefix.clone(), d.clone(), blocks.clone(), nw, qw, onw)
        out = torch.full((2300, h), float("nan"), dtype=BF16, device="cuda")
        cases.append(((prefix, d, blocks, nw, qw, onw), ref_in, out))
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    for _ in range(3):  # several rounds: a shared counter would skip or repeat rows
        for (args, _, out), st in zip(cases, streams):
            with torch.cuda.stream(st):
                attn_res(*args, out=out, num_blocks=k)
    torch.cuda.synchronize()
    # three in-place prefix updates (prefix += delta each round): rebuild the reference
    for (args, ref_in, out) in cases:
        p, dd, b, nw, qw, onw = ref_in
        for _ in range(2):
            p, b, _o = attn_res_reference(p, dd, b, nw, qw, onw, k, -1, 1e-5, 1e-5)
        check(*args, k, -1, out, (p, dd, b, nw, qw, onw))


def test_torch_compile(design):
    prefix, d, blocks, nw, qw, onw = make(8, 4, 2048, 9)
    ref_in = (prefix.clone(), d.clone(), blocks.clone(), nw, qw, onw)

    @torch.compile(fullgraph=True)
    def f(prefix, d, blocks, nw, qw, onw):
        return attn_res(prefix, d, blocks, nw, qw, onw, num_blocks=4, block_write_idx=-1)

    out = f(prefix, d, blocks, nw, qw, onw)
    torch.cuda.synchronize()
    check(prefix, d, blocks, nw, qw, onw, 4, -1, out, ref_in)


def test_bad_inputs_name_the_argument():
    prefix, d, blocks, nw, qw, onw = make(4, 2, 1024, 0)
    out = torch.empty_like(prefix)
    with pytest.raises(ValueError, match="num_blocks"):
        prepare_attn_res(prefix, d, blocks, nw, qw, onw, out, num_blocks=3)
    with pytest.raises(ValueError, match="block_write_idx"):
        prepare_attn_res(prefix, d, blocks, nw, qw, onw, out, num_blocks=1, block_write_idx=2)
    with pytest.raises(ValueError, match="'out' overlaps 'prefix'"):
        prepare_attn_res(prefix, d, blocks, nw, qw, onw, prefix, num_blocks=1)
    with pytest.raises(TypeError, match="'delta'"):
        prepare_attn_res(prefix, d.half(), blocks, nw, qw, onw, out, num_blocks=1)


def test_zero_rows(design):
    prefix, d, blocks, nw, qw, onw = make(0, 2, 1024, 0)
    out = torch.empty_like(prefix)
    prepare_attn_res(prefix, d, blocks, nw, qw, onw, out, num_blocks=2).launch()
    assert attn_res(prefix, d, blocks, nw, qw, onw, num_blocks=1).shape == (0, 1024)


@pytest.mark.parametrize("m", [1, 16, 63, 128, 300, 2048])
def test_default_kernel_choice(monkeypatch, m):
    """No design forced: the per-shape choice (cluster-split sm90 kernel for small M, the
    sm90 kernel from M = 128: its online-schedule build for K <= 1 below M = 8192 and for up
    to 2048 loads per launch (M = 128 at K = 8), the batched one at M = 300 / 2048; the
    Ada-design kernel for K <= 1 from M = 8192) is correct too."""
    monkeypatch.delenv("CUTEKERN_DESIGN", raising=False)
    run_case(m, 8, 7168, 8, 7 if m % 2 else -1, seed=m + 99)
    if m >= 300:  # K = 1: the online build
        run_case(m, 2, 7168, 1, -1, seed=m + 98)
