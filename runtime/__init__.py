"""thin's runtime: load a .thin artifact and run it (forward, generate, chat, perplexity).

Importing this package loads torch, tokenizers and jinja2 only: never the compiler,
the passes, transformers or triton (a test checks). The CLI (typer) lives in
`thin.runtime.cli` and is imported only by the `thin-exec` entry point.
"""

from .chat_template import ChatTemplate, ChatTemplateError, render_chat
from .generate import (
    ContextTooLongError,
    ConversationCache,
    GenerationStats,
    decode_n_tokens,
    decode_one_token,
    generate,
    prefill,
)
from .loader import DeviceUnavailableError, FFNLevelError, NoChatTemplateError, ThinModel, load, resolve_device
from .perplexity import (
    PerplexityResult,
    Window,
    evaluate_perplexity,
    iter_logprobs,
    perplexity,
    token_logprobs,
)
from .sampling import GenerationOptions, process_logits, sample_next
from .tokenizer import StreamDecoder, Tokenizer, TokenizerError

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "ContextTooLongError",
    "ConversationCache",
    "DeviceUnavailableError",
    "FFNLevelError",
    "GenerationOptions",
    "GenerationStats",
    "NoChatTemplateError",
    "PerplexityResult",
    "StreamDecoder",
    "ThinModel",
    "Tokenizer",
    "TokenizerError",
    "Window",
    "decode_n_tokens",
    "decode_one_token",
    "evaluate_perplexity",
    "generate",
    "iter_logprobs",
    "load",
    "perplexity",
    "prefill",
    "process_logits",
    "render_chat",
    "resolve_device",
    "sample_next",
    "token_logprobs",
]
