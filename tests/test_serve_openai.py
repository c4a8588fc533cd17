"""`thin-exec serve` started on a free loopback port and driven by the official openai client.

The model is a random 2-layer Llama with a real tokenizer and a 4096-position context (so a
long generation can be cut off mid-stream); every text the server returns is checked against
what `generate` gives for the same prompt alone.
"""

import dataclasses
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from thin.artifacts import ArtifactWriter
from thin.ir import formats
from thin.runtime import load

from ir_fixtures import tiny_model
from tiny_tokenizer import CHATML, write_tokenizer

CONTEXT = 4096
MAX_BATCH, MAX_QUEUE = 4, 4


def write_artifact(path, tmp_dir):
    """A random model whose stop token is one it never picks (its LM-head row is zero), so every
    generation runs to max_tokens and a long one can be counted on to still be running."""
    write_tokenizer(tmp_dir)
    config = json.loads((tmp_dir / "tokenizer_config.json").read_text())
    del config["eos_token"], config["pad_token"]
    files = {"tokenizer.json": (tmp_dir / "tokenizer.json").read_bytes(),
             "tokenizer_config.json": json.dumps(config).encode()}
    vocab = len(json.loads(files["tokenizer.json"])["model"]["vocab"]) + 3  # padded, as checkpoints often are
    model = dataclasses.replace(tiny_model(vocab=vocab), max_position_embeddings=CONTEXT)
    g = torch.Generator().manual_seed(0)
    with ArtifactWriter(path) as writer:
        for t in model.tensors:
            data = torch.randn(t.shape, generator=g) * (1.0 if "norm" in t.role else 0.3)
            if "norm" in t.role:
                data = data.abs() + 0.5
            if t.role == "lm_head":
                data[vocab - 1] = 0.0
            writer.add_tensor(t.name, formats.encode(t.encoding.format, data).numpy())
        writer.commit(model, {"tokenizer": files, "chat_template": CHATML,
                              "generation_config": {"do_sample": False, "eos_token_id": vocab - 1,
                                                    "max_new_tokens": 8}})


@dataclasses.dataclass
class Server:
    url: str
    log_path: object
    process: subprocess.Popen

    def log(self) -> str:
        return self.log_path.read_text()

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    write_artifact(tmp / "tiny.thin", tmp)
    return tmp / "tiny.thin"


@pytest.fixture(scope="module")
def server(artifact):
    log_path = artifact.parent / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "thin.runtime.cli", "serve", str(artifact), "--port", "0",
             "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE)],
            stdout=log, stderr=subprocess.STDOUT,
            # One torch thread: this process and the server share the machine's cores.
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        # The server's own line names the port --port 0 got; requests wait for uvicorn's startup line.
        while not ((found := re.search(r" at (http://127\.0\.0\.1:\d+)/v1 ", log_path.read_text()))
                   and "Application startup complete" in log_path.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        yield Server(found.group(1), log_path, process)
    finally:
        process.terminate()
        process.wait(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(artifact):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server: the two share the machine's cores
    yield load(artifact)
    torch.set_num_threads(threads)


def alone(model, prompt_ids, max_tokens, **options):
    """(text, finish_reason, completion_tokens) that generate gives for these ids by itself."""
    tokens = list(model.generate(prompt_ids, max_new_tokens=max_tokens, **options))
    stopped = model.last_stats.stop_reason == "eos"
    return model.tokenizer.decode(tokens, skip_special_tokens=True), "stop" if stopped else "length", \
        len(tokens) + stopped


def chat_ids(model, content):
    return model.encode(model.render_chat([{"role": "user", "content": content}]), add_special_tokens=False)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").owned_by == "thin"
    assert server.health() == {"status": "ok", "model": "tiny", "active": 0, "waiting": 0}
    assert "thin-exec serve:" in server.log() and "as model 'tiny'" in server.log()


def test_chat_and_completions_give_the_text_generate_gives(client, model):
    for content in ("def push", "class Stack:"):
        text, finish, n = alone(model, chat_ids(model, content), 12)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                               max_tokens=12)
        assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (text, finish)
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(chat_ids(model, content)), n)
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + n
        chunks = list(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_tokens=12, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n

    prompt = "    if n < 2:"
    text, finish, n = alone(model, model.encode(prompt), 10)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=10)
    assert (reply.choices[0].text, reply.choices[0].finish_reason, reply.usage.completion_tokens) == (text, finish, n)
    ids = model.encode(prompt)
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=10).choices[0].text == text
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text
    # Omitted max_tokens: the artifact's max_new_tokens (8), as thin-exec uses.
    assert client.completions.create(model="tiny", prompt=prompt).choices[0].text == alone(model, ids, 8)[0]


