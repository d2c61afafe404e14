"""IKBO ops over torch tensors: user x candidate kernels that never broadcast user tensors.

    lce = LinearCompression(w_cand, w_user)     # pads weights once (16-byte rows)
    out = lce(e_cand, e_user, cand_to_user)     # [B, M, N]
    plan = lce.plan(e_cand, e_user, cand_to_user, out)   # validate + bind once ...
    plan.run()                                  # ... then two launches per run (no checks)
    out = linear_compression(w_cand, w_user, e_cand, e_user, cand_to_user)  # one-shot

Both run two launches of one kernel class: the user GEMM once per user into fp32
partials [U, M, N], then the candidate GEMM whose epilogue adds the partial tile of
``cand_to_user[b]`` (a gather mode of the user view; no [B, M, N] intermediate).
"""
from __future__ import annotations

import functools
import os

import torch

from ._checks import check_rows16
from .arch import sm_count
from .dispatch import env_key
from .reference import pad_k
from .runtime import _raw_stream

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _err(name, msg):
    return ValueError(f"linear_compression: argument '{name}' {msg}")


def _check_weight(name, w, dtype=None, m=None):
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"linear_compression: argument '{name}' must be a torch.Tensor")
    if w.dtype not in _DTYPES:
        raise TypeError(f"linear_compression: argument '{name}' must be float16 or bfloat16, got {w.dtype}")
    if dtype is not None and w.dtype != dtype:
        raise TypeError(f"linear_compression: argument '{name}' must have dtype {dtype} like w_cand, got {w.dtype}")
    if w.dim() != 2:
        raise _err(name, f"must be 2-D [M, K], got shape {tuple(w.shape)}")
    if m is not None and w.shape[0] != m:
        raise _err(name, f"must have M={m} rows like w_cand, got {w.shape[0]}")


def _check_rows16(name, t):
    """Embedding tensors go to the kernel as they are: N contiguous, 16-byte aligned rows."""
    if t.shape[-1] % 8 != 0:
        raise _err(name, f"last dim N={t.shape[-1]} must be a multiple of 8 (16-byte rows)")
    check_rows16(_err, name, t, "N")


class LinearCompression:
    """Prepared IKBO Linear Compression Embedding: weights padded once, then any batch.

    w_cand [M, K_cand], w_user [M, K_user] (fp16 or bf16, same dtype, same device).
    """

    def __init__(self, w_cand: torch.Tensor, w_user: torch.Tensor):
        _check_weight("w_cand", w_cand)
        _check_weight("w_user", w_user, w_cand.dtype, w_cand.shape[0])
        if w_user.device != w_cand.device:
            raise _err("w_user", f"is on {w_user.device}, w_cand on {w_cand.device}")
        self.m = w_cand.shape[0]
        self.k_cand, self.k_user = w_cand.shape[1], w_user.shape[1]
        self.dtype = w_cand.dtype
        # zero pad keeps the k-tail exact; the kernel also relies on it (see kernels/CONTRACT.md)
        self.w_cand = pad_k(w_cand)
        self.w_user = pad_k(w_user)

    def __call__(self, e_cand, e_user, cand_to_user, out=None, *, check_indices=True):
        _validate(self, e_cand, e_user, cand_to_user, out)
        if not torch.compiler.is_compiling():
            # eager: skip the custom-op dispatcher (tens of microseconds of host time)
            if check_indices:
                _check_indices(cand_to_user, e_user.shape[0])
            if out is None:
                out = torch.empty(e_cand.shape[0], self.m, e_cand.shape[2], dtype=self.dtype,
                                  device=e_cand.device)
            return _launch(self.w_cand, self.w_user, e_cand, e_user, cand_to_user, out, check=False)
        if out is None:
            return torch.ops.cutekern.lce(self.w_cand, self.w_user, e_cand, e_user,
                                          cand_to_user, check_indices)
        torch.ops.cutekern.lce_out(self.w_cand, self.w_user, e_cand, e_user, cand_to_user,
                                   out, check_indices)
        return out

    def plan(self, e_cand, e_user, cand_to_user, out=None, *, check_indices=True) -> "LcePlan":
        """Validate and bind one batch's tensors once (FlashInfer-style plan / run):
        ``run()`` then re-runs both phases on the current stream with the tensors' current
        contents (same shapes and addresses) at ~2 launches of host cost, no validation, no
        allocation, no host sync; capturable in a CUDA graph. ``check_indices`` checks
        cand_to_user's values now (one sync); run() never does, so keep them in range."""
        _validate(self, e_cand, e_user, cand_to_user, out)
        if check_indices:
            _check_indices(cand_to_user, e_user.shape[0])
        if out is None:
            out = torch.empty(e_cand.shape[0], self.m, e_cand.shape[2], dtype=self.dtype,
                              device=e_cand.device)
        steps = [fn.bind(*args, check=False)
                 for fn, args in _phases(self.w_cand, self.w_user, e_cand, e_user,
                                         cand_to_user, out)]
        return LcePlan(steps, out, (e_cand, e_user, cand_to_user))


