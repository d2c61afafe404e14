"""KDA prefill: the chunked algorithm against the token recurrence, the chain's split and
affine forms (what a split of the recurrent chain across CTAs relies on), the argument
contract, the chunk work list and the intra kernel's diagonal-block arithmetic (emulated).
The kernels themselves are checked against these on the GPU (tests/gpu/test_kda_gpu.py)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cutekern.kda import check_kda_args, chunk_work_list, seq_bounds
from cutekern.reference import (kda_chunk_affine, kda_chunk_stages, kda_chunked, kda_gate,
                                kda_reference)


def _inputs(bsz, t, h, dk, dv, seed, gate="safe", n_state=None, dtype=torch.float32):
    g0 = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g0)
    q, k, v = rn(bsz, t, h, dk), rn(bsz, t, h, dk), rn(bsz, t, h, dv)
    a_log, dt_bias = torch.rand(h, generator=g0), torch.rand(h, dk, generator=g0)
    if gate == "safe":
        g = kda_gate(rn(bsz, t, h, dk), a_log, dt_bias, lower_bound=-5.0)
    elif gate == "softplus":
        g = kda_gate(rn(bsz, t, h, dk), a_log, dt_bias)
    else:                                                   # a direct log decay, mild
        g = -0.1 * torch.rand(bsz, t, h, dk, generator=g0)
    beta = rn(bsz, t, h)                                    # logits
    s0 = None if n_state is None else rn(n_state, h, dk, dv)
    return [x.to(dtype) for x in (q, k, v)] + [g.float(), beta], s0


@settings(max_examples=20, deadline=None)
@given(lens=st.lists(st.integers(0, 130), min_size=1, max_size=4).filter(lambda l: sum(l) > 0),
       h=st.integers(1, 3), dk=st.sampled_from([8, 16, 32]), dv=st.sampled_from([8, 16]),
       chunk=st.sampled_from([16, 64]), gate=st.sampled_from(["safe", "softplus", "direct"]),
       norm=st.booleans(), with_state=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_chunked_matches_token_recurrence_varlen(lens, h, dk, dv, chunk, gate, norm, with_state, seed):
    t = sum(lens)
    (q, k, v, g, beta), s0 = _inputs(1, t, h, dk, dv, seed, gate, len(lens) if with_state else None)
    if not norm:  # keys normalized upstream, as models do: raw keys make I - beta k k^T expand
        q, k = (x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
    kw = dict(initial_state=s0, output_final_state=True, cu_seqlens=cu,
              use_qk_l2norm_in_kernel=norm, use_beta_sigmoid_in_kernel=True)
    o_ref, f_ref = kda_reference(q, k, v, g, beta, **kw)
    assert torch.isfinite(o_ref).all() and torch.isfinite(f_ref).all()
    o64, f64 = kda_chunked(q, k, v, g, beta, chunk_size=chunk, acc_dtype=torch.float64, **kw)
    torch.testing.assert_close(o64, o_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(f64, f_ref, rtol=1e-9, atol=1e-9)
    # the same algorithm in fp32 (what the kernels accumulate in), bounded by the output scale
    o32, f32 = kda_chunked(q, k, v, g, beta, chunk_size=chunk, **kw)
    tol = 2e-4 * (1 + o_ref.abs().max().item())
    assert (o32.double() - o_ref).abs().max().item() <= tol
    assert (f32.double() - f_ref).abs().max().item() <= 2e-4 * (1 + f_ref.abs().max().item())
    # a 0-length sequence hands its initial state through unchanged
    for n, ln in enumerate(lens):
        if ln == 0:
            want = s0[n].double() if s0 is not None else torch.zeros_like(f_ref[n])
            torch.testing.assert_close(f_ref[n], want)


def test_batched_equals_varlen_and_defaults():
    (q, k, v, g, beta), s0 = _inputs(3, 70, 2, 16, 8, 7, "safe", n_state=3)
    o_b, f_b = kda_reference(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                             use_beta_sigmoid_in_kernel=True)
    flat = lambda x: x.reshape(1, -1, *x.shape[2:])
    cu = torch.tensor([0, 70, 140, 210], dtype=torch.int64)
    o_v, f_v = kda_reference(flat(q), flat(k), flat(v), flat(g), flat(beta), initial_state=s0,
                             output_final_state=True, cu_seqlens=cu, use_beta_sigmoid_in_kernel=True)
    torch.testing.assert_close(flat(o_b), o_v, rtol=0, atol=0)
    torch.testing.assert_close(f_b, f_v, rtol=0, atol=0)
    # scale defaults to K ** -0.5 after the norm; beta post-sigmoid when not logits
    o1, _ = kda_reference(q, k, v, g, torch.sigmoid(beta.double()))
    o2, _ = kda_reference(q, k, v, g, beta, use_beta_sigmoid_in_kernel=True, scale=16 ** -0.5)
    torch.testing.assert_close(o1, o2, rtol=1e-12, atol=1e-12)
    o3, _ = kda_reference(q, k, v, g, beta, use_beta_sigmoid_in_kernel=True, scale=0.5)
    assert not torch.allclose(o2, o3)


def test_token_recurrence_first_steps_by_hand():
    """Two tokens, one head, against the closed form of the spec's update."""
    (q, k, v, g, beta), _ = _inputs(1, 2, 1, 4, 3, 3, "softplus")
    b = torch.sigmoid(beta.double())
    o, f = kda_reference(q, k, v, g, beta, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=False, scale=1.0,
                         output_final_state=True)
    qd, kd, vd, gd = (x.double()[0, :, 0] for x in (q, k, v, g))
    s = torch.zeros(4, 3, dtype=torch.float64)
    for i in range(2):
        s = torch.diag(torch.exp(gd[i])) @ s
        s = s - b[0, i, 0] * torch.outer(kd[i], kd[i]) @ s + b[0, i, 0] * torch.outer(kd[i], vd[i])
        torch.testing.assert_close(o[0, i, 0], s.T @ qd[i], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(f[0, 0], s, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cut", [1, 64, 100, 192])
def test_chain_split_hands_state_over(cut):
    """A sequence cut in two pieces, the second started from the first's final state, gives
    the whole sequence's outputs and state (the piece hand-over of a split chain)."""
    (q, k, v, g, beta), s0 = _inputs(1, 256, 2, 16, 8, 11, "safe", n_state=1)
    kw = dict(output_final_state=True, use_beta_sigmoid_in_kernel=True, acc_dtype=torch.float64)
    o, f = kda_chunked(q, k, v, g, beta, initial_state=s0, **kw)
    p = lambda x, a, b: x[:, a:b]
    o1, f1 = kda_chunked(*(p(x, 0, cut) for x in (q, k, v, g, beta)), initial_state=s0, **kw)
    o2, f2 = kda_chunked(*(p(x, cut, 256) for x in (q, k, v, g, beta)), initial_state=f1, **kw)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(f2, f, rtol=1e-10, atol=1e-10)


def test_chain_is_affine_per_chunk():
    """S_{c+1} = M_c S_c + B_c: composing the chunks' maps over pieces reproduces every chunk
    state the sequential chain sees (the scan-and-merge form of a long sequence)."""
    (q, k, v, g, beta), s0 = _inputs(1, 64 * 5 + 9, 2, 16, 8, 5, "softplus", n_state=1)
    kw = dict(use_beta_sigmoid_in_kernel=True, acc_dtype=torch.float64)
    _, f, hs = kda_chunked(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                           return_chunk_states=True, **kw)
    from cutekern.reference import _kda_prep
    qn, kn, vn, gn, bn = _kda_prep(q, k, v, g, beta, None, False, True, torch.float64)
    maps = []
    for c0 in range(0, q.shape[1], 64):
        c1 = min(c0 + 64, q.shape[1])
        sl = lambda x: x[0, c0:c1].transpose(0, 1)
        maps.append(kda_chunk_affine(sl(qn), sl(kn), sl(gn), bn[0, c0:c1].T, sl(vn), c1 - c0))
    # pieces of two chunks merged first, then applied: (M2, B2) o (M1, B1) = (M2 M1, M2 B1 + B2)
    s = s0[0].double()
    for i in range(0, len(maps), 2):
        torch.testing.assert_close(s, hs[i], rtol=1e-10, atol=1e-10)
        m, b = maps[i]
        if i + 1 < len(maps):
            m2, b2 = maps[i + 1]
            m, b = m2 @ m, m2 @ b + b2
        s = m @ s + b
    torch.testing.assert_close(s, f[0], rtol=1e-10, atol=1e-10)


def test_chunk_stages_inverse_and_bounds():
    (q, k, v, g, beta), _ = _inputs(1, 64, 2, 16, 8, 2, "safe")
    sl = lambda x: x[0].transpose(0, 1).double()
    aqk, a, w, u, kg, G, gam = kda_chunk_stages(sl(q), sl(k), sl(g), torch.sigmoid(beta[0].T.double()),
                                                sl(v), 64)
    assert torch.equal(torch.triu(aqk, 1), torch.zeros_like(aqk))
    assert torch.equal(torch.triu(a, 1), torch.zeros_like(a))
    torch.testing.assert_close(torch.diagonal(a, dim1=1, dim2=2), torch.ones(2, 64, dtype=torch.float64))
    # the decays the kernels will tile are all <= 1 (no overflow in bf16/fp16 tiles)
    assert (G <= 0).all() and (gam[:, None] <= G + 1e-12).all() and (kg.abs() <= k[0].transpose(0, 1).abs() + 1e-12).all()


# ---- the argument contract -------------------------------------------------------------

def _args(bsz=1, t=96, h=2, dk=64, dv=64, dtype=torch.bfloat16):
    r = lambda *s: torch.randn(*s).to(dtype)
    return r(bsz, t, h, dk), r(bsz, t, h, dk), r(bsz, t, h, dv), -torch.rand(bsz, t, h, dk), torch.rand(bsz, t, h)


def _shifted(x):
    """x's contents at a data pointer one element past a 16-byte boundary."""
    buf = torch.empty(x.numel() + 1, dtype=x.dtype)
    y = buf[1:].view(x.shape)
    y.copy_(x)
    return y


def test_check_accepts_valid_and_describes():
    q, k, v, g, beta = _args(bsz=3, dv=128)
    p = check_kda_args(q, k, v, g, beta, initial_state=torch.zeros(3, 2, 64, 128))
    assert (p.batch, p.seqlen, p.heads, p.head_k, p.head_v, p.num_seqs, p.varlen) == (3, 96, 2, 64, 128, 3, False)
    q, k, v, g, beta = _args()
    cu = torch.tensor([0, 0, 30, 96], dtype=torch.int64)
    p = check_kda_args(q, k, v, g, beta, cu_seqlens=cu, use_gate_in_kernel=True, A_log=torch.rand(2),
                       dt_bias=torch.rand(2, 64), safe_gate=True, lower_bound=-5.0)
    assert p.num_seqs == 3 and p.varlen and p.gate_in_kernel
    assert seq_bounds(p, cu) == [(0, 0, 0), (0, 0, 30), (0, 30, 96)]
    # the peer's other accepted forms: flat dt_bias, no A_log with a lower bound, a host copy
    p = check_kda_args(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(), use_gate_in_kernel=True,
                       dt_bias=torch.rand(128), lower_bound=-1.0)
    assert p.num_seqs == 3


@pytest.mark.parametrize("mutate, name", [
    (lambda a: a.update(q=a["q"].float()), "q"),
    (lambda a: a.update(k=a["k"].half()), "k"),
    (lambda a: a.update(v=a["v"][..., :32]), "v"),
    (lambda a: a.update(q=torch.randn(1, 96, 2, 48).bfloat16(), k=torch.randn(1, 96, 2, 48).bfloat16(),
                        g=-torch.rand(1, 96, 2, 48)), "q"),
    (lambda a: a.update(k=a["k"][:, :95]), "k"),
    (lambda a: a.update(g=a["g"].double()), "g"),
    (lambda a: a.update(g=a["g"][..., :32]), "g"),
    (lambda a: a.update(beta=a["beta"][..., None]), "beta"),
    (lambda a: a.update(beta=a["beta"][:, :, :1]), "beta"),
    (lambda a: a.update(v=a["v"].transpose(2, 3).contiguous().transpose(2, 3)), "v"),
    (lambda a: a.update(scale=-1.0), "scale"),
    (lambda a: a.update(cu_seqlens=torch.tensor([0, 50, 96], dtype=torch.int32)), "cu_seqlens"),
    (lambda a: a.update(cu_seqlens=torch.tensor([0, 60, 50, 96])), "cu_seqlens"),
    (lambda a: a.update(cu_seqlens=torch.tensor([0, 95])), "cu_seqlens"),
    (lambda a: a.update(cu_seqlens=torch.tensor([1, 96])), "cu_seqlens"),
    (lambda a: a.update(cu_seqlens=torch.tensor([96])), "cu_seqlens"),
    (lambda a: a.update(initial_state=torch.zeros(2, 2, 64, 64)), "initial_state"),
    (lambda a: a.update(initial_state=torch.zeros(1, 2, 64, 64).bfloat16()), "initial_state"),
    (lambda a: a.update(dt_bias=torch.zeros(2, 64)), "dt_bias"),
    (lambda a: a.update(lower_bound=-1.0), "lower_bound"),
    (lambda a: a.update(A_log=torch.zeros(2)), "A_log"),
    (lambda a: a.update(v=torch.randn(1, 96, 4, 64).bfloat16()), "v"),
    (lambda a: a.update(use_gate_in_kernel=True), "A_log"),
    (lambda a: a.update(use_gate_in_kernel=True, A_log=torch.zeros(3)), "A_log"),
    (lambda a: a.update(use_gate_in_kernel=True, A_log=torch.zeros(2, dtype=torch.float64)), "A_log"),
    (lambda a: a.update(use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(2, 32)), "dt_bias"),
    (lambda a: a.update(use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(64)), "dt_bias"),
    (lambda a: a.update(use_gate_in_kernel=True, A_log=torch.zeros(2), safe_gate=True), "lower_bound"),
    (lambda a: a.update(use_gate_in_kernel=True, A_log=torch.zeros(2), lower_bound=-6.0), "lower_bound"),
    (lambda a: a.update(use_gate_in_kernel=True, A_log=torch.zeros(2), lower_bound=0.0), "lower_bound"),
    (lambda a: a.update(cu_seqlens_cpu=torch.tensor([0, 96])), "cu_seqlens_cpu"),
    (lambda a: a.update(cu_seqlens=torch.tensor([0, 96]), cu_seqlens_cpu=torch.tensor([0, 40, 96])), "cu_seqlens_cpu"),
    # the kernels' 16-byte row vectors (checked here: the launches skip the runtime's check)
    (lambda a: a.update(q=_shifted(a["q"])), "q"),
    (lambda a: a.update(k=torch.randn(1, 96, 2, 68).bfloat16()[..., :64]), "k"),
    (lambda a: a.update(v=torch.randn(1, 96, 2, 72).bfloat16()[..., 4:68]), "v"),
    (lambda a: a.update(g=(-torch.rand(1, 96, 2, 66))[..., :64]), "g"),
    (lambda a: a.update(initial_state=torch.zeros(1, 2, 64, 66)[..., 1:65]), "initial_state"),
])
def test_check_names_the_argument(mutate, name):
    q, k, v, g, beta = _args()
    a = dict(q=q, k=k, v=v, g=g, beta=beta)
    mutate(a)
    with pytest.raises((ValueError, TypeError), match=f"'{name}'"):
        check_kda_args(**a)


def test_varlen_needs_batch_one():
    q, k, v, g, beta = _args(bsz=2)
    with pytest.raises(ValueError, match="'cu_seqlens'"):
        check_kda_args(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 96]))


