"""Experiment: int4 g128 matvec on tensor cores (tl.dot of the dequantized tile against x padded to 16 columns).

python .k/mma4.py check            # small shapes, against the dequantized reference (interpreter ok)
python .k/mma4.py bench            # GPU: llama-8b shapes, against the production kernel's best candidate
"""
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))


@triton.jit
def _pair_fma(a, b, c, ASM: tl.constexpr):
    if ASM:
        out = tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                        is_pure=True, pack=1)
    else:
        lo = (a << 16).to(tl.float32, bitcast=True) * (b << 16).to(tl.float32, bitcast=True) + \
            (c << 16).to(tl.float32, bitcast=True)
        hi = (a & -65536).to(tl.float32, bitcast=True) * (b & -65536).to(tl.float32, bitcast=True) + \
            (c & -65536).to(tl.float32, bitcast=True)
        out = ((lo.to(tl.int32, bitcast=True) >> 16) & 0xFFFF) | (hi.to(tl.int32, bitcast=True) & -65536)
    return out


@triton.jit
def _mma4(w_ptr, s_ptr, x_ptr, out_ptr, N, K: tl.constexpr, steps_per_split, BN: tl.constexpr, GS: tl.constexpr,
          ZSUB: tl.constexpr, ASM: tl.constexpr, STAGES: tl.constexpr):
    """out[split, rows] = partial W[rows, cols of split] @ x. GS groups (128 columns) a step."""
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    rows = pid * BN + tl.arange(0, BN)
    WPR: tl.constexpr = K // 8
    G: tl.constexpr = K // 128
    j = tl.arange(0, 16 * GS)
    i = tl.arange(0, 32 * GS)
    nn = tl.arange(0, 16)
    acc = tl.zeros([BN, 16], tl.float32)
    first = sp * steps_per_split
    last = tl.minimum(first + steps_per_split, G // GS)
    for st in tl.range(first, last, num_stages=STAGES):
        words = tl.load(w_ptr + rows[:, None] * WPR + st * 16 * GS + j[None, :])
        raw = tl.zeros([BN, 16], tl.float32)
        xs = tl.zeros([BN, 16], tl.float32)
        for k in tl.static_range(4):
            p = ((words >> (4 * k)) & 0x000F000F) | 0x43004300
            if ZSUB:  # exact (u - 8) pairs: (128 + u) * 1 + (-136)
                p = _pair_fma(p, tl.full([1, 1], 0x3F803F80, tl.int32), tl.full([1, 1], -1022835960, tl.int32), ASM)
            if ASM:
                lo = (p & 0xFFFF).to(tl.int16)
                hi = ((p >> 16) & 0xFFFF).to(tl.int16)
                wk = tl.reshape(tl.join(lo, hi), [BN, 32 * GS]).to(tl.bfloat16, bitcast=True)
            else:  # the interpreter's dot reads a bitcast bf16 by its integer bits: go through float32
                lo = (p << 16).to(tl.float32, bitcast=True)
                hi = (p & -65536).to(tl.float32, bitcast=True)
                wk = tl.reshape(tl.join(lo, hi), [BN, 32 * GS]).to(tl.bfloat16)
            cols = st * 128 * GS + 8 * (i // 2) + k + 4 * (i % 2)
            xk = tl.load(x_ptr + cols)
            xb = tl.where(nn[None, :] == 0, xk[:, None], 0.0).to(tl.bfloat16)
            if ASM:
                raw = tl.dot(wk, xb, raw)
            else:  # the interpreter multiplies a bf16 dot's integer bits
                raw = tl.dot(wk.to(tl.float32), xb.to(tl.float32), raw)
        if GS == 1:
            scale = tl.load(s_ptr + rows * G + st).to(tl.float32)
            if ZSUB:
                acc += raw * scale[:, None]
            else:
                sx = tl.sum(tl.load(x_ptr + st * 128 + tl.arange(0, 128)).to(tl.float32), axis=0)
                acc += (raw - 136.0 * sx) * scale[:, None]
    out = tl.sum(tl.where(nn[None, :] == 0, acc, 0.0), axis=1)
    tl.store(out_ptr + sp * N + rows, out, mask=rows < N)


def mma4(words, scales, x, n, k, bn=64, split=1, warps=4, zsub=True, stages=1, asm=True):
    g = k // 128
    steps = -(-g // split)
    out = torch.empty(split, n, dtype=torch.float32, device=x.device)
    return _mma4[(n // bn, split)](words, scales, x, out, n, k, steps, BN=bn, GS=1, ZSUB=zsub, ASM=asm,
                           STAGES=stages, num_warps=warps), out


def sass():
    import collections, re
    n, k = 28672, 4096
    words = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
    scales = torch.rand(n, k // 128, device="cuda").half()
    x = torch.randn(k, device="cuda").bfloat16()
    for bn, warps, zsub in ((64, 4, True), (128, 4, True)):
        kern, _ = mma4(words, scales, x, n, k, bn=bn, warps=warps, zsub=zsub)
        text = kern.asm["ptx"]
        ops = collections.Counter(line.split()[0] for line in text.splitlines() if line.strip() and line.startswith("\t") and not line.strip().startswith(("//", ".", "{", "}", "$")))
        print(f"bn={bn} w={warps} zsub={zsub}: {sum(ops.values())} instructions, regs {kern.n_regs}, spills {kern.n_spills}")
        print("  ", ", ".join(f"{o} {c}" for o, c in ops.most_common(30)))


def make(n, k, device):
    from thin.ir import Encoding, Tensor, formats
    from thin.runtime.linear import make_linear

    params = formats.get("int4").normalize({})
    w = 0.02 * torch.randn(n, k, device=device)
    raw = formats.encode("int4", w, params).cpu()
    record = Tensor("w", "ffn.down", 0, (n, k), Encoding("int4", params), "bf16")
    from thin.runtime.kernels.grouped_int import GroupedIntLinear
    op = GroupedIntLinear(record, raw.to(device), None, torch.bfloat16, torch.device(device))
    dense = formats.decode("int4", raw, (n, k), params, torch.float32).float().to(device)
    return op, dense


def check():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for n, k in ((128, 512), (64, 256)):
        op, dense = make(n, k, device)
        x = torch.randn(k, device=device).bfloat16()
        want = dense @ x.float()
        for zsub in (True, False):
            for split in (1, 2):
                _, got = mma4(op.low32, op.scales, x, n, k, bn=64, split=split, zsub=zsub, asm=device == "cuda")
                got = got.sum(0)
                err = ((got - want).norm() / want.norm()).item()
                print(f"n={n} k={k} zsub={zsub} split={split}: rel err {err:.2e}")


def bench():
    import bench_kernels as bk
    from concurrent.futures import ProcessPoolExecutor
    from thin.runtime.bench import copy_bandwidth

    if False:
        for line in pool.map(bk.compile_all, [("int4", name, False) for name in ("qkv", "o", "gate_up", "down")]):
            print(line, flush=True)
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"copy {bw/1e9:.0f} GB/s")
    check()
    sass()
    rows = []
    for name in ("qkv", "o", "gate_up", "down"):
        n, k, mode = bk.SHAPES[name]
        b = {"us": {"qkv": 6.72, "o": 5.61, "gate_up": 19.19, "down": 12.14}[name], "config": "call 2"}
        print(name, "production", b, flush=True)
        ops, nbytes = bk.build("int4", n, k)
        copies = max(1, min(24, bk.L2_BYTES // nbytes))
        ops = ops + bk.build("int4", n, k, copies - 1)[0] if copies > 1 else ops
        x = torch.randn(k, device="cuda").bfloat16()
        best = None
        for bn in (64, 128):
            for warps in (4,):
                for split in (2, 4, 8, 16):
                    for zsub in (1, 3, 4):
                        try:
                            calls = [lambda op=op, s=split, z=zsub, bn=bn, w=warps: mma4(op.low32, op.scales, x, n, k,
                                                                                        bn=bn, split=s, warps=w, stages=z)
                                     for op in ops]
                            sec = bk.time_graph(calls * max(1, 20 // len(ops)))
                        except Exception as e:  # noqa: BLE001
                            print(name, bn, warps, split, zsub, "failed", str(e)[:300])
                            continue
                        r = (sec * 1e6, bn, warps, split, zsub)
                        print(f"  {name} bn={bn} w={warps} split={split} zsub={zsub}: {sec*1e6:.2f} us "
                              f"{nbytes / sec / bw * 100:.0f}%", flush=True)
                        if best is None or r < best:
                            best = r
        rows.append((name, nbytes, b["us"], b["config"], best))
    print("\nshape | MB | production us (% copy) | mma us (% copy) | mma config | production config")
    for name, nbytes, us, cfg, best in rows:
        print(f"{name} | {nbytes/1e6:.1f} | {us:.2f} ({nbytes/us/1e-6/bw*100:.0f}%) | {best[0]:.2f} "
              f"({nbytes/best[0]/1e-6/bw*100:.0f}%) | bn={best[1]} w={best[2]} split={best[3]} zsub={best[4]} | {cfg}")


if __name__ == "__main__":
    {"check": check, "bench": bench, "sass": sass}[sys.argv[1]]()
