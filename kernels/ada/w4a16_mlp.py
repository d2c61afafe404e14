"""Ada design of a W4A16 SwiGLU MLP block of decode in one persistent launch (the megakernel's
first cross-CTA dependency; kernels/CONTRACT_MEGAKERNEL.md):

    h = silu(x Wg^T) * (x Wu^T)      (fp32, rounded once to the activation dtype)
    out = h Wd^T

Phase 1 runs the W4A16 GEMM's 32-column build (kernels/ada/w4a16_gemm.py) over a gate / up
weight whose 16-column blocks alternate (block 2i = gate columns 16i.., block 2i + 1 = up
columns 16i..), so a tile holds both halves of its 16 h columns and its epilogue writes
silu(gate) * up. Phase 2 runs the 16-column build over the down weight with h as its
activations. Between them every CTA waits for every other CTA's h stores:

- flags (the spec's correctness rules): after its phase-1 stores a CTA passes a barrier and
  thread 0 stores the launch's target value into the CTA's own word, `st.release.gpu`; one
  warp reads every CTA's word (relaxed, 16 independent loads per lane per poll, so one L2
  round trip per poll for up to 512 CTAs) until all hold the target, then `fence.acq_rel.gpu`
  and a CTA barrier, and phase 2 reads h with cp.async.cg (L2, never a stale L1 line). One
  writer per word, no atomics.
- the target is the generation word the previous launch published plus one (CTA 0 publishes
  it at its end, after its own wait has seen every CTA's flag, so every CTA has read the old
  generation by then): the words never need resetting, CUDA-graph replays included.
- all CTAs must be co-resident (the host sizes the grid from the build's CTAs per SM and the
  device's shared memory), else a waiting CTA could hold the SM a missing one needs.
- the down-projection codes of a CTA's first phase-2 tile are fetched into L2 after its own
  phase 1, before it waits for the others (prefetch.global.L2; config `prefetch_down`: the
  weights stream while the dependency resolves). At entry instead it ran 2-4% slower on an
  H100 at 1..16 rows (perf/results/ab_w4a16_mlp_prefetch_h100.json).
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from kernels.ada.w4a16_gemm import SMEM_LIMIT_BYTES, W4a16GemmAda, _Shape, smem_bytes

SASS_REQUIRED = ("LDGSTS", "HMMA")
# flags are plain release / acquire loads and stores: no atomics anywhere
SASS_FORBIDDEN = ("HGMMA", "UTCHMMA", "UTMALDG", "ATOM", "ATOMG", "RED", "REDG", "LDL", "STL")

_DTYPES = (cutlass.Float16, cutlass.BFloat16)
_POLL = 16   # flags per lane per poll: grids up to 512 CTAs in one round trip


@dsl_user_op
def prefetch_l2(ptr, *, loc=None, ip=None):
    """prefetch.global.L2 of the 128-byte line holding ptr (no destination, no wait)."""
    addr = Int64(ptr.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip)
    llvm.inline_asm(None, [addr], "prefetch.global.L2 [$0];", "l", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dataclass(frozen=True)
class W4a16MlpAdaConfig:
    # 8 warps per CTA, 2 CTAs per SM: the down phase's 16-column tiles get 8 warps each (its
    # K = F split 8 ways, as the stand-alone GEMM runs it). 4 warps x 3 CTAs (the GEMM's wide
    # build) timed 27.9 vs 22.5 us at 1 row (Qwen3-1.7B's MLP, H100; perf/NOTES.md).
    warps: int = 8
    stages: int = 4         # ring slots per warp, batches <= 8
    stages16: int = 2       # the same for the rows16 build (99 KB per CTA at most)
    ctas_per_sm: int = 2    # the persistent grid, at most (all co-resident: see the docstring)
    # L2 prefetch of the codes of the CTA's first down tile: "entry" (while phase 1 streams
    # its own weights), "wait" (after phase 1, before the wait) or "none"
    prefetch_down: str = "wait"


def phase_shapes(config: W4a16MlpAdaConfig, rows16: bool) -> tuple:
    """(gate / up phase, down phase) build shapes: 32- and 16-column tiles, same warps and
    ring depth (the CTA's buffers are sized for the first, the larger)."""
    nb = 2 if rows16 else 1
    r = config.stages16 if rows16 else config.stages
    return (_Shape(config.warps, r, 2, config.ctas_per_sm, nb),
            _Shape(config.warps, r, 1, config.ctas_per_sm, nb))


class W4a16MlpAda(W4a16GemmAda):
    def __init__(self, dtype, rows16: bool, config: W4a16MlpAdaConfig = W4a16MlpAdaConfig()):
        if not W4a16MlpAda.can_implement(dtype, rows16, config):
            raise ValueError(f"W4a16MlpAda cannot implement {dtype}, rows16={rows16}, {config}")
        self.dtype = dtype
        self.bf16 = dtype is cutlass.BFloat16
        self.rows16 = rows16
        self.cfg = config
        self.b, self.bd = phase_shapes(config, rows16)

    @staticmethod
    def can_implement(dtype, rows16, config: W4a16MlpAdaConfig) -> bool:
        b, _ = phase_shapes(config, rows16)
        if dtype not in _DTYPES or b.stages < 2 or b.warps < 1:
            return False
        if config.prefetch_down not in ("entry", "wait", "none"):
            return False
        return smem_bytes(b) <= SMEM_LIMIT_BYTES

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, x: cute.Tensor, packed_gu: cute.Tensor, scales_gu: cute.Tensor,
                 packed_d: cute.Tensor, scales_d: cute.Tensor, h: cute.Tensor,
                 out: cute.Tensor, sync: cute.Tensor, ctas: Int32, ks_gu: Int32, ks_d: Int32,
                 stream: cuda.CUstream):
        # the host's grid: every CTA co-resident (they wait for each other)
        self.kernel(x, packed_gu, scales_gu, packed_d, scales_d, h, out, sync, ks_gu,
                    ks_d).launch(grid=[ctas, 1, 1], block=[32 * self.b.warps, 1, 1],
                                 stream=stream, min_blocks_per_mp=self.b.ctas_per_sm,
                                 preferred_smem_carveout=100)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, x: cute.Tensor, packed_gu: cute.Tensor, scales_gu: cute.Tensor,
               packed_d: cute.Tensor, scales_d: cute.Tensor, h: cute.Tensor, out: cute.Tensor,
               sync: cute.Tensor, ks_gu: Int32, ks_d: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        # this launch's flag value: the previous launch's generation + 1 (read before this
        # CTA's flag is stored, so before CTA 0 can publish the next generation)
        target = cute.arch.load(sync.iterator, Int32, sem="relaxed", scope="gpu") + 1

        sW, sX, sS, red = self._smem(self.b)
        if cutlass.const_expr(self.cfg.prefetch_down == "entry"):
            self._prefetch_first_tile(packed_d, scales_d, ks_d, warp, lane, bid)
        self._gemm(self.b, x, packed_gu, scales_gu, h, ks_gu, sW, sX, sS, red, True)
        if cutlass.const_expr(self.cfg.prefetch_down == "wait"):
            self._prefetch_first_tile(packed_d, scales_d, ks_d, warp, lane, bid)
        cute.arch.sync_threads()
        if tidx == 0:
            cute.arch.store(sync.iterator + 1 + bid, target, sem="release", scope="gpu")
        if warp == 0:
            # each lane reads its flags lane, lane + 32, ... at once (relaxed, independent
            # loads: one L2 round trip per poll, not one per 32 CTAs), then one acquire fence
            for base in cutlass.range(0, grid, 32 * _POLL, unroll=1):
                pending = Int32(1)
                while pending != 0:
                    late = Int32(0)
                    for j in cutlass.range_constexpr(_POLL):
                        i = cutlass.min(base + 32 * j + lane, grid - 1)
                        v = cute.arch.load(sync.iterator + 1 + i, Int32, sem="relaxed",
                                           scope="gpu")
                        late = late | Int32(v != target)
                    pending = Int32(cute.arch.vote_ballot_sync(late != 0))
            cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        self._gemm(self.bd, h, packed_d, scales_d, out, ks_d, sW, sX, sS, red, False)
        if (bid == 0) & (tidx == 0):
            # every CTA's flag holds target (CTA 0 waited for them): all have read the old
            # generation, so the next launch may see the new one
            cute.arch.store(sync.iterator, target, sem="relaxed", scope="gpu")

    @cute.jit
    def _prefetch_first_tile(self, packed: cute.Tensor, scales: cute.Tensor, ks: Int32,
                             warp: Int32, lane: Int32, bid: Int32):
        """L2 prefetch of the codes this warp streams for its first down tile (the run of k
        blocks _gemm gives it: contiguous 512-byte blocks, 4 lines each)."""
        wn = warp // ks
        kk = warp - wn * ks
        groups = scales.shape[0]
        bpg = packed.shape[1] // groups
        b_lo = ((groups * kk) // ks) * bpg
        nblk = ((groups * (kk + 1)) // ks) * bpg - b_lo
        tile = bid * (self.bd.warps // ks) + wn
        if tile < packed.shape[0]:
            base = packed.iterator + (tile * packed.stride[0] + b_lo * packed.stride[1])
            for i in cutlass.range(lane, nblk * 4, 32, unroll=1):
                prefetch_l2(base + i * 32)
