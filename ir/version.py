"""Version numbers: the package, and the IR schema it writes."""

__version__ = "0.1.0"

# The plain-data schema of the IR. A reader refuses a newer major schema; a newer
# minor may only add optional fields, which older readers ignore.
IR_VERSION = (1, 3)  # 1.1: Tensor.align; 1.2: YaRN RoPE fields, MLP alpha/limit/up_offset; 1.3: Model.ffn_levels
