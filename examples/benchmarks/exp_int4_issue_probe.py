"""Scratch: is the int4 pairs matvec issue-bound? VARIANT=0 production, 1 no zero-point fma (wrong numbers),
2 also no shifts (every pair from nibbles 0/4: wrong numbers). Times the tuned tilings (session 12 call 2)."""
import os, sys, torch
sys.path.insert(0, os.path.dirname(__file__))
import triton, triton.language as tl
from thin.runtime.kernels import pairs
V = int(os.environ.get("VARIANT", "0"))

@triton.jit
def code_pair_v1(word, k: tl.constexpr, magic, ZERO_BITS: tl.constexpr, ASM: tl.constexpr):
    return ((word >> (4 * k)) & 0x000F000F) | magic

@triton.jit
def code_pair_v2(word, k: tl.constexpr, magic, ZERO_BITS: tl.constexpr, ASM: tl.constexpr):
    return (word & 0x000F000F) | magic

if V == 1:
    pairs.code_pair = code_pair_v1
elif V == 2:
    pairs.code_pair = code_pair_v2
import bench_kernels as bk
from thin.runtime.kernels.common import MatvecConfig
cfg = {"qkv": MatvecConfig(4, 2048, 1, 2, packed=True), "o": MatvecConfig(4, 2048, 1, 2, packed=True),
       "gate_up": MatvecConfig(2, 1024, 1, 1, packed=True), "down": MatvecConfig(4, 2048, 1, 2, packed=True, ahead=2)}
bw = 4.25e12
for name, c in cfg.items():
    n, k, mode = bk.SHAPES[name]
    ops, nbytes = bk.build("int4", n, k)
    copies = max(1, min(24, bk.L2_BYTES // nbytes))
    ops = ops + bk.build("int4", n, k, copies - 1)[0] if copies > 1 else ops
    x = torch.randn(k, device="cuda").bfloat16()
    best = []
    for cc in (c, MatvecConfig(c.block_n, c.chunk, c.split, c.num_warps, packed=True, ahead=0)):
        outs = [bk.out_buffer(op, cc, mode) for op in ops]
        calls = [lambda op=op, o=o, cc=cc: bk.launch(op, x, cc, mode, o) for op, o in zip(ops, outs)]
        sec = bk.time_graph(calls * max(1, 20 // len(ops)))
        best.append(sec)
    print(f"VARIANT {V} {name}: {min(best)*1e6:.2f} us ({nbytes/min(best)/bw*100:.0f}% of 4.25 TB/s)", flush=True)
