"""`thinc`: compile a Hugging Face checkpoint to a .thin file, and inspect, verify or key artifacts."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="thin's compiler: Hugging Face checkpoint in, one verified .thin file out.")

_FUSE_HELP = "Keep q/k/v and gate/up as separate projections (default: fuse them)."
_QUANT_HELP = ("Store every linear weight in FORMAT, round-to-nearest: fp8_e4m3, int8, int3..int6, mxfp4, "
               "q2, q1 (`thinc formats` lists them). Embeddings and norms stay as stored.")
_GROUP_HELP = "Group size along the input dimension for formats with groups (default: the format's)."
_ASYM_HELP = "Grouped integer formats: store a per-group offset as well as a scale."
_KEEP_HEAD_HELP = "Leave an untied LM head as stored when quantizing."
_VRAM_HELP = ("Fit everything the runtime holds on the GPU (weights, KV cache for --ctx tokens, activations, "
              "workspace, runtime overhead) in SIZE: 8G, 7.5GiB, 12000M. The planner picks each tensor's format.")
_BPW_HELP = "Weights (every tensor, scales included) at most B bits per parameter; the planner picks the formats."
_CTX_HELP = "Tokens of KV cache the --vram ledger reserves (default 4096)."
_CALIB_HELP = "Calibration text: a text file, or JSON lines with a \"text\" field (default: the stdlib sample)."
_CALIB_TOKENS_HELP = "Calibration tokens run through the model (default 16384)."
_METHOD_HELP = "gptq (error-compensating, calibrated; the default with a budget) or rtn (round to nearest)."
_MAX_KLD_HELP = ("Certificate gate: mean KL divergence on held-out prompts at most X; below it the most "
                 "sensitive tensors are promoted and the plan re-solved. Default gate: 1.0 (broken compiles).")
_UNCERTIFIED_HELP = "Write the artifact even when the gate fails; its certificate says FAILED."
_DEVICE_HELP = "Where calibration and certification run: cuda or cpu (default: cuda when available)."
_MAP_HELP = "Draw the format of every tensor, layer by layer, into FILE (.svg or .png)."
_TIE_HELP = "Give q/k/v and gate/up one format each so they fuse into one matmul (speed over quality)."
_EXPERT_FORMATS_HELP = ("Routed experts take only these formats (any of their group sizes), e.g. q2, q1,q2 or trellis "
                        "(a 2-3 bit trellis code for experts only; slow to encode); the planner spends the rest of the "
                        "budget on everything else. Needs a budget and a MoE model.")
_MAX_EXPERT_FORMATS_HELP = ("At most N formats (each with its parameters) among a layer's routed experts, per "
                            "projection (gate/up, down): the GPU runs one launch per format, so fewer are faster; "
                            "the planner re-solves the budget with them. Needs a budget and a MoE model.")
_FORMATS_HELP = ("The planner picks among only these formats (any of their parameters) and each tensor's stored one, "
                 "e.g. int4,q2. Needs a budget. trellis is for routed experts only: --expert-formats.")
_STREAM_HELP = ("With --vram: the budget bounds the GPU only, and routed experts that do not fit it stay in host "
               "memory (the least routed by the calibration text), streamed through a cache of GPU slots. The "
               "precision comes from --bpw or --quant (or stays as stored). Calibrates (runs the model).")
_LEVELS_HELP = ("Elastic FFN: order each FFN's channels by importance in 128-channel superblocks and certify a "
                "cheaper model per keep fraction F (share of FFN bytes read), e.g. 1,0.875,0.75,0.5 or 5/6; "
                "thin-exec --ffn-keep F runs one. Calibrates and certifies (runs the model).")


# Options several commands take, declared once (thinc compile, key, plan).
NoFuse = Annotated[bool, typer.Option("--no-fuse", help=_FUSE_HELP)]
Quant = Annotated[str | None, typer.Option("--quant", metavar="FORMAT", help=_QUANT_HELP)]
GroupSize = Annotated[int | None, typer.Option("--group-size", metavar="N", help=_GROUP_HELP)]
Asymmetric = Annotated[bool, typer.Option("--asymmetric", help=_ASYM_HELP)]
KeepLmHead = Annotated[bool, typer.Option("--keep-lm-head", help=_KEEP_HEAD_HELP)]
Vram = Annotated[str | None, typer.Option("--vram", metavar="SIZE", help=_VRAM_HELP)]
Bpw = Annotated[float | None, typer.Option("--bpw", metavar="B", help=_BPW_HELP)]
Ctx = Annotated[int | None, typer.Option("--ctx", metavar="N", help=_CTX_HELP)]
Calib = Annotated[Path | None, typer.Option("--calib", metavar="FILE", help=_CALIB_HELP)]
CalibTokens = Annotated[int | None, typer.Option("--calib-tokens", metavar="N", help=_CALIB_TOKENS_HELP)]
Method = Annotated[str | None, typer.Option("--method", metavar="gptq|rtn", help=_METHOD_HELP)]
MaxKld = Annotated[float | None, typer.Option("--max-kld", metavar="X", help=_MAX_KLD_HELP)]
AllowUncertified = Annotated[bool, typer.Option("--allow-uncertified", help=_UNCERTIFIED_HELP)]
Device = Annotated[str | None, typer.Option("--device", metavar="cuda|cpu", help=_DEVICE_HELP)]
TieFused = Annotated[bool, typer.Option("--tie-fused", help=_TIE_HELP)]
FfnLevels = Annotated[str | None, typer.Option("--ffn-levels", metavar="F[,F...]", help=_LEVELS_HELP)]
StreamExperts = Annotated[bool, typer.Option("--stream-experts", help=_STREAM_HELP)]
ExpertFormats = Annotated[str | None, typer.Option("--expert-formats", metavar="FORMAT[,FORMAT...]",
                                                   help=_EXPERT_FORMATS_HELP)]
MaxExpertFormats = Annotated[int | None, typer.Option("--max-expert-formats", metavar="N",
                                                     help=_MAX_EXPERT_FORMATS_HELP)]
Formats = Annotated[str | None, typer.Option("--formats", metavar="FORMAT[,FORMAT...]", help=_FORMATS_HELP)]


def _config(no_fuse: bool, quant: str | None, group_size: int | None, asymmetric: bool, keep_lm_head: bool,
            **budget):
    from .config import CompileConfig

    return CompileConfig.from_options(fuse_projections=not no_fuse, quant=quant, group_size=group_size,
                                      asymmetric=asymmetric, keep_lm_head=keep_lm_head, **budget)


def _budget(vram, bpw, ctx, calib, calib_tokens, method, max_kld, allow_uncertified, device, tie_fused,
            expert_formats=None, formats=None, max_expert_formats=None) -> dict:
    """The planner, calibration and certificate flags as CompileConfig's flat options."""
    return {"vram": vram, "bpw": bpw, "ctx": ctx, "calib_source": "file" if calib is not None else None,
            "calib_tokens": calib_tokens, "method": method, "max_kld": max_kld,
            "allow_uncertified": allow_uncertified, "device": device, "tie_fused": tie_fused,
            "expert_formats": expert_formats, "formats": formats, "max_expert_formats": max_expert_formats}


