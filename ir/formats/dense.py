"""Dense formats: one plain IEEE or bfloat16 element per weight, stored as is (any shape).

The layout is a single part, `values`, in the format's dtype: a safetensors tensor's bytes
and these bytes are the same, so an unquantized weight goes from checkpoint to artifact
without conversion.
"""

from __future__ import annotations

from .base import Format

F32 = Format("f32", "IEEE float32, stored as is", torch_dtype="float32", safetensors_dtype="F32",
             matrix_only=False)
F16 = Format("f16", "IEEE float16, stored as is", torch_dtype="float16", safetensors_dtype="F16",
             matrix_only=False)
BF16 = Format("bf16", "bfloat16, stored as is", torch_dtype="bfloat16", safetensors_dtype="BF16",
              matrix_only=False)
