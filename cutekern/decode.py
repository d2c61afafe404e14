"""One decode step's attention for Qwen3-style models (the megakernel's attention task as its
own launch; kernels/ada/decode_attn.py, kernels/CONTRACT_MEGAKERNEL.md).

From the step's fused projections ``qkv`` [B, (Hq + 2 Hkv) 128] (q heads, then k heads, then
v heads), per row b at position p = lens[b] (the row's cached tokens): q and k get their
per-head RMSNorm and rotate-half RoPE (fp32), k and v are appended to the caches at p, and
out[b, h] = softmax(q_h K^T / sqrt(128)) V over positions 0..p, with q head h reading KV
head h // (Hq / Hkv). Caches are [B, Hkv, S, 128] (a row's slab per KV head, as
``reference.qwen3_forward`` keeps them); RoPE reads ``rope_table``'s fp32 cos / sin rows.
"""
from __future__ import annotations

import math

import torch

from ._checks import check_rows16
from .runtime import _raw_stream, stream_scratch

HEAD_DIM = 128
DTYPES = (torch.float16, torch.bfloat16)
_DT_NAME = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_OP = "decode_attention"


def _err(name, msg):
    return ValueError(f"{_OP}: argument '{name}' {msg}")


def rope_table(positions: int, head_dim: int = HEAD_DIM, theta: float = 1e6,
               device=None) -> torch.Tensor:
    """fp32 [positions, head_dim]: row p holds cos(p f_i) for i < head_dim / 2, then
    sin(p f_i), f_i = theta ** (-2 i / head_dim) (computed in float64, rounded once). Build
    it once per model for the longest context."""
    if positions < 1 or head_dim % 2:
        raise ValueError(f"rope_table: need positions >= 1 and an even head_dim, got "
                         f"{positions}, {head_dim}")
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], 1).float().to(device)


