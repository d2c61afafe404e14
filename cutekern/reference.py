"""Reference implementations (float64/float32 math), the ground truth for every test."""
from __future__ import annotations

import math
from dataclasses import dataclass

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


def attn_res_reference(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                       num_blocks, block_write_idx=-1, eps=1e-5, output_norm_eps=1e-5):
    """AttnRes serving op on copies: returns (prefix', blocks', out fp32).

    prefix' = bf16(prefix + delta) (the in-place update, bit-exact target); blocks' has
    slot ``block_write_idx`` set to prefix'; out = rmsnorm(mix) * output_norm_weight (or mix)
    with mix = sum_i softmax_i(s) c_i over c = (blocks'[:, :K], prefix'), s_i =
    sum_h rmsnorm(c_i)[h] * norm_weight[h] * qk_weight[h]. All math in fp32.
    """
    f32 = torch.float32
    p = prefix.clone() if delta is None else (prefix.to(f32) + delta.to(f32)).to(prefix.dtype)
    bl = blocks.clone()
    if block_write_idx >= 0:
        bl[:, block_write_idx] = p
    src = torch.cat([bl[:, :num_blocks], p.unsqueeze(1)], dim=1).to(f32)   # [M, K+1, H]
    rms = torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + eps)
    s = (src * rms * (norm_weight.to(f32) * qk_weight.to(f32))).sum(-1)     # [M, K+1]
    mix = (torch.softmax(s, dim=-1).unsqueeze(-1) * src).sum(1)             # [M, H]
    if output_norm_weight is not None:
        mix = mix * torch.rsqrt(mix.pow(2).mean(-1, keepdim=True) + output_norm_eps) \
            * output_norm_weight.to(f32)
    return p, bl, mix


def attn_res_torch(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                   num_blocks, block_write_idx=-1, eps=1e-5, output_norm_eps=1e-5):
    """The torch route a user would run (in place, like the fused op): the baseline that the
    benchmark times eager and under torch.compile."""
    if delta is not None:
        prefix.copy_((prefix.float() + delta.float()).to(prefix.dtype))
    if block_write_idx >= 0:
        blocks[:, block_write_idx] = prefix
    src = torch.cat([blocks[:, :num_blocks], prefix.unsqueeze(1)], dim=1).float()
    s = (torch.nn.functional.rms_norm(src, (src.shape[-1],), eps=eps)
         * (norm_weight.float() * qk_weight.float())).sum(-1)
    mix = (torch.softmax(s, dim=-1).unsqueeze(-1) * src).sum(1)
    if output_norm_weight is not None:
        mix = torch.nn.functional.rms_norm(mix, (mix.shape[-1],), output_norm_weight.float(),
                                           eps=output_norm_eps)
    return mix.to(prefix.dtype)


def bgmv_live(topk_ids, lora, num_loras, num_experts):
    """[T, k] bool: which (token, expert) pairs carry a LoRA delta."""
    lo = lora.long().unsqueeze(1).expand_as(topk_ids)
    e = topk_ids.long()
    return (lo >= 0) & (lo < num_loras) & (e >= 0) & (e < num_experts)


def _pair_index(topk_ids, lora, num_l, num_e):
    k = topk_ids.shape[1]
    live = bgmv_live(topk_ids, lora, num_l, num_e).reshape(-1)
    lo = lora.long().clamp(0, num_l - 1).repeat_interleave(k)
    e = topk_ids.long().reshape(-1).clamp(0, num_e - 1)
    return live, lo, e


def bgmv_shrink_reference(x, lora_a, topk_ids, lora, chunk=256):
    """s [T*k, r] fp32: x[t] @ A[lora[t], e]^T per pair in float64 (0 where skipped); round
    it to the input dtype to get the kernel's contract. Pairs go in chunks so the gathered
    weights stay small."""
    t, k = topk_ids.shape
    live, lo, e = _pair_index(topk_ids, lora, lora_a.shape[0], lora_a.shape[1])
    tok = torch.arange(t, device=x.device).repeat_interleave(k)
    out = torch.zeros(t * k, lora_a.shape[2], dtype=torch.float64, device=x.device)
    for i in range(0, t * k, chunk):
        j = slice(i, i + chunk)
        out[j] = torch.einsum("ph,prh->pr", x[tok[j]].double(), lora_a[lo[j], e[j]].double())
    return (out * live.unsqueeze(1)).float()


