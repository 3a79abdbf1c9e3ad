"""Finding a tool call at the end of the model's text, in one of two formats:

- "markdown" (math tool-integrated reasoning): a closed ```python block; the output comes back as a ```output block.
- "hermes" (the Qwen2.5 / Qwen3 templates' tool calls): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

    find_call("Let me compute.\\n```python\\nprint(2 + 2)\\n```", "markdown")   # ToolCall("python", "print(2 + 2)\\n")
    find_call("no call here", "markdown")                                        # None

A call that is there but malformed (bad JSON, no name) is a ToolCall with `error` set: the model gets the error as
its observation, the episode goes on.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

FORMATS = ("markdown", "hermes")
END_MARKERS = {"markdown": "```", "hermes": "</tool_call>"}
_MARKDOWN = re.compile(r"[ \t]*\n(.*?)```\s*$", re.DOTALL)
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>\s*$", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str | None
    arguments: Any
    error: str | None = None


def check_format(call_format: str) -> str:
    if call_format not in FORMATS:
        raise ValueError(f"unknown tool-call format {call_format!r}; use one of {FORMATS}")
    return call_format


def find_call(text: str, call_format: str) -> ToolCall | None:
    """The call that `text` ends with, or None where it ends with no call."""
    if check_format(call_format) == "markdown":
        start = text.rfind("```python")
        match = _MARKDOWN.match(text, start + len("```python")) if start >= 0 else None
        if match is None or "```" in match.group(1):
            return None
        return ToolCall("python", match.group(1))
    match = _HERMES.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError as e:
        return ToolCall(None, None, f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(None, None, 'a tool call is {"name": "...", "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return ToolCall(call["name"], arguments)
