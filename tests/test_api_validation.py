"""Bad input raises a clear error naming the argument (CPU: checks run before any launch)."""
import pytest
import torch

from cutekern.ikbo import LinearCompression, linear_compression
from cutekern.runtime import validate_args
from cutekern.abi import lce_gemm_abi

F16 = torch.float16


def _ok(b=4, u=2, m=5, n=16, kc=13, ku=9, dtype=F16):
    return (torch.randn(m, kc, dtype=dtype), torch.randn(m, ku, dtype=dtype),
            torch.randn(b, kc, n, dtype=dtype), torch.randn(u, ku, n, dtype=dtype),
            torch.tensor([0, 0, 1, 1][:b], dtype=torch.int32))


def _raises(exc, match, *args, **kw):
    with pytest.raises(exc, match=match):
        linear_compression(*args, **kw)


def test_valid_cpu_input_reaches_the_device_check():
    _raises(ValueError, "'w_cand' must be on a CUDA device", *_ok())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32])
def test_weight_dtype(dtype):
    a = list(_ok())
    a[0] = a[0].to(dtype)
    _raises(TypeError, "'w_cand' must be float16 or bfloat16", *a)


def test_mixed_dtypes():
    a = list(_ok())
    a[1] = a[1].to(torch.bfloat16)
    _raises(TypeError, "'w_user' must have dtype", *a)
    a = list(_ok())
    a[2] = a[2].to(torch.bfloat16)
    _raises(TypeError, "'e_cand' must have dtype", *a)


def test_shapes():
    a = list(_ok()); a[1] = torch.randn(6, 9, dtype=F16)
    _raises(ValueError, "'w_user' must have M=5", *a)
    a = list(_ok()); a[2] = torch.randn(4, 12, 16, dtype=F16)
    _raises(ValueError, "'e_cand' dim 1 must be K_cand=13", *a)
    a = list(_ok()); a[3] = torch.randn(2, 8, 16, dtype=F16)
    _raises(ValueError, "'e_user' dim 1 must be K_user=9", *a)
    a = list(_ok()); a[3] = torch.randn(2, 9, 24, dtype=F16)
    _raises(ValueError, "'e_user' must have N=16", *a)
    a = list(_ok()); a[4] = torch.tensor([0, 1, 1], dtype=torch.int32)
    _raises(ValueError, "'cand_to_user' must have B=4", *a)
    a = list(_ok()); a[2] = torch.randn(4, 13, dtype=F16)
    _raises(ValueError, "'e_cand' must be 3-D", *a)
    a = list(_ok()); a[0] = torch.randn(5, 13, 1, dtype=F16)
    _raises(ValueError, "'w_cand' must be 2-D", *a)


def test_index_dtype():
    a = list(_ok()); a[4] = a[4].long()
    _raises(TypeError, "'cand_to_user' must be int32", *a)


def test_strides_and_alignment():
    a = list(_ok(n=12)); 
    _raises(ValueError, "'e_cand' last dim N=12 must be a multiple of 8", *a)
    a = list(_ok()); a[2] = torch.randn(4, 16, 13, dtype=F16).transpose(1, 2)
    _raises(ValueError, "'e_cand' must be contiguous in its last dim", *a)
    base = torch.randn(4 * 13 * 16 + 1, dtype=F16)
    a = list(_ok()); a[2] = base[1:].view(4, 13, 16)
    _raises(ValueError, "'e_cand' data pointer must be 16-byte aligned", *a)
    a = list(_ok()); a[3] = torch.randn(2, 9, 20, dtype=F16)[:, :, :16]
    _raises(ValueError, r"'e_user' stride \d+ of dim \d must be a multiple of 8", *a)


def test_out_checked():
    a = _ok()
    lce = LinearCompression(a[0], a[1])
    with pytest.raises(ValueError, match="'out' must be"):
        lce(*a[2:], out=torch.empty(4, 5, 8, dtype=F16))
    with pytest.raises(ValueError, match="'out' must be"):
        lce(*a[2:], out=torch.empty(4, 5, 16, dtype=torch.float32))


def test_plan_validates_like_a_call():
    """plan() runs the same checks as a call before binding anything."""
    a = _ok()
    lce = LinearCompression(a[0], a[1])
    with pytest.raises(ValueError, match="'out' must be"):
        lce.plan(*a[2:], out=torch.empty(4, 5, 8, dtype=F16))
    with pytest.raises(TypeError, match="'cand_to_user' must be int32"):
        lce.plan(a[2], a[3], a[4].long())
    with pytest.raises(ValueError, match="'e_cand'"):
        lce.plan(torch.randn(4, 12, 16, dtype=F16), a[3], a[4])


def test_zero_users_with_candidates():
    a = list(_ok()); a[3] = torch.randn(0, 9, 16, dtype=F16)
    _raises(ValueError, "'e_user' has 0 users", *a)


def test_weights_are_padded_once():
    a = _ok()
    lce = LinearCompression(a[0], a[1])
    assert lce.w_cand.shape == (5, 16) and lce.w_user.shape == (5, 16)
    assert not lce.w_cand[:, 13:].any() and torch.equal(lce.w_cand[:, :13], a[0])


# ---- runtime-level ABI validation (the DSL-free path checks again before launching)
META = {"op": "lce_gemm", "design": "sm90", "arch": "sm_90a",
        "abi": [x.to_json() for x in lce_gemm_abi("float16", "float16")]}


