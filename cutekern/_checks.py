"""Argument checks shared by the torch-facing APIs (errors name the argument)."""
from __future__ import annotations

import torch


def check_rows16(err, name, t, last):
    """A tensor the kernels read or write in 16-byte pieces: contiguous in its last dim
    (called ``last`` in messages), other strides multiples of 8 elements, a 16-byte aligned
    base. ``err(name, msg)`` builds the calling op's exception."""
    shape, stride = t.shape, t.stride()  # once: each access builds a Python object
    if stride[-1] != 1:
        raise err(name, f"must be contiguous in its last dim ({last})")
    for d in range(len(shape) - 1):
        if shape[d] > 1 and stride[d] % 8 != 0:
            raise err(name, f"stride {stride[d]} of dim {d} must be a multiple of 8 elements")
    # fake tensors under torch.compile have no storage; the runtime re-checks at launch
    if not torch.compiler.is_compiling() and t.numel() and t.data_ptr() % 16 != 0:
        raise err(name, "data pointer must be 16-byte aligned")
