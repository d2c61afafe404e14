"""ikbo.attention: bad input raises a clear error naming the argument (CPU)."""
import pytest
import torch

from cutekern.ikbo import attention, plan_attention

BF = torch.bfloat16


def _ok(b=4, n_seed=3, h=2, d=64, u=2, s=10):
    return (torch.randn(b, n_seed, h, d, dtype=BF), torch.randn(u, s, h, d, dtype=BF),
            torch.randn(u, s, h, d, dtype=BF), torch.tensor([0, 0, 1, 1][:b], dtype=torch.int32))


def _raises(exc, match, *args, **kw):
    with pytest.raises(exc, match=match):
        attention(*args, **kw)


def test_valid_cpu_input_reaches_the_device_check():
    _raises(ValueError, "'q' must be on a CUDA device", *_ok())


def test_plan_validates_like_the_one_shot_call():
    with pytest.raises(ValueError, match="'q' must be on a CUDA device"):
        plan_attention(*_ok())
    a = list(_ok()); a[3] = a[3].long()
    with pytest.raises(TypeError, match="'cand_to_user' must be int32"):
        plan_attention(*a)
    with pytest.raises(ValueError, match="'scale' must be a positive"):
        plan_attention(*_ok(), scale=-1.0)


def test_dtypes():
    a = list(_ok()); a[0] = a[0].float()
    _raises(TypeError, "'q' must be float16 or bfloat16", *a)
    a = list(_ok()); a[2] = a[2].half()
    _raises(TypeError, "'v' must have dtype", *a)
    a = list(_ok()); a[3] = a[3].long()
    _raises(TypeError, "'cand_to_user' must be int32", *a)


def test_shapes():
    _raises(ValueError, "head dim 96 is not supported", *_ok(d=96))
    a = list(_ok()); a[1] = torch.randn(2, 10, 3, 64, dtype=BF)
    _raises(ValueError, "'k' must have H=2, D=64", *a)
    a = list(_ok()); a[2] = torch.randn(2, 11, 2, 64, dtype=BF)
    _raises(ValueError, "'v' must have the shape of k", *a)
    a = list(_ok()); a[3] = torch.tensor([0, 1], dtype=torch.int32)
    _raises(ValueError, "'cand_to_user' must have B=4", *a)
    _raises(ValueError, "'kv_len' must be an int32 tensor of shape", *_ok(), kv_len=torch.tensor([1, 2]))
    a = list(_ok()); a[0] = a[0][..., 0]
    _raises(ValueError, "'q' must be 4-D", *a)


def test_strides():
    a = list(_ok()); a[0] = torch.randn(4, 3, 64, 2, dtype=BF).transpose(2, 3)
    _raises(ValueError, "'q' must be contiguous in its last dim", *a)
    a = list(_ok()); a[1] = torch.randn(2, 10, 2, 68, dtype=BF)[..., :64]
    _raises(ValueError, r"'k' stride \d+ of dim \d must be a multiple of 8", *a)
    a = list(_ok()); a[0] = torch.randn(4, 4, 2, 64, dtype=BF)[:, :3]
    _raises(ValueError, "'q' must have its \\(candidate, seed\\) dims mergeable", *a)


def test_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k, v, c2u = _ok()
        out, lse = torch.ops.cutekern.ikbo_attention(q, k, v, c2u, None, 0.125, False)
        assert out.shape == q.shape and lse.shape == (4, 2, 3) and lse.dtype == torch.float32
