"""Prompt templates: a problem string in, the exact model input text out.

Templates are filled with str.replace, not str.format: math problems are full of LaTeX braces. Two names are not
templates but ask for the model's own chat template (tokenizer_config.json's Jinja), rendered once around a
"{problem}" slot by `resolve`: "chat" (error if the tokenizer has none) and "auto" (the chat template when there is
one, else the system prompt and instruction as plain text). The system prompt and the user instruction come from
the config (data.system_prompt, data.instruction).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

log = logging.getLogger("sage_jax")

# Common evaluation prompt for Qwen2.5-Math base models (see paper/IMPLEMENTATION_FACTS.md).
QWEN_MATH_BOXED = (
    "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
    "<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n"
)

# R1-Zero style: reasoning inside <think>, the final answer inside <answer>; the text continues after "Assistant:".
R1_THINK = (
    "A conversation between User and Assistant. The User asks a question and the Assistant solves it. The Assistant "
    "first thinks through the reasoning process and then gives the final answer. The reasoning is enclosed in "
    "<think> </think> tags and the answer in <answer> </answer> tags, i.e. <think> reasoning here </think> "
    "<answer> answer here </answer>.\nUser: {problem}\nAssistant:"
)

CHAT, AUTO = "chat", "auto"
# Registered names whose text the model's own chat template rendered (it writes any BOS itself); other templates are
# plain text, to which a prompt's encoder adds the BOS the tokenizer would (Tokenizer.with_bos).
_CHAT_RENDERED: set[str] = set()
_FALLBACKS_LOGGED: set[str] = set()
# The user message around a math problem when the model's own chat template renders it (data.instruction).
MATH_INSTRUCTION = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."

TEMPLATES: dict[str, str] = {
    "qwen_math_boxed": QWEN_MATH_BOXED,
    "r1_think": R1_THINK,
    "plain": "{problem}",
}


def register(name: str, template: str) -> None:
    if "{problem}" not in template:
        raise ValueError(f"template {name!r} has no '{{problem}}' placeholder")
    TEMPLATES[name] = template


def render(template_name: str, problem: str) -> str:
    try:
        template = TEMPLATES[template_name]
    except KeyError:
        if template_name in (CHAT, AUTO):
            raise ValueError(f"prompt template {template_name!r} is the model's chat template: resolve it first with "
                             "sage_jax.data.templates.resolve(name, tokenizer, system, instruction)") from None
        raise ValueError(f"unknown prompt template {template_name!r}; choose one of {sorted(TEMPLATES)}"
                         " or add one with sage_jax.data.templates.register") from None
    return template.replace("{problem}", problem)


def is_chat(name: str) -> bool:
    """Whether a resolved template name is the model's chat template rendered (not plain text)."""
    return name in _CHAT_RENDERED


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(getattr(tokenizer, "hf", None), "chat_template", None))


def chat_template_text(tokenizer: Any, system: str = "", instruction: str = "{problem}", tools=None) -> str:
    """The model's chat template rendered once around a "{problem}" slot: [system], user, generation prompt (and the
    tools' schemas where the run calls tools through the template, rollout.tool_format 'hermes')."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": instruction}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **({"tools": tools} if tools else {}))
    if text.count("{problem}") != 1:
        raise ValueError("the tokenizer's chat template does not keep the user message verbatim (one '{problem}' "
                         "slot); set data.template to a named template such as 'qwen_math_boxed'")
    return text


def resolve(name: str, tokenizer: Any = None, system: str = "", instruction: str = "{problem}", tools=None) -> str:
    """A render()-able template name: `name` itself, or for "chat" / "auto" the model's own template, registered."""
    if name not in (CHAT, AUTO):
        if name not in TEMPLATES:
            render(name, "")  # the unknown-template error
        return name
    instruction = instruction or "{problem}"
    if "{problem}" not in instruction:
        raise ValueError(f"data.instruction={instruction!r} has no '{{problem}}' placeholder")
    if has_chat_template(tokenizer):
        text = chat_template_text(tokenizer, system, instruction, tools)
    elif name == CHAT:
        raise ValueError("data.template='chat' but the tokenizer has no chat template; use data.template='auto' "
                         "or a named template such as 'qwen_math_boxed'")
    else:
        text = (system + "\n\n" if system else "") + instruction
    key = f"{name}:{hashlib.sha1(text.encode()).hexdigest()[:10]}"
    TEMPLATES[key] = text
    if has_chat_template(tokenizer):
        _CHAT_RENDERED.add(key)
    else:
        _CHAT_RENDERED.discard(key)
        if key not in _FALLBACKS_LOGGED:
            _FALLBACKS_LOGGED.add(key)
            log.info("data.template='auto': the tokenizer has no chat template, so prompts are plain text (the "
                     "system prompt and data.instruction), with the BOS the tokenizer adds, if any")
    return key


def resolve_for(data_config: Any, tokenizer: Any, name: str | None = None, tools=None) -> str:
    """resolve() with the system prompt and instruction of a config's `data` section (defaults where absent)."""
    get = getattr(data_config, "get", lambda k, default=None: default)
    return resolve(name or str(get("template", AUTO)), tokenizer, str(get("system_prompt", "") or ""),
                   str(get("instruction", MATH_INSTRUCTION) or MATH_INSTRUCTION), tools)
