"""Scratch A/B, one way per fresh process: WAY=attn (shipped) | ofull (o also a dependent, its finishing
matvec loading its whole share of the weight before the wait) | o (o a dependent, tuned config)."""
import logging, os, sys
from dataclasses import replace
from thin.runtime import engine as E
from thin.runtime.kernels.dependent import ATTENTION
way = os.environ["WAY"]
orig = E.DecodeEngine.__init__
def init(self, ex, **kw):
    kw["dependent_launch"] = ATTENTION if way == "attn" else ATTENTION | {"o"}
    orig(self, ex, **kw)
E.DecodeEngine.__init__ = init
warm = E.DecodeEngine.warm_up
def warm_up(self):
    warm(self)
    if way == "ofull":
        for layer in self.ex.layers:
            op = layer.attention.o
            c = op.finish_config
            if c is not None:
                whole = op.in_features if op.format != "int4" else c.chunk
                op.finish_config = replace(c, chunk=whole, split=1, stages=0, ahead=0 if op.format != "int4" else c.ahead)
        print("o finish", c, "->", op.finish_config, flush=True)
E.DecodeEngine.warm_up = warm_up
from thin.runtime import load, bench
m = load(sys.argv[1], device="cuda", context=640)
r = bench.run(m, prompt_len=512, new_tokens=128, runs=5)
print(f"RESULT {os.path.basename(sys.argv[1])} {way}: {r.decode_tokens_per_second:.1f} tok/s ({r.decode_min:.1f}-{r.decode_max:.1f}) "
      f"copy {r.bandwidth_bytes_per_second/1e9:.0f} GB/s {100*r.roofline_fraction:.1f}%", flush=True)
