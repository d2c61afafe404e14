"""Deterministic MoE-LoRA shrink / expand (BGMV for mixture-of-experts layers).

    plan = prepare_bgmv_moe(x, lora_a, lora_b, topk_ids, topk_weights, lora_indices)
    plan.run()      # shrink + expand: no allocation, no host sync, CUDA-graph capturable
    plan.out        # [T, H_out] fp32 (finalized), or [T*k, H_out] per pair
    s = bgmv_moe_shrink(x, lora_a, topk_ids, lora_indices)              # [T*k, r]
    y = bgmv_moe_expand(s, lora_b, topk_ids, lora_indices, topk_weights)  # [T, H_out]

Pairs p = t * k + j. Tokens with lora -1 contribute zero. Pairs may be processed in token
order (default) or in an expert-sorted order (``sorted_token_ids``, vLLM's
moe_align_block_size layout: pair indices, entries >= T*k are padding); the result is the
same, bit for bit. Every output element is produced by one owner with a fixed fp32
summation order and no atomics, so results are bitwise reproducible and batch-invariant
(a token's result does not depend on the other tokens). See kernels/CONTRACT_BGMV.md.
"""
from __future__ import annotations

import torch

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
MAX_TOPK, MAX_LORAS, MAX_EXPERTS = 8, 16, 512
RANKS = (8, 64)  # inclusive range; multiples of 8


def _err(op, name, msg):
    return ValueError(f"{op}: argument '{name}' {msg}")


def _tensor(op, name, t, dtype, rank):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        raise TypeError(f"{op}: argument '{name}' must be "
                        f"{' or '.join(str(d) for d in (dtype if isinstance(dtype, tuple) else (dtype,)))}"
                        f", got {t.dtype}")
    if t.dim() != rank:
        raise _err(op, name, f"must be {rank}-D, got shape {tuple(t.shape)}")


def _contig(op, name, t, align_bytes=16):
    """Contiguous; 16-byte aligned for the rows the kernels copy in 16-byte pieces, natural
    alignment for the index / weight tables (read element by element)."""
    if t.numel() == 0:
        return
    if not t.is_contiguous():
        raise _err(op, name, "must be contiguous")
    if not torch.compiler.is_compiling() and t.data_ptr() % align_bytes != 0:
        raise _err(op, name, f"data pointer must be {align_bytes}-byte aligned")