def _fail(message: str, code: int = 1) -> None:
    from thin.ir import one_line

    typer.echo(f"thinc: error: {terminal_safe(one_line(message))}", err=True)
    raise typer.Exit(code)


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the program is so that the writer's cleanup runs as for Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum, frame):
    raise _Terminated(signum)


def _guard(fn, writes: bool = False):
    """Turn every expected failure into one line on stderr and a non-zero exit; never a traceback.

    Expected: thin's own errors (each layer's base derives from ThinError), compile option errors,
    the operating system's refusals and running out of memory. Anything else is a bug and keeps
    its traceback. `writes`: the command writes an output path, so an interruption says that nothing
    was written there."""
    from thin.ir import ThinError

    from .config import CompileOptionError

    try:
        return fn()
    except (ThinError, CompileOptionError, OSError, MemoryError) as e:
        _fail(e)
    except _Terminated as e:
        _fail(f"terminated by {signal.Signals(e.signum).name}{_NOTHING_WRITTEN if writes else ''}", 128 + e.signum)
    except KeyboardInterrupt:
        _fail(f"interrupted{_NOTHING_WRITTEN if writes else ''}", 130)


_NOTHING_WRITTEN = "; nothing was written at the output path"


def _json_bytes(value):
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    raise TypeError(f"{type(value).__name__} is not plain data")


def terminal_safe(text: str) -> str:
    """`text` with control and bidirectional-override characters escaped, so a string read from a file
    cannot move the cursor, retitle the terminal or reorder what is shown."""
    from thin.artifacts import printable

    return printable(text)