def test_stop_strings_cut_the_text(client, model):
    text, _, _ = alone(model, model.encode("class Stack:"), 24, stop_token_ids=())
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(text) > 8 and stop.strip()
    for stream in (False, True):
        reply = client.completions.create(model="tiny", prompt="class Stack:", max_tokens=24, stop=[stop, "\x00"],
                                          stream=stream)
        chunks = list(reply) if stream else [reply]
        assert "".join(c.choices[0].text for c in chunks) == text[:text.find(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_the_same_seed_gives_the_same_sample(client, model):
    messages = [{"role": "user", "content": "def push"}]
    sampled = [client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=1.0,
                                              seed=seed, extra_body={"top_k": 0}).choices[0].message.content
               for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1] != sampled[2]
    assert sampled[0] == alone(model, chat_ids(model, "def push"), 16, temperature=1.0, seed=7, top_k=0)[0]


def _error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_refusals_are_openai_errors(server, client):
    url = server.url + "/v1/chat/completions"
    assert _error(httpx.post(url, content=b'{"model": "tiny", "messages": [', timeout=10), 400)["type"] == \
        "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[5] * CONTEXT)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=CONTEXT)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    for bad in ({"temperature": 9}, {"top_p": 0}, {"n": 3}, {"max_tokens": 0}, {"stop": ["a", "b", "c", "d", "e"]},
                {"extra_body": {"frobnicate": True}}, {"extra_body": {"top_k": "ten"}}, {"seed": 2 ** 70}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="hi", **{"max_tokens": 2, **bad})
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[10 ** 6])
    assert "vocabulary" in e.value.message
    _error(httpx.post(url, content=b" " * (2 << 20), timeout=10), 413)
    _error(httpx.get(url, timeout=10), 405)
    _error(httpx.get(server.url + "/v2/engines", timeout=10), 404)


def _wait_idle(server, timeout=60):
    deadline = time.monotonic() + timeout
    while (load := server.health())["active"] or load["waiting"]:
        assert time.monotonic() < deadline, load
        time.sleep(0.02)


def test_a_client_that_goes_away_frees_its_slot(server, client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": CONTEXT - 64}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        assert [next(lines) for _ in range(6)][0].startswith("data: ")
    _wait_idle(server)
    with pytest.raises(httpx.TimeoutException):  # a plain request whose client gives up
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.5)
    _wait_idle(server)
    cancelled = [int(n) for n in re.findall(r"chatcmpl-\w+: cancelled after (\d+) tokens", server.log())]
    assert len(cancelled) == 2 and max(cancelled) < CONTEXT - 64


def test_a_full_queue_is_429_and_closing_streams_empties_it(server, client):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": CONTEXT - 64, "stream": True}
    with httpx.Client(timeout=30) as http:
        streams = [http.stream("POST", server.url + "/v1/completions", json=body) for _ in range(MAX_BATCH + MAX_QUEUE)]
        responses = [s.__enter__() for s in streams]
        assert all(r.status_code == 200 for r in responses)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert server.health() == {"status": "ok", "model": "tiny", "active": MAX_BATCH, "waiting": MAX_QUEUE}
        for s in streams:
            s.__exit__(None, None, None)
    _wait_idle(server)
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text is not None


def test_64_requests_from_8_clients_give_what_each_gives_alone(server, client, model):
    prompts = ["def push", "class Stack:", "    return n", "fibonacci(n - 1)", "self.items", "def __init__", "x", "if"]
    jobs = [(prompts[i % 8], 4 + i % 9, ("chat", "completion")[i % 2], i % 3 == 0) for i in range(64)]
    expected = {(p, n, kind): alone(model, chat_ids(model, p) if kind == "chat" else model.encode(p), n)[0]
                for p, n, kind, _ in jobs}
    busiest = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            busiest.append(server.health()["active"])
            time.sleep(0.005)

    def run(job):
        prompt, n, kind, stream = job
        if kind == "chat":
            reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=n, stream=stream)
            return "".join(c.choices[0].delta.content or "" for c in reply) if stream else \
                reply.choices[0].message.content
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, stream=stream)
        return "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(run, jobs))
    finally:
        stop.set()
        watcher.join()
    assert texts == [expected[(p, n, kind)] for p, n, kind, _ in jobs]
    assert max(busiest) > 1  # they did decode together


