"""`thin-exec serve MODEL.thin`: the OpenAI-compatible server (runtime/cli.py dispatches here).

The server's packages (starlette, uvicorn, pydantic) load when the command runs, not on import.
"""

from __future__ import annotations

import ipaddress
import logging
import sys
from pathlib import Path

import typer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def _fail(message: str):
    typer.echo(f"thin-exec serve: error: {message}", err=True)
    raise typer.Exit(1)


@app.command(help="Serve MODEL.thin over the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions, "
                  "streamed or not; /health) with continuous batching. Binds the loopback address unless "
                  "--host says otherwise.")
def serve(
    model_path: Path = typer.Argument(..., metavar="MODEL.thin", help="Compiled model artifact."),
    host: str = typer.Option("127.0.0.1", help="Address to bind. Anything but loopback exposes the model to the "
                                               "network: set --api-key then."),
    port: int = typer.Option(8000, min=0, max=65535, help="TCP port (0: any free one)."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="THIN_API_KEY", metavar="KEY",
                                       help="Require 'Authorization: Bearer KEY' on /v1/* (or set THIN_API_KEY)."),
    max_batch: int = typer.Option(8, "--max-batch", min=1, help="Requests decoding together."),
    max_queue: int = typer.Option(64, "--max-queue", min=0, help="Requests waiting for a place in the batch; "
                                                                  "more are refused with 429."),
    name: str | None = typer.Option(None, "--name", help="Model id clients send (default: the file name "
                                                         "without .thin)."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    verify: bool = typer.Option(False, "--verify", help="Check every tensor's checksum before serving."),
):
    try:
        import uvicorn  # noqa: F401 (here so that a missing server package is one line)

        from .app import create_app
        from .limits import Limits
    except ImportError as e:
        _fail(f"{e.name or e} is missing: install the server's packages with pip install 'thin[serve]' "
              "(or pip install -e '.[serve]' in a checkout)")
    from jinja2 import TemplateError

    from thin.artifacts import ArtifactError, missing_artifact
    from thin.ir import ThinError
    from thin.runtime import DeviceUnavailableError, load
    from thin.runtime.cli import report_progress

    if why := missing_artifact(model_path):
        _fail(why)
    if name is not None and not name.strip():
        _fail("--name is empty: give the model id clients send, or leave it out for the file name")
    if api_key is not None and not api_key.strip():
        _fail("--api-key (or THIN_API_KEY) is empty: give a key, or unset it to serve without one")
    sock = _listen(host, port)  # a busy port or a bad address fails now, not after the model loads
    report_progress("thin-exec serve")
    try:
        model = load(model_path, device=device, verify=verify)
        server = create_app(model, name=name, limits=Limits(max_batch=max_batch, max_queue=max_queue),
                            api_key=api_key)
    except (ThinError, ArtifactError, OSError, DeviceUnavailableError, TemplateError, ValueError, MemoryError) as e:
        sock.close()
        _fail(str(e) or type(e).__name__)
    port = sock.getsockname()[1]  # the port chosen for --port 0
    if not is_loopback(host) and not api_key:
        typer.echo(f"thin-exec serve: warning: binding {host} without --api-key: anyone who can reach this "
                   "address can use the model", err=True)
    where = f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"
    typer.echo(f"thin-exec serve: {model_path} as model {server.state.server.name!r} at {where} "
               f"(batch {max_batch}, queue {max_queue})", err=True)
    _log_requests()
    _run(server, sock, host, port)


def _listen(host: str, port: int):
    """A socket bound to (host, port) and listening, or one line and exit 1 (port taken, no such address)."""
    import socket

    address = host.strip("[]")
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    except OSError as e:
        _fail(f"cannot listen on {host}: {e.strerror or e}")
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart while old ones close
        sock.bind((address, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        why = e.strerror or str(e)
        _fail(f"cannot listen on {host} port {port}: {why}; choose another --port (0: any free one) or --host")
    return sock


def _run(server, sock, host: str, port: int) -> None:
    import uvicorn

    config = uvicorn.Config(server, host=host.strip("[]"), port=port, log_level="info", timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C during startup; afterwards uvicorn shuts down by itself
        pass
    finally:
        sock.close()


def _log_requests() -> None:
    # One line per finished request, and any model failure, beside uvicorn's own lines.
    from uvicorn.logging import DefaultFormatter

    logger = logging.getLogger("thin.serve")
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
        logger.addHandler(handler)


def main(argv: list[str] | None = None):
    app(args=sys.argv[1:] if argv is None else argv, prog_name="thin-exec serve")