class LcePlan:
    """One LinearCompression batch bound to its tensors (see ``LinearCompression.plan``).
    The partials buffer belongs to the plan: one run() at a time per plan (runs on one
    stream are ordered, so back-to-back runs and graph replays are fine)."""

    def __init__(self, steps, out, keep):
        self._steps, self.out, self._keep = steps, out, keep

    def run(self, stream=None):
        if stream is None and self._steps:
            stream = _raw_stream(self.out.device)
        for st in self._steps:
            st.launch(stream)
        return self.out


def linear_compression(w_cand, w_user, e_cand, e_user, cand_to_user, out=None, *, check_indices=True):
    """out[b] = w_cand @ e_cand[b] + w_user @ e_user[cand_to_user[b]]  (fp32 accumulation).

    e_cand [B, K_cand, N], e_user [U, K_user, N], cand_to_user int32 [B] non-decreasing in
    [0, U); output [B, M, N] in the input dtype. Weights whose K is not a multiple of 8 are
    padded on every call; use ``LinearCompression`` to pay that once. ``check_indices``
    validates cand_to_user on the device and syncs once; turn it off inside CUDA graphs.
    """
    return LinearCompression(w_cand, w_user)(e_cand, e_user, cand_to_user, out,
                                             check_indices=check_indices)


def _validate(lce, e_cand, e_user, cand_to_user, out):
    """Metadata checks (no device sync); the index values are checked inside the op."""
    dt, dev = lce.dtype, lce.w_cand.device
    for name, t, rank in (("e_cand", e_cand, 3), ("e_user", e_user, 3), ("cand_to_user", cand_to_user, 1)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"linear_compression: argument '{name}' must be a torch.Tensor")
        if t.dim() != rank:
            raise _err(name, f"must be {rank}-D, got shape {tuple(t.shape)}")
        if t.device != dev:
            raise _err(name, f"is on {t.device}, weights on {dev}")
    for name, t in (("e_cand", e_cand), ("e_user", e_user)):
        if t.dtype != dt:
            raise TypeError(f"linear_compression: argument '{name}' must have dtype {dt} like the weights, got {t.dtype}")
    if cand_to_user.dtype != torch.int32:
        raise TypeError(f"linear_compression: argument 'cand_to_user' must be int32, got {cand_to_user.dtype}")
    b, kc, n = e_cand.shape
    u, ku, n2 = e_user.shape
    if kc != lce.k_cand:
        raise _err("e_cand", f"dim 1 must be K_cand={lce.k_cand} (w_cand's K), got {kc}")
    if ku != lce.k_user:
        raise _err("e_user", f"dim 1 must be K_user={lce.k_user} (w_user's K), got {ku}")
    if n2 != n:
        raise _err("e_user", f"must have N={n} like e_cand, got {n2}")
    if cand_to_user.shape[0] != b:
        raise _err("cand_to_user", f"must have B={b} entries like e_cand, got {cand_to_user.shape[0]}")
    if b > 0 and u == 0:
        raise _err("e_user", "has 0 users but there are candidates")
    if b > 0:
        _check_rows16("e_cand", e_cand)
    if u > 0:
        _check_rows16("e_user", e_user)
    if b > 1 and cand_to_user.stride(0) != 1:
        raise _err("cand_to_user", "must be contiguous")
    if out is not None:
        if tuple(out.shape) != (b, lce.m, n) or out.dtype != dt or out.device != dev:
            raise _err("out", f"must be {dt} of shape {(b, lce.m, n)} on {dev}, "
                              f"got {out.dtype} {tuple(out.shape)} on {out.device}")
        if b > 0:
            _check_rows16("out", out)
    if dev.type != "cuda":
        raise _err("w_cand", f"must be on a CUDA device, got {dev} (cutekern has no CPU kernels; "
                             f"cutekern.reference has the float64 reference)")


