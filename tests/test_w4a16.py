"""W4A16 fragment order (cutekern.w4a16): the megakernel's weight prepare step, checked
against GPTQ's storage through the bit-level emulation of the kernel's dequant."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cutekern.reference import w4a16_dequantize, w4a16_fragments_dense, w4a16_quantize
from cutekern.w4a16 import fragment_index, prepare_w4a16


def _weight(n, k, dtype, seed, group=128):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)).to(dtype)
    return w4a16_quantize(w, group)


def test_fragment_index_is_the_mma_b_layout():
    """Lane 4 g + t, nibble i: PTX's m16n8k16 B fragment (row 2t + (i & 1) + 8 (i >= 2) of
    the first n8 atom for registers 0, 1, the second atom for 2, 3), every (k, n) of a 16 x 16
    tile exactly once."""
    kk, nn = fragment_index()
    cells = {(int(a), int(b)) for a, b in zip(kk.flatten(), nn.flatten())}
    assert len(cells) == 256 and cells == {(a, b) for a in range(16) for b in range(16)}
    for lane in range(32):
        t, g = lane % 4, lane // 4
        for reg in range(4):
            for half, nib in enumerate((reg, reg + 4)):        # register r: nibbles r, r + 4
                e = 2 * (reg % 2) + half                         # element of the n8 atom's b0..b3
                assert kk[lane, nib] == 2 * t + (e & 1) + 8 * (e >= 2)
                assert nn[lane, nib] == g + 8 * (reg // 2)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([128, 256, 384]), st.integers(1, 6), st.sampled_from([torch.float16, torch.bfloat16]),
       st.sampled_from([32, 64, 128]), st.integers(0, 2 ** 16))
def test_fragment_dequant_equals_gptq_storage(k, n16, dtype, group, seed):
    """Every weight element the kernel forms from the fragment order (masks, the exponent
    constant, one subtract / FMA, the scale in the 16-bit type) equals GPTQ's storage
    dequantized exactly and rounded once to that type."""
    if k % group:
        group = 32
    qweight, scales = _weight(16 * n16, k, dtype, seed, group)
    prep = prepare_w4a16(qweight, scales, group)
    assert prep.packed.shape == (n16, k // 16, 32) and prep.packed.dtype == torch.int32
    got = w4a16_fragments_dense(prep.packed, prep.scales, group)
    want = w4a16_dequantize(qweight, scales, group, torch.float64).to(dtype)
    assert got.dtype == dtype and torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_fragment_order_mutations_are_caught():
    """Swapping two nibbles of one word (or two lanes) changes the emulated weight."""
    qweight, scales = _weight(32, 256, torch.float16, 5)
    prep = prepare_w4a16(qweight, scales)
    want = w4a16_dequantize(qweight, scales, 128, torch.float64).to(torch.float16)
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
