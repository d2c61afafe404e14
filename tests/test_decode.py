"""Decode attention (cutekern.decode) on the CPU: the float64 reference against
reference.qwen3_forward's decoder (one layer, rows at their own positions), the RoPE table
against the reference's rotary embedding, named argument errors, the custom op's fake."""
import pytest
import torch

from cutekern.decode import HEAD_DIM, decode_attention, rope_table
from cutekern.reference import (Qwen3Config, _rms, _rope, decode_attention_reference,
                                qwen3_forward, qwen3_params)


def test_rope_table_matches_the_reference_rotary_embedding():
    tab = rope_table(300, theta=1e6).double()
    x = torch.randn(2, 3, 4, HEAD_DIM, dtype=torch.float64)
    pos = torch.tensor([0, 1, 77, 299])
    want = _rope(x, pos, 1e6)
    cos, sin = tab[pos, :64], tab[pos, 64:]
    x1, x2 = x[..., :64], x[..., 64:]
    got = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    assert (got - want).abs().max() < 1e-6       # the table is fp32
    assert rope_table(5).dtype == torch.float32 and rope_table(5).shape == (5, HEAD_DIM)


def _one_layer_decode(cfg, params, tokens_b, n_prev):
    """qwen3_forward's decode step of one row after n_prev prefilled tokens, and the same step
    composed from decode_attention_reference (cache in float64)."""
    p = params["layers"][0]
    prev = tokens_b[None, :n_prev]
    cache = None
    if n_prev:
        _, cache = qwen3_forward(params, cfg, prev)
    else:
        z = torch.zeros(1, cfg.kv_heads, 0, cfg.head_dim, dtype=torch.float64)
        cache = [(z, z)]
    want, _ = qwen3_forward(params, cfg, tokens_b[None, n_prev:n_prev + 1], cache=cache)
    x = params["embed"][tokens_b[n_prev:n_prev + 1]].double()               # [1, H]
    h = _rms(x, p["input_norm"], cfg.eps)
    qkv = torch.cat([h @ p[n].double().t() for n in ("q", "k", "v")], -1)
    s = cache[0][0].shape[2] + 1
    kc = torch.zeros(1, cfg.kv_heads, s, cfg.head_dim, dtype=torch.float64)
    vc = torch.zeros_like(kc)
    kc[:, :, :n_prev] = cache[0][0]
    vc[:, :, :n_prev] = cache[0][1]
    a, _, _ = decode_attention_reference(qkv, kc, vc, torch.tensor([n_prev]), p["q_norm"],
                                         p["k_norm"], cfg.eps, cfg.rope_theta, cfg.head_dim)
    x = x + a @ p["o"].double().t()
    h = _rms(x, p["post_norm"], cfg.eps)
    g, u = h @ p["gate"].double().t(), h @ p["up"].double().t()
    x = x + (torch.nn.functional.silu(g) * u) @ p["down"].double().t()
    x = _rms(x, params["final_norm"], cfg.eps)
    return want[0, 0], (x @ params["embed"].double().t())[0]


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (2, 2), (8, 2)])
def test_reference_is_the_decoder_step(q_heads, kv_heads):
    cfg = Qwen3Config(hidden=256, layers=1, q_heads=q_heads, kv_heads=kv_heads,
                      intermediate=384, vocab=97)
    params = qwen3_params(cfg, seed=3)
    tokens = torch.randint(0, cfg.vocab, (12,), generator=torch.Generator().manual_seed(1))
    for n_prev in (0, 1, 7, 11):            # rows at their own positions (ragged batches)
        want, got = _one_layer_decode(cfg, params, tokens, n_prev)
        assert (got - want).abs().max() < 1e-9 * want.abs().max()


def test_reference_marks_rows_outside_the_cache():
    qkv = torch.randn(3, 4 * HEAD_DIM)
    kc = torch.randn(3, 1, 5, HEAD_DIM)
    w = torch.ones(HEAD_DIM)
    out, k, v = decode_attention_reference(qkv, kc, kc, torch.tensor([4, 5, -1]), w, w)
    assert not out[0].isnan().any() and out[1:].isnan().all()
    assert torch.equal(v, qkv.double().view(3, 4, HEAD_DIM)[:, 3:])


