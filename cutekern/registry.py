"""Which kernel variants exist: ops x designs x dtypes x flags. DSL-free.

A variant's identity is a KernelKey; everything that changes generated code is in it
(op, design, arch, dtypes, flags, tile config), so it doubles as the compile-cache key.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass

from . import abi as _abi
from .arch import DESIGNS_FOR_ARCH


@dataclass(frozen=True)
class KernelKey:
    op: str
    design: str
    arch: str
    dtypes: tuple  # ((role, dtype name), ...)
    flags: tuple = ()  # ((name, value), ...)
    config: tuple = ()  # ((field, value), ...) of the design's frozen config

    def as_dict(self) -> dict:
        return {"op": self.op, "design": self.design, "arch": self.arch,
                "dtypes": dict(self.dtypes), "flags": dict(self.flags),
                "config": dict(self.config)}

    @property
    def digest(self) -> str:
        blob = json.dumps(self.as_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    @property
    def prefix(self) -> str:
        """C symbol prefix of the exported function: readable and unique per key."""
        dt = "_".join(v.replace("float", "f").replace("bfloat", "bf") for _, v in self.dtypes)
        return f"ck_{self.op}_{self.design}_{self.arch}_{dt}_{self.digest}"

    def lookup(self) -> tuple:
        """Identity without the config: what a caller asks the runtime for."""
        return (self.op, self.design, self.arch, self.dtypes, self.flags)


@dataclass(frozen=True)
class DesignImpl:
    module: str       # e.g. "kernels.sm90.lce"
    kernel_class: str
    config_class: str


@dataclass(frozen=True)
class OpSpec:
    name: str
    abi: object  # callable(**{dtype role: dtype name}) -> tuple of ABI args
    designs: dict  # design -> DesignImpl
    variants: tuple  # ((dtypes tuple, flags tuple), ...)
    make: object  # callable(kernel_class, dsl dtypes {role: type}, flags {name: value}, config)
    doc: str = ""
    design_variants: tuple = ()  # ((design, variants), ...): overrides ``variants`` there
    # ((design, (arch, ...)), ...): arches beyond DESIGNS_FOR_ARCH that build this op's design
    # (an op without a design of an arch's own serves it with one that compiles there)
    extra_arches: tuple = ()

    def variants_for(self, design: str) -> tuple:
        return dict(self.design_variants).get(design, self.variants)

    def extra_designs_on(self, arch: str) -> tuple:
        """The op's designs built for ``arch`` beyond the arch's own (``extra_arches``)."""
        return tuple(d for d, arches in self.extra_arches
                     if arch in arches and d not in DESIGNS_FOR_ARCH[arch])

    def designs_on(self, arch: str) -> tuple:
        """The op's designs built for ``arch``, in DESIGNS_FOR_ARCH's order, then extras."""
        return (tuple(d for d in DESIGNS_FOR_ARCH[arch] if d in self.designs)
                + self.extra_designs_on(arch))

    def has_flag(self, design: str, flag: str) -> bool:
        """Whether the design's variants carry `flag` (a design-specific build choice)."""
        return _has_flag(self.name, design, flag)


@functools.lru_cache(maxsize=None)  # asked on call paths (per plan / per one-shot call)
def _has_flag(op: str, design: str, flag: str) -> bool:
    return any(flag in dict(f) for _, f in OPS[op].variants_for(design))


_DESIGN_SUFFIX = {"sm90": "Sm90", "ada": "Ada", "sm100": "Sm100"}


def _impls(module: str, kernel_stem: str, config_stem: str) -> dict:
    """kernels/<design>/<module>.py: class <kernel_stem><Design>, config <config_stem><Design>Config."""
    return {d: DesignImpl(f"kernels.{d}.{module}", f"{kernel_stem}{sfx}", f"{config_stem}{sfx}Config")
            for d, sfx in _DESIGN_SUFFIX.items()}


