"""IR -> IR passes and the runner that applies them in order."""

from .calibrate_inputs import CalibrateOptions, CalibrationError, calibrate_inputs, input_groups
from .certify_ffn_levels import certify_ffn_levels
from .certify_model import DEFAULT_MAX_KLD, CertificationError, CertifyOptions, certify_model
from .check_budget import check_budget
from .fuse_projections import fuse_projections
from .layout_experts import layout_experts
from .memory_ledger import CUDA_CONTEXT, ledger, parse_size
from .order_superblocks import FFNLevelOptionError, FFNLevelOptions, check_ffn_levels, order_superblocks
from .order_tensors import order_tensors
from .plan_precision import BudgetError, PlanOptions, plan_precision, solve
from .plan_residency import ResidencyOptions, check_residency, plan_residency
from .quantize_weights import QuantizeOptionError, QuantizeOptions, check_lm_head, linear_weights, quantize_weights
from .runner import Evaluator, Pass, PassContext, PassError, run_passes
from .score_formats import ScoreOptions, plannable, score_formats
from .scratch import Scratch

__all__ = [
    "BudgetError", "CalibrateOptions", "CalibrationError", "CertificationError", "CertifyOptions", "DEFAULT_MAX_KLD",
    "Evaluator", "FFNLevelOptionError", "FFNLevelOptions", "Pass", "PassContext", "PassError", "PlanOptions",
    "QuantizeOptionError", "QuantizeOptions", "ResidencyOptions", "CUDA_CONTEXT", "ScoreOptions", "Scratch",
    "calibrate_inputs", "certify_ffn_levels", "certify_model", "check_budget", "check_ffn_levels", "check_lm_head",
    "check_residency",
    "fuse_projections", "input_groups", "layout_experts", "ledger", "linear_weights", "order_superblocks",
    "order_tensors", "parse_size",
    "plan_precision", "plan_residency", "plannable", "quantize_weights", "run_passes", "score_formats", "solve",
]
