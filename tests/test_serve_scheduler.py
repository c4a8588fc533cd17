"""The server's parts without HTTP: stop strings, request checks, the scheduler, the torch batch backend."""

import threading
import time

import pytest
import torch
from test_runtime_loader import write_tiny_artifact

from thin.runtime import GenerationOptions, load
from thin.runtime.serve import protocol
from thin.runtime.serve.errors import ApiError
from thin.runtime.serve.scheduler import Delta, Done, Failed, Job, NoRoom, Scheduler, SequenceSpec, TorchBackend
from thin.runtime.serve.text import TextStream
from thin.runtime.tokenizer import StreamDecoder, Tokenizer

from tiny_tokenizer import write_tokenizer

# ---- text: stop strings and UTF-8 --------------------------------------------------------------------


class PieceTokenizer:
    """Token i is PIECES[i]; enough of Tokenizer for TextStream."""

    PIECES = ["Hel", "lo", " wor", "ld", "!", "<eos>", "o"]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i == 5))

    def stream(self, skip_special_tokens=True):
        return StreamDecoder(self, skip_special_tokens)


def _shown(stop, ids, finish=True):
    text = TextStream(PieceTokenizer(), stop)
    pieces = [text.put(i) for i in ids]
    if finish:
        pieces.append(text.finish())
    return pieces, text.stopped


def test_stop_string_is_cut_and_its_start_held_back():
    pieces, stopped = _shown(["o wo"], [0, 1, 2, 3])
    assert stopped and "".join(pieces) == "Hell"
    assert pieces[:2] == ["Hel", "l"]  # "o" could begin "o wo": held until " wor" settles it
    pieces, stopped = _shown(["o wx"], [0, 1, 2, 3])
    assert not stopped and "".join(pieces) == "Hello world"
    assert pieces[1] == "l" and pieces[2] == "o wor"  # held, then released when it can't match
    # The earliest match wins; a stop string inside one token cuts that token.
    assert _shown(["ld", "lo"], [0, 1, 2, 3])[0] == ["He", "l", "", "", ""]
    assert "".join(_shown(["wor"], [0, 1, 2])[0]) == "Hello "
    # Held text is released at the end when the sequence stops for another reason.
    assert _shown(["o!"], [0, 6], finish=True)[0] == ["Hel", "", "o"]
    # Nothing after a stop; special tokens are not shown.
    assert "".join(_shown(["lo"], [0, 1, 2, 3, 4])[0]) == "Hel"
    assert "".join(_shown([], [0, 5, 4])[0]) == "Hel!"


def test_multibyte_text_streams_without_replacement_characters(tmp_path):
    write_tokenizer(tmp_path)
    tok = Tokenizer.from_files({n: (tmp_path / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json")})
    text = "héllo wörld ✓ naïve → 東京"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # the byte-level BPE splits characters across tokens
    for stop in ((), ("wörld",), ("東",)):
        stream = TextStream(tok, stop)
        pieces = [stream.put(i) for i in ids] + [stream.finish()]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == (text.split(stop[0])[0] if stop else text)


# ---- protocol: strict requests --------------------------------------------------------------------

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("change, param", [
    ({"temperature": "1"}, "temperature"), ({"temperature": 3}, "temperature"), ({"temperature": True}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 1.5}, "max_tokens"), ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"), ({"seed": 2 ** 64}, "seed"), ({"n": 2}, "n"),
    ({"frequency_penalty": 3}, "frequency_penalty"), ({"stream": "yes"}, "stream"),
    ({"logit_bias": {"5": 1}}, "logit_bias"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"logprobs": True}, "logprobs"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"frobnicate": 1}, "frobnicate"), ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0.content"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"model": 5}, "model"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
])
def test_bad_parameters_are_400_naming_the_parameter(change, param):
    with pytest.raises(ApiError) as e:
        protocol.parse(protocol.ChatRequest, {**BASE, **change})
    assert e.value.status == 400 and e.value.param.startswith(param), e.value.message
    assert e.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{", b"[1,", b'{"a": NaN}', b'{"a": Infinity}', b'{"a": 1e999}',
                                 b'{"a": "\\ud800"}', b"\xff\xfe", b"[" * 100000 + b"]" * 100000,
                                 b'{"a": ' + b"9" * 5000 + b"}"])
