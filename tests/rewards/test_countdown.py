import itertools
import random
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from sage_jax.rewards import countdown as cd


def brute_force_solutions(numbers, target):
    """Independent enumeration: every permutation, every tree shape, every operator; full parentheses."""

    def trees(items):
        if len(items) == 1:
            yield Fraction(items[0]), str(items[0])
            return
        for split in range(1, len(items)):
            for lv, ls in trees(items[:split]):
                for rv, rs in trees(items[split:]):
                    yield lv + rv, f"({ls}+{rs})"
                    yield lv - rv, f"({ls}-{rs})"
                    yield lv * rv, f"({ls}*{rs})"
                    if rv != 0:
                        yield lv / rv, f"({ls}/{rs})"

    found = set()
    for perm in set(itertools.permutations(numbers)):
        for v, expr in trees(list(perm)):
            if v == target:
                found.add(cd.canonical(expr))
    return found


@pytest.mark.parametrize("numbers,target", [([3, 4, 2], 10), ([2, 2, 4], 8), ([1, 5, 6], 1), ([3, 3, 8, 8], 24),
                                            ([2, 3, 4, 6], 24), ([1, 2, 7, 9], 10)])
def test_solver_finds_exactly_the_brute_force_solutions(numbers, target):
    solutions = cd.solve(numbers, target)
    assert set(solutions) == brute_force_solutions(numbers, target)
    assert len(solutions) == len(set(solutions))
    for s in solutions:
        assert cd.score(f"{s}={target}", {"numbers": numbers, "target": target}) == 1.0
        assert cd.canonical(s) == s  # canonical form is a fixed point


def test_solver_random_problems_match_brute_force():
    rng = random.Random(3)
    for _ in range(15):
        numbers = [rng.randint(1, 12) for _ in range(3)]
        target = rng.randint(1, 40)
        assert set(cd.solve(numbers, target)) == brute_force_solutions(numbers, target)


def test_canonical_dedupes_commutative_and_associative_variants():
    assert cd.canonical("2+3") == cd.canonical("3+2")
    assert cd.canonical("(1+2)+3") == cd.canonical("1+(2+3)") == cd.canonical("3+2+1")
    assert cd.canonical("4*3-2") == cd.canonical("3*4-2") == "4*3-2"
    assert cd.canonical("4*3-2") == cd.canonical("(3*4)-2")
    assert cd.canonical("4-(2-3)") == cd.canonical("4+3-2")
    assert cd.canonical("8/(4/2)") == cd.canonical("8*2/4")
    assert cd.canonical("(4-2)*3") != cd.canonical("4-2*3")
    assert cd.canonical("6/2/3") == cd.canonical("6/(2*3)")
    assert cd.solve([3, 4, 2], 10) == sorted(["4*3-2", "3*2+4"])


@pytest.mark.parametrize("text", ["", "3+", "3++4", "(3+4", "3+4)", "-3+4", "3**4", "3^4", "1.5*2", "3 4", "()",
                                  "03+4", "abc", "3+4=7"])
def test_canonical_rejects_malformed(text):
    assert cd.canonical(text) is None


def test_strategy_classes():
    assert cd.strategy("3+4+2") == "add"
    assert cd.strategy("3*2+4") == "add"
    assert cd.strategy("4*3-2") == "sub"
    assert cd.strategy("(4+3)*2") == "mul"
    assert cd.strategy("8/(3-8/3)") == "div"
    assert cd.strategy("4*3-2", scheme="ops") == "mixed"
    assert cd.strategy("4+3-2", scheme="ops") == "sub"
    assert cd.strategy("4*3*2", scheme="ops") == "mul"
    assert cd.strategy("4*3/2", scheme="ops") == "div"
    with pytest.raises(ValueError):
        cd.strategy("3+")


GOLD = {"numbers": [3, 4, 2], "target": 10}


@pytest.mark.parametrize("completion", ["4*3-2=10", "3*4-2", " (3*4) - 2 = 10 ", "2*3+4=10",
                                        "<answer>4*3-2=10</answer>", "let me think\n4*3-2=10",
                                        "<think>12-2</think> <answer> 3*4-2 </answer>", "4*3-2=10\n"])
def test_score_accepts_valid(completion):
    assert cd.score(completion, GOLD) == 1.0


@pytest.mark.parametrize("completion", [
    "4*3=12",                     # a number unused
    "4*3-2-2+2=10",               # a number used twice / extra number
    "5*2=10",                     # numbers not given
    "4*3-2=11",                   # wrong claimed result
    "4*3+2=14",                   # wrong value
    "4*(3-3)+2",                  # repeated number
    "4*3-2=10 and more",          # trailing text
    "__import__('os').system('echo hi')",
    "4**3-2",                     # no power operator
    "9**9**9**9",
    "1e3",
    "4*3-2.0=10",
    "-2+4*3",                     # no unary minus
    "2/(4-4)*3+10",               # division by zero
    "(" * 500 + "4*3-2" + ")" * 500,
    "4" * 10_000,
    "",
    "<answer></answer>",
])
def test_score_rejects_invalid(completion):
    assert cd.score(completion, GOLD) == 0.0


