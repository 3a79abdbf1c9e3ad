"""Tiny tokenizers with the chat templates of four model families, built here (no hub): Qwen2.5 (ChatML, Hermes tool
calls, tool output as a user turn in <tool_response>), Qwen3 (the same, with <think> blocks kept only after the last
user query), Llama 3.1 (header ids, tool output as an `ipython` turn) and SmolLM2 (plain ChatML, a `tool` turn).
The templates are written here to render these families' formats; they are small but render the same text."""

from __future__ import annotations

_TOOLS_BLOCK = (
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>' }}{%- for tool in tools %}"
    "{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '\\n</tools>\\n\\nFor each function call, return a json object "
    "with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call>' }}")
_TOOL_RESPONSE = (
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}")

QWEN25 = (
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- else %}"
    "{%- set system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}{%- if tools %}{{- '\\n\\n' }}" + _TOOLS_BLOCK + "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}{%- if message.role == 'tool' %}" + _TOOL_RESPONSE +
    "{%- elif not (loop.first and message.role == 'system') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

QWEN3 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}{%- endif %}" + _TOOLS_BLOCK + "{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and not (message.content.startswith('<tool_response>') "
    "and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set content = message.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}" + _TOOL_RESPONSE + "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")

LLAMA3 = (
    "{{- bos_token }}{%- if messages[0].role == 'system' %}{%- set system = messages[0].content | trim %}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{%- if tools %}{{- 'Environment: ipython\\n' }}"
    "{%- endif %}{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{%- if tools %}{{- 'You have access to the following functions. To call a function, respond with JSON of the "
    "form {\"name\": function name, \"parameters\": dictionary of argument name and its value}.\\n\\n' }}"
    "{%- for t in tools %}{{- (t | tojson(indent=4)) + '\\n\\n' }}{%- endfor %}{%- endif %}"
    "{{- system + '<|eot_id|>' }}"
    "{%- for message in rest %}{%- if message.role in ('tool', 'ipython') %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim "
    "+ '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

_CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_QWEN_EXTRA = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
FAMILIES = {  # name: (template, special tokens, eos/end of turn, bos)
    "qwen2.5": (QWEN25, _CHATML + _QWEN_EXTRA, "<|im_end|>", None),
    "qwen3": (QWEN3, _CHATML + _QWEN_EXTRA, "<|im_end|>", None),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>", "<|eom_id|>"], "<|eot_id|>", "<|begin_of_text|>"),
    "smollm2": (SMOLLM2, _CHATML, "<|im_end|>", None),
}


def family_tokenizer(name: str, chat_template: str | None = None):
    """A byte-level BPE tokenizer (transformers PreTrainedTokenizerFast) with the family's specials and template."""
    import transformers
    from tests.helpers_hf import byte_level_bpe

    template, specials, end, bos = FAMILIES[name]
    corpus = ["Please reason step by step. What is 6 * 7? The answer is 42.", "```python\nprint(6 * 7)\n```\n",
              '{"name": "python", "arguments": {"code": "x"}} system user assistant tool ipython'] * 4
    raw = byte_level_bpe(corpus, 400, specials)
    kwargs = {"bos_token": bos} if bos else {}
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=end, pad_token=specials[0], **kwargs)
    fast.chat_template = chat_template or template
    return fast
