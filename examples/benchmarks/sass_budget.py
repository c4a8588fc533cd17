"""The instruction budget of a decode matvec, on a machine without a GPU: compile one launch configuration of a
weight format's matvec kernel for sm_90 (Triton's own ptxas and nvdisasm, which its wheel carries) and count the
SASS instructions of the kernel's hot loop, per weight and lane, by opcode.

    python3 examples/benchmarks/sass_budget.py [--format int4] [--shape qkv] [--config "block_n=4, chunk=2048,
        num_warps=2, packed=1"] [--dump FILE]

At llama-8b's bandwidth on an H200 an int4 weight (4.125 bits with its scale) allows about 4 instructions a lane
before the SMs, not memory, are the limit (computed, not measured: 132 SMs x 4 schedulers x 32 lanes x ~1.98 GHz
= 3.3e13 lane-instructions a second, against 4.3 TB/s x 8 / 4.125 = 8.3e12 weights a second), and the
matvecs issue from only part of their cycles (latency): BENCHMARKS.md's Round 12 timed a third of the loop's
instructions removed at 7-10% of the big matvecs. This script is how Round 16 chose its arithmetic before any device
time. The weights are random and nothing runs: the launch goes through the kernel's own launcher (so every constexpr
and specialization is the engine's) into Triton's compile-only `warmup`, with a stand-in for the CUDA driver that
names sm_90 as the target. The hot loop is the longest backward branch of the SASS.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

SHAPES = {"qkv": (6144, 4096, "plain"), "o": (4096, 4096, "plain"), "gate_up": (14336, 4096, "glu"),
          "down": (4096, 14336, "plain"), "lm_head": (32000, 4096, "plain")}
ADDRESS = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*)$")
LABEL = re.compile(r"^\.(L_x_\d+):")
BRANCH = re.compile(r"\bBRA\b.*`\(\.(L_x_\d+)\)")


class _Sm90:
    """The part of Triton's active driver that a compile-only launch asks for: an sm_90 target, device 0."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


_COMPILED = []  # what the wrapped kernels compiled, last launch last


class _CompileOnly:
    """kernel[grid](...) compiles (Triton's warmup) and keeps the result instead of launching."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _COMPILED.append(self.fn.warmup(*args, grid=grid, **kwargs))


def compile_launch(fmt: str, shape: str, config_text: str):
    """The compiled kernel (Triton's CompiledKernel) of one matvec launch of `fmt` at llama-8b's `shape` with
    the MatvecConfig written as `config_text` (its keyword arguments)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("sass_budget compiles for the GPU: run it without TRITON_INTERPRET=1")
    import torch
    import triton
    from triton.runtime import driver

    from thin.ir import Encoding, Tensor, formats
    from thin.runtime.kernels import grouped_int, mxfp4, rowwise8
    from thin.runtime.kernels.common import MatvecConfig

    driver.set_active(_Sm90())
    for module in (grouped_int, mxfp4, rowwise8):  # once a process: a second call finds them wrapped
        for name, value in vars(module).copy().items():
            if isinstance(value, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                setattr(module, name, _CompileOnly(value))
    n, k, mode = SHAPES[shape]
    rows = 2 * n if mode == "glu" else n
    params = formats.get(fmt).normalize({})
    raw = formats.encode(fmt, 0.02 * torch.randn(rows, k), params)
    record = Tensor("w", "ffn.down", 0, (rows, k), Encoding(fmt, params), "bf16")
    factory = {"int4": grouped_int.make, "int8": rowwise8.make, "fp8_e4m3": rowwise8.make, "mxfp4": mxfp4.make}.get(fmt)
    if factory is None:
        raise SystemExit(f"sass_budget knows the int4, int8, fp8_e4m3 and mxfp4 matvecs, not {fmt}")
    op = factory(record, raw, None, torch.device("cpu"), torch.bfloat16)
    config = eval(f"MatvecConfig({config_text})", {"MatvecConfig": MatvecConfig})  # noqa: S307 (a developer's flag)
    x = torch.randn(k).to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    op._matvec(x, out, config, 0 if mode == "glu" else -1, False)
    return _COMPILED[-1], op, config, mode


def disassemble(kernel) -> str:
    """nvdisasm's listing of a compiled kernel's cubin (Triton's own nvdisasm)."""
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        return subprocess.run([nvdisasm, "-c", cubin.name], capture_output=True, text=True, check=True).stdout


def hot_loop(sass: str) -> list[str]:
    """The instructions of the longest loop (a backward branch to a label) of nvdisasm's listing."""
    code, labels, best = [], {}, []
    for line in sass.splitlines():
        label = LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = len(code)
        found = ADDRESS.match(line)
        if found:
            code.append(found.group(2))
    for i, text in enumerate(code):
        branch = BRANCH.search(text)
        if branch and labels.get(branch.group(1), i + 1) <= i and i + 1 - labels[branch.group(1)] > len(best):
            best = code[labels[branch.group(1)]:i + 1]
    return best


def opcode(text: str) -> str:
    """The opcode of one SASS instruction (predicate and modifiers dropped)."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def budget(fmt: str, shape: str, config_text: str, dump: str | None = None) -> dict:
    """{'per_weight': loop instructions per weight and lane, 'loop': their count, 'opcodes': Counter}."""

    from thin.runtime.kernels.chunks import chunk_launch

    kernel, op, config, mode = compile_launch(fmt, shape, config_text)
    sass = disassemble(kernel)
    if dump:
        with open(dump, "w") as f:
            f.write(sass)
    loop = hot_loop(sass)
    if not loop:
        raise SystemExit("no loop in the kernel's SASS: a configuration of one step a program has none to count")
    weight_rows = config.block_n * (2 if mode == "glu" else 1)
    columns = chunk_launch(op.in_features // 32, config).chunks * 32  # a step's columns
    lanes = 32 * config.num_warps
    return {"per_weight": len(loop) * lanes / (weight_rows * columns), "loop": len(loop),
            "opcodes": collections.Counter(opcode(t) for t in loop)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", default="int4")
    ap.add_argument("--shape", default="qkv", choices=sorted(SHAPES))
    ap.add_argument("--config", default="block_n=4, chunk=2048, num_warps=2, packed=1",
                    help="MatvecConfig keyword arguments (chunk: columns a step)")
    ap.add_argument("--dump", default=None, help="write the whole SASS listing here")
    args = ap.parse_args(argv)
    result = budget(args.format, args.shape, args.config, args.dump)
    print(f"| {args.format} {args.shape} | {args.config} | {result['loop']} | {result['per_weight']:.3f} | "
          + ", ".join(f"{name} {count}" for name, count in result["opcodes"].most_common()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