def test_score_rejects_non_integer_and_deep_parentheses():
    assert cd.score("8/(3-8/3)=24", {"numbers": [8, 3, 8, 3], "target": 24}) == 1.0
    assert cd.score("3/2+4=5", {"numbers": [3, 2, 4], "target": 5}) == 0.0  # 5.5
    deep = "(" * (cd.MAX_DEPTH + 1) + "3" + ")" * (cd.MAX_DEPTH + 1) + "+4"
    assert cd.score(deep, {"numbers": [3, 4], "target": 7}) == 0.0
    assert cd.score("1000*1000*1000=1000000000", {"numbers": [1000] * 3, "target": 10**9}) == 0.0  # claim too long
    assert cd.score(None, GOLD) == 0.0
    # the canonical form would hide this division by zero (a/(b/0) -> a*0/b); scoring evaluates the text as written
    trap = {"numbers": [6, 2, 3, 3, 7], "target": 7}
    assert cd.canonical("6/(2/(3-3))+7") == cd.canonical("6*(3-3)/2+7")
    assert cd.score("6/(2/(3-3))+7=7", trap) == 0.0 and cd.score("6*(3-3)/2+7=7", trap) == 1.0


def test_tokenizer_round_trip():
    tok = cd.CountdownTokenizer()
    assert tok.vocab_size < 64
    problem = {"numbers": [12, 3, 7], "target": 29}
    text = cd.prompt(problem)
    assert text == "12 3 7>29:"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == text
    completion = tok.encode("12*3-7=29", add_bos=False, add_eos=True)
    assert completion[-1] == tok.eos_token_id
    assert tok.decode(completion + [tok.pad_token_id] * 3 + tok.encode("99", add_bos=False)) == "12*3-7=29"
    assert tok.batch_decode([ids, completion]) == [text, "12*3-7=29"]
    with pytest.raises(ValueError, match="vocabulary"):
        tok.encode("x")


def test_generate_problems_properties():
    problems = cd.generate_problems(100, seed=0)
    assert problems == cd.generate_problems(100, seed=0)
    assert len({cd.problem_key(p) for p in problems}) == 100
    for p in problems:
        assert len(p["numbers"]) == 3 and all(1 <= x <= 15 for x in p["numbers"])
        assert len(cd.solve(p["numbers"], p["target"])) >= 2
    test = cd.generate_problems(50, seed=1, exclude=problems)
    assert not {cd.problem_key(p) for p in problems} & {cd.problem_key(p) for p in test}
    hard = cd.generate_problems(5, seed=2, num_numbers=4, high=9)
    assert all(len(p["numbers"]) == 4 and len(cd.solve(p["numbers"], p["target"])) >= 2 for p in hard)
    with pytest.raises(ValueError, match="widen"):
        cd.generate_problems(10_000, seed=0, high=9)


def test_generate_problems_min_strategies():
    problems = cd.generate_problems(40, seed=0, min_strategies=3)
    for p in problems:
        assert len({cd.strategy(s) for s in cd.solve(p["numbers"], p["target"])}) >= 3


def test_demonstrations_follow_uneven_mode_weights():
    weights = {"mul": 0.6, "add": 0.25, "sub": 0.1, "div": 0.05}
    problems = cd.generate_problems(1000, seed=5, min_strategies=2)
    available = [{cd.strategy(s) for s in cd.solve(p["numbers"], p["target"])} for p in problems]
    demos = cd.demonstrations(problems, random.Random(0), weights)
    assert len(demos) == len(problems)
    shares = Counter(d["strategy"] for d in demos)
    for name, w in weights.items():
        # each problem picks among the strategies it has, so the expected share is a per-problem renormalisation
        expected = np.mean([w / sum(weights[s] for s in avail) if name in avail else 0.0 for avail in available])
        assert abs(shares[name] / len(demos) - expected) < 0.04, (name, shares, expected)
    assert shares.most_common(1)[0][0] == "mul"
    for d, p in zip(demos, problems):
        assert cd.score(d["completion"], p) == 1.0
        assert cd.strategy(d["completion"].split("=")[0]) == d["strategy"]
        assert d["prompt"] == cd.prompt(p)
    measured = cd.strategy_shares([d["completion"] for d in demos], problems)
    assert measured == pytest.approx({k: v / len(demos) for k, v in shares.items()})


def test_demonstrations_two_modes_exact_shares():
    problems = [p for p in cd.generate_problems(1000, seed=5)
                if {"mul", "add"} <= {cd.strategy(s) for s in cd.solve(p["numbers"], p["target"])}]
    assert len(problems) > 100
    demos = cd.demonstrations(problems, random.Random(1), {"mul": 0.8, "add": 0.2})
    share = sum(d["strategy"] == "mul" for d in demos) / len(demos)
    assert abs(share - 0.8) < 0.08


def test_demonstrations_skip_zero_weight_and_accept_numpy_rng():
    problems = cd.generate_problems(60, seed=7)
    demos = cd.demonstrations(problems, np.random.default_rng(0), {"div": 1.0})
    assert demos and all(d["strategy"] == "div" for d in demos)
    assert len(demos) == sum("div" in {cd.strategy(s) for s in cd.solve(p["numbers"], p["target"])}
                             for p in problems)
    assert cd.demonstrations(problems, 1) == cd.demonstrations(problems, 1)