def bgmv_expand_reference(s, lora_b, topk_ids, lora, topk_w=None, chunk=256):
    """fp32 expand of a given shrink result s [T*k, r]: per pair s[p] @ B[lora, e]^T
    ([T*k, N]) or, with ``topk_w``, the finalized sum over each token's pairs ([T, N])."""
    t, k = topk_ids.shape
    live, lo, e = _pair_index(topk_ids, lora, lora_b.shape[0], lora_b.shape[1])
    y = torch.zeros(t * k, lora_b.shape[2], dtype=torch.float64, device=s.device)
    for i in range(0, t * k, chunk):
        j = slice(i, i + chunk)
        y[j] = torch.einsum("pr,pnr->pn", s[j].double(), lora_b[lo[j], e[j]].double())
    y = y * live.unsqueeze(1)
    if topk_w is None:
        return y.float()
    return (y.reshape(t, k, -1) * topk_w.double().unsqueeze(-1)).sum(1).float()


def bgmv_torch(x, lora_a, lora_b, topk_ids, topk_w, lora):
    """The torch gather + einsum route a serving engine falls back to (finalized, fp32):
    the benchmark baseline."""
    k = topk_ids.shape[1]
    live = bgmv_live(topk_ids, lora, lora_a.shape[0], lora_a.shape[1]).reshape(-1, 1)
    lo = lora.long().clamp(min=0).repeat_interleave(k)
    e = topk_ids.long().reshape(-1).clamp(min=0)
    xt = x.repeat_interleave(k, dim=0)
    s = torch.einsum("ph,prh->pr", xt, lora_a[lo, e]) * live.to(x.dtype)
    y = torch.einsum("pr,pnr->pn", s, lora_b[lo, e]).float()
    return (y.reshape(-1, k, y.shape[-1]) * topk_w.unsqueeze(-1)).sum(1)


# ---------------------------------------------------------------------------------------
# KDA (Kimi Delta Attention) prefill: ../shared/specs/kda.md. No kernel yet; these are the
# ground truth and the chunked algorithm the kernels will implement stage by stage.

def kda_gate(g_raw, a_log=None, dt_bias=None, lower_bound=None, acc_dtype=torch.float64):
    """Per-channel log decay from a raw projection g_raw [..., H, K]: ``-exp(A_log[h]) *
    softplus(g_raw + dt_bias[h])``, or with a lower bound (the "safe gate", lower_bound in
    [-5, 0)) ``lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias[h]))``; A_log may be
    None with a lower bound (then exp(A_log) is 1). dt_bias is [H, K] or flat [H * K]."""
    x = g_raw.to(acc_dtype)
    h, dk = x.shape[-2], x.shape[-1]
    if dt_bias is not None:
        x = x + dt_bias.to(acc_dtype).reshape(h, dk)
    a = 1.0 if a_log is None else torch.exp(a_log.to(acc_dtype))[:, None]
    if lower_bound is None:
        return -a * torch.nn.functional.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def kda_segments(batch, t, cu_seqlens):
    """(batch row, start, end) per sequence: each batch row, or the varlen segments of row 0
    (``cu_seqlens``: a tensor or a sequence of host ints; None, or empty, when not varlen)."""
    if cu_seqlens is None or len(cu_seqlens) == 0:
        return [(b, 0, t) for b in range(batch)]
    cu = [int(x) for x in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens)]
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _kda_prep(q, k, v, g, beta, scale, l2norm, beta_sigmoid, acc):
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    if beta_sigmoid:
        beta = torch.sigmoid(beta)
    return q, k, v, g, beta


def _kda_setup(q, k, v, g, beta, scale, l2norm, beta_sigmoid, cu_seqlens, acc):
    """What both KDA references start from: prepared inputs, zeroed outputs, the sequences."""
    q, k, v, g, beta = _kda_prep(q, k, v, g, beta, scale, l2norm, beta_sigmoid, acc)
    bsz, t, h, dk = k.shape
    segs = kda_segments(bsz, t, cu_seqlens)
    o = torch.zeros(bsz, t, h, v.shape[-1], dtype=acc, device=q.device)
    final = torch.zeros(len(segs), h, dk, v.shape[-1], dtype=acc, device=q.device)
    return (q, k, v, g, beta), o, final, segs


def _kda_state0(initial_state, n, like):
    """Sequence n's starting state (a copy), zeros without an initial state."""
    return initial_state[n].to(like.dtype).clone() if initial_state is not None else torch.zeros_like(like)


