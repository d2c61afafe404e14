"""sm_90a fast path of the IKBO LCE batched broadcast GEMM (see kernels/CONTRACT.md).

    c[l] = a @ b[l]  (+ d[idx[l]])          a (M, K) shared, b (L, K, N), c (L, M, N)

The kernel computes the transposed product c[l]^T = b[l]^T @ a^T, so the WGMMA "M" side is
the problem's N and the WGMMA "N" side is the problem's M. WGMMA M is fixed at 64 per
warpgroup while WGMMA N can be any multiple of 8 up to 256; putting the odd-sized M
(433 in the reference shape) on the N side lets the tile follow it closely (224 + 216 = 440
rows computed, the last tile running a narrower WGMMA, instead of 4 x 128 = 512).
In that orientation b^T is an MN-major A operand and a^T a K-major B operand, both legal
for 16-bit WGMMA, and c^T is an M-major output that the TMA store writes directly.

Structure: one producer warp issues TMA loads into an `ab_stages`-deep shared-memory ring
(mbarrier pipeline); two consumer warpgroups run WGMMA into fp32 registers and do the
epilogue (optional fp32 addend, convert, registers -> smem -> TMA store). With the addend
and `addend_tma` (default), a second producer warp TMA-loads each epilogue subtile of
d[idx[l]] into a small shared-memory ring ahead of time, so the consumers read the addend
from smem with the accumulator's own thread -> element mapping. Persistent grid
with a static scheduler whose raster walks all tiles of one batch entry l back to back, so
b[l] comes from DRAM once and from L2 for its other tiles (contiguous runs of l per cluster
measured ~10% slower on the H200).

Where the time goes (H200 clock64 timeline, perf/timeline_lce.py, perf/NOTES.md): the
mainloop runs at the tensor-core peak (~12.6 K cycles per 128x224x896 tile), and shared
memory is nearly saturated there (WGMMA operand reads + TMA writes ~130 B/clk); the
epilogue (~3.5 K cycles with the addend, ~1.9 K without) does not overlap it. The two
launches of an LCE call (user phase without addend, then candidate phase) overlap through
programmatic dependent launch (`pdl`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.cute.nvgpu import cpasync

from cutekern.layout import broadcast_mode

SASS_REQUIRED = ("HGMMA", "UTMALDG", "SYNCS")
SASS_FORBIDDEN = ("HMMA",)

_SMEM_CAPACITY = 227 * 1024  # sm_90 opt-in maximum per block
_SMEM_RESERVED = 1024  # mbarriers + alignment slack


@dataclass(frozen=True)
class LceSm90Config:
    """Compile-time configuration. Tile sizes are named in problem terms.

    tile_n: CTA tile along problem N (the WGMMA M side): 64 per consumer warpgroup.
    tile_m: CTA tile along problem M (the WGMMA N side): multiple of 8, <= 256.
    tile_k: K per pipeline stage: 64 (one 128-byte swizzle row of 16-bit data) or 32 (half
        the bytes per stage, so twice the stages fit in the same shared memory).
    ab_stages: depth of the TMA -> WGMMA shared-memory ring.
    epi_stages: output staging buffers for the TMA store (>= 2); reduced automatically to
        what fits next to the ring (fp32 output needs twice the bytes).
    epi_m: epilogue subtile along problem M.
    addend_tma: has_addend only: TMA-load each epilogue subtile of d[idx[l]] into a
        shared-memory ring (issued ahead by a dedicated warp of the producer warpgroup)
        instead of predicated scalar LDGs from the consumer threads.
    addend_stages: depth of that ring (tile_n x epi_m fp32 per stage); reduced automatically
        to what fits next to ab_stages and two output buffers.
    cluster_n: CTAs per cluster along problem N; > 1 multicasts the weight (a) tile, the
        larger of the two per-stage loads, to CTAs that share it (halves its L2 reads).
    cluster_m: CTAs per cluster along problem M; > 1 multicasts the b tile.
    num_ctas: persistent grid size cap (132 SMs on H100 SXM / H200).
    pdl: programmatic dependent launch between the two phases: the user phase (no addend)
        lets the next kernel launch as soon as all its CTAs run, and the candidate phase is
        launched so it may start early. Its CTAs that find a free SM begin their mainloops
        while the user phase runs; only the warp that reads the addend waits
        (griddepcontrol.wait) for the user phase to finish.
    wide_tile_m: tile_m of the op's `wide` build, which the dispatch picks when it covers M in
        fewer tiles (M = 449: 2 x 256 instead of 224 + 224 + a 1-row tile that still loads
        a whole tile's operands).
    narrow_tile_m: tile_m of the user phase's `narrow` build (epi_m becomes gcd(epi_m,
        narrow_tile_m)), which the dispatch picks when the user GEMM in tiles that narrow
        still fits in one wave of the grid. The candidate phase's epilogues wait for the whole
        user phase (PDL), so while that is a single wave its wall time is on the critical
        path, not its efficiency per FLOP (reference shape: 15 users, 60 tiles of 224 rows ->
        120 tiles of 112).
    narrow_ab_stages: ab_stages of the narrow build (0: ab_stages). Its stages are 2/3 the
        size; 10 of them (150 KB) timed ~0.4% faster than 6 at the reference shape (H200,
        perf/results/tune_lce_h200_narrow.json).
    m_tail: the last tile along problem M runs a narrower WGMMA, the smallest
        `tile_m - 8 * j` (j = 1..m_tail) that covers what is left of M (M = 433: 224 + 216
        instead of 2 x 224 rows). Only widths near tile_m: a much narrower tile is bound by its
        loads' latency, not by the WGMMA (H200: M = 449, a 32-wide third tile, timed the same
        at 32 as at 224). 0: every tile runs tile_m wide. The epilogue (and the addend loader)
        skip subtiles wholly past M in any case.
    k_tail: the last k-tile issues only the k16 blocks that hold data below K (K = 866 with
        tile_k 32: 880 instead of 896 columns).
    rotate: when the last M tile is less than half as wide as the others, rotate each
        wave's cluster -> tile map of the persistent walk by one, so every cluster runs each M
        tile in turn (with the library's walk a cluster keeps one M tile when the grid is a
        multiple of the M tile count, and those with the narrow last one idle: M = 449, three
        M tiles, 0.73 -> 0.66 ms on the H200).
    debug_no_epilogue: diagnostics only (never exported by default): skip the epilogue,
        so the output is not written; times the loads and WGMMAs alone.
    debug_no_addend: diagnostics only: the epilogue neither loads nor adds the addend.
    debug_timeline: diagnostics only: consumer thread 0 of every CTA writes clock64 marks
        (cycles since it started) of its first 32 tiles as int32 into the LAST user slot of
        d, d[U-1] (which the caller must leave unreferenced by idx): per tile 8 ints at
        (cta * 32 + tile) * 8: tile start, first stage full, mainloop done, first addend
        subtile ready, epilogue done (perf/timeline_lce.py reads them).
    """

    tile_n: int = 128
    tile_m: int = 224
    # 6 x 32-deep stages hold what 3 x 64 would (135 KB) but keep the mainloop at 4 x 64's
    # pace, which leaves room for 4 addend stages (H200 timeline, perf/NOTES.md)
    tile_k: int = 32
    ab_stages: int = 6
    epi_stages: int = 4
    epi_m: int = 32
    addend_tma: bool = True
    addend_stages: int = 4
    cluster_n: int = 2
    cluster_m: int = 1
    num_ctas: int = 132
    pdl: bool = True
    m_tail: int = 2
    k_tail: bool = True
    rotate: bool = True
    wide_tile_m: int = 256
    narrow_tile_m: int = 112
    narrow_ab_stages: int = 10
    debug_no_epilogue: bool = False
    debug_no_addend: bool = False
    debug_timeline: bool = False


def _ab_stage_bytes(cfg: LceSm90Config, ab_dtype) -> int:
    return (cfg.tile_n + cfg.tile_m) * cfg.tile_k * ab_dtype.width // 8


def _epi_stage_bytes(cfg: LceSm90Config, c_dtype) -> int:
    return cfg.tile_n * cfg.epi_m * c_dtype.width // 8


def _addend_stage_bytes(cfg: LceSm90Config) -> int:
    return cfg.tile_n * cfg.epi_m * 4


def _fit_stages(cfg: LceSm90Config, ab_dtype, c_dtype, has_addend: bool) -> tuple:
    """(epi_stages, addend_stages) that fit next to the ab ring; addend_stages is 0 unless
    the addend is TMA-loaded."""
    left = _SMEM_CAPACITY - _SMEM_RESERVED - cfg.ab_stages * _ab_stage_bytes(cfg, ab_dtype)
    epi_b = _epi_stage_bytes(cfg, c_dtype)
    if not (has_addend and cfg.addend_tma):
        # 1024-byte alignment padding for each of the three buffers (conservative: every
        # buffer size is a multiple of 1024 bytes, so only the barrier block pads)
        left -= 3 * 1024
        return max(0, min(cfg.epi_stages, left // epi_b)), 0
    # Exact accounting: the barriers sit in the first 1024 bytes (_SMEM_RESERVED) and
    # every buffer is a multiple of 1024 bytes, so the 1024-byte aligned buffers pack.
    add_b = _addend_stage_bytes(cfg)
    # the one-barrier-per-subtile store scheme needs two output buffers; then one addend
    # stage, then addend stages up to addend_stages, then output buffers up to epi_stages
    epi = min(cfg.epi_stages, 2, max(0, left) // epi_b)
    left -= epi * epi_b
    add = min(cfg.addend_stages, max(0, left) // add_b)
    left -= add * add_b
    extra = min(cfg.epi_stages - epi, max(0, left) // epi_b)
    return epi + max(0, extra), add


def _fit_epi_stages(cfg: LceSm90Config, ab_dtype, c_dtype, has_addend: bool = False) -> int:
    return _fit_stages(cfg, ab_dtype, c_dtype, has_addend)[0]


def _m_tail_widths(cfg: LceSm90Config) -> tuple:
    """WGMMA widths (descending, all < tile_m) the last M tile may run instead of tile_m."""
    return tuple(w for w in (cfg.tile_m - 8 * j for j in range(1, cfg.m_tail + 1)) if w > 0)


def _mma_regs(num_mma_wg: int) -> int:
    # register file is 64K per SM; the producer warpgroup keeps 40 per thread
    return min(232, (65536 - 128 * 40) // (128 * num_mma_wg) // 8 * 8)


class LceGemmSm90:
    num_threads_per_wg = 128

    def __init__(self, ab_dtype, c_dtype, has_addend: bool,
                 config: LceSm90Config = LceSm90Config(), wide: bool = False,
                 narrow: bool = False):
        # wide: the build for M that wide_tile_m covers in fewer tiles; narrow: the user
        # phase's build for a one-wave user GEMM (see LceSm90Config)
        if wide and narrow:
            raise ValueError("LceGemmSm90: a build is wide or narrow, not both")
        if wide:
            config = dataclasses.replace(config, tile_m=config.wide_tile_m)
        if narrow:
            config = dataclasses.replace(config, tile_m=config.narrow_tile_m,
                                         epi_m=math.gcd(config.epi_m, config.narrow_tile_m),
                                         ab_stages=config.narrow_ab_stages or config.ab_stages)
        if not LceGemmSm90.can_implement(ab_dtype, c_dtype, has_addend, config):
            raise ValueError(f"LceGemmSm90 cannot run {ab_dtype}/{c_dtype} with {config}")
        self.ab_dtype = ab_dtype
        self.c_dtype = c_dtype
        self.acc_dtype = cutlass.Float32
        # the debug builds run without the addend (and its ring)
        self.has_addend = bool(has_addend) and not (config.debug_no_epilogue
                                                    or config.debug_no_addend)
        self.cfg = config

        # WGMMA-side tile (M', N', K) = (problem N, problem M, K)
        self.cta_tile = (config.tile_n, config.tile_m, config.tile_k)
        self.num_mma_wg = config.tile_n // 64
        self.threads_per_cta = (1 + self.num_mma_wg) * self.num_threads_per_wg
        self.num_mma_threads = self.num_mma_wg * self.num_threads_per_wg
        # WGMMA-side cluster (M', N') = (problem N, problem M)
        self.cluster_shape_mn = (config.cluster_n, config.cluster_m)
        self.cluster_size = config.cluster_n * config.cluster_m
        self.ab_stages = config.ab_stages
        self.epi_stages, self.addend_stages = _fit_stages(
            config, ab_dtype, c_dtype, self.has_addend)
        self.addend_tma = self.has_addend and config.addend_tma
        self.epi_tile = (config.tile_n, config.epi_m)
        self.load_warp_id = 0
        self.addend_load_warp_id = 1  # idle otherwise: second warp of the producer warpgroup
        self.epi_store_warp_id = 4  # first warp of the first consumer warpgroup
        # producer WG gives registers to the consumers (128 x 40 + 256 x 232 <= 64K)
        self.load_regs = 40
        self.mma_regs = _mma_regs(self.num_mma_wg)
        self.buffer_align_bytes = 1024

    @staticmethod
    def can_implement(ab_dtype, c_dtype, has_addend, config: LceSm90Config) -> bool:
        if ab_dtype not in (cutlass.Float16, cutlass.BFloat16):
            return False
        if c_dtype not in (ab_dtype, cutlass.Float32):
            return False
        cfg = config
        # 128 = two consumer warpgroups, the only shape whose epilogue fragment order
        # was checked (accumulator chunk e == epilogue subtile e)
        if cfg.tile_n != 128:
            return False
        if cfg.tile_m % 8 != 0 or not 8 <= cfg.tile_m <= 256:
            return False
        if cfg.tile_k not in (32, 64):
            return False
        if cfg.epi_m % 8 != 0 or cfg.tile_m % cfg.epi_m != 0:
            return False
        if cfg.ab_stages < 2 or cfg.epi_stages < 2:
            return False
        if has_addend and cfg.addend_tma and cfg.addend_stages < 1:
            return False
        if cfg.cluster_m not in (1, 2, 4) or cfg.cluster_n not in (1, 2, 4):
            return False
        csize = cfg.cluster_m * cfg.cluster_n
        if csize > 4 or cfg.num_ctas < csize:
            return False
        # accumulator registers per consumer thread: tile_m / 2 (plus ~60 for the rest)
        if cfg.tile_m // 2 + 64 > _mma_regs(cfg.tile_n // 64):
            return False
        # each CTA loads a 1/cluster slice of a multicast tile: keep whole swizzle atoms
        # (64 N-elements of the MN-major b tile, 8 M-rows of the K-major a tile)
        if cfg.tile_n % (64 * cfg.cluster_m) != 0 or cfg.tile_m % (8 * cfg.cluster_n) != 0:
            return False
        # the one-barrier-per-subtile store scheme needs two output buffers
        epi, add = _fit_stages(cfg, ab_dtype, c_dtype, bool(has_addend))
        if epi < 2:
            return False
        if has_addend and cfg.addend_tma and add < 1:
            return False
        return True

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, d: cute.Tensor,
                 idx: cute.Tensor, stream: cuda.CUstream):
        M = a.shape[0]
        L = b.shape[0]
        K = b.shape[1]
        N = b.shape[2]

        # WGMMA A operand: b[l]^T, (N, K, L), N contiguous (MN-major)
        mA = cute.make_tensor(
            b.iterator, cute.make_layout((N, K, L), stride=(1, b.stride[1], b.stride[0])))
        # WGMMA B operand: a^T seen as (M, K, L) K-major with a stride-0 batch mode. Its K
        # extent is b's K, so TMA zero-fills past K whatever a's padding holds.
        a_mk = cute.make_tensor(a.iterator, cute.make_layout((M, K), stride=(a.stride[0], 1)))
        mB = broadcast_mode(a_mk, L)
        # output c[l]^T: (N, M, L), N contiguous (M-major in WGMMA terms)
        mC = cute.make_tensor(
            c.iterator, cute.make_layout((N, M, L), stride=(1, c.stride[1], c.stride[0])))
        # addend d[u]^T: (N, M, U)
        mD = cute.make_tensor(
            d.iterator,
            cute.make_layout((N, M, d.shape[0]), stride=(1, d.stride[1], d.stride[0])))

        a_layout = utils.LayoutEnum.COL_MAJOR  # MN-major A
        b_layout = utils.LayoutEnum.ROW_MAJOR  # K-major B
        c_layout = utils.LayoutEnum.COL_MAJOR  # M-major C
        self.c_layout = c_layout

        bm, bn, bk = self.cta_tile
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype,
            OperandMajorMode.MN, OperandMajorMode.K,
            self.acc_dtype, (self.num_mma_wg, 1, 1), tiler_mn=(64, bn))

        a_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(a_layout, self.ab_dtype, bm), self.ab_dtype)
        a_smem_staged = cute.tile_to_shape(a_atom, (bm, bk, self.ab_stages), order=(1, 0, 2))
        b_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(b_layout, self.ab_dtype, bk), self.ab_dtype)
        b_smem_staged = cute.tile_to_shape(b_atom, (bn, bk, self.ab_stages), order=(0, 1, 2))
        epi_smem_staged = sm90_utils.make_smem_layout_epi(
            self.c_dtype, c_layout, self.epi_tile, self.epi_stages)

        a_smem = cute.slice_(a_smem_staged, (None, None, 0))
        b_smem = cute.slice_(b_smem_staged, (None, None, 0))
        # A (b tile) is shared by the CTAs along cluster mode 1, B (a tile) along mode 0
        mc_a = self.cluster_shape_mn[1]
        mc_b = self.cluster_shape_mn[0]
        tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp() if mc_a == 1
            else cpasync.CopyBulkTensorTileG2SMulticastOp(),
            mA, a_smem, (bm, bk), num_multicast=mc_a)
        tma_atom_b, tma_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp() if mc_b == 1
            else cpasync.CopyBulkTensorTileG2SMulticastOp(),
            mB, b_smem, (bn, bk), num_multicast=mc_b)
        tma_atom_c, tma_c = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mC,
            cute.slice_(epi_smem_staged, (None, None, 0)), self.epi_tile)

        tma_bytes = cute.size_in_bytes(self.ab_dtype, a_smem) + \
            cute.size_in_bytes(self.ab_dtype, b_smem)

        # addend ring: one (tile_n, epi_m) fp32 subtile of d[idx[l]]^T per stage, N
        # contiguous like the output (128-byte swizzle: the epilogue's per-thread reads,
        # consecutive in M, hit 32 distinct banks). TMA zero-fills rows/columns past N/M.
        add_smem_staged = None
        tma_atom_d = None
        tma_d = None
        add_bytes = 0
        if cutlass.const_expr(self.addend_tma):
            add_smem_staged = sm90_utils.make_smem_layout_epi(
                cutlass.Float32, c_layout, self.epi_tile, self.addend_stages)
            add_smem = cute.slice_(add_smem_staged, (None, None, 0))
            tma_atom_d, tma_d = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), mD, add_smem, self.epi_tile)
            add_bytes = cute.size_in_bytes(cutlass.Float32, add_smem)

        # tiles over (N', M', L) = (problem N, problem M, L); N' fastest, then M', then l,
        # so the few tiles of one batch entry run together and share b[l] through L2.
        ntiles = (cute.ceil_div(N, bm), cute.ceil_div(M, bn), L)
        sched_params = utils.PersistentTileSchedulerParams(
            ntiles, (*self.cluster_shape_mn, 1), 1, True)
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(
            sched_params, self.cfg.num_ctas // self.cluster_size)

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem_staged)],
                self.buffer_align_bytes]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem_staged)],
                self.buffer_align_bytes]
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(epi_smem_staged)],
                self.buffer_align_bytes]

        self.shared_storage = SharedStorage
        if cutlass.const_expr(self.addend_tma):
            @cute.struct
            class SharedStorageAddend:
                ab_mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
                add_mbar: cute.struct.MemRange[cutlass.Int64, self.addend_stages * 2]
                sA: cute.struct.Align[
                    cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem_staged)],
                    self.buffer_align_bytes]
                sB: cute.struct.Align[
                    cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem_staged)],
                    self.buffer_align_bytes]
                sC: cute.struct.Align[
                    cute.struct.MemRange[self.c_dtype, cute.cosize(epi_smem_staged)],
                    self.buffer_align_bytes]
                sAdd: cute.struct.Align[
                    cute.struct.MemRange[cutlass.Float32, cute.cosize(add_smem_staged)],
                    self.buffer_align_bytes]

            self.shared_storage = SharedStorageAddend

        self.kernel(
            tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_c, tma_c,
            mD, idx, tiled_mma,
            a_smem_staged, b_smem_staged, epi_smem_staged, tma_bytes, sched_params,
            tma_atom_d, tma_d, add_smem_staged, add_bytes,
        ).launch(
            grid=grid,
            block=[self.threads_per_cta, 1, 1],
            cluster=(*self.cluster_shape_mn, 1),
            min_blocks_per_mp=1,
            stream=stream,
            # the addend's producer (the user phase) may still run: see cfg.pdl
            use_pdl=self.cfg.pdl and self.has_addend,
        )

    # ---------------------------------------------------------------- device side
    @cute.jit
    def _load_addend(self, thr_copy_r2s, cC_t, gD, extent_nm, ecrd, dst):
        """dst[v] = d value for register v of epilogue subtile ecrd (0 outside M x N).
        partition_S, not partition_D: the register side of the r2s copy holds the
        accumulator fragment's elements (stmatrix redistributes them on the way)."""
        crds = thr_copy_r2s.partition_S(cute.local_tile(cC_t, self.epi_tile, ecrd))
        for v in cutlass.range_constexpr(cute.size(dst)):
            dst[v] = cutlass.Float32(0.0)
            crd = crds[v]
            if cute.elem_less(crd, extent_nm):
                dst[v] = gD[crd]

    @cute.jit
    def _work(self, sched, M):
        """The scheduler's next tile, with each wave's cluster -> tile map rotated by one per
        wave (cfg.rotate): the library's walk gives cluster k the tiles k + G*w of the G
        persistent clusters, so with G a multiple of the number of M tiles a cluster gets
        the same M tile in every wave, and those holding the narrower last M tile idle at
        the end. Rotating keeps each wave's tiles (and their L2 sharing) but cycles every
        cluster through the M tiles. The shift is 0 in the last wave W, so its partial set of
        tiles goes to the lowest clusters as in the library's walk: those start first (the
        others wait for the SMs the user phase holds; a shift of w there cost ~3% at M=433)."""
        if cutlass.const_expr(not self.cfg.rotate):
            return sched.get_current_work()
        G = sched.num_persistent_clusters
        w = sched.num_tiles_executed
        k = sched._current_work_linear_idx - w * G
        W = (cute.size(sched.params.problem_layout_ncluster_mnl) - 1) // G
        # w > W: past the last wave, any index >= W * G + G is invalid
        shift = (W - w + G) % G
        if (M - 1) % self.cta_tile[1] >= self.cta_tile[1] // 2:
            # the last M tile is at least half as wide as the others: the M tiles cost about
            # the same and rotating measured ~2% slower (M = 433; cause not found), so keep
            # the library's walk
            shift = 0
        return sched._get_current_work_for_linear_idx(w * G + (k + shift) % G)

    @cute.jit
    def _epi_count(self, M, tile_m_idx):
        """Epilogue subtiles of M' tile tile_m_idx that hold rows below M."""
        bn = self.cta_tile[1]
        epi_m = self.epi_tile[1]
        rem = M - tile_m_idx * bn
        n = bn // epi_m
        if rem < bn:
            n = (rem + epi_m - 1) // epi_m
        return n

    @cute.jit
    def _mainloop(self, tiled_mma, acc, tCrA, tCrB, ab_pipeline, read_state, release_state,
                  k_tile_cnt, kb_last):
        """WGMMA of one tile into acc; k-tile j's WGMMA overlaps the wait for k-tile j+1, and
        the stage of k-tile j-1 is released once its WGMMA has retired. The last k-tile
        issues its first kb_last k16 blocks only (the rest lie past K). Leaves the last
        k-tile's WGMMA in flight and its stage held."""
        # the WGMMA groups below stay written out: a helper setting ACCUMULATE does not get the
        # field carried through the loop and the branches (the DSL rejects the IR)
        num_k_blocks = cute.size(tCrA, mode=[2])
        read_state.reset_count()
        release_state.reset_count()
        # the tile's first WGMMA overwrites the accumulator (no zero fill)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        warpgroup.fence()
        for k_tile in range(k_tile_cnt - 1):
            ab_pipeline.consumer_wait(read_state)
            for kb in cutlass.range_constexpr(num_k_blocks):
                kc = (None, None, kb, read_state.index)
                cute.gemm(tiled_mma, acc, tCrA[kc], tCrB[kc], acc)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
            warpgroup.wait_group(1)
            if k_tile > 0:
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
            read_state.advance()
        ab_pipeline.consumer_wait(read_state)
        # one whole WGMMA group (committed inside) per count of k16 blocks the last k-tile may
        # issue (without cfg.k_tail, kb_last is the static num_k_blocks: one group, no branch)
        first = 1 if cutlass.const_expr(self.cfg.k_tail) else num_k_blocks
        for n in cutlass.range_constexpr(first, num_k_blocks + 1):
            if kb_last == n:
                for kb in cutlass.range_constexpr(n):
                    kc = (None, None, kb, read_state.index)
                    cute.gemm(tiled_mma, acc, tCrA[kc], tCrB[kc], acc)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
        warpgroup.wait_group(1)
        if k_tile_cnt > 1:
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
        read_state.advance()
        return read_state, release_state

    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        mC: cute.Tensor,
        mD: cute.Tensor,
        idx: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        epi_smem_staged: cute.ComposedLayout,
        tma_bytes: cutlass.Constexpr,
        sched_params: utils.PersistentTileSchedulerParams,
        tma_atom_d,
        mD_tma,
        add_smem_staged,
        add_bytes: cutlass.Constexpr,
    ):
        bm, bn, bk = self.cta_tile
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        if cutlass.const_expr(self.cfg.pdl and not self.has_addend):
            # the next kernel (the candidate phase) may launch onto the SMs this one leaves
            # free; it waits for this grid before it reads what this grid writes
            cute.arch.griddepcontrol_launch_dependents()
        if warp_idx == self.load_warp_id:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
            cpasync.prefetch_descriptor(tma_atom_c)
        if cutlass.const_expr(self.addend_tma):
            if warp_idx == self.addend_load_warp_id:
                cpasync.prefetch_descriptor(tma_atom_d)

        cta_layout_mnk = cute.make_layout((*self.cluster_shape_mn, 1))
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        mc_a = self.cluster_shape_mn[1]
        mc_b = self.cluster_shape_mn[0]
        a_mcast_mask = 0
        b_mcast_mask = 0
        if cutlass.const_expr(mc_a > 1):
            a_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=1)
        if cutlass.const_expr(mc_b > 1):
            b_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # full barrier: 1 producer arrive + tx bytes; empty barrier: one arrive per consumer
        # warp from each CTA the stage was multicast into
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, (mc_a + mc_b - 1) * self.num_mma_wg * 4),
            tx_count=tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
            defer_sync=True,
        )
        # addend ring (CTA-local): full barrier = 1 producer arrive + tx bytes; empty barrier =
        # ONE arrive per stage, from the epilogue store warp after the epilogue barrier that
        # all consumer threads pass only once they have read the stage
        add_pipeline = None
        if cutlass.const_expr(self.addend_tma):
            add_pipeline = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.add_mbar.data_ptr(),
                num_stages=self.addend_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                tx_count=add_bytes,
                defer_sync=True,
            )
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sC = storage.sC.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)
        sAdd = None
        if cutlass.const_expr(self.addend_tma):
            # (tile_n, epi_m, ADD_STAGE)
            sAdd = storage.sAdd.get_tensor(add_smem_staged.outer, swizzle=add_smem_staged.inner)

        # (bm, bk, RestN', RestK, L) and (bn, bk, RestM', RestK, L)
        gA = cute.local_tile(mA, (bm, bk), (None, None, None))
        gB = cute.local_tile(mB, (bn, bk), (None, None, None))
        # (bm, bn, RestN', RestM', L)
        gC = cute.local_tile(mC, (bm, bn), (None, None, None))

        # A is split across the cluster's CTAs along M' and multicast to all of them
        a_cta_layout = cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape)
        tAsA, tAgA = cpasync.tma_partition(
            tma_atom_a, cluster_coord[1], a_cta_layout,
            cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        b_cta_layout = cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape)
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b, cluster_coord[0], b_cta_layout,
            cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))

        wg_idx = cute.arch.make_warp_uniform(tidx // self.num_threads_per_wg)
        mma_thr_layout = cute.make_layout(self.num_mma_wg, stride=self.num_threads_per_wg)
        thr_mma = tiled_mma.get_slice(mma_thr_layout(wg_idx - 1))
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        tCgC = thr_mma.partition_C(gC)
        acc = cute.make_rmem_tensor(tCgC.shape[:3], self.acc_dtype)

        k_tile_cnt = cute.size(gA, mode=[3])
        M_rows = mC.shape[1]
        # k16 blocks of the last k-tile that hold data below K
        kb_last = bk // 16
        if cutlass.const_expr(self.cfg.k_tail):
            kb_last = (mA.shape[1] - (k_tile_cnt - 1) * bk + 15) // 16

        # the last M' tile's narrower WGMMAs (cfg.m_tail): the same smem stages and
        # accumulator registers, seen w rows (B) / columns (accumulator) wide. The
        # accumulator fragment holds its columns in 8-wide chunks, outermost, so the w-wide
        # fragment is a prefix of the bn-wide one; the columns past w keep stale values and
        # lie wholly past M, where the TMA store clips them.
        # widths[i] runs mmas[i] on Bs[i] into accs[i]; entry 0 is the full tile
        widths = (bn,) + _m_tail_widths(self.cfg)
        mmas, Bs, accs = [tiled_mma], [tCrB], [acc]
        for w in widths[1:]:
            mma_w = sm90_utils.make_trivial_tiled_mma(
                self.ab_dtype, self.ab_dtype, OperandMajorMode.MN, OperandMajorMode.K,
                self.acc_dtype, (self.num_mma_wg, 1, 1), tiler_mn=(64, w))
            b_w = cute.composition(
                b_smem_staged.outer,
                cute.make_layout((w, bk, self.ab_stages), stride=(1, bn, bn * bk)))
            sB_w = storage.sB.get_tensor(b_w, swizzle=b_smem_staged.inner)
            thr_w = mma_w.get_slice(mma_thr_layout(wg_idx - 1))
            mmas.append(mma_w)
            Bs.append(mma_w.make_fragment_B(thr_w.partition_B(sB_w)))
            acc_shape_w = thr_w.partition_C(cute.local_tile(mC, (bm, w), (0, 0, 0))).shape
            accs.append(cute.make_tensor(acc.iterator, cute.make_layout(acc_shape_w)))

        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.load_regs)

        # ------------------------------------------------------------ producer warp
        if warp_idx == self.load_warp_id:
            sched = utils.StaticPersistentTileScheduler.create(
                sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
            work = self._work(sched, M_rows)
            prod_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, self.ab_stages)
            while work.is_valid_tile:
                tc = work.tile_idx
                tAgA_t = tAgA[(None, tc[0], None, tc[2])]
                tBgB_t = tBgB[(None, tc[1], None, tc[2])]
                # count = k-tile index within this tile; index/phase keep running
                prod_state.reset_count()
                for _k in range(k_tile_cnt):
                    ab_pipeline.producer_acquire(prod_state)
                    bar = ab_pipeline.producer_get_barrier(prod_state)
                    cute.copy(tma_atom_a, tAgA_t[(None, prod_state.count)],
                              tAsA[(None, prod_state.index)],
                              tma_bar_ptr=bar, mcast_mask=a_mcast_mask)
                    cute.copy(tma_atom_b, tBgB_t[(None, prod_state.count)],
                              tBsB[(None, prod_state.index)],
                              tma_bar_ptr=bar, mcast_mask=b_mcast_mask)
                    ab_pipeline.producer_commit(prod_state)
                    prod_state.advance()
                sched.advance_to_next_work()
                work = self._work(sched, M_rows)
            # keep the CTA alive until consumers released every stage (multicast peers
            # may still be writing into our smem otherwise)
            ab_pipeline.producer_tail(prod_state)

        # epilogue subtiles, in the order the accumulator fragment holds them
        # (row-major over (1, tile_m / epi_m): a subtile spans the whole tile_n)
        epi_grid = (bm // self.epi_tile[0], bn // self.epi_tile[1])
        epi_num = epi_grid[0] * epi_grid[1]
        epi_order = cute.make_layout(epi_grid, stride=(epi_grid[1], 1))

        # ------------------------------------------------------- addend loader warp
        # Loads every epilogue subtile the epilogue stores (those wholly past M are skipped
        # by both; parts past M or N are zero-filled by TMA, which still signals the full
        # byte count), in the order the consumers read them, so both sides advance the ring
        # once per subtile.
        if cutlass.const_expr(self.addend_tma):
            if warp_idx == self.addend_load_warp_id:
                # (bm, bn, RestN', RestM', U)
                gD_tma = cute.local_tile(mD_tma, (bm, bn), (None, None, None))
                if cutlass.const_expr(self.cfg.pdl):
                    # d is written by the previous grid (the user phase)
                    cute.arch.griddepcontrol_wait()
                sched = utils.StaticPersistentTileScheduler.create(
                    sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
                work = self._work(sched, M_rows)
                add_prod_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.addend_stages)
                while work.is_valid_tile:
                    tc = work.tile_idx
                    u = idx[tc[2]]
                    gD_epi = cute.zipped_divide(
                        gD_tma[(None, None, tc[0], tc[1], u)], self.epi_tile)
                    bGS_sD, bGS_gD = cpasync.tma_partition(
                        tma_atom_d, 0, cute.make_layout(1),
                        cute.group_modes(sAdd, 0, 2), gD_epi)
                    n_epi = self._epi_count(M_rows, tc[1])
                    for e in cutlass.range_constexpr(epi_num):
                        if e < n_epi:
                            add_pipeline.producer_acquire(add_prod_state)
                            cute.copy(tma_atom_d, bGS_gD[(None, epi_order.get_hier_coord(e))],
                                      bGS_sD[(None, add_prod_state.index)],
                                      tma_bar_ptr=add_pipeline.producer_get_barrier(
                                          add_prod_state))
                            add_pipeline.producer_commit(add_prod_state)
                            add_prod_state.advance()
                    sched.advance_to_next_work()
                    work = self._work(sched, M_rows)
                # every stage released: no TMA write into smem outlives this warp
                add_pipeline.producer_tail(add_prod_state)

        # ------------------------------------------------------- consumer warpgroups
        if wg_idx > 0:
            cute.arch.setmaxregister_increase(self.mma_regs)
            mma_tidx = tidx - self.num_threads_per_wg
            sched = utils.StaticPersistentTileScheduler.create(
                sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
            work = self._work(sched, M_rows)
            read_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.ab_stages)
            release_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.ab_stages)

            # registers -> smem copy shaped like the accumulator fragment
            copy_atom_r2s = sm90_utils.sm90_get_smem_store_op(
                self.c_layout, elem_ty_d=self.c_dtype, elem_ty_acc=self.acc_dtype)
            copy_atom_c = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4),
                self.c_dtype)
            tiled_copy_c_atom = cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma)
            tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, tiled_copy_c_atom)
            thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
            tRS_sC = thr_copy_r2s.partition_D(sC)  # (R2S, R2S_M, R2S_N, PIPE)
            tRS_rAcc = tiled_copy_r2s.retile(acc)
            rD_shape = cute.shape(thr_copy_r2s.partition_S(sC))[:3]
            tRS_rD = cute.make_rmem_tensor(rD_shape, self.acc_dtype)
            tRS_rOut = cute.make_rmem_tensor(rD_shape, self.c_dtype)
            size_rD = cute.size(tRS_rD)

            epi_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)

            # coordinates (n, m) of every output element, for the addend's predicate
            cC = cute.make_identity_tensor((mC.shape[0], mC.shape[1]))
            gcC = cute.local_tile(cC, (bm, bn), (None, None))
            extent_nm = (mC.shape[0], mC.shape[1])
            # double-buffered addend fragments (same element order as tRS_rD), LDG path
            rAdd = [cute.make_rmem_tensor(rD_shape, self.acc_dtype) for _ in range(2)]
            # TMA path: the addend ring partitioned with the accumulator fragment's
            # thread -> element mapping (partition_S, as for the LDG coordinates)
            tRS_sAdd = None
            add_cons_state = None
            if cutlass.const_expr(self.addend_tma):
                tRS_sAdd = thr_copy_r2s.partition_S(sAdd)  # (R2S, R2S_M, R2S_N, ADD_STAGE)
                add_cons_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Consumer, self.addend_stages)
            use_ldg_addend = self.has_addend and not self.addend_tma
            if cutlass.const_expr(self.cfg.pdl and use_ldg_addend):
                cute.arch.griddepcontrol_wait()  # these threads read d, the user phase's output
            dbg = self.cfg.debug_timeline
            tl = None
            t_base = cutlass.Int64(0)
            tl_cta = cute.arch.block_idx()[2] * self.cluster_size + cta_rank
            if cutlass.const_expr(dbg):
                t_base = cute.arch.clock64()
                tl = cute.make_tensor(
                    cute.recast_ptr(mD.iterator + cutlass.Int64(mD.shape[2] - 1) *
                                    cutlass.Int64(mD.stride[2]), dtype=cutlass.Int32),
                    cute.make_layout(1 << 16))
            epi_cnt = cutlass.Int32(0)  # epilogue subtiles stored so far (output buffers)
            while work.is_valid_tile:
                tc = work.tile_idx
                j = sched.num_tiles_executed  # tiles this CTA finished so far
                tl_slot = 0
                tl_on = False
                if cutlass.const_expr(dbg):
                    tl_slot = (tl_cta * 32 + j) * 8
                    tl_on = (mma_tidx == 0) & (j < 32)
                    if tl_on:
                        tl[tl_slot] = cutlass.Int32(cute.arch.clock64() - t_base)
                # addend rows of this batch entry; idx is read before the mainloop so its
                # latency hides behind it
                cC_t = gcC[(None, None, tc[0], tc[1])]
                gD = mD[(None, None, 0)]
                if cutlass.const_expr(use_ldg_addend):
                    gD = mD[(None, None, idx[tc[2]])]
                if cutlass.const_expr(dbg):
                    ab_pipeline.consumer_wait(read_state)  # waited again in the mainloop
                    if tl_on:
                        tl[tl_slot + 1] = cutlass.Int32(cute.arch.clock64() - t_base)
                # problem-M rows from this tile on; the last M' tile may run narrower
                rem_m = M_rows - tc[1] * bn
                sel = 0  # the narrowest width that covers rem_m (widths descend)
                for i in cutlass.range_constexpr(1, len(widths)):
                    if rem_m <= widths[i]:
                        sel = i
                for i in cutlass.range_constexpr(len(widths)):
                    if sel == i:
                        read_state, release_state = self._mainloop(
                            mmas[i], accs[i], tCrA, Bs[i], ab_pipeline, read_state,
                            release_state, k_tile_cnt, kb_last)
                if cutlass.const_expr(use_ldg_addend):
                    # first addend subtile loads overlap the last WGMMA
                    self._load_addend(thr_copy_r2s, cC_t, gD, extent_nm,
                                      epi_order.get_hier_coord(0), rAdd[0])
                warpgroup.wait_group(0)
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
                if cutlass.const_expr(dbg):
                    if tl_on:
                        tl[tl_slot + 2] = cutlass.Int32(cute.arch.clock64() - t_base)

                # ---------------------------------------------------------- epilogue
                if cutlass.const_expr(self.cfg.debug_no_epilogue):
                    # keep the accumulator (and so the WGMMAs) alive
                    if acc[0] == cutlass.Float32(-1.25e-37):
                        mD[(0, 0, 0)] = acc[0]
                if cutlass.const_expr(not self.cfg.debug_no_epilogue):
                    gC_t = gC[(None, None, tc[0], tc[1], tc[2])]
                    gC_epi = cute.zipped_divide(gC_t, self.epi_tile)
                    bSG_sC, bSG_gC = cpasync.tma_partition(
                        tma_atom_c, 0, cute.make_layout(1),
                        cute.group_modes(sC, 0, 2), gC_epi)
                    n_epi = self._epi_count(M_rows, tc[1])
                    for e in cutlass.range_constexpr(epi_num):
                        if e < n_epi:  # subtiles wholly past M are skipped
                            for v in cutlass.range_constexpr(size_rD):
                                tRS_rD[v] = tRS_rAcc[e * size_rD + v]
                            ecrd = epi_order.get_hier_coord(e)
                            if cutlass.const_expr(self.addend_tma):
                                # stage add_cons_state holds subtile e of this tile; it is released
                                # by the store warp after the epilogue barrier below
                                add_pipeline.consumer_wait(add_cons_state)
                                if cutlass.const_expr(dbg and e == 0):
                                    if tl_on:
                                        tl[tl_slot + 3] = cutlass.Int32(
                                            cute.arch.clock64() - t_base)
                                sAdd_e = tRS_sAdd[(None, None, None, add_cons_state.index)]
                                for v in cutlass.range_constexpr(size_rD):
                                    tRS_rD[v] = tRS_rD[v] + sAdd_e[v]
                            if cutlass.const_expr(use_ldg_addend):
                                # loads for the next subtile fly while this one is stored
                                if cutlass.const_expr(e + 1 < epi_num):
                                    self._load_addend(thr_copy_r2s, cC_t, gD, extent_nm,
                                                      epi_order.get_hier_coord(e + 1),
                                                      rAdd[(e + 1) % 2])
                                for v in cutlass.range_constexpr(size_rD):
                                    tRS_rD[v] = tRS_rD[v] + rAdd[e % 2][v]
                            tRS_rOut.store(tRS_rD.load().to(self.c_dtype))
                            buf = (epi_cnt + e) % self.epi_stages
                            # buffer buf was last read by the store issued epi_stages subtiles ago;
                            # the store warp waited for it before the previous barrier (below)
                            cute.copy(tiled_copy_r2s, tRS_rOut, tRS_sC[(None, None, None, buf)])
                            # make the generic-proxy smem accesses (output writes, and the addend
                            # reads before the loader's next TMA write) ordered with the async proxy
                            cute.arch.fence_proxy("async.shared", space="cta")
                            if warp_idx == self.epi_store_warp_id:
                                # one barrier per subtile: the buffer written after this barrier,
                                # (epi_cnt + e + 1) % epi_stages, was last read by the store issued
                                # epi_stages - 1 subtiles ago; leave at most epi_stages - 2 stores
                                # reading smem. Waiting here, not right after the commit, gives the
                                # last store this warp's convert/stmatrix time to drain.
                                cute.arch.cp_async_bulk_wait_group(self.epi_stages - 2, read=True)
                            epi_bar.arrive_and_wait()
                            if warp_idx == self.epi_store_warp_id:
                                if cutlass.const_expr(self.addend_tma):
                                    # every consumer thread has read the stage (barrier above)
                                    add_pipeline.consumer_release(add_cons_state)
                                cute.copy(tma_atom_c, bSG_sC[(None, buf)], bSG_gC[(None, ecrd)])
                                cute.arch.cp_async_bulk_commit_group()
                            if cutlass.const_expr(self.addend_tma):
                                add_cons_state.advance()
                    epi_cnt = epi_cnt + n_epi
                    if cutlass.const_expr(dbg):
                        if tl_on:
                            tl[tl_slot + 4] = cutlass.Int32(cute.arch.clock64() - t_base)

                sched.advance_to_next_work()
                work = self._work(sched, M_rows)

            if warp_idx == self.epi_store_warp_id:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
