"""Experiment: a bitshift trellis code for low-bit experts, in the spirit of QTIP (Tseng et al.,
"QTIP: Quantization with Trellises and Incoherence Processing", 2024). Not a thin format: nothing
in ir/formats, the planner or the runtime knows it. bench_rotation.py uses it as its `trellis`
variants; run alone it measures the code on i.i.d. Gaussian data:

    OMP_NUM_THREADS=1 python3 examples/benchmarks/trellis.py --gaussian --L 8,10,12

The code. A sequence of T weights (here a 16 x 16 tile of a weight matrix, flattened row-major) is
stored as a circular bitstream of k*T bits, b_0 .. b_{T-1} (k bits each). Weight t reads the L-bit
window ending at chunk t, state s_t = b_t | b_{t-1} << k | ... | b_{t-L/k+1} << (L-k) (indices
mod T: "tail-biting", so the stream is exactly k bits per weight), and decodes to scale * c(s_t),
c a codebook of 2^L values. Consecutive states overlap in L - k bits: s_{t+1} = (s_t << k | b_{t+1})
mod 2^L, so the choice of a weight's value is constrained by its neighbours' and the best stream is
a shortest path through the trellis of 2^L states (Viterbi, squared error). With L > k the code
spends k bits per weight but picks each value from 2^L, which is what lets it get closer to the
Gaussian rate-distortion bound 2^(-2k) than any scalar grid.

Codebooks (`--codebook`): `hash`, computed, lookup-free: c(s) = (bytesum(A s + B mod 2^32) - 510)
/ 147.8, the sum of the four bytes of one integer multiply-add of the state, close to a Gaussian
(a sum of four near-uniform bytes; QTIP's "1MAD" idea, my own constants); `gauss`, a table of 2^L
i.i.d. N(0, 1) values; `lloyd`, the `hash` values refined on Gaussian training sequences (each
state's value moved to the mean of the weights Viterbi assigns it, a few rounds): a 2^L-entry table
a kernel would keep in shared memory.

Tail-biting encode (QTIP's two-pass trick): Viterbi with a free start on the sequence rotated by
T/2 gives the L - k bits the best path crosses the wrap point with; a second Viterbi is run with
the first state's high bits and the last state's low bits both held to them.

`trellis_gptq` quantizes matrices (already rotated, W R) block by block of 16 columns under their
inputs' second moments, GPTQ's error feedback with a block quantized jointly (BlockLDLQ in QuIP#'s
words): with U the upper Cholesky factor of H^-1, after the columns J are coded the remaining
columns take W[:, rest] -= (W_J - Q_J) U_JJ^-1 U_J,rest. Each row has one float16 scale
(`scale` x its rms); bits per weight are k + 16 / columns.
"""

from __future__ import annotations

import argparse
import time

HASH_A = 0x2F6B_4E95  # odd multiplier of the `hash` codebook's multiply-add
HASH_B = 0x1D3C_5A17
TILE = 16  # a trellis sequence is a TILE x TILE tile of a matrix: T = 256 weights


def hash_values(L: int):
    """The `hash` codebook: 2^L values, each from one 32-bit multiply-add of its state and a byte sum."""
    import torch

    s = torch.arange(2 ** L, dtype=torch.int64)
    x = (s * HASH_A + HASH_B) & 0xFFFF_FFFF
    total = sum((x >> (8 * i)) & 0xFF for i in range(4))
    return ((total.double() - 510.0) / (4 * (256 ** 2 - 1) / 12) ** 0.5).float()


def codebook(L: int, kind: str, k: int = 2, seed: int = 0):
    """The 2^L codebook values (float32) of `kind`: hash, gauss or lloyd (see the module docstring)."""
    import torch

    if kind == "hash":
        return hash_values(L)
    if kind == "gauss":
        return torch.randn(2 ** L, generator=torch.Generator().manual_seed(seed))
    if kind != "lloyd":
        raise ValueError(f"unknown codebook {kind!r}; codebooks are hash, gauss, lloyd")
    values = hash_values(L)
    x = torch.randn(max(64, 2 ** (16 - L) * 16), TILE * TILE, generator=torch.Generator().manual_seed(seed + 1))
    for _ in range(6):
        states = encode(x, values, k, L)
        total = torch.zeros_like(values).index_add_(0, states.flatten(), x.flatten())
        count = torch.zeros_like(values).index_add_(0, states.flatten(), torch.ones(x.numel()))
        values = torch.where(count > 0, total / count.clamp(min=1), values)
    return values


def viterbi(x, values, k: int, L: int, overlap=None):
    """States [B, T] (int64) of the path through the trellis minimising sum_t (x[:, t] - values[s_t])^2;
    `overlap` [B] (optional) holds a tail-biting path's wrap bits. The `trellis` format's Viterbi
    (thin/ir/formats/trellis.py), where this experiment's code now lives."""
    from thin.ir.formats.trellis import viterbi as format_viterbi

    return format_viterbi(x, values, k, L, overlap)


def encode(x, values, k: int, L: int, chunk: int = 512):
    """Tail-biting states [B, T] for the sequences x [B, T] (two Viterbi passes, see the docstring)."""
    from thin.ir.formats.trellis import tail_biting

    return tail_biting(x, values, k, L, chunk=chunk)


def pack(states, k: int):
    """The circular bitstream [B, T] of k-bit chunks (uint8): chunk t is the k low bits of s_t."""
    import torch

    return (states & (2 ** k - 1)).to(torch.uint8)


