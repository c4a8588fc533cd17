"""The mixture-of-experts decode kernels alone (runtime/kernels/experts.py), at a benchmark shape's
expert dimensions, on one GPU:

    python examples/benchmarks/bench_experts.py [--shape moe-a3b] [--formats bf16,int4,mxfp4] [--group-size 128]

Formats are the registry's names, and `trellis2` / `trellis3` for trellis experts of k = 2 / 3 bits, made
of random code bytes and row scales (the format's encoder is a compile-time Viterbi search, too slow for
a benchmark's experts, and a kernel's speed does not depend on the codes).

One set of random experts (num_experts, in each format) serves every layer of the shape, and layer
l's router is biased towards experts l*k .. l*k+k-1, so a step over the layers reads each expert once
(more bytes than the 50 MB L2, as a model's step does). Each of router / gate_up / down / the whole
layer is captured in a CUDA graph over all the layers and replayed; the table gives microseconds per
layer and the bandwidth of the bytes read (the k experts' packed weights, the float32 router). Launch
tiles are the ones the engine's load would pick (timed), named by ExpertConfig.label / RouterConfig.label:
rows x groups (whole-word tilings: chunks of 32 columns) / warps, +pf prefetching, +words whole-word
reads, +pairs bf16 pairs. `--device cpu` runs it once through Triton's
interpreter at any shape given by --hidden/--inter/--experts/--top-k/--layers (a smoke test).

A second table times what comes before the experts in the decode step, the residual norm then the
router, both ways (the first format's layers, in one graph): add_rmsnorm of `--parts` split-K partial
rows (o's) then the router, against the router that runs the norm itself (kernels/norm_router.py), each
of its tilings; the engine's warm-up picks between them by a shorter timing of the same launches.

A third table times what comes after the experts, per format: the chosen down launch then add_rmsnorm
of its top_k rows, against the down launch whose last program runs that norm itself
(kernels/expert_finish.py), each of its tilings; again the warm-up's choice, timed longer.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from bench_kernels import time_graph  # this folder: one CUDA-graph timer for the kernel benchmarks

SHAPES = {"moe-a3b": (2048, 768, 128, 8, 16, {}), "gpt-oss-20b": (2880, 2880, 32, 4, 24, {"clamp": True})}


def build(fmt: str, params: dict, hidden: int, inter: int, experts: int, top_k: int, layers: int, clamp: bool,
          device, dtype):
    """([MoEKernels] for `layers` layers sharing one set of experts, (gate_up, down) bytes a layer reads)."""
    from thin.ir import Encoding, Tensor, formats
    from thin.runtime.ffn import MLPPlan, MoEPlan
    from thin.runtime.kernels.experts import MoEKernels
    from thin.runtime.linear import make_linear

    gen = torch.Generator().manual_seed(0)
    params = formats.get(fmt).normalize(params)

    def op(shape):
        record = Tensor("layers.0.mlp.experts.0.w", "moe.expert.up", 0, shape, Encoding(fmt, params), "bf16")
        bias = (0.01 * torch.randn(shape[0], generator=gen)).to(dtype).to(device) if clamp else None
        if fmt == "trellis":  # random code bytes (see the module's note), row scales of the others' rms
            codes = torch.randint(0, 256, (shape[0], shape[1] * dict(params)["bits"] // 8), generator=gen,
                                  dtype=torch.uint8)
            raw = formats.get(fmt).join({"codes": codes, "row_scale": torch.full((shape[0],), 0.02).half()}, shape,
                                        params)
        else:
            raw = formats.encode(fmt, (0.02 * torch.randn(*shape, generator=gen)).to(device), params).cpu()
        return make_linear(record, raw, bias, device, dtype)

    extra = dict(alpha=1.702, limit=7.0, up_offset=1.0) if clamp else {}
    mlps = [MLPPlan("silu", True, [op((2 * inter, hidden))], op((hidden, inter)), **extra) for _ in range(experts)]
    up_bytes, down_bytes = (formats.nbytes(fmt, s, params) for s in ((2 * inter, hidden), (hidden, inter)))
    out = []
    for layer in range(layers):
        router = 0.01 * torch.randn(experts, hidden, generator=gen)
        bias = torch.zeros(experts)
        chosen = [(layer * top_k + j) % experts for j in range(top_k)]
        bias[chosen] = 30.0 + torch.arange(top_k, 0, -1).float()  # these k, in this order
        plan = MoEPlan(top_k, True, "softmax", router.to(device), bias.to(device), mlps, None, None)
        out.append(MoEKernels(plan, device, dtype))
    return out, (top_k * up_bytes, top_k * down_bytes)


def step(kernels, x, partials, part: str) -> None:
    """Launch `part` (router, gate_up, down or all) of every layer's expert kernels for x."""
    for k in kernels:
        if part in ("router", "all"):
            k.route(x)
        if part in ("gate_up", "all"):
            for i in range(len(k.groups("gate_up"))):
                k._gate_up(i, x, k.config(i, "gate_up"))
        if part in ("down", "all"):
            for i in range(len(k.groups("down"))):
                k._down(i, partials, k.config(i, "down"))


