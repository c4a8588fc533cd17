"""Quantization and storage formats, each defined once: a spec (torch-free) and a torch reference."""

from .spec import FORMATS, SAFETENSORS_DTYPES, FormatSpec, get, nbytes

__all__ = ["FORMATS", "SAFETENSORS_DTYPES", "FormatSpec", "get", "nbytes"]