def test_malformed_json_is_400(raw):
    with pytest.raises(ApiError) as e:
        protocol.parse_json(raw)
    assert e.value.status == 400
    assert "sys.set_int_max_str_digits" not in e.value.message  # advice for the server's Python, not the client
    e.value.encode()  # the error body itself always encodes


def test_accepted_requests_and_fields_that_do_not_change_text():
    req = protocol.parse(protocol.ChatRequest, {
        **BASE, "user": "u", "metadata": {"a": "b"}, "top_k": -1, "stop": "x", "stream": True,
        "stream_options": {"include_usage": True}, "tool_choice": "none", "response_format": {"type": "text"},
        "messages": [{"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                     {"role": "assistant", "content": "c", "refusal": None, "tool_calls": None}]})
    assert [m.as_template_input() for m in req.messages] == [{"role": "system", "content": "ab"},
                                                           {"role": "assistant", "content": "c"}]
    assert protocol.stop_strings(["a", "b"]) == ("a", "b")
    with pytest.raises(ApiError):
        protocol.stop_strings(["a", "b", "c", "d", "e"])
    with pytest.raises(ApiError):
        protocol.stop_strings([""])
    completion = protocol.parse(protocol.CompletionRequest, {"model": "m", "prompt": [[1, 2, 3]]})
    assert completion.prompt == [[1, 2, 3]]


# ---- the scheduler over a backend that records what it is asked ----------------------------------


class FakeBackend:
    """Sequence `id` produces tokens 10*id + 1, 10*id + 2, ...; token 0 (an EOS) when the prompt says so."""

    def __init__(self, fail_step_at=None, room=None):
        self.steps: list[set[int]] = []  # the active ids of each step
        self.removed: list[int] = []
        self.active: dict[int, list] = {}
        self.fail_step_at = fail_step_at
        self.needs: dict[int, int] = {}
        self.room = room  # sequences that fit at once (a KV pool); a 4-token prompt takes it all, 5 more

    def add(self, spec: SequenceSpec) -> int:
        need = {4: self.room, 5: (self.room or 0) + 1}.get(len(spec.prompt), 1)
        if self.room is not None and sum(self.needs.get(i, 1) for i in self.active) + need > self.room:
            raise NoRoom
        self.needs[spec.id] = need
        self.active[spec.id] = [spec, 0]
        return self._next(spec.id)

    def step(self) -> dict[int, int]:
        self.steps.append(set(self.active))
        if self.fail_step_at == len(self.steps):
            raise RuntimeError("boom")
        time.sleep(0.002)
        return {i: self._next(i) for i in self.active}

    def _next(self, i):
        spec, n = self.active[i]
        self.active[i][1] = n + 1
        return 0 if spec.prompt[0] == n else 10 * (i % 1000) + n + 1

    def remove(self, seq_id):
        self.removed.append(seq_id)
        self.active.pop(seq_id, None)


class Collect:
    def __init__(self):
        self.events = []
        self.done = threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if not isinstance(event, Delta):
            self.done.set()


class DigitsTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids if i != 0)

    def stream(self, skip_special_tokens=True):
        return StreamDecoder(self, skip_special_tokens)


def _job(max_new, eos_at=99, stop=()):
    sink = Collect()
    options = GenerationOptions(max_new_tokens=max_new, stop_token_ids=(0,))
    return Job([eos_at, 5, 6], options, DigitsTokenizer(), sink, stop), sink


def test_requests_join_and_leave_between_steps_within_the_batch_limit():
    backend = FakeBackend()
    scheduler = Scheduler(backend, max_batch=3, max_queue=10)
    scheduler.start()
    try:
        jobs = [_job(max_new=2 + i) for i in range(8)]
        eos_job = _job(max_new=50, eos_at=3)
        for job, _ in jobs + [eos_job]:
            scheduler.submit(job)
        for _, sink in jobs + [eos_job]:
            assert sink.done.wait(10)
        assert max(len(s) for s in backend.steps) == 3  # full batches, never more
        for job, sink in jobs:
            deltas = "".join(e.text for e in sink.events if isinstance(e, Delta))
            i = job.id % 1000
            assert deltas == "".join(f"<{10 * i + n}>" for n in range(1, job.options.max_new_tokens + 1))
            assert sink.events[-1] == Done("length", 3, job.options.max_new_tokens)
        assert eos_job[1].events[-1] == Done("stop", 3, 4)  # three tokens, then the stop token
        assert sorted(backend.removed) == sorted(j.id for j, _ in jobs + [eos_job]) and not backend.active
        assert scheduler.load() == {"active": 0, "waiting": 0}
    finally:
        scheduler.close()


def test_a_cancelled_request_leaves_before_the_next_step_and_the_queue_is_bounded():
    backend = FakeBackend()
    scheduler = Scheduler(backend, max_batch=1, max_queue=1)
    scheduler.start()
    try:
        long_job, long_sink = _job(max_new=100000)
        scheduler.submit(long_job)
        waiting, waiting_sink = _job(max_new=3)
        scheduler.submit(waiting)
        with pytest.raises(ApiError) as e:
            scheduler.submit(_job(max_new=3)[0])
        assert e.value.status == 429
        while not backend.steps:
            time.sleep(0.001)
        scheduler.cancel(long_job)
        assert waiting_sink.done.wait(10)  # its place came free
        assert long_job.id in backend.removed and not long_sink.done.is_set()
        assert all(long_job.id not in s for s in backend.steps[backend.steps.index({waiting.id}):])
    finally:
        scheduler.close()
    with pytest.raises(ApiError) as e:
        scheduler.submit(_job(max_new=3)[0])
    assert e.value.status == 503


def test_requests_the_backend_has_no_room_for_wait_until_a_sequence_leaves():
    backend = FakeBackend(room=2)
    scheduler = Scheduler(backend, max_batch=4, max_queue=8)
    scheduler.start()
    try:
        jobs = [_job(max_new=3 + i) for i in range(6)]
        whole, whole_sink = _job(max_new=3)
        whole.prompt.append(7)  # needs the whole pool: it waits until the batch is empty
        never, never_sink = _job(max_new=3)
        never.prompt.extend([7, 8])  # needs more than the pool
        for job, _ in jobs[:3] + [(whole, whole_sink)] + jobs[3:] + [(never, never_sink)]:
            scheduler.submit(job)
        for _, sink in jobs + [(whole, whole_sink), (never, never_sink)]:
            assert sink.done.wait(10)
        assert all(isinstance(sink.events[-1], Done) for _, sink in jobs)
        assert max(len(s) for s in backend.steps) == 2  # the backend's room, not max_batch
        assert whole_sink.events[-1] == Done("length", 4, 3) and {whole.id} in backend.steps
        assert isinstance(never_sink.events[-1], Failed) and "KV cache" in never_sink.events[-1].message
        # Waiting kept the order: nothing submitted after the whole-pool request ran before it.
        first_step = {j.id: next(i for i, s in enumerate(backend.steps) if j.id in s) for j, _ in jobs + [(whole, 0)]}
        assert all(first_step[j.id] > first_step[whole.id] for j, _ in jobs[3:])
    finally:
        scheduler.close()


def test_a_failing_step_fails_its_requests_and_the_scheduler_goes_on(caplog):
    backend = FakeBackend(fail_step_at=2)
    scheduler = Scheduler(backend, max_batch=4, max_queue=4)
    scheduler.start()
    try:
        failed, failed_sink = _job(max_new=10)
        scheduler.submit(failed)
        assert failed_sink.done.wait(10) and isinstance(failed_sink.events[-1], Failed)
        later, later_sink = _job(max_new=3)
        scheduler.submit(later)
        assert later_sink.done.wait(10) and later_sink.events[-1] == Done("length", 3, 3)
    finally:
        scheduler.close()
    assert "decode step failed" in caplog.text


# ---- the torch backend gives each sequence what generate gives it alone ---------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-backend")
    write_tiny_artifact(tmp / "tiny.thin", tmp)
    return load(tmp / "tiny.thin")


def test_torch_backend_batch_equals_generate_alone(model):
    prompts = [model.encode(p) for p in ("def push", "class Stack:", "return n", "    if n < 2:")]
    cases = [dict(temperature=0.0), dict(temperature=1.0, seed=3, top_k=40, repetition_penalty=1.3),
             dict(temperature=0.8, seed=11, top_p=0.9, min_p=0.05)]
    backend = TorchBackend(model.executor)
    for case in cases:
        options = model.generation_options(max_new_tokens=12, **case)
        alone = [list(model.generate(p, max_new_tokens=12, stop_token_ids=(), **case)) for p in prompts]
        got = {i: [backend.add(SequenceSpec(i, p, options))] for i, p in enumerate(prompts[:2])}
        for step in range(14):
            if step == 3:  # two more join mid-way
                got.update({i: [backend.add(SequenceSpec(i, p, options))] for i, p in enumerate(prompts) if i >= 2})
            for i, token in backend.step().items():
                got[i].append(token)
                if len(got[i]) == 12:  # and leave as they finish
                    backend.remove(i)
        assert got == dict(enumerate(alone)), case


def test_frequency_and_presence_penalties_follow_openai(model):
    prompt = model.encode("def push")
    spec = SequenceSpec(1, prompt, model.generation_options(max_new_tokens=16, stop_token_ids=()),
                        frequency_penalty=2.0)
    plain = list(model.generate(prompt, max_new_tokens=16, stop_token_ids=()))
    backend = TorchBackend(model.executor)
    tokens = [backend.add(spec)] + [backend.step()[1] for _ in range(15)]
    # Penalised greedy decoding, reproduced by hand from plain logits.
    ids, counts = list(prompt), torch.zeros(model.ir.vocab_size)
    expected = []
    for _ in range(16):
        logits = model.forward(ids)[-1] - 2.0 * counts
        token = int(logits.argmax())
        expected.append(token)
        ids.append(token)
        counts[token] += 1
    assert tokens == expected
    assert len(set(tokens)) > len(set(plain))  # the penalty does change the text


def test_the_most_extreme_parameters_accepted_still_generate(model):
    """Every value the schema lets through samples without overflow: tiny temperatures become greedy,
    penalties are bounded so a penalised logit stays finite."""
    extremes = [{"temperature": 1e-300, "seed": -(2 ** 63)}, {"temperature": 2.0, "top_p": 1e-9, "seed": 2 ** 64 - 1},
                {"temperature": 1e-5, "repetition_penalty": 0.01, "seed": 1},
                {"temperature": 2.0, "repetition_penalty": 100.0, "min_p": 1.0, "top_k": 1, "seed": 2},
                {"temperature": 1.0, "frequency_penalty": -2.0, "presence_penalty": 2.0, "top_k": 10 ** 30, "seed": 3}]
    backend = TorchBackend(model.executor)
    for i, fields in enumerate(extremes):
        request = protocol.parse(protocol.CompletionRequest, {"model": "m", "prompt": "def push", "max_tokens": 24,
                                                              **fields})
        prepared = protocol.prepare(model, request, protocol.completion_prompt(model, request))
        if fields["temperature"] < protocol.MIN_TEMPERATURE:
            assert prepared.options.greedy
        spec = SequenceSpec(i, prepared.prompt, prepared.options, prepared.frequency_penalty, prepared.presence_penalty)
        tokens = [backend.add(spec)] + [backend.step()[i] for _ in range(23)]
        backend.remove(i)
        assert all(0 <= t < model.ir.vocab_size for t in tokens)
    for bad in ({"repetition_penalty": 0.001}, {"repetition_penalty": 1000.0}):
        with pytest.raises(ApiError):
            protocol.parse(protocol.CompletionRequest, {"model": "m", "prompt": "x", **bad})


class SlowPrefillBackend(FakeBackend):
    """FakeBackend whose prefill (add) waits until the test lets it go."""

    def __init__(self):
        super().__init__()
        self.entered, self.go = threading.Event(), threading.Event()

    def add(self, spec):
        self.entered.set()
        assert self.go.wait(10)
        return super().add(spec)


def test_requests_being_admitted_still_hold_their_places():
    """A job taken off the queue for its prefill is in neither list until it joins the batch: the
    queue must still count it, or one request too many gets in while a prefill runs."""
    backend = SlowPrefillBackend()
    scheduler = Scheduler(backend, max_batch=2, max_queue=1)
    scheduler.start()
    try:
        sinks = []
        for _ in range(3):
            job, sink = _job(max_new=100000)
            scheduler.submit(job)
            sinks.append((job, sink))
        assert backend.entered.wait(10)  # the scheduler is inside the first prefill
        with pytest.raises(ApiError) as e:
            scheduler.submit(_job(max_new=3)[0])
        assert e.value.status == 429
        backend.go.set()
        while not backend.steps:
            time.sleep(0.001)
        with pytest.raises(ApiError) as e:
            scheduler.submit(_job(max_new=3)[0])
        assert e.value.status == 429
        for job, _ in sinks:
            scheduler.cancel(job)
    finally:
        backend.go.set()
        scheduler.close()
