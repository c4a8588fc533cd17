"""Chat templates render exactly as transformers' apply_chat_template(tokenize=False)."""

import jinja2
import pytest
from test_runtime_tokenizer import _files, byte_level_bpe

from thin.runtime.chat_template import ChatTemplate, ChatTemplateError, render_chat
from thin.runtime.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

# Qwen-style ChatML: default system prompt, tools through tojson, namespace, loop.last.
CHATML = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}
    {{- "# Tools\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}{{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(count=0) %}
{%- for message in messages %}
    {%- if message.role == 'system' and tools %}{% continue %}{% endif %}
    {%- set ns.count = ns.count + 1 %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}
    {%- if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}
    {%- else %}{{ message.content }}{% endif %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""

# Llama-3-style: bos from the tokenizer, roles must alternate, a date via strftime_now.
LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + strftime_now("%d %b %Y") + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Llama-2 / Mistral-style with block tags on their own lines: trim_blocks and lstrip_blocks matter.
INST = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'user' %}
[INST] {{ message['content'] }} [/INST]
    {% elif message['role'] == 'assistant' %}
{{ message['content'] }}{{ eos_token }}
    {% else %}
{{ raise_exception('Only user and assistant roles are supported!') }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}
{{ dict(a=1, b='<&>') | tojson }} {{ {'ü': 'é'} | tojson(indent=2) }}
"""

CHAT = [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi <b>there</b> & ünïcode 🦊"},
        {"role": "assistant", "content": "Hello!", "tool_calls": None},
        {"role": "user", "content": "And now?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für <Ort>",
                                           "parameters": {"type": "object", "properties": {}}}}]
CONFIG = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<|endoftext|>"}


@pytest.fixture(scope="module")
def tokenizers_pair(tmp_path_factory):
    """Our tokenizer and transformers' loaded from the same tiny byte-level BPE files."""
    backend = byte_level_bpe()
    path = tmp_path_factory.mktemp("tok")
    for name, data in _files(backend, {"tokenizer_class": "PreTrainedTokenizerFast", **CONFIG}).items():
        (path / name).write_bytes(data)
    return Tokenizer.from_files(_files(backend, CONFIG)), transformers.AutoTokenizer.from_pretrained(str(path))


CASES = [
    (CHATML, CHAT, True, {}),
    (CHATML, CHAT[1:], False, {}),
    (CHATML, CHAT, True, {"tools": TOOLS}),
    (CHATML, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "hmm"}],
     False, {}),
    (LLAMA3, CHAT, True, {}),
    (LLAMA3, CHAT[1:], False, {}),
    (INST, CHAT[1:], True, {}),
    (INST, CHAT[1:3], False, {}),
]


@pytest.mark.parametrize("template,messages,add_generation_prompt,extra", CASES)
def test_renders_like_transformers(tokenizers_pair, template, messages, add_generation_prompt, extra):
    ours, theirs = tokenizers_pair
    expected = theirs.apply_chat_template(messages, chat_template=template, tokenize=False,
                                          add_generation_prompt=add_generation_prompt, **extra)
    got = ChatTemplate(template, ours.special_tokens_map).render(
        messages, add_generation_prompt=add_generation_prompt, **extra)
    assert got == expected
    assert got  # a template that renders nothing would make this test vacuous


def test_generation_prompt_changes_the_output(tokenizers_pair):
    ours, _ = tokenizers_pair
    with_prompt = render_chat(LLAMA3, CHAT, add_generation_prompt=True, special_tokens=ours.special_tokens_map)
    without = render_chat(LLAMA3, CHAT, add_generation_prompt=False, special_tokens=ours.special_tokens_map)
    assert with_prompt == without + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert with_prompt.startswith("<s><|start_header_id|>system")


@pytest.mark.parametrize("template", [LLAMA3, INST])
def test_raise_exception_on_bad_roles(tokenizers_pair, template):
    ours, theirs = tokenizers_pair
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    if template is INST:
        bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(jinja2.TemplateError) as expected:
        theirs.apply_chat_template(bad, chat_template=template, tokenize=False)
    with pytest.raises(ChatTemplateError) as got:
        ChatTemplate(template, ours.special_tokens_map).render(bad)
    assert str(got.value) == str(expected.value)


def test_sandbox_refuses_mutation_and_dunder_access():
    # The sandbox's refusals arrive as ChatTemplateError (a jinja2.TemplateError) naming them.
    with pytest.raises(ChatTemplateError, match="SecurityError.*unsafe"):
        render_chat("{{ messages.append(1) }}", CHAT)
    with pytest.raises(ChatTemplateError, match="SecurityError.*underscore"):
        render_chat("{% set ns = namespace(_x=1) %}", CHAT)
    assert render_chat("{{ ''.__class__ }}", CHAT) == ""  # unsafe attributes read as undefined


def test_named_templates_and_errors():
    assert ChatTemplate({"default": "A", "tool_use": "B"}).render(CHAT) == "A"
    assert ChatTemplate([{"name": "default", "template": "C"}]).render(CHAT) == "C"
    with pytest.raises(ValueError, match="default"):
        ChatTemplate({"tool_use": "B"})
    with pytest.raises(ValueError, match="empty"):
        ChatTemplate("x").render([])
