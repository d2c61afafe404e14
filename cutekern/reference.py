"""Reference implementations (float64/float32 math), the ground truth for every test."""
from __future__ import annotations

import torch


def lce_reference(w_cand, w_user, e_cand, e_user, cand_to_user, acc_dtype=torch.float64):
    """out[b] = w_cand @ e_cand[b] + w_user @ e_user[cand_to_user[b]] in ``acc_dtype``."""
    wc, wu = w_cand.to(acc_dtype), w_user.to(acc_dtype)
    user = torch.matmul(wu, e_user.to(acc_dtype))               # [U, M, N], once per user
    cand = torch.matmul(wc, e_cand.to(acc_dtype))               # [B, M, N]
    return cand + user[cand_to_user.long()]


def lce_broadcast_bmm(w_cand, w_user, e_cand, e_user, cand_to_user):
    """The route a user writes first: broadcast the user embeddings, one batched matmul."""
    w = torch.cat([w_user, w_cand], dim=1)
    e = torch.cat([e_user.index_select(0, cand_to_user.long()), e_cand], dim=1)
    return torch.matmul(w, e)


def lce_decomposed(w_cand, w_user, e_cand, e_user, cand_to_user):
    """Decomposition: the user GEMM once per user, then gather and add."""
    user = torch.matmul(w_user, e_user)
    return torch.baddbmm(user.index_select(0, cand_to_user.long()),
                         w_cand.expand(e_cand.shape[0], -1, -1), e_cand)


def pad_k(w, multiple=8):
    """Zero-pad the K (last) dim of a weight so its rows are 16-byte aligned."""
    k = w.shape[-1]
    kp = -(-k // multiple) * multiple
    if kp == k and w.is_contiguous():
        return w
    out = w.new_zeros(*w.shape[:-1], kp)
    out[..., :k] = w
    return out


def pad_k_rows(e, multiple=8):
    """Zero-pad the K dim (dim 1) of an embedding tensor [B, K, N] to a multiple of 8."""
    k = e.shape[1]
    kp = -(-k // multiple) * multiple
    return e if kp == k else torch.nn.functional.pad(e, (0, 0, 0, kp - k))


def lce_decomposed_padded(w_cand_p, w_user_p, e_cand_p, e_user_p, cand_to_user):
    """Decomposition with every K padded to a multiple of 8 (the strongest torch route):
    weights padded once, embeddings produced K-padded upstream (``pad_k_rows``), so cuBLAS
    runs its aligned kernels. Zero padding leaves the result unchanged."""
    return lce_decomposed(w_cand_p, w_user_p, e_cand_p, e_user_p, cand_to_user)


def ikbo_attention_reference(q, k, v, cand_to_user, kv_len=None, scale=None,
                             acc_dtype=torch.float32):
    """out[b] = softmax(q[b] k[u]^T * scale) v[u], u = cand_to_user[b], keys >= kv_len[u]
    masked; also lse [B, H, n_seed] (natural log). A user with kv_len 0 gives out 0,
    lse -inf. Computed per user in ``acc_dtype`` (never materializes a K/V broadcast)."""
    b, n_seed, h, d = q.shape
    u_count, s_max = k.shape[0], k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    if kv_len is None:
        kv_len = torch.full((u_count,), s_max, dtype=torch.int32, device=q.device)
    out = torch.zeros(b, n_seed, h, d, dtype=acc_dtype, device=q.device)
    lse = torch.full((b, h, n_seed), float("-inf"), dtype=acc_dtype, device=q.device)
    c2u = cand_to_user.long()
    for u in torch.unique(c2u).tolist():
        n = int(kv_len[u])
        rows = torch.nonzero(c2u == u).flatten()
        if n == 0 or rows.numel() == 0:
            continue
        qu = q[rows].to(acc_dtype)                      # [c, s, h, d]
        ku, vu = k[u, :n].to(acc_dtype), v[u, :n].to(acc_dtype)  # [n, h, d]
        s = torch.einsum("cshd,nhd->chsn", qu, ku) * scale
        lse[rows] = torch.logsumexp(s, dim=-1)
        out[rows] = torch.einsum("chsn,nhd->cshd", torch.softmax(s, dim=-1), vu)
    return out, lse
