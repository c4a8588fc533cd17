"""`thinc`: compile a Hugging Face checkpoint to a .thin file, and inspect, verify or key artifacts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="thin's compiler: Hugging Face checkpoint in, one verified .thin file out.")

_FUSE_HELP = "Keep q/k/v and gate/up as separate projections (default: fuse them)."
_QUANT_HELP = ("Store every linear weight in FORMAT, round-to-nearest: fp8_e4m3, int8, int3..int6, mxfp4, "
               "q2, q1 (`thinc formats` lists them). Embeddings and norms stay as stored.")
_GROUP_HELP = "Group size along the input dimension for formats with groups (default: the format's)."
_ASYM_HELP = "Grouped integer formats: store a per-group offset as well as a scale."
_KEEP_HEAD_HELP = "Leave an untied LM head as stored when quantizing."


def _config(no_fuse: bool, quant: str | None, group_size: int | None, asymmetric: bool, keep_lm_head: bool):
    from .config import CompileConfig

    return CompileConfig.from_options(fuse_projections=not no_fuse, quant=quant, group_size=group_size,
                                      asymmetric=asymmetric, keep_lm_head=keep_lm_head)


def _fail(message: str, code: int = 1) -> None:
    typer.echo(f"thinc: error: {message}", err=True)
    raise typer.Exit(code)


def _guard(fn):
    """Turn every expected failure into one line on stderr and a non-zero exit; never a traceback."""
    from thin.artifacts import ArtifactError
    from thin.passes import PassError

    from .config import CompileOptionError
    from .hf import FrontendError

    try:
        return fn()
    except (ArtifactError, FrontendError, PassError, CompileOptionError, OSError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        _fail("interrupted; nothing was written at the output path", 130)


class _StageProgress:
    """Prints a line per stage; on a terminal, tensor counts update in place."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.stage = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.quiet:
            return
        if total:
            if self.tty:
                typer.echo(f"\r  {stage} {done}/{total}", err=True, nl=done == total)
            elif done == total:
                typer.echo(f"  {stage} {done}/{total}", err=True)
            return
        if stage != self.stage:
            typer.echo(f"  {stage}", err=True)
        self.stage = stage


@app.command()
def compile(
    model_dir: Path = typer.Argument(..., help="Hugging Face model folder (config.json + *.safetensors)."),
    output: Path = typer.Option(..., "-o", "--output", help="Path of the .thin file to write."),
    dump_ir: Path | None = typer.Option(None, "--dump-ir", help="Write the IR text after each pass here."),
    cache_dir: Path | None = typer.Option(
        None, "--cache-dir", help="Reuse DIR/<key>.thin when present; store new builds there."),
    no_fuse: bool = typer.Option(False, "--no-fuse", help=_FUSE_HELP),
    quant: str | None = typer.Option(None, "--quant", metavar="FORMAT", help=_QUANT_HELP),
    group_size: int | None = typer.Option(None, "--group-size", metavar="N", help=_GROUP_HELP),
    asymmetric: bool = typer.Option(False, "--asymmetric", help=_ASYM_HELP),
    keep_lm_head: bool = typer.Option(False, "--keep-lm-head", help=_KEEP_HEAD_HELP),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print only the summary."),
):
    """Compile MODEL_DIR into one .thin file. Without --quant every tensor keeps its stored precision."""
    from thin.artifacts import human_size

    from .build import build

    def run():
        config = _config(no_fuse, quant, group_size, asymmetric, keep_lm_head)
        return build(model_dir, output, config, cache_dir=cache_dir, dump_ir=dump_ir,
                     progress=_StageProgress(quiet))

    report = _guard(run)
    if report.cache_hit:
        typer.echo(f"cache hit: {cache_dir}/{report.key}.thin", err=True)
    formats = ", ".join(f"{k} x{v}" for k, v in sorted(report.formats.items()))
    rows = [
        ("output", str(report.output)),
        ("parameters", f"{report.parameters:,}"),
        ("tensors", f"{report.tensors} ({formats})"),
        ("tensor bytes", f"{human_size(report.tensor_bytes)} ({8 * report.tensor_bytes / report.parameters:.2f} "
                         "bits per weight)"),
        ("file bytes", human_size(report.file_bytes)),
        ("key", report.key[:16]),
        ("time", " ".join(f"{k} {v:.2f}s" for k, v in report.seconds.items())
         + f" | total {sum(report.seconds.values()):.2f}s"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        typer.echo(f"{k:<{width}}  {v}")


@app.command()
def inspect(
    file: Path = typer.Argument(..., help="A .thin file."),
    as_json: bool = typer.Option(False, "--json", help="Print the description as JSON."),
    ir: bool = typer.Option(False, "--ir", help="Print the model's IR as text."),
):
    """Describe an artifact: sections and sizes, tensors by format, key, provenance."""
    from thin.artifacts import describe, open_artifact, render_description
    from thin.ir import format_ir

    def run():
        with open_artifact(file) as art:
            return describe(art), format_ir(art.model)

    desc, ir_text = _guard(run)
    if as_json:
        typer.echo(json.dumps(desc, indent=2, sort_keys=True))
    else:
        typer.echo(render_description(desc))
    if ir:
        typer.echo(ir_text, nl=False)


@app.command()
def verify(file: Path = typer.Argument(..., help="A .thin file.")):
    """Check the header and every tensor checksum; exit 0 when intact, 1 naming the bad tensors."""
    from thin.artifacts import verify_file

    bad = _guard(lambda: verify_file(file))
    if bad:
        _fail(f"{file}: {len(bad)} tensor(s) fail their checksum: {', '.join(bad[:10])}; "
              f"the file is damaged: recompile or fetch it again")
    typer.echo(f"{file}: ok")


@app.command()
def key(
    model_dir: Path = typer.Argument(..., help="Hugging Face model folder."),
    no_fuse: bool = typer.Option(False, "--no-fuse", help=_FUSE_HELP),
    quant: str | None = typer.Option(None, "--quant", metavar="FORMAT", help=_QUANT_HELP),
    group_size: int | None = typer.Option(None, "--group-size", metavar="N", help=_GROUP_HELP),
    asymmetric: bool = typer.Option(False, "--asymmetric", help=_ASYM_HELP),
    keep_lm_head: bool = typer.Option(False, "--keep-lm-head", help=_KEEP_HEAD_HELP),
):
    """Print the cache key `thinc compile` would give MODEL_DIR with these options."""
    from thin.artifacts import compute_key

    def run():
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json; give a Hugging Face model folder")
        config = _config(no_fuse, quant, group_size, asymmetric, keep_lm_head)
        return compute_key(model_dir, config.to_plain(), calibration=None, target=config.target)

    typer.echo(_guard(run))


@app.command("formats")
def formats_command():
    """List the storage formats, their parameters and bits per weight (on a 4096x4096 weight)."""
    from thin.ir import formats

    rows = [("format", "params (default)", "bits/weight", "description")]
    for fmt in formats.FORMATS.values():
        params = ", ".join(f"{k} {'/'.join(map(str, p.choices))} ({p.default})" for k, p in fmt.params.items())
        rows.append((fmt.name, params or "-", f"{fmt.bits_per_weight((4096, 4096)):.3f}",
                     fmt.description.splitlines()[0]))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])


def main() -> None:
    app()


if __name__ == "__main__":
    main()
