"""References and the torch baselines agree with an explicit per-candidate loop."""
import torch
from hypothesis import given, settings, strategies as st

from cutekern.reference import (lce_broadcast_bmm, lce_decomposed, lce_decomposed_padded,
                                lce_reference, pad_k, pad_k_rows)


def _problem(b_counts, m, n, kc, ku, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    u = len(b_counts)
    c2u = torch.repeat_interleave(torch.arange(u, dtype=torch.int32), torch.tensor(b_counts))
    b = int(c2u.numel())
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)
    return mk(m, kc), mk(m, ku), mk(b, kc, n), mk(u, ku, n), c2u


def _loop(w_cand, w_user, e_cand, e_user, c2u):
    return torch.stack([w_cand.double() @ e_cand[i].double() + w_user.double() @ e_user[int(c2u[i])].double()
                        for i in range(e_cand.shape[0])])


@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.integers(0, 4), min_size=1, max_size=5).filter(lambda c: sum(c) > 0),
       m=st.integers(1, 9), n=st.integers(1, 9), kc=st.integers(1, 11), ku=st.integers(1, 11),
       seed=st.integers(0, 2**31 - 1))
def test_reference_matches_loop(counts, m, n, kc, ku, seed):
    args = _problem(counts, m, n, kc, ku, seed)
    want = _loop(*args)
    torch.testing.assert_close(lce_reference(*args), want, rtol=1e-12, atol=1e-12)
    for fn in (lce_broadcast_bmm, lce_decomposed):
        torch.testing.assert_close(fn(*args).double(), want, rtol=1e-5, atol=1e-4)
    wc, wu = pad_k(args[0]), pad_k(args[1])
    torch.testing.assert_close(lce_decomposed_padded(wc, wu, pad_k_rows(args[2]), pad_k_rows(args[3]), args[4]).double(),
                               want, rtol=1e-5, atol=1e-4)


def test_pad_k_zero_fills_and_aligns():
    w = torch.randn(3, 13)
    p = pad_k(w)
    assert p.shape == (3, 16) and p.stride(0) % 8 == 0
    assert torch.equal(p[:, :13], w) and not p[:, 13:].any()
    w8 = torch.randn(3, 16)
    assert pad_k(w8) is w8  # already aligned: no copy
