"""`thin-exec MODEL.thin`: chat with, or generate from, a compiled model.
`thin-exec bench MODEL.thin`: prefill and decode speed against the bandwidth limit (CUDA).

Interactive chat when stdin is a terminal; otherwise one completion for --prompt, or for
the text read from stdin. Generated text streams to stdout; throughput and errors go to
stderr. Expected failures (missing or damaged file, absent GPU, prompt too long, a model
over its --vram budget, a bad option, a template that fails) print one line and exit 1, never
a traceback; in the interactive chat a failed turn prints its line and the session goes on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})


class _UserError(Exception):
    """An error the user can fix; printed as one line."""


def _error_line(error) -> str:
    """One line, control characters escaped: messages quote names from the file."""
    from thin.ir import one_line, printable

    return f"thin-exec: error: {printable(one_line(error))}"


def report_progress(prefix: str = "thin-exec") -> None:
    """Runtime progress notes (logger "thin.runtime": the first load's kernel compiles) go to stderr
    as `PREFIX: ...` lines."""
    import logging

    class ToStderr(logging.Handler):  # whatever sys.stderr is when a note is written
        def emit(self, record):
            typer.echo(self.format(record), err=True)

    log = logging.getLogger("thin.runtime")
    if not log.handlers:
        handler = ToStderr()
        handler.setFormatter(logging.Formatter(f"{prefix}: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _fail(message):
    # Messages stay on one line so scripts can grep them.
    typer.echo(_error_line(message), err=True)
    raise typer.Exit(1)


def _expected_errors() -> tuple[type[BaseException], ...]:
    """thin's own errors (the runtime's RunError, ArtifactError, ...), the OS's, and running out of memory."""
    from thin.ir import ThinError

    return (_UserError, ThinError, OSError, MemoryError)


def _out_of_memory(e: BaseException, vram: str | None) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    budget = f" under --vram {vram}" if vram else ""
    return f"out of GPU memory{budget}: {first}"


def _vram_bytes(vram: str | None) -> int | None:
    if vram is None:
        return None
    from thin.runtime.memory import parse_size

    try:
        return parse_size(vram)
    except ValueError as e:
        raise _UserError(str(e)) from None


_KEEP_HELP = ("Run the elastic FFN level F (1, 0.75, 5/6 ...): each FFN reads only the prefix of its "
              "importance-ordered channels the artifact certified for F (thinc compile --ffn-levels).")
_UNCERTIFIED_HELP = "Run an --ffn-keep the artifact did not certify: the same share of every FFN, no correction."


def _ffn_keep(text: str | None) -> float | None:
    """--ffn-keep as a number: a decimal or a fraction such as 5/6."""
    if text is None:
        return None
    from fractions import Fraction

    try:
        keep = float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError):
        raise _UserError(f"--ffn-keep takes a number such as 0.75 or 5/6, got {text!r}") from None
    if not 0 < keep <= 1:
        raise _UserError(f"--ffn-keep must be in (0, 1], got {text}")
    return keep


def _check_file(model_path: Path) -> None:
    from thin.artifacts import missing_artifact

    if why := missing_artifact(model_path):
        raise _UserError(why)


def _terminal_text(piece: str) -> str:
    # Generated text goes to a terminal as is, except control characters (a model's tokens could
    # spell escape sequences); newlines and tabs are text.
    from thin.ir import printable

    if piece.isprintable() or not sys.stdout.isatty():
        return piece
    return "".join(c if c in "\n\t" else printable(c) for c in piece)


def _stream(model, prompt_ids: list[int], options: dict, conversation=None) -> tuple[str, object]:
    """Generate for `prompt_ids`, printing text as it completes; return the text and the stats."""
    from thin.runtime import GenerationStats

    stats = GenerationStats()
    decoder = model.tokenizer.stream(skip_special_tokens=True)
    pieces = []
    try:
        for token in model.generate(prompt_ids, stats=stats, conversation=conversation, **options):
            piece = decoder.put(token)
            if piece:
                pieces.append(piece)
                sys.stdout.write(_terminal_text(piece))
                sys.stdout.flush()
    finally:
        tail = decoder.flush()
        pieces.append(tail)
        sys.stdout.write(_terminal_text(tail) + "\n")
        sys.stdout.flush()
    return "".join(pieces), stats


