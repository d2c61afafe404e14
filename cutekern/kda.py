"""KDA (Kimi Delta Attention) chunked prefill: argument contract and the chunk work list.

Status: no kernel yet (see README, "Features"). This module fixes what the kernels will
accept, so that the torch-facing op, its tests and the kernels share one contract. The
call mirrors ``fla.ops.kda.chunk_kda`` (same argument names and defaults, so it can stand
in for it):

    chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, A_log=None, dt_bias=None, safe_gate=False,
              lower_bound=None, cu_seqlens=None, cu_seqlens_cpu=None)

q, k [B, T, H, K] and v [B, T, H, V] in bf16 or fp16; g [B, T, H, K] is the log decay, or
with ``use_gate_in_kernel`` the raw gate projection (``-exp(A_log) * softplus(g + dt_bias)``,
or with ``lower_bound`` the bounded "safe gate" ``lower_bound * sigmoid(exp(A_log) * (g +
dt_bias))``); beta [B, T, H] post-sigmoid unless ``use_beta_sigmoid_in_kernel``;
initial_state [N, H, K, V] fp32; varlen is B == 1 with int64 cu_seqlens [N + 1]
(FlashAttention convention, 0-length sequences allowed). Not supported (named errors):
grouped value heads (v with more heads than q), a bf16 state. The math and the float64
ground truth are in ``cutekern.reference`` (``kda_reference``, ``kda_chunked``, ``kda_gate``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

IN_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)           # K and V the kernels will tile (one or two 64-wide blocks)
CHUNK = 64


def _err(name, msg):
    return ValueError(f"chunk_kda: argument '{name}' {msg}")


@dataclass(frozen=True)
class KdaProblem:
    """What a validated call describes (all host-side ints: no device reads)."""
    batch: int
    seqlen: int
    heads: int
    head_k: int
    head_v: int
    num_seqs: int
    varlen: bool
    gate_in_kernel: bool


def _tensor(name, t, ndim, dtypes, device=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"chunk_kda: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise _err(name, f"must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"chunk_kda: argument '{name}' must be one of "
                        f"{[str(d).replace('torch.', '') for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise _err(name, f"must be on {device} like q, got {t.device}")
    if t.numel() and t.stride(-1) != 1:
        raise _err(name, "must be contiguous in its last dim")


def check_kda_args(q, k, v, g, beta, *, scale=None, initial_state=None, use_gate_in_kernel=False,
                   A_log=None, dt_bias=None, safe_gate=False, lower_bound=None, cu_seqlens=None,
                   cu_seqlens_cpu=None):
    """Validate a chunk_kda call; errors name the argument. The chunk work list needs the
    sequence offsets on the host: from ``cu_seqlens_cpu`` when given (no sync), else read
    from ``cu_seqlens`` (one sync if it lives on the GPU)."""
    _tensor("q", q, 4, IN_DTYPES)
    dev = q.device
    bsz, t, h, dk = q.shape
    _tensor("k", k, 4, (q.dtype,), dev)
    _tensor("v", v, 4, (q.dtype,), dev)
    if tuple(k.shape) != tuple(q.shape):
        raise _err("k", f"must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if tuple(v.shape[:2]) != (bsz, t):
        raise _err("v", f"must be [B, T, H, V] = [{bsz}, {t}, {h}, V], got {tuple(v.shape)}")
    if v.shape[2] != h:
        raise _err("v", f"must have q's {h} heads (grouped value heads are not supported), "
                        f"got {v.shape[2]}")
    dv = v.shape[3]
    if dk not in HEAD_DIMS:
        raise _err("q", f"head dim K={dk} is not supported (one of {HEAD_DIMS})")
    if dv not in HEAD_DIMS:
        raise _err("v", f"head dim V={dv} is not supported (one of {HEAD_DIMS})")
    _tensor("g", g, 4, (torch.float32, q.dtype), dev)
    if tuple(g.shape) != tuple(q.shape):
        raise _err("g", f"must have q's shape {tuple(q.shape)}, got {tuple(g.shape)}")
    _tensor("beta", beta, 3, (torch.float32, q.dtype), dev)
    if tuple(beta.shape) != (bsz, t, h):
        raise _err("beta", f"must be [B, T, H] = [{bsz}, {t}, {h}], got {tuple(beta.shape)}")
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise _err("scale", f"must be a positive number, got {scale!r}")

    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise _err("A_log", "is required by use_gate_in_kernel (optional only with lower_bound)")
        if A_log is not None:
            _tensor("A_log", A_log, 1, (torch.float32,), dev)
            if A_log.shape[0] != h:
                raise _err("A_log", f"must be [H] = [{h}], got {tuple(A_log.shape)}")
        if dt_bias is not None:
            flat = not (isinstance(dt_bias, torch.Tensor) and dt_bias.dim() == 2)
            _tensor("dt_bias", dt_bias, 1 if flat else 2, (torch.float32,), dev)
            if tuple(dt_bias.shape) not in ((h, dk), (h * dk,)):
                raise _err("dt_bias", f"must be [H, K] = [{h}, {dk}] or [H * K], got {tuple(dt_bias.shape)}")
        if safe_gate and lower_bound is None:
            raise _err("lower_bound", "is required by safe_gate with use_gate_in_kernel")
    else:
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if x is not None:
                raise _err(name, "is only used with use_gate_in_kernel=True (g is then the raw gate)")
    if lower_bound is not None and not (isinstance(lower_bound, (int, float)) and -5.0 <= lower_bound < 0.0):
        raise _err("lower_bound", f"must be a number in [-5, 0), got {lower_bound!r}")

    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise _err("cu_seqlens_cpu", "is given without cu_seqlens")
        num_seqs = bsz
    else:
        _tensor("cu_seqlens", cu_seqlens, 1, (torch.int64,), dev)
        if bsz != 1:
            raise _err("cu_seqlens", f"needs q with batch 1 (varlen packs sequences along T), got B={bsz}")
        if cu_seqlens.numel() < 2:
            raise _err("cu_seqlens", "must hold N + 1 >= 2 offsets")
        if cu_seqlens_cpu is not None:
            if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.device.type != "cpu":
                raise _err("cu_seqlens_cpu", "must be a CPU tensor (a host copy of cu_seqlens)")
            if tuple(cu_seqlens_cpu.shape) != tuple(cu_seqlens.shape):
                raise _err("cu_seqlens_cpu", f"must have cu_seqlens' shape {tuple(cu_seqlens.shape)}")
        cu = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
        if cu[0] != 0 or cu[-1] != t:
            raise _err("cu_seqlens", f"must start at 0 and end at T={t}, got {cu[0]}..{cu[-1]}")
        if any(b < a for a, b in zip(cu, cu[1:])):
            raise _err("cu_seqlens", "must be non-decreasing")
        num_seqs = len(cu) - 1
    if initial_state is not None:
        _tensor("initial_state", initial_state, 4, (torch.float32,), dev)
        if tuple(initial_state.shape) != (num_seqs, h, dk, dv):
            raise _err("initial_state", f"must be [N, H, K, V] = [{num_seqs}, {h}, {dk}, {dv}], "
                                        f"got {tuple(initial_state.shape)}")
    return KdaProblem(bsz, t, h, dk, dv, num_seqs, cu_seqlens is not None, bool(use_gate_in_kernel))


def chunk_work_list(seq_bounds, chunk=CHUNK):
    """The chunk work list the kernels walk: int32 [num_chunks, 4] rows (sequence, batch row,
    first token, length), chunks in sequence order and never crossing a sequence boundary,
    plus int32 [N + 1] offsets of each sequence's first chunk (the recurrent chain of
    sequence n is rows offsets[n] .. offsets[n + 1] - 1). ``seq_bounds`` is a list of
    (batch row, start, end) per sequence."""
    rows, offsets = [], [0]
    for n, (b, s0, s1) in enumerate(seq_bounds):
        for c0 in range(s0, s1, chunk):
            rows.append((n, b, c0, min(chunk, s1 - c0)))
        offsets.append(len(rows))
    work = torch.tensor(rows, dtype=torch.int32).reshape(-1, 4)
    return work, torch.tensor(offsets, dtype=torch.int32)


def seq_bounds(problem: KdaProblem, cu_seqlens=None):
    """(batch row, start, end) per sequence of a validated problem (pass the host copy of
    cu_seqlens when there is one: reading a GPU tensor syncs)."""
    from .reference import kda_segments
    return kda_segments(problem.batch, problem.seqlen, cu_seqlens if problem.varlen else None)
