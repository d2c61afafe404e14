"""The W4A16 Qwen3 decoder in launches (cutekern.qwen3) on the CPU: its wiring (weight
stacking, norms, residual, cache append, lens advance, ragged rows) checked against
reference.qwen3_forward in float64 with the three launches replaced by emulations of their
contracts (rounding where the kernels round); the GPU test runs the kernels themselves."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import cutekern.qwen3 as q3
from cutekern.reference import (Qwen3Config, decode_attention_reference, qwen3_forward,
                                qwen3_params, qwen3_quantized, w4a16_dequantize,
                                w4a16_fragments_dense)

CFG = Qwen3Config(hidden=256, layers=2, q_heads=4, kv_heads=2, intermediate=384, vocab=211)


def _dense(w):
    return w4a16_fragments_dense(w.packed, w.scales, w.group)              # float64 [N, K]


def _linear(x, w, out):
    out.copy_((x.double() @ _dense(w).t()).to(out.dtype))
    return out


def _attention(qkv, kc, vc, lens, qn, kn, rope, *, eps, out):
    a, k, v = decode_attention_reference(qkv, kc, vc, lens, qn, kn, eps, CFG.rope_theta)
    for b in range(qkv.shape[0]):
        p = int(lens[b])
        if 0 <= p < kc.shape[2]:
            kc[b, :, p], vc[b, :, p] = k[b].to(kc.dtype), v[b].to(vc.dtype)
    out.copy_(a.to(out.dtype))
    return out


def _mlp(x, mlp, out, h):
    gu = w4a16_fragments_dense(mlp.packed_gu, mlp.scales_gu, mlp.down.group)     # [2F, K]
    y = x.double() @ gu.t()                       # 16-column blocks of gate, then of up
    y = y.view(*y.shape[:-1], mlp.f // 16, 2, 16)
    h.copy_((F.silu(y[..., 0, :]) * y[..., 1, :]).reshape(*x.shape[:-1], mlp.f).to(h.dtype))
    out.copy_((h.double() @ _dense(mlp.down).t()).to(out.dtype))
    return out


def _add_rms_norm(x, y, w, out, *, eps):
    x.add_(y.float())
    out.copy_(F.rms_norm(x, (x.shape[-1],), w, eps))
    return out


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(q3, "add_rms_norm", _add_rms_norm)
    monkeypatch.setattr(q3, "w4a16_linear", _linear)
    monkeypatch.setattr(q3, "decode_attention", _attention)
    monkeypatch.setattr(q3, "w4a16_mlp", _mlp)


def _ref_logits(params, dq, seq):
    """float64 logits of the last token of one row's sequence [T]."""
    logits, _ = qwen3_forward(params, CFG, seq[None], weight=lambda i, n, w: dq[i][n])
    return logits[0, -1]


def _ref_cache(params, dq, prefix):
    _, cache = qwen3_forward(params, CFG, prefix[None], weight=lambda i, n, w: dq[i][n])
    return cache


def _close(got, want, tol):
    err = (got.double() - want).abs().max().item()
    assert not torch.isnan(got).any()
    assert err <= tol * want.abs().max().item(), err
    return err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_steps_match_the_float64_model(emulated, dtype):
    params = qwen3_params(CFG, seed=5, dtype=dtype)
    qp, dq = qwen3_quantized(params)
    dec = q3.prepare_qwen3_decoder(qp, CFG, batch=3, max_len=16)
    g = torch.Generator().manual_seed(2)
    seqs = torch.randint(0, CFG.vocab, (3, 9), generator=g)
    prev = (0, 3, 5)                                  # ragged: rows at their own positions
    for layer, (kc, vc) in enumerate(zip(dec.k_cache, dec.v_cache)):
        for b, n in enumerate(prev):
            if n:
                c = _ref_cache(params, dq, seqs[b, :n])[layer]
                kc[b, :, :n], vc[b, :, :n] = c[0][0].to(dtype), c[1][0].to(dtype)
    dec.reset(torch.tensor(prev))
    for t in range(4):
        got = dec.step(torch.stack([seqs[b, n + t] for b, n in enumerate(prev)]))
        for b, n in enumerate(prev):
            _close(got[b], _ref_logits(params, dq, seqs[b, :n + t + 1]), 2e-2)
        assert dec.lens.tolist() == [n + t + 1 for n in prev]
    # the same model given dense weights quantizes to the same storage: the same logits
    dense = q3.prepare_qwen3_decoder(params, CFG, batch=3, max_len=16)
    for a, b in zip(dense.layers, dec.layers):
        assert torch.equal(a.qkv.packed, b.qkv.packed) and torch.equal(a.mlp.scales_gu,
                                                                          b.mlp.scales_gu)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_head(emulated, dtype):
    """quantize_head=True runs the tied head through w4a16_linear: the float64 model with the
    dequantized head matches it, the 16-bit head's model does not match as closely."""
    cfg = replace(CFG, vocab=224)                     # a multiple of the GEMM's 16 columns
    params = qwen3_params(cfg, seed=6, dtype=dtype)
    qp, dq = qwen3_quantized(params, head=True)
    head = w4a16_dequantize(*qp["lm_head"], 128)
    dec = q3.prepare_qwen3_decoder(qp, cfg, batch=2, max_len=8, quantize_head=True)
    assert dec.head.n == cfg.vocab and dec.head.k == cfg.hidden
    seqs = torch.tensor([[3, 17, 200], [223, 0, 5]])
    for t in range(3):
        got = dec.step(seqs[:, t])
    for b in range(2):
        want, _ = qwen3_forward(params, cfg, seqs[b][None],
                                weight=lambda i, n, w: dq[i][n], head=head)
        dense, _ = qwen3_forward(params, cfg, seqs[b][None], weight=lambda i, n, w: dq[i][n])
        err = _close(got[b], want[0, -1], 1e-2)
        assert (got[b].double() - dense[0, -1]).abs().max().item() > 2 * err
    # a dense tied embedding quantizes here to the same storage
    again = q3.prepare_qwen3_decoder(params, cfg, batch=1, max_len=8, quantize_head=True)
    assert torch.equal(again.head.packed, dec.head.packed)
    tied = q3.prepare_qwen3_decoder(params, cfg, batch=1, max_len=8)
    assert tied.head is tied.embed


