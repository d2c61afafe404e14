"""The runtime's flat argument buffer must hold exactly what the exported host stub reads:
for each ABI slot, a pointer to the tensor struct {void*; int32 shapes[r]; int64
strides[r-1]} (ctypes layout), the int32 / float32 scalar, or the stream handle."""
import ctypes
import struct

import pytest
import torch

from cutekern.runtime import KernelFunction, _Layout, tensor_struct

ABI = [
    {"kind": "tensor", "name": "a", "rank": 3, "dtype": "float16", "align": 8},
    {"kind": "scalar", "name": "n", "dtype": "int32"},
    {"kind": "tensor", "name": "b", "rank": 1, "dtype": "int32", "align": 1},
    {"kind": "scalar", "name": "eps", "dtype": "float32"},
    {"kind": "tensor", "name": "c", "rank": 2, "dtype": "float32", "align": 4},
    {"kind": "tensor", "name": "d", "rank": 5, "dtype": "bfloat16", "align": 8},
    {"kind": "stream", "name": "stream"},
    {"kind": "tensor", "name": "e", "rank": 4, "dtype": "float16", "align": 8},
]


def _fake_function(abi):
    """A KernelFunction without a loaded module: packing only."""
    fn = KernelFunction.__new__(KernelFunction)
    fn._init_abi({"op": "t", "design": "d", "arch": "sm_90a", "prefix": "t", "abi": abi})
    return fn


def test_packed_slots_match_the_ctypes_structs():
    torch.manual_seed(0)
    ts = {"a": torch.empty(5, 7, 16, dtype=torch.float16),
          "b": torch.empty(9, dtype=torch.int32),
          "c": torch.empty(6, 24, dtype=torch.float32)[:, :16],
          "d": torch.empty(2, 3, 4, 5, 8, dtype=torch.bfloat16),
          "e": torch.empty(3, 1, 2, 8, dtype=torch.float16)}
    scal = {"n": -123456, "eps": 1.5e-5}
    fn = _fake_function(ABI)
    args = [ts[s["name"]] if s["kind"] == "tensor" else scal[s["name"]] for s in fn._arg_specs]
    dims = [(list(a.shape), list(a.stride())) if isinstance(a, torch.Tensor) else None for a in args]
    buf, ptrs, ret = fn._layout.buffer()
    fn._pack_into(buf, args, dims, 0xDEADBEEF1234)
    assert len(ptrs) == len(ABI) + 1
    for j, spec in enumerate(ABI):
        addr = ptrs[j]
        if spec["kind"] == "stream":
            assert ctypes.c_uint64.from_address(addr).value == 0xDEADBEEF1234
        elif spec["kind"] == "scalar":
            ct = ctypes.c_int32 if spec["dtype"] == "int32" else ctypes.c_float
            assert ct.from_address(addr).value == pytest.approx(scal[spec["name"]], rel=1e-7)
        else:
            t = ts[spec["name"]]
            st = tensor_struct(spec["rank"]).from_address(addr)
            assert st.data == t.data_ptr()
            assert list(st.dynamic_shapes) == list(t.shape)
            if spec["rank"] > 1:
                assert list(st.dynamic_strides) == list(t.stride())[:-1]
    assert ptrs[len(ABI)] == ctypes.addressof(ret)
    assert ret.value == 0
    # every slot lies inside the buffer and none overlaps the next
    offs = fn._layout.offsets + [fn._layout.ret_offset]
    assert offs == sorted(offs) and offs[-1] + 4 <= ctypes.sizeof(buf)


def test_bad_scalar_names_the_argument():
    fn = _fake_function(ABI[:2])
    a = torch.empty(5, 7, 16, dtype=torch.float16)
    buf, _, _ = fn._layout.buffer()
    with pytest.raises(ValueError, match="'n'"):
        fn._pack_into(buf, [a, 2**31], [(list(a.shape), list(a.stride())), None], 0)
    with pytest.raises(TypeError, match="'n'"):
        fn._pack_into(buf, [a, 1.5], [(list(a.shape), list(a.stride())), None], 0)


@pytest.mark.parametrize("rank", [1, 2, 3, 4, 5, 6])
def test_layout_size_covers_every_rank(rank):
    lay = _Layout([{"kind": "tensor", "name": "x", "rank": rank}, {"kind": "stream"}])
    assert lay.offsets[1] >= ctypes.sizeof(tensor_struct(rank))
    assert struct.calcsize(lay.fmt) == lay.ret_offset + 4
