"""cutekern: CuTe DSL kernels for recommendation and LLM inference.

Public ops take torch tensors; kernels come from an AOT export (``$CUTEKERN_ARTIFACTS``)
or, with nvidia-cutlass-dsl installed, are compiled on first use. Importing cutekern
never imports the DSL.
"""
from . import ikbo
from .arch import ARCHES

__all__ = ["ikbo", "ARCHES"]
__version__ = "0.1.0"