class _StageProgress:
    """Prints a line per stage; on a terminal, tensor counts update in place. A counted stage's line
    ends with its wall time once it is done (from its first report to its last)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.stage = None
        self.started: dict[str, float] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.quiet:
            return
        if total:
            now = time.perf_counter()
            started = self.started.setdefault(stage, now)
            took = f" ({now - started:.1f}s)" if done == total else ""
            if self.tty:
                typer.echo(f"\r  {stage} {done}/{total}{took}", err=True, nl=done == total)
            elif done == total:
                typer.echo(f"  {stage} {done}/{total}{took}", err=True)
            if done == total:
                del self.started[stage]  # a stage that runs again (promotion rounds) is timed again
            return
        if stage != self.stage:
            typer.echo(f"  {stage}", err=True)
        self.stage = stage


@app.command()
def compile(
    model_dir: Path = typer.Argument(..., metavar="MODEL_DIR",
                                     help="Hugging Face model folder (config.json + *.safetensors)."),
    # A str, not a Path: Path("dir/") drops the trailing slash that says a folder was meant.
    output: str = typer.Option(..., "-o", "--output", help="Path of the .thin file to write."),
    dump_ir: Path | None = typer.Option(None, "--dump-ir", help="Write the IR text after each pass here."),
    cache_dir: Path | None = typer.Option(
        None, "--cache-dir", help="Reuse DIR/<key>.thin when present; store new builds there."),
    no_fuse: NoFuse = False,
    quant: Quant = None,
    group_size: GroupSize = None,
    asymmetric: Asymmetric = False,
    keep_lm_head: KeepLmHead = False,
    vram: Vram = None,
    bpw: Bpw = None,
    ctx: Ctx = None,
    calib: Calib = None,
    calib_tokens: CalibTokens = None,
    method: Method = None,
    max_kld: MaxKld = None,
    allow_uncertified: AllowUncertified = False,
    device: Device = None,
    tie_fused: TieFused = False,
    expert_formats: ExpertFormats = None,
    max_expert_formats: MaxExpertFormats = None,
    formats: Formats = None,
    ffn_levels: FfnLevels = None,
    stream_experts: StreamExperts = False,
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print only the summary."),
):
    """Compile MODEL_DIR into one .thin file. Without --vram, --bpw or --quant every tensor keeps its stored
    precision; with a budget the planner picks each tensor's format and a certificate measures the result."""
    from thin.artifacts import human_size

    from .build import build

    def run():
        config = _config(no_fuse, quant, group_size, asymmetric, keep_lm_head, ffn_levels=ffn_levels,
                         stream_experts=stream_experts, **_budget(
            vram, bpw, ctx, calib, calib_tokens, method, max_kld, allow_uncertified, device, tie_fused,
            expert_formats, formats, max_expert_formats))
        return build(model_dir, output, config, cache_dir=cache_dir, dump_ir=dump_ir,
                     progress=_StageProgress(quiet), calib=calib)

    report = _guard(run, writes=True)
    if report.cache_hit:
        typer.echo(f"cache hit: {cache_dir}/{report.key}.thin", err=True)
    elif report.cache_note:
        typer.echo(terminal_safe(report.cache_note), err=True)
    if not report.has_tokenizer:
        typer.echo(f"warning: {terminal_safe(str(model_dir))} has no tokenizer.json, so the artifact has no "
                   "tokenizer: thin-exec cannot take text, only token ids from Python", err=True)
    if ctx is not None and report.memory is not None and report.memory["ctx"] < ctx:
        typer.echo(f"note: the model takes at most {report.memory['ctx']} positions, so the ledger reserves KV "
                   f"cache for {report.memory['ctx']} tokens, not --ctx {ctx}", err=True)
    mix = ", ".join(f"{k} x{v}" for k, v in sorted(report.formats.items()))
    rows = [
        ("output", terminal_safe(str(report.output))),
        ("parameters", f"{report.parameters:,}"),
        ("tensors", f"{report.tensors} ({mix})"),
        ("tensor bytes", f"{human_size(report.tensor_bytes)} ({8 * report.tensor_bytes / report.parameters:.2f} "
                         "bits per weight)"),
        ("file bytes", human_size(report.file_bytes)),
        *_quality_rows(report),
        ("key", report.key[:16]),
        ("time", " ".join(f"{k} {v:.2f}s" for k, v in report.seconds.items())
         + f" | total {sum(report.seconds.values()):.2f}s"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        typer.echo(f"{k:<{width}}  {v}")


@app.command()
def inspect(
    file: Path = typer.Argument(..., metavar="FILE.thin", help="A .thin file."),
    as_json: bool = typer.Option(False, "--json", help="Print the description as JSON."),
    ir: bool = typer.Option(False, "--ir", help="Print the model's IR as text."),
    # A str, not a Path, as -o: Path("map.svg/") drops the slash that says a folder was meant.
    precision_map: str | None = typer.Option(None, "--precision-map", metavar="FILE", help=_MAP_HELP),
):
    """Describe an artifact: sections and sizes, tensors by format, key, provenance, certificate, memory ledger."""
    from thin.artifacts import describe, missing_artifact, open_artifact, render_description
    from thin.ir import format_ir

    from .build import check_output
    from .precision_map import write_precision_map

    def run():
        if why := missing_artifact(file):
            raise OSError(why)
        if precision_map is not None:
            # The same refusals as -o: never the artifact itself, a device, a folder or a missing folder.
            check_output(precision_map, [file])  # raises on "map.svg/"; a Path from here on
        with open_artifact(file) as art:
            if precision_map is not None:
                try:
                    write_precision_map(art, precision_map)
                except ValueError as e:
                    raise OSError(str(e)) from None
            return describe(art), format_ir(art.model)

    desc, ir_text = _guard(run, writes=precision_map is not None)
    if as_json:
        # Sections may hold bytes (plain data allows them): shown as hex. ensure_ascii (the default)
        # escapes every control character, so the JSON is safe on a terminal too.
        typer.echo(json.dumps(desc, indent=2, sort_keys=True, default=_json_bytes))
    else:
        typer.echo(render_description(desc))
    if ir:
        typer.echo(ir_text, nl=False)


@app.command()
def verify(file: Path = typer.Argument(..., metavar="FILE.thin", help="A .thin file.")):
    """Check the header and every tensor checksum; exit 0 when intact, 1 naming the bad tensors."""
    from thin.artifacts import missing_artifact, verify_file

    if why := missing_artifact(file):
        _fail(why)
    bad = _guard(lambda: verify_file(file))
    if bad:
        _fail(f"{file}: {len(bad)} tensor(s) fail their checksum: {', '.join(bad[:10])}; "
              f"the file is damaged: recompile or fetch it again")
    typer.echo(f"{terminal_safe(str(file))}: ok")


@app.command()
def key(
    model_dir: Path = typer.Argument(..., metavar="MODEL_DIR", help="Hugging Face model folder."),
    no_fuse: NoFuse = False,
    quant: Quant = None,
    group_size: GroupSize = None,
    asymmetric: Asymmetric = False,
    keep_lm_head: KeepLmHead = False,
    vram: Vram = None,
    bpw: Bpw = None,
    ctx: Ctx = None,
    calib: Calib = None,
    calib_tokens: CalibTokens = None,
    method: Method = None,
    max_kld: MaxKld = None,
    allow_uncertified: AllowUncertified = False,
    device: Device = None,
    tie_fused: TieFused = False,
    expert_formats: ExpertFormats = None,
    max_expert_formats: MaxExpertFormats = None,
    formats: Formats = None,
    ffn_levels: FfnLevels = None,
    stream_experts: StreamExperts = False,
):
    """Print the cache key `thinc compile` would give MODEL_DIR with these options (calibration text,
    planner options and certificate thresholds included)."""
    from thin.passes import PassContext, run_passes

    from .build import input_key
    from .hf import load_checkpoint
    from .hf.inventory import take_inventory
    from .inputs import evaluation_texts
    from .pipeline import check_passes

    def run():
        inventory = take_inventory(model_dir)  # the same list of files a compile reads and hashes
        config = _config(no_fuse, quant, group_size, asymmetric, keep_lm_head, ffn_levels=ffn_levels,
                         stream_experts=stream_experts, **_budget(
            vram, bpw, ctx, calib, calib_tokens, method, max_kld, allow_uncertified, device, tie_fused,
            expert_formats, formats, max_expert_formats))
        # A compile's check passes (budget, experts to stream, FFN levels) refuse here as there.
        source = load_checkpoint(model_dir)
        run_passes(source.program, check_passes(config), PassContext(config=config, source=source.program))
        inputs = {name: inventory.folder.path / name for name in inventory.names()}
        return input_key(inputs, inventory.folder.identities, config, *evaluation_texts(config, calib))

    typer.echo(_guard(run))


def _budget_list(values: str | None, parse, flag: str) -> list:
    """The budgets of a comma-separated --vram or --bpw; OSError (one line) for an entry that does not parse, an
    empty one ("4," is a typo, not one budget) or one given twice (it would be planned twice)."""
    if not values:
        return []
    entries = [v.strip() for v in values.split(",")]
    try:
        if "" in entries:
            raise ValueError
        budgets = [parse(v) for v in entries]
    except ValueError:
        example = "4G,6G" if flag == "--vram" else "3.6,5"
        raise OSError(f"{flag} takes a comma-separated list such as {example}; got {values!r}") from None
    twice = next((v for i, v in enumerate(budgets) if v in budgets[:i]), None)
    if twice is not None:
        raise OSError(f"{flag} lists {twice} twice; give each budget once")
    return budgets


@app.command()
def plan(
    model_dir: Path = typer.Argument(..., metavar="MODEL_DIR", help="Hugging Face model folder."),
    vram: str | None = typer.Option(None, "--vram", metavar="SIZE[,SIZE...]", help="Budgets such as 4G,6G,8G."),
    bpw: str | None = typer.Option(None, "--bpw", metavar="B[,B...]", help="Bits-per-weight budgets such as 3.6,5."),
    ctx: Ctx = None,
    calib: Calib = None,
    calib_tokens: CalibTokens = None,
    method: Method = None,
    device: Device = None,
    tie_fused: TieFused = False,
    expert_formats: ExpertFormats = None,
    max_expert_formats: MaxExpertFormats = None,
    formats: Formats = None,
    no_fuse: NoFuse = False,
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print only the table."),
):
    """Print, per budget, the memory ledger and the predicted quality of the plan; writes nothing."""
    from .plan import plan_budgets, render_plan

    def run():
        budgets = [{"vram": v} for v in _budget_list(vram, str, "--vram")]
        budgets += [{"bpw": b} for b in _budget_list(bpw, float, "--bpw")]
        return plan_budgets(model_dir, budgets, progress=_StageProgress(quiet), calib=calib, ctx=ctx,
                            calib_tokens=calib_tokens, method=method, device=device, tie_fused=tie_fused,
                            expert_formats=expert_formats, formats=formats,
                            max_expert_formats=max_expert_formats, fuse_projections=not no_fuse)

    result = _guard(run)
    typer.echo(json.dumps(result, indent=2, sort_keys=True) if as_json else render_plan(result))


@app.command("formats")
def formats_command():
    """List the storage formats, their parameters and bits per weight (on a 4096x4096 weight)."""
    from thin.ir import formats

    rows = [("format", "params (default)", "bits/weight", "description")]
    for fmt in formats.FORMATS.values():
        params = ", ".join(f"{k} {'/'.join(map(str, p.choices))} ({p.default})" for k, p in fmt.params.items())
        only = " (routed experts only: --expert-formats)" if fmt.experts_only else ""
        rows.append((fmt.name, params or "-", f"{fmt.bits_per_weight((4096, 4096)):.3f}",
                     fmt.description.splitlines()[0] + only))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])


