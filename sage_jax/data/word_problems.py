"""Generated arithmetic: one- and two-step word problems (small whole numbers, + - x; "arith_words"), a task a 135M
instruct model partly solves before RL, so that GRPO has signal on a CPU; and two-digit products ("products", "37*48="),
which a small model trained from scratch cannot work out in its head but can with a Python tool, with the SFT
demonstrations that teach the tool's call (tool_demonstrations). Deterministic in the seed; answers are integers."""

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


def products(num: int, seed: int, exclude: set[str] | None = None, low: int = 10, high: int = 99) -> list[Example]:
    """`num` distinct products "A*B=" with A and B in [low, high] (none whose text is in `exclude`), ids
    'products{seed}_{i}'; meta["expression"] is "A*B"."""
    if num > (high - low + 1) ** 2 - len(exclude or ()):
        raise ValueError(f"only {(high - low + 1) ** 2} products of two numbers in [{low}, {high}] exist; asked for "
                         f"{num} beyond the {len(exclude or ())} excluded: lower data.num_train / data.num_eval")
    rng, seen, out = random.Random(seed), set(exclude or ()), []
    while len(out) < num:
        a, b = rng.randint(low, high), rng.randint(low, high)
        problem = f"{a}*{b}="
        if problem in seen:
            continue
        seen.add(problem)
        out.append(Example(problem, str(a * b), {"id": f"products{seed}_{len(out)}", "dataset": "products",
                                                 "expression": f"{a}*{b}"}))
    return out


def tool_demonstration(ex: Example, use_tool: bool) -> str:
    """A product's SFT completion: the answer alone, or a ```python block that prints it, the block's output as the
    tool loop observes it (the plain wrapper on a line of its own, then a newline), and the answer."""
    if not use_tool:
        return ex.answer
    from sage_jax.data.segments import PLAIN_WRAPPER
    call = f"```python\nprint({ex.meta['expression']})\n```"
    return f"{call}\n{PLAIN_WRAPPER.format(output=ex.answer)}\n{ex.answer}"


def tool_demonstrations(examples, share: float, seed: int) -> list[tuple[str, str]]:
    """(problem, completion) for each example: a share of them (drawn with `seed`) call the tool, the rest answer."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"sft.tool_share={share}: a share in [0, 1]")
    rng = random.Random(seed)
    return [(ex.problem, tool_demonstration(ex, rng.random() < share)) for ex in examples]
