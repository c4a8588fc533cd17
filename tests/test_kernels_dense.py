"""bf16 / f16 / f32 matvec (+ gate/up activation epilogue, split-K) and the prefill path."""

import pytest
import torch
from kernel_support import DEVICE, rel_err
from linear_kernel_cases import check_all, check_glu, make_op


@pytest.mark.parametrize("fmt,dtype", [("f32", torch.float32), ("bf16", torch.bfloat16), ("f16", torch.float16)])
def test_matches_reference(fmt, dtype):
    check_all(fmt, (96, 192), dtype=dtype, bias=True)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "relu"])
def test_every_activation_in_the_epilogue(activation):
    op, dense, b = make_op("f32", (64, 64))
    check_glu(op, dense, b, torch.float32, activation)


def test_prefill_gate_up_activation():
    from thin.runtime.ffn import activate
    from thin.runtime.kernels.activation import glu

    x = torch.randn(7, 2 * 80, device=DEVICE).to(torch.bfloat16)
    gate, up = x.float().cpu().to(torch.bfloat16).chunk(2, dim=-1)
    want = activate("gelu", gate) * up
    assert rel_err(glu(x, "gelu"), want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (32000, 4096)])
def test_real_shapes_on_gpu(shape):
    from linear_kernel_cases import check_matvec

    op, dense, _ = make_op("bf16", shape, dtype=torch.bfloat16)
    check_matvec(op, dense, None, torch.bfloat16)
