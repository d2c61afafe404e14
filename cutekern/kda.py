"""KDA (Kimi Delta Attention) chunked prefill over torch tensors.

Status (kernels/CONTRACT_KDA.md): two CuTe DSL kernels of the Ada design (they also build
for sm_90a and run on the H200): the intra-chunk stage (kernels/ada/kda_intra.py, one CTA
per (chunk, head)) and the chain (kernels/ada/kda_chain.py, one CTA per (sequence, head, 64
columns of V)). No sm90 (WGMMA) or sm100 (tcgen05) design yet: SM100 gets the Ada design's
kernels built for sm_100a / sm_103a (compiled and SASS-checked; never run, no SM100 GPU
here). The call mirrors
``fla.ops.kda.chunk_kda`` (same argument names, order and defaults, so it can stand in for it):

    chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
              lower_bound=None, disable_recompute=False, return_intermediate_states=False,
              state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None,
              use_graph=False, max_num_seqs=None, *, A_log=None, dt_bias=None, chunk_size=64,
              transpose_state_layout=None)

q, k [B, T, H, K] and v [B, T, H, V] in bf16 or fp16; g [B, T, H, K] is the log decay, or
with ``use_gate_in_kernel`` the raw gate projection (``-exp(A_log) * softplus(g + dt_bias)``,
or with ``lower_bound`` the bounded "safe gate" ``lower_bound * sigmoid(exp(A_log) * (g +
dt_bias))``); beta [B, T, H] post-sigmoid unless ``use_beta_sigmoid_in_kernel``;
initial_state [N, H, K, V] fp32; q, k, v and g are read as 16-byte row vectors (their last dim
contiguous, data pointers 16-byte aligned: the runtime names the argument otherwise);
varlen is B == 1 with int64 cu_seqlens [N + 1]
(FlashAttention convention, 0-length sequences allowed). Not supported (named errors):
grouped value heads (v with more heads than q), a bf16 state. The math and the float64
ground truth are in ``cutekern.reference`` (``kda_reference``, ``kda_chunked``, ``kda_gate``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .arch import sm_count, target_arch
from .reference import kda_segments
from .registry import OPS
from .runtime import _raw_stream, _validate_tensor

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
    offsets: tuple = ()   # varlen: cu_seqlens as host ints (read once, here)


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


def _rows16(name, t, align):
    """The runtime's ABI check of a tensor (data pointer and every stride of a mode longer than
    1 a multiple of ``align`` elements: the kernels' 16-byte row vectors), done once here so
    that the launches skip it."""
    _validate_tensor({"name": name, "dtype": _DT_NAME[t.dtype], "rank": t.dim(), "align": align},
                     t, "chunk_kda", None, require_cuda=False)


def check_kda_args(q, k, v, g, beta, *, scale=None, initial_state=None, use_gate_in_kernel=False,
                   A_log=None, dt_bias=None, safe_gate=False, lower_bound=None, cu_seqlens=None,
                   cu_seqlens_cpu=None, state_v_first=False):
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
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        _rows16(name, x, 8)
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
        cu = []
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
        want, name = ((num_seqs, h, dv, dk), "[N, H, V, K] (state_v_first)") if state_v_first else \
            ((num_seqs, h, dk, dv), "[N, H, K, V]")
        if tuple(initial_state.shape) != want:
            raise _err("initial_state", f"must be {name} = {list(want)}, "
                                        f"got {tuple(initial_state.shape)}")
        _rows16("initial_state", initial_state, 4)
    return KdaProblem(bsz, t, h, dk, dv, num_seqs, cu_seqlens is not None, bool(use_gate_in_kernel),
                      tuple(int(x) for x in cu))


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
    """(batch row, start, end) per sequence of a validated problem (from the offsets the
    check read; ``cu_seqlens`` is accepted for the older call form and not read again)."""
    return kda_segments(problem.batch, problem.seqlen, problem.offsets)


# ------------------------------------------------------------------ the op


def _chunk_table(bounds, seqlen, chunk=CHUNK):
    """int32 [NC, 2] (first row in the flattened B * T rows, length) per chunk, the int32
    first row of each sequence (N + 1 offsets) and its first chunk (N + 1 offsets)."""
    work, offsets = chunk_work_list(bounds, chunk)
    first = work[:, 1].long() * seqlen + work[:, 2].long()
    table = torch.stack([first, work[:, 3].long()], 1).to(torch.int32)
    # sequences are contiguous in the flattened rows: one offset list bounds them all
    ends = [b * seqlen + s0 for b, s0, _ in bounds[:1]] + [b * seqlen + s1 for b, _, s1 in bounds]
    return table, torch.tensor(ends, dtype=torch.int32), offsets


def _chunk_rows(bounds, seqlen, chunk=CHUNK):
    """``_chunk_table`` with, instead of the table, each chunk slot's flattened row
    ([NC, chunk] int64, -1 past the sequence's end): the torch models' view
    (reference.kda_intra_packed)."""
    table, cu_rows, offsets = _chunk_table(bounds, seqlen, chunk)
    j = torch.arange(chunk)
    rows = torch.where(j[None, :] < table[:, 1:2].long(), table[:, :1].long() + j[None, :],
                       torch.full((1, 1), -1, dtype=torch.int64))
    return rows, cu_rows, offsets


_DT_NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _intra(q, k, v, g, beta, chunks, *, scale, l2norm, beta_sigmoid, gate_mode, a_log,
           dt_bias, lower_bound, out=None, check=True):
    """The intra-chunk kernel: chunk-padded w, u, qg, kg, Aqk ([NC, H, 64, *], q's dtype) and
    exp(Gamma) ([NC, H, K] fp32) for the chain (into ``out`` when given, in that order).
    ``check=False``: skip the runtime's argument check (callers that ran check_kda_args:
    on a slow host it was ~100 us per launch)."""
    from .dispatch import get_function
    bsz, t, h, dk = q.shape
    dv = v.shape[-1]
    nc, dt, dev = chunks.shape[0], q.dtype, q.device
    fn = get_function("kda_intra", {"dtype": _DT_NAME[dt], "g": _DT_NAME[g.dtype]},
                      {"head_k": dk}, dev, design="ada")
    if out is None:
        w, qg, kg = (torch.empty(nc, h, CHUNK, dk, dtype=dt, device=dev) for _ in range(3))
        u = torch.empty(nc, h, CHUNK, dv, dtype=dt, device=dev)
        aqk = torch.empty(nc, h, CHUNK, CHUNK, dtype=dt, device=dev)
        eg = torch.empty(nc, h, dk, dtype=torch.float32, device=dev)
    else:
        w, u, qg, kg, aqk, eg = out
    rows = lambda x: x.reshape(bsz * t, *x.shape[2:])                  # noqa: E731
    fn(rows(q), rows(k), rows(v), rows(g), rows(beta.float()).contiguous(), a_log, dt_bias,
       chunks, w, u, qg, kg, aqk, eg, float(dk ** -0.5 if scale is None else scale),
       int(l2norm), int(beta_sigmoid), gate_mode, float(lower_bound or 0.0),
       stream=_raw_stream(dev), check=check)
    return w, u, qg, kg, aqk, eg


def _chain(w, u, qg, kg, aqk, eg, cu_rows, cu_chunks, initial_state, o, ht, check=True):
    from .dispatch import get_function
    fn = get_function("kda_chain", {"dtype": _DT_NAME[o.dtype]}, {"head_k": w.shape[-1]},
                      o.device, design="ada")
    h0 = initial_state if initial_state is not None else ht
    fn(w, u, qg, kg, aqk, eg, cu_rows, cu_chunks, h0, o.reshape(-1, *o.shape[2:]), ht,
       int(initial_state is not None), 1, stream=_raw_stream(o.device), check=check)


# Splitting long recurrent chains across CTAs (kernels/CONTRACT_KDA.md, "Kernel split" 3),
# where `chain_pieces` asks for it; False runs every sequence's chain whole. Checked on the
# CPU against the chain kernel's torch model and on the H200 through the kernels
# (tests/gpu/test_kda_gpu.py::test_op_chain_split_across_ctas).
SPLIT_LONG_CHAINS = True


# The chain kernel on the H200 (measured 2026-12-02, perf/results/kda.json): one CTA's chunk
# step takes ~1.95 us, so a chain of n chunks takes n x 1.95 us however few CTAs run; a pass
# with enough CTAs moves what it reads and writes at ~3.5 TB/s.
_CHAIN_STEP_S = 2.0e-6
_CHAIN_BYTES_PER_S = 3.5e12
# composition time charged per piece: one ~5 us baddbmm per piece (`_split_chain` under graph
# capture); eager calls' log-depth scan takes ~2 log2(pieces) batched matmuls instead
_COMPOSE_STEP_S = 5e-6


def _chain_pass_bytes(tokens, heads, head_k, head_v):
    """Bytes one chain pass moves: each CTA (64 columns of V) reads w, qg, kg (16-bit) and
    Aqk (fp32) of its chunks; u is read and o written once."""
    return tokens * heads * ((head_v // CHUNK) * (3 * head_k * 2 + CHUNK * 4) + 2 * head_v * 2)


def chain_pieces(chunks_per_seq, heads, head_v, sm_count, *, head_k=None, min_piece=8):
    """Piece length (in chunks) for splitting the sequences' chains, or 0 for no split.

    The chain kernel runs a CTA per (piece, head, 64 columns of V), so few long sequences
    over few heads leave most SMs idle and the time is the longest chain's steps. A split runs
    the chain three times over (the pieces' affine maps M and B, then the outputs from the
    composed start states) plus the composition of the pieces' maps: it pays only where those
    passes, bandwidth-bound once enough CTAs run, beat the unsplit chain's latency (1 x 65536
    at 4-8 heads: yes; 1 x 8192 at 32 heads: no, measured 0.35 -> 0.49 ms with the chain
    kernel of the time, whose step took 2.7 us).
    Pieces are sized so that the output pass has about two CTAs per SM."""
    head_k = head_v if head_k is None else head_k
    longest = max(chunks_per_seq, default=0)
    ctas_per_piece = heads * (head_v // CHUNK)
    want = max(1, (2 * sm_count) // max(ctas_per_piece, 1))
    if want <= len(chunks_per_seq):
        return 0
    piece = max(min_piece, -(-sum(chunks_per_seq) // want))
    if longest < 4 * piece:
        return 0
    stream = _chain_pass_bytes(sum(chunks_per_seq) * CHUNK, heads, head_k, head_v) / _CHAIN_BYTES_PER_S
    unsplit = max(longest * _CHAIN_STEP_S, stream)
    split = 3 * max(stream, piece * _CHAIN_STEP_S) + -(-longest // piece) * _COMPOSE_STEP_S
    return piece if split < 0.8 * unsplit else 0


def _split_bounds(bounds, piece):
    """Each sequence (batch row, start, end) cut into pieces of `piece` chunks (a 0-token
    sequence stays one empty piece); returns the pieces and the first piece of each
    sequence (N + 1 offsets)."""
    out, first = [], [0]
    for b, s0, s1 in bounds:
        cuts = list(range(s0, s1, piece * CHUNK)) or [s0]
        out += [(b, a, min(a + piece * CHUNK, s1)) for a in cuts]
        first.append(len(out))
    return out, first


@functools.lru_cache(maxsize=64)
def _compose_tables(first: tuple, heads: int, device: torch.device):
    """Gather indices of `_split_chain`'s start-state composition for a piece layout (rows
    of (piece, head) matrices; row npc * heads.. is the identity map, the sentinel): per
    doubling step d = 1, 2, 4, .. below the longest sequence's piece count, each piece's
    partner p - d, or the sentinel before its sequence's first piece; each piece's
    predecessor p - 1 (the sentinel for a first piece) and its sequence."""
    npc = first[-1]
    seq = [n for n in range(len(first) - 1) for _ in range(first[n], first[n + 1])]
    hs = torch.arange(heads)

    def rows(pieces):
        return (torch.tensor(pieces, dtype=torch.long)[:, None] * heads + hs).flatten().to(device)

    steps, d = [], 1
    longest = max((b - a for a, b in zip(first, first[1:])), default=0)
    while d < longest:
        steps.append(rows([p - d if p - d >= first[seq[p]] else npc for p in range(npc)]))
        d *= 2
    prev = rows([p - 1 if p > first[seq[p]] else npc for p in range(npc)])
    return steps, prev, rows(seq)


def _split_chain(chain, packed, cu_rows, cu_chunks, first, last, initial_state, o, ht,
                 scan=None):
    """The chain over pieces of the sequences instead of whole sequences. The chain is
    affine per piece p: S_end = M_p S_start + B_p. Pass 1 gets B_p (the chain from S = 0)
    and M_p (the chain from S = I with u = 0: a stride-0 view, no copy) for every piece;
    their composition in fp32 gives each piece's start state; pass 2 is the chain from those
    states, writing o (pass 1's o writes land in o too and are all overwritten) and the
    pieces' final states. ``chain`` is ``_chain`` or a stand-in with its signature;
    ``first``: host list, the first piece of each sequence (N + 1 offsets); ``last``: a
    long tensor on the device, the last piece of each sequence (no host copy here, so the
    call can be captured in a CUDA graph).
    The composition (``scan``; default: on unless the stream is being captured): a
    log-depth scan (Hillis-Steele over each sequence's pieces, ~2 log2(pieces) batched
    matmuls: few launches, for eager calls, which were host-bound on one launch per piece:
    1 x 65536 at 4 heads, 32 pieces, ~1.9 ms of host time per call), or one baddbmm per
    piece (the fewest FLOPs, for a CUDA graph, where launches cost nothing)."""
    w, u, qg, kg, aqk, eg = packed
    npc, h, dk, dv = cu_chunks.shape[0] - 1, w.shape[1], w.shape[-1], u.shape[-1]
    dev = w.device
    nr = npc * h
    if scan is None:
        scan = not (w.is_cuda and torch.cuda.is_current_stream_capturing())
    # the pieces' maps as rows of (piece, head) matrices, plus the identity map (I, 0)
    # behind them; two buffers each: a doubling step reads one and writes the other (few
    # torch ops: eager calls pay ~10-20 us of host time per op on the H200's host)
    eye = torch.eye(dk, dtype=torch.float32, device=dev)
    extra = h if scan else 0
    abuf = torch.empty(2 if scan else 1, nr + extra, dk, dk, dtype=torch.float32, device=dev)
    bbuf = torch.empty(2 if scan else 1, nr + extra, dk, dv, dtype=torch.float32, device=dev)
    a_run, b_run = abuf[:, :nr].unbind(0), bbuf[:, :nr].unbind(0)
    chain(w, u, qg, kg, aqk, eg, cu_rows, cu_chunks, None, o, b_run[0].view(npc, h, dk, dv))
    u0 = torch.zeros(dk, dtype=u.dtype, device=dev).expand(u.shape[0], h, CHUNK, dk)
    scratch = o if dv == dk else o.new_empty(*o.shape[:-1], dk)
    chain(w, u0, qg, kg, aqk, eg, cu_rows, cu_chunks, eye.expand(npc, h, dk, dk), scratch,
          a_run[0].view(npc, h, dk, dk))
    if scan:
        abuf[:, nr:] = eye
        bbuf[:, nr:] = 0.0
        am, bm = abuf.unbind(0), bbuf.unbind(0)
        steps, prev, seq = _compose_tables(tuple(first), h, dev)
        # X_p <- X_p o X_{p-d}: (A, B) o (A', B') = (A A', A B' + B); the last step's A only
        # where an initial state needs it
        cur = 0
        for i, idx in enumerate(steps):
            torch.baddbmm(b_run[cur], a_run[cur], bm[cur].index_select(0, idx), out=b_run[1 - cur])
            if initial_state is not None or i + 1 < len(steps):
                torch.bmm(a_run[cur], am[cur].index_select(0, idx), out=a_run[1 - cur])
            cur = 1 - cur
        # start state of piece p: X_{p-1} (the pieces first..p-1 composed) applied to the
        # sequence's initial state; a first piece gets the identity map
        starts = bm[cur].index_select(0, prev)
        if initial_state is not None:
            h0 = initial_state.reshape(-1, dk, dv).index_select(0, seq)
            starts = torch.baddbmm(starts, am[cur].index_select(0, prev), h0)
        starts = starts.view(npc, h, dk, dv)
    else:
        # S_0 of a sequence is its initial state, S_{i+1} = M_i S_i + B_i
        ms, bs = a_run[0].view(npc, h, dk, dk).unbind(0), b_run[0].view(npc, h, dk, dv).unbind(0)
        starts = torch.zeros(npc, h, dk, dv, dtype=torch.float32, device=dev)
        ss = starts.unbind(0)
        for n in range(len(first) - 1):
            p0, p1 = first[n], first[n + 1]
            if initial_state is not None:
                ss[p0].copy_(initial_state[n])
            for p in range(p0, p1 - 1):
                torch.baddbmm(bs[p], ms[p], ss[p], out=ss[p + 1])
    pieces_ht = torch.empty(npc, h, dk, dv, dtype=torch.float32, device=dev)
    chain(w, u, qg, kg, aqk, eg, cu_rows, cu_chunks, starts, o, pieces_ht)
    ht.copy_(pieces_ht.index_select(0, last))


def _fla_options(use_beta_sigmoid_in_kernel, allow_neg_eigval, return_intermediate_states,
                 state_v_first, cp_context, use_graph, chunk_size, transpose_state_layout):
    """fla.ops.kda.chunk_kda's further options: what this op honours (named errors for the
    rest). Returns state_v_first after the deprecated alias."""
    if transpose_state_layout is not None:
        if state_v_first:
            raise _err("transpose_state_layout", "is the deprecated name of state_v_first: pass one")
        state_v_first = bool(transpose_state_layout)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise _err("allow_neg_eigval", "requires use_beta_sigmoid_in_kernel=True (as in fla)")
    if return_intermediate_states:
        raise NotImplementedError("chunk_kda: argument 'return_intermediate_states' is not "
                                  "supported (the chain keeps its per-chunk states on chip)")
    if cp_context is not None:
        raise NotImplementedError("chunk_kda: argument 'cp_context' (context parallelism) is not supported")
    if use_graph:
        raise NotImplementedError(
            "chunk_kda: argument 'use_graph' (replays with new cu_seqlens contents) is not "
            "supported: pass cu_seqlens_cpu and capture one graph per sequence layout")
    if chunk_size not in (32, 64):
        raise _err("chunk_size", f"must be 32 or 64 (as in fla), got {chunk_size!r}")
    return bool(state_v_first)


def _compat_inputs(beta, initial_state, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                   state_v_first):
    """beta and the initial state as the kernels take them: allow_neg_eigval's 2 sigmoid(beta)
    applied here (the kernels then read a post-sigmoid beta), a V-first state transposed."""
    if allow_neg_eigval:
        beta, use_beta_sigmoid_in_kernel = 2.0 * torch.sigmoid(beta.float()), False
    if state_v_first and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2).contiguous()
    return beta, initial_state, use_beta_sigmoid_in_kernel


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
              lower_bound=None, disable_recompute=False, return_intermediate_states=False,
              state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None,
              use_graph=False, max_num_seqs=None, *, A_log=None, dt_bias=None, chunk_size=64,
              transpose_state_layout=None):
    """KDA chunked prefill (fla.ops.kda.chunk_kda's contract and argument order; see the
    module docstring). Returns (o [B, T, H, V] in q's dtype, final state [N, H, K, V] fp32
    ([N, H, V, K] with state_v_first) or None). fla's further options: allow_neg_eigval (beta
    = 2 sigmoid(beta)) and state_v_first (alias transpose_state_layout) are honoured;
    disable_recompute (a training option) and max_num_seqs (only used with use_graph) change
    nothing here; chunk_size 32 or 64 gives the same result up to rounding (the kernels use
    64); return_intermediate_states, cp_context and use_graph raise NotImplementedError."""
    state_v_first = _fla_options(use_beta_sigmoid_in_kernel, allow_neg_eigval,
                                 return_intermediate_states, state_v_first, cp_context, use_graph,
                                 chunk_size, transpose_state_layout)
    pb = check_kda_args(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                        safe_gate=safe_gate, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
                        cu_seqlens_cpu=cu_seqlens_cpu, state_v_first=state_v_first)
    if not q.is_cuda:
        raise _err("q", f"must be a CUDA tensor, got {q.device}")
    arch = target_arch(q.device)
    if "ada" not in OPS["kda_intra"].designs_on(arch):
        raise NotImplementedError(f"chunk_kda: no KDA kernels for {arch}")
    beta, initial_state, beta_sigmoid = _compat_inputs(
        beta, initial_state, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first)
    # eager calls skip the custom op's dispatch (about half of the host time of a call on a
    # CPU box); torch.compile traces the registered op
    run = _kda_op if torch.compiler.is_compiling() else _kda_impl
    o, ht = run(q, k, v, g, beta, scale, initial_state, bool(output_final_state),
                bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel), bool(beta_sigmoid),
                A_log, dt_bias, None if lower_bound is None else float(lower_bound),
                list(pb.offsets))
    if not output_final_state:
        return o, None
    return o, (ht.transpose(-1, -2).contiguous() if state_v_first else ht)


@functools.lru_cache(maxsize=64)
def _device_tables(bounds: tuple, seqlen: int, device: torch.device):
    """The chunk table and offsets on ``device``, per batch layout: a repeated call (and a
    CUDA-graph capture after a warm-up call) copies nothing from the host."""
    table, cu_rows, cu_chunks = _chunk_table(list(bounds), seqlen)
    return table.to(device), cu_rows.to(device), cu_chunks.to(device)


@functools.lru_cache(maxsize=64)
def _piece_tables(bounds: tuple, piece: int, seqlen: int, device: torch.device):
    """A chain split's tables on ``device`` (cached like `_device_tables`): the first piece of
    each sequence (host list), the pieces' row and chunk offsets, each sequence's last piece."""
    pbounds, first = _split_bounds(list(bounds), piece)
    _, cu_rows, cu_chunks = _device_tables(tuple(pbounds), seqlen, device)
    last = torch.tensor([f - 1 for f in first[1:]], dtype=torch.long).to(device)
    return first, cu_rows, cu_chunks, last


@functools.lru_cache(maxsize=64)
def _chain_piece(bounds: tuple, heads: int, head_k: int, head_v: int, device: torch.device) -> int:
    """`chain_pieces` for a batch layout (cached like `_device_tables`: off the call path)."""
    return chain_pieces([-(-(s1 - s0) // CHUNK) for _, s0, s1 in bounds], heads, head_v,
                        sm_count(device), head_k=head_k)


@torch.library.custom_op("cutekern::chunk_kda", mutates_args=())
def _kda_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, scale: float | None, initial_state: torch.Tensor | None,
            output_final_state: bool, l2norm: bool, gate_in_kernel: bool, beta_sigmoid: bool,
            A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None,
            cu_seqlens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    # reachable as torch.ops.cutekern.chunk_kda without chunk_kda's checks: the launches
    # check their arguments
    return _kda_impl(q, k, v, g, beta, scale, initial_state, output_final_state, l2norm,
                     gate_in_kernel, beta_sigmoid, A_log, dt_bias, lower_bound, cu_seqlens,
                     check=True)


def _kda_impl(q, k, v, g, beta, scale, initial_state, output_final_state, l2norm,
              gate_in_kernel, beta_sigmoid, A_log, dt_bias, lower_bound, cu_seqlens,
              check=False):
    bsz, t, h, dk = q.shape
    dv = v.shape[-1]
    bounds = kda_segments(bsz, t, cu_seqlens)
    dev = q.device
    table, cu_rows, cu_chunks = _device_tables(tuple(bounds), t, dev)
    if table.shape[0]:
        gate_mode = 0 if not gate_in_kernel else (1 if lower_bound is None else 2)
        a_log = A_log if A_log is not None else torch.zeros(h, device=dev)
        dtb = (dt_bias.reshape(h, dk) if dt_bias is not None
               else torch.zeros(h, dk, device=dev))
        packed = _intra(q, k, v, g, beta, table, scale=scale, l2norm=l2norm,
                        beta_sigmoid=beta_sigmoid, gate_mode=gate_mode, a_log=a_log,
                        dt_bias=dtb, lower_bound=lower_bound, check=check)
    # (allocated after the first launch: an eager call's host time up to it shows on the GPU)
    o = torch.empty(bsz, t, h, dv, dtype=q.dtype, device=dev)
    # the chain writes every sequence's final state (0-chunk sequences: the initial one)
    ht = torch.empty(len(bounds), h, dk, dv, dtype=torch.float32, device=dev)
    if table.shape[0]:
        chain = functools.partial(_chain, check=check)
        piece = _chain_piece(tuple(bounds), h, dk, dv, dev) if SPLIT_LONG_CHAINS else 0
        if piece:
            first, cu_rows_p, cu_chunks_p, last = _piece_tables(tuple(bounds), piece, t, dev)
            _split_chain(chain, packed, cu_rows_p, cu_chunks_p, first, last, initial_state, o, ht)
        else:
            chain(*packed, cu_rows, cu_chunks, initial_state, o, ht)
    elif initial_state is not None:
        ht.copy_(initial_state)
    else:
        ht.zero_()
    return o, (ht if output_final_state else ht.new_empty(0, h, dk, dv))


@_kda_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, gate_in_kernel,
      beta_sigmoid, A_log, dt_bias, lower_bound, cu_seqlens):
    bsz, t, h, dk = q.shape
    n = (len(cu_seqlens) - 1) if cu_seqlens else bsz
    o = q.new_empty(bsz, t, h, v.shape[-1])
    return o, q.new_empty(n if output_final_state else 0, h, dk, v.shape[-1], dtype=torch.float32)
