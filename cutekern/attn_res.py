"""AttnRes (Kimi attention residuals), fused serving form, over torch tensors.

    runner = prepare_attn_res(prefix, delta, blocks, norm_weight, qk_weight,
                              output_norm_weight, out, num_blocks=K, block_write_idx=w)
    runner.launch()          # no allocation, no host sync, CUDA-graph capturable
    attn_res(prefix, delta, blocks, norm_weight, qk_weight, num_blocks=K)   # one-shot

One launch per call: prefix += delta (in place, bf16), the optional snapshot write
blocks[:, w] = prefix, then out = [rmsnorm](softmax-over-depth mix of blocks[:, :K] and
prefix). Each source row is read from HBM once (see kernels/CONTRACT_ATTN_RES.md).
"""
from __future__ import annotations

import os

import torch

from ._checks import check_rows16
from .abi import ATTN_RES_WORK_WORDS
from .runtime import stream_scratch

MAX_SLOTS = 8
HIDDEN_TIERS = (8192, 16384)  # compiled variants: on-chip row buffers sized for the tier


def _err(name, msg):
    return ValueError(f"attn_res: argument '{name}' {msg}")


def _rows_ok(name, t, shape):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"attn_res: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"attn_res: argument '{name}' must be bfloat16, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise _err(name, f"must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.numel():
        check_rows16(_err, name, t, "H")


def _span(t):
    if t.numel() == 0:
        return (0, 0)
    lo = t.data_ptr()
    hi = lo + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) * t.element_size() + t.element_size()
    return (lo, hi)


def _validate(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, out,
              num_blocks, block_write_idx, eps, output_norm_eps):
    if not isinstance(prefix, torch.Tensor) or prefix.dim() != 2:
        raise _err("prefix", "must be a 2-D [M, H] tensor"
                   + (f", got shape {tuple(prefix.shape)}" if isinstance(prefix, torch.Tensor) else ""))
    m, h = prefix.shape
    if h % 8 != 0 or h == 0:
        raise _err("prefix", f"hidden size H={h} must be a positive multiple of 8")
    if h > HIDDEN_TIERS[-1]:
        raise _err("prefix", f"hidden size H={h} is over the supported maximum {HIDDEN_TIERS[-1]}")
    _rows_ok("prefix", prefix, (m, h))
    if delta is not None:
        _rows_ok("delta", delta, (m, h))
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 3:
        raise _err("blocks", "must be a 3-D [M, NB, H] tensor")
    nb = blocks.shape[1]
    if not 1 <= nb <= MAX_SLOTS:
        raise _err("blocks", f"must have 1..{MAX_SLOTS} slots (dim 1), got {nb}")
    _rows_ok("blocks", blocks, (m, nb, h))
    for name, w in (("norm_weight", norm_weight), ("qk_weight", qk_weight),
                    ("output_norm_weight", output_norm_weight)):
        if w is None and name == "output_norm_weight":
            continue
        _rows_ok(name, w, (h,))
    _rows_ok("out", out, (m, h))
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or not 0 <= num_blocks <= nb:
        raise _err("num_blocks", f"must be an int in [0, NB={nb}], got {num_blocks!r}")
    if isinstance(block_write_idx, bool) or not isinstance(block_write_idx, int) \
            or not -1 <= block_write_idx < nb:
        raise _err("block_write_idx", f"must be -1 or an int in [0, NB={nb}), got {block_write_idx!r}")
    for name, e in (("eps", eps), ("output_norm_eps", output_norm_eps)):
        if not isinstance(e, (int, float)) or not e >= 0:
            raise _err(name, f"must be a non-negative float, got {e!r}")
    dev = prefix.device
    for name, t in (("delta", delta), ("blocks", blocks), ("norm_weight", norm_weight),
                    ("qk_weight", qk_weight), ("output_norm_weight", output_norm_weight), ("out", out)):
        if t is not None and t.device != dev:
            raise _err(name, f"is on {t.device}, prefix on {dev}")
    if not torch.compiler.is_compiling():
        # out is written while the sources are still being read: it must not overlap them
        o = _span(out)
        for name, t in (("prefix", prefix), ("delta", delta), ("blocks", blocks)):
            if t is not None:
                a = _span(t)
                if o[0] < a[1] and a[0] < o[1]:
                    raise _err("out", f"overlaps '{name}' in memory")
    if dev.type != "cuda":
        raise _err("prefix", f"must be on a CUDA device, got {dev} "
                             f"(cutekern.reference.attn_res_reference is the CPU reference)")


class AttnResRunner:
    """A prepared AttnRes call: ``launch()`` re-runs it on the current stream with whatever
    the tensors hold then (same addresses). Allocates nothing, never syncs the host."""

    def __init__(self, call, m, h, num_blocks, work=None):
        self._call = call
        self._work = work  # the row-scheduler counters the bound call uses (kept alive)
        self.m, self.hidden, self.num_blocks = m, h, num_blocks

    def launch(self):
        if self._call is not None:
            self._call.launch()

    def bytes_moved(self) -> int:
        """The spec's traffic model: (K + 4) * M * H * 2."""
        return (self.num_blocks + 4) * self.m * self.hidden * 2