def _prompt_ids(model, text: str, raw: bool, history: list[dict] | None = None) -> list[int]:
    # A chat template writes its own bos, so the rendered text is encoded without special tokens
    # (as transformers' apply_chat_template(tokenize=True) does); raw text gets them.
    from .chat_template import ChatTemplateError
    from .inputs import check_prompt_text

    if raw:
        return model.encode(text, add_special_tokens=True)
    check_prompt_text(text)  # before the template, so a message about the text points into what the user typed
    messages = (history or []) + [{"role": "user", "content": text}]
    try:
        rendered = model.render_chat(messages, add_generation_prompt=True)
    except ChatTemplateError as e:  # its own words (raise_exception) or why it failed: say whose they are
        said = str(e) if str(e).startswith("the chat template") else f"the chat template refused the prompt: {e}"
        raise _UserError(f"{said} (--raw sends the text without the template)") from None
    return model.encode(rendered, add_special_tokens=False)


def _fit_default(model, options: dict, prompt_tokens: int) -> dict:
    """`options` with a default max_new_tokens (not given on the command line) cut to the positions the
    prompt leaves, as the server does; a length the user gave is kept and checked as given."""
    if options.get("max_new_tokens") is not None:
        return options
    room = (model.ir.max_position_embeddings or 0) - prompt_tokens
    if 1 <= room < model.generation_options(**options).max_new_tokens:
        return {**options, "max_new_tokens": room}
    return options


def _one_shot(model, text: str, raw: bool, options: dict, notes: tuple[str, ...] = ()):
    """Generate once for `text`; `notes` (quality, implementations) are printed with the speed at the end,
    so that a refused prompt or option is the one line on stderr."""
    if not text.strip():
        raise _UserError("the prompt is empty: give --prompt TEXT or pipe text on stdin")
    if not raw and model.chat_template is None:
        typer.echo("thin-exec: the artifact has no chat template; using the prompt as raw text", err=True)
        raw = True
    ids = _prompt_ids(model, text, raw)
    if not ids:
        raise _UserError("the prompt is empty")
    _, stats = _stream(model, ids, _fit_default(model, options, len(ids)))
    for note in notes:
        typer.echo(note, err=True)
    typer.echo(stats.summary(), err=True)


def _chat(model, raw: bool, options: dict, notes: tuple[str, ...] = ()):
    """Read-eval loop: history is kept between turns; /reset clears it, /exit (or Ctrl-D) leaves."""
    for note in notes:
        typer.echo(note, err=True)
    if not raw and model.chat_template is None:
        typer.echo("thin-exec: the artifact has no chat template; each line is a raw prompt", err=True)
        raw = True
    typer.echo("thin-exec: /reset clears the conversation, /exit quits", err=True)
    history: list[dict] = []
    # Each turn's prompt starts with the previous turns: their keys and values are reused.
    conversation = model.new_conversation()
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            typer.echo("", err=True)
            return
        except UnicodeDecodeError as e:  # the terminal sent bytes that are not UTF-8: this turn only
            typer.echo(_error_line(f"the input is not UTF-8 text ({e.reason})"), err=True)
            continue
        command = line.strip()
        if command in ("/exit", "/quit"):
            return
        if command == "/reset":
            history.clear()
            conversation.clear()
            typer.echo("(conversation cleared)", err=True)
            continue
        if not command:
            continue
        try:
            ids = _prompt_ids(model, line, raw, history)
            reply, stats = _stream(model, ids, _fit_default(model, options, len(ids)), conversation)
        except KeyboardInterrupt:
            typer.echo("(interrupted)", err=True)
            continue
        except _expected_errors() as e:
            # One bad turn (too long, template refusal) should not end the session.
            from .generate import ContextTooLongError

            grown = isinstance(e, ContextTooLongError) and history
            typer.echo(_error_line(f"{e} (the conversation so far is part of the prompt: /reset clears it)"
                                   if grown else e), err=True)
            continue
        typer.echo(stats.summary(), err=True)
        if not raw:
            history += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]


@app.command(help="Chat with, or generate from, a compiled .thin model.\n\n"
                  "Interactive chat when stdin is a terminal; otherwise one completion of --prompt, "
                  "or of the text read from stdin.")