def _hostile_requests(rng: random.Random):
    """(method, path, body bytes) for 200 requests no server should take badly."""
    values = [None, True, False, -1, 0, 2 ** 70, -(2 ** 70), 1e308, 1e-300, -0.0, 0.5, "", "x" * 5000, "\u2603", "\x00",
              [], {}, [[[]]], [None], {"a": {"b": [1]}}, "{{ 7 * 7 }}", "{% for x in range(99999999) %}",
              [{"role": "user"}], [{"role": "user", "content": None}], [{"content": "x"}], "NaN", 3]
    fields = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
              "stream", "n", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
              "stream_options", "tools", "chat_template_kwargs", "max_completion_tokens", "echo", "suffix"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for i in range(200):
        kind = i % 10
        if kind < 5:  # one field of a valid request replaced by something odd
            body = dict(chat) if rng.random() < 0.5 else {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            body[rng.choice(fields)] = rng.choice(values)
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            yield "POST", path, json.dumps(body).encode()
        elif kind == 5:
            yield "POST", "/v1/chat/completions", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        elif kind == 6:
            raw = json.dumps(chat).encode()
            yield "POST", "/v1/chat/completions", raw[:rng.randrange(len(raw))]
        elif kind == 7:
            depth = rng.choice([50, 5000, 100000])
            yield "POST", "/v1/completions", b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
        elif kind == 8:
            yield rng.choice([("GET", "/v1/completions", b""), ("DELETE", "/v1/models", b""),
                              ("GET", "/v1/models/%00..%2f", b""), ("PUT", "/health", b"{}"),
                              ("POST", "/v1/chat/completions", b'"just a string"'),
                              ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "\\ud800"}'),
                              ("POST", "/v1/chat/completions", b'{"model": "tiny", "temperature": NaN}')])
        else:
            content = "".join(chr(rng.randrange(1, 0x2FFFF)) for _ in range(rng.randrange(1, 50)))
            content = content.encode("utf-8", "replace").decode("utf-8")
            yield "POST", "/v1/chat/completions", json.dumps(
                {**chat, "messages": [{"role": "user", "content": content}], "stop": rng.choice(["a", ["\n"]])}).encode()


def test_hostile_requests_leave_it_serving_with_no_traceback(server, client):
    statuses = []
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for method, path, body in _hostile_requests(random.Random(0)):
            response = http.request(method, path, content=body)
            statuses.append(response.status_code)
            assert response.status_code < 500, (method, path, body[:200], response.text)
            if response.status_code >= 400:
                _error(response, response.status_code)
    for raw in (b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n{"):
        with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10) as s:
            s.sendall(raw)
            assert s.recv(100).split(b" ")[1][:1] == b"4"  # a 4xx status line
    assert statuses.count(200) < 100 and len({s for s in statuses if s >= 400}) >= 3
    assert server.health()["status"] == "ok"
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason
    log = server.log()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


def test_an_api_key_is_required_when_set(model):
    from starlette.testclient import TestClient

    from thin.runtime.serve.app import create_app

    with TestClient(create_app(model, name="m", api_key="sekrit")) as http:
        assert http.get("/health").status_code == 200  # for load balancers: no key
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            assert _error(http.get("/v1/models", headers=headers), 401)["code"] == "invalid_api_key"
        assert _error(http.post("/v1/completions", json={"model": "m", "prompt": "x"}), 401)["type"] == \
            "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=http).models.list()
        good = openai.OpenAI(base_url="http://testserver/v1", api_key="sekrit", http_client=http, max_retries=0)
        assert good.completions.create(model="m", prompt="def push", max_tokens=3).usage.completion_tokens == 3


def test_serve_command_binds_loopback_unless_told_and_warns_without_a_key(artifact, monkeypatch):
    from typer.testing import CliRunner

    from thin.runtime.serve import cli
    from thin.runtime.serve.cli import app, is_loopback

    assert all(map(is_loopback, ["127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.10", "example.com"]))
    runs = []
    monkeypatch.setattr(cli, "_run", lambda server, sock, host, port: runs.append((sock.getsockname(), host, port)))
    runner = CliRunner()
    result = runner.invoke(app, [str(artifact), "--port", "0"])
    assert result.exit_code == 0, result.output
    (address, port), host, told = runs[-1]
    assert address == host == "127.0.0.1" and port == told > 0 and "warning" not in result.stderr
    assert f"at http://127.0.0.1:{port}/v1" in result.stderr  # the port --port 0 got, not 0
    result = runner.invoke(app, [str(artifact), "--host", "0.0.0.0", "--port", "0"])
    assert result.exit_code == 0 and runs[-1][0][0] == runs[-1][1] == "0.0.0.0"
    assert "warning: binding 0.0.0.0 without --api-key" in result.stderr
    result = runner.invoke(app, [str(artifact), "--host", "0.0.0.0", "--port", "0", "--api-key", "k"])
    assert "warning" not in result.stderr
    result = runner.invoke(app, [str(artifact.parent / "missing.thin")])
    assert result.exit_code == 1 and "no such artifact" in result.stderr
    # A port taken, an address that is not there, an empty id: one line before the model loads, exit 1.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = str(taken.getsockname()[1])
        for args, match in ((["--port", busy], f"cannot listen on 127.0.0.1 port {busy}"),
                            (["--host", "no-such-host.invalid"], "cannot listen on no-such-host.invalid"),
                            (["--name", " "], "--name is empty")):
            result = runner.invoke(app, [str(artifact), *args])
            assert result.exit_code == 1 and match in result.stderr, result.output
            assert len(result.stderr.strip().splitlines()) == 1 and "thin-exec serve: error:" in result.stderr
    # `thin-exec serve` reaches this command through thin-exec's entry point.
    help_text = subprocess.run([sys.executable, "-m", "thin.runtime.cli", "serve", "--help"], capture_output=True,
                               text=True, check=True).stdout
    for option in ("--host", "--port", "--api-key", "--max-batch", "--max-queue", "--device"):
        assert option in help_text
