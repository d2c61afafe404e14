"""The W4A16 Qwen3 decoder in launches (cutekern.qwen3: w4a16_linear, decode_attention,
w4a16_mlp, torch norms and LM head) on the GPU against the float64 model
(reference.qwen3_forward with the dequantized GPTQ weights: independent of the kernels'
fragment order). Every logit of every step is compared (NaN fails); fresh random weights and
tokens, rows at their own ragged positions (prefilled caches from the float64 model), cache
positions past each row's length and the logits poisoned with NaN, batches past the GEMM's
16-row slices, Qwen3-1.7B's layer dims, CUDA-graph replay bitwise equal to eager steps, a
hypothesis fuzz over batch, lengths and dtype."""
from dataclasses import replace

import pytest
import torch

from hypothesis import HealthCheck, given, settings, strategies as st

import cutekern.qwen3 as q3
from cutekern.arch import target_arch
from cutekern.reference import (Qwen3Config, qwen3_forward, qwen3_params, qwen3_quantized,
                                w4a16_dequantize)
from cutekern.registry import OPS

pytestmark = pytest.mark.skipif(
    any("ada" not in OPS[op].designs_on(target_arch())
        for op in ("decode_attn", "w4a16_gemm", "w4a16_mlp")),
    reason="no decode kernels for this arch")

SMALL = Qwen3Config(hidden=256, layers=2, q_heads=4, kv_heads=2, intermediate=384, vocab=211)
# Qwen3-1.7B's layer (hidden 2048, 16 / 8 heads, intermediate 6144), 2 layers, small vocab
LAYER_1P7B = Qwen3Config(layers=2, vocab=1000)
TOL = 2e-2        # max |error| / max |logit|: bf16 activations through 2 layers + the head


class Model:
    def __init__(self, cfg, dtype, seed, quantize_head=False):
        self.cfg, self.quantize_head = cfg, quantize_head
        self.params = qwen3_params(cfg, seed=seed, dtype=dtype, device="cuda")
        self.qp, self.dense = qwen3_quantized(self.params, head=quantize_head)
        self.head = w4a16_dequantize(*self.qp["lm_head"], 128) if quantize_head else None

    def forward(self, seq):
        """float64 logits [T, vocab] of one row's tokens [T], and its cache."""
        logits, cache = qwen3_forward(self.params, self.cfg, seq[None],
                                      weight=lambda i, n, w: self.dense[i][n], head=self.head)
        return logits[0], cache

    def decoder(self, batch, max_len):
        return q3.prepare_qwen3_decoder(self.qp, self.cfg, batch=batch, max_len=max_len,
                                        quantize_head=self.quantize_head)


def run_and_check(model, dec, prev, steps, seed):
    """Prefill each row's first prev[b] tokens (float64 cache, rounded), poison the rest of
    the caches and the logits, decode ``steps`` tokens; check every logit of every step."""
    b = len(prev)
    g = torch.Generator(device="cuda").manual_seed(seed)
    seqs = torch.randint(0, model.cfg.vocab, (b, max(prev) + steps), device="cuda", generator=g)
    want = []
    for layer in range(model.cfg.layers):
        dec.k_cache[layer].fill_(float("nan"))
        dec.v_cache[layer].fill_(float("nan"))
    for r, n in enumerate(prev):
        logits, cache = model.forward(seqs[r, :n + steps])
        want.append(logits[n:])
        for layer, (k, v) in enumerate(cache):
            dec.k_cache[layer][r, :, :n] = k[0, :, :n].to(dec.dtype)
            dec.v_cache[layer][r, :, :n] = v[0, :, :n].to(dec.dtype)
    dec.reset(torch.tensor(prev))
    worst = 0.0
    for t in range(steps):
        dec.logits.fill_(float("nan"))
        got = dec.step(torch.stack([seqs[r, n + t] for r, n in enumerate(prev)])).double()
        for r in range(b):
            ref = want[r][t]
            assert not torch.isnan(got[r]).any(), (r, t)
            err = (got[r] - ref).abs().max().item() / ref.abs().max().item()
            assert err <= TOL, (r, t, err)
            worst = max(worst, err)
    torch.cuda.synchronize()
    assert dec.lens.tolist() == [n + steps for n in prev]
    return worst


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prev", [(0, 3, 5), (1,), (0,) * 17 + (9, 2, 30)])
def test_steps_match_the_float64_model(dtype, prev):
    model = Model(SMALL, dtype, seed=len(prev))
    dec = model.decoder(len(prev), max_len=max(prev) + 6)
    run_and_check(model, dec, prev, steps=4, seed=1)


def test_qwen3_1p7b_layer_dims():
    model = Model(LAYER_1P7B, torch.bfloat16, seed=7)
    dec = model.decoder(4, max_len=80)
    run_and_check(model, dec, (0, 76, 13, 64), steps=3, seed=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_head_matches_the_float64_model(dtype):
    """quantize_head=True: the tied head in W4A16 (w4a16_linear) against the float64 model
    with the dequantized head; 20 rows (two of the GEMM's 16-row slices)."""
    model = Model(replace(SMALL, vocab=224), dtype, seed=11, quantize_head=True)
    dec = model.decoder(20, max_len=24)
    dec.capture()
    run_and_check(model, dec, tuple(range(0, 20)), steps=3, seed=5)


def test_quantized_head_qwen3_1p7b_layer_dims():
    model = Model(replace(LAYER_1P7B, vocab=1008), torch.bfloat16, seed=12, quantize_head=True)
    dec = model.decoder(3, max_len=40)
    run_and_check(model, dec, (0, 33, 7), steps=3, seed=6)


@pytest.mark.parametrize("batch", [1, 5])
def test_graph_replay_is_the_eager_step(batch):
    model = Model(SMALL, torch.bfloat16, seed=3)
    eager, graphed = model.decoder(batch, 12), model.decoder(batch, 12)
    graphed.capture()
    assert graphed.lens.tolist() == [0] * batch          # the capture's warm-up is undone
    g = torch.Generator(device="cuda").manual_seed(4)
    for _ in range(5):
        tok = torch.randint(0, SMALL.vocab, (batch,), device="cuda", generator=g)
        a = eager.step(tok).clone()
        b = graphed.step(tok)
        torch.cuda.synchronize()
        assert torch.equal(a, b)
    assert torch.equal(eager.lens, graphed.lens)
    for i in range(SMALL.layers):
        assert torch.equal(eager.k_cache[i][:, :, :5], graphed.k_cache[i][:, :, :5])


def test_graph_steps_match_the_float64_model():
    model = Model(SMALL, torch.bfloat16, seed=9)
    dec = model.decoder(3, max_len=12)
    dec.capture()
    run_and_check(model, dec, (2, 0, 4), steps=4, seed=3)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(prev=st.lists(st.integers(0, 20), min_size=1, max_size=20),
       spare=st.integers(2, 9), fp16=st.booleans(), seed=st.integers(0, 1000))
def test_fuzz(prev, spare, fp16, seed):
    model = Model(SMALL, torch.float16 if fp16 else torch.bfloat16, seed=seed)
    dec = model.decoder(len(prev), max_len=max(prev) + spare)
    run_and_check(model, dec, tuple(prev), steps=2, seed=seed)