def test_chunk_work_list_covers_every_token_once():
    bounds = [(0, 0, 0), (0, 0, 1), (0, 1, 130), (0, 130, 194), (0, 194, 195)]
    work, offs = chunk_work_list(bounds, 64)
    assert work.dtype == torch.int32 and offs.tolist() == [0, 0, 1, 4, 5, 6]
    seen = torch.zeros(195, dtype=torch.int32)
    for n, b, s, ln in work.tolist():
        assert 1 <= ln <= 64 and bounds[n][1] <= s and s + ln <= bounds[n][2] and b == 0
        seen[s:s + ln] += 1
    assert torch.equal(seen, torch.ones(195, dtype=torch.int32))
    work, offs = chunk_work_list([(0, 0, 100), (1, 0, 100)], 64)
    assert work.tolist() == [[0, 0, 0, 64], [0, 0, 64, 36], [1, 1, 0, 64], [1, 1, 64, 36]]


def test_gate_forms():
    g0 = torch.Generator().manual_seed(4)
    raw, a_log, dtb = torch.randn(2, 5, 3, 8, generator=g0), torch.rand(3, generator=g0), torch.rand(3, 8, generator=g0)
    x = raw.double() + dtb.double()
    a = torch.exp(a_log.double())[:, None]
    torch.testing.assert_close(kda_gate(raw, a_log, dtb), -a * torch.log1p(torch.exp(x)))
    torch.testing.assert_close(kda_gate(raw, a_log, dtb.flatten(), lower_bound=-5.0), -5.0 / (1 + torch.exp(-a * x)))
    torch.testing.assert_close(kda_gate(raw, None, dtb, lower_bound=-2.0), -2.0 / (1 + torch.exp(-x)))
    safe = kda_gate(100 * raw, a_log, dtb, lower_bound=-5.0)
    assert (safe >= -5.0).all() and (safe <= 0).all()