def kda_reference(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                  use_beta_sigmoid_in_kernel=False, acc_dtype=torch.float64):
    """Token-by-token recurrence in exactly the spec's order (the float64 ground truth).

    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] log decay (<= 0); beta [B, T, H]
    (post-sigmoid unless ``use_beta_sigmoid_in_kernel``); initial_state [N, H, K, V]; varlen:
    B == 1 and cu_seqlens [N + 1]; flags and defaults as fla.ops.kda.chunk_kda's. Returns
    (o [B, T, H, V], final state [N, H, K, V] or None), in ``acc_dtype``."""
    (q, k, v, g, beta), o, final, segs = _kda_setup(
        q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
        cu_seqlens, acc_dtype)
    for n, (b, s0, s1) in enumerate(segs):
        s = _kda_state0(initial_state, n, final[n])
        for i in range(s0, s1):
            s = s * torch.exp(g[b, i])[:, :, None]                       # decay first
            pred = torch.einsum("hkv,hk->hv", s, k[b, i])                 # S^T k
            s = s + torch.einsum("hk,hv->hkv", beta[b, i][:, None] * k[b, i], v[b, i] - pred)
            o[b, i] = torch.einsum("hkv,hk->hv", s, q[b, i])              # read after the update
        final[n] = s
    return o, (final if output_final_state else None)


def kda_chunk_stages(q, k, g, beta, v, chunk_len):
    """Steps 1-3 of the chunked algorithm for one chunk of one sequence (all heads), inputs
    already normalized and scaled, [H, L, *] with L <= chunk size. Returns the intra-chunk
    tensors the kernels produce: Aqk (lower, diagonal included), A = (I + Akk)^-1, the WY
    factors w, u, kg, and the cumulative decay G and its last row Gamma."""
    G = torch.cumsum(g, dim=1)                                   # [H, L, K]
    gam = G[:, -1]                                               # [H, K]
    r = torch.arange(chunk_len, device=k.device)
    # exp(G_r - G_s) only where s <= r (the other exponents are >= 0 and may overflow)
    diff = G[:, :, None, :] - G[:, None, :, :]                   # [H, L(r), L(s), K]
    causal = (r[None, :] <= r[:, None])
    diff = torch.where(causal[None, :, :, None], diff, torch.full_like(diff, -float("inf")))
    dec = torch.exp(diff)
    akk = beta[:, :, None] * torch.einsum("hrk,hsk,hrsk->hrs", k, k, dec)
    akk = akk * (r[None, :] < r[:, None])                         # strictly lower
    aqk = torch.einsum("hrk,hsk,hrsk->hrs", q, k, dec)            # lower incl. diagonal
    eye = torch.eye(chunk_len, dtype=k.dtype, device=k.device).expand(k.shape[0], -1, -1)
    a = torch.linalg.solve_triangular(eye + akk, eye, upper=False, unitriangular=True)
    w = a @ (beta[:, :, None] * k * torch.exp(G))
    u = a @ (beta[:, :, None] * v)
    kg = k * torch.exp(gam[:, None, :] - G)
    return aqk, a, w, u, kg, G, gam