def _lce_variants(wide=(None,), narrow=False):
    # wide (sm90): the build with the wider M tile, for M it covers in fewer tiles;
    # narrow (sm90): a user-phase build with a narrower M tile, for user GEMMs of one wave
    out = []
    for ab in ("float16", "bfloat16"):
        n = (("narrow", False),) if narrow else ()
        for w in wide:
            x = () if w is None else (("wide", w),)
            # user phase: fp32 partials, no addend; candidate phase: output dtype + gathered addend
            out.append(((("ab", ab), ("c", "float32")), (("has_addend", False),) + x + n))
            out.append(((("ab", ab), ("c", ab)), (("has_addend", True),) + x + n))
        if narrow:
            x = () if wide == (None,) else (("wide", False),)
            out.append(((("ab", ab), ("c", "float32")),
                        (("has_addend", False),) + x + (("narrow", True),)))
    return tuple(out)


def _attn_variants():
    return tuple(((("dtype", dt),), (("head_dim", d),))
                 for dt in ("float16", "bfloat16") for d in (64, 128))


def _attn_res_variants(splits=(1,), online=False, skip=()):
    # the hidden size tier bounds the on-chip row buffers; any H % 8 == 0 up to it runs.
    # row_split > 1: a row's H is split over the CTAs of a cluster (sm90) or of a group
    # exchanging through global memory (Ada) (small M: latency); skip: (tier, split) pairs
    # a design cannot build. online (sm90, row_split 1): the build with the online schedule
    # only (short rows, few rows)
    def flags(h, r, o):
        return (("max_hidden", h), ("row_split", r)) + ((("online", o),) if online else ())
    return tuple(((("dtype", "bfloat16"),), flags(h, r, o)) for h in (8192, 16384) for r in splits
                 if (h, r) not in skip
                 for o in ((False, True) if online and r == 1 else (False,)))


def _bgmv_shrink_variants():
    return tuple(((("dtype", dt),), ()) for dt in ("float16", "bfloat16"))


def _bgmv_expand_variants(after_shrink=(False,)):
    # after_shrink (sm90 only): the variant a plan launches right after its own shrink,
    # which may overlap that shrink through PDL (kernels/CONTRACT_BGMV.md, v2.2)
    if after_shrink == (False,):
        return tuple(((("dtype", dt),), (("finalize", f),))
                     for dt in ("float16", "bfloat16") for f in (True, False))
    return tuple(((("dtype", dt),), (("finalize", f), ("after_shrink", a)))
                 for dt in ("float16", "bfloat16") for f in (True, False) for a in after_shrink)


