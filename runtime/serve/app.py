"""The HTTP side: a Starlette app with OpenAI's routes over one model and its Scheduler.

    GET  /health                  {"status": "ok", "active": n, "waiting": m} (no API key needed)
    GET  /v1/models               the one model this server holds; /v1/models/{id} for it alone
    POST /v1/completions          text (or token-id) prompt; "stream": true for server-sent events
    POST /v1/chat/completions     messages through the model's chat template; streams the same way

Every refusal is an OpenAI error object with its status (see errors.py). A client that goes away
cancels its request: a stream notices through the ASGI disconnect message, a plain request through
a task waiting for it, and the scheduler drops the sequence before its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import protocol
from .engine_backend import default_backend
from .errors import ApiError
from .limits import Limits, read_body
from .scheduler import BatchBackend, Delta, Done, Failed, Job, Scheduler

log = logging.getLogger("thin.serve")


def create_app(model, *, name: str | None = None, limits: Limits | None = None, api_key: str | None = None,
               backend: BatchBackend | None = None) -> Starlette:
    """An ASGI app serving `model` (a ThinModel with a tokenizer) under the id `name` (default: the
    artifact's file name without .thin). Its scheduler thread runs from the app's startup to its
    shutdown. `backend` defaults to the CUDA decode engine's batched step when the model runs on it,
    else to the torch executor's."""
    if model.tokenizer is None:
        raise ValueError("this artifact has no tokenizer; the server needs one to read prompts and write text")
    server = _Server(model, name or Path(model.artifact.path).stem, limits or Limits(), api_key,
                     backend or default_backend(model, (limits or Limits()).max_batch))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.scheduler.start()
        try:
            yield
        finally:
            await run_in_threadpool(server.scheduler.close)

    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", server.model_card, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: _api_error, HTTPException: _http_error})
    app.state.server = server
    return app


async def _api_error(request, exc: ApiError) -> Response:
    return Response(exc.encode(), status_code=exc.status, media_type="application/json")


async def _http_error(request, exc: HTTPException) -> Response:
    # Starlette's own refusals (no such route, wrong method) in OpenAI's shape too.
    path = request.url.path[:200]
    message = {404: f"no route {path}", 405: f"{request.method[:16]} is not allowed on {path}"}
    error = ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail)[:200]))
    return Response(error.encode(), status_code=exc.status_code, media_type="application/json",
                    headers=exc.headers)


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


class _Stream(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends: done, failed or cut off."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _wait_disconnect(request) -> None:
    # The body has been read, so the next ASGI message is the client leaving.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Server:
    def __init__(self, model, name: str, limits: Limits, api_key: str | None, backend: BatchBackend):
        self.model, self.name, self.limits = model, name, limits
        self.api_key = api_key.encode("utf-8") if api_key else None
        self.scheduler = Scheduler(backend, limits.max_batch, limits.max_queue)
        self.created = int(Path(model.artifact.path).stat().st_mtime)

    # ---- plain routes ----------------------------------------------------------------------------

    async def health(self, request) -> Response:
        ok = self.scheduler.running
        return JSONResponse({"status": "ok" if ok else "unavailable", "model": self.name, **self.scheduler.load()},
                            status_code=200 if ok else 503)

    def _card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "thin",
                "max_model_len": self.model.ir.max_position_embeddings}

    async def models(self, request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model_card(self, request) -> Response:
        self._authorize(request)
        self._check_model(request.path_params["model_id"])
        return JSONResponse(self._card())

    def _authorize(self, request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), self.api_key):
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def _check_model(self, requested: str) -> None:
        if requested != self.name:
            raise ApiError(404, f"the model {requested[:200]!r} does not exist; this server has {self.name!r}",
                           param="model", code="model_not_found")

    # ---- generation ------------------------------------------------------------------------------

    async def completions(self, request) -> Response:
        req = await self._read(request, protocol.CompletionRequest)
        prepared = await run_in_threadpool(
            lambda: protocol.prepare(self.model, req, protocol.completion_prompt(self.model, req)))
        return await self._generate(request, req, prepared, chat=False)

    async def chat_completions(self, request) -> Response:
        req = await self._read(request, protocol.ChatRequest)
        prepared = await run_in_threadpool(
            lambda: protocol.prepare(self.model, req, protocol.chat_prompt(self.model, req)))
        return await self._generate(request, req, prepared, chat=True)

    async def _read(self, request, schema):
        self._authorize(request)
        req = protocol.parse(schema, protocol.parse_json(await read_body(request, self.limits.max_body_bytes)))
        self._check_model(req.model)
        return req

    async def _generate(self, request, req, prepared: protocol.Prepared, chat: bool) -> Response:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        reply = _Reply(self.name, chat)
        job = Job(prepared.prompt, prepared.options, self.model.tokenizer,
                  lambda event: loop.call_soon_threadsafe(events.put_nowait, event), prepared.stop,
                  prepared.frequency_penalty, prepared.presence_penalty, name=reply.id)
        self.scheduler.submit(job)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return _Stream(self._stream(job, events, reply, usage), on_close=lambda: self.scheduler.cancel(job))
        collect = asyncio.ensure_future(_collect(events))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            finished = collect.done()
            if not finished:
                collect.cancel()
                self.scheduler.cancel(job)
        if not finished:
            return Response(status_code=499)  # nobody is left to read it
        text, end = collect.result()
        if isinstance(end, Failed):
            raise ApiError(500, end.message)
        reply.log(end)
        return JSONResponse(reply.whole(text, end))

    async def _stream(self, job: Job, events: asyncio.Queue, reply: _Reply, usage: bool):
        try:
            if reply.chat:
                yield _event(reply.chunk("", role=True))
            while True:
                event = await events.get()
                if isinstance(event, Delta):
                    yield _event(reply.chunk(event.text))
                elif isinstance(event, Done):
                    yield _event(reply.chunk("", finish=event.finish_reason))
                    if usage:
                        yield _event(reply.usage_chunk(event))
                    reply.log(event)
                    break
                else:
                    yield _event(ApiError(500, event.message).body())
                    break
            yield b"data: [DONE]\n\n"
        finally:
            self.scheduler.cancel(job)


async def _collect(events: asyncio.Queue) -> tuple[str, Done | Failed]:
    pieces = []
    while True:
        event = await events.get()
        if not isinstance(event, Delta):
            return "".join(pieces), event
        pieces.append(event.text)


class _Reply:
    """Response bodies of one request: its id, time and kind (chat or text completion)."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.start = time.perf_counter()

    def whole(self, text: str, done: Done) -> dict:
        use = protocol.usage(done.prompt_tokens, done.completion_tokens)
        if self.chat:
            return protocol.chat_body(self.id, self.created, self.model, text, done.finish_reason, use)
        return protocol.completion_body(self.id, self.created, self.model, text, done.finish_reason, use)

    def chunk(self, text: str, *, role: bool = False, finish: str | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            return protocol.chat_chunk(self.id, self.created, self.model, delta, finish)
        return protocol.completion_body(self.id, self.created, self.model, text, finish, None)

    def usage_chunk(self, done: Done) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return protocol.usage_chunk(self.id, self.created, self.model, obj,
                                    protocol.usage(done.prompt_tokens, done.completion_tokens))

    def log(self, done: Done) -> None:
        log.info("%s: %d prompt + %d completion tokens, finish %s, %.2f s", self.id, done.prompt_tokens,
                 done.completion_tokens, done.finish_reason, time.perf_counter() - self.start)