def kda_chunk_stages_tiled(q, k, g, beta, v, chunk_len, sub=16, op_dtype=torch.bfloat16):
    """``kda_chunk_stages`` the way the tensor-core kernels will compute it (kernels/
    CONTRACT_KDA.md): Aqk / Akk in ``sub``-token sub-chunks, an off-diagonal block as one
    product of ``op_dtype`` operands whose decays are both <= 1 (reference point: the last
    token before the row sub-chunk), a diagonal block in fp32 with the exact exponent; the
    WY products with ``op_dtype`` operands and fp32 accumulation; w, u, kg, qg rounded to
    ``op_dtype`` as they would be stored. Inputs fp32 [H, L, *]; returns (aqk, w, u, kg, qg,
    gam) in fp32 holding ``op_dtype`` values where the kernel would store them."""
    rnd = lambda x: x.to(op_dtype).to(torch.float32)             # noqa: E731
    G = torch.cumsum(g, dim=1)
    gam = G[:, -1]
    h, L, _ = k.shape
    akk = torch.zeros(h, L, L, dtype=torch.float32, device=k.device)
    aqk = torch.zeros_like(akk)
    for i0 in range(0, L, sub):
        i1 = min(i0 + sub, L)
        r = torch.arange(i0, i1, device=k.device)
        # diagonal block: exact exponents (s <= r only: the others may overflow)
        diff = G[:, i0:i1, None, :] - G[:, None, i0:i1, :]
        causal = (r[None, :] <= r[:, None])[None, :, :, None]
        dec = torch.exp(torch.where(causal, diff, torch.full_like(diff, -float("inf"))))
        akk[:, i0:i1, i0:i1] = torch.einsum("hrk,hsk,hrsk->hrs", k[:, i0:i1], k[:, i0:i1], dec)
        aqk[:, i0:i1, i0:i1] = torch.einsum("hrk,hsk,hrsk->hrs", q[:, i0:i1], k[:, i0:i1], dec)
        if i0:  # every earlier column in one product, decays split at token i0 - 1
            gb = G[:, i0 - 1:i0]
            left = torch.exp(G[:, i0:i1] - gb)
            kl, ql = rnd(k[:, i0:i1] * left), rnd(q[:, i0:i1] * left)
            kr = rnd(k[:, :i0] * torch.exp(gb - G[:, :i0]))
            akk[:, i0:i1, :i0] = kl @ kr.transpose(1, 2)
            aqk[:, i0:i1, :i0] = ql @ kr.transpose(1, 2)
    idx = torch.arange(L, device=k.device)
    akk = beta[:, :, None] * akk * (idx[None, :] < idx[:, None])
    eye = torch.eye(L, dtype=torch.float32, device=k.device).expand(h, -1, -1)
    a = torch.linalg.solve_triangular(eye + akk, eye, upper=False, unitriangular=True)
    w = rnd(rnd(a) @ rnd(beta[:, :, None] * k * torch.exp(G)))
    u = rnd(rnd(a) @ rnd(beta[:, :, None] * v))
    return rnd(aqk), w, u, rnd(k * torch.exp(gam[:, None, :] - G)), rnd(q * torch.exp(G)), gam


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                use_beta_sigmoid_in_kernel=False, chunk_size=64,
                acc_dtype=torch.float32, return_chunk_states=False, tiled_dtype=None):
    """The chunked algorithm (spec steps 1-5) in ``acc_dtype``: intra-chunk stages, then the
    sequential chain ``h[c] = S; v_new = u - w S; S = Diag(exp Gamma) S + kg^T v_new`` and
    ``o = (q * exp(G)) h[c] + Aqk v_new``. Chunks never cross a sequence boundary (a
    sequence's last chunk may be short). Same arguments and returns as ``kda_reference``;
    with ``return_chunk_states`` also the list of per-chunk input states h[c] (in chunk
    order over the sequences), which a split of the chain must reproduce. ``tiled_dtype``
    (fp32 accumulation only): emulate the kernels' rounding, ``kda_chunk_stages_tiled`` for
    the stages and the state / v_new rounded to that dtype as product operands."""
    (q, k, v, g, beta), o, final, segs = _kda_setup(
        q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
        cu_seqlens, acc_dtype)
    hs = []
    for n, (b, s0, s1) in enumerate(segs):
        s = _kda_state0(initial_state, n, final[n])
        for c0 in range(s0, s1, chunk_size):
            c1 = min(c0 + chunk_size, s1)
            sl = lambda x: x[b, c0:c1].transpose(0, 1)            # [H, L, *]
            qc, kc, vc, gc, bc = sl(q), sl(k), sl(v), sl(g), beta[b, c0:c1].transpose(0, 1)
            hs.append(s)
            if tiled_dtype is None:
                aqk, _, w, u, kg, G, gam = kda_chunk_stages(qc, kc, gc, bc, vc, c1 - c0)
                v_new = u - w @ s
                o[b, c0:c1] = ((qc * torch.exp(G)) @ s + aqk @ v_new).transpose(0, 1)
                s = torch.exp(gam)[:, :, None] * s + kg.transpose(1, 2) @ v_new
            else:  # the state and v_new enter the products as tiled_dtype (fp32 accumulate)
                rnd = lambda x: x.to(tiled_dtype).to(acc_dtype)   # noqa: E731
                aqk, w, u, kg, qg, gam = kda_chunk_stages_tiled(qc, kc, gc, bc, vc, c1 - c0,
                                                                op_dtype=tiled_dtype)
                sb = rnd(s)
                v_new = u - w @ sb
                vb = rnd(v_new)
                o[b, c0:c1] = (qg @ sb + aqk @ vb).transpose(0, 1)
                s = torch.exp(gam)[:, :, None] * s + kg.transpose(1, 2) @ vb
        final[n] = s
    out = (o, final if output_final_state else None)
    return out + (hs,) if return_chunk_states else out


def kda_chunk_affine(q, k, g, beta, v, chunk_len):
    """The chain step of one chunk as an affine map S -> M S + B (M = Diag(exp Gamma) - kg^T w,
    B = kg^T u): what a scan over pieces of a long sequence composes. Inputs as for
    ``kda_chunk_stages``; returns (M [H, K, K], B [H, K, V])."""
    _, _, w, u, kg, _, gam = kda_chunk_stages(q, k, g, beta, v, chunk_len)
    m = torch.diag_embed(torch.exp(gam)) - kg.transpose(1, 2) @ w
    return m, kg.transpose(1, 2) @ u