def _quality_rows(report) -> list[tuple[str, str]]:
    """Summary rows for the plan, the memory ledger and the certificate, when the compile made them."""
    from thin.artifacts import certificate_summary, human_size
    from thin.artifacts.describe import residency_summary

    from .plan import describe_experts

    rows = []
    plan = (report.precision_plan or {}).get("plan")
    if plan is not None:
        budget = plan["budget"]
        asked = " and ".join(x for x in (f"--bpw {budget['bpw']}" if budget["bpw"] is not None else "",
                                         f"--vram {human_size(budget['vram'])}" if budget["vram"] else "") if x)
        experts = f", {describe_experts(plan['experts'])}" if plan.get("experts") else ""
        rows.append(("plan", f"{asked}: {plan['bits_per_weight']:.3f} bits per weight{experts}, predicted KLD "
                             f"{plan['predicted_kld']:.5f} ({plan['method']})"))
    if report.memory is not None:
        lines = ", ".join(f"{k.replace('_', ' ')} {human_size(v)}" for k, v in report.memory["lines"].items())
        budget = f" of {human_size(report.memory['budget'])}" if report.memory.get("budget") else ""
        rows.append(("memory", f"{human_size(report.memory['total'])}{budget} at --ctx {report.memory['ctx']} "
                               f"({lines})"))
        residency = report.memory.get("residency")
        if residency:
            rows.append(("residency", residency_summary(residency)))
    if report.certificate is not None:
        rows.append(("certificate", certificate_summary(report.certificate)))
        for level in (report.certificate.get("ffn_levels") or {}).get("levels", [])[1:]:
            m = level["measured"]
            rows.append((f"ffn level {level['keep']:g}", f"mean KLD {m['mean_kld']:.5f}, top-1 "
                         f"{100 * m['top1_agreement']:.1f}%, {human_size(level['bytes_per_token'])} per token, "
                         f"channels {','.join(map(str, level['channels']))}"))
    return rows


def main() -> None:
    # SIGTERM (kill, CI timeouts) and SIGHUP (a closed terminal) clean up like Ctrl-C: the exception
    # unwinds through the writer, which removes its temp file.
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), _raise_terminated)
    app()


if __name__ == "__main__":
    main()
