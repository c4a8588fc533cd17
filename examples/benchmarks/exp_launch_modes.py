"""Experiment (BENCHMARKS Round 19): the int4 decode step with other launch modes, in one process.

    python3 examples/benchmarks/exp_launch_modes.py FILE.thin base,odep,odep_me,... [ROUNDS]

A way is names joined by "_": `Xdep` launches section X (o, gu = gate/up, down, qkv, lm) as a programmatic
dependent besides the attention's; `me` lets the merge release its dependents before its wait, `Xearly` section X
(dependent.py level 4); `old` runs the grouped-int matvec kernel of OLD_SOURCE (a copy of an earlier
grouped_int.py, e.g. `git show REV:runtime/kernels/grouped_int.py > /tmp/grouped_int_old.py`); `norope` runs the
split kernel without RoPE (wrong numbers: a bound). Each way: 128 greedy tokens after a 512-token prompt under the
CUDA graph, median of 3, the ways taking turns; prints tok/s, us a layer against the first way, and whether the
tokens and the positions attended match.
"""
import importlib.util
import os
import statistics
import sys
import time

import torch

import thin.runtime.kernels.attention_append as aa
import thin.runtime.kernels.grouped_int as gi
from thin.runtime import load
from thin.runtime.kernels.dependent import ATTENTION
from thin.runtime.sampling import GenerationOptions

path = sys.argv[1]
ways = sys.argv[2].split(",")
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
model = load(path, device="cuda", context=640)
engine = model.engine
P, N = 512, 128
prompt = torch.randint(0, model.ir.vocab_size, (P,), generator=torch.Generator().manual_seed(0))
options = GenerationOptions(max_new_tokens=N, stop_token_ids=())
sampler = engine.sampler(options)
OLD_SOURCE = os.environ.get("OLD_SOURCE", "/tmp/grouped_int_old.py")
NEW_MATVEC = OLD_MATVEC = gi._matvec_kernel
if "old" in sys.argv[2]:
    spec = importlib.util.spec_from_file_location("thin.runtime.kernels.grouped_int_old", OLD_SOURCE)
    gi_old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gi_old)
    OLD_MATVEC = gi_old._matvec_kernel
ORIG_APPEND = aa.append_attend
SECT = {"o": "o", "gu": "gate/up + act", "down": "down", "qkv": "qkv", "lm": "lm head"}

def setway(w):
    parts = w.split("_")
    dep, early = set(ATTENTION), set()
    for p in parts:
        if p.endswith("dep") and p[:-3] in SECT:
            dep.add(SECT[p[:-3]])
        if p == "me":
            early.add("merge")
        if p.endswith("early") and p[:-5] in SECT:
            early.add(SECT[p[:-5]])
    gi._matvec_kernel = OLD_MATVEC if "old" in parts else NEW_MATVEC
    aa.append_attend = ORIG_APPEND
    if "norope" in parts:
        aa.append_attend = lambda *a, rope=None, **k: ORIG_APPEND(*a, rope=None, **k)
    if "all" in parts:
        dep = True
    engine._dependent = frozenset(dep) if dep is not True else True
    engine._early = frozenset(early)

def measure(runs=3):
    cache = engine.new_cache(P + N)
    out, toks = [], None
    for i in range(runs + 1):
        cache.reset()
        cache.reserve(P + N)
        engine.start(cache, prompt.tolist(), options)
        engine.prefill(cache, prompt, sampler)
        first = int(engine.token)
        torch.cuda.synchronize()
        t = time.perf_counter()
        toks = [first] + list(engine.decode_n_tokens(cache, N - 1, sampler, graph=True))
        d = time.perf_counter() - t
        if i:
            out.append((N - 1) / d)
    att = cache.attended[1:N].tolist()
    ok = att == [P + i for i in range(1, N)]
    return statistics.median(out), toks, ok

res = {w: [] for w in ways}
info = {}
for r in range(rounds):
    for w in ways:
        setway(w)
        m, toks, ok = measure()
        res[w].append(m)
        info[w] = (toks, ok)
        print(f"round {r} {w}: {m:.1f} attended-ok {ok}", file=sys.stderr, flush=True)
base = statistics.median(res[ways[0]])
print("| way | tok/s | step us | vs first (us/layer) | tokens as first | positions ok |")
for w in ways:
    m = statistics.median(res[w])
    same = info[w][0] == info[ways[0]][0]
    print(f"| {w} | {m:.1f} | {1e6/m:.1f} | {(1e6/m - 1e6/base)/32:+.2f} | {same} | {info[w][1]} |")
