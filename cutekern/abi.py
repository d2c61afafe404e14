"""Argument ABI shared by the compile side and the DSL-free runtime.

An op's entry takes a fixed list of arguments. Each tensor argument is described
by (name, dtype, rank, which mode is contiguous, alignment in elements); every
other extent and stride is dynamic. The compile side turns this into fake
tensors; the runtime turns it into the C structs the exported object expects.
This module must import without the DSL or torch.
"""
from __future__ import annotations

from dataclasses import dataclass

# dtype name -> bytes per element. Names are the ones the manifest stores.
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "int32": 4}


@dataclass(frozen=True)
class TensorArg:
    name: str
    dtype: str
    rank: int
    align: int = 8  # elements; base address and non-unit strides are multiples of this

    @property
    def n_dyn_shapes(self) -> int:
        return self.rank

    @property
    def n_dyn_strides(self) -> int:
        # the last mode is contiguous (stride 1, static); all others dynamic
        return self.rank - 1

    def to_json(self) -> dict:
        return {"kind": "tensor", "name": self.name, "dtype": self.dtype,
                "rank": self.rank, "align": self.align,
                "dynamic_shapes": self.n_dyn_shapes, "dynamic_strides": self.n_dyn_strides}


@dataclass(frozen=True)
class ScalarArg:
    """A by-value scalar (int32 or float32); the entry receives a pointer to the value."""
    name: str
    dtype: str

    def to_json(self) -> dict:
        return {"kind": "scalar", "name": self.name, "dtype": self.dtype}


@dataclass(frozen=True)
class StreamArg:
    name: str = "stream"

    def to_json(self) -> dict:
        return {"kind": "stream", "name": self.name}


