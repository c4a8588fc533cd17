"""The compile pipeline: one ordered list of passes."""

from __future__ import annotations

from thin.passes import Pass, fuse_projections, order_tensors, quantize_weights

from .config import CompileConfig


def build_pipeline(config: CompileConfig) -> list[Pass]:
    """The passes a compile with `config` runs, in order."""
    return [
        # -- precision: one format for every linear weight (calibrate, score and plan arrive with --vram)
        *([quantize_weights] if config.quantize.format is not None else []),
        # -- structure: fusion (after precision, so q/k/v fuse when their formats agree), execution order
        *([fuse_projections] if config.fuse_projections else []),
        order_tensors,
        # -- proof (certify) arrives with the certificate
    ]
