"""Multi-turn rows, token in and token out: a row is its prompt followed by segments, each *sampled* (the policy drew
it: trained, with its behaviour log-probs) or *observed* (a tool's output and whatever text the template puts around
it: never trained, behaviour log-probs NaN). Nothing is re-rendered or re-tokenised: each segment's ids are kept as
they were drawn or tokenised, once.

    row = TurnRow(prompt_ids)
    row.add_sampled(ids, logprobs)                     # turn 1: the model's text up to its tool call's end
    row.add_observed(turns.observation_ids(messages, tool_output))
    row.add_sampled(ids2, logprobs2)                   # turn 2 ...
    row.completion_ids(), row.sampled_mask(), row.behaviour_logprobs()   # what the loss reads (NaN where observed)
    row.check_consumed(ids_the_sampler_consumed)       # every turn: the sampler's ids are the segments, exactly

How a tool's output becomes observed ids (ToolTurns):
- "template" (the Hermes-style tool calls of the Qwen2.5 / Qwen3 templates, and any chat template): the template's
  text for the conversation so far plus the tool message (and the next assistant header), minus its text for the
  conversation so far; what remains also closes the model's turn where the model stopped before its end-of-turn
  token. Where the template formats the last assistant turn apart (Qwen3 keeps an empty <think> block only in the
  last turn), the earlier turns must be unchanged and the model's turn is read through neutral text; a template that
  rewrites earlier turns is refused, naming the first difference.
- "plain" (```python blocks, math tool-integrated reasoning): the output goes back in the same turn inside a fixed
  wrapper, "```output\\n...\\n```" (a tool rollout adds the newline after it as a token of its own: the tokens that
  end with a fence are where rows pause for their calls, and a row that comes back may not end in one).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

PLAIN_WRAPPER = "```output\n{output}\n```"
_PROBE = "sage-jax assistant turn probe"


@dataclasses.dataclass(frozen=True)
class Segment:
    ids: tuple[int, ...]
    sampled: bool
    logprobs: tuple[float, ...] | None = None  # the behaviour policy's, for sampled segments


class TurnRow:
    """A prompt and its segments; the completion is the segments' ids in order."""

    def __init__(self, prompt_ids: Sequence[int]):
        self.prompt_ids = [int(i) for i in prompt_ids]
        self.segments: list[Segment] = []

    def add_sampled(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"a sampled segment needs one behaviour log-prob per token: {len(ids)} ids, "
                             f"{len(logprobs)} log-probs")
        if not np.all(np.isfinite(np.asarray(logprobs, np.float64))):
            raise ValueError("a sampled segment's behaviour log-probs must be finite (NaN marks observed tokens)")
        self.segments.append(Segment(tuple(int(i) for i in ids), True, tuple(float(x) for x in logprobs)))

    def add_observed(self, ids: Sequence[int]) -> None:
        self.segments.append(Segment(tuple(int(i) for i in ids), False))

    def completion_ids(self) -> list[int]:
        return [i for s in self.segments for i in s.ids]

    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids()

    def sampled_mask(self) -> np.ndarray:
        """int32 [completion length]: 1 on sampled tokens (trained), 0 on observed ones."""
        return np.concatenate([np.full(len(s.ids), int(s.sampled), np.int32) for s in self.segments]
                              or [np.zeros(0, np.int32)])

    def behaviour_logprobs(self) -> np.ndarray:
        """float32 [completion length]: the behaviour log-probs on sampled tokens, NaN on observed ones."""
        return np.concatenate([np.asarray(s.logprobs if s.sampled else [np.nan] * len(s.ids), np.float32)
                               for s in self.segments] or [np.zeros(0, np.float32)])

    def num_turns(self) -> int:
        return sum(s.sampled for s in self.segments)

    def check_consumed(self, consumed_ids: Sequence[int]) -> None:
        """Fails loudly unless the ids the sampler consumed are exactly the prompt and the segments."""
        want, got = self.ids(), [int(i) for i in consumed_ids]
        if got != want:
            at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise RuntimeError(f"the sampler consumed ids that are not the row's segments (first difference at "
                               f"position {at} of {len(want)}: got {got[at:at + 8]}, want {want[at:at + 8]}): "
                               "a row's history must never be re-rendered or re-tokenised")