def norm_rows(kernels, parts: int) -> list[tuple[str, float]]:
    """(what, us per layer) of add_rmsnorm of `parts` partial rows then the router, and of each tiling of
    the norming router (norm_router.candidates), over every layer in one graph."""
    from thin.runtime.kernels import norm_router
    from thin.runtime.kernels.norm import Finish, add_rmsnorm

    first = kernels[0]
    hidden, device, dtype = first.hidden, first.device, first.dtype
    residual, normed = torch.randn(hidden, device=device).to(dtype), torch.empty(hidden, dtype=dtype, device=device)
    partials = torch.randn(parts, hidden, device=device)
    finish = Finish(torch.zeros(1, dtype=torch.int32, device=device), residual, normed, None, None,
                    (torch.ones(hidden, device=device), 1e-5))

    def separate():
        for k in kernels:
            add_rmsnorm(residual, normed, partials=partials, norm=finish.norm)
            k.route(normed)

    def fused():
        for k in kernels:
            k.route_norm(finish, partials)

    rows = [(f"add_rmsnorm + router {first.router_config().label()}", 1e6 * time_graph([separate], reps=20)
             / len(kernels))]
    for config in norm_router.candidates(first.num_experts, hidden):
        for k in kernels:
            k.norm_router = config
        rows.append((f"norming router {config.label()}", 1e6 * time_graph([fused], reps=20) / len(kernels)))
    for k in kernels:
        k.norm_router = None
    return rows


