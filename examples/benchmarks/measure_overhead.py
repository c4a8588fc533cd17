"""Measure what thin's runtime holds on the GPU beyond its tensors: the `cuda_context` line of the
memory ledger (passes/memory_ledger.py, CUDA_CONTEXT).

    python examples/benchmarks/measure_overhead.py examples/models/tiny-coder [--device 0]

Run it on an otherwise idle GPU. It compiles the model exactly (a few MB of weights), then, in this
process, reads the process's device memory from NVML (pynvml when installed, else
`nvidia-smi --query-compute-apps`) at each step:

    1. CUDA context: after torch initialises CUDA and allocates one byte;
    2. loaded: after `thin.runtime.load(artifact, device="cuda")`;
    3. generated: after a 512-token prompt and 32 generated tokens (kernels, cuBLAS, graphs loaded).

The overhead is what the process holds minus what torch's allocator has allocated at the peak
(`torch.cuda.max_memory_allocated()`): the CUDA context and loaded kernels, cuBLAS workspaces,
CUDA graph pools and the allocator's unused reserve. Put the figure printed last (rounded up to
the next 32 MiB) into CUDA_CONTEXT, with the GPU, driver and torch version it was measured with.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path


def process_bytes(index: int) -> int:
    """Device bytes this process holds on GPU `index`, from NVML."""
    pid = os.getpid()
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == pid:
                return int(p.usedGpuMemory)
        return 0
    except ImportError:
        out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            fields = [f.strip() for f in line.split(",")]
            if fields and fields[0] == str(pid):
                return int(fields[1]) * 2**20
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--device", type=int, default=0, help="GPU index")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    args = parser.parse_args()

    import torch

    from thin.compiler import compile_model
    from thin.runtime import load

    mib = 2**20
    torch.cuda.set_device(args.device)
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    rows = [("CUDA context (torch initialised, 1 byte allocated)", process_bytes(args.device),
             torch.cuda.memory_reserved())]
    with tempfile.TemporaryDirectory() as tmp:
        path = compile_model(args.model_dir, Path(tmp) / "model.thin")
        model = load(path, device="cuda")
        torch.cuda.synchronize()
        rows.append(("model loaded", process_bytes(args.device), torch.cuda.memory_reserved()))
        prompt = list(range(1, args.prompt_tokens + 1))
        tokens = list(model.generate(prompt, max_new_tokens=32, temperature=0.0))
        torch.cuda.synchronize()
        rows.append((f"{args.prompt_tokens}-token prompt + {len(tokens)} generated", process_bytes(args.device),
                     torch.cuda.memory_reserved()))
    peak_allocated = torch.cuda.max_memory_allocated()
    print(f"GPU {torch.cuda.get_device_name(args.device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"{'step':<52} {'process MiB':>12} {'torch reserved MiB':>19}")
    for name, used, reserved in rows:
        print(f"{name:<52} {used / mib:12.1f} {reserved / mib:19.1f}")
    overhead = rows[-1][1] - peak_allocated
    print(f"peak allocated by torch: {peak_allocated / mib:.1f} MiB")
    print(f"context alone (process - reserved after init): {(rows[0][1] - rows[0][2]) / mib:.1f} MiB")
    print(f"overhead (process at the end - peak allocated): {overhead / mib:.1f} MiB")
    print(f"CUDA_CONTEXT = {-(-overhead // (32 * mib)) * 32} * 2**20")


if __name__ == "__main__":
    main()