def _args(b=3, hq=4, hkv=2, s=9, dtype=torch.float16):
    return dict(qkv=torch.randn(b, (hq + 2 * hkv) * HEAD_DIM).to(dtype),
                k_cache=torch.randn(b, hkv, s, HEAD_DIM).to(dtype),
                v_cache=torch.randn(b, hkv, s, HEAD_DIM).to(dtype),
                lens=torch.zeros(b, dtype=torch.int32),
                q_norm_weight=torch.ones(HEAD_DIM, dtype=dtype),
                k_norm_weight=torch.ones(HEAD_DIM, dtype=dtype), rope=rope_table(16))


def test_decode_attention_names_the_bad_argument():
    good = _args()
    bad = [
        ({"qkv": good["qkv"].float()}, ValueError, "qkv"),
        ({"qkv": good["qkv"][:, :-8]}, ValueError, "qkv"),
        ({"qkv": torch.randn(3, 5 * HEAD_DIM).half()}, ValueError, "qkv"),     # Hq 1 of 2
        ({"qkv": torch.randn(3, 4 * HEAD_DIM).half()}, ValueError, "qkv"),     # Hq 0
        ({"k_cache": good["k_cache"][..., :64]}, ValueError, "k_cache"),
        ({"k_cache": good["k_cache"][:2]}, ValueError, "k_cache"),
        ({"k_cache": good["k_cache"].bfloat16()}, ValueError, "k_cache"),
        ({"v_cache": good["v_cache"][:, :, :4]}, ValueError, "v_cache"),
        ({"v_cache": good["v_cache"][..., 1:].contiguous()}, ValueError, "v_cache"),
        ({"k_cache": torch.randn(3, 2, HEAD_DIM, 9).half().transpose(2, 3)}, ValueError,
         "k_cache"),
        ({"lens": good["lens"].long()}, ValueError, "lens"),
        ({"lens": good["lens"][:2]}, ValueError, "lens"),
        ({"lens": torch.zeros(3, 2, dtype=torch.int32)[:, 0]}, ValueError, "lens"),
        ({"q_norm_weight": torch.ones(64).half()}, ValueError, "q_norm_weight"),
        ({"k_norm_weight": torch.ones(HEAD_DIM)}, ValueError, "k_norm_weight"),
        ({"rope": rope_table(16).double()}, ValueError, "rope"),
        ({"rope": rope_table(16)[:, :64]}, ValueError, "rope"),
        ({"rope": rope_table(16, 256)[:, ::2]}, ValueError, "rope"),
        ({"qkv": good["qkv"].tolist()}, TypeError, "qkv"),
        ({"eps": 0.0}, ValueError, "eps"),
        ({"eps": float("nan")}, ValueError, "eps"),
        ({"out": torch.empty(3, 511).half()}, ValueError, "out"),
        ({"out": torch.empty(3, 512)}, ValueError, "out"),
        ({}, ValueError, "qkv"),                                  # CPU: must be on CUDA
    ]
    for change, exc, name in bad:
        kw = {**good, **change}
        with pytest.raises(exc, match=f"'{name}'"):
            decode_attention(**kw)


def test_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        a = _args(b=5, hq=6, hkv=3, dtype=torch.bfloat16)
        y = torch.ops.cutekern.decode_attention(a["qkv"], a["k_cache"], a["v_cache"],
                                                a["lens"], a["q_norm_weight"],
                                                a["k_norm_weight"], a["rope"], 1e-6)
        assert y.shape == (5, 6 * HEAD_DIM) and y.dtype == torch.bfloat16


def test_kernel_config_fits():
    pytest.importorskip("cutlass")
    from kernels.ada.decode_attn import DecodeAttnAda, DecodeAttnAdaConfig
    import cutlass
    assert DecodeAttnAda.can_implement(cutlass.BFloat16, DecodeAttnAdaConfig())
    assert not DecodeAttnAda.can_implement(cutlass.BFloat16, DecodeAttnAdaConfig(warps=2))
    assert not DecodeAttnAda.can_implement(cutlass.Float32, DecodeAttnAdaConfig())


