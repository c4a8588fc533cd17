"""The OpenAI API as this server speaks it: request schemas, their checks, and response bodies.

A request is parsed strictly (no "5" for 5, no NaN, no unknown fields) and every refusal is an
ApiError naming the parameter. Fields a client may send that do not change the text (user,
metadata, ...) are accepted and unused; fields asking for something thin does not do (n > 1,
logprobs, tools, ...) are refused rather than ignored, so a client never gets silently less
than it asked for. Sampling fields omitted from a request take the artifact's generation_config
defaults, exactly as `thin-exec` does, so the same options give the same text there and here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from thin.runtime.sampling import MIN_TEMPERATURE, PENALTY_RANGE, GenerationOptions

from .errors import ApiError
from .limits import MAX_STOP_CHARS, MAX_STOP_STRINGS

# Below MIN_TEMPERATURE a request's temperature means greedy (vLLM's threshold too).


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # extension (vLLM's name); -1 or 0: off
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # extension
    # Extension: transformers' multiplicative penalty; bounded so a penalised logit stays finite.
    repetition_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logit_bias: dict[str, float] | None = None
    # Accepted and unused: they do not change the text.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"n={self.n}: this server returns one choice per request", param="n")
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    # What openai's client writes back when a reply's message is appended as is; None only.
    refusal: None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None
    tool_calls: list[Any] | None = None

    def as_template_input(self) -> dict:
        if self.tool_calls:
            raise ApiError(400, "tool calls are not supported", param="messages")
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        fields = {"role": self.role, "content": content, "name": self.name, "tool_call_id": self.tool_call_id,
                  "reasoning_content": self.reasoning_content}
        return {k: v for k, v in fields.items() if v is not None}


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM's name): extra template variables

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs or self.top_logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        if self.tools or self.tool_choice not in (None, "none"):
            raise ApiError(400, "tools are not supported", param="tools")
        if self.response_format not in (None, {"type": "text"}):
            raise ApiError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format")
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise ApiError(400, "max_tokens and max_completion_tokens differ; send one", param="max_tokens")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise ApiError(400, "suffix (insertion) is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise ApiError(400, "best_of is not supported", param="best_of")
        if self.logprobs is not None:
            raise ApiError(400, "logprobs are not supported", param="logprobs")


def parse_json(raw: bytes) -> Any:
    """The JSON value of a request body; 400 for anything but strict UTF-8 JSON with finite numbers."""

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"number out of range: {text[:40]}")
        return value

    def refuse_constant(name: str):
        raise ValueError(f"{name} is not JSON")

    def integer(text: str) -> int:
        if len(text.lstrip("-")) > 40:  # no field takes more; Python's own refusal names an interpreter setting
            raise ValueError(f"an integer of {len(text)} digits is out of range")
        return int(text)

    try:
        value = json.loads(raw.decode("utf-8"), parse_float=finite, parse_int=integer,
                           parse_constant=refuse_constant)
        # Lone surrogates ("\ud800") parse but are not text: nothing downstream could encode them.
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError, UnicodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {str(e)[:200]}") from None
    return value


def parse(schema: type[_Sampling], body: Any) -> _Sampling:
    """`body` checked against `schema`; the first problem becomes a 400 naming its parameter."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        request = schema.model_validate(body)
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            raise ApiError(400, f"unrecognized request argument supplied: {param}", param=param) from None
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise ApiError(400, f"{param}: {first['msg']}{more}", param=param) from None
    request.refuse_unsupported()
    return request


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise ApiError(400, f"a stop string has 1 to {MAX_STOP_CHARS} characters", param="stop")
    return tuple(stops)


@dataclass(frozen=True)
class Prepared:
    """A checked request, ready for the scheduler."""

    prompt: list[int]
    options: GenerationOptions
    frequency_penalty: float
    presence_penalty: float
    stop: tuple[str, ...]


