"""Countdown data: problem generation, prompt and completion text, the character tokenizer and SFT demonstrations
drawn with uneven strategy weights (the dominant/rare modes of the mode-collapse experiment).
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any, Iterable, Mapping, Sequence

from sage_jax.rewards.countdown_expr import Node, expressions, render, solution_nodes, strategy

# ----------------------------------------------------------------------------------------------- problems


def problem_key(problem: Mapping[str, Any]) -> tuple:
    return tuple(sorted(problem["numbers"])), int(problem["target"])


def _eligible_targets(numbers: tuple[int, ...], target_range: tuple[int, int], min_solutions: int,
                      min_strategies: int) -> list[int]:
    by_target: dict[int, list[Node]] = {}
    for node, v in expressions(numbers).items():
        if v.denominator == 1 and target_range[0] <= v <= target_range[1]:
            by_target.setdefault(int(v), []).append(node)
    return sorted(t for t, nodes in by_target.items()
                  if len(nodes) >= min_solutions and len({strategy(x) for x in nodes}) >= min_strategies)


def generate_problems(
    n: int,
    seed: int,
    num_numbers: int = 3,
    low: int = 1,
    high: int = 15,
    target_range: tuple[int, int] = (1, 99),
    min_solutions: int = 2,
    min_strategies: int = 1,
    exclude: Iterable[Mapping[str, Any]] = (),
    max_enumerate: int = 2000,
) -> list[dict[str, Any]]:
    """`n` distinct problems {"numbers": [...], "target": int}, each with >= `min_solutions` distinct solutions
    spanning >= `min_strategies` top-level strategies.

    Problems in `exclude` (e.g. the train split when building a test split) are never returned. With 3 numbers and at
    most `max_enumerate` number multisets, every eligible (numbers, target) pair is listed and `n` are drawn without
    replacement; those pools are small (3 numbers, targets 1..99: 465 problems for 1..9, 1259 for 1..15, 2146 for
    1..20). Otherwise the numbers are drawn uniformly from [low, high] and the target uniformly among the eligible
    ones; every draw enumerates all expressions of its numbers, which is what makes 4-number problems costly.
    """
    if n < 0 or num_numbers < 2 or low > high or low < 0:
        raise ValueError(f"bad countdown settings n={n} num_numbers={num_numbers} range=[{low},{high}]")
    rng = random.Random(seed)
    seen = {problem_key(p) for p in exclude}
    settings = (target_range, min_solutions, min_strategies)
    problems: list[dict[str, Any]] = []
    if num_numbers <= 3 and math.comb(high - low + num_numbers, num_numbers) <= max_enumerate:
        pool = [(nums, t)
                for nums in itertools.combinations_with_replacement(range(low, high + 1), num_numbers)
                for t in _eligible_targets(nums, *settings) if (nums, t) not in seen]
        if len(pool) < n:
            raise ValueError(f"only {len(pool)} countdown problems exist with {num_numbers} numbers in [{low},{high}],"
                             f" targets {target_range}, >= {min_solutions} solutions, >= {min_strategies} strategies"
                             f" (after exclusions); asked for"
                             f" {n}: widen the number range or lower n")
        chosen = rng.sample(pool, n)
    else:
        chosen, failures = [], 0
        while len(chosen) < n:
            nums = tuple(sorted(rng.randint(low, high) for _ in range(num_numbers)))
            targets = [t for t in _eligible_targets(nums, *settings) if (nums, t) not in seen]
            if not targets:
                failures += 1
                if failures > 5000:
                    raise ValueError(f"found only {len(chosen)} of {n} countdown problems ({num_numbers} numbers in"
                                     f" [{low},{high}], targets {target_range}): widen the ranges or lower n")
                continue
            failures = 0
            chosen.append((nums, rng.choice(targets)))
            seen.add(chosen[-1])
    for nums, target in chosen:
        shuffled = list(nums)
        rng.shuffle(shuffled)
        problems.append({"numbers": shuffled, "target": int(target)})
    return problems


def prompt(problem: Mapping[str, Any]) -> str:
    return " ".join(str(x) for x in problem["numbers"]) + f">{int(problem['target'])}:"


def completion_text(expr: str, target: int) -> str:
    return f"{expr}={int(target)}"


# ----------------------------------------------------------------------------------------------- tokenizer


class CountdownTokenizer:
    """Character-level tokenizer for the countdown prompts and completions (no HF tokenizer needed).

    encode() prepends <bos> by default (prompts) and appends <eos> on request (SFT completions); decode() drops special
    tokens and stops at the first <eos>.
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = "0123456789+-*/()=>: "

    def __init__(self):
        self.itos = list(self.SPECIALS) + list(self.CHARS)
        self.stoi = {ch: i for i, ch in enumerate(self.itos)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        try:
            ids = [self.stoi[ch] for ch in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the countdown vocabulary {self.CHARS!r}") from None
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if skip_special_tokens:
                if i == self.eos_id:
                    break
                if i < len(self.SPECIALS):
                    continue
            out.append(self.itos[i] if 0 <= i < len(self.itos) else "")
        return "".join(out)

    def batch_decode(self, batch: Iterable[Iterable[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]


# ----------------------------------------------------------------------------------------------- SFT data


DEFAULT_MODE_WEIGHTS = {"mul": 0.7, "add": 0.2, "sub": 0.07, "div": 0.03}


def _weighted_index(rng: Any, weights: Sequence[float]) -> int:
    if isinstance(rng, random.Random):
        return rng.choices(range(len(weights)), weights=weights)[0]
    total = float(sum(weights))
    return int(rng.choice(len(weights), p=[w / total for w in weights]))  # numpy Generator


def demonstrations(
    problems: Sequence[Mapping[str, Any]],
    rng: Any,
    mode_weights: Mapping[str, float] | None = None,
    scheme: str = "top",
) -> list[dict[str, Any]]:
    """One SFT demonstration per problem; its strategy is drawn ∝ mode_weights among those the problem has.

    rng: random.Random, numpy Generator or int seed. Problems none of whose strategies has positive weight are skipped.
    Returns dicts with prompt, completion ("EXPR=TARGET", no <eos>), strategy, numbers, target.
    """
    weights = dict(DEFAULT_MODE_WEIGHTS if mode_weights is None else mode_weights)
    if isinstance(rng, int):
        rng = random.Random(rng)
    demos = []
    for problem in problems:
        target = int(problem["target"])
        by_strategy: dict[str, list[str]] = {}
        for node in solution_nodes(problem["numbers"], target):
            by_strategy.setdefault(strategy(node, scheme), []).append(render(node))
        names = [s for s in sorted(by_strategy) if weights.get(s, 0.0) > 0]
        if not names:
            continue
        name = names[_weighted_index(rng, [weights[s] for s in names])]
        options = by_strategy[name]
        expr = options[_weighted_index(rng, [1.0] * len(options))]
        demos.append({"prompt": prompt(problem), "completion": completion_text(expr, target), "strategy": name,
                                    "numbers": list(problem["numbers"]), "target": target})
    return demos