def _rt_args():
    return [torch.randn(5, 16, dtype=F16), torch.randn(3, 13, 16, dtype=F16),
            torch.randn(3, 5, 16, dtype=F16), torch.randn(2, 5, 16), torch.zeros(3, dtype=torch.int32)]


def test_runtime_validation_names_argument():
    args = _rt_args()
    with pytest.raises(ValueError, match="argument 'a' must be on a CUDA device"):
        validate_args(META, args)
    bad = list(args); bad[1] = bad[1].float()
    with pytest.raises(TypeError, match="argument 'b' must be torch.float16"):
        validate_args(META, bad, require_cuda=False)
    bad = list(args); bad[2] = bad[2][0]
    with pytest.raises(ValueError, match="argument 'c' must have rank 3"):
        validate_args(META, bad, require_cuda=False)
    bad = list(args); bad[0] = torch.randn(5, 20, dtype=F16)[:, :13]
    with pytest.raises(ValueError, match="argument 'a' stride 20 of dim 0 must be a multiple of 8"):
        validate_args(META, bad, require_cuda=False)
    with pytest.raises(TypeError, match="expected 5 arguments"):
        validate_args(META, args[:4], require_cuda=False)
    # a well-formed CPU call passes every metadata check and reports canonical strides
    dims, _ = validate_args(META, args, require_cuda=False)
    assert dims[1] == ([3, 13, 16], [208, 16, 1])


def test_runtime_validates_scalar_arguments():
    """By-value scalars (AttnRes' num_blocks, eps, ...) are type- and range-checked by name."""
    from cutekern.abi import attn_res_abi
    meta = {"op": "attn_res", "design": "sm90", "arch": "sm_90a",
            "abi": [x.to_json() for x in attn_res_abi("bfloat16")]}
    bf = torch.bfloat16
    t2, t3, t1 = torch.randn(4, 64).to(bf), torch.randn(4, 2, 64).to(bf), torch.randn(64).to(bf)
    tensors = [t2, t2, t3, t1, t1, t1, t2]
    w = [torch.zeros(2, dtype=torch.int32)]  # the row-scheduler counters (last tensor)
    good = tensors + [2, -1, 1, 1, 1e-5, 1e-5] + w
    dims, _ = validate_args(meta, good, require_cuda=False)
    assert dims[7:13] == [None] * 6
    with pytest.raises(TypeError, match="argument 'num_blocks' must be a Python int"):
        validate_args(meta, tensors + [2.0, -1, 1, 1, 1e-5, 1e-5] + w, require_cuda=False)
    with pytest.raises(TypeError, match="argument 'has_delta' must be a Python int"):
        validate_args(meta, tensors + [2, -1, True, 1, 1e-5, 1e-5] + w, require_cuda=False)
    with pytest.raises(ValueError, match="argument 'write_idx' = 4294967296 does not fit in int32"):
        validate_args(meta, tensors + [2, 2**32, 1, 1, 1e-5, 1e-5] + w, require_cuda=False)
    with pytest.raises(TypeError, match="argument 'eps' must be a Python float"):
        validate_args(meta, tensors + [2, -1, 1, 1, "1e-5", 1e-5] + w, require_cuda=False)
    with pytest.raises(TypeError, match="argument 'work'"):
        validate_args(meta, tensors + [2, -1, 1, 1, 1e-5, 1e-5, torch.zeros(2)], require_cuda=False)


def test_custom_ops_have_fake_implementations():
    """torch.compile traces the ops with fake tensors: shapes/dtypes come out right."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        wc, wu = torch.empty(5, 16, dtype=F16), torch.empty(5, 16, dtype=F16)
        ec, eu = torch.empty(4, 13, 24, dtype=F16), torch.empty(2, 9, 24, dtype=F16)
        c2u = torch.empty(4, dtype=torch.int32)
        out = torch.ops.cutekern.lce(wc, wu, ec, eu, c2u, True)
        assert out.shape == (4, 5, 24) and out.dtype == F16
        torch.ops.cutekern.lce_out(wc, wu, ec, eu, c2u, torch.empty(4, 5, 24, dtype=F16), False)
        # AttnRes (mutates in place, returns nothing) and the BGMV ops
        bf = torch.bfloat16
        p, b = torch.empty(3, 64, dtype=bf), torch.empty(3, 2, 64, dtype=bf)
        w = torch.empty(64, dtype=bf)
        assert torch.ops.cutekern.attn_res(p, p, b, w, w, None, torch.empty(3, 64, dtype=bf),
                                           2, -1, 1e-5, 1e-5) is None
        x, a = torch.empty(5, 32, dtype=bf), torch.empty(2, 4, 8, 32, dtype=bf)
        ids, lora = torch.empty(5, 3, dtype=torch.int32), torch.empty(5, dtype=torch.int32)
        s = torch.ops.cutekern.bgmv_moe_shrink(x, a, ids, lora, None)
        assert s.shape == (15, 8) and s.dtype == bf
        bb = torch.empty(2, 4, 48, 8, dtype=bf)
        y = torch.ops.cutekern.bgmv_moe_expand(s, bb, ids, lora, torch.empty(5, 3), True)
        assert y.shape == (5, 48) and y.dtype == torch.float32
        yp = torch.ops.cutekern.bgmv_moe_expand(s, bb, ids, lora, None, False)
        assert yp.shape == (15, 48) and yp.dtype == torch.float32
