"""Qwen3 W4A16 decode steps in launches: the megakernel's route before it is one kernel
(kernels/CONTRACT_MEGAKERNEL.md) and the baseline it has to beat.

A step takes one new token per row and returns its logits. Per layer: residual add + RMSNorm
(``add_rms_norm``), the fused q / k / v projection (``w4a16_linear``), attention with q / k
norm, RoPE and the cache append (``decode_attention``), the o projection (``w4a16_linear``),
residual add + RMSNorm, the MLP block in one launch (``w4a16_mlp``); then the last add + the
final norm and the LM head: 16-bit through cuBLAS, or W4A16 (``w4a16_linear``) with
``quantize_head=True`` (~26% of the bytes: Qwen3-1.7B's 151936-row head is 46% of a 16-bit
head step's). The residual stream stays fp32; each linear's input is rounded once to the
model dtype. Every buffer is allocated at prepare time and the row lengths live on the
device, so a step never syncs the host and ``capture()`` records it as one CUDA graph (6
launches of ours per layer; the embedding gather, the 16-bit LM head and the lens update are
torch's).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .decode import HEAD_DIM, add_rms_norm, decode_attention, rope_table
from .reference import Qwen3Config, w4a16_quantize
from .w4a16 import W4A16MLP, W4A16Weight, prepare_w4a16, prepare_w4a16_mlp, w4a16_linear, \
    w4a16_mlp

_OP = "prepare_qwen3_decoder"
LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor     # fp32 [hidden]
    qkv: W4A16Weight             # q, k, v rows stacked: [(Hq + 2 Hkv) 128, hidden]
    q_norm: torch.Tensor         # model dtype [128]
    k_norm: torch.Tensor
    o: W4A16Weight
    post_norm: torch.Tensor      # fp32 [hidden]
    mlp: W4A16MLP


def _gptq(entry, where, group, dtype, device):
    """A linear's GPTQ storage: given as (qweight, scales), or quantized here (round to
    nearest) from a dense [out, in] weight."""
    if isinstance(entry, tuple):
        if len(entry) != 2:
            raise ValueError(f"{_OP}: argument 'params' {where} must be a dense "
                             f"weight or a (qweight, scales) pair")
        qw, sc = entry
    elif isinstance(entry, torch.Tensor):
        qw, sc = w4a16_quantize(entry.to(device=device, dtype=dtype), group)
    else:
        raise TypeError(f"{_OP}: argument 'params' {where} must be a tensor or "
                        f"a (qweight, scales) pair, got {type(entry).__name__}")
    if sc.dtype != dtype:
        raise ValueError(f"{_OP}: argument 'params' {where} scales must be "
                         f"{dtype} (the model dtype), got {sc.dtype}")
    return qw.to(device), sc.to(device)


def _vec(t, n, what, dtype, device):
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,):
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{_OP}: argument 'params' {what} must be a tensor of shape ({n},), "
                         f"got {shape}")
    return t.to(device=device, dtype=dtype).contiguous()


class Qwen3Decoder:
    """Prepared W4A16 weights, KV caches [B, Hkv, max_len, 128] per layer, device-resident
    row lengths and the step's buffers (see ``prepare_qwen3_decoder``)."""

    def __init__(self, cfg, layers, embed, head, final_norm, batch, max_len, device):
        self.cfg, self.layers, self.embed, self.final_norm = cfg, layers, embed, final_norm
        self.head = head             # 16-bit [vocab, hidden] (the embedding when tied) or W4A16
        self.batch, self.max_len, self.device = batch, max_len, device
        dt, d, hkv = embed.dtype, cfg.hidden, cfg.kv_heads
        self.dtype = dt
        self.rope = rope_table(max_len, HEAD_DIM, cfg.rope_theta, device)
        cache = lambda: torch.zeros(batch, hkv, max_len, HEAD_DIM, dtype=dt, device=device)  # noqa: E731
        self.k_cache = [cache() for _ in layers]
        self.v_cache = [cache() for _ in layers]
        self.lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        self.logits = torch.empty(batch, cfg.vocab, dtype=dt, device=device)
        qkv_w = (cfg.q_heads + 2 * hkv) * HEAD_DIM
        new = lambda n: torch.empty(batch, n, dtype=dt, device=device)  # noqa: E731
        self._x = torch.empty(batch, d, dtype=torch.float32, device=device)
        self._h, self._qkv, self._a = new(d), new(qkv_w), new(cfg.q_heads * HEAD_DIM)
        self._y, self._f = new(d), new(cfg.intermediate)
        self._graph = None

    def resized(self, batch: int, max_len: int) -> "Qwen3Decoder":
        """A decoder for another batch / context sharing these weights (fresh caches and
        buffers; run one at a time: the MLP blocks' flags are shared)."""
        if not isinstance(batch, int) or batch < 1 or not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"Qwen3Decoder.resized: arguments 'batch' >= 1 and 'max_len' >= 2 "
                             f"must be ints, got {batch!r}, {max_len!r}")
        return Qwen3Decoder(self.cfg, self.layers, self.embed, self.head, self.final_norm, batch,
                            max_len, self.device)

    def reset(self, lens: torch.Tensor | None = None):
        """Rows start at ``lens`` cached tokens (int, on any device; default 0): the caches'
        first lens[b] positions must hold them (e.g. from a prefill, written by the caller
        into ``k_cache[layer]`` / ``v_cache[layer]`` post-norm, post-RoPE as the step does)."""
        if lens is None:
            self.lens.zero_()
            return
        lens = torch.as_tensor(lens)
        if tuple(lens.shape) != (self.batch,) or lens.dtype.is_floating_point:
            raise ValueError(f"Qwen3Decoder.reset: argument 'lens' must be {self.batch} "
                             f"integers, got {lens.dtype} {tuple(lens.shape)}")
        if bool(((lens < 0) | (lens >= self.max_len)).any()):
            raise ValueError(f"Qwen3Decoder.reset: argument 'lens' must be in [0, "
                             f"{self.max_len}) (max_len), got {lens.tolist()}")
        self.lens.copy_(lens.to(torch.int32))

    def _forward(self):
        eps = self.cfg.eps
        x, h, y = self._x, self._h, self._y
        torch.index_select(self.embed, 0, self.tokens, out=y)
        x.zero_()
        for i, L in enumerate(self.layers):
            add_rms_norm(x, y, L.input_norm, h, eps=eps)     # x += embedding / last MLP
            w4a16_linear(h, L.qkv, out=self._qkv)
            decode_attention(self._qkv, self.k_cache[i], self.v_cache[i], self.lens, L.q_norm,
                             L.k_norm, self.rope, eps=eps, out=self._a)
            w4a16_linear(self._a, L.o, out=y)
            add_rms_norm(x, y, L.post_norm, h, eps=eps)      # x += attention
            w4a16_mlp(h, L.mlp, out=y, h=self._f)
        add_rms_norm(x, y, self.final_norm, h, eps=eps)
        if isinstance(self.head, W4A16Weight):
            w4a16_linear(h, self.head, out=self.logits)
        else:
            torch.matmul(h, self.head.t(), out=self.logits)
        self.lens.add_(1)

    def step(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step: ``tokens`` [B] (the rows' new tokens; None: those already in
        ``self.tokens``) -> logits [B, vocab] (``self.logits``, overwritten by the next step).
        Appends to the caches and advances ``lens`` by one on the device. Replays the
        captured graph when ``capture()`` was called."""
        if tokens is not None:
            if not isinstance(tokens, torch.Tensor) or tuple(tokens.shape) != (self.batch,) \
                    or tokens.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"Qwen3Decoder.step: argument 'tokens' must be an integer "
                                 f"tensor of shape ({self.batch},)")
            self.tokens.copy_(tokens)
        if self._graph is not None:
            self._graph.replay()
        else:
            self._forward()
        return self.logits

    def capture(self):
        """Record one step as a CUDA graph (replayed by ``step``). The warm-up run this
        needs is undone where it matters: lens is restored (it wrote cache positions at lens,
        which the next step overwrites)."""
        if self.device.type != "cuda":
            raise ValueError("Qwen3Decoder.capture: needs a CUDA device")
        saved = self.lens.clone()
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            self._forward()              # loads every kernel outside the capture
        torch.cuda.current_stream(self.device).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self._forward()
        self.lens.copy_(saved)
        self._graph = g
        return g


def prepare_qwen3_decoder(params: dict, cfg: Qwen3Config, *, batch: int, max_len: int,
                          group: int = 128, quantize_head: bool = False,
                          device=None) -> Qwen3Decoder:
    """Qwen3 weights (``reference.qwen3_params``'s layout: nn.Linear [out, in], tied
    embeddings) -> a W4A16 decoder for ``batch`` rows of up to ``max_len`` tokens. A linear
    given as a dense tensor is quantized here (symmetric, group ``group``, round to nearest);
    one given as a GPTQ (qweight int32 [in / 8, out], scales [in / group, out]) pair is used
    as it is. The model dtype is the embedding's (fp16 or bf16): activations, q / k norm
    weights and the LM head are in it; the residual and the other norm weights are fp32
    (the same values). Head dim 128 (``decode_attention``). The LM head is params' 'lm_head'
    when given (untied), else the embedding; ``quantize_head``: run it in W4A16 (quantized
    here unless given as a GPTQ pair; vocab a multiple of 16), else in the model dtype."""
    if not isinstance(cfg, Qwen3Config):
        raise TypeError(f"{_OP}: argument 'cfg' must be a Qwen3Config, got {type(cfg).__name__}")
    if cfg.head_dim != HEAD_DIM or cfg.q_heads % cfg.kv_heads:
        raise ValueError(f"{_OP}: argument 'cfg' needs head_dim {HEAD_DIM} and q_heads a "
                         f"multiple of kv_heads, got {cfg.head_dim}, {cfg.q_heads} / "
                         f"{cfg.kv_heads}")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"{_OP}: argument 'batch' must be a positive int, got {batch!r}")
    if not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"{_OP}: argument 'max_len' must be an int >= 2, got {max_len!r}")
    embed = params.get("embed") if isinstance(params, dict) else None
    if not isinstance(embed, torch.Tensor) or tuple(embed.shape) != (cfg.vocab, cfg.hidden):
        raise ValueError(f"{_OP}: argument 'params' must hold 'embed' [vocab, hidden] = "
                         f"[{cfg.vocab}, {cfg.hidden}]")
    dt = embed.dtype
    if dt not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{_OP}: argument 'params' embed must be float16 or bfloat16, got {dt}")
    dev = torch.device(device) if device is not None else embed.device
    if len(params.get("layers", ())) != cfg.layers:
        raise ValueError(f"{_OP}: argument 'params' must hold {cfg.layers} layers (cfg.layers), "
                         f"got {len(params.get('layers', ()))}")
    d = cfg.hidden
    layers = []
    for i, p in enumerate(params["layers"]):
        missing = [n for n in LINEARS + ("input_norm", "post_norm", "q_norm", "k_norm")
                   if n not in p]
        if missing:
            raise ValueError(f"{_OP}: argument 'params' layer {i} lacks {missing}")
        q = {n: _gptq(p[n], f"layer {i} '{n}'", group, dt, dev) for n in LINEARS}
        # rows of q, k, v stacked: GPTQ keeps outputs as columns and groups run along the
        # input, so stacking the storage equals quantizing the stacked weight
        qkv = prepare_w4a16(torch.cat([q[n][0] for n in "qkv"], 1),
                            torch.cat([q[n][1] for n in "qkv"], 1), group)
        want = (cfg.q_heads + 2 * cfg.kv_heads) * HEAD_DIM
        if (qkv.k, qkv.n) != (d, want):
            raise ValueError(f"{_OP}: argument 'params' layer {i} q / k / v must map hidden "
                             f"{d} to {want} outputs in all, got [{qkv.n}, {qkv.k}]")
        o = prepare_w4a16(*q["o"], group)
        gate, up, down = (prepare_w4a16(*q[n], group) for n in ("gate", "up", "down"))
        if (o.k, o.n) != (cfg.q_heads * HEAD_DIM, d) or (gate.k, gate.n) != (d, cfg.intermediate):
            raise ValueError(f"{_OP}: argument 'params' layer {i} o / gate shapes do not match cfg")
        layers.append(_Layer(
            _vec(p["input_norm"], d, f"layer {i} input_norm", torch.float32, dev),
            qkv,
            _vec(p["q_norm"], HEAD_DIM, f"layer {i} q_norm", dt, dev),
            _vec(p["k_norm"], HEAD_DIM, f"layer {i} k_norm", dt, dev),
            o,
            _vec(p["post_norm"], d, f"layer {i} post_norm", torch.float32, dev),
            prepare_w4a16_mlp(gate, up, down)))
    final_norm = _vec(params.get("final_norm"), d, "final_norm", torch.float32, dev)
    embed = embed.to(dev).contiguous()
    head = _head(params.get("lm_head"), embed, cfg, group, quantize_head, dev)
    return Qwen3Decoder(cfg, layers, embed, head, final_norm, batch, max_len, dev)


def _head(entry, embed, cfg, group, quantize, dev):
    """The LM head as the step runs it: W4A16 storage, or the 16-bit [vocab, hidden] weight."""
    dt = embed.dtype
    if entry is None:
        entry = embed                                                       # tied
    elif isinstance(entry, torch.Tensor) and (tuple(entry.shape) != (cfg.vocab, cfg.hidden)
                                              or entry.dtype != dt):
        raise ValueError(f"{_OP}: argument 'params' lm_head must be [vocab, hidden] = "
                         f"[{cfg.vocab}, {cfg.hidden}] in {dt} (the embedding's dtype), got "
                         f"{entry.dtype} {tuple(entry.shape)}")
    if not quantize:
        if not isinstance(entry, torch.Tensor):
            raise ValueError(f"{_OP}: argument 'params' lm_head is a GPTQ pair: pass "
                             f"quantize_head=True to run it in W4A16")
        return entry.to(dev).contiguous()
    if cfg.vocab % 16:
        raise ValueError(f"{_OP}: argument 'quantize_head' needs cfg.vocab a multiple of 16 "
                         f"(the W4A16 GEMM's column tile), got {cfg.vocab}")
    head = prepare_w4a16(*_gptq(entry, "'lm_head'", group, dt, dev), group)
    if (head.k, head.n) != (cfg.hidden, cfg.vocab):
        raise ValueError(f"{_OP}: argument 'params' lm_head must map hidden {cfg.hidden} to "
                         f"vocab {cfg.vocab}, got [{head.n}, {head.k}]")
    return head
