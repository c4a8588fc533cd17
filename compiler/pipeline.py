"""The compile pipeline: one ordered list of passes."""

from __future__ import annotations

from thin.passes import (
    Pass,
    calibrate_inputs,
    certify_ffn_levels,
    certify_model,
    check_budget,
    check_ffn_levels,
    check_lm_head,
    check_residency,
    fuse_projections,
    layout_experts,
    order_superblocks,
    order_tensors,
    plan_precision,
    plan_residency,
    quantize_weights,
    score_formats,
)

from .config import CompileConfig


def check_passes(config: CompileConfig) -> list[Pass]:
    """The passes that only check the model against `config` (they run nothing and change nothing): a budget
    below the smallest model, experts to stream in a dense model, FFN levels in a mixture of experts or below
    one superblock a layer, --keep-lm-head on a tied LM head.
    A compile runs them first; `thinc key` runs them too, so it keys only what a compile would build."""
    return [*([check_residency] if config.residency.enabled else []),
            *([check_ffn_levels] if config.ffn.enabled else []),
            *([check_lm_head] if config.quantize.keep_lm_head else []),
            *([check_budget] if config.plan.planned else [])]


def build_pipeline(config: CompileConfig) -> list[Pass]:
    """The passes a compile with `config` runs, in order."""
    planned, levels = config.plan.planned, config.ffn.enabled
    return [
        # -- checks: fail here, before the model ever runs
        *check_passes(config),
        # -- precision: statistics of every linear input, predicted error per format, the plan
        *([calibrate_inputs] if config.calibrated else []),
        # -- elastic FFN: channels by importance in 128-channel superblocks, before any group is quantized
        *([order_superblocks] if levels else []),
        *([score_formats, plan_precision] if planned else []),
        *([quantize_weights] if config.quantized else []),
        # -- proof: held-out comparison with the source; promotions and re-planning below the gate; then
        #    each FFN level (a channel prefix per layer within its bytes) chosen, corrected and measured
        *([certify_model] if config.certified else []),
        *([certify_ffn_levels] if levels else []),
        # -- structure: fusion (after precision, so q/k/v fuse when their formats agree), execution order
        *([fuse_projections] if config.fuse_projections else []),
        order_tensors,
        # -- layout: each routed expert one 4 KiB-aligned contiguous page (no-op without experts)
        layout_experts,
        # -- residency (--stream-experts): the least routed experts stay in host memory when --vram can't hold them
        *([plan_residency] if config.residency.enabled else []),
    ]
