"""Decode attention on the GPU (the Ada design, built for sm_90a on an H100 / H200) against the
float64 reference (reference.decode_attention_reference, itself checked against
qwen3_forward's decoder step on the CPU). Every output element is compared (NaN fails), the
appended k (within a rounding of the fp32 value) and v (bit for bit), every other cache
element unchanged bit for bit; fresh random inputs, poisoned outputs, ragged lengths
(0, 1, S - 1, off multiples of the CTA's 32 positions per step), GQA groups 1..8 (odd ones
split a CTA's head pair), rows outside the cache (NaN out, cache untouched), repeat and
batch invariance, the positions split over several CTAs (1..16 splits, partials exchanged
through words that must be zero again after every launch), CUDA-graph replay with new
contents, torch.compile, a hypothesis fuzz."""
import pytest
import torch

import cutekern.decode as dec
from hypothesis import HealthCheck, given, settings, strategies as st

from cutekern.arch import target_arch
from cutekern.decode import HEAD_DIM, decode_attention, rope_table
from cutekern.reference import decode_attention_reference
from cutekern.registry import OPS

pytestmark = pytest.mark.skipif("ada" not in OPS["decode_attn"].designs_on(target_arch()),
                                reason="no decode attention kernels for this arch")

DTYPES = (torch.float16, torch.bfloat16)
# out: fp32 inside, one rounding at the end, plus the appended k's rounding in one score
TOL = {torch.float16: 4e-3, torch.bfloat16: 2.4e-2}


@pytest.fixture(params=[None, 1, 3, 16])
def splits(request, monkeypatch):
    """None: the API's pick; else forced (still at most one CTA per SM in all)."""
    monkeypatch.setattr(dec, "SPLITS_OVERRIDE", request.param)
    return request.param


def xch_clear():
    """Split 0 leaves every exchange word it read at zero (the next launch relies on it)."""
    torch.cuda.synchronize()
    for buf in dec._XCH.values():
        assert int(buf.abs().sum()) == 0


class Case:
    def __init__(self, b, hq, hkv, s, lens, dtype, seed=0, rope_len=None):
        g = torch.Generator(device="cuda").manual_seed(seed)
        rnd = lambda *sh: torch.randn(*sh, device="cuda", generator=g)         # noqa: E731
        self.dtype, self.hq, self.hkv = dtype, hq, hkv
        self.qkv = (rnd(b, (hq + 2 * hkv) * HEAD_DIM) * 2).to(dtype)
        self.kc = rnd(b, hkv, s, HEAD_DIM).to(dtype)
        self.vc = rnd(b, hkv, s, HEAD_DIM).to(dtype)
        self.qn = (1 + 0.2 * rnd(HEAD_DIM)).to(dtype)
        self.kn = (1 + 0.2 * rnd(HEAD_DIM)).to(dtype)
        self.lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        self.rope = rope_table(rope_len or s, device="cuda")
        self.kc0, self.vc0 = self.kc.clone(), self.vc.clone()

    def run(self, out=None):
        if out is None:
            out = torch.full((self.qkv.shape[0], self.hq * HEAD_DIM), 7777.0, dtype=self.dtype,
                             device="cuda")                                # poison
        return decode_attention(self.qkv, self.kc, self.vc, self.lens, self.qn, self.kn,
                                self.rope, out=out)

    def check(self, out):
        xch_clear()
        ref, k_new, v_new = decode_attention_reference(self.qkv, self.kc0, self.vc0,
                                                       self.lens.cpu(), self.qn, self.kn)
        s = self.kc.shape[2]
        p_max = self.rope.shape[0]
        lens = self.lens.tolist()
        for b, p in enumerate(lens):
            keep = torch.ones(s, dtype=torch.bool, device="cuda")     # positions not written
            if 0 <= p < min(s, p_max):
                o, r = out[b].double(), ref[b]
                assert not o.isnan().any(), f"row {b}: NaN"
                err = ((o - r).abs() / (1 + r.abs())).max().item()
                assert err < TOL[self.dtype], f"row {b} (len {p}): error {err}"
                kd = self.kc[b, :, p].double()
                assert ((kd - k_new[b]).abs() / (1 + k_new[b].abs())).max() < TOL[self.dtype] / 2
                assert torch.equal(self.vc[b, :, p], v_new[b].to(self.dtype))
                keep[p] = False
            else:
                assert out[b].isnan().all(), f"row {b} (len {p} outside the cache): not NaN"
            assert torch.equal(self.kc[b][:, keep], self.kc0[b][:, keep]), f"row {b}: k cache"
            assert torch.equal(self.vc[b][:, keep], self.vc0[b][:, keep]), f"row {b}: v cache"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b", [1, 3, 16])
def test_qwen3_heads(dtype, b, splits):
    """Qwen3-1.7B's heads (16 q / 8 KV), ragged lengths incl. 0 and S - 1."""
    s = 200
    lens = [(37 * i + 5) % s for i in range(b)]
    if b >= 3:
        lens[0], lens[1] = 0, s - 1
    c = Case(b, 16, 8, s, lens, dtype, seed=b)
    c.check(c.run())