def test_wiring_mistakes_are_caught(emulated, monkeypatch):
    """The comparison above can fail: a decoder that skips the residual of the MLP does."""
    params = qwen3_params(CFG, seed=5)
    qp, dq = qwen3_quantized(params)
    dec = q3.prepare_qwen3_decoder(qp, CFG, batch=1, max_len=8)
    monkeypatch.setattr(q3, "w4a16_mlp", lambda x, mlp, out, h: out.zero_())
    seq = torch.tensor([7, 11])
    dec.step(seq[:1])
    got = dec.step(seq[1:])
    with pytest.raises(AssertionError):
        _close(got[0], _ref_logits(params, dq, seq), 2e-2)


def test_prepare_names_the_bad_argument():
    params = qwen3_params(CFG, seed=1)
    with pytest.raises(ValueError, match="'batch'"):
        q3.prepare_qwen3_decoder(params, CFG, batch=0, max_len=8)
    with pytest.raises(ValueError, match="'max_len'"):
        q3.prepare_qwen3_decoder(params, CFG, batch=1, max_len=1)
    with pytest.raises(TypeError, match="'cfg'"):
        q3.prepare_qwen3_decoder(params, dict(), batch=1, max_len=8)
    bad = dict(params, layers=params["layers"][:1])
    with pytest.raises(ValueError, match="2 layers"):
        q3.prepare_qwen3_decoder(bad, CFG, batch=1, max_len=8)
    lay = dict(params["layers"][0])
    del lay["k_norm"]
    with pytest.raises(ValueError, match="layer 0 lacks"):
        q3.prepare_qwen3_decoder(dict(params, layers=[lay, params["layers"][1]]), CFG,
                                 batch=1, max_len=8)
    lay = dict(params["layers"][0], q_norm=torch.ones(64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="q_norm"):
        q3.prepare_qwen3_decoder(dict(params, layers=[lay, params["layers"][1]]), CFG,
                                 batch=1, max_len=8)
    with pytest.raises(ValueError, match="'params'"):
        q3.prepare_qwen3_decoder(dict(params, embed=params["embed"][:5]), CFG, batch=1,
                                 max_len=8)
    with pytest.raises(ValueError, match="'quantize_head'"):
        q3.prepare_qwen3_decoder(params, CFG, batch=1, max_len=8, quantize_head=True)  # 211
    with pytest.raises(ValueError, match="lm_head"):
        q3.prepare_qwen3_decoder(dict(params, lm_head=params["embed"][:, :8]), CFG, batch=1,
                                 max_len=8)
    qp, _ = qwen3_quantized(qwen3_params(replace(CFG, vocab=224), seed=1), head=True)
    with pytest.raises(ValueError, match="quantize_head=True"):
        q3.prepare_qwen3_decoder(qp, replace(CFG, vocab=224), batch=1, max_len=8)
    dec = q3.prepare_qwen3_decoder(params, CFG, batch=2, max_len=8)
    with pytest.raises(ValueError, match="'lens'"):
        dec.reset(torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="'tokens'"):
        dec.step(torch.tensor([1, 2, 3]))