def kda_chain_packed(w, u, qg, kg, aqk, eg, cu_rows, cu_chunks, h0, num_rows):
    """The chain kernel's contract (abi.kda_chain_abi) in fp32 over its packed inputs: per
    sequence, its chunks in order with S fp32 and S / v_new rounded to the operands' dtype
    as the products' inputs. Returns (o [num_rows, H, V] fp32, ht [N, H, K, V] fp32); rows
    no sequence covers stay zero."""
    f32 = torch.float32
    rnd = lambda x: x.to(w.dtype).to(f32)                       # noqa: E731
    nseq, h, dk, dv = len(cu_chunks) - 1, w.shape[1], w.shape[-1], u.shape[-1]
    o = torch.zeros(num_rows, h, dv, dtype=f32, device=w.device)
    ht = torch.zeros(nseq, h, dk, dv, dtype=f32, device=w.device)
    for n in range(nseq):
        s = h0[n].to(f32).clone() if h0 is not None else ht[n].clone()
        r0, r1 = int(cu_rows[n]), int(cu_rows[n + 1])
        for i, c in enumerate(range(int(cu_chunks[n]), int(cu_chunks[n + 1]))):
            sb = rnd(s)
            v_new = u[c].to(f32) - w[c].to(f32) @ sb
            vb = rnd(v_new)
            oc = qg[c].to(f32) @ sb + aqk[c].to(f32) @ vb            # [H, 64, V]
            a = r0 + i * w.shape[2]
            b = min(r1, a + w.shape[2])
            o[a:b] = oc[:, :b - a].transpose(0, 1)
            s = eg[c][:, :, None] * s + kg[c].to(f32).transpose(1, 2) @ vb
        ht[n] = s
    return o, ht


def kda_intra_packed(q, k, v, g, beta, rows, dtype, *, scale, l2norm, beta_sigmoid, gate):
    """The intra-chunk kernel's contract (abi.kda_intra_abi) as torch ops in fp32 with the
    tile plan's 16-bit rounding points (``kda_chunk_stages_tiled``), batched over all chunks
    and heads: chunk-padded w, u, qg, kg, Aqk in ``dtype`` ([NC, H, 64, *]) and exp(Gamma)
    in fp32 ([NC, H, K]). ``rows`` [NC, 64]: each chunk slot's row in the flattened B * T
    rows, -1 past a sequence's end (those slots get k = q = v = beta = g = 0, so they add
    nothing and leave the decay unchanged). ``gate``: a callable applied to g, or None."""
    bsz, t, h, dk = q.shape
    chunk = rows.shape[1]
    dv = v.shape[-1]
    f32 = torch.float32
    flat = lambda x: x.reshape(bsz * t, *x.shape[2:]).to(f32)          # noqa: E731
    q, k, v, g, beta = flat(q), flat(k), flat(v), flat(g), flat(beta)
    if gate is not None:
        g = gate(g.reshape(-1, h, dk))
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (dk ** -0.5 if scale is None else scale)
    if beta_sigmoid:
        beta = torch.sigmoid(beta)
    nc = rows.shape[0]
    idx = rows.to(q.device)
    valid = (idx >= 0)
    idx = idx.clamp_min(0)

    out = {name: torch.empty(nc, h, chunk, d, dtype=dtype, device=q.device)
           for name, d in (("w", dk), ("u", dv), ("qg", dk), ("kg", dk), ("aqk", chunk))}
    eg = torch.empty(nc, h, dk, dtype=f32, device=q.device)
    per = max(1, 4096 // h)
    for c0 in range(0, nc, per):
        sl = slice(c0, min(nc, c0 + per))
        sub = idx[sl], valid[sl]
        n = sub[0].shape[0]

        def g2(x):
            y = x[sub[0]] * sub[1].reshape(n, chunk, *([1] * (x.dim() - 1)))
            return y.transpose(1, 2).reshape(n * h, chunk, *x.shape[2:])
        aqk, w, u, kg, qg, gam = kda_chunk_stages_tiled(
            g2(q), g2(k), g2(g), g2(beta), g2(v), chunk, op_dtype=dtype)
        for name, x in (("w", w), ("u", u), ("qg", qg), ("kg", kg), ("aqk", aqk)):
            out[name][sl] = x.reshape(n, h, chunk, -1).to(dtype)
        eg[sl] = torch.exp(gam).reshape(n, h, dk)
    return out["w"], out["u"], out["qg"], out["kg"], out["aqk"], eg


# ---------------------------------------------------------------------------------------
# MegaKernel decode (../shared/specs/megakernel.md): a Qwen3 decoder step and the W4A16 g128
# weight format, the ground truth a persistent decode kernel will be checked against.


@dataclass(frozen=True)
class Qwen3Config:
    """Qwen3 decoder dimensions; the defaults are Qwen3-1.7B's (the spec's model)."""
    hidden: int = 2048
    layers: int = 28
    q_heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 6144
    vocab: int = 151936
    eps: float = 1e-6
    rope_theta: float = 1e6


def w4a16_nibbles(qweight):
    """GPTQ's qweight int32 [K / 8, N] -> the 4-bit codes int64 [K, N] (0..15)."""
    k8, n = qweight.shape
    bits = qweight.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(bits >> (4 * j)) & 0xF for j in range(8)], dim=1).reshape(8 * k8, n)