def unpack(chunks, k: int, L: int):
    """States [B, T] read back from a tail-biting stream: s_t = sum_j b_{t-j} << (k j), j < L / k."""
    import torch

    c = chunks.long()
    return sum(torch.roll(c, j, 1) << (k * j) for j in range(L // k))


def decode(chunks, values, k: int, L: int):
    """The codeword values [B, T] of a stream of k-bit chunks."""
    return values[unpack(chunks, k, L)]


def tiles(w):
    """[N, rows, c] -> [N * rows / TILE * c / TILE, TILE * TILE]: each TILE x TILE tile row-major."""
    n, rows, cols = w.shape
    return w.reshape(n, rows // TILE, TILE, cols // TILE, TILE).permute(0, 1, 3, 2, 4).reshape(-1, TILE * TILE)


def untiles(seq, n: int, rows: int, cols: int):
    """The inverse of `tiles`."""
    return seq.reshape(n, rows // TILE, cols // TILE, TILE, TILE).permute(0, 1, 3, 2, 4).reshape(n, rows, cols)


def trellis_gptq(weights, uppers, books: dict, ks, L: int, scale: float = 1.0):
    """w_hat [N, rows, cols]: the matrices `weights` [N, rows, cols] trellis-coded a block of TILE columns
    at a time, with GPTQ's error feedback through `uppers` [N, cols, cols] (each its input second moment's
    inverse_cholesky factor; None: no feedback, plain Viterbi per tile). `ks` [N, cols / TILE] (or an int):
    the bits per weight k of each matrix's column block, `books` {k: codebook values}. One float16 scale
    per row, `scale` x the row's rms, rounded to float16."""
    import torch

    w = weights.float().clone()
    n, rows, cols = w.shape
    if rows % TILE or cols % TILE:
        raise ValueError(f"trellis tiles of {TILE} x {TILE} do not tile a [{rows}, {cols}] weight")
    ks = torch.full((n, cols // TILE), ks) if isinstance(ks, int) else ks
    s = (scale * w.pow(2).mean(2, keepdim=True).sqrt()).clamp(min=1e-8).half().float()  # [N, rows, 1]
    w_hat = torch.zeros_like(w)
    for j in range(0, cols, TILE):
        block = w[:, :, j:j + TILE]
        q = torch.empty_like(block)
        for k in ks[:, j // TILE].unique().tolist():
            pick = ks[:, j // TILE] == k
            seq = tiles(block[pick] / s[pick])
            chunks = pack(encode(seq, books[k], k, L), k)
            q[pick] = untiles(decode(chunks, books[k], k, L), int(pick.sum()), rows, TILE) * s[pick]
        w_hat[:, :, j:j + TILE] = q
        if uppers is not None and j + TILE < cols:
            u = uppers[:, j:j + TILE, j:j + TILE]
            err = torch.linalg.solve_triangular(u, block - q, upper=True, left=False)
            w[:, :, j + TILE:] -= err @ uppers[:, j:j + TILE, j + TILE:]
    return w_hat


def trellis_bits(k: int, cols: int) -> float:
    """Bits per weight of a trellis-coded [rows, cols] matrix: k, plus one float16 scale per row."""
    return k + 16 / cols


def gaussian_table(Ls, kinds, ks, rows: int, cols: int, seed: int) -> list[dict]:
    """Relative squared error of the trellis code on i.i.d. N(0, 1) matrices [rows, cols], per L, codebook
    and k, with its bits per weight and the Gaussian rate-distortion bound at k bits (2^-2k)."""
    import torch

    w = torch.randn(1, rows, cols, generator=torch.Generator().manual_seed(seed))
    out = []
    for k in ks:
        for L in Ls:
            if L % k or k >= L:
                print(f"skipped L={L}, k={k}: the state must be a multiple of k bits, larger than k", flush=True)
                continue
            for kind in kinds:
                values = codebook(L, kind, k, seed)
                t0 = time.perf_counter()
                w_hat = trellis_gptq(w, None, {k: values}, k, L)
                err = float((w_hat - w).pow(2).sum() / w.pow(2).sum())
                out.append({"k": k, "L": L, "codebook": kind, "bits_per_weight": trellis_bits(k, cols),
                            "rel_sq_error": err, "bound": 2.0 ** (-2 * k), "seconds": time.perf_counter() - t0})
                print(out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gaussian", action="store_true", help="measure on i.i.d. Gaussian matrices")
    parser.add_argument("--L", default="8,10,12", help="comma-separated state sizes in bits")
    parser.add_argument("--k", default="2", help="comma-separated bits per weight")
    parser.add_argument("--codebooks", default="hash,gauss,lloyd")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--cols", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not args.gaussian:
        raise SystemExit("nothing to do: pass --gaussian (bench_rotation.py runs the model variants)")
    rows = gaussian_table([int(v) for v in args.L.split(",")], args.codebooks.split(","),
                          [int(v) for v in args.k.split(",")], args.rows, args.cols, args.seed)
    print()
    print("| k | L | codebook | bits per weight | rel. sq. error | bound 2^-2k | ratio | seconds |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['k']} | {r['L']} | {r['codebook']} | {r['bits_per_weight']:.3f} | {r['rel_sq_error']:.4f} | "
              f"{r['bound']:.4f} | {r['rel_sq_error'] / r['bound']:.3f} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