@pytest.mark.parametrize("gate", ["safe", "softplus", "strong"])
def test_tiled_stages_hold_the_bf16_bar(gate):
    """The kernels' plan (kernels/CONTRACT_KDA.md): sub-chunk products of 16-bit operands whose
    decays are all <= 1, diagonal blocks exact in fp32, the state and v_new rounded as product
    operands. Emulated here, it stays at the peer's error level against the fp64 recurrence
    (fla-core measured 3.3e-3 rel L2 on outputs, perf/results/kda.json) for any gate, while
    one factorization over the whole chunk (exp(G_r) * exp(-G_s)) would overflow fp32."""
    g0 = torch.Generator().manual_seed(21)
    t, h, dk, dv = 200, 2, 64, 64
    rn = lambda *s: torch.randn(*s, generator=g0)
    l2 = lambda x: x / x.norm(dim=-1, keepdim=True)
    q, k, v, raw, beta = l2(rn(1, t, h, dk)), l2(rn(1, t, h, dk)), rn(1, t, h, dv), rn(1, t, h, dk), rn(1, t, h)
    a_log, dtb = torch.rand(h, generator=g0), torch.rand(h, dk, generator=g0)
    g = {"safe": lambda: kda_gate(raw, a_log, dtb, lower_bound=-5.0),
         "softplus": lambda: kda_gate(raw, a_log, dtb),
         "strong": lambda: kda_gate(3 * raw, a_log + 2, dtb)}[gate]().float()
    kw = dict(output_final_state=True, use_beta_sigmoid_in_kernel=True)
    o_ref, f_ref = kda_reference(q, k, v, g, beta, **kw)
    rel = lambda x, ref: ((x.double() - ref).norm() / ref.norm()).item()
    for dt, bar in ((torch.bfloat16, 6e-3), (torch.float16, 1e-3)):
        o, f = kda_chunked(q, k, v, g, beta, tiled_dtype=dt, **kw)
        assert torch.isfinite(o).all() and torch.isfinite(f).all()
        assert rel(o, o_ref) <= bar and rel(f, f_ref) <= bar, (dt, rel(o, o_ref), rel(f, f_ref))
    if gate != "softplus":  # the mild softplus draw decays too slowly to show it
        assert torch.isinf(torch.exp(-torch.cumsum(g[0, :64], dim=0))).any()


