"""bf16 / f16 / f32 matvec (+ gate/up activation epilogue, split-K) and the prefill path."""

import contextlib
import logging

import pytest
import torch
from kernel_support import DEVICE, rel_err
from linear_kernel_cases import check_all, check_glu, make_op


@contextlib.contextmanager
def runtime_log():
    """The records of the "thin.runtime" logger at INFO, from a handler on that logger itself (not
    caplog's on the root: thin-exec's CLI tests, in the same worker, may stop propagation)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("thin.runtime")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


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


def test_untuned_op_takes_the_default_configuration(monkeypatch):
    """An op with tune=False (the compiler's evaluation sessions) runs its first candidate untimed,
    where a tuned op on the GPU would time them all."""
    from thin.runtime.kernels import tuning

    timed = []
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "_time", lambda op, config, mode, rows=None, cols=None: timed.append(config) or 1.0)

    class Op:
        device, in_features, out_features, tune = torch.device("cuda"), 4096, 4096, False

        def candidates(self, mode, rows=None, cols=None):
            return ["default", "other"]

    assert tuning.choose(Op(), "direct") == "default" and timed == []


def test_a_candidate_that_does_not_compile_is_skipped(monkeypatch):
    """Tuning on the GPU: a launch candidate whose compile raises (Triton's errors, its passes'
    RuntimeError, as Triton 3.6 did for the first mxfp4 tiled prefill) times as infinity with one
    log line naming it, and the fastest candidate that compiles is chosen and cached; a CUDA error
    or any other exception is raised; with no candidate compiling the first is returned and nothing
    cached."""

    from triton.runtime.errors import OutOfResources, PTXASError

    from thin.runtime.kernels import tuning

    failures = {"ptxas": PTXASError("ptxas fatal: Unresolved extern function"),
                "smem": OutOfResources(300000, 232448, "shared memory"),
                "passes": RuntimeError("PassManager::run failed"),
                "cuda": RuntimeError("CUDA error: an illegal memory access was encountered")}
    speeds = {"slow": 3.0, "fast": 2.0}

    def launch_of(config):
        def launch():
            if config in failures:
                raise failures[config]
        return launch

    monkeypatch.setattr(tuning, "median_ms", lambda launch, **timing: launch() or 1.0)
    with runtime_log() as records:
        for name in ("ptxas", "smem", "passes"):
            assert tuning.median_ms_or_inf(launch_of(name), f"candidate {name}", repeats=5) == float("inf")
    assert len(records) == 3 and "candidate passes" in records[-1].getMessage()
    assert "PassManager::run failed" in records[-1].getMessage()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        tuning.median_ms_or_inf(launch_of("cuda"))
    failures["bug"] = ValueError("a launcher's own error")
    with pytest.raises(ValueError):
        tuning.median_ms_or_inf(launch_of("bug"))

    stored = {}
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "median_ms", lambda launch, **timing: launch() or launch.speed)
    monkeypatch.setattr(tuning, "cache_key", lambda op, mode, *_: f"{op.configs}|{mode}")
    monkeypatch.setattr(tuning.TuneCache, "get", classmethod(lambda cls: type(
        "Cache", (), {"lookup": lambda self, key: None, "store": lambda self, key, c: stored.update({key: c})})()))

    def launcher(op, config, mode, rows=None, cols=None):
        launch = launch_of(config)
        launch.speed = speeds.get(config, 1.0)
        return launch

    monkeypatch.setattr(tuning, "_launcher", launcher)

    class Op:
        device, in_features, out_features, tune, format = torch.device("cuda"), 4096, 4096, True, "int4"

        def __init__(self, configs):
            self.configs = configs

        def candidates(self, mode, rows=None, cols=None):
            return self.configs

    with runtime_log() as records:
        assert tuning.choose(Op(["slow", "passes", "fast", "ptxas"]), "direct") == "fast"
    assert list(stored.values()) == ["fast"] and len(records) == 3
    assert "int4 direct passes" in records[0].getMessage()
    assert records[-1].getMessage() == \
        "int4 4096x4096 direct: fast 2000.0 us, the fastest of 4 candidates timed on the one weight"
    stored.clear()
    assert tuning.choose(Op(["smem", "ptxas"]), "glu") == "smem" and stored == {}


def test_evaluation_sessions_do_not_tune(tmp_path):
    from thin.compiler.evaluate import make_evaluator
    from thin.compiler.hf import load_checkpoint

    from hf_tiny import build_model

    build_model("llama", hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=96).save_pretrained(tmp_path)
    source = load_checkpoint(tmp_path)
    session = make_evaluator("cpu", {}).session(source.program)
    taps = [session.executor.lm_head, *vars(session.executor.layers[0].ffn).values(),
            *vars(session.executor.layers[0].attention).values()]
    ops = [tap.op for tap in taps if hasattr(tap, "op")]
    assert len(ops) >= 3 and all(op.tune is False for op in ops)


def test_precompile_launches_each_untuned_candidate_once(monkeypatch):
    """precompile: every candidate of each distinct (shape, format, mode) not yet chosen, launched
    once on the thread pool; cached, untuned and single-candidate uses skipped; a failing launch
    left to choose()."""

    from thin.runtime.kernels import tuning
    from thin.runtime.kernels.common import MatvecConfig

    launched = []

    def launcher(op, config, mode, rows=None, cols=None):
        def launch():
            if config == "broken":
                raise RuntimeError("does not compile")
            launched.append((op.name, mode, config))
        return launch

    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "_launcher", launcher)
    monkeypatch.setattr(tuning, "cache_key", lambda op, mode, *_: f"{op.shape}|{mode}")
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    cached = MatvecConfig(16, 4, 1, 4)
    monkeypatch.setattr(tuning.TuneCache, "get", classmethod(lambda cls: type(
        "Cache", (), {"lookup": lambda self, key: cached if key == "cached|direct" else None})()))

    rows = {"qkv": 6144, "gate_up": 28672, "cached": 1024, "untuned": 2048, "single": 512}

    class Op:
        device, in_features = torch.device("cuda"), 4096

        def __init__(self, name, shape, configs=("a", "b", "broken"), tune=True):
            self.name, self.shape, self.configs, self.tune, self._configs = name, shape, list(configs), tune, {}
            self.out_features = rows[shape]

        def candidates(self, mode, rows=None, cols=None):
            return self.configs

    uses = [(Op("q0", "qkv"), "direct"), (Op("q1", "qkv"), "direct"), (Op("g0", "gate_up"), "glu"),
            (Op("c", "cached", [cached, "x"]), "direct"), (Op("u", "untuned", tune=False), "direct"),
            (Op("s", "single", ["only"]), "direct")]
    assert tuning.precompile(uses, workers=2) == 6
    assert sorted(launched) == [("g0", "glu", "a"), ("g0", "glu", "b"), ("q0", "direct", "a"), ("q0", "direct", "b")]
    # Two weights of one kind are chosen over both in turn: their cached choice has a key of its own.
    cached_in_turn = MatvecConfig(16, 4, 1, 4)
    monkeypatch.setattr(tuning.TuneCache, "get", classmethod(lambda cls: type(
        "Cache", (), {"lookup": lambda self, key: cached_in_turn if key == "qkv|direct in turn" else None})()))
    launched.clear()
    pair = [(Op("q0", "qkv", [cached_in_turn, "x"]), "direct"), (Op("q1", "qkv", [cached_in_turn, "x"]), "direct")]
    assert tuning.precompile(pair, workers=1) == 0
    assert tuning.precompile(pair[:1], workers=1) == 2 and [c for *_, c in launched] == [cached_in_turn, "x"]


def test_compile_threads(monkeypatch):
    from thin.runtime.kernels.tuning import compile_threads

    monkeypatch.setenv("THIN_COMPILE_THREADS", "3")
    assert compile_threads() == 3
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv("THIN_COMPILE_THREADS", bad)
        with pytest.raises(ValueError, match="THIN_COMPILE_THREADS"):
            compile_threads()
    monkeypatch.delenv("THIN_COMPILE_THREADS")
    assert 1 <= compile_threads() <= 16


def test_compile_launches_reports_progress(monkeypatch):
    """The first load's compile says what it does (thin-exec prints the "thin.runtime" log on stderr);
    every launch runs once, a failing one is skipped."""

    from thin.runtime.kernels import tuning

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    ran = []

    def fails():
        raise RuntimeError("does not compile")

    jobs = [("cuda", lambda i=i: ran.append(i)) for i in range(3)] + [("cuda", fails)]
    with runtime_log() as records:
        tuning.compile_launches(jobs, workers=1)
        tuning.compile_launches([], workers=1)
        tuning.compile_launches(jobs[:1], workers=1, report=False)  # the batch engine's, per bucket: silent
    assert ran == [0, 1, 2, 0]
    messages = [r.getMessage() for r in records]
    assert len(messages) == 2 and "compiling 4 kernel launch candidates" in messages[0] and "1 thread" in messages[0]
    assert messages[1].startswith("compiled in ")


def test_thin_exec_prints_runtime_progress(capsys):

    from thin.runtime.cli import report_progress

    log = logging.getLogger("thin.runtime")
    saved = (list(log.handlers), log.level, log.propagate)
    try:
        log.handlers.clear()
        report_progress()
        report_progress()  # once only
        log.info("compiling 3 kernel launch candidates")
        assert capsys.readouterr().err == "thin-exec: compiling 3 kernel launch candidates\n"
    finally:
        log.handlers[:], log.level, log.propagate = saved[0], saved[1], saved[2]


def test_weights_of_one_kind_are_timed_in_turn_and_take_one_choice(monkeypatch):
    """choose_together: the weights of one kind (type, format, shape, mode, prefix) are timed once, each
    timed launch on the next of them (so a weight under L2's size is read from memory as in the decode
    step, not from L2), every one of them takes the fastest, cached under the "in turn" key; a weight alone
    of its kind is timed alone under the plain key; a chosen one is left as it is."""
    from thin.runtime.kernels import tuning

    timed, stored = [], {}
    speeds = {"slow": 2.0, "fast": 1.0}
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "cache_key", lambda op, mode, *_: f"{op.out_features}|{mode}")
    monkeypatch.setattr(tuning.TuneCache, "get", classmethod(lambda cls: type(
        "Cache", (), {"lookup": lambda self, key: None, "store": lambda self, key, c: stored.update({key: c})})()))

    def time(op, config, mode, rows=None, cols=None, ops=()):
        timed.append((op.name, config, cols, [o.name for o in ops]))
        return speeds[config]

    monkeypatch.setattr(tuning, "_time", time)

    class Op:
        device, in_features, tune, format = torch.device("cuda"), 14336, True, "int4"

        def __init__(self, name, out_features=4096):
            self.name, self.out_features, self._configs = name, out_features, {}

        def candidates(self, mode, rows=None, cols=None):
            return ["slow", "fast"]

    downs = [Op(f"down{i}") for i in range(3)]
    lone, chosen = Op("lone", 2048), Op("chosen", 2048)
    chosen._configs[("partial", None, 7168)] = "kept"
    uses = [(op, "partial", None, 7168) for op in downs + [lone, chosen]] + [(downs[0], "partial", None, 7168)]
    tuning.choose_together(uses)
    assert timed == [("down0", c, 7168, ["down0", "down1", "down2"]) for c in ("slow", "fast")] + \
        [("lone", c, 7168, []) for c in ("slow", "fast")]
    assert all(op._configs == {("partial", None, 7168): "fast"} for op in downs + [lone])
    assert chosen._configs == {("partial", None, 7168): "kept"}
    assert stored == {"4096|partial cols 7168 in turn": "fast", "2048|partial cols 7168": "fast"}


def test_a_launcher_over_several_weights_launches_each_in_turn():
    from thin.runtime.kernels import tuning
    from thin.runtime.kernels.common import MatvecConfig

    ran = []

    class Op:
        device, dtype, in_features, out_features = torch.device("cpu"), torch.float32, 64, 32

        def __init__(self, name):
            self.name = name

        def matvec_shape(self, mode, rows=None, cols=None):
            return self.out_features, self.in_features if cols is None else cols

        def _matvec(self, x, out, config, act, partial, rows, cols):
            ran.append((self.name, x.shape[0], tuple(out.shape), partial, cols))

    ops = [Op("a"), Op("b"), Op("c")]
    launch = tuning._launcher(ops[0], MatvecConfig(4, 32, 2, 1), "partial", None, 32, ops=ops)
    for _ in range(5):
        launch()
    assert [name for name, *_ in ran] == ["a", "b", "c", "a", "b"]
    assert {tuple(rest) for _, *rest in ran} == {(32, (2, 32), True, 32)}


def test_cache_key_names_the_candidates(monkeypatch):
    """A choice stored in the cache of launch configurations is keyed by the candidates it was timed among:
    a thin with other candidates (a new kernel variant) times them again instead of reusing the old pick."""
    from thin.runtime.kernels import tuning
    from thin.runtime.kernels.common import MatvecConfig

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")

    class Op:
        p, format, out_features, in_features, dtype, device = {"group_size": 128}, "int4", 64, 128, torch.bfloat16, None

    old = [MatvecConfig(4, 256, 1, 2), MatvecConfig(8, 256, 1, 2)]
    new = old + [MatvecConfig(4, 256, 1, 2, ahead=2)]
    key = tuning.cache_key(Op(), "direct", old)
    assert key == tuning.cache_key(Op(), "direct", list(old))
    assert key != tuning.cache_key(Op(), "direct", new)
    assert key != tuning.cache_key(Op(), "partial", old)
