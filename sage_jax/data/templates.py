"""Prompt templates: a problem string in, the exact model input text out.

Templates are filled with str.replace, not str.format: math problems are full of LaTeX braces.
"""

from __future__ import annotations

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
        raise ValueError(f"unknown prompt template {template_name!r}; choose one of {sorted(TEMPLATES)}"
                         " or add one with sage_jax.data.templates.register") from None
    return template.replace("{problem}", problem)