def _diag_split_error(spread, seed, tiny, in_dtype=torch.bfloat16):
    """Max abs error of one 16 x 16 diagonal score block done as the intra kernel does it
    (kernels/ada/kda_intra.py): split at the sub-chunk's first token f, left k_r rk exp2(G_r -
    G_f) <= 1 and right k_s rk exp2(G_f - G_s) <= 2^spread in fp32 (flushing subnormals, as
    the fast-math multiplies may), each rounded to a bf16 pair hi + lo, products hi hi' +
    lo hi' + hi lo' accumulated in fp32; against float64. Rows of k are unit vectors (the
    bounded case, stored in `in_dtype`), some components tiny (1e-6) when `tiny`; G has the
    given spread (log2). The pair is bf16 for fp16 inputs too, as in the kernel."""
    g0 = torch.Generator().manual_seed(seed)
    K = 64
    inc = torch.rand(15, K, generator=g0, dtype=torch.float64)
    G = torch.cat([torch.zeros(1, K, dtype=torch.float64), -(inc / inc.sum(0) * spread).cumsum(0)])
    G = G + 30 * torch.randn(1, K, generator=g0, dtype=torch.float64)   # any column offset
    k = torch.randn(16, K, generator=g0, dtype=torch.float64)
    if tiny:
        k = k * torch.where(torch.rand(16, K, generator=g0) < 0.3, 1e-6, 1.0).double()
    kb = (k / k.norm(dim=1, keepdim=True)).to(in_dtype).float()
    rk = 1.0 / kb.double().norm(dim=1, keepdim=True)
    ftz = lambda x: torch.where(x.abs() < 2.0 ** -126, torch.zeros_like(x), x)  # noqa: E731
    G32 = G.float()
    xl = ftz(kb * rk.float() * torch.exp2(G32 - G32[:1]))
    xr = ftz(kb * rk.float() * torch.exp2(G32[:1] - G32))
    pair = lambda x: (x.to(torch.bfloat16).float(), (x - x.to(torch.bfloat16).float()).to(torch.bfloat16).float())  # noqa: E731
    (hl, ll), (hr, lr) = pair(xl), pair(xr)
    acc = hl @ hr.T + ll @ hr.T + hl @ lr.T
    kr = kb.double() * rk
    exact = (kr[:, None, :] * kr[None, :, :] * torch.exp2(G[:, None, :] - G[None, :, :])).sum(-1)
    low = torch.tril(torch.ones(16, 16, dtype=torch.bool))
    if not torch.isfinite(acc[low]).all():
        return float("inf")
    return (acc.double() - exact).abs()[low].max().item()