def pack_nibbles(codes):
    """4-bit codes int64 [..., 8] -> int32 [...] with code i at bits 4i (two's-complement
    view of the 32-bit word)."""
    word = (codes << (4 * torch.arange(8, device=codes.device))).sum(-1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def w4a16_bytes(weights, group=128, scale_bytes=2):
    """Bytes of `weights` W4A16 weights: half a byte each plus a 16-bit scale per group."""
    return weights // 2 + (weights // group) * scale_bytes


def w4a16_quantize(w, group=128):
    """W4A16 storage as GPTQ keeps it (symmetric, zero point 8): w [N, K] (out, in) ->
    qweight int32 [K / 8, N] (k's nibble at bits 4 (k % 8) of row k // 8), scales [K / group,
    N] in w's dtype; w ~ (nibble - 8) * scale. Round to nearest (GPTQ's error feedback picks
    other nibbles, not another format)."""
    n, k = w.shape
    if k % group or group % 8:
        raise ValueError(f"w4a16_quantize: K={k} must be a multiple of group={group} (itself of 8)")
    wg = w.double().reshape(n, k // group, group)
    scale = (wg.abs().amax(-1) / 7.0).clamp_min(1e-12).to(w.dtype)          # [N, K / group]
    q = torch.round(wg / scale.double()[..., None]).clamp(-8, 7).to(torch.int64) + 8
    return pack_nibbles(q.reshape(n, k // 8, 8)).t().contiguous(), scale.t().contiguous()


def w4a16_dequantize(qweight, scales, group=128, dtype=torch.float64):
    """The W4A16 weight [N, K] in ``dtype`` (the inverse of w4a16_quantize's storage)."""
    q = w4a16_nibbles(qweight).to(dtype) - 8.0
    return (q * scales.to(dtype).repeat_interleave(group, dim=0)).t()


def w4a16_fragments_dense(packed, scales, group=128):
    """The W4A16 weight [N, K] (float64) as the GEMM forms it from ``cutekern.w4a16``'s
    fragment order, emulated bit for bit up to the scale. fp16: per 32-bit word, two rounds of
    (word & 0x000f000f) | E and (word & 0x00f000f0) | E (E: 1024's fp16 pattern in both
    halves), the first minus (1024 + 8), the second times 1/16 minus (64 + 8) (one HFMA2 each),
    the word shifted right by 8 between rounds. bf16 (7 mantissa bits: a nibble at bits 4..7
    would reach the exponent): four rounds of (word & 0x000f000f) | E (128's bf16 pattern)
    minus (128 + 8), shifted right by 4 between rounds. Either way exact (code - 8), giving
    registers 0..3 = nibbles (0, 4), (1, 5), (2, 6), (3, 7), placed at the (k, n) of
    ``cutekern.w4a16.fragment_index``; the kernel multiplies a group's fp32 partial sum by
    the scale, i.e. uses (code - 8) x scale unrounded (here in float64)."""
    from .w4a16 import KBLOCK, TILE, fragment_index
    dt = scales.dtype
    fp16 = dt == torch.float16
    magic, base = (0x6400, 1024.0) if fp16 else (0x4300, 128.0)
    e2 = magic | magic << 16
    nt, kb = packed.shape[0], packed.shape[1]
    word = packed.to(torch.int64) & 0xFFFFFFFF

    def halves(x, mul, sub):        # 16-bit patterns -> values; x * mul - sub is exact
        out = []
        for b in (x & 0xFFFF, x >> 16):
            v = torch.where(b >= 2 ** 15, b - 2 ** 16, b).to(torch.int16).view(dt)
            r = (v.float() * mul - sub).to(dt)
            assert torch.equal(r.double(), v.double() * mul - sub), "dequant not exact"
            out.append(r)
        return out

    regs = []                       # per register: (low half, high half)
    if fp16:
        for _ in range(2):
            regs.append(halves((word & 0x000F000F) | e2, 1.0, base + 8.0))
            regs.append(halves((word & 0x00F000F0) | e2, 1.0 / 16, base / 16 + 8.0))
            word = word >> 8
    else:
        for _ in range(4):
            regs.append(halves((word & 0x000F000F) | e2, 1.0, base + 8.0))
            word = word >> 4
    vals = torch.empty(nt, kb, 32, 4, 8, dtype=dt)
    for r, (low, high) in enumerate(regs):
        vals[..., r], vals[..., r + 4] = low, high
    kk, nn = fragment_index()
    k, n = kb * KBLOCK, nt * TILE
    dense = torch.empty(nt, kb, KBLOCK, TILE, dtype=torch.float64)
    dense[:, :, kk, nn] = vals.double()
    dense = dense.permute(1, 2, 0, 3).reshape(k, n)         # [K, N]
    return (dense * scales.double().repeat_interleave(group, dim=0)).t()


def qwen3_params(cfg: Qwen3Config, seed=0, dtype=torch.bfloat16, device="cpu"):
    """Seeded random weights in the real layout (nn.Linear [out, in]; tied embeddings): the
    spec's stand-in when no checkpoint is given. Scales keep activations O(1) over layers."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    d, hq, hk, hd, f = cfg.hidden, cfg.q_heads, cfg.kv_heads, cfg.head_dim, cfg.intermediate
    lin = lambda o, i: (torch.randn(o, i, generator=g) / math.sqrt(i)).to(dtype).to(device)  # noqa: E731
    norm = lambda n: (1.0 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(device)  # noqa: E731
    layers = [dict(input_norm=norm(d), q=lin(hq * hd, d), k=lin(hk * hd, d), v=lin(hk * hd, d),
                   q_norm=norm(hd), k_norm=norm(hd), o=lin(d, hq * hd), post_norm=norm(d),
                   gate=lin(f, d), up=lin(f, d), down=lin(d, f)) for _ in range(cfg.layers)]
    embed = torch.randn(cfg.vocab, d, generator=g).to(dtype).to(device)
    return dict(embed=embed, layers=layers, final_norm=norm(d))


def _rms(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w.to(x.dtype)


def _rope(x, pos, theta):
    """Rotary embedding of x [B, H, T, D] at positions pos [T] (rotate-half pairing)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=x.dtype, device=x.device) / d)
    ang = pos.to(x.dtype)[:, None] * inv[None, :]                           # [T, D / 2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def decode_attention_reference(qkv, k_cache, v_cache, lens, q_norm, k_norm, eps=1e-6,
                               theta=1e6, head_dim=128):
    """One decode step's attention in float64 (``cutekern.decode.decode_attention``'s
    contract; qwen3_forward's attention per row at its own position): qkv [B, (Hq + 2 Hkv) D],
    caches [B, Hkv, S, D] (positions < lens[b] read), lens [B]. Returns (out [B, Hq D], k
    [B, Hkv, D], v [B, Hkv, D]): the attention output and the rows the step appends (post-norm,
    post-RoPE k), float64; rows whose length is outside the cache get NaN outputs."""
    acc = torch.float64
    bsz = qkv.shape[0]
    hkv, d = k_cache.shape[1], head_dim
    hq = qkv.shape[1] // d - 2 * hkv
    x = qkv.to(acc).view(bsz, hq + 2 * hkv, d)
    q, k, v = x[:, :hq], x[:, hq:hq + hkv], x[:, hq + hkv:]
    out = torch.full((bsz, hq, d), float("nan"), dtype=acc, device=qkv.device)
    k_new = torch.empty(bsz, hkv, d, dtype=acc, device=qkv.device)
    for b in range(bsz):
        p = int(lens[b])
        pos = torch.tensor([max(p, 0)], device=qkv.device)
        qb = _rope(_rms(q[b][:, None], q_norm, eps), pos, theta)           # [Hq, 1, D]
        kb = _rope(_rms(k[b][:, None], k_norm, eps), pos, theta)           # [Hkv, 1, D]
        k_new[b] = kb[:, 0]
        if not 0 <= p < k_cache.shape[2]:
            continue
        kk = torch.cat([k_cache[b, :, :p].to(acc), kb], 1)                 # [Hkv, p + 1, D]
        vv = torch.cat([v_cache[b, :, :p].to(acc), v[b][:, None]], 1)
        kk = kk.repeat_interleave(hq // hkv, 0)
        vv = vv.repeat_interleave(hq // hkv, 0)
        s = (qb @ kk.transpose(-1, -2)) * d ** -0.5                         # [Hq, 1, p + 1]
        out[b] = (torch.softmax(s, -1) @ vv)[:, 0]
    return out.reshape(bsz, hq * d), k_new, v.clone()


def qwen3_forward(params, cfg: Qwen3Config, tokens, cache=None, acc_dtype=torch.float64,
                  weight=None, head=None):
    """Qwen3 decoder over new tokens [B, T] after the cached ones: prefill (no cache) and
    decode steps (T = 1 with the cache) are the same function. ``cache``: per layer (k, v)
    [B, H_kv, S, D] in ``acc_dtype`` (post-norm, post-RoPE keys), extended and returned.
    ``weight(layer, name, w)``: the weight a linear uses (default w itself; e.g. a W4A16
    dequantization). ``head``: the LM head [vocab, hidden] (default params' 'lm_head', else
    the tied embedding). Returns (logits [B, T, vocab], cache) in ``acc_dtype``."""
    acc = acc_dtype
    wt = weight or (lambda i, name, w: w)
    bsz, t = tokens.shape
    past = 0 if cache is None else cache[0][0].shape[2]
    pos = torch.arange(past, past + t, device=tokens.device)
    hq, hk, hd = cfg.q_heads, cfg.kv_heads, cfg.head_dim
    x = params["embed"][tokens].to(acc)                                     # [B, T, H]
    causal = torch.ones(t, past + t, dtype=torch.bool, device=tokens.device).tril(past)
    new_cache = []
    for i, p in enumerate(params["layers"]):
        lin = lambda name, a: a @ wt(i, name, p[name]).to(acc).t()          # noqa: E731
        hcur = _rms(x, p["input_norm"], cfg.eps)
        q = lin("q", hcur).view(bsz, t, hq, hd).transpose(1, 2)
        k = lin("k", hcur).view(bsz, t, hk, hd).transpose(1, 2)
        v = lin("v", hcur).view(bsz, t, hk, hd).transpose(1, 2)
        q = _rope(_rms(q, p["q_norm"], cfg.eps), pos, cfg.rope_theta)
        k = _rope(_rms(k, p["k_norm"], cfg.eps), pos, cfg.rope_theta)
        if cache is not None:
            k = torch.cat([cache[i][0], k], 2)
            v = torch.cat([cache[i][1], v], 2)
        new_cache.append((k, v))
        kk = k.repeat_interleave(hq // hk, dim=1)                           # q head j: kv head j // (hq / hk)
        vv = v.repeat_interleave(hq // hk, dim=1)
        s = (q @ kk.transpose(-1, -2)) * hd ** -0.5
        s = s.masked_fill(~causal, float("-inf"))
        a = torch.softmax(s, -1) @ vv                                       # [B, Hq, T, D]
        x = x + lin("o", a.transpose(1, 2).reshape(bsz, t, hq * hd))
        hcur = _rms(x, p["post_norm"], cfg.eps)
        x = x + lin("down", torch.nn.functional.silu(lin("gate", hcur)) * lin("up", hcur))
    x = _rms(x, params["final_norm"], cfg.eps)
    if head is None:
        head = params.get("lm_head", params["embed"])
    return x @ head.to(acc).t(), new_cache


def qwen3_quantized(params, group=128,
                    linears=("q", "k", "v", "o", "gate", "up", "down"), head=False):
    """W4A16 params for ``cutekern.qwen3.prepare_qwen3_decoder``: every layer linear as its
    GPTQ pair (``w4a16_quantize``), plus per layer the float64 weights they stand for, for
    ``qwen3_forward(..., weight=lambda i, name, w: dense[i][name])``. ``head``: also the LM
    head (params' 'lm_head', else the tied embedding) as params' 'lm_head' pair (for
    ``quantize_head=True``); its float64 weight is ``w4a16_dequantize(*qp['lm_head'], group)``."""
    qp, dense = dict(params, layers=[]), []
    if head:
        qp["lm_head"] = w4a16_quantize(params.get("lm_head", params["embed"]), group)
    for p in params["layers"]:
        lay, deq = dict(p), {}
        for n in linears:
            qw, sc = w4a16_quantize(p[n], group)
            lay[n], deq[n] = (qw, sc), w4a16_dequantize(qw, sc, group)
        qp["layers"].append(lay)
        dense.append(deq)
    return qp, dense


def decode_weight_bytes(cfg: Qwen3Config, *, quant_layers, quant_head, group=128, act_bytes=2):
    """Weight bytes one decode token streams (the spec's roofline): every layer's linears
    and norms, the final norm, one embedding row and the (tied) LM head; W4A16 = half a byte
    per weight plus a 16-bit scale per group."""
    d, hq, hk, hd, f = cfg.hidden, cfg.q_heads, cfg.kv_heads, cfg.head_dim, cfg.intermediate
    lin = d * hq * hd + 2 * d * hk * hd + hq * hd * d + 3 * d * f
    w4 = lambda n: w4a16_bytes(n, group, act_bytes)                        # noqa: E731
    per_layer = (w4(lin) if quant_layers else lin * act_bytes) + (2 * d + 2 * hd) * act_bytes
    head = cfg.vocab * d
    return (cfg.layers * per_layer + d * act_bytes + d * act_bytes
            + (w4(head) if quant_head else head * act_bytes))
