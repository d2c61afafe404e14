"""KDA chunked prefill on the GPU (the Ada design's two kernels, built for sm_90a on an
H200). Each kernel against the fp32 torch model of its own contract (reference.
kda_intra_packed / kda_chain_packed, the same 16-bit rounding points) with poisoned outputs;
the whole op against the float64 token recurrence: ragged chunks, 0- and 1-token sequences,
initial / final state, the gate forms, l2norm on / off, both head dims, both dtypes, a
bf16 gate input, and a hypothesis fuzz over varlen batches."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from cutekern import kda
from cutekern.arch import target_arch
from cutekern.registry import OPS
from cutekern.reference import kda_chain_packed, kda_intra_packed, kda_reference

# the tile emulation of the contract measured 2.8-2.9e-3 (bf16) / 3.6e-4 (fp16) rel L2
REL_L2 = {torch.bfloat16: 6e-3, torch.float16: 1.5e-3}

pytestmark = pytest.mark.skipif("ada" not in OPS["kda_intra"].designs_on(target_arch()),
                                reason="no KDA kernels for this arch")


def rel_l2(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def close(x, ref, rel, what):
    """Every element: finite, within a bound scaled by the tensor's rms; and rel L2 <= rel."""
    x, ref = x.double(), ref.double()
    assert torch.isfinite(x).all(), f"{what}: non-finite values"
    rms = ref.pow(2).mean().sqrt().item() if ref.numel() else 0.0
    err = (x - ref).abs()
    bound = 25 * rel * rms + 4 * rel * ref.abs()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {x.numel()} elements out of bound, "
                           f"max err {err.max().item():.3e}, rms {rms:.3e}")
    r = rel_l2(x, ref)
    assert r <= rel, f"{what}: rel L2 {r:.2e} > {rel:.1e}"


def make(bsz, t, h, dk, dv, dtype, seed, *, raw_gate=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = rnd(bsz, t, h, dk).to(dtype), rnd(bsz, t, h, dk).to(dtype), rnd(bsz, t, h, dv).to(dtype)
    if raw_gate:
        g = rnd(bsz, t, h, dk)
    else:  # log decay in (-1, 0): strong enough that exp(G) spans decades over a chunk
        g = -torch.rand(bsz, t, h, dk, device="cuda", generator=gen)
    beta = torch.rand(bsz, t, h, device="cuda", generator=gen).to(dtype)
    return q, k, v, g, beta


def _reference(q, k, v, g, beta, cu, h0, **kw):
    from cutekern.reference import kda_gate
    if kw.get("use_gate_in_kernel"):
        g = kda_gate(g, kw.get("A_log"), kw.get("dt_bias"), kw.get("lower_bound"))
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64, device="cuda")
    return kda_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                         cu_seqlens=cu_t, scale=kw.get("scale"),
                         use_qk_l2norm_in_kernel=kw.get("use_qk_l2norm_in_kernel", False),
                         use_beta_sigmoid_in_kernel=kw.get("use_beta_sigmoid_in_kernel", False))


def check_op(q, k, v, g, beta, *, cu=None, h0=None, **kw):
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64, device="cuda")
    o, ht = kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                          cu_seqlens=cu_t, **kw)
    ro, rh = _reference(q, k, v, g, beta, cu, h0, **kw)
    assert o.dtype == q.dtype and o.shape == v.shape
    rel = REL_L2[q.dtype]
    close(o, ro, rel, "o")
    close(ht, rh, rel, "final state")