def run(
    model_path: Path = typer.Argument(..., metavar="MODEL.thin", help="Compiled model artifact."),
    prompt: str | None = typer.Option(
        None, "--prompt", "-p", help="Generate once for this prompt and exit."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template: the prompt is plain text."),
    max_new_tokens: int | None = typer.Option(
        None, help="Most tokens to generate (default: the model's generation_config, else 512)."),
    temperature: float | None = typer.Option(
        None, help="0 is greedy (default: the model's generation_config)."),
    top_k: int | None = typer.Option(None, help="Keep the k most likely tokens (0: off)."),
    top_p: float | None = typer.Option(None, help="Keep the smallest set with this total probability (1: off)."),
    min_p: float | None = typer.Option(
        None, help="Drop tokens below min_p x the top token's probability (0: off)."),
    repetition_penalty: float | None = typer.Option(None, help="Penalise tokens already seen (1: off)."),
    seed: int | None = typer.Option(None, help="Seed for sampling: same seed, same text."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    verify: bool = typer.Option(False, "--verify", help="Check every tensor's checksum before running."),
    verbose: bool = typer.Option(False, "--verbose", "-v",
                                 help="Say which implementation runs each weight format on this device."),
    vram: str | None = typer.Option(
        None, "--vram", metavar="SIZE", help="GPU memory budget (8G, 7.5GiB, 12000M): the model must fit, and "
        "the runtime allocates no more."),
    no_graph: bool = typer.Option(False, "--no-graph", help="Decode without capturing the step in a CUDA graph."),
    ffn_keep: str | None = typer.Option(None, "--ffn-keep", metavar="F", help=_KEEP_HELP),
    uncertified: bool = typer.Option(False, "--uncertified", help=_UNCERTIFIED_HELP),
):
    import torch

    from thin.artifacts import certificate_summary, ffn_level_summary
    from thin.runtime import load

    options = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                   "min_p": min_p, "repetition_penalty": repetition_penalty, "seed": seed}
    report_progress()
    try:
        _check_file(model_path)
        if uncertified and ffn_keep is None:
            raise _UserError("--uncertified goes with --ffn-keep F")
        if no_graph and not device.startswith("cuda"):
            raise _UserError("--no-graph is for --device cuda (the CPU path captures no graph)")
        model = load(model_path, device=device, verify=verify, vram=_vram_bytes(vram), graphs=not no_graph,
                     ffn_keep=_ffn_keep(ffn_keep), uncertified=uncertified)
        if model.generation_options(**options).greedy:  # also rejects bad values before any prompt is read
            ignored = [f"--{k.replace('_', '-')}" for k in ("top_k", "top_p", "min_p", "seed")
                       if options[k] is not None]
            if ignored:
                why = "--temperature 0" if temperature is not None else "the model's generation_config"
                typer.echo(f"thin-exec: note: decoding is greedy ({why}), so {', '.join(ignored)} change nothing; "
                           "give --temperature T > 0 to sample", err=True)
        certificate = model.artifact.section("certificate")
        quality = (certificate_summary(certificate) if ffn_keep is None
                   else ffn_level_summary(certificate, model.ffn_keep, model.ffn_share))
        notes = (f"thin-exec: quality: {quality}",
                 *([f"thin-exec: {model.describe_implementations()}"] if verbose else []))
        if prompt is not None:
            if not prompt.strip():
                raise _UserError("--prompt is empty: give the text to continue, or leave --prompt out to read stdin")
            _one_shot(model, prompt, raw, options, notes)
        elif sys.stdin is not None and sys.stdin.isatty():
            _chat(model, raw, options, notes)
        else:
            # `echo text |` ends the prompt with a newline the user did not mean as text.
            _one_shot(model, _read_stdin().removesuffix("\n"), raw, options, notes)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except BrokenPipeError:  # `thin-exec ... | head`: the reader has what it wanted
        _quiet_stdout()
        raise typer.Exit(0) from None
    except torch.OutOfMemoryError as e:
        _fail(_out_of_memory(e, vram))
    except _expected_errors() as e:
        _fail(str(e) or type(e).__name__)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush on a closed pipe says nothing."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


bench_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                        context_settings={"help_option_names": ["-h", "--help"]})