def clip_output(text: str, tokenizer: Any, max_tokens: int) -> tuple[str, bool]:
    """The tool's output with its middle cut to `max_tokens` tokens (head and tail kept) -> (text, clipped)."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if max_tokens <= 0 or len(ids) <= max_tokens:
        return text, False
    head, tail = ids[:max_tokens // 2], ids[len(ids) - (max_tokens - max_tokens // 2):]
    cut = len(ids) - len(head) - len(tail)
    return f"{tokenizer.decode(head)}\n[... {cut} tokens cut ...]\n{tokenizer.decode(tail)}", True


def _first_difference(a: str, b: str) -> str:
    at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"at character {at}: {a[at:at + 40]!r} becomes {b[at:at + 40]!r}"


class ToolTurns:
    """Observed ids for a tool's output, for one tokenizer (a transformers tokenizer) and one way of rendering."""

    def __init__(self, hf_tokenizer: Any, rendering: str = "template", tool_role: str = "tool",
                 template_kwargs: dict | None = None):
        if rendering not in ("template", "plain"):
            raise ValueError(f"tool output rendering must be 'template' or 'plain', got {rendering!r}")
        if rendering == "template" and not getattr(hf_tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template to render tool turns with: use the ```python "
                             "call format, whose output goes back in the plain ```output wrapper")
        self.hf, self.rendering, self.tool_role = hf_tokenizer, rendering, tool_role
        self.template_kwargs = dict(template_kwargs or {})
        self._closing: str | None = None

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           **self.template_kwargs)

    def turn_closing(self) -> str:
        """The text the template writes after an assistant message's content (e.g. '<|im_end|>\\n')."""
        if self._closing is None:
            text = self._render([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": _PROBE}],
                                False)
            self._closing = text[text.rfind(_PROBE) + len(_PROBE):]
        return self._closing

    def tool_turn_text(self, messages: list[dict], tool_output: str) -> str:
        """The template's text for the tool message and the next assistant header, after `messages` (which end with
        the assistant turn that made the call)."""
        tool = {"role": self.tool_role, "content": tool_output}
        before, after = self._render(messages, False), self._render(messages + [tool], True)
        if after.startswith(before):
            return after[len(before):]
        # Some templates format the last assistant turn apart (Qwen3 keeps an empty <think> block only there): then
        # the earlier turns must stay as they were, and the model's turn is read through neutral text to its end.
        probe = [dict(m, content=_PROBE) if m["role"] == "assistant" else m for m in messages]
        start, probed = self._render(probe[:-1], True), self._render(probe + [tool], True)
        end = probed.find(_PROBE + self.turn_closing(), len(start))
        if probed.startswith(start) and end >= 0:
            return probed[end + len(_PROBE + self.turn_closing()):]
        raise ValueError("the chat template rewrites the earlier turns when a tool turn is added ("
                         f"{_first_difference(before, after)}), so a tool's output cannot be tokenised by appending: "
                         "use a template that only appends, or the ```python call format (plain output wrapper)")

    def observation_text(self, messages: list[dict], tool_output: str, end_emitted: str = "") -> str:
        """end_emitted: the text of the end-of-turn token the model's sampled ids end with (it stopped there), or
        "" where it paused at its call's end: the template's closing of the turn is then observed."""
        if self.rendering == "plain":
            return PLAIN_WRAPPER.format(output=tool_output.rstrip("\n"))
        closing = self.turn_closing()
        if not closing.startswith(end_emitted):
            raise ValueError(f"the template closes an assistant turn with {closing!r}, which does not start with the "
                             f"end-of-turn token the model emitted ({end_emitted!r})")
        return closing[len(end_emitted):] + self.tool_turn_text(messages, tool_output)

    def observation_ids(self, messages: list[dict], tool_output: str, end_emitted: str = "") -> list[int]:
        return list(self.hf.encode(self.observation_text(messages, tool_output, end_emitted),
                                   add_special_tokens=False))