# rows per launch up to which a row is split over a group of CTAs, per design: with far
# fewer rows than SMs, one CTA per row leaves most of the GPU idle and each row's sources
# stream through one SM. H200, H=7168, K=8, graph replay after the zeroing L2 flush
# (perf/results/tune_memops_h200_attn_res_ada_split.json, two rounds each; us):
# - sm90 (clusters, DSMEM): split 8 up to M=12 (M=4 6.5 vs 6.6-6.7 at split 4, M=8 6.6-6.7 vs
#   6.8-6.9, M=12 7.1-7.2 both), 4 up to M=28 (M=16 7.2-7.3 vs 7.6 at split 8; M=24 7.6-7.7
#   vs 8.0-8.1 at split 2; M=28 7.8 vs 8.2; but M=32 11.2-11.5, apparently more clusters of
#   4 than run at once), 2 up to M=64. (The benchmark's own A/B before, 5 rounds: M=16 7.49
#   split 4 vs 7.78 split 8, perf/results/ab_attn_res_split_h200.json.)
# - ada (no clusters, exchange through global memory): the largest split whose groups, one
#   per row, fit 132 CTAs: 8 up to M=16 (M=1 6.9 vs 7.1-7.3 at split 4, M=8..16 within
#   +-0.2 us), 4 up to 32 (M=20 8.7-8.8 vs 11.2-11.5 at split 8, M=32 9.3 vs 10.1-10.2 at
#   split 2), 2 up to 64 (M=40 10.3-10.4 vs 12.3-12.5, M=64 11.5 vs 14.8 unsplit; M=96 a tie).
# - sm100 (clusters, DSMEM: the sm90 split kernel built for sm_100a / sm_103a): the sm90 rule,
#   never measured (no SM100 GPU here).
_SPLIT_FOR_ROWS = {"sm90": ((12, 8), (28, 4), (64, 2)), "ada": ((16, 8), (32, 4), (64, 2)),
                   "sm100": ((12, 8), (28, 4), (64, 2))}


def _row_split(m, design, tier):
    from .registry import OPS
    have = {dict(f)["row_split"] for _, f in OPS["attn_res"].variants_for(design)
            if dict(f)["max_hidden"] == tier}
    for rows, split in _SPLIT_FOR_ROWS.get(design, ()):
        if m <= rows and split in have:
            return split
    return 1


# sm90, one CTA per row, hidden tier 8192 (where it was measured): the build with the online
# schedule only (a CTA reduction per source, each slot freed as soon as it is consumed) for rows
# of at most one block source (below _ADA_SHORT_ROWS rows), and for launches of at most
# _ONLINE_LOADS loads (rows x (K + 2));
# the batched schedule (one reduction per row, a row's slots held until its mix) otherwise.
# H200, H=7168, same-run A/B, two rounds (perf/results/tune_memops_h200_attn_res_online.json), us
# online vs batched (vs the Ada-design kernel, which served K <= 1 from M = 512 before):
# K=1 M=256 10.9 vs 12.9 (12.2), M=512 16.8 vs 19.1 (17.5-17.9), M=1024 28.0-28.1 vs 30.4-30.7
# (28.2), M=4096 82.6-83.2 vs 84.9 (84.6-86.0); K=4 M=128 10.7 vs 12.3, M=256 15.3-15.4 vs 17.1,
# M=512 25.2 vs 26.0-26.2, M=1024 41.4 vs 41.4-41.8, M=4096 128-130 vs 121.8; K=8 M=128 13.3 vs
# 14.9-15.1, M=256 20.5-20.6 vs 21.5-21.6, M=512 34.4-34.6 vs 33.4-33.5, M=1024 57.4 vs 55.3-55.7.
# The committed benchmark (perf/results/attn_res.json at 6b43da5, with 3072 here) had K=8
# M=256 at 21.7 us online against 21.3 batched the run before, so the bound is 2048 loads.
# At K <= 1 from M = 8192 the Ada-design kernel stays faster (157 vs 168 us online, 163-167
# batched), as before.
_ONLINE_LOADS = 2048
_ADA_SHORT_ROWS = 8192


def choose_kernel(m, h, arch, design, num_blocks=None):
    """(design, flags) of the kernel that serves M rows of hidden size H (num_blocks K).

    Each arch runs its own design (on sm_90a: the cluster-split sm90 kernel for small M, the
    sm90 kernel from M = 128, in its online-schedule build for short rows or few rows, see
    _ONLINE_LOADS; the Ada-design kernel, also built for sm_90a, for K <= 1 from M = 8192).
    $CUTEKERN_DESIGN forces a design (then no switch to another design)."""
    from .arch import DESIGNS_FOR_ARCH, ENV_DESIGN
    from .registry import OPS
    tier = next(t for t in HIDDEN_TIERS if h <= t)
    k = 8 if num_blocks is None else num_blocks
    if (not os.environ.get(ENV_DESIGN) and design == "sm90" and "ada" in DESIGNS_FOR_ARCH[arch]
            and k <= 1 and m >= _ADA_SHORT_ROWS and tier == HIDDEN_TIERS[0]):
        design = "ada"
    # $CUTEKERN_ATTN_RES_SPLIT forces a split (tuning sweeps, perf/tune_memops.py)
    split = int(os.environ.get("CUTEKERN_ATTN_RES_SPLIT", 0)) or _row_split(m, design, tier)
    flags = {"max_hidden": tier, "row_split": split}
    if OPS["attn_res"].has_flag(design, "online"):
        flags["online"] = bool(split == 1 and tier == HIDDEN_TIERS[0] and (
            (k <= 1 and m < _ADA_SHORT_ROWS) or m * (k + 2) <= _ONLINE_LOADS))
    return design, flags


