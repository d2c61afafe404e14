"""CPU checks of the AttnRes and BGMV MoE references (against explicit loops) and of the
argument validation of their APIs (errors name the argument; CPU tensors are refused only
after every metadata check passed)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cutekern.attn_res import attn_res, prepare_attn_res
from cutekern.bgmv_moe import bgmv_moe_expand, bgmv_moe_shrink, prepare_bgmv_moe
from cutekern.reference import (attn_res_reference, attn_res_torch, bgmv_expand_reference,
                                bgmv_shrink_reference, bgmv_torch)

BF16 = torch.bfloat16


def ar_inputs(m=3, nb=4, h=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(BF16)  # noqa: E731
    return r(m, h), r(m, h), r(m, nb, h), (1 + 0.3 * torch.randn(h, generator=g)).to(BF16), \
        (0.1 * torch.randn(h, generator=g)).to(BF16), (1 + 0.3 * torch.randn(h, generator=g)).to(BF16)


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 5), nb=st.integers(1, 8), data=st.data(), delta=st.booleans(),
       onorm=st.booleans(), seed=st.integers(0, 1000))
def test_attn_res_reference_matches_a_loop(m, nb, data, delta, onorm, seed):
    k = data.draw(st.integers(0, nb))
    w = data.draw(st.integers(-1, nb - 1))
    prefix, d, blocks, nw, qw, onw = ar_inputs(m, nb, 32, seed)
    d = d if delta else None
    onw = onw if onorm else None
    p, bl, out = attn_res_reference(prefix, d, blocks, nw, qw, onw, k, w, 1e-5, 1e-5)
    for i in range(m):
        pi = prefix[i] if d is None else (prefix[i].float() + d[i].float()).to(BF16)
        assert torch.equal(p[i], pi)
        slots = [blocks[i, j] for j in range(nb)]
        if w >= 0:
            slots[w] = pi
        assert all(torch.equal(bl[i, j], slots[j]) for j in range(nb))
        srcs = [s.double() for s in slots[:k]] + [pi.double()]
        scores = torch.stack([(c / torch.sqrt((c * c).mean() + 1e-5) * nw.double() * qw.double()).sum()
                              for c in srcs])
        mix = sum(a * c for a, c in zip(torch.softmax(scores, 0), srcs))
        if onw is not None:
            mix = mix / torch.sqrt((mix * mix).mean() + 1e-5) * onw.double()
        torch.testing.assert_close(out[i].double(), mix, rtol=1e-4, atol=1e-4)


def test_attn_res_torch_route_matches_reference():
    prefix, d, blocks, nw, qw, onw = ar_inputs(4, 8, 128, 1)
    p_ref, b_ref, o_ref = attn_res_reference(prefix, d, blocks, nw, qw, onw, 8, -1)
    p2, b2 = prefix.clone(), blocks.clone()
    out = attn_res_torch(p2, d, b2, nw, qw, onw, 8, -1)
    assert torch.equal(p2, p_ref) and torch.equal(b2, b_ref)
    torch.testing.assert_close(out.float(), o_ref, rtol=2e-2, atol=2e-2)


def test_attn_res_validation_names_the_argument():
    prefix, d, blocks, nw, qw, onw = ar_inputs(4, 2, 64)
    out = torch.empty_like(prefix)
    call = lambda **kw: prepare_attn_res(**{**dict(  # noqa: E731
        prefix=prefix, delta=d, blocks=blocks, norm_weight=nw, qk_weight=qw,
        output_norm_weight=onw, out=out, num_blocks=2), **kw})
    with pytest.raises(TypeError, match="'delta' must be bfloat16"):
        call(delta=d.float())
    with pytest.raises(ValueError, match="'blocks' must have shape"):
        call(blocks=blocks[:3])
    with pytest.raises(ValueError, match="'blocks' must have 1..8 slots"):
        call(blocks=torch.zeros(4, 9, 64, dtype=BF16))
    with pytest.raises(ValueError, match="'num_blocks'"):
        call(num_blocks=3)
    with pytest.raises(ValueError, match="'block_write_idx'"):
        call(block_write_idx=2)
    with pytest.raises(ValueError, match="'prefix' hidden size H=60"):
        prepare_attn_res(prefix[:, :60], None, blocks[..., :60], nw[:60], qw[:60], None,
                         out[:, :60], num_blocks=0)
    with pytest.raises(ValueError, match="over the supported maximum"):
        z = torch.zeros(1, 16392, dtype=BF16)
        prepare_attn_res(z, None, z.view(1, 1, -1), z[0], z[0], None, z.clone(), num_blocks=0)
    with pytest.raises(ValueError, match="'qk_weight' must have shape"):
        call(qk_weight=qw[:32])
    with pytest.raises(ValueError, match="'out' stride"):
        call(out=torch.empty(4, 68, dtype=BF16)[:, :64])
    with pytest.raises(ValueError, match="'out' overlaps 'delta'"):
        call(out=d)
    with pytest.raises(ValueError, match="'eps'"):
        call(eps=-1.0)
    with pytest.raises(ValueError, match="'prefix' must be on a CUDA device"):
        call()
    with pytest.raises(ValueError, match="'prefix' must be on a CUDA device"):
        attn_res(prefix, d, blocks, nw, qw, num_blocks=1)


def bg_inputs(t=5, k=3, h=32, n=24, r=8, num_l=3, num_e=6, seed=0, dtype=BF16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    a = torch.randn(num_l, num_e, r, h, generator=g).to(dtype)
    b = torch.randn(num_l, num_e, n, r, generator=g).to(dtype)
    ids = torch.randint(0, num_e, (t, k), generator=g, dtype=torch.int32)
    w = torch.rand(t, k, generator=g)
    lora = torch.randint(-1, num_l, (t,), generator=g, dtype=torch.int32)
    return x, a, b, ids, w, lora


def test_bgmv_references_match_loops():
    x, a, b, ids, w, lora = bg_inputs()
    t, k = ids.shape
    s = bgmv_shrink_reference(x, a, ids, lora)
    y = bgmv_expand_reference(s, b, ids, lora, w)
    yp = bgmv_expand_reference(s, b, ids, lora)
    for ti in range(t):
        acc = torch.zeros(b.shape[2], dtype=torch.float64)
        for j in range(k):
            p = ti * k + j
            if lora[ti] < 0:
                assert (s[p] == 0).all() and (yp[p] == 0).all()
                continue
            sp = a[lora[ti], ids[ti, j]].double() @ x[ti].double()
            torch.testing.assert_close(s[p].double(), sp, rtol=1e-6, atol=1e-6)
            dp = b[lora[ti], ids[ti, j]].double() @ s[p].double()
            torch.testing.assert_close(yp[p].double(), dp, rtol=1e-5, atol=1e-5)
            acc += w[ti, j].double() * dp
        torch.testing.assert_close(y[ti].double(), acc, rtol=1e-5, atol=1e-5)
    # the torch route computes the same thing in the input dtype
    torch.testing.assert_close(bgmv_torch(x.float(), a.float(), b.float(), ids, w, lora), y,
                               rtol=1e-3, atol=1e-3)


def test_bgmv_validation_names_the_argument():
    x, a, b, ids, w, lora = bg_inputs(r=16)
    call = lambda **kw: prepare_bgmv_moe(**{**dict(  # noqa: E731
        x=x, lora_a=a, lora_b=b, topk_ids=ids, topk_weights=w, lora_indices=lora), **kw})
    with pytest.raises(TypeError, match="'lora_a' must be"):
        call(lora_a=a.half())
    with pytest.raises(ValueError, match="'lora_a' must be \\[L, E, r, H\\]"):
        call(lora_a=a[..., :16])
    with pytest.raises(ValueError, match="'lora_a' rank 12"):
        call(lora_a=torch.zeros(3, 6, 12, 32, dtype=BF16), lora_b=torch.zeros(3, 6, 24, 12, dtype=BF16))
    with pytest.raises(ValueError, match="'lora_b' must be \\[L=3"):
        call(lora_b=b[:2])
    with pytest.raises(TypeError, match="'topk_ids' must be torch.int32"):
        call(topk_ids=ids.long())
    with pytest.raises(ValueError, match="'topk_ids' top-k 9"):
        call(topk_ids=torch.zeros(5, 9, dtype=torch.int32), topk_weights=torch.zeros(5, 9))
    with pytest.raises(ValueError, match="'topk_weights' must have the shape"):
        call(topk_weights=w[:, :2].contiguous())
    with pytest.raises(ValueError, match="'lora_indices' must have T=5"):
        call(lora_indices=lora[:4])
    with pytest.raises(ValueError, match="'x' must be contiguous"):
        call(x=torch.zeros(5, 64, dtype=BF16)[:, ::2])
    with pytest.raises(ValueError, match="'out' must have shape"):
        call(out=torch.zeros(5, 23))
    with pytest.raises(ValueError, match="'x' must be on a CUDA device"):
        call()
    with pytest.raises(ValueError, match="'topk_weights' is required"):
        bgmv_moe_expand(torch.zeros(15, 16, dtype=BF16), b, ids, lora)
    with pytest.raises(ValueError, match="'s' must have shape"):
        bgmv_moe_expand(torch.zeros(14, 16, dtype=BF16), b, ids, lora, w)
    with pytest.raises(ValueError, match="'x' must be on a CUDA device"):
        bgmv_moe_shrink(x, a, ids, lora)
    # one (adapter, expert) slab must fit int32 offsets (sm90 bin kernels); meta tensors: no
    # memory, and the shape checks come before the device check
    big = dict(device="meta", dtype=BF16)
    with pytest.raises(ValueError, match="'lora_a' one adapter/expert slab"):
        bgmv_moe_shrink(torch.empty(5, 2 ** 26, **big), torch.empty(1, 1, 32, 2 ** 26, **big),
                        ids, lora)
    with pytest.raises(ValueError, match="'lora_b' one adapter/expert slab"):
        bgmv_moe_expand(torch.empty(15, 32, **big), torch.empty(3, 6, 2 ** 26, 32, **big),
                        ids.to("meta"), lora.to("meta"), w.to("meta"))


def test_attn_res_kernel_choice(monkeypatch):
    """sm_90a: the cluster-split sm90 kernel for small M (split 8 up to 12 rows, 4 up to 28,
    2 up to 64), the sm90 kernel from M = 128, in its online-schedule build for rows of at most
    one block source and for launches of at most 2048 loads (M * (K + 2)), hidden tier 8192;
    the Ada-design kernel for K <= 1 from M = 8192; a design forced by $CUTEKERN_DESIGN is
    kept; the Ada design splits small M by its own rule (split 8 up to 16 rows, 4 up to 32,
    2 up to 64: its split builds exchange through global memory, no clusters) and the sm100
    design by the sm90 rule, where each has the build (not the 16384 tier over 2 CTAs); other
    arches keep their design."""
    from cutekern.attn_res import choose_kernel
    monkeypatch.delenv("CUTEKERN_DESIGN", raising=False)
    monkeypatch.delenv("CUTEKERN_ATTN_RES_SPLIT", raising=False)
    sm90 = lambda h, r, o=False: ("sm90", {"max_hidden": h, "row_split": r, "online": o})  # noqa: E731
    assert choose_kernel(1, 7168, "sm_90a", "sm90") == sm90(8192, 8)
    assert choose_kernel(12, 7168, "sm_90a", "sm90")[1]["row_split"] == 8
    assert choose_kernel(13, 7168, "sm_90a", "sm90")[1]["row_split"] == 4
    assert choose_kernel(16, 7168, "sm_90a", "sm90")[1]["row_split"] == 4
    assert choose_kernel(28, 7168, "sm_90a", "sm90")[1]["row_split"] == 4
    assert choose_kernel(29, 7168, "sm_90a", "sm90")[1]["row_split"] == 2
    assert choose_kernel(64, 7168, "sm_90a", "sm90", 1) == sm90(8192, 2)
    assert choose_kernel(128, 7168, "sm_90a", "sm90", 8) == sm90(8192, 1, True)
    assert choose_kernel(204, 7168, "sm_90a", "sm90", 8) == sm90(8192, 1, True)
    assert choose_kernel(205, 7168, "sm_90a", "sm90", 8) == sm90(8192, 1)
    assert choose_kernel(1024, 7168, "sm_90a", "sm90") == sm90(8192, 1)
    assert choose_kernel(341, 7168, "sm_90a", "sm90", 4) == sm90(8192, 1, True)
    assert choose_kernel(512, 7168, "sm_90a", "sm90", 4) == sm90(8192, 1)
    assert choose_kernel(4096, 7168, "sm_90a", "sm90", 1) == sm90(8192, 1, True)
    assert choose_kernel(8191, 7168, "sm_90a", "sm90", 0) == sm90(8192, 1, True)
    assert choose_kernel(8192, 7168, "sm_90a", "sm90", 1) == ("ada", {"max_hidden": 8192, "row_split": 1})
    assert choose_kernel(8192, 7168, "sm_90a", "sm90", 2) == sm90(8192, 1)
    assert choose_kernel(128, 12344, "sm_90a", "sm90", 1) == sm90(16384, 1)
    assert choose_kernel(4096, 12344, "sm_90a", "sm90") == sm90(16384, 1)
    ada = lambda h, r: ("ada", {"max_hidden": h, "row_split": r})  # noqa: E731
    assert choose_kernel(1, 7168, "sm_89", "ada") == ada(8192, 8)
    assert choose_kernel(16, 7168, "sm_80", "ada") == ada(8192, 8)
    assert choose_kernel(17, 7168, "sm_80", "ada") == ada(8192, 4)
    assert choose_kernel(32, 7168, "sm_89", "ada") == ada(8192, 4)
    assert choose_kernel(33, 7168, "sm_89", "ada") == ada(8192, 2)
    assert choose_kernel(64, 7168, "sm_89", "ada") == ada(8192, 2)
    assert choose_kernel(65, 7168, "sm_89", "ada") == ada(8192, 1)
    assert choose_kernel(32, 12344, "sm_89", "ada") == ada(16384, 4)
    assert choose_kernel(33, 12344, "sm_89", "ada") == ada(16384, 1)
    sm100 = lambda h, r: ("sm100", {"max_hidden": h, "row_split": r})  # noqa: E731
    assert choose_kernel(1, 7168, "sm_100a", "sm100") == sm100(8192, 8)
    assert choose_kernel(20, 7168, "sm_103a", "sm100") == sm100(8192, 4)
    assert choose_kernel(64, 7168, "sm_100a", "sm100") == sm100(8192, 2)
    assert choose_kernel(64, 12344, "sm_100a", "sm100") == sm100(16384, 1)
    assert choose_kernel(128, 7168, "sm_100a", "sm100") == sm100(8192, 1)
    assert choose_kernel(300, 7168, "sm_90a", "ada") == ada(8192, 1)
    assert choose_kernel(1, 7168, "sm_90a", "ada") == ada(8192, 8)
    assert choose_kernel(4096, 7168, "sm_100a", "sm100", 1)[0] == "sm100"
    monkeypatch.setenv("CUTEKERN_DESIGN", "sm90")  # a forced design is kept (batched at this M)
    assert choose_kernel(8192, 7168, "sm_90a", "sm90", 1) == sm90(8192, 1)


def test_bgmv_sm90_config_bounds():
    """The sm90 BGMV configs reject shapes the kernels cannot run: segments of whole
    32-element k blocks, ring rows of whole groups of 8 vectors (the parity swizzle), the
    shared-memory limit."""
    import cutlass
    from kernels.sm90.bgmv_expand import BgmvExpandSm90, BgmvExpandSm90Config as EC
    from kernels.sm90.bgmv_shrink import BgmvShrinkSm90, BgmvShrinkSm90Config as C
    bf = cutlass.BFloat16
    ok = BgmvShrinkSm90.can_implement
    assert ok(bf, C()) and BgmvExpandSm90.can_implement(bf, EC())
    assert ok(bf, C(seg_h=256, bin_chunk_h=192))        # a segment may end inside a stage
    assert not ok(bf, C(bin_chunk_h=32))                # < 8 vectors per row
    assert not ok(bf, C(bin_chunk_h=96))                # 12 vectors: the swizzle leaves the row
    assert not ok(bf, C(seg_h=48))                      # not whole k blocks
    assert not ok(bf, C(bin_stages=8, bin_chunk_h=256))  # shared memory
    assert not ok(cutlass.Float32, C())
    assert not BgmvExpandSm90.can_implement(bf, EC(bin_cols=100))