def finish_rows(kernels, fmt: str) -> list[tuple[str, float]]:
    """(what, us per layer) of the chosen down launch then add_rmsnorm of its rows, and of each tiling of
    the finishing down launch (expert_finish.candidates), over every layer in one graph (their routings
    and intermediates as the last step left them)."""
    from thin.runtime.kernels import expert_finish
    from thin.runtime.kernels.norm import Finish, add_rmsnorm

    first = kernels[0]
    hidden, device, dtype = first.hidden, first.device, first.dtype
    residual, normed = torch.randn(hidden, device=device).to(dtype), torch.empty(hidden, dtype=dtype, device=device)
    out = torch.zeros(first.top_k, hidden, dtype=torch.float32, device=device)
    finish = Finish(torch.zeros(1, dtype=torch.int32, device=device), residual, normed, None, None,
                    (torch.ones(hidden, device=device), 1e-5))

    def separate():
        for k in kernels:
            k._down(0, out, k.config(0, "down"))
            add_rmsnorm(residual, normed, partials=out, norm=finish.norm)

    rows = [(f"{fmt}: down {first.config(0, 'down').label()} + add_rmsnorm",
             1e6 * time_graph([separate], reps=20) / len(kernels))]
    for config in expert_finish.candidates(first):
        def fused(config=config):
            for k in kernels:
                k._down(0, out, config, finish=finish)

        rows.append((f"{fmt}: finishing down {config.label()}", 1e6 * time_graph([fused], reps=20) / len(kernels)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="moe-a3b")
    ap.add_argument("--formats", default="bf16,int4,mxfp4", help="comma list (trellis2 / trellis3: trellis of k bits)")
    ap.add_argument("--group-size", type=int, default=None, help="int4's group (default 128, 64 for 2880 columns)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--parts", type=int, default=4, help="partial rows the residual norm adds (o's split-K)")
    for name in ("hidden", "inter", "experts", "top-k", "layers"):
        ap.add_argument(f"--{name}", type=int, default=None, help="override the shape's")
    args = ap.parse_args()
    hidden, inter, experts, top_k, layers, extra = SHAPES[args.shape]
    hidden, inter = args.hidden or hidden, args.inter or inter
    experts, top_k, layers = args.experts or experts, args.top_k or top_k, args.layers or layers
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu runs the kernels through Triton's interpreter: set TRITON_INTERPRET=1")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here (--device cpu with TRITON_INTERPRET=1 for a smoke run)")
    dtype = torch.bfloat16
    group = args.group_size or (128 if hidden % 128 == 0 and inter % 128 == 0 else 64)
    rows, norm, after = [], [], []
    for name in args.formats.split(","):
        fmt, params = name, {"group_size": group} if name.startswith("int") and name != "int8" else {}
        if name in ("trellis2", "trellis3"):
            fmt, params = "trellis", {"bits": int(name[-1])}
        began = time.perf_counter()
        kernels, (up_bytes, down_bytes) = build(fmt, params, hidden, inter, experts, top_k, layers,
                                                extra.get("clamp", False), device, dtype)
        x = torch.randn(hidden, device=device).to(dtype)
        partials = torch.zeros(top_k, hidden, dtype=torch.float32, device=device)
        for k in kernels:
            k.warm_up()
        setup = time.perf_counter() - began
        router_bytes = experts * hidden * 4

        if device.type == "cpu":
            step(kernels, x, partials, "all")
            print(f"{name}: ran {layers} layers through the interpreter (setup {setup:.1f} s)")
            continue
        if not norm:
            norm = norm_rows(kernels, args.parts)
        ms = {part: 1e3 * time_graph([lambda p=part, k=kernels, x=x, out=partials: step(k, x, out, p)], reps=20)
              for part in ("router", "gate_up", "down", "all")}
        per = {p: 1e3 * t / layers for p, t in ms.items()}
        read = {"router": router_bytes, "gate_up": up_bytes, "down": down_bytes,
                "all": up_bytes + down_bytes + router_bytes}
        rows.append((name, per, {p: read[p] / (per[p] * 1e-6) / 1e9 for p in per}, up_bytes + down_bytes, setup,
                     kernels[0].router_config(), kernels[0].config(0, "gate_up"), kernels[0].config(0, "down")))
        after += finish_rows(kernels, name)
        kernels.clear()
        torch.cuda.empty_cache()
    if not rows:
        return
    print(f"\n{args.shape} experts: hidden {hidden}, FFN {inter}, {experts} experts top-{top_k}, {layers} layers "
          f"sharing them ({torch.cuda.get_device_name()}); us per layer (GB/s of the bytes read)")
    print("| format | routed expert MB/layer | router | gate_up | down | layer | tiles (router; gate_up; down) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for fmt, per, bw, nbytes, _, rt, gu, dn in rows:
        cells = " | ".join(f"{per[p]:.1f} ({bw[p]:.0f})" for p in ("router", "gate_up", "down", "all"))
        print(f"| {fmt} | {nbytes / 1e6:.1f} | {cells} | {rt.label()}; {gu.label()}; {dn.label()} |")
    print(f"\nresidual norm ({args.parts} partial rows) then router, us per layer")
    print("| launches | us |\n| --- | ---: |")
    for what, us in norm:
        print(f"| {what} | {us:.2f} |")
    print(f"\nexpert down then the residual norm of its {top_k} rows, us per layer")
    print("| launches | us |\n| --- | ---: |")
    for what, us in after:
        print(f"| {what} | {us:.2f} |")


if __name__ == "__main__":
    main()