def test_diagonal_blocks_on_the_tensor_cores_hold_fp32_accuracy_to_the_threshold():
    """The intra kernel sends a sub-chunk's diagonal block to the tensor cores when its decay
    spread is at most `diag_spread` (bf16, bounded rows of k: 2^110). Emulated, the hi + lo
    products stay ~2^-17 from float64 there (entries are <= 1), tiny components included,
    while a spread past the bf16 range (2^124) is wrong: the threshold is what keeps it."""
    from kernels.ada.kda_intra import KdaIntraAda
    import cutlass
    for dt, tdt in ((cutlass.BFloat16, torch.bfloat16), (cutlass.Float16, torch.float16)):
        spread = KdaIntraAda(dt, cutlass.Float32, 128).diag_spread
        assert 100 <= spread <= 112
        for seed in range(8):
            for tiny in (False, True):
                for sp in (8.0, 60.0, spread):
                    assert _diag_split_error(sp, seed, tiny, tdt) <= 2e-5, (sp, seed, tiny, tdt)
        assert min(_diag_split_error(124.0, seed, False, tdt) for seed in range(4)) > 1e-2


def test_intra_g_slab_order_is_a_conflict_free_permutation():
    """The intra kernel keeps G's 64-column slabs in a permuted order (ncu showed 2-way bank
    conflicts on every G vector in column order; the intra kernel 0.97 -> 0.93 ms at 1 x 8192
    H = 64 with this order alone). Its layout must be a permutation that `_slab_col` inverts,
    and each of a thread's two 16-byte loads, over the 8 threads of a row, must hit each of
    the 32 banks once (the scan's 32 lanes on consecutive places too)."""
    from kernels.ada import kda_intra as ki
    shape, stride = ki._G_SLAB_SHAPE, ki._G_SLAB_STRIDE

    def place(col):          # colexicographic coordinates of the column, dotted with stride
        p, rest = 0, col
        for n, d in zip(shape, stride):
            p, rest = p + (rest % n) * d, rest // n
        return p

    assert sorted(place(x) for x in range(64)) == list(range(64))
    assert all(ki.KdaIntraAda._slab_col(place(x)) == x for x in range(64))
    assert ki.KdaIntraAda._slab_col(64 + place(5)) == 64 + 5            # the second slab
    for half in range(2):    # thread t of a row: columns 8 t + 4 half .. + 3
        banks = [place(8 * t + 4 * half + e) % 32 for t in range(8) for e in range(4)]
        assert sorted(banks) == list(range(32)), half
    for start in (0, 32):    # the scan: lane l takes the column at place start + l
        assert sorted(place(ki.KdaIntraAda._slab_col(start + l)) % 32 for l in range(32)) == list(range(32))


