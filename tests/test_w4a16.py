"""W4A16 fragment order (cutekern.w4a16): the megakernel's weight prepare step, checked
against GPTQ's storage through the bit-level emulation of the kernel's dequant."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cutekern.reference import w4a16_dequantize, w4a16_fragments_dense, w4a16_quantize
from cutekern.w4a16 import fragment_index, prepare_w4a16, w4a16_linear


def _weight(n, k, dtype, seed, group=128):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)).to(dtype)
    return w4a16_quantize(w, group)


def test_fragment_index_is_the_permuted_k_mma_layout():
    """Lane 4 g + q, word 2 h + a: column g + 8 a; nibbles (r, r + 4) (register r of the
    dequant) are k 32 h + 8 q + 2 r and + 1, the two halves of the B register that meets the
    activation vector's word r (kernels/_mma.py's permuted k: lane q's 16-byte vector of a
    32-wide k block is k 8q .. 8q + 7); every (k, n) of a 64 x 16 block exactly once."""
    kk, nn = fragment_index()
    assert kk.shape == nn.shape == (32, 4, 8)
    cells = {(int(a), int(b)) for a, b in zip(kk.flatten(), nn.flatten())}
    assert len(cells) == 64 * 16 and cells == {(a, b) for a in range(64) for b in range(16)}
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for word in range(4):
            h, a = word // 2, word % 2
            for reg in range(4):
                for half, nib in enumerate((reg, reg + 4)):
                    assert kk[lane, word, nib] == 32 * h + 8 * q + 2 * reg + half
                    assert nn[lane, word, nib] == g + 8 * a


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([128, 256, 384, 768]), st.integers(1, 6),
       st.sampled_from([torch.float16, torch.bfloat16]), st.sampled_from([64, 128, 192, 256]),
       st.integers(0, 2 ** 16))
def test_fragment_dequant_equals_gptq_storage(k, n16, dtype, group, seed):
    """Every weight the kernel forms from the fragment order (masks, the exponent constant,
    one HFMA2: code - 8 exactly, then the group's scale) equals GPTQ's storage dequantized
    exactly."""
    if k % group:
        group = 64
    qweight, scales = _weight(16 * n16, k, dtype, seed, group)
    prep = prepare_w4a16(qweight, scales, group)
    assert prep.packed.shape == (n16, k // 64, 32, 4) and prep.packed.dtype == torch.int32
    got = w4a16_fragments_dense(prep.packed, prep.scales, group)
    want = w4a16_dequantize(qweight, scales, group, torch.float64)
    assert got.dtype == torch.float64 and torch.equal(got, want)


def test_fragment_order_mutations_are_caught():
    """Swapping two nibbles of one word (or two lanes) changes the emulated weight."""
    qweight, scales = _weight(32, 256, torch.float16, 5)
    prep = prepare_w4a16(qweight, scales)
    want = w4a16_dequantize(qweight, scales, 128, torch.float64)
    bad = prep.packed.clone()
    bad[0, 0, 3], bad[0, 0, 4] = prep.packed[0, 0, 4], prep.packed[0, 0, 3]
    assert not torch.equal(w4a16_fragments_dense(bad, scales), want)
    w = prep.packed.to(torch.int64) & 0xFFFFFFFF
    swapped = (w & ~0xFF) | ((w & 0xF) << 4) | ((w >> 4) & 0xF)         # nibbles 0 <-> 1
    swapped = torch.where(swapped >= 2 ** 31, swapped - 2 ** 32, swapped).to(torch.int32)
    assert not torch.equal(w4a16_fragments_dense(swapped, scales), want)


@pytest.mark.parametrize("args,exc,name", [
    ((torch.zeros(32, 16, dtype=torch.int64), torch.zeros(2, 16, dtype=torch.float16)), TypeError, "qweight"),
    ((torch.zeros(32, 16, dtype=torch.int32), torch.zeros(2, 16, dtype=torch.float32)), TypeError, "scales"),
    ((torch.zeros(32, 16, dtype=torch.int32), torch.zeros(3, 16, dtype=torch.float16)), ValueError, "scales"),
    ((torch.zeros(32, 24, dtype=torch.int32), torch.zeros(2, 24, dtype=torch.float16)), ValueError, "qweight"),
    ((torch.zeros(20, 16, dtype=torch.int32), torch.zeros(1, 16, dtype=torch.float16)), ValueError, "qweight"),
    ((torch.zeros(32, dtype=torch.int32), torch.zeros(2, 16, dtype=torch.float16)), ValueError, "qweight"),
])
def test_prepare_names_the_bad_argument(args, exc, name):
    with pytest.raises(exc, match=f"'{name}'"):
        prepare_w4a16(*args)
    with pytest.raises(ValueError, match="'group'"):
        prepare_w4a16(torch.zeros(32, 16, dtype=torch.int32), torch.zeros(2, 16, dtype=torch.float16), 24)


def _linear_case():
    qweight, scales = _weight(32, 256, torch.float16, 7)
    return prepare_w4a16(qweight, scales), torch.randn(3, 256).half()


@pytest.mark.parametrize("mutate,exc,name", [
    (lambda p, x: (x.float(), p, None), TypeError, "x"),
    (lambda p, x: (x[:, :128], p, None), ValueError, "x"),
    (lambda p, x: (x, p.packed, None), TypeError, "weight"),
    (lambda p, x: (x, type(p)(p.packed[:1], p.scales, p.k, p.n, p.group), None), ValueError,
     "weight"),
    (lambda p, x: (x, p, torch.empty(3, 31).half()), ValueError, "out"),
    (lambda p, x: (x, p, torch.empty(3, 32)), TypeError, "out"),
    (lambda p, x: (x, p, torch.empty(32, 3).half().t()), ValueError, "out"),
    (lambda p, x: (x, p, None), ValueError, "x"),          # a CPU tensor: must be CUDA
])
def test_linear_names_the_bad_argument(mutate, exc, name):
    p, x = _linear_case()
    xx, pp, out = mutate(p, x)
    with pytest.raises(exc, match=f"'{name}'"):
        w4a16_linear(xx, pp, out=out)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20000), st.sampled_from([1, 2, 4, 8]), st.integers(1, 1200))
def test_balanced_grid_keeps_the_most_rounds_with_the_fewest_ctas(tiles, per_round, ctas):
    from cutekern.w4a16 import balanced_grid
    rounds = -(-tiles // per_round)
    most = -(-rounds // ctas)                  # what the full grid's busiest CTA runs
    g = balanced_grid(tiles, per_round, ctas)
    assert 1 <= g <= min(ctas, rounds)
    assert -(-rounds // g) == most             # no CTA runs more rounds than before
    assert g == 1 or -(-rounds // (g - 1)) > most   # and no smaller grid would do


def test_tile_width_and_k_split_rules():
    from cutekern.w4a16 import ksplit, tile_cols
    # 132 SMs: 16 columns for short N, 32 from 32 x SMs, 64 (rows <= 8) from 2.5 x 64 x SMs
    assert [tile_cols(n, False, 132) for n in (2048, 4096, 4224, 12288, 21119, 21120, 151936)] \
        == [16, 16, 32, 32, 32, 64, 64]
    assert tile_cols(151936, True, 132) == 32
    # the fewest warps per tile (at least 2) that keep the grid's warps busy
    assert ksplit(151936, 64, 396 * 4, 4) == 2
    assert ksplit(32768, 64, 396 * 4, 4) == 4
    assert ksplit(2048, 16, 264 * 8, 8) == 8


@pytest.mark.parametrize("rows16", [False, True])
@pytest.mark.parametrize("cols", [16, 32, 64])
def test_launch_path_knows_each_builds_shared_memory(rows16, cols):
    """The launch path's CTA count reads shared memory per CTA off the exported config
    without the DSL: its formula must be the kernel's, for every build and for configs
    other than the default."""
    pytest.importorskip("cutlass")
    import dataclasses
    from kernels.ada.w4a16_gemm import W4a16GemmAdaConfig, build_shape, smem_bytes
    from cutekern.w4a16 import cta_smem, resident_ctas
    if rows16 and cols == 64:
        pytest.skip("no 64-column rows-16 build")
    for cfg in (W4a16GemmAdaConfig(), W4a16GemmAdaConfig(stages=3, stages16=2, wide_stages=5,
                                                          wide_stages16=3, wide64_stages=3)):
        d = dataclasses.asdict(cfg)
        assert cta_smem(d, rows16, cols) == smem_bytes(build_shape(cfg, rows16, cols))
    d = dataclasses.asdict(W4a16GemmAdaConfig())
    # the H200 (228 KB per SM) holds the configured count; sm_89 (100 KB) one wide CTA
    assert resident_ctas(d, rows16, cols, 233472) == d["ctas_per_sm" if cols == 16
                                                      else "wide_ctas_per_sm"]
    assert resident_ctas(d, rows16, cols, 102400) == (1 if cta_smem(d, rows16, cols) > 50 * 1024
                                                      else 2)


# ---------------------------------------------------------------------------- the MLP block
def _mlp_weights(k=256, f=128, d=64, dtype=torch.float16, group=128):
    return [prepare_w4a16(*_weight(n, kk, dtype, seed), group)
            for seed, (kk, n) in enumerate(((k, f), (k, f), (f, d)))]


def test_mlp_gate_and_up_blocks_alternate():
    """Tile t of the first phase holds gate columns 16t.. (block 2t) and up columns 16t..
    (block 2t + 1), codes and scales alike: the dequantized interleave equals the two
    weights' columns in that order."""
    from cutekern.reference import w4a16_fragments_dense
    from cutekern.w4a16 import prepare_w4a16_mlp
    gate, up, down = _mlp_weights()
    mlp = prepare_w4a16_mlp(gate, up, down)
    assert (mlp.k, mlp.f, mlp.d) == (256, 128, 64)
    assert torch.equal(mlp.packed_gu[0::2], gate.packed)
    assert torch.equal(mlp.packed_gu[1::2], up.packed)
    dense = w4a16_fragments_dense(mlp.packed_gu, mlp.scales_gu)          # [2F, K]
    want = torch.stack([w4a16_fragments_dense(gate.packed, gate.scales).reshape(8, 16, 256),
                        w4a16_fragments_dense(up.packed, up.scales).reshape(8, 16, 256)],
                       1).reshape(256, 256)
    assert torch.equal(dense, want)
    assert mlp.sync.dtype == torch.int32 and int(mlp.sync.abs().sum()) == 0


def test_mlp_prepare_names_the_bad_argument():
    from cutekern.w4a16 import prepare_w4a16_mlp
    gate, up, down = _mlp_weights()
    other = _mlp_weights(k=512)[0]
    cases = [((gate.packed, up, down), TypeError, "gate"),
             ((gate, other, down), ValueError, "up"),
             ((gate, up, gate), ValueError, "down"),
             ((gate, up, _mlp_weights(dtype=torch.bfloat16)[2]), ValueError, "down")]
    for args, exc, name in cases:
        with pytest.raises(exc, match=f"'{name}'"):
            prepare_w4a16_mlp(*args)


def test_mlp_names_the_bad_argument():
    from cutekern.w4a16 import prepare_w4a16_mlp, w4a16_mlp
    mlp = prepare_w4a16_mlp(*_mlp_weights())
    x = torch.randn(3, 256).half()
    cases = [((x.float(), mlp), {}, TypeError, "x"),
             ((x[:, :128], mlp), {}, ValueError, "x"),
             ((x, mlp.down), {}, TypeError, "mlp"),
             ((x, mlp), {}, ValueError, "x"),                         # CPU: must be CUDA
             ((x, mlp), {"out": torch.empty(3, 63).half()}, ValueError, "out"),
             ((x, mlp), {"h": torch.empty(3, 128)}, TypeError, "h")]
    for args, kw, exc, name in cases:
        with pytest.raises(exc, match=f"'{name}'"):
            w4a16_mlp(*args, **kw)


@pytest.mark.parametrize("rows16", [False, True])
def test_mlp_launch_is_one_resident_wave(rows16):
    """Every CTA of an MLP launch waits for all the others, so the grid the launch path picks
    must fit at once: the launch path's shared memory per CTA is the kernel's, and the grid is
    at most SMs x (configured CTAs per SM, or what the device's shared memory holds)."""
    pytest.importorskip("cutlass")
    import dataclasses
    from kernels.ada.w4a16_gemm import smem_bytes
    from kernels.ada.w4a16_mlp import W4a16MlpAdaConfig, phase_shapes
    from cutekern.w4a16 import mlp_cta_smem, mlp_launch
    for cfg in (W4a16MlpAdaConfig(), W4a16MlpAdaConfig(warps=4, stages=6, stages16=4, ctas_per_sm=3)):
        d = dataclasses.asdict(cfg)
        assert mlp_cta_smem(d, rows16) == smem_bytes(phase_shapes(cfg, rows16)[0])
        for sms, smem in ((132, 233472), (128, 102400), (46, 102400)):
            per_sm = min(d["ctas_per_sm"], smem // (mlp_cta_smem(d, rows16) + 1024))
            for f, dd in ((6144, 2048), (64, 16), (1088, 272)):
                grid, ks_gu, ks_d = mlp_launch(f, dd, d, rows16, sms, smem)
                assert 1 <= grid <= sms * per_sm
                assert ks_gu in (2, 4, 8) and ks_d in (2, 4, 8) and ks_gu <= d["warps"]
    # Qwen3-1.7B on the H200: 384 gate / up tiles of 8 warps each on 2 x 132 CTAs (two
    # rounds each on 192 CTAs), then 128 down tiles of 8 warps each
    assert mlp_launch(6144, 2048, dataclasses.asdict(W4a16MlpAdaConfig()), False, 132,
                      233472) == (192, 8, 8)
