"""Launch choices tried in the whole decode step: for each kind of weight whose configuration the tuner chose (one
entry of the launch-choice cache), the candidates nearest its choice, each put into a copy of the cache and run by
`thin-exec bench` in a fresh process.

    python examples/benchmarks/tune_in_step.py MODEL.thin [--near 3] [--only 6144x4096,partial] [--runs 3]
        [--prompt-len 512] [--gen 128]

Why: the tuner times each kind of weight alone (over its layers' weights in turn), while in the captured step the
launches overlap and wait on one another; a choice the alone timing cannot see may run the step faster, as the
attention's 8 warps did (BENCHMARKS Round 23). The cache is THIN_CACHE_DIR's (filled first, by a plain bench, if
empty); each try copies it into a folder of its own with one entry changed, so the cache itself is left as it was.
`--only` keeps the entries whose key holds any of the given strings (a shape "NxK", a mode). Prints the baseline
before and after the tries and one row a try: the entry (shape and mode), the configuration, tok/s and its change.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FIELDS = ("block_n", "chunk", "split", "num_warps", "packed", "ahead", "stages")


def distance(a: dict, b: dict) -> float:
    """How far two configurations (MatvecConfig fields) are apart: octaves of each size, one a flag or step."""
    out = 0.0
    for field in FIELDS:
        x, y = a.get(field), b.get(field)
        if field in ("block_n", "chunk", "split", "num_warps"):
            out += abs(math.log2(max(x, 1)) - math.log2(max(y, 1)))
        else:
            out += abs(int(x or 0) - int(y or 0))
    return out


def nearest(chosen: dict, candidates: list[dict], count: int) -> list[dict]:
    """The `count` candidates nearest `chosen` (itself left out), nearest first, ties in the candidates' order."""
    others = [c for c in candidates if c != chosen]
    return sorted(others, key=lambda c: distance(chosen, c))[:count]


def entry_name(key: str) -> str:
    """A cache key's shape and mode ("6144x4096 direct in turn")."""
    parts = key.split("|")
    return f"{parts[3]} {parts[5]}" if len(parts) > 5 else key


def with_entry(cache_file: Path, key: str, config: dict, folder: Path) -> Path:
    """A copy of the cache's folder (every other choice kept) in `folder` with `key`'s configuration replaced by
    `config`; returns the folder."""
    shutil.copytree(cache_file.parent, folder)
    entries = json.loads(cache_file.read_text())
    entries[key] = config
    (folder / cache_file.name).write_text(json.dumps(entries, indent=1, sort_keys=True))
    return folder


def _list_candidates(model: str, context: int) -> None:
    """Child: load `model` on the GPU (its warm-up reads or makes every choice) and print, as one JSON line, each
    choice's cache key and the candidates it was chosen from."""
    from dataclasses import asdict

    import thin.runtime.kernels.tuning as tuning
    from thin.runtime import load

    seen: dict[str, list] = {}
    key_of = tuning.cache_key

    def recording(op, mode, candidates=()):
        key = key_of(op, mode, candidates)
        seen[key] = [asdict(c) for c in candidates]
        return key

    tuning.cache_key = recording
    load(model, device="cuda", context=context)
    print(json.dumps(seen))


def fresh_bench(command: list[str], env: dict | None = None) -> dict | str:
    """The JSON result of a process that runs `thin-exec bench --json` (`command`), or the last lines of its output
    where it gave none."""
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return " ".join((done.stdout + done.stderr).strip().splitlines()[-2:])[:300]
    return json.loads(lines[-1])


def rate(got: dict) -> str:
    """A bench result's decode tok/s and its spread: "637.8 (636.9-637.9)"."""
    return f"{got['decode_tokens_per_second']:.1f} ({got['decode_min']:.1f}-{got['decode_max']:.1f})"


def checks(got: dict) -> str:
    """A bench result's checks: "ok" where all passed, else each."""
    return "ok" if all(v == "ok" for v in got["checks"].values()) else str(got["checks"])


def _bench(bench_args: list[str], cache_dir: Path) -> dict | str:
    """`thin-exec bench --json` in a fresh process with `cache_dir` as THIN_CACHE_DIR."""
    return fresh_bench([sys.executable, "-m", "thin.runtime.cli", "bench", *bench_args, "--json"],
                       dict(os.environ, THIN_CACHE_DIR=str(cache_dir)))


def _row(name: str, config: str, got: dict | str, base: float | None) -> str:
    if isinstance(got, str):
        return f"| {name} | {config} | failed: {got} | | |"
    change = f"{100 * (got['decode_tokens_per_second'] / base - 1):+.1f}%" if base else ""
    return f"| {name} | {config} | {rate(got)} | {change} | {checks(got)} |"


def main() -> None:
    if sys.argv[1:2] == ["--list"]:
        return _list_candidates(sys.argv[2], int(sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a compiled .thin artifact")
    ap.add_argument("--near", type=int, default=3, help="candidates tried an entry, the nearest to its choice")
    ap.add_argument("--only", default="", help="entries whose key holds any of these, comma-separated")
    ap.add_argument("--runs", type=int, default=3, help="timed runs a process (thin-exec bench --runs)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    args = ap.parse_args()
    cache_dir = Path(os.environ.get("THIN_CACHE_DIR") or Path.home() / ".cache" / "thin")
    cache_file = cache_dir / "kernel-configs.json"
    bench_args = [args.model, "--runs", str(args.runs), "--prompt-len", str(args.prompt_len), "--gen", str(args.gen)]
    print("| entry | configuration | decode tok/s (min-max) | change | checks |\n| --- | --- | ---: | ---: | --- |")
    first = _bench(bench_args, cache_dir)  # fills the cache where it is empty
    print(_row("baseline", "the tuner's", first, None), flush=True)
    base = None if isinstance(first, str) else first["decode_tokens_per_second"]
    listed = subprocess.run([sys.executable, os.path.abspath(__file__), "--list", args.model,
                             str(args.prompt_len + args.gen)], capture_output=True, text=True,
                            env=dict(os.environ, THIN_CACHE_DIR=str(cache_dir)))
    lines = [line for line in listed.stdout.splitlines() if line.startswith("{")]
    if listed.returncode != 0 or not lines or not cache_file.exists():
        sys.exit(f"tune_in_step: could not list the choices: {(listed.stderr.strip().splitlines() or [''])[-1]}")
    candidates = json.loads(lines[-1])
    chosen = json.loads(cache_file.read_text())
    only = [s for s in args.only.split(",") if s]
    work = Path(tempfile.mkdtemp(prefix="thin-tune-in-step-"))
    try:
        for i, (key, options) in enumerate(sorted(candidates.items())):
            if key not in chosen or not options or "block_n" not in options[0] or (
                    only and not any(s in key for s in only)):
                continue  # not chosen, not a matvec's configuration, or not asked for
            for j, config in enumerate(nearest(chosen[key], options, args.near)):
                folder = with_entry(cache_file, key, config, work / f"{i}-{j}")
                shown = ", ".join(f"{f} {config[f]}" for f in FIELDS if config.get(f) != chosen[key].get(f))
                print(_row(entry_name(key), shown, _bench(bench_args, folder), base), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(_row("baseline, again", "the tuner's", _bench(bench_args, cache_dir), base), flush=True)


if __name__ == "__main__":
    main()
