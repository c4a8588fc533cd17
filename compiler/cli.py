"""`thinc`: compile a Hugging Face checkpoint to a .thin file, and inspect, verify or key artifacts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="thin's compiler: Hugging Face checkpoint in, one verified .thin file out.")

_FUSE_HELP = "Keep q/k/v and gate/up as separate projections (default: fuse them)."


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
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print only the summary."),
):
    """Compile MODEL_DIR into one .thin file (unquantized: every tensor at its stored precision)."""
    from thin.artifacts import human_size

    from .build import build
    from .config import CompileConfig

    def run():
        config = CompileConfig(fuse_projections=not no_fuse)
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
        ("tensor bytes", human_size(report.tensor_bytes)),
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
):
    """Print the cache key `thinc compile` would give MODEL_DIR with these options."""
    from thin.artifacts import compute_key

    from .config import CompileConfig

    def run():
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json; give a Hugging Face model folder")
        config = CompileConfig(fuse_projections=not no_fuse)
        return compute_key(model_dir, config.to_plain(), calibration=None, target=config.target)

    typer.echo(_guard(run))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