@pytest.mark.parametrize("varlen", [False, True])
def test_op_packing_for_the_chain_kernel(varlen):
    """What the op hands the chain kernel (cutekern.kda: the chunk rows, the intra stage as
    torch ops, abi.kda_chain_abi's packed tensors), run through the fp32 model of the chain
    kernel's contract (reference.kda_chain_packed), stays within the bf16 bar of the fp64
    token recurrence: padding rows add nothing, sequences and chunks line up, the states of
    0- and 1-token sequences pass through. (The kernel itself runs in tests/gpu.)"""
    from cutekern.kda import _chunk_rows
    from cutekern.reference import kda_intra_packed
    from cutekern.reference import kda_chain_packed
    cu = [0, 100, 101, 101, 300] if varlen else None
    bsz, t = (1, 300) if varlen else (2, 150)
    h, d = 3, 64
    (q, k, v, g, beta), s0 = _inputs(bsz, t, h, d, d, 9, gate="softplus",
                                     n_state=len(cu) - 1 if varlen else bsz, dtype=torch.bfloat16)
    bounds = [(0, a, b) for a, b in zip(cu, cu[1:])] if varlen else [(b, 0, t) for b in range(bsz)]
    rows, cu_rows, cu_chunks = _chunk_rows(bounds, t)
    assert cu_chunks.tolist() == ([0, 2, 3, 3, 7] if varlen else [0, 3, 6])
    assert cu_rows.tolist() == ([0, 100, 101, 101, 300] if varlen else [0, 150, 300])
    w, u, qg, kg, aqk, eg = kda_intra_packed(q, k, v, g, beta, rows, torch.bfloat16, scale=None,
                                         l2norm=True, beta_sigmoid=True, gate=None)
    assert w.shape == (rows.shape[0], h, 64, d) and eg.dtype == torch.float32
    pad = rows < 0                                          # [NC, 64]: rows past a sequence
    for x in (w, u, qg, kg, aqk):
        assert (x.transpose(1, 2)[pad] == 0).all()
    o, ht = kda_chain_packed(w, u, qg, kg, aqk, eg, cu_rows, cu_chunks, s0, bsz * t)
    ro, rh = kda_reference(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                           cu_seqlens=torch.tensor(cu) if varlen else None,
                           use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    rel = lambda x, ref: ((x.double() - ref).norm() / ref.norm()).item()
    assert rel(o, ro.reshape(bsz * t, h, d)) < 6e-3 and rel(ht, rh) < 6e-3
    if varlen:
        assert torch.equal(ht[2], s0[2])                    # the 0-token sequence


def test_op_rejects_host_tensors_naming_q():
    from cutekern import chunk_kda
    (q, k, v, g, beta), _ = _inputs(1, 10, 2, 64, 64, 3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'q'.*CUDA"):
        chunk_kda(q, k, v, g, beta)


def _model_chain(num_rows):
    """The chain kernel's torch model behind `kda._chain`'s signature: writes only the rows
    its sequences cover (as the kernel does) and the final states."""
    from cutekern.reference import kda_chain_packed

    def chain(w, u, qg, kg, aqk, eg, cu_rows, cu_chunks, h0, o, ht):
        ro, rh = kda_chain_packed(w, u, qg, kg, aqk, eg, cu_rows, cu_chunks, h0, num_rows)
        rows = o.reshape(-1, *o.shape[-2:])
        for a, b in zip(cu_rows.tolist(), cu_rows.tolist()[1:]):
            rows[a:b] = ro[a:b].to(o.dtype)
        ht.copy_(rh)
    return chain


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 700), min_size=1, max_size=6), st.booleans(),
       st.integers(1, 5))
def test_chain_split_tables_refine_the_whole_chain_tables(lens, varlen, piece):
    """The split's chain runs over the intra stage's chunks as they are (no repacking): the
    pieces' chunk table is the whole sequences' table row for row, their chunk offsets refine
    the sequences' offsets, and each sequence's first / last piece bound exactly its chunks
    (0-token sequences keep one empty piece). Batch rows (B > 1) and varlen (B = 1)."""
    from cutekern.kda import _chunk_table, _split_bounds
    from cutekern.reference import kda_segments
    if varlen:
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        bsz, t = 1, max(cu[-1], 1)
        bounds = kda_segments(bsz, t, cu if cu[-1] else None) if cu[-1] else [(0, 0, 0)]
    else:
        bsz, t = len(lens), max(lens[0], 1)
        bounds = kda_segments(bsz, t, None)
    table, cu_rows, cu_chunks = _chunk_table(bounds, t)
    pbounds, first = _split_bounds(bounds, piece)
    ptable, pcu_rows, pcu_chunks = _chunk_table(pbounds, t)
    assert torch.equal(ptable, table)
    assert set(cu_chunks.tolist()) <= set(pcu_chunks.tolist())
    assert set(cu_rows.tolist()) <= set(pcu_rows.tolist())
    assert len(first) == len(bounds) + 1 and first[-1] == len(pbounds)
    for n in range(len(bounds)):
        assert pcu_chunks[first[n]] == cu_chunks[n] and pcu_chunks[first[n + 1]] == cu_chunks[n + 1]
        assert all(int(pcu_chunks[p + 1] - pcu_chunks[p]) <= piece for p in range(first[n], first[n + 1]))


