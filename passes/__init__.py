"""IR -> IR passes and the runner that applies them in order."""

from .fuse_projections import fuse_projections
from .order_tensors import order_tensors
from .quantize_weights import QuantizeOptionError, QuantizeOptions, linear_weights, quantize_weights
from .runner import Pass, PassContext, PassError, run_passes

__all__ = ["fuse_projections", "order_tensors", "quantize_weights", "QuantizeOptions", "QuantizeOptionError",
           "linear_weights", "Pass", "PassContext", "PassError", "run_passes"]