def _check(qkv, k_cache, v_cache, lens, q_norm_weight, k_norm_weight, rope, eps, out):
    """Shapes, dtypes, devices, strides; returns (B, Hq, Hkv)."""
    for name, t in (("qkv", qkv), ("k_cache", k_cache), ("v_cache", v_cache), ("lens", lens),
                    ("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight),
                    ("rope", rope)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_OP}: argument '{name}' must be a torch.Tensor, "
                            f"got {type(t).__name__}")
    if qkv.dtype not in DTYPES:
        raise _err("qkv", f"must be float16 or bfloat16, got {qkv.dtype}")
    if qkv.dim() != 2:
        raise _err("qkv", f"must be 2-D [B, (Hq + 2 Hkv) * {HEAD_DIM}], got shape "
                          f"{tuple(qkv.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4 or t.shape[3] != HEAD_DIM:
            raise _err(name, f"must be [B, Hkv, S, {HEAD_DIM}], got shape {tuple(t.shape)}")
    bsz, width = qkv.shape
    hkv = k_cache.shape[1]
    if k_cache.shape[0] != bsz:
        raise _err("k_cache", f"must have qkv's {bsz} rows in dim 0, got {k_cache.shape[0]}")
    if v_cache.shape != k_cache.shape:
        raise _err("v_cache", f"must have k_cache's shape {tuple(k_cache.shape)}, got "
                              f"{tuple(v_cache.shape)}")
    if hkv < 1 or width % HEAD_DIM or width // HEAD_DIM <= 2 * hkv:
        raise _err("qkv", f"must have (Hq + 2 Hkv) * {HEAD_DIM} columns with Hq >= 1 and "
                          f"Hkv = k_cache.shape[1] = {hkv}, got {width}")
    hq = width // HEAD_DIM - 2 * hkv
    if hq % hkv:
        raise _err("qkv", f"holds {hq} q heads, not a multiple of the caches' {hkv} KV heads")
    if k_cache.shape[2] < 1:
        raise _err("k_cache", "must hold at least one position (dim 2)")
    for name, t, dt in (("k_cache", k_cache, qkv.dtype), ("v_cache", v_cache, qkv.dtype),
                        ("q_norm_weight", q_norm_weight, qkv.dtype),
                        ("k_norm_weight", k_norm_weight, qkv.dtype), ("lens", lens, torch.int32),
                        ("rope", rope, torch.float32)):
        if t.dtype != dt:
            raise _err(name, f"must be {dt}, got {t.dtype}")
        if t.device != qkv.device:
            raise _err(name, f"must be on qkv's device {qkv.device}, got {t.device}")
    for name, t in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if tuple(t.shape) != (HEAD_DIM,):
            raise _err(name, f"must be [{HEAD_DIM}], got shape {tuple(t.shape)}")
    if tuple(lens.shape) != (bsz,):
        raise _err("lens", f"must be [{bsz}] (one length per row of qkv), got shape "
                           f"{tuple(lens.shape)}")
    if bsz > 1 and lens.stride(0) != 1:
        raise _err("lens", "must be contiguous")
    if rope.dim() != 2 or rope.shape[1] != HEAD_DIM or rope.shape[0] < 1:
        raise _err("rope", f"must be [positions, {HEAD_DIM}] (rope_table), got shape "
                           f"{tuple(rope.shape)}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise _err("eps", f"must be a positive finite float, got {eps!r}")
    for name, t in (("qkv", qkv), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        check_rows16(_err, name, t, "channels")
    if rope.stride(1) != 1 or (rope.shape[0] > 1 and rope.stride(0) % 4):
        raise _err("rope", "must be contiguous in dim 1 with a row stride of a multiple of 4")
    if not torch.compiler.is_compiling() and rope.data_ptr() % 16:
        raise _err("rope", "data pointer must be 16-byte aligned")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{_OP}: argument 'out' must be a torch.Tensor, got "
                            f"{type(out).__name__}")
        if tuple(out.shape) != (bsz, hq * HEAD_DIM) or out.dtype != qkv.dtype:
            raise _err("out", f"must be [{bsz}, {hq * HEAD_DIM}] {qkv.dtype}, got "
                              f"{tuple(out.shape)} {out.dtype}")
        if out.device != qkv.device:
            raise _err("out", f"must be on qkv's device {qkv.device}, got {out.device}")
        check_rows16(_err, "out", out, "channels")
    if not qkv.is_cuda:         # last: every other check also runs on CPU tensors
        raise _err("qkv", f"must be on a CUDA device, got {qkv.device}")
    return bsz, hq, hkv


def decode_attention(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lens: torch.Tensor, q_norm_weight: torch.Tensor,
                     k_norm_weight: torch.Tensor, rope: torch.Tensor, *, eps: float = 1e-6,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step's attention (head_dim 128): q / k per-head RMSNorm (``eps``) and RoPE
    (``rope``: ``rope_table``), k / v appended to the caches at lens[b], softmax attention
    over positions 0..lens[b]; returns out [B, Hq * 128] in qkv's dtype (fp32 inside).

    lens (int32, on the device) is not read by the host (no sync; CUDA-graph capturable): a
    row whose length is outside the caches (or the RoPE table) gets NaN outputs and its
    caches are left alone. lens is not advanced: the caller adds 1 after the step. Sums run
    in a fixed order: bitwise deterministic for a given launch shape (the split count below
    follows the batch and head counts, so a row's bits can differ between batch sizes).

    Launches with fewer CTAs (row x KV head x pair of q heads) than RESIDENT_PER_SM per SM
    split each one's positions over up to MAX_SPLITS CTAs (one per 128 cache positions at
    most); split 0 waits for the others' partials, exchanged through a per-stream buffer,
    so as with a cooperative launch another kernel holding SMs for good on a second stream
    could stall it."""
    bsz, hq, _ = _check(qkv, k_cache, v_cache, lens, q_norm_weight, k_norm_weight, rope, eps,
                        out)
    if out is None and torch.compiler.is_compiling():
        return _decode_attn_op(qkv, k_cache, v_cache, lens, q_norm_weight, k_norm_weight,
                               rope, float(eps))
    y = out if out is not None else torch.empty(bsz, hq * HEAD_DIM, dtype=qkv.dtype,
                                                device=qkv.device)
    _decode_attn_impl(qkv, k_cache, v_cache, lens, q_norm_weight, k_norm_weight, rope, y,
                      float(eps))
    return y


# forced split counts on an H100 (perf/results/decode_splits_h100_w8_xch.json): best at 8 / 16
# splits for 1 row x 1024 / 4096 since split 0 reads a split's partials in one round trip
SPLIT_MIN_POSITIONS = 128   # cache positions per split at least (a split's fixed cost)
MAX_SPLITS = 16
# CTAs of the kernel one SM is sure to hold at once: 256 threads, ~19 KB of shared memory and
# at most 128 registers a thread (tests/test_export.py checks every build's SASS: 102..124
# used now) fit twice in any SM's 64K registers, 1536 threads and 99 KB
RESIDENT_PER_SM = 2
SPLITS_OVERRIDE = None      # tests: force the split count (still bounded by residency)


def pick_splits(ctas: int, capacity: int, sms: int) -> int:
    """CTAs over each (row, KV head, head pair)'s positions: enough to fill every SM with
    RESIDENT_PER_SM CTAs when the launch has fewer, never more than all SMs hold at once
    (split 0 waits for the others, so every CTA must be resident) and one per
    SPLIT_MIN_POSITIONS of the cache's capacity at most."""
    resident = sms * RESIDENT_PER_SM
    if SPLITS_OVERRIDE is not None:
        return max(1, min(SPLITS_OVERRIDE, resident // max(ctas, 1)))
    return max(1, min(resident // max(ctas, 1), -(-capacity // SPLIT_MIN_POSITIONS), MAX_SPLITS))


_XCH: dict = {}


def _decode_attn_impl(qkv, k_cache, v_cache, lens, q_norm, k_norm, rope, out, eps,
                      check=False):
    from .arch import sm_count
    from .dispatch import get_function
    bsz = qkv.shape[0]
    if bsz == 0:
        return
    hkv = k_cache.shape[1]
    group = out.shape[1] // HEAD_DIM // hkv
    ctas = bsz * hkv * -(-group // 2)
    splits = pick_splits(ctas, min(k_cache.shape[2], rope.shape[0]), sm_count(qkv.device))
    # the splits' exchange words (int32 pairs, zero between launches: split 0 clears them)
    words = ctas * (splits - 1) * 2 * (HEAD_DIM + 2) * 2
    xch = stream_scratch(_XCH, qkv.device, max(2, words))
    fn = get_function("decode_attn", {"dtype": _DT_NAME[qkv.dtype]}, {}, qkv.device,
                      design="ada")
    fn(qkv, k_cache, v_cache, lens, q_norm, k_norm, rope, out, eps, xch, splits,
       stream=_raw_stream(qkv.device), check=check)


@torch.library.custom_op("cutekern::decode_attention", mutates_args=("k_cache", "v_cache"))
def _decode_attn_op(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    lens: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                    rope: torch.Tensor, eps: float) -> torch.Tensor:
    # reachable as torch.ops.cutekern.decode_attention without decode_attention's checks: the
    # launch checks its arguments against the ABI
    _, hq, _ = _check(qkv, k_cache, v_cache, lens, q_norm, k_norm, rope, eps, None)
    y = torch.empty(qkv.shape[0], hq * HEAD_DIM, dtype=qkv.dtype, device=qkv.device)
    _decode_attn_impl(qkv, k_cache, v_cache, lens, q_norm, k_norm, rope, y, eps, check=True)
    return y


@_decode_attn_op.register_fake
def _(qkv, k_cache, v_cache, lens, q_norm, k_norm, rope, eps):
    hq = qkv.shape[1] // HEAD_DIM - 2 * k_cache.shape[1]
    return qkv.new_empty(qkv.shape[0], hq * HEAD_DIM)


# ------------------------------------------------------------- residual add + RMSNorm
_NORM_OP = "add_rms_norm"


def _norm_err(name, msg):
    return ValueError(f"{_NORM_OP}: argument '{name}' {msg}")


def _check_norm(residual, y, weight, out, eps):
    for name, t in (("residual", residual), ("y", y), ("weight", weight), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_NORM_OP}: argument '{name}' must be a torch.Tensor, "
                            f"got {type(t).__name__}")
    if residual.dtype != torch.float32 or residual.dim() != 2:
        raise _norm_err("residual", f"must be a 2-D float32 tensor [B, D], got "
                                    f"{residual.dtype} {tuple(residual.shape)}")
    bsz, d = residual.shape
    if d % 8 or d == 0:
        raise _norm_err("residual", f"must have a hidden size D that is a positive multiple of "
                                    f"8, got {d}")
    if y.dtype not in DTYPES:
        raise _norm_err("y", f"must be float16 or bfloat16, got {y.dtype}")
    for name, t, dt, shape in (("y", y, y.dtype, (bsz, d)), ("out", out, y.dtype, (bsz, d)),
                               ("weight", weight, torch.float32, (d,))):
        if tuple(t.shape) != shape or t.dtype != dt:
            raise _norm_err(name, f"must be {list(shape)} {dt}, got {tuple(t.shape)} {t.dtype}")
        if t.device != residual.device:
            raise _norm_err(name, f"must be on residual's device {residual.device}, got "
                                  f"{t.device}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise _norm_err("eps", f"must be a positive finite float, got {eps!r}")
    for name, t in (("residual", residual), ("y", y), ("weight", weight), ("out", out)):
        check_rows16(_norm_err, name, t, "hidden")
    if not residual.is_cuda:    # last: every other check also runs on CPU tensors
        raise _norm_err("residual", f"must be on a CUDA device, got {residual.device}")


def add_rms_norm(residual: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                 out: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """The decoder's glue in one launch: residual += y (fp32 [B, D], in place), then
    out = residual * rsqrt(mean(residual^2) + eps) * weight (fp32 weight [D]) rounded once to
    y's dtype (fp16 / bf16; out [B, D]). D a multiple of 8. Returns out. Sums in a fixed order
    (bitwise deterministic, a row's result independent of the batch)."""
    _check_norm(residual, y, weight, out, eps)
    if torch.compiler.is_compiling():
        _add_rms_norm_op(residual, y, weight, out, float(eps))
        return out
    _add_rms_norm_impl(residual, y, weight, out, float(eps))
    return out


def _add_rms_norm_impl(residual, y, weight, out, eps, check=False):
    from .dispatch import get_function
    if residual.shape[0] == 0:
        return
    fn = get_function("add_rms_norm", {"dtype": _DT_NAME[y.dtype]}, {}, residual.device,
                      design="ada")
    fn(residual, y, weight, out, eps, stream=_raw_stream(residual.device), check=check)


@torch.library.custom_op("cutekern::add_rms_norm", mutates_args=("residual", "out"))
def _add_rms_norm_op(residual: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                     out: torch.Tensor, eps: float) -> None:
    _check_norm(residual, y, weight, out, eps)
    _add_rms_norm_impl(residual, y, weight, out, eps, check=True)


@_add_rms_norm_op.register_fake
def _(residual, y, weight, out, eps):
    return None
