"""Broadcast layout algebra: every (candidate, coordinate) of a candidate view reaches the
right user element, checked against explicit torch expansion; and the DSL layouts the
kernels use evaluate to the same offsets."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cutekern.layout import CandidateView
from helpers import dsl_installed


def _expand_check(view: CandidateView, user: torch.Tensor, c2u: torch.Tensor):
    expanded = user[c2u.long()]  # what a broadcast would materialize
    flat = user.reshape(-1)
    for b in range(view.num_candidates):
        for idx in torch.cartesian_prod(*[torch.arange(s) for s in view.shape_rest]).reshape(-1, len(view.shape_rest)).tolist():
            assert flat[view.offset(b, idx)] == expanded[(b, *idx)]


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=6).filter(lambda c: sum(c) > 0),
       rest=st.lists(st.integers(1, 4), min_size=1, max_size=2))
def test_gather_view_matches_expansion(counts, rest):
    u = len(counts)
    user = torch.arange(u * int(torch.tensor(rest).prod())).reshape(u, *rest)
    c2u = torch.repeat_interleave(torch.arange(u), torch.tensor(counts))
    view = CandidateView.gather(c2u.tolist(), u, rest, user.stride())
    assert view.layout() is None  # ragged counts are a gather mode, not an affine layout
    _expand_check(view, user, c2u)


@settings(max_examples=30, deadline=None)
@given(u=st.integers(1, 5), ratio=st.sampled_from([1, 2, 3, 7]), rest=st.lists(st.integers(1, 4), min_size=1, max_size=2))
def test_uniform_view_is_stride0(u, ratio, rest):
    user = torch.randn(u, *rest)
    c2u = torch.repeat_interleave(torch.arange(u), ratio)
    view = CandidateView.uniform(u, ratio, rest, user.stride())
    shape, stride = view.layout()
    assert shape[0] == (ratio, u) and stride[0] == (0, user.stride(0))
    _expand_check(view, user, c2u)


def test_edge_cases():
    user = torch.randn(3, 4)
    # one user, one candidate
    v = CandidateView.gather([0], 1, (4,), (4, 1))
    assert v.offset(0, (3,)) == 3
    # users 0 and 2 own no candidates
    v = CandidateView.gather([1, 1], 3, (4,), user.stride())
    assert v.offset(1, (2,)) == 6
    with pytest.raises(IndexError):
        v.offset(2, (0,))


@pytest.mark.skipif(not dsl_installed(), reason="needs nvidia-cutlass-dsl")
def test_dsl_layouts_match_host_model():
    import cutlass
    import cutlass.cute as cute
    from cutekern import layout as L

    u, ratio, m, n = 3, 4, 5, 8
    res = {}

    @cute.jit
    def probe():
        lay = L.uniform_candidate_layout(u, ratio, cute.make_layout((m, n), stride=(n, 1)), m * n)
        vals = []
        for b in cutlass.range_constexpr(u * ratio):
            for i in cutlass.range_constexpr(m):
                vals.append(cute.crd2idx(((b % ratio, b // ratio), i, 3), lay))
        res["uniform"] = vals
        w = cute.make_layout((m, n, 6), stride=(n, 1, 0))  # broadcast_mode's layout
        bc = []
        for l in cutlass.range_constexpr(6):
            bc.append(cute.crd2idx((2, 3, l), w))
        res["bcast"] = bc

    cute.compile(probe)
    view = CandidateView.uniform(u, ratio, (m, n), (m * n, n, 1))
    assert res["uniform"] == [view.offset(b, (i, 3)) for b in range(u * ratio) for i in range(m)]
    assert res["bcast"] == [2 * n + 3] * 6  # the shared weight: same element for every batch