def test_split_pick_keeps_every_cta_resident():
    from cutekern.decode import MAX_SPLITS, RESIDENT_PER_SM, SPLIT_MIN_POSITIONS, pick_splits
    assert RESIDENT_PER_SM == 2 and MAX_SPLITS == 16 and SPLIT_MIN_POSITIONS == 128
    assert pick_splits(8, 4096, 132) == MAX_SPLITS            # B = 1, Qwen3: 8 CTAs
    assert pick_splits(8, 1025, 132) == 9
    assert pick_splits(32, 4096, 132) == 8
    assert pick_splits(64, 4096, 132) == 4
    assert pick_splits(128, 4096, 132) == 2
    assert pick_splits(200, 4096, 132) == 1
    assert pick_splits(8, 77, 132) == 1                       # a short cache: one split
    assert pick_splits(8, 3 * SPLIT_MIN_POSITIONS, 132) == 3
    for ctas in range(1, 700):
        for cap in (1, 255, 256, 257, 5000, 1 << 20):
            n = pick_splits(ctas, cap, 132)
            assert n >= 1 and (n == 1 or ctas * n <= 132 * RESIDENT_PER_SM)


def test_benchmark_baseline_computes_the_same_step():
    """perf/bench_decode_attn.py's torch route (masked SDPA over the static cache) is the
    same contract: checked here on the CPU against the float64 reference, cache writes
    included, so its timings compare like with like."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "perf" / "bench_decode_attn.py"
    spec = importlib.util.spec_from_file_location("bench_decode_attn", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    g = torch.Generator().manual_seed(4)
    b, s, dt = 3, 40, torch.bfloat16
    qkv = torch.randn(b, (bench.HQ + 2 * bench.HKV) * HEAD_DIM, generator=g).to(dt)
    kc = torch.randn(b, bench.HKV, s, HEAD_DIM, generator=g).to(dt)
    vc = torch.randn(b, bench.HKV, s, HEAD_DIM, generator=g).to(dt)
    qn = (1 + 0.2 * torch.randn(HEAD_DIM, generator=g)).to(dt)
    kn = (1 + 0.2 * torch.randn(HEAD_DIM, generator=g)).to(dt)
    lens = torch.tensor([0, 17, s - 1], dtype=torch.int32)
    ref, k_new, v_new = decode_attention_reference(qkv, kc.clone(), vc.clone(), lens, qn, kn)
    y = bench.torch_step(qkv, kc, vc, lens, qn, kn, rope_table(s))
    assert (y.double() - ref).abs().max() < 2e-2
    for i, p in enumerate(lens.tolist()):
        assert (kc[i, :, p].double() - k_new[i]).abs().max() < 3e-2
        assert torch.equal(vc[i, :, p], v_new[i].to(dt))


def test_add_rms_norm_names_the_bad_argument():
    from cutekern.decode import add_rms_norm
    bf = torch.bfloat16
    x, y = torch.zeros(3, 64), torch.zeros(3, 64, dtype=bf)
    w, out = torch.ones(64), torch.empty(3, 64, dtype=bf)
    cases = [
        (dict(residual=x.double()), "'residual'"),
        (dict(residual=torch.zeros(3, 60), y=torch.zeros(3, 60, dtype=bf),
              weight=torch.ones(60), out=torch.empty(3, 60, dtype=bf)), "'residual'.*multiple of 8"),
        (dict(y=y.float()), "'y'"),
        (dict(y=torch.zeros(2, 64, dtype=bf)), "'y'"),
        (dict(out=out.half()), "'out'"),
        (dict(out=torch.empty(3, 72, dtype=bf)[:, :64]), None),      # strided rows: fine
        (dict(weight=w.to(bf)), "'weight'"),
        (dict(weight=torch.ones(65)[1:]), "'weight'.*16-byte"),
        (dict(out=torch.empty(3, 68, dtype=bf)[:, :64]), "'out'.*multiple of 8"),
        (dict(eps=0.0), "'eps'"),
        (dict(), "CUDA device"),
    ]
    for change, match in cases:
        args = dict(residual=x, y=y, weight=w, out=out, eps=1e-6) | change
        if match is None:
            with pytest.raises(ValueError, match="CUDA device"):
                add_rms_norm(args.pop("residual"), args.pop("y"), args.pop("weight"),
                             args.pop("out"), **args)
            continue
        with pytest.raises((ValueError, TypeError), match=match):
            add_rms_norm(args.pop("residual"), args.pop("y"), args.pop("weight"),
                         args.pop("out"), **args)
    with pytest.raises(TypeError, match="'y'"):
        add_rms_norm(x, None, w, out)


def test_add_rms_norm_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x, w = torch.empty(3, 64), torch.empty(64)
        y, out = torch.empty(3, 64, dtype=torch.bfloat16), torch.empty(3, 64, dtype=torch.bfloat16)
        assert torch.ops.cutekern.add_rms_norm(x, y, w, out, 1e-6) is None
