"""MegaKernel decode ground truth (../shared/specs/megakernel.md): the W4A16 g128 storage,
the Qwen3 decoder step in float64 (decode steps with a KV cache against one prefill, the
grouped KV heads, RoPE's relative positions) and the spec's bytes-per-token roofline. No
kernel yet: these fix the ground truth first."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cutekern.reference import (Qwen3Config, _rope, decode_weight_bytes, qwen3_forward,
                                qwen3_params, w4a16_dequantize, w4a16_quantize)

SMALL = Qwen3Config(hidden=64, layers=2, q_heads=4, kv_heads=2, head_dim=16, intermediate=96,
                    vocab=50)


def test_w4a16_storage_by_hand():
    """Nibble k % 8 of row k // 8 holds input channel k (zero point 8); the top nibble makes
    the int32 negative when >= 8; the scale maps the group's absmax to 7."""
    w = torch.zeros(2, 128)
    w[0, :8] = torch.tensor([7, -7, 0, 1, -1, 3, -3, 7.0])      # absmax 7 -> scale 1
    w[1, 0] = -2.0                                              # absmax 2 -> scale 2/7
    qw, sc = w4a16_quantize(w, group=128)
    assert qw.shape == (16, 2) and qw.dtype == torch.int32 and sc.shape == (1, 2)
    assert sc[0, 0] == 1.0 and torch.isclose(sc[0, 1], torch.tensor(2 / 7))
    nib = [(int(qw[0, 0]) >> (4 * j)) & 0xF for j in range(8)]
    assert nib == [15, 1, 8, 9, 7, 11, 5, 15]
    assert int(qw[0, 0]) < 0                                     # top nibble 15
    assert ((int(qw[0, 1]) & 0xF) == 1) and all(((int(qw[r, 1]) >> (4 * j)) & 0xF) == 8
                                                for r in range(1, 16) for j in range(8))
    assert torch.equal(w4a16_dequantize(qw, sc, 128).float(), w)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 40), groups=st.integers(1, 3), group=st.sampled_from([32, 128]),
       seed=st.integers(0, 2 ** 16), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_w4a16_roundtrip_within_half_a_step(n, groups, group, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, groups * group, generator=g) * torch.rand(n, 1, generator=g) * 3).to(dtype)
    qw, sc = w4a16_quantize(w, group=group)
    back = w4a16_dequantize(qw, sc, group)
    step = sc.double().t().repeat_interleave(group, dim=1)              # [N, K]
    assert ((back - w.double()).abs() <= 0.5 * step + 1e-3 * step).all()
    assert w4a16_dequantize(*w4a16_quantize(back.to(dtype), group=group), group).allclose(back, rtol=1e-2, atol=0)


def test_decode_steps_match_one_prefill():
    """T tokens as one prefill, or as a prefill of 3 then decode steps of 1 with the KV
    cache: the same logits (float64), for each step's new token."""
    p = qwen3_params(SMALL, seed=1, dtype=torch.float32)
    tokens = torch.randint(0, SMALL.vocab, (2, 9), generator=torch.Generator().manual_seed(2))
    full, cache_full = qwen3_forward(p, SMALL, tokens)
    part, cache = qwen3_forward(p, SMALL, tokens[:, :3])
    assert torch.allclose(part, full[:, :3], rtol=0, atol=1e-10)
    for i in range(3, 9):
        step, cache = qwen3_forward(p, SMALL, tokens[:, i:i + 1], cache=cache)
        assert torch.allclose(step[:, 0], full[:, i], rtol=0, atol=1e-10), i
    for (k, v), (kf, vf) in zip(cache, cache_full):
        assert k.shape == (2, SMALL.kv_heads, 9, SMALL.head_dim)
        assert torch.allclose(k, kf, atol=1e-12) and torch.allclose(v, vf, atol=1e-12)


def test_grouped_kv_heads_serve_consecutive_q_heads():
    """With every KV head's weights duplicated (kv_heads = q_heads), the model is the same
    one: q head j reads KV head j // (q_heads / kv_heads)."""
    p = qwen3_params(SMALL, seed=3, dtype=torch.float32)
    full = Qwen3Config(**{**SMALL.__dict__, "kv_heads": SMALL.q_heads})
    rep = SMALL.q_heads // SMALL.kv_heads
    hd = SMALL.head_dim
    dup = lambda w: w.view(SMALL.kv_heads, hd, -1).repeat_interleave(rep, 0).reshape(-1, w.shape[1])  # noqa: E731
    p2 = dict(p, layers=[dict(layer, k=dup(layer["k"]), v=dup(layer["v"])) for layer in p["layers"]])
    tokens = torch.randint(0, SMALL.vocab, (1, 6), generator=torch.Generator().manual_seed(4))
    a, _ = qwen3_forward(p, SMALL, tokens)
    b, _ = qwen3_forward(p2, full, tokens)
    assert torch.allclose(a, b, rtol=0, atol=1e-10)


def test_rope_depends_on_relative_position_only():
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 1, 1, 16, generator=g, dtype=torch.float64), torch.randn(1, 1, 1, 16, generator=g, dtype=torch.float64)
    dot = lambda a, b: (_rope(q, torch.tensor([a]), 1e6) * _rope(k, torch.tensor([b]), 1e6)).sum().item()  # noqa: E731
    assert abs(dot(7, 3) - dot(104, 100)) < 1e-9 and abs(dot(0, 0) - (q * k).sum().item()) < 1e-12
    assert abs(dot(7, 3) - dot(3, 7)) > 1e-6                         # direction matters


def test_w4a16_model_is_the_dequantized_model():
    """The `weight` hook: a W4A16 model is the float model of its dequantized weights, and
    stays close to the bf16 model it was quantized from (logits correlate > 0.97: 4-bit
    round-to-nearest on random weights measured 0.987 here)."""
    p = qwen3_params(SMALL, seed=6, dtype=torch.bfloat16)
    packs = [{n: w4a16_quantize(layer[n], group=32) for n in ("q", "k", "v", "o", "gate", "up", "down")}
             for layer in p["layers"]]
    hook = lambda i, name, w: w4a16_dequantize(*packs[i][name], group=32)  # noqa: E731
    tokens = torch.randint(0, SMALL.vocab, (1, 5), generator=torch.Generator().manual_seed(7))
    lq, _ = qwen3_forward(p, SMALL, tokens, weight=hook)
    pd = dict(p, layers=[dict(layer, **{n: hook(i, n, None) for n in packs[i]})
                         for i, layer in enumerate(p["layers"])])
    ld, _ = qwen3_forward(pd, SMALL, tokens)
    assert torch.allclose(lq, ld, rtol=0, atol=1e-10)
    lf, _ = qwen3_forward(p, SMALL, tokens)
    assert torch.corrcoef(torch.stack([lq.flatten(), lf.flatten()]))[0, 1] > 0.97


@pytest.mark.parametrize("quant_layers,quant_head,spec_gb", [(False, False, 3.45), (True, False, 1.36),
                                                             (True, True, 0.90)])
def test_bytes_per_token_match_the_spec(quant_layers, quant_head, spec_gb):
    got = decode_weight_bytes(Qwen3Config(), quant_layers=quant_layers, quant_head=quant_head) / 1e9
    assert abs(got - spec_gb) / spec_gb < 0.02, got