def test_chain_split_plan():
    """Pieces only where a few long sequences would leave the GPU idle (132 SMs) and three
    passes over the data beat the unsplit chain: the spec's 65536-token cases split into 16 /
    32 pieces, the T = 8192 cases (H = 32, 64) and the varlen batches not; every token in exactly one piece, pieces cut at whole chunks."""
    from cutekern.kda import _split_bounds, chain_pieces
    assert chain_pieces([1024], 8, 128, 132) == 64 and chain_pieces([1024], 4, 128, 132) == 32
    assert chain_pieces([200, 3], 4, 128, 132) == 8 and chain_pieces([63, 0, 79], 2, 128, 132) == 8
    # 1 x 8192 at 32 heads: 4 pieces would be bandwidth-bound at three passes (measured slower)
    for lens, h in (([128], 64), ([256], 64), ([256], 96), ([21, 9, 32, 16, 5, 48], 64),
                    ([16] * 8, 64), ([1024], 64), ([20, 3], 4), ([128], 32), ([40, 3], 4)):
        assert chain_pieces(lens, h, 128, 132) == 0, (lens, h)
    bounds = [(0, 0, 700), (0, 700, 700), (0, 700, 1500), (1, 0, 64)]
    pieces, first = _split_bounds(bounds, 2)
    assert first == [0, 6, 7, 14, 15]
    assert pieces[:6] == [(0, 0, 128), (0, 128, 256), (0, 256, 384), (0, 384, 512),
                          (0, 512, 640), (0, 640, 700)]
    assert pieces[6] == (0, 700, 700) and pieces[14] == (1, 0, 64)
    for (b, s0, s1), (p0, p1) in zip(bounds, zip(first, first[1:])):
        assert [x[1] for x in pieces[p0:p1]][0] == s0 and pieces[p1 - 1][2] == s1
        assert all(pieces[i][2] == pieces[i + 1][1] for i in range(p0, p1 - 1))


@pytest.mark.parametrize("dv,with_h0,scan", [(64, True, True), (128, True, True), (128, False, True),
                                             (64, True, False), (128, False, False)])
