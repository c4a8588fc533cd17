"""`thin-exec serve`: an OpenAI-compatible HTTP server with continuous batching.

Nothing in `thin.runtime` imports this package, and importing it loads nothing: the server's
dependencies (starlette, uvicorn, pydantic: the `serve` extra) load only when a server is made.

    limits.py     the bounds a server enforces (batch, queue, body size, stop strings) and the body reader
    protocol.py   the OpenAI request schemas, their checks, and the error object every refusal carries
    text.py       generated ids -> text, UTF-8 safe, with stop strings held back and cut
    scheduler.py  continuous batching: the BatchBackend interface, the torch backend, the scheduler thread
    engine_backend.py  the CUDA decode engine's batched step as a BatchBackend (runtime/batch_engine.py)
    app.py        the Starlette app: routes, server-sent events, API key, disconnects
    cli.py        the `thin-exec serve` command
"""
