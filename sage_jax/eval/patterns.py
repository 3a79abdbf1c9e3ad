"""Reasoning-pattern tags for completions, from transparent keyword / regex rules.

The rules are deliberately simple and inspectable: a completion gets a tag when any of that tag's patterns matches
(case-insensitive). They measure which styles of reasoning a run writes out, not whether the reasoning is sound.

The command that compares two runs is `python -m sage_jax.patterns` (sage_jax/patterns.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Mapping

# tag -> (what it means, patterns). A pattern is a regex searched case-insensitively anywhere in the text.
RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "contradiction": (
        "proof by contradiction: assumes something and derives a contradiction or absurdity",
        (r"\bcontradict(?:s|ion|ions|ory|ed|ing)?\b",
         r"\bassume,? (?:to the contrary|for (?:the sake of )?contradiction|otherwise)\b",
         r"\bsuppose,? (?:to the contrary|for (?:the sake of )?contradiction)\b",
         r"\bwhich is (?:absurd|impossible)\b"),
    ),
    "case_analysis": (
        "case analysis: splits the problem into explicit cases",
        (r"\bcase\s*(?:\d+|[ivx]+|[a-d])\s*[:.)]",
         r"\b(?:first|second|third|other|each|both|this|that|latter|former) cases?\b",
         r"\b(?:two|three|four|several|\d+) cases\b",
         r"\bconsider(?:ing)? (?:the |all |separate )?cases\b",
         r"\bif \S+ is (?:even|odd|positive|negative|a knight|a knave)\b.{0,300}?\b(?:if|otherwise)\b"),
    ),
    "equation_setup": (
        "constraint / equation setup: names unknowns and writes equations or a system to solve",
        (r"\blet\s+\$?\\?[a-z](?:_\{?\w+\}?)?\$?\s+(?:be|denote|represent|equal)\b",
         r"\bset(?:ting)? up (?:an |the |a |a system of )?equations?\b",
         r"\bsystem of (?:linear )?equations\b",
         r"\bsolv(?:e|ing) (?:for|the equation|this equation|the system)\b",
         r"\bsubstitut(?:e|ing|ion)\b",
         r"\\begin\{cases\}"),
    ),
    "direct_computation": (
        "direct computation: evaluates arithmetic step by step",
        (r"\b(?:compute|computing|calculate|calculating|evaluate|evaluating|simplify|simplifying)\b",
         r"\d\s*(?:[-+*/×]|\\times|\\cdot)\s*\d+(?:\.\d+)?\s*=\s*-?\d",
         r"\bplug(?:ging)? (?:in|this|these|it)\b"),
    ),
    "enumeration": (
        "enumeration / trial: lists candidates or tries values one by one",
        (r"\b(?:list|listing|enumerate|enumerating) (?:all|the|every|each|possible)\b",
         r"\b(?:try|trying|tried|test|testing|check|checking) (?:all|each|every|small|some|the possible|possible|"
         r"different) (?:values|cases|numbers|options|possibilities|candidates)?",
         r"\b(?:let's|let us|we) try\b",
         r"\bby (?:trial|inspection|brute force)\b|\btrial and error\b",
         r"\bpossibilities\b",
         r"\b[a-z]\s*=\s*[0-9]+\s*,\s*[a-z]?\s*=?\s*[0-9]+\s*,\s*[a-z]?\s*=?\s*[0-9]+\s*,"),
    ),
    "working_backwards": (
        "working backwards: reasons from the goal or answer back to the givens",
        (r"\bwork(?:ing|ed)? backwards?\b",
         r"\bbackwards? from\b",
         r"\bstart(?:ing)? (?:from|with|at) the (?:end|answer|result|goal|target|final)\b",
         r"\bin reverse\b|\breverse the (?:process|steps|operations)\b",
         r"\bto (?:get|reach|obtain|end up with|make) .{0,60}?,? we (?:need|must|would need)\b"),
    ),
}

TAGS = tuple(RULES)
_COMPILED = {tag: [re.compile(p, re.IGNORECASE | re.DOTALL) for p in patterns]
             for tag, (_, patterns) in RULES.items()}


def tag(text: str) -> set[str]:
    """Tags whose rules match the text."""
    return {name for name, patterns in _COMPILED.items() if any(p.search(text) for p in patterns)}


def frequencies(texts: Iterable[str]) -> dict[str, float]:
    """Fraction of texts carrying each tag (every tag listed, 0.0 when absent); an empty input gives all zeros."""
    counts = dict.fromkeys(TAGS, 0)
    total = 0
    for text in texts:
        total += 1
        for name in tag(text):
            counts[name] += 1
    return {name: counts[name] / total if total else 0.0 for name in TAGS}


def load_texts(path: str | Path, only_correct: bool = False) -> list[str]:
    """Completions from an evaluation samples.jsonl (fields completions, rewards) or any JSONL with a
    completion / text field per line."""
    texts, rows = [], 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            rows += 1
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}); fix or delete "
                                 "this line") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
            if "completions" in row:
                rewards = row.get("rewards") or [1.0] * len(row["completions"])
                texts += [t for t, r in zip(row["completions"], rewards) if not only_correct or r >= 1.0]
            elif "completion" in row or "text" in row:
                if not only_correct or row.get("reward", 1.0) >= 1.0:
                    texts.append(row.get("completion", row.get("text")))
            else:
                raise ValueError(f"{path}:{lineno}: no 'completions', 'completion' or 'text' field")
    if not texts:  # frequencies of nothing would print as a table of zeros
        raise ValueError(f"{path}: none of its {rows} rows' completions has reward 1 (--only-correct): nothing to "
                         "count" if only_correct and rows else f"{path}: no completions in it (an empty file?); pass "
                         "a samples.jsonl with completions")
    return texts


def _run_name(path: Path) -> str:
    return path.parent.name if path.stem == "samples" and path.parent.name else path.stem


def comparison_table(freqs: Mapping[str, Mapping[str, float]], counts: Mapping[str, int] | None = None) -> str:
    names = list(freqs)
    header = [f"{n} (n={counts[n]})" if counts else n for n in names]
    lines = ["| pattern | " + " | ".join(header) + (" | Δ (2nd - 1st) |" if len(names) == 2 else " |"),
             "|---|" + "---:|" * (len(names) + (len(names) == 2))]
    for name in TAGS:
        cells = [f"{freqs[n][name]:.3f}" for n in names]
        if len(names) == 2:
            cells.append(f"{freqs[names[1]][name] - freqs[names[0]][name]:+.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def compare(run_a_jsonl: str | Path, run_b_jsonl: str | Path, only_correct: bool = False) -> str:
    """Markdown table of tag frequencies of two runs side by side, with their difference."""
    paths = [Path(run_a_jsonl), Path(run_b_jsonl)]
    names = [_run_name(p) for p in paths]
    if names[0] == names[1]:
        names = [str(p) for p in paths]
    if names[0] == names[1]:
        names = [f"{names[0]} [A]", f"{names[1]} [B]"]
    texts = {name: load_texts(p, only_correct) for name, p in zip(names, paths)}
    return comparison_table({n: frequencies(t) for n, t in texts.items()}, {n: len(t) for n, t in texts.items()})
