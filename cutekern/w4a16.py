"""W4A16 weights in tensor-core fragment order: the prepare step of the megakernel's linear
layers (kernels/CONTRACT_MEGAKERNEL.md, "W4A16 fragment order"). No kernel reads it yet.

GPTQ keeps a W4A16 g128 weight as qweight int32 [K / 8, N] (input channel k in nibble k % 8
of row k // 8, zero point 8) and scales [K / group, N] (``reference.w4a16_quantize``). A
tensor-core GEMV / skinny GEMM (mma.sync m16n8k16, activations as A, weights as B) wants each
thread's B fragments of a 16 (k) x 16 (n) tile in one 32-bit word, so that a warp reads a
tile as 128 contiguous bytes and turns a word into its four 16-bit register pairs with a
mask, an OR with an exponent constant and one subtract (or FMA) per register, and a shift
between them (fp16: by 8, two registers per round; bf16, whose 7 mantissa bits cannot hold a
nibble at bits 4..7: by 4, one register per round):

    packed int32 [N / 16, K / 16, 32]: tile (n16, k16), lane l = 4 g + t holds
      nibble 0: (k 2t,     n g)      nibble 4: (k 2t + 1, n g)        -> B register 0
      nibble 1: (k 2t + 8, n g)      nibble 5: (k 2t + 9, n g)        -> B register 1
      nibble 2: (k 2t,     n g + 8)  nibble 6: (k 2t + 1, n g + 8)    -> B register 2
      nibble 3: (k 2t + 8, n g + 8)  nibble 7: (k 2t + 9, n g + 8)    -> B register 3
    (nibble i at bits 4i; registers 0 / 1: the first n8 atom's b0b1 / b2b3, 2 / 3: the
    second's, in PTX's m16n8k16 B fragment order: row 2t + (i & 1) + 8 (i >= 2), column g)

``reference.w4a16_fragments_dense`` emulates the kernel's register-level dequant of this
layout bit for bit; tests/test_w4a16.py checks it against GPTQ's storage.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import pack_nibbles, w4a16_nibbles

TILE = 16
SCALE_DTYPES = (torch.float16, torch.bfloat16)
# nibble i of a lane's word: (k offset beyond 2t, n offset beyond g)
NIBBLE_K = (0, 8, 0, 8, 1, 9, 1, 9)
NIBBLE_N = (0, 0, 8, 8, 0, 0, 8, 8)


def _err(name, msg):
    return ValueError(f"prepare_w4a16: argument '{name}' {msg}")


@dataclass(frozen=True)
class W4A16Weight:
    """A prepared W4A16 weight: ``packed`` int32 [N / 16, K / 16, 32] in fragment order,
    ``scales`` [K / group, N] as given (fp16 or bf16: the kernel's operand type)."""
    packed: torch.Tensor
    scales: torch.Tensor
    k: int
    n: int
    group: int


def fragment_index(device=None):
    """(k, n) offsets inside a 16 x 16 tile of every (lane, nibble): two int64 [32, 8]."""
    lane = torch.arange(32, device=device)
    t, g = (lane % 4)[:, None], (lane // 4)[:, None]
    kk = 2 * t + torch.tensor(NIBBLE_K, device=device)[None, :]
    nn = g + torch.tensor(NIBBLE_N, device=device)[None, :]
    return kk, nn


def prepare_w4a16(qweight: torch.Tensor, scales: torch.Tensor, group: int = 128) -> W4A16Weight:
    """GPTQ storage (qweight int32 [K / 8, N], scales [K / group, N]) -> fragment order. Once
    per weight, on the weight's device; the scales are kept as they are."""
    for name, t in (("qweight", qweight), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"prepare_w4a16: argument '{name}' must be a torch.Tensor, "
                            f"got {type(t).__name__}")
        if t.dim() != 2:
            raise _err(name, f"must have 2 dims, got shape {tuple(t.shape)}")
    if qweight.dtype != torch.int32:
        raise TypeError(f"prepare_w4a16: argument 'qweight' must be int32, got {qweight.dtype}")
    if scales.dtype not in SCALE_DTYPES:
        raise TypeError(f"prepare_w4a16: argument 'scales' must be float16 or bfloat16, "
                        f"got {scales.dtype}")
    if scales.device != qweight.device:
        raise _err("scales", f"must be on {qweight.device} like qweight, got {scales.device}")
    if not isinstance(group, int) or group <= 0 or group % TILE:
        raise _err("group", f"must be a positive multiple of {TILE} (a k16 tile in one group), "
                            f"got {group!r}")
    k8, n = qweight.shape
    k = 8 * k8
    if k % group or k == 0:
        raise _err("qweight", f"has K = 8 x {k8} = {k}: must be a positive multiple of group "
                              f"{group}")
    if n % TILE or n == 0:
        raise _err("qweight", f"has N = {n}: must be a positive multiple of {TILE}")
    if tuple(scales.shape) != (k // group, n):
        raise _err("scales", f"must be [K / group, N] = [{k // group}, {n}], got "
                             f"{tuple(scales.shape)}")
    nib = w4a16_nibbles(qweight)                                               # [K, N]
    tiles = nib.reshape(k // TILE, TILE, n // TILE, TILE).permute(2, 0, 1, 3)  # [NT, KT, k, n]
    kk, nn = fragment_index(qweight.device)
    packed = pack_nibbles(tiles[:, :, kk, nn])                                 # [NT, KT, 32]
    return W4A16Weight(packed.contiguous(), scales, k, n, group)