def _function(m, h, num_blocks, device):
    """(bound-able kernel function, words of `work` it needs)."""
    from .arch import target_arch, target_design
    from .dispatch import get_function
    arch = target_arch(device)
    design, flags = choose_kernel(m, h, arch, target_design(arch), num_blocks)
    fn = get_function("attn_res", {"dtype": "bfloat16"}, flags, device, design=design)
    # the Ada design's split kernels exchange through records in `work` (cutekern/abi.py)
    words = ATTN_RES_WORK_WORDS if design == "ada" and flags["row_split"] > 1 else 2
    return fn, words


_ONESHOT_WORK: dict = {}


def _oneshot_work(device):
    """The `work` buffer of one-shot calls (row-scheduler counters, exchange records): one
    per (device, stream), since launches on one stream never overlap, the kernels leave the
    counters zero and the records' sequence numbers stay consistent whatever the M of each
    call; a fresh one while a CUDA graph is being captured (the capture then owns it)."""
    return stream_scratch(_ONESHOT_WORK, device, ATTN_RES_WORK_WORDS)


def prepare_attn_res(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, out, *,
                     num_blocks, block_write_idx=-1, eps=1e-5, output_norm_eps=1e-5,
                     _work=None) -> AttnResRunner:
    """Validate once and bind the kernel (see the module docstring for the math).

    prefix [M, H] (updated in place when ``delta`` is given), delta [M, H] or None,
    blocks [M, NB, H] (NB <= 8; slot ``block_write_idx`` receives the new prefix when >= 0),
    norm_weight, qk_weight [H], output_norm_weight [H] or None, out [M, H]; all bf16 on one
    CUDA device, H a multiple of 8 up to 16384; num_blocks K in [0, NB].
    """
    _validate(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, out,
              num_blocks, block_write_idx, eps, output_norm_eps)
    m, h = prefix.shape
    if m == 0:
        return AttnResRunner(None, m, h, num_blocks)
    fn, words = _function(m, h, num_blocks, prefix.device)
    # the runner owns its scheduler counters (zero; every launch leaves them zero) and the
    # split kernels' exchange records (sequence numbers that run on across its launches)
    work = _work if _work is not None else torch.zeros(words, dtype=torch.int32,
                                                       device=prefix.device)
    call = fn.bind(prefix, prefix if delta is None else delta, blocks, norm_weight, qk_weight,
                   norm_weight if output_norm_weight is None else output_norm_weight, out,
                   int(num_blocks), int(block_write_idx), int(delta is not None),
                   int(output_norm_weight is not None), float(eps), float(output_norm_eps),
                   work)
    return AttnResRunner(call, m, h, num_blocks, work)


def attn_res(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight=None, out=None, *,
             num_blocks, block_write_idx=-1, eps=1e-5, output_norm_eps=1e-5):
    """One-shot AttnRes; returns ``out`` (allocated when None). Same contract as
    ``prepare_attn_res``; works under torch.compile (custom op ``cutekern::attn_res``)."""
    if out is None and isinstance(prefix, torch.Tensor):
        out = torch.empty_like(prefix, memory_format=torch.contiguous_format)
    if torch.compiler.is_compiling():
        torch.ops.cutekern.attn_res(prefix, delta, blocks, norm_weight, qk_weight,
                                    output_norm_weight, out, num_blocks, block_write_idx,
                                    float(eps), float(output_norm_eps))
    else:
        prepare_attn_res(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, out,
                         num_blocks=num_blocks, block_write_idx=block_write_idx, eps=eps,
                         output_norm_eps=output_norm_eps,
                         _work=_oneshot_work(prefix.device)
                         if isinstance(prefix, torch.Tensor) and prefix.is_cuda else None).launch()
    return out


@torch.library.custom_op("cutekern::attn_res", mutates_args=("prefix", "blocks", "out"))
def _attn_res_op(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
                 norm_weight: torch.Tensor, qk_weight: torch.Tensor,
                 output_norm_weight: torch.Tensor | None, out: torch.Tensor, num_blocks: int,
                 block_write_idx: int, eps: float, output_norm_eps: float) -> None:
    prepare_attn_res(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, out,
                     num_blocks=num_blocks, block_write_idx=block_write_idx, eps=eps,
                     output_norm_eps=output_norm_eps,
                     _work=_oneshot_work(prefix.device)).launch()


@_attn_res_op.register_fake
def _(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, out, num_blocks,
      block_write_idx, eps, output_norm_eps):
    return None
