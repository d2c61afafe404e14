"""IKBO attention work list: every query row of every candidate is covered exactly once by a
chunk of its own user, no chunk exceeds block_m rows, no chunk mixes users."""
import torch
from hypothesis import given, settings, strategies as st

from cutekern._attn_work import build_work, max_chunks
from cutekern.reference import ikbo_attention_reference


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 9), min_size=1, max_size=8).filter(lambda c: sum(c) > 0),
       n_seed=st.sampled_from([1, 3, 64]), block_m=st.sampled_from([16, 64, 128]),
       sort=st.booleans(), data=st.data())
def test_work_covers_rows_once(counts, n_seed, block_m, sort, data):
    u = len(counts)
    c2u = torch.repeat_interleave(torch.arange(u, dtype=torch.int32), torch.tensor(counts))
    kv_len = torch.tensor(data.draw(st.lists(st.integers(0, 50), min_size=u, max_size=u)),
                          dtype=torch.int32) if sort else None
    work = build_work(c2u, u, n_seed, block_m, kv_len)
    if sort:  # longest users first, a user's chunks contiguous, unused entries last
        users = work[:, 0]
        n_valid = int((users >= 0).sum())
        assert (users[n_valid:] < 0).all()
        lens = kv_len[users[:n_valid].long()]
        assert (lens[1:] <= lens[:-1]).all()
        runs = torch.unique_consecutive(users[:n_valid])
        assert runs.numel() == torch.unique(users[:n_valid]).numel()
    assert work.dtype == torch.int32 and work.shape == (max_chunks(c2u.numel(), n_seed, u, block_m), 3)
    seen = torch.zeros(c2u.numel() * n_seed, dtype=torch.int64)
    for user, r0, r1 in work.tolist():
        if user < 0:
            continue
        assert 0 < r1 - r0 <= block_m
        seen[r0:r1] += 1
        assert set(c2u[torch.arange(r0, r1) // n_seed].tolist()) == {user}
    assert torch.all(seen == 1)


def test_reference_matches_broadcast_sdpa():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, 2, 8, generator=g)
    k = torch.randn(3, 7, 2, 8, generator=g)
    v = torch.randn(3, 7, 2, 8, generator=g)
    c2u = torch.tensor([0, 0, 2, 2, 2], dtype=torch.int32)
    kv_len = torch.tensor([7, 4, 3], dtype=torch.int32)
    out, lse = ikbo_attention_reference(q, k, v, c2u, kv_len, acc_dtype=torch.float64)
    for b in range(5):
        u = int(c2u[b]); n = int(kv_len[u])
        s = torch.einsum("shd,nhd->hsn", q[b].double(), k[u, :n].double()) * 8 ** -0.5
        torch.testing.assert_close(lse[b], torch.logsumexp(s, -1))
        torch.testing.assert_close(out[b], torch.einsum("hsn,nhd->shd", s.softmax(-1), v[u, :n].double()))
    # a user with no valid keys: zeros and -inf
    out, lse = ikbo_attention_reference(q, k, v, c2u, torch.tensor([7, 4, 0], dtype=torch.int32))
    assert not out[2:].any() and torch.isinf(lse[2:]).all()