def _check_indices(cand_to_user, num_users, kv_len=None, s_max=0, op="linear_compression"):
    """cand_to_user in [0, U) and non-decreasing (and kv_len in [0, S_max] when given), with
    one device sync. Skipped while a CUDA graph is being captured (a sync is illegal there)."""
    c = cand_to_user
    if c.numel() == 0 or (c.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    checks = [(c.min() < 0) | (c.max() >= num_users), (c[1:] < c[:-1]).any()]
    if kv_len is not None and kv_len.numel():
        checks.append(((kv_len < 0) | (kv_len > s_max)).any())
    flags = torch.stack(checks).tolist()
    err = lambda name, msg: ValueError(f"{op}: argument '{name}' {msg}")  # noqa: E731
    if flags[0]:
        raise err("cand_to_user", f"has values outside [0, U={num_users})")
    if flags[1]:
        raise err("cand_to_user", "must be non-decreasing (candidates of a user contiguous)")
    if len(flags) > 2 and flags[2]:
        raise err("kv_len", f"has values outside [0, S_max={s_max}]")


def pick_lce_function(lookup, has_addend: bool, m: int, has_wide: bool,
                      has_narrow: bool = False, batch: int = 0, n: int = 0, sms=None,
                      cand_tiles: int = 0):
    """The LCE phase kernel for M rows: ``lookup(flags)`` returns the kernel function of one
    flag set. A design with a `wide` build (sm90) runs it when its M tile covers M in fewer
    tiles than the default build's (M = 449: 2 x 256 rather than 3 x 224 rows).

    A design with a `narrow` user-phase build (sm90) runs that for the user phase (batch = U
    users of N columns) when (a) its tiles still fit in one wave of the grid (``sms``: the
    device's SM count, else the config's num_ctas) and (b) the SMs it leaves free still host
    every candidate-phase CTA that gets one tile more than the others (``cand_tiles`` mod the
    grid: the first CTAs of the static walk, which are also the ones that launch first, onto
    the SMs the user phase leaves free). The candidate phase's epilogues wait for the whole
    user phase (PDL), so a one-wave user GEMM costs its wall time, which tiles of half the rows
    on twice the SMs cut; (b) keeps the CTAs with the most tiles among the early starters."""
    flags = {"has_addend": has_addend}
    if has_narrow:
        flags["narrow"] = False
    if not has_wide:
        best = lookup(flags)
    else:
        fns = [lookup({**flags, "wide": w}) for w in (False, True)]
        # the key's config is the design's default; the flag swaps in its wide_tile_m
        tiles = [-(-m // int(f.meta["config"]["wide_tile_m" if w else "tile_m"]))
                 for f, w in zip(fns, (False, True))]
        best = fns[1] if tiles[1] < tiles[0] else fns[0]
    if has_narrow and not has_addend:
        fn = lookup({**flags, "narrow": True, **({"wide": False} if has_wide else {})})
        cfg = fn.meta["config"]
        grid = min(int(cfg["num_ctas"]), sms or int(cfg["num_ctas"]))
        ctas = batch * -(-n // int(cfg["tile_n"])) * -(-m // int(cfg["narrow_tile_m"]))
        if ctas <= grid and grid - ctas >= cand_tiles % grid:
            return fn
    return best


def _lce_function(ab, c, has_addend, m, device, batch=0, n=0, cand_tiles=0, env=None):
    # only the user phase's pick depends on (batch, n, cand_tiles)
    key = (batch, n, cand_tiles) if not has_addend else (0, 0, 0)
    return _lce_function_cached(ab, c, has_addend, m, getattr(device, "index", device),
                                env_key() if env is None else env, *key)


@functools.lru_cache(maxsize=256)
def _lce_function_cached(ab, c, has_addend, m, device, env, batch, n, cand_tiles):
    # cached: this sits on every eager call's host path (env: as get_function's own cache)
    from .arch import target_arch, target_design
    from .dispatch import get_function
    from .registry import OPS
    design = target_design(target_arch(device))
    sms = None  # a CPU box tracing another arch: the config's grid bound
    if torch.cuda.is_available():
        sms = sm_count(torch.cuda.current_device() if device is None else device)
    return pick_lce_function(
        lambda fl: get_function("lce_gemm", {"ab": ab, "c": c}, fl, device), has_addend, m,
        OPS["lce_gemm"].has_flag(design, "wide"), OPS["lce_gemm"].has_flag(design, "narrow"),
        batch, n, sms, cand_tiles)


def _lce_tiles(fn, m, n, batch) -> int:
    """CTA tiles of an sm90-design LCE kernel over (M, N, batch); 0 for designs without
    those config fields (only the narrow pick, an sm90 build, reads it)."""
    cfg = {} if fn is None else fn.meta.get("config", {})
    wide = dict(fn.meta.get("flags", {})).get("wide", False) if fn is not None else False
    tm = cfg.get("wide_tile_m" if wide else "tile_m")
    if not tm or not cfg.get("tile_n"):
        return 0
    return batch * -(-m // int(tm)) * -(-n // int(cfg["tile_n"]))


def _phases(w_cand_p, w_user_p, e_cand, e_user, cand_to_user, out) -> list:
    """The call as (function, args) steps, each callable / bindable like a kernel function:
    the user phase into fp32 partials, then the candidate phase (or, for an empty K_cand,
    a torch gather of the partials)."""
    b, kc, n = e_cand.shape
    u, ku, _ = e_user.shape
    if b == 0 or n == 0 or w_cand_p.shape[0] == 0:
        return []  # nothing to compute (TMA descriptors cannot describe empty extents)
    ab = _DTYPES[w_cand_p.dtype]
    dev = e_cand.device
    steps = []
    env = env_key()  # once per call: ~1 us of os.environ lookups
    cand = None if kc == 0 else _lce_function(ab, ab, True, w_cand_p.shape[0], dev, env=env)
    if ku == 0:
        partial = torch.zeros(u, w_user_p.shape[0], n, dtype=torch.float32, device=dev)
    else:
        partial = torch.empty(u, w_user_p.shape[0], n, dtype=torch.float32, device=dev)
        user = _lce_function(ab, "float32", False, w_user_p.shape[0], dev, u, n,
                             _lce_tiles(cand, w_cand_p.shape[0], n, b), env=env)
        # d/idx are unused by this variant; pass valid tensors of the right kind
        steps.append((user, (w_user_p, e_user, partial, partial, cand_to_user)))
    if kc == 0:  # degenerate: no candidate features
        steps.append((_GatherPartials(), (partial, cand_to_user, out)))
        return steps
    steps.append((cand, (w_cand_p, e_cand, out, partial, cand_to_user)))
    return steps


class _GatherPartials:
    """K_cand = 0: out[b] = partial[cand_to_user[b]] with torch ops (these allocate), called
    and bound like a kernel function."""

    def __call__(self, partial, cand_to_user, out, check=True, stream=None):
        out.copy_(partial.index_select(0, cand_to_user.long()))

    def bind(self, *args, check=True):
        return _BoundGather(self, args)


class _BoundGather:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def launch(self, stream=None):
        self.fn(*self.args)


def _launch(w_cand_p, w_user_p, e_cand, e_user, cand_to_user, out, check=True):
    """Both phases. ``check=False`` only for callers that ran ``_validate``."""
    steps = _phases(w_cand_p, w_user_p, e_cand, e_user, cand_to_user, out)
    # the stream is looked up once for both launches (host time)
    stream = _raw_stream(out.device) if steps else None
    for fn, args in steps:
        fn(*args, check=check, stream=stream)
    return out


# ------------------------------------------------------------------ torch custom ops
# Inputs are the padded weights (see LinearCompression); metadata is validated by the
# Python wrapper, index values inside the op so torch.compile'd callers keep the check.
@torch.library.custom_op("cutekern::lce", mutates_args=())
def _lce_op(w_cand_p: torch.Tensor, w_user_p: torch.Tensor, e_cand: torch.Tensor,
            e_user: torch.Tensor, cand_to_user: torch.Tensor, check_indices: bool) -> torch.Tensor:
    if check_indices:
        _check_indices(cand_to_user, e_user.shape[0])
    res = torch.empty(e_cand.shape[0], w_cand_p.shape[0], e_cand.shape[2],
                      dtype=w_cand_p.dtype, device=e_cand.device)
    return _launch(w_cand_p, w_user_p, e_cand, e_user, cand_to_user, res)


@_lce_op.register_fake
def _(w_cand_p, w_user_p, e_cand, e_user, cand_to_user, check_indices):
    return e_cand.new_empty(e_cand.shape[0], w_cand_p.shape[0], e_cand.shape[2])


@torch.library.custom_op("cutekern::lce_out", mutates_args=("out",))
def _lce_out_op(w_cand_p: torch.Tensor, w_user_p: torch.Tensor, e_cand: torch.Tensor,
                e_user: torch.Tensor, cand_to_user: torch.Tensor, out: torch.Tensor,
                check_indices: bool) -> None:
    if check_indices:
        _check_indices(cand_to_user, e_user.shape[0])
    _launch(w_cand_p, w_user_p, e_cand, e_user, cand_to_user, out)


@_lce_out_op.register_fake
def _(w_cand_p, w_user_p, e_cand, e_user, cand_to_user, out, check_indices):
    return None


# ====================================================================== attention
_ATTN_HEAD_DIMS = (64, 128)


def _attn_err(name, msg):
    return ValueError(f"ikbo.attention: argument '{name}' {msg}")


def _validate_attention(q, k, v, cand_to_user, kv_len):
    for name, t, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("cand_to_user", cand_to_user, 1)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ikbo.attention: argument '{name}' must be a torch.Tensor")
        if t.dim() != rank:
            raise _attn_err(name, f"must be {rank}-D, got shape {tuple(t.shape)}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"ikbo.attention: argument 'q' must be float16 or bfloat16, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"ikbo.attention: argument '{name}' must have dtype {q.dtype} like q, got {t.dtype}")
    if cand_to_user.dtype != torch.int32:
        raise TypeError(f"ikbo.attention: argument 'cand_to_user' must be int32, got {cand_to_user.dtype}")
    b, n_seed, h, d = q.shape
    u, s_max, hk, dk = k.shape
    if d not in _ATTN_HEAD_DIMS:
        raise _attn_err("q", f"head dim {d} is not supported (supported: {_ATTN_HEAD_DIMS})")
    if (hk, dk) != (h, d):
        raise _attn_err("k", f"must have H={h}, D={d} like q, got shape {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise _attn_err("v", f"must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if cand_to_user.shape[0] != b:
        raise _attn_err("cand_to_user", f"must have B={b} entries like q, got {cand_to_user.shape[0]}")
    if b > 0 and u == 0:
        raise _attn_err("k", "has 0 users but there are candidates")
    if kv_len is not None:
        if not isinstance(kv_len, torch.Tensor) or kv_len.dtype != torch.int32 or tuple(kv_len.shape) != (u,):
            raise _attn_err("kv_len", f"must be an int32 tensor of shape ({u},)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_rows16(_attn_err, name, t, "D")
    if n_seed > 1 and b > 1 and q.stride(0) != n_seed * q.stride(1):
        raise _attn_err("q", "must have its (candidate, seed) dims mergeable (stride(0) == n_seed * stride(1))")
    dev = q.device
    for name, t in (("k", k), ("v", v), ("cand_to_user", cand_to_user), ("kv_len", kv_len)):
        if t is not None and t.device != dev:
            raise _attn_err(name, f"is on {t.device}, q on {dev}")
    if dev.type != "cuda":
        raise _attn_err("q", f"must be on a CUDA device, got {dev} (cutekern.reference has the reference)")


def _attn_scale(scale):
    """A given scale checked before anything else (None: D**-0.5, resolved after the tensor
    checks)."""
    if scale is not None and not 0 < float(scale) < float("inf"):
        # the kernels keep the running max on raw scores
        raise _attn_err("scale", f"must be a positive finite number, got {scale}")
    return scale


class AttentionPlan:
    """IKBO attention for one batch structure, resolved once (plan/run, as in FlashInfer).

    ``plan_attention`` validates cand_to_user and kv_len (one device sync), builds the work
    list on the device and looks up the kernel; ``run(q, k, v)`` then checks the tensors
    against the plan's shapes and launches one kernel: no device sync, nothing allocated
    but ``out`` (and the LSE when returned) if not given, capturable in a CUDA graph. Every
    layer and head that shares the batch (same cand_to_user, kv_len, shapes) can reuse one
    plan; the per-call work of the one-shot ``attention`` (about 20 small torch ops on the
    host) is paid once. One ``run`` at a time per plan (the LSE scratch buffer is shared).
    """

    def __init__(self, q, k, v, cand_to_user, kv_len, scale, check_indices):
        from ._attn_work import build_work
        from .dispatch import get_function
        scale = _attn_scale(scale)
        _validate_attention(q, k, v, cand_to_user, kv_len)
        scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        b, n_seed, h, d = q.shape
        u, s_max = k.shape[0], k.shape[1]
        self.q_shape, self.kv_shape, self.dtype = tuple(q.shape), tuple(k.shape), q.dtype
        self.cand_to_user, self.scale, self.device = cand_to_user, scale, q.device
        self._empty = b == 0 or n_seed == 0 or h == 0
        if self._empty:
            return
        if check_indices:
            _check_indices(cand_to_user, u, kv_len, s_max, op="ikbo.attention")
        if kv_len is None:
            kv_len = torch.full((u,), s_max, dtype=torch.int32, device=q.device)
        self.kv_len = kv_len
        self._fn = get_function("ikbo_attn", {"dtype": _DTYPES[q.dtype]}, {"head_dim": d}, q.device)
        self.work = build_work(cand_to_user, u, n_seed, int(self._fn.meta["config"]["block_m"]),
                               kv_len)
        self._scale_t = torch.full((1,), scale, dtype=torch.float32, device=q.device)
        self._lse_scratch = torch.empty(b * n_seed, h, dtype=torch.float32, device=q.device)
        self._num_ctas = min(self.work.shape[0] * h, sm_count(q.device.index))

    def run(self, q, k, v, out=None, return_lse=False):
        """out [B, n_seed, H, D] (and the fp32 LSE [B, H, n_seed] with return_lse)."""
        if tuple(q.shape) != self.q_shape or tuple(k.shape) != self.kv_shape:
            raise _attn_err("q" if tuple(q.shape) != self.q_shape else "k",
                            f"shapes {tuple(q.shape)} / {tuple(k.shape)} differ from the plan's "
                            f"{self.q_shape} / {self.kv_shape}")
        if q.dtype != self.dtype or q.device != self.device:
            raise _attn_err("q", f"must be {self.dtype} on {self.device} like the plan's q")
        _validate_attention(q, k, v, self.cand_to_user, None)
        if out is not None and (
                not isinstance(out, torch.Tensor) or tuple(out.shape) != self.q_shape
                or out.dtype != q.dtype or out.device != q.device or not out.is_contiguous()):
            raise _attn_err("out", f"must be a contiguous {q.dtype} tensor of shape {self.q_shape} "
                                   f"on {q.device}")
        return self._launch(q, k, v, out, return_lse)

    def _launch(self, q, k, v, out, return_lse):
        """The launch itself, on tensors already checked against the plan."""
        b, n_seed, h, d = q.shape
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if self._empty:
            lse = torch.empty(b, h, n_seed, dtype=torch.float32, device=q.device)
            return (out, lse) if return_lse else out
        lse_rh = (torch.empty(b * n_seed, h, dtype=torch.float32, device=q.device)
                  if return_lse else self._lse_scratch)
        if os.environ.get("CUTEKERN_POISON"):
            # debug aid ($CUTEKERN_POISON=1): NaN-fill outputs so an unwritten element shows
            out.fill_(float("nan"))
            lse_rh.fill_(float("nan"))
        # _validate_attention checked dtype, shape, strides, alignment and device
        self._fn(q.reshape(b * n_seed, h, d), k, v, self.kv_len, self.work, self._scale_t,
                 out.view(b * n_seed, h, d), lse_rh, self._num_ctas, check=False)
        if not return_lse:
            return out
        return out, lse_rh.view(b, n_seed, h).permute(0, 2, 1).contiguous()


def plan_attention(q, k, v, cand_to_user, kv_len=None, scale=None, *, check_indices=True) -> AttentionPlan:
    """A reusable plan for ``attention`` on tensors shaped (and typed) like q, k, v with this
    cand_to_user / kv_len. The work list is built from cand_to_user now, so its contents
    must not change while the plan is used; kv_len is read by the kernel at run time (it may
    change; the work order, longest users first, keeps the plan-time lengths)."""
    return AttentionPlan(q, k, v, cand_to_user, kv_len, scale, check_indices)


def attention(q, k, v, cand_to_user, kv_len=None, scale=None, return_lse=False, *, check_indices=True):
    """IKBO candidate-over-user attention (non-causal), without broadcasting K/V.

    q [B, n_seed, H, D] per candidate; k, v [U, S_max, H, D] per user (padded);
    cand_to_user int32 [B] non-decreasing in [0, U); kv_len int32 [U] (default S_max).
    out[b] = softmax(q[b] k[u]^T * scale) v[u], u = cand_to_user[b]; scale defaults to
    D**-0.5. Returns out [B, n_seed, H, D] (input dtype) and, with return_lse, the fp32
    natural-log LSE [B, H, n_seed]. fp16/bf16, D in {64, 128}; any n_seed, ragged counts,
    users with 0 candidates and kv_len 0 (out 0, lse -inf) are fine. Calls that share the
    batch structure should use ``plan_attention(...).run(q, k, v)`` (the plan is built here
    on every call).
    """
    if torch.compiler.is_compiling():
        scale = _attn_scale(scale)
        _validate_attention(q, k, v, cand_to_user, kv_len)
        scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        out, lse = torch.ops.cutekern.ikbo_attention(q, k, v, cand_to_user, kv_len, scale, check_indices)
        return (out, lse) if return_lse else out
    # the plan has just checked these very tensors
    return AttentionPlan(q, k, v, cand_to_user, kv_len, scale, check_indices)._launch(
        q, k, v, None, return_lse)


def _attention_impl(q, k, v, cand_to_user, kv_len, scale, check_indices):
    return AttentionPlan(q, k, v, cand_to_user, kv_len, scale, check_indices)._launch(
        q, k, v, None, True)


@torch.library.custom_op("cutekern::ikbo_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cand_to_user: torch.Tensor,
                  kv_len: torch.Tensor | None, scale: float, check_indices: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _attention_impl(q, k, v, cand_to_user, kv_len, scale, check_indices)


@_attention_op.register_fake
def _(q, k, v, cand_to_user, kv_len, scale, check_indices):
    b, n_seed, h, _ = q.shape
    return torch.empty_like(q), q.new_empty(b, h, n_seed, dtype=torch.float32)