def chat_prompt(model, request: ChatRequest) -> list[int]:
    """The prompt ids for chat `messages`: the template rendered as transformers does, encoded without
    special tokens (the template writes its own), as `thin-exec` does for a chat turn."""
    if model.chat_template is None:
        raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
    messages = [m.as_template_input() for m in request.messages]
    variables = dict(request.chat_template_kwargs or {})
    # As vLLM: the extra variables may turn the generation prompt off (to continue the last message).
    generation_prompt = variables.pop("add_generation_prompt", True)
    if not isinstance(generation_prompt, bool):
        raise ApiError(400, "chat_template_kwargs.add_generation_prompt must be true or false",
                       param="chat_template_kwargs")
    taken = sorted({"messages", "tools"} & variables.keys())
    if taken:
        raise ApiError(400, f"chat_template_kwargs cannot set {taken[0]!r}: it is the request's own field",
                       param="chat_template_kwargs")
    try:
        text = model.render_chat(messages, add_generation_prompt=generation_prompt, **variables)
    except Exception as e:  # noqa: BLE001 -- the template is code; whatever it raises, these messages caused it
        raise ApiError(400, f"the chat template cannot render these messages: {type(e).__name__}: "
                            f"{str(e)[:300]}", param="messages") from None
    return model.encode(text, add_special_tokens=False)


def completion_prompt(model, request: CompletionRequest) -> list[int]:
    """The prompt ids: text is encoded with special tokens (as `thin-exec --raw`), ids are taken as given."""
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"one prompt per request, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return model.encode(prompt, add_special_tokens=True)
    vocab = model.ir.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary (0 .. {vocab - 1})", param="prompt")
    return list(prompt)


def prepare(model, request: _Sampling, prompt: list[int]) -> Prepared:
    """Bound `prompt` and max_tokens by the model's context and build the generation options."""
    context = model.ir.max_position_embeddings
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if len(prompt) >= context:
        raise ApiError(400, f"the prompt is {len(prompt)} tokens; this model's context is {context}, and at "
                            "least one must be left to generate",
                       param="messages" if isinstance(request, ChatRequest) else "prompt",
                       code="context_length_exceeded")
    asked = request.max_tokens
    if asked is None and isinstance(request, ChatRequest):
        asked = request.max_completion_tokens
    if asked is not None and len(prompt) + asked > context:
        raise ApiError(400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({asked}) exceeds this model's "
                            f"context of {context} tokens", param="max_tokens", code="context_length_exceeded")
    temperature = request.temperature
    if temperature is not None and temperature < MIN_TEMPERATURE:
        temperature = 0.0  # the limit of sampling as the temperature falls; dividing by it would overflow
    overrides = {"temperature": temperature, "top_p": request.top_p, "min_p": request.min_p,
                 "top_k": 0 if request.top_k == -1 else request.top_k,
                 "repetition_penalty": request.repetition_penalty, "seed": request.seed}
    try:
        options = model.generation_options(**overrides)
        # Omitted: the artifact's default, cut to the room the context leaves.
        new = asked if asked is not None else min(options.max_new_tokens, context - len(prompt))
        options = model.generation_options(max_new_tokens=new, **overrides)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    return Prepared(prompt, options, request.frequency_penalty, request.presence_penalty, stop_strings(request.stop))


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_body(ident: str, created: int, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": ident, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}],
            "usage": use}


def chat_chunk(ident: str, created: int, model: str, delta: dict, finish: str | None = None) -> dict:
    return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def completion_body(ident: str, created: int, model: str, text: str, finish: str | None,
                    use: dict | None) -> dict:
    """A text_completion object; a streamed chunk has the same shape, finish None and no usage until the end."""
    body = {"id": ident, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if use is not None:
        body["usage"] = use
    return body


def usage_chunk(ident: str, created: int, model: str, obj: str, use: dict) -> dict:
    """The last streamed chunk when stream_options.include_usage is set: no choices, the usage."""
    return {"id": ident, "object": obj, "created": created, "model": model, "choices": [], "usage": use}