OPS: dict = {
    "lce_gemm": OpSpec(
        name="lce_gemm",
        abi=_abi.lce_gemm_abi,
        designs=_impls("lce", "LceGemm", "Lce"),
        variants=_lce_variants(),
        design_variants=(("sm90", _lce_variants((False, True), narrow=True)),),
        make=lambda k, dt, fl, cfg: k(dt["ab"], dt["c"], fl["has_addend"], cfg,
                                      **{f: fl[f] for f in ("wide", "narrow") if f in fl}),
        doc="IKBO linear compression: batched GEMM with stride-0 weight and gathered addend",
    ),
    "ikbo_attn": OpSpec(
        name="ikbo_attn",
        abi=_abi.ikbo_attention_abi,
        designs=_impls("ikbo_attn", "IkboAttn", "IkboAttn"),
        variants=_attn_variants(),
        make=lambda k, dt, fl, cfg: k(dt["dtype"], fl["head_dim"], cfg),
        doc="IKBO attention: candidate queries over the unbroadcast user K/V",
    ),
    "attn_res": OpSpec(
        name="attn_res",
        abi=_abi.attn_res_abi,
        designs=_impls("attn_res", "AttnRes", "AttnRes"),
        variants=_attn_res_variants(),
        # the Ada and sm100 split kernels hold <= 2 chunks of a row per thread in
        # registers: not the 16384 tier over 2 CTAs
        design_variants=(("sm90", _attn_res_variants((1, 2, 4, 8), online=True)),
                         ("ada", _attn_res_variants((1, 2, 4, 8), skip=((16384, 2),))),
                         ("sm100", _attn_res_variants((1, 2, 4, 8), skip=((16384, 2),)))),
        make=lambda k, dt, fl, cfg: k(dt["dtype"], fl["max_hidden"], cfg, row_split=fl["row_split"],
                                      **({"online": fl["online"]} if "online" in fl else {})),
        doc="Kimi attention residuals: softmax over depth of block snapshots, fused serving form",
    ),
    "bgmv_shrink": OpSpec(
        name="bgmv_shrink",
        abi=_abi.bgmv_shrink_abi,
        designs=_impls("bgmv_shrink", "BgmvShrink", "BgmvShrink"),
        variants=_bgmv_shrink_variants(),
        make=lambda k, dt, fl, cfg: k(dt["dtype"], cfg),
        doc="MoE-LoRA shrink: s[p] = x[t] @ A[lora, expert]^T per (token, expert) pair",
    ),
    "bgmv_expand": OpSpec(
        name="bgmv_expand",
        abi=_abi.bgmv_expand_abi,
        designs=_impls("bgmv_expand", "BgmvExpand", "BgmvExpand"),
        variants=_bgmv_expand_variants(),
        design_variants=(("sm90", _bgmv_expand_variants((False, True))),),
        make=lambda k, dt, fl, cfg: k(dt["dtype"], fl["finalize"], cfg,
                                      **({"after_shrink": fl["after_shrink"]}
                                         if "after_shrink" in fl else {})),
        doc="MoE-LoRA expand: fixed-order weighted sum over a token's pairs, one owner per output",
    ),
    "bgmv_binplan": OpSpec(
        name="bgmv_binplan",
        abi=_abi.bgmv_binplan_abi,
        designs={d: DesignImpl(f"kernels.{d}.bgmv_binplan", f"BgmvBinPlan{sfx}",
                               f"BgmvBinPlan{sfx}Config")
                 for d, sfx in (("sm90", "Sm90"), ("ada", "Ada"))},
        variants=tuple(((("dtype", dt),), (("finalize", f),))
                       for dt in ("float16", "bfloat16") for f in (True, False)),
        make=lambda k, dt, fl, cfg: k(dt["dtype"], fl["finalize"], cfg),
        doc="MoE-LoRA plan of a large batch: shrink + expand of each bin in one CTA, one launch",
    ),
    "kda_chain": OpSpec(
        name="kda_chain",
        abi=_abi.kda_chain_abi,
        # the Ada design only so far (it also builds for sm_90a); sm90 / sm100: not yet, so
        # SM100 gets the Ada design's build (mma.sync and cp.async run there; never run here)
        designs={"ada": DesignImpl("kernels.ada.kda_chain", "KdaChainAda", "KdaChainAdaConfig")},
        extra_arches=(("ada", ("sm_100a", "sm_103a")),),
        variants=tuple(((("dtype", dt),), (("head_k", d),))
                       for dt in ("float16", "bfloat16") for d in (64, 128)),
        make=lambda k, dt, fl, cfg: k(dt["dtype"], fl["head_k"], cfg),
        doc="KDA prefill, the chain: per (sequence, head, V block) the chunks' state recurrence",
    ),
    "kda_intra": OpSpec(
        name="kda_intra",
        abi=_abi.kda_intra_abi,
        designs={"ada": DesignImpl("kernels.ada.kda_intra", "KdaIntraAda", "KdaIntraAdaConfig")},
        extra_arches=(("ada", ("sm_100a", "sm_103a")),),
        # g: the gate input's dtype (fp32, or the inputs' own: no cast pass over a bf16 gate)
        variants=tuple(((("dtype", dt), ("g", gd)), (("head_k", d),))
                       for dt in ("float16", "bfloat16") for gd in ("float32", dt)
                       for d in (64, 128)),
        make=lambda k, dt, fl, cfg: k(dt["dtype"], dt["g"], fl["head_k"], cfg),
        doc="KDA prefill, the intra-chunk stage: per (chunk, head) the chain's inputs",
    ),
    "w4a16_gemm": OpSpec(
        name="w4a16_gemm",
        abi=_abi.w4a16_gemm_abi,
        # the megakernel's linear layers, Ada design first (the spec's design); SM100 gets
        # its sm_100a / sm_103a builds (mma.sync and cp.async run there; never run here)
        designs={"ada": DesignImpl("kernels.ada.w4a16_gemm", "W4a16GemmAda",
                                   "W4a16GemmAdaConfig")},
        extra_arches=(("ada", ("sm_100a", "sm_103a")),),
        # rows16: the build for batches of 9..16 rows (the other loads rows 0..7 only);
        # cols: output columns per tile: 16 over 8 warps (short N), 32 or 64 (rows 8 only)
        # over 4 warps (long N)
        variants=tuple(((("dtype", dt),), (("rows16", r), ("cols", c)))
                       for dt in ("float16", "bfloat16") for r in (False, True)
                       for c in ((16, 32) if r else (16, 32, 64))),
        make=lambda k, dt, fl, cfg: k(dt["dtype"], fl["rows16"], fl["cols"], cfg),
        doc="W4A16 skinny GEMM of decode: out = x W^T, W as 4-bit codes x group scales",
    ),
    "w4a16_mlp": OpSpec(
        name="w4a16_mlp",
        abi=_abi.w4a16_mlp_abi,
        # the megakernel's first cross-CTA dependency: gate / up then down in one launch
        designs={"ada": DesignImpl("kernels.ada.w4a16_mlp", "W4a16MlpAda",
                                   "W4a16MlpAdaConfig")},
        extra_arches=(("ada", ("sm_100a", "sm_103a")),),
        variants=tuple(((("dtype", dt),), (("rows16", r),))
                       for dt in ("float16", "bfloat16") for r in (False, True)),
        make=lambda k, dt, fl, cfg: k(dt["dtype"], fl["rows16"], cfg),
        doc="W4A16 SwiGLU MLP of decode in one launch: out = (silu(x Wg^T) * x Wu^T) Wd^T",
    ),
    "decode_attn": OpSpec(
        name="decode_attn",
        abi=_abi.decode_attn_abi,
        # the megakernel's attention task as its own launch first (Ada design)
        designs={"ada": DesignImpl("kernels.ada.decode_attn", "DecodeAttnAda",
                                   "DecodeAttnAdaConfig")},
        extra_arches=(("ada", ("sm_100a", "sm_103a")),),
        variants=tuple(((("dtype", dt),), ()) for dt in ("float16", "bfloat16")),
        make=lambda k, dt, fl, cfg: k(dt["dtype"], cfg),
        doc="decode attention with q / k RMSNorm and RoPE, KV cache append (head_dim 128)",
    ),
    "add_rms_norm": OpSpec(
        name="add_rms_norm",
        abi=_abi.add_rms_norm_abi,
        # the decoder's glue between launches (the megakernel's norm tasks as a launch)
        designs={"ada": DesignImpl("kernels.ada.add_rms_norm", "AddRmsNormAda",
                                   "AddRmsNormAdaConfig")},
        extra_arches=(("ada", ("sm_100a", "sm_103a")),),
        variants=tuple(((("dtype", dt),), ()) for dt in ("float16", "bfloat16")),
        make=lambda k, dt, fl, cfg: k(dt["dtype"], cfg),
        doc="residual add + RMSNorm of decode: x += y (fp32), out = rmsnorm(x) * w",
    ),
}