def _check_routing(op, topk_ids, topk_weights, lora_indices, t, dev, need_weights):
    _tensor(op, "topk_ids", topk_ids, torch.int32, 2)
    if topk_ids.shape[0] != t:
        raise _err(op, "topk_ids", f"must have T={t} rows, got shape {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    if not 1 <= k <= MAX_TOPK:
        raise _err(op, "topk_ids", f"top-k {k} must be in 1..{MAX_TOPK}")
    _contig(op, "topk_ids", topk_ids, 4)
    _tensor(op, "lora_indices", lora_indices, torch.int32, 1)
    if lora_indices.shape[0] != t:
        raise _err(op, "lora_indices", f"must have T={t} entries, got {lora_indices.shape[0]}")
    _contig(op, "lora_indices", lora_indices, 4)
    if need_weights:
        _tensor(op, "topk_weights", topk_weights, torch.float32, 2)
        if tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise _err(op, "topk_weights", f"must have the shape of topk_ids {tuple(topk_ids.shape)}, "
                                           f"got {tuple(topk_weights.shape)}")
        _contig(op, "topk_weights", topk_weights, 4)
    for name, x in (("topk_ids", topk_ids), ("lora_indices", lora_indices),
                    ("topk_weights", topk_weights if need_weights else None)):
        if x is not None and x.device != dev:
            raise _err(op, name, f"is on {x.device}, expected {dev}")
    return k


def _check_values(op, topk_ids, lora_indices, num_loras, num_experts, order=None, num_pairs=0):
    """Index ranges, one device sync (prepare time only; never inside a capture)."""
    if topk_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    checks = [torch.zeros((), dtype=torch.bool, device=topk_ids.device)] * 3
    if topk_ids.numel():
        checks[0] = (topk_ids.min() < 0) | (topk_ids.max() >= num_experts)
        checks[1] = (lora_indices.min() < -1) | (lora_indices.max() >= num_loras)
    if order is not None:
        valid = order[(order >= 0) & (order < num_pairs)]
        seen = torch.zeros(num_pairs, dtype=torch.int32, device=order.device)
        seen.index_add_(0, valid.long(), torch.ones_like(valid))
        checks[2] = (order < 0).any() | (seen != 1).any()
    flags = torch.stack(checks).tolist()
    if flags[0]:
        raise _err(op, "topk_ids", f"has expert ids outside [0, E={num_experts})")
    if flags[1]:
        raise _err(op, "lora_indices", f"has values outside [-1, L={num_loras})")
    if flags[2]:
        raise _err(op, "sorted_token_ids", f"must name every pair in [0, T*k={num_pairs}) exactly once "
                                           f"(other entries must be >= T*k padding)")


def _check_x_a(op, x, lora_a):
    _tensor(op, "x", x, tuple(_DTYPES), 2)
    _tensor(op, "lora_a", lora_a, x.dtype, 4)
    t, h = x.shape
    num_l, num_e, r, ha = lora_a.shape
    if ha != h:
        raise _err(op, "lora_a", f"must be [L, E, r, H] with H={h} like x, got shape {tuple(lora_a.shape)}")
    if h % 8 != 0 or h == 0:
        raise _err(op, "x", f"hidden size {h} must be a positive multiple of 8")
    _check_dims(op, "lora_a", num_l, num_e, r)
    if r * h >= 2 ** 31:  # the sm90 bin kernels address one (adapter, expert) slab in int32
        raise _err(op, "lora_a", f"one adapter/expert slab r*H = {r * h} elements must be < 2^31")
    _contig(op, "x", x)
    _contig(op, "lora_a", lora_a)
    if lora_a.device != x.device:
        raise _err(op, "lora_a", f"is on {lora_a.device}, x on {x.device}")
    return t, h, num_l, num_e, r


def _require_cuda(op, name, t):
    # last of the checks, so CPU-only machines can test all the others
    if t.device.type != "cuda":
        raise _err(op, name, f"must be on a CUDA device, got {t.device} (cutekern.reference has the reference)")


def _check_dims(op, name, num_l, num_e, r):
    if not 1 <= num_l <= MAX_LORAS:
        raise _err(op, name, f"must have 1..{MAX_LORAS} adapters (dim 0), got {num_l}")
    if not 1 <= num_e <= MAX_EXPERTS:
        raise _err(op, name, f"must have 1..{MAX_EXPERTS} experts (dim 1), got {num_e}")
    if not (RANKS[0] <= r <= RANKS[1] and r % 8 == 0):
        raise _err(op, name, f"rank {r} must be a multiple of 8 in [{RANKS[0]}, {RANKS[1]}]")


def _check_b(op, lora_b, s_dtype, num_l, num_e, r, dev):
    _tensor(op, "lora_b", lora_b, s_dtype, 4)
    lb, eb, n, rb = lora_b.shape
    if (lb, eb, rb) != (num_l, num_e, r):
        raise _err(op, "lora_b", f"must be [L={num_l}, E={num_e}, H_out, r={r}], got shape {tuple(lora_b.shape)}")
    if n % 8 != 0 or n == 0:
        raise _err(op, "lora_b", f"output size H_out={n} must be a positive multiple of 8")
    if n * r >= 2 ** 31:  # the sm90 bin kernels address one (adapter, expert) slab in int32
        raise _err(op, "lora_b", f"one adapter/expert slab H_out*r = {n * r} elements must be < 2^31")
    _contig(op, "lora_b", lora_b)
    if lora_b.device != dev:
        raise _err(op, "lora_b", f"is on {lora_b.device}, expected {dev}")
    return n


def _check_out(op, name, out, shape, dtype, dev):
    if out is None:
        return
    _tensor(op, name, out, dtype, len(shape))
    if tuple(out.shape) != tuple(shape):
        raise _err(op, name, f"must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.device != dev:
        raise _err(op, name, f"is on {out.device}, expected {dev}")
    _contig(op, name, out)


def _workspace(expand_fn, p, n, finalize, y, device):
    """fp32 [P, N] workspace of the bin-grouped expand (large T, finalize): per-pair deltas
    summed per token by a second, fixed-order pass. Small problems run the pair schedule,
    which never touches it, so they get a one-row stand-in instead of P * N * 4 bytes."""
    if not finalize:
        return y
    rows = p if p >= _bin_threshold(expand_fn) else 1
    return torch.empty(rows, n, dtype=torch.float32, device=device)


def _nbytes(ws, y) -> int:
    """Bytes of a plan's own workspace (0 where the kernels write y directly)."""
    return 0 if ws is y else ws.numel() * ws.element_size()


def _bin_threshold(fn) -> int:
    """P from which a variant runs its bin schedule (its config's bin_min*; 0 when none)."""
    cfg = fn.meta.get("config", {})
    return int(next((v for k, v in cfg.items() if k.startswith("bin_min")), 0))


def _pair_plan_max(fn) -> int:
    """P up to which a plan runs the variant's one-launch small-batch kernel (0: none)."""
    return int(fn.meta.get("config", {}).get("pair_max_pairs", 0))


# The small-batch plan kernel's CTAs wait for the other CTAs of their token (ceil(H_out / 64)
# of them, consecutive blocks): bounded so a token's group always fits the GPU at once.
_PAIR_PLAN_MAX_COLS = 8192


def _pair_plan_fits(fn, t, k, r, h, n, dev) -> bool:
    """Whether a plan runs the variant's small-batch kernel: it has one (T*k <= its
    pair_max_pairs), rank <= 32, H_out <= _PAIR_PLAN_MAX_COLS, and where it measured faster
    than the two pair kernels (Ada design, H200):
    its grid (a CTA per token and 64 output columns) fits one wave of the device (beyond, the
    CTAs of a late wave hold up their tokens' earlier ones: T=12 at H_out=2688, 1.3 waves,
    22 us against 16), and each of its unit warps takes at most one of the token's shrink
    units (a second one waits for the CTA's b vectors too: top-8 H=3072 T=4 / 8, 1.3 units
    per warp, 14.5 / 19.3 us against 13.5 / 18.1; perf/results/ab_bgmv_small_h200.json)."""
    from .abi import BGMV_PAIR_COLS, BGMV_PAIR_SMEM_BYTES, BGMV_SEG_H
    if t * k > _pair_plan_max(fn) or r > 32 or n > _PAIR_PLAN_MAX_COLS:
        return False
    cfg = fn.meta.get("config", {})
    ctas = -(-n // BGMV_PAIR_COLS)
    if k * (r // 8) * -(-h // BGMV_SEG_H) > int(cfg.get("pair_unit_warps", 0)) * ctas:
        return False
    props = torch.cuda.get_device_properties(dev)
    smem = getattr(props, "shared_memory_per_multiprocessor", 0) or BGMV_PAIR_SMEM_BYTES
    per_sm = min(int(cfg.get("pair_ctas_per_sm", 1)), max(1, smem // BGMV_PAIR_SMEM_BYTES))
    return t * ctas <= props.multi_processor_count * per_sm


def _pair_xch(t, k, r, h, n, dev, extra_words=0):
    """The small-batch kernel's exchange buffer (its `ws`, [rows, H_out] fp32), zeroed: it
    holds the launch counts. ``extra_words``: 8-byte words after it (debug timelines)."""
    from .abi import bgmv_pair_xch_words
    words = bgmv_pair_xch_words(t, k, r, h, n) + extra_words
    return torch.zeros(-(-2 * words // n), n, dtype=torch.float32, device=dev)


def _check_order(op, sorted_token_ids, dev):
    if sorted_token_ids is not None:
        _tensor(op, "sorted_token_ids", sorted_token_ids, torch.int32, 1)
        _contig(op, "sorted_token_ids", sorted_token_ids, 4)
        if sorted_token_ids.device != dev:
            raise _err(op, "sorted_token_ids", f"is on {sorted_token_ids.device}, x on {dev}")


def _order(sorted_token_ids, p, dev):
    """The shrink's processing order: the caller's expert-sorted pairs, or token order."""
    return sorted_token_ids if sorted_token_ids is not None else \
        torch.arange(p, dtype=torch.int32, device=dev)


def _expand_weights(topk_weights, finalize, t, k, dev):
    # the per-pair expand never reads the routing weights; it still takes a [T, k] fp32 tensor
    return topk_weights if finalize else torch.zeros(t, k, dtype=torch.float32, device=dev)


def _expand_function(dtype, finalize, device, after_shrink):
    """``after_shrink``: launched right after this module's shrink (a plan), so a design
    that has such a variant may overlap the two (sm90: PDL, kernels/CONTRACT_BGMV.md)."""
    from .arch import target_arch, target_design
    from .dispatch import get_function
    flags = {"finalize": bool(finalize)}
    from .registry import OPS
    if OPS["bgmv_expand"].has_flag(target_design(target_arch(device)), "after_shrink"):
        flags["after_shrink"] = bool(after_shrink)
    return get_function("bgmv_expand", {"dtype": _DTYPES[dtype]}, flags, device)


def _binplan_function(dtype, finalize, device):
    """The one-launch plan kernel of large batches, where the target design has one."""
    from .arch import target_arch, target_design
    from .dispatch import get_function
    from .registry import OPS
    if target_design(target_arch(device)) not in OPS["bgmv_binplan"].designs:
        return None
    return get_function("bgmv_binplan", {"dtype": _DTYPES[dtype]}, {"finalize": bool(finalize)},
                        device)


def _functions(dtype, finalize, device):
    from .dispatch import get_function
    return (get_function("bgmv_shrink", {"dtype": _DTYPES[dtype]}, {}, device),
            _expand_function(dtype, finalize, device, after_shrink=True))


class BgmvMoePlan:
    """Bound shrink + expand launches over fixed buffers. ``run()`` re-runs both on the
    current stream with the tensors' current contents: it allocates nothing, never syncs
    the host and can be captured in a CUDA graph (one replay = shrink + expand)."""

    def __init__(self, calls, shrink_out, out, meta):
        self._calls = tuple(calls)
        self.shrink_out, self.out = shrink_out, out
        self.meta = meta

    def run(self):
        for c in self._calls:
            c.launch()
        return self.out

    def bytes_moved(self, bins_touched: int) -> int:
        """The spec's roofline bytes for U = ``bins_touched`` distinct (adapter, expert) bins."""
        m = self.meta
        b = m["elem_bytes"]
        idx = m["T"] * 4 + m["P"] * 8
        shrink = m["T"] * m["H"] * b + bins_touched * m["r"] * m["H"] * b + m["P"] * m["r"] * b + idx
        expand = m["P"] * m["r"] * b + bins_touched * m["N"] * m["r"] * b + m["T"] * m["N"] * 4 + idx
        return shrink + expand


def prepare_bgmv_moe(x, lora_a, lora_b, topk_ids, topk_weights, lora_indices, *,
                     sorted_token_ids=None, finalize=True, out=None, shrink_out=None,
                     check_indices=True, fused=None) -> BgmvMoePlan:
    """Validate everything once and bind shrink + expand.

    x [T, H] (fp16/bf16), lora_a [L, E, r, H], lora_b [L, E, H_out, r] (same dtype),
    topk_ids int32 [T, k] in [0, E), topk_weights fp32 [T, k], lora_indices int32 [T] in
    [-1, L). ``finalize``: out [T, H_out] fp32 = sum_j w[t, j] * delta(t, j); otherwise
    out [T*k, H_out] fp32 holds the unweighted per-pair deltas. ``sorted_token_ids``
    (int32, optional): the pairs in expert-sorted order (padding entries >= T*k).
    ``check_indices`` checks the index values now (one device sync); run() never checks,
    so replays with new routing must keep ids in range (out-of-range pairs are skipped).
    ``fused`` (None or True: where available): large batches (T*k >= the kernel's
    bin_min_pairs, 384) run shrink and expand of each (adapter, expert) bin in one launch,
    and small ones (T*k <= its pair_max_pairs, rank <= 32, H_out <= 8192) shrink and expand
    in one launch too (Ada design; sm90 overlaps its two small-batch kernels through PDL),
    where the design has those kernels; False keeps the two kernels. The results are
    bit-identical either way; ``plan.meta["fused"]`` says which ran. A plan's launches must
    not overlap each other (one stream at a time): the small-batch kernel keeps launch
    counts in its own buffer. ``plan.meta["workspace_bytes"]``: the size of the plan's workspace
    buffer; finalized large batches (T*k >= 384) need an fp32 [T*k, H_out] workspace
    (T=4096, top-8, H_out=4096: 512 MiB).
    """
    op = "prepare_bgmv_moe"
    t, h, num_l, num_e, r = _check_x_a(op, x, lora_a)
    dev = x.device
    k = _check_routing(op, topk_ids, topk_weights, lora_indices, t, dev, need_weights=finalize)
    n = _check_b(op, lora_b, x.dtype, num_l, num_e, r, dev)
    p = t * k
    _check_order(op, sorted_token_ids, dev)
    _check_out(op, "shrink_out", shrink_out, (p, r), x.dtype, dev)
    _check_out(op, "out", out, (t, n) if finalize else (p, n), torch.float32, dev)
    _require_cuda(op, "x", x)
    if check_indices:
        _check_values(op, topk_ids, lora_indices, num_l, num_e, sorted_token_ids, p)
    s = shrink_out if shrink_out is not None else torch.empty(p, r, dtype=x.dtype, device=dev)
    y = out if out is not None else torch.empty((t, n) if finalize else (p, n), dtype=torch.float32,
                                                device=dev)
    meta = {"T": t, "k": k, "P": p, "H": h, "N": n, "r": r, "L": num_l, "E": num_e,
            "elem_bytes": x.element_size(), "finalize": finalize}
    if t == 0:
        return BgmvMoePlan((), s, y, dict(meta, fused=False, workspace_bytes=0))
    w = _expand_weights(topk_weights, finalize, t, k, dev)
    fused_fn = _binplan_function(x.dtype, finalize, dev) if fused is not False else None
    if fused_fn is not None and p >= _bin_threshold(fused_fn):
        # (bin schedules only: `order` is not used, the pairs are collected per bin)
        ws = _workspace(fused_fn, p, n, finalize, y, dev)
        fc = fused_fn.bind(x, lora_a, lora_b, topk_ids, lora_indices, w, s, y, ws)
        plan = BgmvMoePlan((fc,), s, y, dict(meta, fused=True, workspace_bytes=_nbytes(ws, y)))
        plan._keep = (w, ws)
        return plan
    if fused_fn is not None and _pair_plan_fits(fused_fn, t, k, r, h, n, dev):
        xch = _pair_xch(t, k, r, h, n, dev)
        fc = fused_fn.bind(x, lora_a, lora_b, topk_ids, lora_indices, w, s, y, xch)
        plan = BgmvMoePlan((fc,), s, y, dict(meta, fused=True, workspace_bytes=_nbytes(xch, y)))
        plan._keep = (w, xch)
        return plan
    order = _order(sorted_token_ids, p, dev)
    shrink_fn, expand_fn = _functions(x.dtype, finalize, dev)
    ws = _workspace(expand_fn, p, n, finalize, y, dev)
    sc = shrink_fn.bind(x, lora_a, topk_ids, lora_indices, order, s)
    ec = expand_fn.bind(s, lora_b, topk_ids, lora_indices, w, y, ws)
    plan = BgmvMoePlan((sc, ec), s, y, dict(meta, fused=False, workspace_bytes=_nbytes(ws, y)))
    plan._keep = (order, w, ws)
    return plan


def bgmv_moe_shrink(x, lora_a, topk_ids, lora_indices, *, sorted_token_ids=None, out=None,
                    check_indices=True):
    """s [T*k, r] in x's dtype: s[t*k + j] = x[t] @ lora_a[lora[t], topk_ids[t, j]]^T (fp32
    accumulation; 0 for tokens with lora -1)."""
    if torch.compiler.is_compiling():
        return torch.ops.cutekern.bgmv_moe_shrink(x, lora_a, topk_ids, lora_indices, sorted_token_ids)
    return _shrink_impl(x, lora_a, topk_ids, lora_indices, sorted_token_ids, out, check_indices)


def _shrink_impl(x, lora_a, topk_ids, lora_indices, sorted_token_ids, out, check_indices):
    op = "bgmv_moe_shrink"
    t, h, num_l, num_e, r = _check_x_a(op, x, lora_a)
    k = _check_routing(op, topk_ids, None, lora_indices, t, x.device, need_weights=False)
    p = t * k
    _check_order(op, sorted_token_ids, x.device)
    _check_out(op, "out", out, (p, r), x.dtype, x.device)
    _require_cuda(op, "x", x)
    if check_indices:
        _check_values(op, topk_ids, lora_indices, num_l, num_e, sorted_token_ids, p)
    s = out if out is not None else torch.empty(p, r, dtype=x.dtype, device=x.device)
    if t == 0:
        return s
    from .dispatch import get_function
    fn = get_function("bgmv_shrink", {"dtype": _DTYPES[x.dtype]}, {}, x.device)
    fn(x, lora_a, topk_ids, lora_indices, _order(sorted_token_ids, p, x.device), s)
    return s


def bgmv_moe_expand(s, lora_b, topk_ids, lora_indices, topk_weights=None, *, finalize=True,
                    out=None, check_indices=True):
    """fp32 expand of a shrink result s [T*k, r]: finalized y [T, H_out] = sum_j
    topk_weights[t, j] * s[t*k+j] @ lora_b[lora[t], e]^T (needs topk_weights), or per pair
    [T*k, H_out] (unweighted) with ``finalize=False``."""
    if torch.compiler.is_compiling():
        return torch.ops.cutekern.bgmv_moe_expand(s, lora_b, topk_ids, lora_indices, topk_weights, finalize)
    return _expand_impl(s, lora_b, topk_ids, lora_indices, topk_weights, finalize, out, check_indices)


def _expand_impl(s, lora_b, topk_ids, lora_indices, topk_weights, finalize, out, check_indices):
    op = "bgmv_moe_expand"
    _tensor(op, "s", s, tuple(_DTYPES), 2)
    _tensor(op, "lora_b", lora_b, s.dtype, 4)
    num_l, num_e, n, r = lora_b.shape
    _check_dims(op, "lora_b", num_l, num_e, r)
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise _err(op, "topk_ids", "must be a 2-D int32 [T, k] tensor")
    t = topk_ids.shape[0]
    if finalize and topk_weights is None:
        raise _err(op, "topk_weights", "is required when finalize=True")
    k = _check_routing(op, topk_ids, topk_weights, lora_indices, t, s.device, need_weights=finalize)
    if tuple(s.shape) != (t * k, r):
        raise _err(op, "s", f"must have shape (T*k={t * k}, r={r}), got {tuple(s.shape)}")
    _contig(op, "s", s)
    _check_b(op, lora_b, s.dtype, num_l, num_e, r, s.device)
    shape = (t, n) if finalize else (t * k, n)
    _check_out(op, "out", out, shape, torch.float32, s.device)
    _require_cuda(op, "s", s)
    if check_indices:
        _check_values(op, topk_ids, lora_indices, num_l, num_e)
    y = out if out is not None else torch.empty(shape, dtype=torch.float32, device=s.device)
    if t == 0:
        return y
    fn = _expand_function(s.dtype, finalize, s.device, after_shrink=False)
    fn(s, lora_b, topk_ids, lora_indices, _expand_weights(topk_weights, finalize, t, k, s.device),
       y, _workspace(fn, t * k, n, finalize, y, s.device))
    return y


# ------------------------------------------------------------------ torch custom ops
# (torch.compile; index values are checked by the prepare-time API, not inside graphs)
@torch.library.custom_op("cutekern::bgmv_moe_shrink", mutates_args=())
def _shrink_op(x: torch.Tensor, lora_a: torch.Tensor, topk_ids: torch.Tensor,
               lora_indices: torch.Tensor, sorted_token_ids: torch.Tensor | None) -> torch.Tensor:
    return _shrink_impl(x, lora_a, topk_ids, lora_indices, sorted_token_ids, None, False)


@_shrink_op.register_fake
def _(x, lora_a, topk_ids, lora_indices, sorted_token_ids):
    return x.new_empty(topk_ids.shape[0] * topk_ids.shape[1], lora_a.shape[2])


@torch.library.custom_op("cutekern::bgmv_moe_expand", mutates_args=())
def _expand_op(s: torch.Tensor, lora_b: torch.Tensor, topk_ids: torch.Tensor,
               lora_indices: torch.Tensor, topk_weights: torch.Tensor | None,
               finalize: bool) -> torch.Tensor:
    return _expand_impl(s, lora_b, topk_ids, lora_indices, topk_weights, finalize, None, False)


@_expand_op.register_fake
def _(s, lora_b, topk_ids, lora_indices, topk_weights, finalize):
    rows = topk_ids.shape[0] if finalize else s.shape[0]
    return s.new_empty(rows, lora_b.shape[2], dtype=torch.float32)