# ------------------------------------------------------------------ the chain kernel alone
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dk,dv", [(128, 128), (64, 64), (64, 128), (128, 64)])
def test_chain_kernel_matches_its_contract(dtype, dk, dv):
    """Poisoned o / ht; every row covered by a sequence and every state written."""
    h = 3
    cu = [0, 100, 101, 101, 300, 364]
    t = cu[-1]
    q, k, v, g, beta = make(1, t, h, dk, dv, dtype, 1)
    bounds = [(0, a, b) for a, b in zip(cu, cu[1:])]
    rows, cu_rows, cu_chunks = kda._chunk_rows(bounds, t)
    w, u, qg, kg, aqk, eg = kda_intra_packed(q, k, v, g, beta, rows, dtype, scale=None,
                                             l2norm=True, beta_sigmoid=False, gate=None)
    h0 = torch.randn(len(bounds), h, dk, dv, device="cuda")
    o = torch.full((1, t + 7, h, dv), float("nan"), dtype=dtype, device="cuda")
    ht = torch.full((len(bounds), h, dk, dv), float("nan"), device="cuda")
    kda._chain(w, u, qg, kg, aqk, eg, cu_rows.cuda(), cu_chunks.cuda(), h0, o, ht)
    torch.cuda.synchronize()
    ro, rh = kda_chain_packed(w, u, qg, kg, aqk, eg, cu_rows, cu_chunks, h0, t)
    assert torch.isnan(o[0, t:]).all(), "rows past the last sequence were written"
    close(o[0, :t], ro, 2e-3, "o")
    close(ht, rh, 2e-3, "final state")
    # the 0-token sequence hands its initial state through unchanged
    assert torch.equal(ht[2], h0[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dk,dv", [(128, 128), (64, 64), (64, 128)])
@pytest.mark.parametrize("gate", ["log_decay", "strong", "softplus", "safe"])
def test_intra_kernel_matches_its_contract(dtype, dk, dv, gate):
    """Every output poisoned first; chunks of 64, 36, 1 and 0 rows' worth of padding. The
    "strong" log decay (down to -12 per token) spreads a 16-token sub-chunk past what the
    tensor-core diagonal path takes, so its diagonal blocks run the exact fp32 path (the
    other gates take the bf16 hi + lo pairs, for fp16 inputs too)."""
    h = 2
    cu = [0, 100, 101, 229]
    t = cu[-1]
    q, k, v, g, beta = make(1, t, h, dk, dv, dtype, 11, raw_gate=gate not in ("log_decay", "strong"))
    if gate == "strong":
        g = g * 12
    a_log = torch.randn(h, device="cuda") * 0.5
    dtb = torch.randn(h, dk, device="cuda") * 0.5
    lb = -5.0 if gate == "safe" else None
    bounds = [(0, a, b) for a, b in zip(cu, cu[1:])]
    rows, _, _ = kda._chunk_rows(bounds, t)
    table, _, _ = kda._chunk_table(bounds, t)
    nc = rows.shape[0]
    nan = lambda *s, dt=dtype: torch.full(s, float("nan"), dtype=dt, device="cuda")  # noqa: E731
    out = (nan(nc, h, 64, dk), nan(nc, h, 64, dv), nan(nc, h, 64, dk), nan(nc, h, 64, dk),
           nan(nc, h, 64, 64), nan(nc, h, dk, dt=torch.float32))
    kda._intra(q, k, v, g, beta, table.cuda(), scale=None, l2norm=True, beta_sigmoid=True,
               gate_mode={"log_decay": 0, "strong": 0, "softplus": 1, "safe": 2}[gate], a_log=a_log,
               dt_bias=dtb, lower_bound=lb, out=out)
    torch.cuda.synchronize()
    gate_fn = None
    if gate in ("softplus", "safe"):
        from cutekern.reference import kda_gate
        gate_fn = lambda x: kda_gate(x, a_log, dtb, lb, acc_dtype=torch.float32)  # noqa: E731
    ref = kda_intra_packed(q, k, v, g, beta, rows, dtype, scale=None, l2norm=True,
                           beta_sigmoid=True, gate=gate_fn)
    for name, x, r in zip(("w", "u", "qg", "kg", "aqk", "eg"), out, ref):
        close(x, r, 1e-2 if name != "eg" else 1e-5, name)
    # the upper triangle of Aqk and every padding row are exact zeros
    assert (out[4].float().triu(1) == 0).all()
    pad = (rows < 0).cuda()
    for x in out[:5]:
        assert (x.transpose(1, 2)[pad] == 0).all()


# ------------------------------------------------------------------ the op vs float64
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dk,dv", [(128, 128), (64, 64), (128, 64)])
def test_op_batched_ragged(dtype, dk, dv):
    q, k, v, g, beta = make(2, 150, 2, dk, dv, dtype, 2)
    h0 = torch.randn(2, 2, dk, dv, device="cuda") * 0.5
    check_op(q, k, v, g, beta, h0=h0, use_qk_l2norm_in_kernel=True)


def test_op_varlen_zero_and_one_token_sequences():
    cu = [0, 0, 1, 65, 65, 200, 201]
    q, k, v, g, beta = make(1, cu[-1], 4, 128, 128, torch.bfloat16, 3)
    check_op(q, k, v, g, beta, cu=cu, use_qk_l2norm_in_kernel=True)
    h0 = torch.randn(len(cu) - 1, 4, 128, 128, device="cuda")
    check_op(q, k, v, g, beta, cu=cu, h0=h0, use_qk_l2norm_in_kernel=True)


def test_op_single_token_and_no_state():
    q, k, v, g, beta = make(1, 1, 2, 128, 128, torch.bfloat16, 4)
    check_op(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    o, ht = kda.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert ht is None and torch.isfinite(o.float()).all()


@pytest.mark.parametrize("form", ["softplus", "safe", "beta_sigmoid_no_l2norm"])
def test_op_gate_forms(form):
    h, dk = 2, 128
    q, k, v, g, beta = make(1, 260, h, dk, dk, torch.bfloat16, 5, raw_gate=True)
    a_log = torch.randn(h, device="cuda") * 0.5
    dt_bias = torch.randn(h * dk, device="cuda") * 0.5
    if form == "softplus":
        check_op(q, k, v, g, beta, use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias,
                 use_qk_l2norm_in_kernel=True)
    elif form == "safe":
        check_op(q, k, v, g, beta, use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias,
                 safe_gate=True, lower_bound=-5.0, use_qk_l2norm_in_kernel=True)
    else:
        q, k = q * 0.1, k * 0.1   # no l2norm: keep the delta rule contractive
        g = -torch.rand_like(g)
        check_op(q, k, v, g, beta.float() * 4 - 2, use_beta_sigmoid_in_kernel=True, scale=0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_strong_decay(dtype):
    """Log decays down to -12 per token: the diagonal blocks' exact path (and mixed slabs)."""
    q, k, v, g, beta = make(1, 300, 2, 128, 128, dtype, 12)
    g[..., :64] *= 12          # one K slab wide, the other narrow
    check_op(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)


def test_op_bf16_gate_input():
    q, k, v, g, beta = make(1, 200, 2, 128, 128, torch.bfloat16, 7, raw_gate=True)
    check_op(q, k, v, g.bfloat16(), beta, use_gate_in_kernel=True,
             A_log=torch.zeros(2, device="cuda"), dt_bias=torch.zeros(2 * 128, device="cuda"),
             safe_gate=True, lower_bound=-3.0, use_qk_l2norm_in_kernel=True)


def test_registered_op_matches_the_eager_call():
    """Eager chunk_kda calls skip the custom op's dispatch; torch.compile traces the registered
    op (torch.ops.cutekern.chunk_kda). Both run the same implementation: same bits, varlen
    with an initial state."""
    cu = [0, 150, 151, 300]
    q, k, v, g, beta = make(1, cu[-1], 2, 128, 128, torch.bfloat16, 41)
    h0 = torch.randn(len(cu) - 1, 2, 128, 128, device="cuda")
    cu_t = torch.tensor(cu, dtype=torch.int64, device="cuda")
    o, ht = kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                          cu_seqlens=cu_t, use_qk_l2norm_in_kernel=True)
    o2, ht2 = torch.ops.cutekern.chunk_kda(q, k, v, g, beta, None, h0, True, True, False, False,
                                           None, None, None, cu)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


def test_op_graph_replay_with_new_contents():
    """A captured call replays on new inputs written into the same buffers."""
    cu = [0, 70, 71, 200]
    q, k, v, g, beta = make(1, cu[-1], 2, 128, 128, torch.bfloat16, 8)
    cu_t = torch.tensor(cu, device="cuda")
    cu_cpu = cu_t.cpu()   # the host copy: a capture may not copy device -> host
    run = lambda: kda.chunk_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_t,  # noqa: E731
                                cu_seqlens_cpu=cu_cpu, use_qk_l2norm_in_kernel=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, ht = run()
    q2, k2, v2, g2, beta2 = make(1, cu[-1], 2, 128, 128, torch.bfloat16, 9)
    for dst, src in ((q, q2), (k, k2), (v, v2), (g, g2), (beta, beta2)):
        dst.copy_(src)
    o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ro, rh = _reference(q, k, v, g, beta, cu, None, use_qk_l2norm_in_kernel=True)
    close(o, ro, REL_L2[torch.bfloat16], "o (replay)")
    close(ht, rh, REL_L2[torch.bfloat16], "final state (replay)")


def test_op_long_sequence_state_stays_bounded():
    """32 chunks of one chain: the state's rounding does not accumulate past the bar."""
    q, k, v, g, beta = make(1, 2048, 2, 128, 128, torch.bfloat16, 6)
    check_op(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(lens=st.lists(st.integers(0, 200), min_size=1, max_size=5),
       h=st.integers(1, 3), dims=st.sampled_from([(64, 64), (128, 128), (64, 128)]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), with_h0=st.booleans(),
       seed=st.integers(0, 2 ** 20))
def test_op_fuzz_varlen(lens, h, dims, dtype, with_h0, seed):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    if cu[-1] == 0:
        cu.append(1)
    dk, dv = dims
    q, k, v, g, beta = make(1, cu[-1], h, dk, dv, dtype, seed)
    h0 = torch.randn(len(cu) - 1, h, dk, dv, device="cuda") if with_h0 else None
    check_op(q, k, v, g, beta, cu=cu, h0=h0, use_qk_l2norm_in_kernel=True)


# ------------------------------------------------------------------ the chain split across CTAs
@pytest.mark.parametrize("dtype,dims", [(torch.bfloat16, (128, 128)), (torch.float16, (64, 128))])
def test_op_chain_split_across_ctas(dtype, dims, monkeypatch):
    """Long sequences over few heads with `kda.SPLIT_LONG_CHAINS` (the pieces' affine maps
    from the chain kernel run from S = 0 and from S = I with a stride-0 zero u, composed, then
    the chain from the composed states): against float64 and against the unsplit op; a weak
    decay so that the composition matters; an initial state and a 0-token sequence; and a
    CUDA-graph replay of the split op with new contents."""
    dk, dv = dims
    h, cu = 2, [0, 4000, 4000, 9000]
    q, k, v, g, beta = make(1, cu[-1], h, dk, dv, dtype, 31)
    g = g * 0.05
    h0 = torch.randn(len(cu) - 1, h, dk, dv, device="cuda")
    nchunks = [-(-(b - a) // 64) for a, b in zip(cu, cu[1:])]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert kda.chain_pieces(nchunks, h, dv, sms) > 0, "the case must take the split"
    monkeypatch.setattr(kda, "SPLIT_LONG_CHAINS", True)
    check_op(q, k, v, g, beta, cu=cu, h0=h0, use_qk_l2norm_in_kernel=True)
    cu_t = torch.tensor(cu, dtype=torch.int64, device="cuda")
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu_t,
              cu_seqlens_cpu=cu_t.cpu(), use_qk_l2norm_in_kernel=True)
    o_s, ht_s = kda.chunk_kda(q, k, v, g, beta, **kw)
    monkeypatch.setattr(kda, "SPLIT_LONG_CHAINS", False)
    o_u, ht_u = kda.chunk_kda(q, k, v, g, beta, **kw)
    close(o_s, o_u.float(), REL_L2[dtype], "o split vs unsplit")
    close(ht_s, ht_u, REL_L2[dtype], "final state split vs unsplit")
    assert torch.equal(ht_s[1], h0[1])                     # the 0-token sequence
    # graph capture of the split op, replayed on new contents
    monkeypatch.setattr(kda, "SPLIT_LONG_CHAINS", True)
    xs = [x.clone() for x in (q, k, v, g, beta)]
    kda.chunk_kda(*xs, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, ht_g = kda.chunk_kda(*xs, **kw)
    q2, k2, v2, g2, beta2 = make(1, cu[-1], h, dk, dv, dtype, 32)
    for dst, src in zip(xs, (q2, k2, v2, g2 * 0.05, beta2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    ro, rh = _reference(q2, k2, v2, g2 * 0.05, beta2, cu, h0, use_qk_l2norm_in_kernel=True)
    close(o_g, ro, REL_L2[dtype], "o (graph replay)")
    close(ht_g, rh, REL_L2[dtype], "final state (graph replay)")


def test_op_fla_options():
    """fla's allow_neg_eigval (beta = 2 sigmoid(logits), so eigenvalues of the delta rule in
    (-1, 1]) and state_v_first ([N, H, V, K] states in and out) against float64."""
    q, k, v, g, beta = make(1, 300, 2, 128, 64, torch.bfloat16, 41)
    cu = [0, 100, 300]
    logits = beta.float() * 4 - 2
    h0 = torch.randn(2, 2, 128, 64, device="cuda")
    cu_t = torch.tensor(cu, dtype=torch.int64, device="cuda")
    o, ht = kda.chunk_kda(q, k, v, g, logits, initial_state=h0.transpose(-1, -2).contiguous(),
                          output_final_state=True, cu_seqlens=cu_t, use_qk_l2norm_in_kernel=True,
                          use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                          state_v_first=True)
    assert ht.shape == (2, 2, 64, 128)
    ro, rh = _reference(q, k, v, g, 2 * torch.sigmoid(logits), cu, h0, use_qk_l2norm_in_kernel=True)
    close(o, ro, REL_L2[torch.bfloat16], "o")
    close(ht.transpose(-1, -2), rh, REL_L2[torch.bfloat16], "final state")
