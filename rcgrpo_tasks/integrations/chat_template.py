"""A tool-calling chat template for SmolLM2-Instruct (the project's embedded model) and TRL's parser for it.

SmolLM2-135M-Instruct ships a plain ChatML template: it renders `message['content']` only, so an assistant
turn's `tool_calls` vanish and TRL's `supports_tool_calling` rejects it (`GRPOTrainer(tools=...)` and
`GRPOTrainer(environment_factory=...)` then refuse to start). `SMOLLM2_TOOL_CHAT_TEMPLATE` is Qwen2.5's
tool-calling ChatML template with SmolLM2's own default system line in place of Qwen's:
- without tools it renders every conversation of system / user / assistant messages byte for byte as SmolLM2's
  own template does (tests check it), so a prompt-mode task's prompts do not change;
- with tools, the system message is followed by the tools' JSON schemas inside `<tools></tools>`; an assistant
  turn's calls are `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks; tool results come
  back as a user turn of `<tool_response>` blocks;
- it is prefix-preserving (TRL's `is_chat_template_prefix_preserving`), which TRL's tool loop needs.
TRL's response parser for this format is its `qwen3_template` (what `trl.chat_template_utils.add_response_schema`
installs for Qwen2.5's template, which it recognises by identity and so not here).

SmolLM2 was not trained on this format: a model fine-tuned on it (SFT or RL) learns it; the untrained model
rarely emits a well-formed `<tool_call>` block.
"""

from __future__ import annotations

import copy

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
"""The system line SmolLM2's own template adds when a conversation has no system message."""

# Qwen2.5's template (trl/chat_templates/qwen2_5.jinja) with SMOLLM2_DEFAULT_SYSTEM for Qwen's default line.
SMOLLM2_TOOL_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


def _check_chatml(tokenizer) -> None:
    """The template is ChatML: both markers must be single tokens and `<|im_end|>` the EOS (TRL's generation
    stops at EOS and its tool loop splits turns there)."""
    unk = tokenizer.unk_token_id
    for marker in CHATML_TOKENS:
        ids = tokenizer.convert_tokens_to_ids([marker])
        if not ids or ids[0] is None or (unk is not None and ids[0] == unk):
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r}: {marker} is not a token; the tool-calling "
                             "template is ChatML (SmolLM2-Instruct's format)")
    if tokenizer.eos_token != "<|im_end|>":
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r}: EOS is {tokenizer.eos_token!r}, expected "
                         "'<|im_end|>' (ChatML turns end there; TRL stops generating at EOS)")


def install_tool_chat_template(tokenizer):
    """Give a ChatML tokenizer (SmolLM2-Instruct's) the tool-calling template and TRL's matching response parser
    (`tokenizer.chat_template`, `tokenizer.response_template`); returns the same tokenizer, changed in place.
    `save_pretrained` keeps the template. ValueError for a tokenizer that is not ChatML."""
    from trl.chat_template_utils import qwen3_template

    _check_chatml(tokenizer)
    tokenizer.chat_template = SMOLLM2_TOOL_CHAT_TEMPLATE
    tokenizer.response_template = copy.deepcopy(qwen3_template)
    return tokenizer
