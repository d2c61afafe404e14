"""cutekern: CuTe DSL kernels for recommendation and LLM inference.

Public ops take torch tensors; kernels come from an AOT export (``$CUTEKERN_ARTIFACTS``)
or, with nvidia-cutlass-dsl installed, are compiled on first use. Importing cutekern
never imports the DSL.
"""
from . import attn_res, bgmv_moe, decode, ikbo, kda, qwen3
from .arch import ARCHES
from .attn_res import prepare_attn_res  # noqa: F401
from .bgmv_moe import bgmv_moe_expand, bgmv_moe_shrink, prepare_bgmv_moe  # noqa: F401
from .decode import decode_attention, rope_table  # noqa: F401
from .kda import chunk_kda  # noqa: F401
from .qwen3 import prepare_qwen3_decoder  # noqa: F401

__all__ = ["ikbo", "attn_res", "bgmv_moe", "kda", "decode", "prepare_attn_res",
           "prepare_bgmv_moe", "bgmv_moe_shrink", "bgmv_moe_expand", "chunk_kda",
           "decode_attention", "rope_table", "prepare_qwen3_decoder", "qwen3", "ARCHES"]
__version__ = "0.1.0"