def default_config(op: str, design: str) -> tuple:
    """The design's default config as a key tuple (imports the kernel module: needs DSL)."""
    import dataclasses
    import importlib
    impl = OPS[op].designs[design]
    cls = getattr(importlib.import_module(impl.module), impl.config_class)
    return tuple((f.name, getattr(cls(), f.name)) for f in dataclasses.fields(cls))


def all_keys(arches, with_config=True, overrides=None, ops=None) -> list:
    """Every registered variant for the given arches (configs resolved if asked).
    ``overrides``: {design: {config field: value}} applied on top of the defaults of the
    selected ``ops`` (all ops when None)."""
    keys = []
    for arch in arches:
        for op in OPS.values():
            if ops is not None and op.name not in ops:
                continue
            for design in op.designs_on(arch):
                cfg = default_config(op.name, design) if with_config else ()
                if overrides and design in overrides:
                    unknown = set(overrides[design]) - {k for k, _ in cfg}
                    if unknown:
                        raise ValueError(f"{design} config has no field(s) {sorted(unknown)}")
                    cfg = tuple((k, overrides[design].get(k, v)) for k, v in cfg)
                for dtypes, flags in op.variants_for(design):
                    keys.append(KernelKey(op.name, design, arch, dtypes, flags, cfg))
    return keys


def abi_for(key: KernelKey) -> tuple:
    return OPS[key.op].abi(**dict(key.dtypes))