@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2), (12, 4), (8, 1), (16, 2), (5, 5)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_groups(hq, hkv, dtype, splits):
    """GQA groups 1..8 (group 3: a CTA with one head; group 1: a pair spanning two KV heads
    would be wrong)."""
    lens = [0, 1, 31, 32, 33, 64, 95]
    c = Case(len(lens), hq, hkv, 97, lens, dtype, seed=hq * 10 + hkv)
    c.check(c.run())


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_context(dtype, splits):
    lens = [4095, 2049, 3000]
    c = Case(3, 16, 8, 4096, lens, dtype, seed=5)
    c.check(c.run())


def test_rows_outside_the_cache_get_nan(splits):
    lens = [5, -1, 40, 41, 1 << 30, 0]
    c = Case(len(lens), 4, 2, 41, lens, torch.bfloat16, seed=7)
    c.check(c.run())
    # a RoPE table shorter than the cache bounds the positions too
    c = Case(3, 4, 2, 64, [9, 10, 63], torch.float16, seed=8, rope_len=10)
    c.check(c.run())


def test_one_cached_position_and_none():
    for p, seed in ((0, 1), (1, 2)):
        c = Case(1, 2, 1, 1 + p, [p], torch.bfloat16, seed=seed)
        c.check(c.run())
    # no cached positions: out is v itself (softmax over one position)
    c = Case(2, 2, 2, 8, [0, 0], torch.float16, seed=3)
    out = c.run()
    v = c.qkv.view(2, 6, HEAD_DIM)[:, 4:].reshape(2, -1)
    assert torch.equal(out, v)


def test_deterministic_and_batch_invariant(monkeypatch):
    """Bit for bit across runs; across batches at the same split count (the split count
    follows the launch's CTA count, and a different count sums in another order)."""
    monkeypatch.setattr(dec, "SPLITS_OVERRIDE", 1)
    c = Case(9, 16, 8, 300, [3, 299, 150, 0, 77, 200, 1, 64, 128], torch.bfloat16, seed=11)
    first = c.run()
    for _ in range(20):
        assert torch.equal(c.run(), first)
    for b in (0, 4, 8):
        one = decode_attention(c.qkv[b:b + 1], c.kc[b:b + 1], c.vc[b:b + 1], c.lens[b:b + 1],
                               c.qn, c.kn, c.rope)
        assert torch.equal(one[0], first[b])


def test_splits_agree():
    """The same step with 1, 2, 5 and 16 splits: equal within fp32 rounding (different
    summation orders), each deterministic."""
    outs = []
    for n in (1, 2, 5, 16):
        dec.SPLITS_OVERRIDE = n
        try:
            c = Case(2, 4, 2, 3000, [2999, 1500], torch.bfloat16, seed=19)
            a, b2 = c.run(), c.run()
        finally:
            dec.SPLITS_OVERRIDE = None
        assert torch.equal(a, b2)
        c.check(a)
        outs.append(a.float())
    for o in outs[1:]:
        assert (o - outs[0]).abs().max() <= 2 ** -7 * (1 + outs[0].abs().max())


def test_cuda_graph_replay_with_new_contents(splits):
    c = Case(4, 16, 8, 128, [10, 20, 30, 40], torch.bfloat16, seed=13)
    out = torch.empty(4, 16 * HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    c.run(out)                                    # warm: compile / load outside the capture
    c.kc.copy_(c.kc0)
    c.vc.copy_(c.vc0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        c.run(out)
    for step in range(3):
        c.qkv.copy_(torch.randn_like(c.qkv, dtype=torch.float32).to(c.qkv.dtype))
        c.lens.copy_(torch.tensor([10 + step, 127, 0, 40 - step], dtype=torch.int32))
        c.kc0, c.vc0 = c.kc.clone(), c.vc.clone()
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        c.check(out)
    del g
    torch.cuda.synchronize()


def test_torch_compile():
    c = Case(3, 8, 2, 50, [4, 49, 0], torch.float16, seed=17)

    @torch.compile(fullgraph=True)
    def step(qkv, kc, vc, lens):
        return decode_attention(qkv, kc, vc, lens, c.qn, c.kn, c.rope) * 1.0

    out = step(c.qkv, c.kc, c.vc, c.lens)
    c.check(out)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(b=st.integers(1, 20), hkv=st.integers(1, 4), group=st.integers(1, 5),
       s=st.integers(1, 300), dt=st.sampled_from(DTYPES), seed=st.integers(0, 2 ** 16),
       data=st.data())
def test_fuzz(b, hkv, group, s, dt, seed, data):
    lens = data.draw(st.lists(st.one_of(st.integers(0, s - 1), st.integers(-3, s + 3)),
                              min_size=b, max_size=b))
    splits = data.draw(st.sampled_from([None, 1, 2, 7]))
    try:
        dec.SPLITS_OVERRIDE = splits
        c = Case(b, hkv * group, hkv, s, lens, dt, seed=seed)
        c.check(c.run())
    finally:
        dec.SPLITS_OVERRIDE = None