def test_chain_split_composes_to_the_whole_chain(dv, with_h0, scan):
    """`kda._split_chain` (pieces' affine maps from the chain run from S = 0 and from S = I
    with a stride-0 zero u, composed in fp32, then the chain from the composed start states)
    through the chain kernel's torch model: the first piece of every sequence is bit-identical
    to the unsplit chain (same inputs, same start), the rest within the bf16 bar of it and of
    the float64 recurrence; initial states, a 0-token sequence and V != K included; both
    compositions (log-depth scan, piece by piece)."""
    from cutekern.kda import _chunk_rows, _split_bounds, _split_chain
    from cutekern.reference import kda_intra_packed
    cu = [0, 700, 700, 1500]
    t, h, d = cu[-1], 2, 64
    # a weak decay (exp(Gamma) ~ 0.85 per chunk), so that the pieces' M are far from 0 and
    # the composition matters (under the safe gate M underflows to 0 within two chunks)
    (q, k, v, g, beta), s0 = _inputs(1, t, h, d, dv, 17, gate="direct", n_state=3, dtype=torch.bfloat16)
    g = g * 0.05
    if not with_h0:
        s0 = None
    bounds = [(0, a, b) for a, b in zip(cu, cu[1:])]
    rows, cu_rows, cu_chunks = _chunk_rows(bounds, t)
    packed = kda_intra_packed(q, k, v, g, beta, rows, torch.bfloat16, scale=None, l2norm=True,
                              beta_sigmoid=True, gate=None)
    chain = _model_chain(t)
    o_ref = torch.full((1, t, h, dv), float("nan"), dtype=torch.bfloat16)
    ht_ref = torch.empty(3, h, d, dv)
    chain(*packed, cu_rows, cu_chunks, s0, o_ref, ht_ref)
    pieces, first = _split_bounds(bounds, 2)
    _, cu_rows_p, cu_chunks_p = _chunk_rows(pieces, t)
    assert torch.equal(cu_chunks_p[torch.tensor(first)], cu_chunks)   # same chunk list
    o = torch.full((1, t, h, dv), float("nan"), dtype=torch.bfloat16)
    ht = torch.full((3, h, d, dv), float("nan"))
    last = torch.tensor([f - 1 for f in first[1:]])
    _split_chain(chain, packed, cu_rows_p, cu_chunks_p, first, last, s0, o, ht, scan=scan)
    assert torch.isfinite(o.float()).all() and torch.isfinite(ht).all()
    if scan:   # the log-depth composition against the piece-by-piece one: fp32 rounding apart
        ht_seq = torch.full_like(ht, float("nan"))
        _split_chain(chain, packed, cu_rows_p, cu_chunks_p, first, last, s0, o.clone(), ht_seq,
                     scan=False)
        ht_default = torch.full_like(ht, float("nan"))   # host tensors: the scan by default
        _split_chain(chain, packed, cu_rows_p, cu_chunks_p, first, last, s0, o.clone(), ht_default)
        assert torch.equal(ht_default, ht)
        # fp32 products of the pieces' affine maps (M far from 0 here) in two orders: 1e-5
        # held on earlier boxes, 4.5e-5 on a 2-core AMD EPYC (AVX2) box whose BLAS blocks
        # the products differently (2026-12-07); a wrong composition is off by O(1)
        assert ((ht - ht_seq).norm() / ht_seq.norm()).item() < 2e-4
    assert torch.equal(o[0, :128], o_ref[0, :128]) and torch.equal(o[0, 700:828], o_ref[0, 700:828])
    assert torch.equal(ht[1], s0[1] if with_h0 else torch.zeros_like(ht[1]))   # 0-token sequence
    rel = lambda x, ref: ((x.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel(o, o_ref) < 6e-3 and rel(ht, ht_ref) < 6e-3, (rel(o, o_ref), rel(ht, ht_ref))
    assert not torch.equal(o, o_ref)        # later pieces start from composed states
    ro, rh = kda_reference(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                           cu_seqlens=torch.tensor(cu), use_qk_l2norm_in_kernel=True,
                           use_beta_sigmoid_in_kernel=True)
    assert rel(o, ro) < 6e-3 and rel(ht, rh) < 6e-3, (rel(o, ro), rel(ht, rh))


def test_fla_options_named_or_honoured():
    """fla's further chunk_kda options: named errors for what the op does not do, the rest
    mapped onto what the kernels take (2 sigmoid(beta) for allow_neg_eigval, a V-first state
    transposed), unknown keywords refused."""
    from cutekern.kda import _compat_inputs, _fla_options, chunk_kda
    opts = dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False,
                return_intermediate_states=False, state_v_first=False, cp_context=None,
                use_graph=False, chunk_size=64, transpose_state_layout=None)
    assert _fla_options(**opts) is False
    assert _fla_options(**{**opts, "transpose_state_layout": True}) is True
    assert _fla_options(**{**opts, "chunk_size": 32}) is False
    for bad, exc, name in ((dict(allow_neg_eigval=True, use_beta_sigmoid_in_kernel=False), ValueError, "allow_neg_eigval"),
                           (dict(return_intermediate_states=True), NotImplementedError, "return_intermediate_states"),
                           (dict(cp_context=object()), NotImplementedError, "cp_context"),
                           (dict(use_graph=True), NotImplementedError, "use_graph"),
                           (dict(chunk_size=16), ValueError, "chunk_size"),
                           (dict(state_v_first=True, transpose_state_layout=True), ValueError, "transpose_state_layout")):
        with pytest.raises(exc, match=f"'{name}'"):
            _fla_options(**{**opts, **bad})
    (q, k, v, g, beta), s0 = _inputs(1, 10, 2, 64, 32, 3, n_state=1, dtype=torch.bfloat16)
    with pytest.raises(TypeError):
        chunk_kda(q, k, v, g, beta, no_such_option=1)
    b2, s2, sig = _compat_inputs(beta, s0.transpose(-1, -2).contiguous(), True, True, True)
    assert sig is False and torch.allclose(b2, 2 * torch.sigmoid(beta.float()))
    assert torch.equal(s2, s0) and s2.is_contiguous()
    b3, s3, sig3 = _compat_inputs(beta, s0, True, False, False)
    assert sig3 is True and b3 is beta and s3 is s0


def test_state_v_first_shape_is_checked():
    from cutekern.kda import check_kda_args
    (q, k, v, g, beta), s0 = _inputs(1, 10, 2, 64, 128, 3, n_state=1, dtype=torch.bfloat16)
    check_kda_args(q, k, v, g, beta, initial_state=s0)
    check_kda_args(q, k, v, g, beta, initial_state=s0.transpose(-1, -2).contiguous(), state_v_first=True)
    with pytest.raises(ValueError, match=r"'initial_state'.*\[N, H, V, K\]"):
        check_kda_args(q, k, v, g, beta, initial_state=s0, state_v_first=True)


def test_registered_op_fake_shapes():
    """torch.compile traces chunk_kda through the registered op (eager calls skip its
    dispatch): its fake gives o like v and the final state [N, H, K, V] fp32 (0 rows when not
    asked for)."""
    import cutekern.kda  # noqa: F401 - registers the op
    m = lambda *s, dt=torch.bfloat16: torch.empty(*s, dtype=dt, device="meta")  # noqa: E731
    q, v, beta = m(1, 300, 3, 128), m(1, 300, 3, 64), m(1, 300, 3)
    o, ht = torch.ops.cutekern.chunk_kda(q, q, v, q, beta, None, None, True, True, False, False,
                                         None, None, None, [0, 100, 300])
    assert o.shape == v.shape and o.dtype == v.dtype
    assert ht.shape == (2, 3, 128, 64) and ht.dtype == torch.float32
    _, ht0 = torch.ops.cutekern.chunk_kda(q, q, v, q, beta, None, None, False, True, False, False,
                                          None, None, None, [])
    assert ht0.shape == (0, 3, 128, 64)