def lce_gemm_abi(ab: str, c: str) -> tuple:
    """ABI of the batched broadcast GEMM behind IKBO linear compression.

    c[l, m, n] = sum_k a[m, k] * b[l, k, n]  (+ d[idx[l], m, n] when the variant has an addend)
      a   (M, Ka)    ab         shared weight; Ka >= K, columns >= K are zero
      b   (L, K, N)  ab         per-batch embeddings, N contiguous
      c   (L, M, N)  c          output, N contiguous
      d   (U, M, N)  float32    per-user partial result (ignored without addend)
      idx (L,)       int32      batch -> user row of d (ignored without addend)
    """
    return (
        TensorArg("a", ab, 2, align=8),
        TensorArg("b", ab, 3, align=8),
        TensorArg("c", c, 3, align=16 // DTYPE_BYTES[c]),
        TensorArg("d", "float32", 3, align=4),
        TensorArg("idx", "int32", 1, align=1),
        StreamArg(),
    )


def ikbo_attention_abi(dtype: str) -> tuple:
    """ABI of IKBO candidate-over-user attention (one head dim per compiled variant).

    Rows r index (candidate, seed) pairs: r = b * n_seed + s. A user's candidates are
    contiguous, so its query rows form one contiguous range; the work list cuts every
    user's range into chunks of at most ``block_m`` rows (config), never mixing users.
      q     (R, H, D)        dtype    queries, D contiguous
      k, v  (U, S, H, D)     dtype    per-user keys/values, padded to S = S_max
      kv_len (U,)            int32    valid keys of each user (0..S)
      work  (W, 3)           int32    (user, row_begin, row_end) per chunk; user < 0: skip
      scale (1,)             float32  softmax scale
      out   (R, H, D)        dtype
      lse   (R, H)           float32  natural-log log-sum-exp of the scaled scores
      num_ctas               int32    grid size of a persistent design (the host passes
                                      min(W * H, SM count)); a (W, H) grid design ignores it
    """
    return (
        TensorArg("q", dtype, 3, align=8),
        TensorArg("k", dtype, 4, align=8),
        TensorArg("v", dtype, 4, align=8),
        TensorArg("kv_len", "int32", 1, align=1),
        TensorArg("work", "int32", 2, align=1),
        TensorArg("scale", "float32", 1, align=1),
        TensorArg("out", dtype, 3, align=8),
        TensorArg("lse", "float32", 2, align=1),
        ScalarArg("num_ctas", "int32"),
        StreamArg(),
    )


# AttnRes `work` buffer: [0, 2) the row-scheduler counters of the sm90 one-CTA-per-row kernel;
# from ATTN_RES_XCH_OFF_WORDS the records of the split kernels that exchange through global
# memory (the Ada design's): per split C in ATTN_RES_XCH_SPLITS, ATTN_RES_XCH_MAX_CTAS records
# (one per CTA of the grid) of ATTN_RES_XCH_RECORD 8-byte words (2 parities x 18 totals).
ATTN_RES_XCH_OFF_WORDS = 64
ATTN_RES_XCH_MAX_CTAS = 132
ATTN_RES_XCH_SPLITS = (2, 4, 8)
ATTN_RES_XCH_RECORD = 2 * 18
ATTN_RES_WORK_WORDS = (ATTN_RES_XCH_OFF_WORDS
                       + len(ATTN_RES_XCH_SPLITS) * ATTN_RES_XCH_MAX_CTAS * ATTN_RES_XCH_RECORD * 2)


def attn_res_abi(dtype: str) -> tuple:
    """ABI of the AttnRes serving op (one fused pass per call).

      prefix   (M, H)      dtype   running in-block sum; rewritten as bf16(prefix + delta)
      delta    (M, H)      dtype   read only when has_delta
      blocks   (M, NB, H)  dtype   snapshot bank; slot write_idx <- new prefix when >= 0
      norm_w, qk_w (H,)    dtype   key RMSNorm weight, pseudo-query
      out_norm_w (H,)      dtype   read only when has_out_norm
      out      (M, H)      dtype
      num_blocks K (0..NB), write_idx (-1 or 0..NB-1), has_delta, has_out_norm: int32
      eps, out_eps: float32
      work     (W,)        int32   zero before the first launch, then kept by the caller for
                                   all its launches on one stream: [0, 2) row-scheduler
                                   counters (sm90, one CTA per row; left zero), and with
                                   W = ATTN_RES_WORK_WORDS the exchange records of the split
                                   kernels without clusters (Ada design, row_split > 1;
                                   sequence numbers that run on across launches)
    """
    return (
        TensorArg("prefix", dtype, 2, align=8),
        TensorArg("delta", dtype, 2, align=8),
        TensorArg("blocks", dtype, 3, align=8),
        TensorArg("norm_w", dtype, 1, align=8),
        TensorArg("qk_w", dtype, 1, align=8),
        TensorArg("out_norm_w", dtype, 1, align=8),
        TensorArg("out", dtype, 2, align=8),
        ScalarArg("num_blocks", "int32"),
        ScalarArg("write_idx", "int32"),
        ScalarArg("has_delta", "int32"),
        ScalarArg("has_out_norm", "int32"),
        ScalarArg("eps", "float32"),
        ScalarArg("out_eps", "float32"),
        TensorArg("work", "int32", 1, align=1),
        StreamArg(),
    )


# The one-launch small-batch plan kernel (kernels/sm90/bgmv_binplan.py, pair_kernel): a CTA per
# (token, 64 output columns); its exchange buffer (the plan's `ws`, zeroed once at prepare) holds
# one 8-byte launch-count word per CTA, then one 8-byte word (seq << 32 | fp32 bits) per
# (pair, 8 ranks, shrink segment of BGMV_SEG_H elements, rank).
BGMV_SEG_H = 384
BGMV_PAIR_COLS = 64
BGMV_PAIR_SMEM_BYTES = 64 * 1024     # shared memory per CTA, at most (the kernel checks)


def bgmv_pair_xch_words(t: int, k: int, r: int, h: int, n: int) -> int:
    """8-byte words of the small-batch plan kernel's exchange buffer."""
    ctas = t * -(-n // BGMV_PAIR_COLS)
    nseg = -(-h // BGMV_SEG_H)
    return ctas + t * k * (r // 8) * nseg * 8


def bgmv_shrink_abi(dtype: str) -> tuple:
    """ABI of the MoE-LoRA shrink. Pairs p = t * k + j (token t, its j-th routed expert).

      x        (T, H)        dtype   token activations
      a        (L, E, R, H)  dtype   LoRA A per (adapter, expert)
      topk_ids (T, k)        int32   expert of each pair (outside [0, E): pair skipped)
      lora     (T,)          int32   adapter of each token (-1 or outside [0, L): skipped)
      order    (Q,)          int32   pair indices in processing order; entries outside
                                     [0, T*k) are padding and skipped
      s        (P, R)        dtype   s[p] = cvt(x[t] @ a[lora[t], e(p)]^T); 0 when skipped
    """
    return (
        TensorArg("x", dtype, 2, align=8),
        TensorArg("a", dtype, 4, align=8),
        TensorArg("topk_ids", "int32", 2, align=1),
        TensorArg("lora", "int32", 1, align=1),
        TensorArg("order", "int32", 1, align=1),
        TensorArg("s", dtype, 2, align=8),
        StreamArg(),
    )


def bgmv_expand_abi(dtype: str) -> tuple:
    """ABI of the MoE-LoRA expand (fp32 output).

      s        (P, R)        dtype   shrink output, P = T * k
      b        (L, E, N, R)  dtype   LoRA B per (adapter, expert)
      topk_ids (T, k)        int32
      lora     (T,)          int32
      topk_w   (T, k)        float32 routing weights (finalize only)
      y        (T, N) fp32 finalize: y[t] = sum_{j=0..k-1, in order} w[t,j] * s[p] @ b[l,e]^T
               (P, N) fp32 per pair: y[p] = s[p] @ b[l, e]^T
               rows of skipped tokens / pairs are written as 0
      ws       (P, N) fp32   workspace of the bin-grouped large-T schedule (finalize):
               per-pair deltas, summed per token in a fixed order by a second pass
    """
    return (
        TensorArg("s", dtype, 2, align=8),
        TensorArg("b", dtype, 4, align=8),
        TensorArg("topk_ids", "int32", 2, align=1),
        TensorArg("lora", "int32", 1, align=1),
        TensorArg("topk_w", "float32", 2, align=1),
        TensorArg("y", "float32", 2, align=4),
        TensorArg("ws", "float32", 2, align=4),
        StreamArg(),
    )


def bgmv_binplan_abi(dtype: str) -> tuple:
    """ABI of the plan kernel of large batches (sm90: shrink + expand per bin in one launch,
    then the finalize pass). Arguments as bgmv_shrink_abi / bgmv_expand_abi:

      x, a, b, topk_ids, lora, topk_w   inputs (topk_w: finalize only)
      s    (P, R)  dtype  written (the shrink's output, as the stand-alone shrink writes it)
      y             fp32   written, as bgmv_expand_abi
      ws   (P, N)  fp32   workspace (finalize)
    """
    return (
        TensorArg("x", dtype, 2, align=8),
        TensorArg("a", dtype, 4, align=8),
        TensorArg("b", dtype, 4, align=8),
        TensorArg("topk_ids", "int32", 2, align=1),
        TensorArg("lora", "int32", 1, align=1),
        TensorArg("topk_w", "float32", 2, align=1),
        TensorArg("s", dtype, 2, align=8),
        TensorArg("y", "float32", 2, align=4),
        TensorArg("ws", "float32", 2, align=4),
        StreamArg(),
    )


def kda_chain_abi(dtype: str) -> tuple:
    """ABI of the KDA chain (the sequential part of chunked prefill; one head dim K per
    compiled variant, V a multiple of 64). Chunk-padded intra-chunk tensors, chunk c of
    head h at [c, h]; rows past a sequence's end are zero:

      w, qg, kg (NC, H, 64, K)  dtype    WY factor, q exp(G), k exp(Gamma - G)
      u         (NC, H, 64, V)  dtype    WY factor of v
      aqk       (NC, H, 64, 64) dtype    intra-chunk q k scores with decay (lower)
      eg        (NC, H, K)      float32  exp(Gamma): the chunk's total decay
      cu_seqlens (N + 1,)       int32    first row of each sequence in o's rows
      cu_chunks  (N + 1,)       int32    first chunk of each sequence (chunks in order)
      h0, ht    (N, H, K, V)    float32  initial state (read when has_h0) and final state
                                         (written when store_ht)
      o         (R, H, V)       dtype    output rows (B * T flattened)
    """
    return (
        TensorArg("w", dtype, 4, align=8),
        TensorArg("u", dtype, 4, align=8),
        TensorArg("qg", dtype, 4, align=8),
        TensorArg("kg", dtype, 4, align=8),
        TensorArg("aqk", dtype, 4, align=8),
        TensorArg("eg", "float32", 3, align=4),
        TensorArg("cu_seqlens", "int32", 1, align=1),
        TensorArg("cu_chunks", "int32", 1, align=1),
        TensorArg("h0", "float32", 4, align=4),
        TensorArg("o", dtype, 3, align=8),
        TensorArg("ht", "float32", 4, align=4),
        ScalarArg("has_h0", "int32"),
        ScalarArg("store_ht", "int32"),
        StreamArg(),
    )


def kda_intra_abi(dtype: str, g: str) -> tuple:
    """ABI of the KDA intra-chunk stage (one head dim K per compiled variant, V a multiple of
    64); writes the chain's inputs (kda_chain_abi) for every chunk c and head h:

      q, k (R, H, K) dtype; v (R, H, V) dtype; g (R, H, K) g (log decay, or the raw gate;
        read as 16-byte row vectors like q)
      beta (R, H) float32 (logits when beta_sigmoid)
      a_log (H,), dt_bias (H, K) float32   the gate's parameters (gate_mode 1 / 2)
      chunks (NC, 2) int32   (first row, length 1..64) of each chunk in q's rows
      w, qg, kg (NC, H, 64, K), u (NC, H, 64, V), aqk (NC, H, 64, 64) dtype; eg (NC, H, K) fp32
      scale (q's factor), l2norm, beta_sigmoid, gate_mode (0: g is the log decay; 1:
      -exp(A_log) softplus(g + dt_bias); 2: lower_bound sigmoid(exp(A_log) (g + dt_bias))),
      lower_bound
    """
    return (
        TensorArg("q", dtype, 3, align=8),
        TensorArg("k", dtype, 3, align=8),
        TensorArg("v", dtype, 3, align=8),
        TensorArg("g", g, 3, align=8),
        TensorArg("beta", "float32", 2, align=1),
        TensorArg("a_log", "float32", 1, align=1),
        TensorArg("dt_bias", "float32", 2, align=1),
        TensorArg("chunks", "int32", 2, align=1),
        TensorArg("w", dtype, 4, align=8),
        TensorArg("u", dtype, 4, align=8),
        TensorArg("qg", dtype, 4, align=8),
        TensorArg("kg", dtype, 4, align=8),
        TensorArg("aqk", dtype, 4, align=8),
        TensorArg("eg", "float32", 3, align=1),
        ScalarArg("scale", "float32"),
        ScalarArg("l2norm", "int32"),
        ScalarArg("beta_sigmoid", "int32"),
        ScalarArg("gate_mode", "int32"),
        ScalarArg("lower_bound", "float32"),
        StreamArg(),
    )


W4A16_KBLOCK = 64    # k per packed block: a lane's 16 bytes of codes (cutekern.w4a16's order)


def w4a16_gemm_abi(dtype: str) -> tuple:
    """ABI of the W4A16 skinny GEMM (decode; any scale group of a multiple of 64: K/64 blocks
    over scales' K/group rows):

      x       (B, K)            dtype   activations, B <= 8 (or <= 16: the rows16 build)
      packed  (N/16, K/64, 32, 4) int32 4-bit codes in cutekern.w4a16's fragment order
      scales  (K/group, N)      dtype   one scale per (group, column)
      out     (B, N)            dtype   out[b, n] = sum_k x[b, k] (code - 8) scale
      ctas                      int32   the persistent grid's size, at most (sm count x the
                                        config's ctas_per_sm)
      ksplit                    int32   warps splitting a tile's K (a power of 2 dividing the
                                        build's warps; 1: each warp a whole tile, no CTA sum)
    """
    return (
        TensorArg("x", dtype, 2, align=8),
        TensorArg("packed", "int32", 4, align=4),
        TensorArg("scales", dtype, 2, align=8),
        TensorArg("out", dtype, 2, align=1),
        ScalarArg("ctas", "int32"),
        ScalarArg("ksplit", "int32"),
        StreamArg(),
    )


def w4a16_mlp_abi(dtype: str) -> tuple:
    """ABI of the W4A16 SwiGLU MLP block in one launch (decode; K = hidden, F = intermediate,
    D = output width; scale groups any multiple of 64):

      x          (B, K)                dtype  activations, B <= 8 (<= 16: the rows16 build)
      packed_gu  (2F/16, K/64, 32, 4)  int32  gate and up codes, 16-column blocks alternating
                                              (2i: gate columns 16i.., 2i + 1: up columns 16i..)
      scales_gu  (K/group, 2F)         dtype  their scales in the same column order
      packed_d   (D/16, F/64, 32, 4)   int32  down codes
      scales_d   (F/group_d, D)        dtype
      h          (B, F)                dtype  silu(gate) * up (written, then read by the launch)
      out        (B, D)                dtype  h Wd^T
      sync       (1 + ctas,)           int32  generation word + one flag per CTA (zeros once;
                                              never reset; one launch at a time per buffer)
      ctas                             int32  the grid: every CTA co-resident
      ks_gu, ks_d                      int32  warps splitting a tile's K in each phase
    """
    return (
        TensorArg("x", dtype, 2, align=8),
        TensorArg("packed_gu", "int32", 4, align=4),
        TensorArg("scales_gu", dtype, 2, align=8),
        TensorArg("packed_d", "int32", 4, align=4),
        TensorArg("scales_d", dtype, 2, align=8),
        TensorArg("h", dtype, 2, align=8),
        TensorArg("out", dtype, 2, align=1),
        TensorArg("sync", "int32", 1, align=1),
        ScalarArg("ctas", "int32"),
        ScalarArg("ks_gu", "int32"),
        ScalarArg("ks_d", "int32"),
        StreamArg(),
    )


def decode_attn_abi(dtype: str) -> tuple:
    """ABI of one decode step's attention with Qwen3's q / k RMSNorm and RoPE (head_dim 128;
    Hq = out's width / 128, a multiple of Hkv = the caches' second extent):

      qkv      (B, (Hq + 2 Hkv) 128)  dtype    the step's projections: q heads, k heads, v heads
      k_cache  (B, Hkv, S, 128)       dtype    post-norm, post-RoPE keys; position lens[b] written
      v_cache  (B, Hkv, S, 128)       dtype    values; position lens[b] written
      lens     (B,)                   int32    cached positions per row (= the new token's)
      q_norm   (128,)                 dtype    per-head RMSNorm weights of q and k
      k_norm   (128,)                 dtype
      rope     (P, 128)               float32  per position: cos(p f_i) for i < 64, then sin(p f_i)
      out      (B, Hq 128)            dtype    softmax(q K^T / sqrt(128)) V per q head
      eps                             float32  the RMSNorms' epsilon
      xch      (>= 2 W,)              int32    W = B Hkv ceil(group / 2) (splits - 1) 2 130
                                               8-byte exchange words, zero between launches
                                               (split 0 clears what it read); one launch at a
                                               time per buffer
      splits                          int32    CTAs per (row, KV head, head pair) over the
                                               positions (all resident: split 0 waits for
                                               the others)
    """
    return (
        TensorArg("qkv", dtype, 2, align=8),
        TensorArg("k_cache", dtype, 4, align=8),
        TensorArg("v_cache", dtype, 4, align=8),
        TensorArg("lens", "int32", 1, align=1),
        TensorArg("q_norm", dtype, 1, align=8),
        TensorArg("k_norm", dtype, 1, align=8),
        TensorArg("rope", "float32", 2, align=4),
        TensorArg("out", dtype, 2, align=8),
        ScalarArg("eps", "float32"),
        TensorArg("xch", "int32", 1, align=2),
        ScalarArg("splits", "int32"),
        StreamArg(),
    )


def add_rms_norm_abi(dtype: str) -> tuple:
    """ABI of a decode step's residual add + RMSNorm (hidden D a multiple of 8):

      x    (B, D)  float32  the residual stream; x += y in place
      y    (B, D)  dtype    what the last launch adds to it
      w    (D,)    float32  the RMSNorm weight
      out  (B, D)  dtype    x * rsqrt(mean(x^2) + eps) * w, rounded once
      eps          float32
    """
    return (
        TensorArg("x", "float32", 2, align=4),
        TensorArg("y", dtype, 2, align=8),
        TensorArg("w", "float32", 1, align=4),
        TensorArg("out", dtype, 2, align=8),
        ScalarArg("eps", "float32"),
        StreamArg(),
    )
