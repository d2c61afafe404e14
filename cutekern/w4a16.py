"""W4A16 weights in tensor-core fragment order: the prepare step of the megakernel's linear
layers (kernels/CONTRACT_MEGAKERNEL.md, "W4A16 fragment order"), read by the W4A16 GEMM
(kernels/ada/w4a16_gemm.py, ``w4a16_linear``).

GPTQ keeps a W4A16 g128 weight as qweight int32 [K / 8, N] (input channel k in nibble k % 8
of row k // 8, zero point 8) and scales [K / group, N] (``reference.w4a16_quantize``). The
GEMM runs mma.sync m16n8k16 with the codes as A (16 columns) and the activations as B (8
batch rows) in the "permuted k" convention of kernels/_mma.py (any assignment of k to the
instruction's slots is the same dot product when both operands use it): lane 4 g + q of a
32-wide k block takes the activation vector k 8q .. 8q + 7 of batch row g (one 16-byte load)
and the codes of the same 8 k of columns g and g + 8 (its A rows). So a lane's codes for 64 k
and 16 columns are 4 words, one 16-byte load:

    packed int32 [N / 16, K / 64, 32, 4]: block (n16, k64), lane l = 4 g + q, word v = 2 h + a
      holds the codes of column 16 n16 + g + 8 a at k = 64 k64 + 32 h + 8 q + e:
      e = 2 i in nibble i, e = 2 i + 1 in nibble i + 4 (i = 0..3; nibble i at bits 4 i)

so register i of the word's dequant (nibbles i and i + 4 in its two halves: fp16, two rounds
of ``(w & 0x000f000f) | 0x64006400`` - (1024 + 8) and ``(w & 0x00f000f0) | 0x64006400`` x 1/16
- (64 + 8), w >>= 8 between; bf16, whose 7 mantissa bits cannot take a nibble at bits 4..7,
four rounds of ``(w & 0x000f000f) | 0x43004300`` - (128 + 8), w >>= 4 between) holds k
8q + 2i, 8q + 2i + 1 of its column: registers 0, 1 feed the first m16n8k16 step of the
32-wide block, 2, 3 the second, in the order of the activation vector's words. Each register
holds code - 8 exactly; the kernel scales a group's fp32 partial sum (no 16-bit rounding of
code x scale). ``reference.w4a16_fragments_dense`` emulates that dequant bit for bit;
tests/test_w4a16.py checks it against GPTQ's storage.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .abi import W4A16_KBLOCK
from .arch import sm_count
from .reference import pack_nibbles, w4a16_nibbles
from .runtime import _raw_stream

TILE = 16          # output columns per block
KBLOCK = W4A16_KBLOCK    # k per block (a lane's 16 bytes), shared with the kernel
SCALE_DTYPES = (torch.float16, torch.bfloat16)
# nibble i of a lane's word: k offset beyond the lane's 8q
NIBBLE_K = (0, 2, 4, 6, 1, 3, 5, 7)


def _err(name, msg):
    return ValueError(f"prepare_w4a16: argument '{name}' {msg}")


@dataclass(frozen=True)
class W4A16Weight:
    """A prepared W4A16 weight: ``packed`` int32 [N / 16, K / 64, 32, 4] in fragment order,
    ``scales`` [K / group, N] as given (fp16 or bf16: the kernel's operand type)."""
    packed: torch.Tensor
    scales: torch.Tensor
    k: int
    n: int
    group: int


def fragment_index(device=None):
    """(k, n) offsets inside a 64 (k) x 16 (n) block of every (lane, word, nibble): two int64
    [32, 4, 8]."""
    lane = torch.arange(32, device=device)[:, None, None]
    word = torch.arange(4, device=device)[None, :, None]
    nib = torch.tensor(NIBBLE_K, device=device)[None, None, :]
    kk = 32 * (word // 2) + 8 * (lane % 4) + nib
    nn = lane // 4 + 8 * (word % 2)
    return kk, nn.expand_as(kk)


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
    if not isinstance(group, int) or group <= 0 or group % KBLOCK:
        raise _err("group", f"must be a positive multiple of {KBLOCK} (a lane's k block in one "
                            f"group), got {group!r}")
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
    nib = w4a16_nibbles(qweight)                                                    # [K, N]
    blocks = nib.reshape(k // KBLOCK, KBLOCK, n // TILE, TILE).permute(2, 0, 1, 3)  # [NT, KB, k, n]
    kk, nn = fragment_index(qweight.device)
    packed = pack_nibbles(blocks[:, :, kk, nn])                                # [NT, KB, 32, 4]
    return W4A16Weight(packed.contiguous(), scales, k, n, group)


# ---------------------------------------------------------------------------- the GEMM
ROWS_PER_LAUNCH = 16     # the kernel's two n8 batch tiles: larger batches run in slices
_DT_NAME = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _check_linear(x, weight, out):
    if not isinstance(weight, W4A16Weight):
        raise TypeError(f"w4a16_linear: argument 'weight' must be a W4A16Weight "
                        f"(prepare_w4a16), got {type(weight).__name__}")
    _check_x("w4a16_linear", x, weight.scales.dtype, weight.k, "the scales'")
    if x.device != weight.packed.device:
        raise ValueError(f"w4a16_linear: argument 'x' must be on the weight's device "
                         f"{weight.packed.device}, got {x.device}")
    if weight.group % KBLOCK:
        raise ValueError(f"w4a16_linear: argument 'weight' has group {weight.group}: the "
                         f"kernel needs a multiple of {KBLOCK}")
    k, n = weight.k, weight.n
    if (tuple(weight.packed.shape) != (n // TILE, k // KBLOCK, 32, 4)
            or weight.packed.dtype != torch.int32 or not weight.packed.is_contiguous()
            or tuple(weight.scales.shape) != (k // weight.group, n)
            or weight.scales.stride(-1) != 1 or weight.scales.device != weight.packed.device):
        raise ValueError("w4a16_linear: argument 'weight' is not a prepare_w4a16 result "
                         "(packed / scales shapes, dtype, layout or device)")
    _check_dest("w4a16_linear", "out", out, weight.n, x)


def _check_x(op, x, dtype, k, whose):
    """x: a tensor of the weights' dtype, [..., K]."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: argument 'x' must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{op}: argument 'x' must have {whose} dtype {dtype}, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{op}: argument 'x' must be [..., K = {k}], got shape "
                         f"{tuple(x.shape)}")


def _check_dest(op, name, t, width, x, aligned=False):
    """An optional output: [..., width] like x, x's dtype and device, contiguous (and
    16-byte aligned where a kernel reads it back with 16-byte copies)."""
    if t is None:
        return
    want = (*x.shape[:-1], width)
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
        raise ValueError(f"{op}: argument '{name}' must be a tensor of shape {want}")
    if t.dtype != x.dtype or t.device != x.device:
        raise TypeError(f"{op}: argument '{name}' must be {x.dtype} on {x.device}, "
                        f"got {t.dtype} on {t.device}")
    if not t.is_contiguous() or (aligned and t.data_ptr() % 16):
        raise ValueError(f"{op}: argument '{name}' must be contiguous"
                         + (" and 16-byte aligned" if aligned else ""))


def w4a16_linear(x: torch.Tensor, weight: W4A16Weight, out: torch.Tensor | None = None):
    """y = x W^T for a prepared W4A16 weight (W [N, K] = (code - 8) x group scale): x [..., K]
    in the scales' dtype (fp16 / bf16) -> [..., N] in that dtype, fp32 accumulation. The
    decode GEMM of the megakernel's linear layers, as its own launch (the Ada design:
    kernels/ada/w4a16_gemm.py; sm_90a runs that design, SM100 its sm_100a / sm_103a builds,
    never run here). Batches of any size run in slices of 16 rows (ROWS_PER_LAUNCH)."""
    _check_linear(x, weight, out)
    if not x.is_cuda:
        raise ValueError(f"w4a16_linear: argument 'x' must be a CUDA tensor, got {x.device}")
    x2 = x.reshape(-1, weight.k)
    if out is None and torch.compiler.is_compiling():
        y = _w4a16_op(x2, weight.packed, weight.scales)
        return y.view(*x.shape[:-1], weight.n)
    x2 = _aligned_rows(x2)
    y = out if out is not None else torch.empty(*x.shape[:-1], weight.n, dtype=x.dtype,
                                                device=x.device)
    _w4a16_impl(x2, weight.packed, weight.scales, y.view(-1, weight.n))
    return y


def _aligned_rows(x2):
    """x's rows as the kernel reads them: 16-byte vectors (a copy only when they are not)."""
    if x2.stride(-1) != 1 or x2.data_ptr() % 16 or (x2.shape[0] > 1 and x2.stride(0) % 8):
        x2 = x2.contiguous()
    if x2.data_ptr() % 16:
        x2 = x2.clone()
    return x2


def _w4a16_impl(x2, packed, scales, y2, check=False):
    """The launches (the kernel reads the group size off packed's and scales' shapes)."""
    from .dispatch import get_function
    m = x2.shape[0]
    stream = _raw_stream(x2.device)
    sms = sm_count(x2.device)
    n = packed.shape[0] * TILE
    for r0 in range(0, m, ROWS_PER_LAUNCH):
        rows = min(ROWS_PER_LAUNCH, m - r0)
        cols = tile_cols(n, rows > 8, sms) if COLS_OVERRIDE is None else COLS_OVERRIDE
        cols = min(cols, 32) if rows > 8 else cols       # no 64-column build for rows 9..16
        fn = get_function("w4a16_gemm", {"dtype": _DT_NAME[x2.dtype]},
                          {"rows16": rows > 8, "cols": cols}, x2.device, design="ada")
        cfg = fn.meta["config"]
        ctas = CTAS_OVERRIDE or sms * resident_ctas(cfg, rows > 8, cols,
                                                    smem_per_sm(x2.device))
        warps = cfg["wide_warps" if cols > TILE else "warps"]
        ks = KSPLIT_OVERRIDE or ksplit(n, cols, ctas * warps, warps)
        if BALANCE:
            ctas = balanced_grid(-(-n // cols), warps // ks, ctas)
        fn(x2[r0:r0 + rows], packed, scales, y2[r0:r0 + rows], ctas, ks, stream=stream,
           check=check)


# tests / tuning: force the build (16, 32 or 64 columns per tile) and the K split (a power of
# 2 dividing the build's warps)
COLS_OVERRIDE = None
KSPLIT_OVERRIDE = None
CTAS_OVERRIDE = None     # tests: a small persistent grid (many tile rounds per CTA)
BALANCE = True           # tuning: False launches the full grid (balanced_grid)


def cta_smem(cfg: dict, rows16: bool, cols: int) -> int:
    """Shared memory of one CTA of a build (the kernel's ``smem_bytes``, restated here so the
    launch path needs no DSL; tests/test_w4a16.py keeps the two equal)."""
    nt, nb = cols // TILE, 2 if rows16 else 1
    if cols == TILE:
        warps, stages = cfg["warps"], cfg["stages16" if rows16 else "stages"]
    elif cols == 2 * TILE:
        warps, stages = cfg["wide_warps"], cfg["wide_stages16" if rows16 else "wide_stages"]
    else:
        warps, stages = cfg["wide_warps"], cfg["wide64_stages"]
    return _smem_bytes(warps, stages, nt, nb)


def _smem_bytes(warps: int, stages: int, nt: int, nb: int) -> int:
    """kernels/ada/w4a16_gemm.py's ``smem_bytes`` of a build shape (per warp: its ring of
    codes, activations and scales per slot, and two tiles' partials)."""
    slot = nt * 512 + nb * 2 * 32 * 16 + nt * 32          # codes, activations, scales
    return warps * (stages * slot + 2 * nt * nb * 32 * 4 * 4)


def resident_ctas(cfg: dict, rows16: bool, cols: int, smem_sm: int) -> int:
    """CTAs per SM of the persistent grid: the config's count (sized for the H200's 228 KB
    of shared memory per SM) or as many as fit the device's (100 KB on sm_86 / sm_89: the
    grid stays one resident wave, so no CTA waits for another's whole run)."""
    want = cfg["ctas_per_sm" if cols == TILE else "wide_ctas_per_sm"]
    fit = smem_sm // (cta_smem(cfg, rows16, cols) + 1024)      # 1 KB per CTA for the driver
    return max(1, min(want, fit))


_SMEM_PER_SM = {}


def smem_per_sm(device) -> int:
    """Shared memory per SM of a CUDA device (bytes; cached per device)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMEM_PER_SM:
        props = torch.cuda.get_device_properties(idx)
        val = getattr(props, "shared_memory_per_multiprocessor", None)
        if not val:
            import cuda.bindings.driver as drv
            err, val = drv.cuDeviceGetAttribute(
                drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
                idx)
            if err != drv.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"w4a16: shared memory per SM of device {idx}: {err}")
        _SMEM_PER_SM[idx] = int(val)
    return _SMEM_PER_SM[idx]


def balanced_grid(tiles: int, per_round: int, ctas: int) -> int:
    """The fewest CTAs that still give every CTA the most rounds any CTA has: a CTA's rounds
    run one after another, so a last round that only some CTAs have runs on SMs left with one
    CTA's warps (N = 32768, K = 4096: 512 rounds on 396 CTAs put 116 of them in a second
    round alone)."""
    rounds = -(-tiles // per_round)
    most = -(-rounds // ctas)
    return -(-rounds // most)


def ksplit(n: int, cols: int, grid_warps: int, warps: int) -> int:
    """Warps per tile: the fewest that keep every warp of the grid busy, and at least two.
    A warp per tile (no CTA-wide sum) measured no faster on the H200's LM head at 1 row and
    slower at 2..16 rows (64.4 / 64.7 / 72.8 / 67.4 us with two warps per tile at 2 / 4 / 6 /
    8 rows against 67.9 / 66.2 / 82.6 / 72.5, 96 against 109 at 16: perf/results/
    w4a16_ab_ksplit3_h200.json, w4a16_ab_swap_h200.json); it stays reachable for tests."""
    tiles = -(-n // cols)
    ks = 2 if warps >= 2 else 1
    while ks < warps and tiles * ks < grid_warps:
        ks *= 2
    return ks


def tile_cols(n: int, rows16: bool, sms: int) -> int:
    """Output columns per tile. 32 (4 warps splitting K) where those tiles are at least as
    many as the SMs, else 16 (8 warps: more warps per column for a short N). Same-process A/B
    on the H200 (K = 2048, 1 / 8 / 16 rows; perf/results/w4a16_ab_wide_h200.json): N = 6144
    32 columns 8.6 / 9.1 / 10.3 us vs 16 columns 9.4 / 10.2 / 11.8, N = 12288 10.0 / 11.1 /
    13.4 vs 13.0 / 14.8 / 20.0; N = 4096 16 columns 7.2 / 8.2 / 8.7 vs 7.5 / 8.2 / 9.5;
    N = 2048, K = 6144 16 columns 8.9 vs 11.4 at 1 row.
    64 (rows 8) where those tiles are at least 2.5 per SM. 64 vs 32 columns, K = 2048, 1 / 8
    rows on 132 SMs (perf/results/w4a16_ab_cols64_h200.json): N = 24576 (2.9 per SM) 14.7 /
    15.5 us vs 15.1 / 17.2, N = 49152 23.5 / 24.8 vs 25.1 / 28.0, the LM head (N = 151936)
    55.7 / 58.0 vs 63.0 / 67.8; N = 32768, K = 4096 33.0 / 34.7 vs 36.8 / 42.5; but N = 12288
    10.8 vs 10.1 at 1 row, N = 18432 (2.2 per SM) a wash."""
    if not rows16 and 2 * n >= 5 * 64 * sms:
        return 64
    return 32 if n >= 32 * sms else 16


@torch.library.custom_op("cutekern::w4a16_linear", mutates_args=())
def _w4a16_op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # reachable as torch.ops.cutekern.w4a16_linear without w4a16_linear's checks: the
    # launches check their arguments
    y = torch.empty(x.shape[0], scales.shape[1], dtype=x.dtype, device=x.device)
    _w4a16_impl(_aligned_rows(x), packed, scales, y, check=True)
    return y


@_w4a16_op.register_fake
def _(x, packed, scales):
    return x.new_empty(x.shape[0], scales.shape[1])


# ---------------------------------------------------------------------------- the MLP block
@dataclass(frozen=True)
class W4A16MLP:
    """A prepared SwiGLU MLP block (``prepare_w4a16_mlp``): gate and up as one weight whose
    16-column blocks alternate (block 2i = gate columns 16i.., 2i + 1 = up columns 16i..), so
    one tile of the kernel's first phase holds both halves of its 16 outputs; the down weight
    as prepared; ``sync``, the launch's generation word and per-CTA flags (zeros once, never
    reset). One launch at a time per prepared block: two streams running the same block
    concurrently would share its flags."""
    packed_gu: torch.Tensor
    scales_gu: torch.Tensor
    down: W4A16Weight
    sync: torch.Tensor
    k: int          # hidden (x's width)
    f: int          # intermediate (h's width)
    d: int          # output width


def prepare_w4a16_mlp(gate: W4A16Weight, up: W4A16Weight, down: W4A16Weight) -> W4A16MLP:
    """Three prepared weights (gate, up: [F, K]; down: [D, F]) -> the one-launch MLP block's
    operands. Once per layer, on the weights' device."""
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        if not isinstance(w, W4A16Weight):
            raise TypeError(f"prepare_w4a16_mlp: argument '{name}' must be a W4A16Weight "
                            f"(prepare_w4a16), got {type(w).__name__}")
        if w.scales.dtype != gate.scales.dtype or w.packed.device != gate.packed.device:
            raise ValueError(f"prepare_w4a16_mlp: argument '{name}' must have gate's scale "
                             f"dtype {gate.scales.dtype} and device {gate.packed.device}")
    if (up.k, up.n, up.group) != (gate.k, gate.n, gate.group):
        raise ValueError(f"prepare_w4a16_mlp: argument 'up' must match gate's [F, K] = "
                         f"[{gate.n}, {gate.k}] and group {gate.group}, got [{up.n}, {up.k}] "
                         f"group {up.group}")
    if down.k != gate.n:
        raise ValueError(f"prepare_w4a16_mlp: argument 'down' must take K = F = {gate.n} "
                         f"(gate's outputs), got K = {down.k}")
    f, k = gate.n, gate.k
    nb = f // TILE
    packed = torch.stack([gate.packed, up.packed], 1).reshape(2 * nb, *gate.packed.shape[1:])
    g = gate.scales.shape[0]
    scales = torch.stack([gate.scales.reshape(g, nb, TILE), up.scales.reshape(g, nb, TILE)],
                         2).reshape(g, 2 * f)
    dev = gate.packed.device
    # one word per CTA the device can hold of any build (16 per SM is beyond every config)
    words = 1 + (sm_count(dev) * 16 if dev.type == "cuda" else 1)
    sync = torch.zeros(words, dtype=torch.int32, device=dev)
    return W4A16MLP(packed.contiguous(), scales.contiguous(), down, sync, k, f, down.n)


def w4a16_mlp(x: torch.Tensor, mlp: W4A16MLP, out: torch.Tensor | None = None,
              h: torch.Tensor | None = None):
    """out = (silu(x Wg^T) * (x Wu^T)) Wd^T in one launch per 16 rows (the Ada design:
    kernels/ada/w4a16_mlp.py): x [..., K] in the weights' scale dtype, fp32 accumulation,
    the product h rounded once to that dtype (``h`` [..., F], optional: where h goes; else a
    new tensor). Every CTA of the launch waits for every other's h, so the grid is at most
    what the device holds at once (as with a cooperative launch, a kernel that holds SMs for
    good, e.g. another persistent one on a second stream, could keep some CTAs from ever
    starting); each CTA's first down tile is fetched into L2 before it waits."""
    if not isinstance(mlp, W4A16MLP):
        raise TypeError(f"w4a16_mlp: argument 'mlp' must be a W4A16MLP (prepare_w4a16_mlp), "
                        f"got {type(mlp).__name__}")
    _check_x("w4a16_mlp", x, mlp.scales_gu.dtype, mlp.k, "the weights'")
    _check_dest("w4a16_mlp", "out", out, mlp.d, x, aligned=True)
    _check_dest("w4a16_mlp", "h", h, mlp.f, x, aligned=True)
    if x.device != mlp.packed_gu.device or not x.is_cuda:
        raise ValueError(f"w4a16_mlp: argument 'x' must be on the weights' CUDA device "
                         f"{mlp.packed_gu.device}, got {x.device}")
    if out is None and h is None and torch.compiler.is_compiling():
        y = _w4a16_mlp_op(x.reshape(-1, mlp.k), mlp.packed_gu, mlp.scales_gu, mlp.down.packed,
                          mlp.down.scales, mlp.sync)
        return y.view(*x.shape[:-1], mlp.d)
    x2 = _aligned_rows(x.reshape(-1, mlp.k))
    y = out if out is not None else torch.empty(*x.shape[:-1], mlp.d, dtype=x.dtype,
                                                device=x.device)
    hh = h if h is not None else torch.empty(*x.shape[:-1], mlp.f, dtype=x.dtype,
                                             device=x.device)
    _w4a16_mlp_impl(x2, mlp.packed_gu, mlp.scales_gu, mlp.down.packed, mlp.down.scales,
                    mlp.sync, hh.view(-1, mlp.f), y.view(-1, mlp.d))
    return y


def mlp_cta_smem(cfg: dict, rows16: bool) -> int:
    """Shared memory of one CTA of the MLP kernel (its first phase's buffers: the kernel's
    ``smem_bytes`` of that shape, restated so the launch path needs no DSL)."""
    return _smem_bytes(cfg["warps"], cfg["stages16" if rows16 else "stages"], 2,
                       2 if rows16 else 1)


def mlp_launch(mlp_f: int, mlp_d: int, cfg: dict, rows16: bool, sms: int, smem_sm: int):
    """(grid, ks_gu, ks_d) of an MLP launch: K splits as the GEMM picks them on the largest
    co-resident grid, then the fewest CTAs that keep both phases' busiest CTA's rounds."""
    per_sm = max(1, min(cfg["ctas_per_sm"], smem_sm // (mlp_cta_smem(cfg, rows16) + 1024)))
    cap = sms * per_sm
    w = cfg["warps"]
    ks_gu = ksplit(2 * mlp_f, 2 * TILE, cap * w, w)
    ks_d = ksplit(mlp_d, TILE, cap * w, w)
    grid = max(balanced_grid(-(-mlp_f // TILE), w // ks_gu, cap),
               balanced_grid(-(-mlp_d // TILE), w // ks_d, cap))
    return grid, ks_gu, ks_d


def _w4a16_mlp_impl(x2, packed_gu, scales_gu, packed_d, scales_d, sync, h2, y2, check=False):
    """The launches, one per 16 rows (F and D read off the scales' widths)."""
    from .dispatch import get_function
    m = x2.shape[0]
    f, d = scales_gu.shape[1] // 2, scales_d.shape[1]
    stream = _raw_stream(x2.device)
    sms = sm_count(x2.device)
    for r0 in range(0, m, ROWS_PER_LAUNCH):
        rows = min(ROWS_PER_LAUNCH, m - r0)
        fn = get_function("w4a16_mlp", {"dtype": _DT_NAME[x2.dtype]}, {"rows16": rows > 8},
                          x2.device, design="ada")
        grid, ks_gu, ks_d = mlp_launch(f, d, fn.meta["config"], rows > 8, sms,
                                       smem_per_sm(x2.device))
        grid = MLP_CTAS_OVERRIDE or grid
        if grid + 1 > sync.numel():
            raise RuntimeError(f"w4a16_mlp: a grid of {grid} CTAs needs {grid + 1} sync words, "
                               f"the block holds {sync.numel()}")
        fn(x2[r0:r0 + rows], packed_gu, scales_gu, packed_d, scales_d, h2[r0:r0 + rows],
           y2[r0:r0 + rows], sync, grid, ks_gu, ks_d, stream=stream, check=check)


MLP_CTAS_OVERRIDE = None   # tests: a smaller grid (several tiles per CTA in both phases)


@torch.library.custom_op("cutekern::w4a16_mlp", mutates_args=("sync",))
def _w4a16_mlp_op(x: torch.Tensor, packed_gu: torch.Tensor, scales_gu: torch.Tensor,
                  packed_d: torch.Tensor, scales_d: torch.Tensor,
                  sync: torch.Tensor) -> torch.Tensor:
    # reachable as torch.ops.cutekern.w4a16_mlp without w4a16_mlp's checks: the launch checks
    # its arguments; sync is the block's generation word and flags
    y = torch.empty(x.shape[0], scales_d.shape[1], dtype=x.dtype, device=x.device)
    h = torch.empty(x.shape[0], scales_gu.shape[1] // 2, dtype=x.dtype, device=x.device)
    _w4a16_mlp_impl(_aligned_rows(x), packed_gu, scales_gu, packed_d, scales_d, sync, h, y,
                    check=True)
    return y


@_w4a16_mlp_op.register_fake
def _(x, packed_gu, scales_gu, packed_d, scales_d, sync):
    return x.new_empty(x.shape[0], scales_d.shape[1])