@bench_app.command(help="Prefill and decode tokens/s on the GPU against the memory-bandwidth limit: bytes "
                        "of weights read per token (from the tensor table), the device's measured copy bandwidth, "
                        "the fraction of that roofline reached, and peak VRAM. Checks that every decode step "
                        "attends to exactly the positions there are and that greedy tokens are the same with "
                        "and without the CUDA graph.")
def bench(
    model_path: Path = typer.Argument(..., metavar="MODEL.thin", help="Compiled model artifact."),
    prompt_len: int = typer.Option(512, "--prompt-len", help="Prompt tokens (random ids, seeded)."),
    gen: int = typer.Option(128, "--gen", help="Tokens to decode per run (greedy, no stop token)."),
    runs: int = typer.Option(5, "--runs", help="Timed runs after one warm-up run."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
    profile: bool = typer.Option(False, "--profile",
                                 help="Time the CUDA graph's step by section and kernel, with idle gaps."),
    vram: str | None = typer.Option(None, "--vram", metavar="SIZE", help="GPU memory budget (see thin-exec -h)."),
    no_graph: bool = typer.Option(False, "--no-graph", help="Decode without the CUDA graph."),
    device: str = typer.Option("cuda", help="A CUDA device."),
    ffn_keep: str | None = typer.Option(None, "--ffn-keep", metavar="F", help=_KEEP_HELP),
    uncertified: bool = typer.Option(False, "--uncertified", help=_UNCERTIFIED_HELP),
):
    import json

    import torch

    from thin.runtime import bench as measure
    from thin.runtime import load

    report_progress()
    try:
        _check_file(model_path)
        if prompt_len < 1 or gen < 2 or runs < 1:
            raise _UserError("--prompt-len must be >= 1, --gen >= 2 and --runs >= 1")
        if uncertified and ffn_keep is None:
            raise _UserError("--uncertified goes with --ffn-keep F")
        budget, keep = _vram_bytes(vram), _ffn_keep(ffn_keep)  # the command line's mistakes first
        if not device.startswith("cuda"):
            raise _UserError(f"thin-exec bench measures the GPU decode path: use --device cuda or cuda:N, "
                             f"not {device}")
        if not torch.cuda.is_available():
            raise _UserError("thin-exec bench measures the GPU decode path and needs a CUDA GPU; none is available "
                             "here")
        model = load(model_path, device=device, vram=budget, context=prompt_len + gen,
                     graphs=not no_graph, ffn_keep=keep, uncertified=uncertified)
        result = measure.run(model, prompt_len=prompt_len, new_tokens=gen, runs=runs, profile=profile)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except torch.OutOfMemoryError as e:
        _fail(_out_of_memory(e, vram))
    except _expected_errors() as e:
        _fail(str(e) or type(e).__name__)
    typer.echo(json.dumps(result.to_dict()) if as_json else result.render())


def _read_stdin() -> str:
    """The prompt piped on stdin: at most MAX_PROMPT_BYTES, strict UTF-8."""
    from thin.runtime.inputs import MAX_PROMPT_BYTES

    if sys.stdin is None:  # started with stdin closed (`<&-`): nothing to read
        return ""
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # a text stream without bytes underneath (embedding, tests)
        text = sys.stdin.read(MAX_PROMPT_BYTES + 1)
        data = text.encode("utf-8", "surrogateescape") if len(text) <= MAX_PROMPT_BYTES else b"x" * len(text)
    else:
        data = stream.read(MAX_PROMPT_BYTES + 1)  # never more than the limit in memory
    if len(data) > MAX_PROMPT_BYTES:
        raise _UserError(f"the prompt on stdin is longer than {MAX_PROMPT_BYTES} bytes, the limit on prompt text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _UserError(f"the prompt on stdin is not UTF-8 text (byte {e.start}: {e.reason})") from None


def main(argv: list[str] | None = None):
    """Entry point of the `thin-exec` console script: `thin-exec bench ...`, `thin-exec serve ...` (runtime/serve/)
    or `thin-exec MODEL.thin ...`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["bench"]:
        bench_app(args=args[1:], prog_name="thin-exec bench")
    elif args[:1] == ["serve"]:
        from thin.runtime.serve.cli import main as serve

        serve(args[1:])
    else:
        app(args=args, prog_name="thin-exec")


if __name__ == "__main__":
    main()
