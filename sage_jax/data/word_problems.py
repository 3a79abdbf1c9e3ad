"""Generated one- and two-step arithmetic word problems (small whole numbers, + - x): a task a 135M instruct
model partly solves before RL, so that GRPO has signal on a CPU. Deterministic in the seed; answers are integers."""

from __future__ import annotations

import random

from sage_jax.data.loaders import Example

_NAMES = ("Tom", "Mia", "Sam", "Lena", "Omar", "Ana", "Ben", "Zoe", "Ravi", "Kim", "Leo", "Ivy")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "coins", "cards", "shells", "balloons")


def _one(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.choice(("add", "sub", "mul", "add_sub"))
    a, b = rng.randint(2, 20), rng.randint(2, 12)
    if kind == "add":
        return f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?", a + b
    if kind == "sub":
        a += b
        return f"{name} had {a} {item} and gave {b} of them to a friend. How many {item} does {name} have left?", a - b
    if kind == "mul":
        a = rng.randint(2, 9)
        return f"{name} has {a} boxes with {b} {item} in each box. How many {item} does {name} have in total?", a * b
    c = rng.randint(1, a + b - 1)
    return (f"{name} has {a} {item}, buys {b} more, and then gives away {c}. How many {item} does {name} have now?",
            a + b - c)


def generate(num: int, seed: int, exclude: set[str] | None = None) -> list[Example]:
    """`num` distinct problems (none whose text is in `exclude`), ids 'words{seed}_{i}'."""
    rng, seen, out = random.Random(seed), set(exclude or ()), []
    while len(out) < num:
        problem, answer = _one(rng)
        if problem in seen:
            continue
        seen.add(problem)
        out.append(Example(problem, str(answer), {"id": f"words{seed}_{len(out)}", "dataset": "arith_words"}))
    return out
