"""The compile pipeline: one ordered list of passes."""

from __future__ import annotations

from thin.passes import Pass, canonicalize

from .config import CompileConfig


def build_pipeline(config: CompileConfig) -> list[Pass]:
    """The passes a compile with `config` runs, in order."""
    return [
        # -- structure: names, fusion, execution order
        canonicalize,
        # -- precision (calibrate, score, plan, quantize) and layout arrive with quantization
        # -- proof (certify) arrives with the certificate
    ]
